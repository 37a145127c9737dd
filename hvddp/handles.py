"""Handles returned by the ``_async`` collectives."""

from __future__ import annotations

import numbers
import threading
import time
from typing import Any, Callable, List, Optional

__all__ = ["Handle", "poll", "synchronize"]

# How many times wait() has raised a group's failure on this rank. Each request carries the count
# at its making: rank 0 tells a call made before this rank's code met the failure (the rest of the
# failed attempt, such as gradients that hooks send one by one) from one made after it (a new
# call). Other errors do not count: a metrics thread's own mismatch must not turn a late member
# into a new call that waits for ever.
RAISED = [0]


class Handle:
    """The pending result of an asynchronous collective.

    A handle keeps its inputs and outputs alive until the engine is done with them. It completes
    on the engine thread; ``wait()`` raises on the caller's thread any error the engine hit.
    """

    __slots__ = ("name", "_done", "_gate", "_result", "_error", "_remaining", "_parts", "_keep",
                 "_finish")

    def __init__(self, name: str, parts: int = 1, keep: Any = None,
                 finish: Optional[Callable[[Any], Any]] = None, grouped: bool = False) -> None:
        self.name = name
        self._done = False
        # A lock held until completion: cheaper to make than an Event, and waiting on it sleeps.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._remaining = parts
        # a grouped call's result is a list, even of one element
        self._parts: Optional[List[Any]] = [None] * parts if parts > 1 or grouped else None
        self._keep = keep  # inputs (and framework tensors) the engine reads or writes
        self._finish = finish

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<hvddp.Handle {self.name!r} {state}>"

    def done(self) -> bool:
        """Return True once the collective has completed (or failed); never blocks."""
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the result.

        Args:
            timeout: seconds to wait at most; None waits for as long as it takes.

        Raises:
            TimeoutError: not done within ``timeout``.
            HvddpError: the collective failed (on every rank alike).
        """
        if not self._done:
            if timeout is not None:  # (Lock.acquire refuses more than TIMEOUT_MAX, math.inf say)
                if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
                    raise ValueError(f"timeout must be a number of seconds or None; received "
                                     f"{type(timeout).__name__} {timeout!r}")
                timeout = min(max(float(timeout), 0.0), threading.TIMEOUT_MAX)
            if not self._gate.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s.")
            self._gate.release()  # let other waiters through
        if self._error is not None:
            if getattr(self._error, "group_failure", False):
                RAISED[0] += 1
            raise self._error
        return self._result

    # Engine side (one thread) --------------------------------------------------------------
    def _set_part(self, index: int, value: Any) -> None:
        if self._done:
            return
        if self._parts is not None:
            self._parts[index] = value
            self._remaining -= 1
            if self._remaining:
                return
            value = self._parts
        try:
            self._result = self._finish(value) if self._finish is not None else value
        except BaseException as exc:  # a failing finisher must not kill the engine
            self._error = exc
        self._release()

    def _fail(self, error: BaseException) -> None:
        if self._done:
            return
        self._error = error
        self._release()

    def _set_now(self, value: Any) -> None:
        """Complete at once on the calling thread (nothing to communicate)."""
        self._result = value
        self._release()

    def _release(self) -> None:
        self._keep = None
        self._parts = None
        self._done = True
        deferred = _deferred.list
        if deferred is not None:
            deferred.append(self._gate)
        else:
            self._gate.release()


class _Deferred(threading.local):
    list: Optional[list] = None


# While the engine executes a cycle it collects the gates of completed handles here and opens
# them all at the end: a waiting user thread then wakes once per cycle instead of once per tensor,
# and does not take the core (ranks are often pinned to one) from the engine mid-cycle.
_deferred = _Deferred()


def defer_wakeups() -> None:
    _deferred.list = []


def wake_deferred() -> None:
    gates, _deferred.list = _deferred.list, None
    for gate in gates or ():
        gate.release()


def poll(handle: Handle) -> bool:
    """Return True if the asynchronous operation behind ``handle`` has completed.

    Not done, it yields the interpreter lock for a moment: the engine is a Python thread, and a
    loop of ``while not poll(h): pass`` would otherwise starve it (50 allreduces of 100,000
    floats at 2 ranks took 1.84 s that way, 0.04 s once poll() yields).
    """
    _check(handle)
    if handle.done():
        return True
    time.sleep(0)
    return handle.done()


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result; raise the collective's error if it failed."""
    _check(handle)
    return handle.wait(timeout)


def _check(handle: Any) -> None:
    if not isinstance(handle, Handle):
        raise TypeError(f"expected an hvddp handle returned by an *_async call, got {type(handle).__name__}.")
