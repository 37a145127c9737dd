"""Errors raised by hvddp inside a framework's compiled step, kept to be re-raised as themselves.

JAX re-raises what an ``io_callback`` raised as its own ``JaxRuntimeError``, and TensorFlow what
a ``tf.numpy_function`` raised inside a graph as ``tf.errors.UnknownError``. The adapters note
each such error here; ``hvddp.keras`` then re-raises it from ``fit``/``evaluate``/``predict``
(and the ``*_on_batch`` calls), so that ``except hvd.HorovodInternalError`` catches a
``MismatchError`` or ``StallError`` on every backend and every rank alike.
"""

from __future__ import annotations

from typing import Optional

_count = 0
_last: Optional[BaseException] = None


def note(exc: BaseException) -> None:
    """Record ``exc``, raised inside a staged call (on whatever thread the framework runs it)."""
    global _count, _last
    _last = exc
    _count += 1


def mark() -> int:
    """A mark to pass to ``since``."""
    return _count


def since(mark_: int) -> Optional[BaseException]:
    """The last error noted after ``mark_`` was taken, or None."""
    return _last if _count != mark_ else None
