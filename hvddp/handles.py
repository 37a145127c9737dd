"""Handles returned by the ``_async`` collectives."""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional

from .exceptions import HvddpError

__all__ = ["Handle", "poll", "synchronize"]


class Handle:
    """The pending result of an asynchronous collective.

    A handle keeps its inputs and outputs alive until the engine is done with them. It completes
    on the engine thread; ``wait()`` raises on the caller's thread any error the engine hit.
    """

    __slots__ = ("name", "_event", "_result", "_error", "_remaining", "_parts", "_lock",
                 "_keep", "_finish")

    def __init__(self, name: str, parts: int = 1, keep: Any = None,
                 finish: Optional[Callable[[Any], Any]] = None) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._remaining = parts
        self._parts: List[Any] = [None] * parts
        self._lock = threading.Lock()
        self._keep = keep  # inputs (and framework tensors) the engine reads or writes
        self._finish = finish

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<hvddp.Handle {self.name!r} {state}>"

    def done(self) -> bool:
        """Return True once the collective has completed (or failed); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the result.

        Args:
            timeout: seconds to wait at most; None waits for as long as it takes.

        Raises:
            TimeoutError: not done within ``timeout``.
            HvddpError: the collective failed (on every rank alike).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s.")
        if self._error is not None:
            raise self._error
        return self._result

    # Engine side -------------------------------------------------------------------------
    def _set_part(self, index: int, value: Any) -> None:
        with self._lock:
            self._parts[index] = value
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            try:
                result = self._parts[0] if len(self._parts) == 1 else list(self._parts)
                self._result = self._finish(result) if self._finish is not None else result
            except BaseException as exc:  # a failing finisher must not kill the engine
                self._error = exc
            self._keep = None
            self._event.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._keep = None
        self._event.set()


def poll(handle: Handle) -> bool:
    """Return True if the asynchronous operation behind ``handle`` has completed."""
    _check(handle)
    return handle.done()


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result; raise the collective's error if it failed."""
    _check(handle)
    return handle.wait(timeout)


def _check(handle: Any) -> None:
    if not isinstance(handle, Handle):
        raise TypeError(f"expected an hvddp handle returned by an *_async call, got {type(handle).__name__}.")
