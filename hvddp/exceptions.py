"""The hvddp error hierarchy: every library failure is an ``HvddpError`` (a ``RuntimeError``)."""

from __future__ import annotations

__all__ = [
    "HvddpError",
    "NotInitializedError",
    "BackendUnavailableError",
    "MismatchError",
    "ShutdownError",
    "StallError",
    "LauncherMismatchError",
]


class HvddpError(RuntimeError):
    """Base class of every error raised by hvddp itself."""


class NotInitializedError(HvddpError, ValueError):
    """A function that needs ``hvddp.init()`` was called before it (or after ``shutdown()``).

    Also a ``ValueError``: Horovod raises that there, and ported scripts catch it.
    """


class BackendUnavailableError(HvddpError):
    """A backend (MPI, NCCL, CUDA) or an optional package is missing."""


class MismatchError(HvddpError):
    """Ranks submitted the same collective with different parameters; raised on every rank."""


# In a MismatchError's message when the ranks called different collectives under one name
KIND_MISMATCH = "was submitted as different collectives"
# ... and when some rank refused the call (its own checks raised there at once)
REFUSED = "was refused on"


class ShutdownError(HvddpError):
    """The engine stopped (``shutdown()`` on some rank) while this operation was pending."""


class StallError(HvddpError):
    """Some ranks never submitted a collective that others were waiting on."""


class LauncherMismatchError(HvddpError):
    """The launcher started N processes but MPI reports each of them as a size-1 world."""
