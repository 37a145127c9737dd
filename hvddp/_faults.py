"""Make one rank's failure end the whole job instead of leaving the others waiting.

``install()`` is called by ``hvddp.init()`` before its first collective. In a multi-process
world it replaces ``sys.excepthook``: an exception that escapes the main thread on any rank
prints that rank's traceback (rank-prefixed) and calls ``MPI_Abort`` on ``COMM_WORLD``, which
makes the launcher stop every rank at once. Without it, the failing rank would run its exit
handlers, other ranks could wait for it forever in a collective, and the job would hang. This is
what ``python -m mpi4py`` does; with ``install()`` a plain ``python train.py`` gets it too.

When the job runs under ``hvddprun``, each rank also leaves small status files in the directory
that ``hvddprun`` names in ``HVDDP_RUNNER_STATUS_DIR`` (rank, pid, host; the exception, if
any; a mark once it exited cleanly), so that ``hvddprun`` can say which rank failed even when
the MPI launcher only reports a pid, and can fail a job in which a rank vanished with exit code 0.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import traceback
from typing import Optional

__all__ = ["install", "installed", "STATUS_DIR_VARIABLE"]

# Private channel from hvddprun to its ranks (not a user setting, so not in config.py).
STATUS_DIR_VARIABLE = "HVDDP_RUNNER_STATUS_DIR"

_lock = threading.Lock()
_installed = False
_rank = -1
_size = 0
_status_dir: Optional[str] = None


def installed() -> bool:
    """Return True once ``install()`` has put the abort-on-exception hook in place."""
    return _installed


def install(world=None) -> bool:
    """Abort the whole job when an exception escapes the main thread of any rank.

    Call it on every rank before the first collective (``hvddp.init()`` does). A no-op in a
    size-1 world and on a second call.

    Args:
        world: the world communicator (``MPI.COMM_WORLD`` by default).

    Returns:
        True if the hook is installed (world size > 1), False otherwise.
    """
    global _installed, _rank, _size, _status_dir
    with _lock:
        if _installed:
            return True
        if world is None:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
        size = world.Get_size()
        if size <= 1:
            return False
        _rank, _size = world.Get_rank(), size
        previous = sys.excepthook

        def hook(etype, value, tb) -> None:
            _abort_on_exception(previous, etype, value, tb, world)

        sys.excepthook = hook
        _status_dir = os.environ.get(STATUS_DIR_VARIABLE) or None
        if _status_dir:
            _write_status("start", {"rank": _rank, "size": _size, "pid": os.getpid(),
                                    "host": socket.gethostname()})
            atexit.register(_write_status, "done", {"rank": _rank})
        _installed = True
        return True


def _abort_on_exception(previous, etype, value, tb, world) -> None:
    try:
        sys.stderr.write(
            f"[hvddp rank {_rank}] uncaught {etype.__name__} on rank {_rank} of {_size} "
            f"(pid {os.getpid()} on {socket.gethostname()}); aborting the job with MPI_Abort so "
            f"that the other ranks do not wait for it. Traceback of rank {_rank}:\n")
        previous(etype, value, tb)
        if _status_dir:
            _write_status("failed", {"rank": _rank, "error": f"{etype.__name__}: {value}",
                                     "traceback": "".join(traceback.format_exception(etype, value, tb))})
    except BaseException:  # reporting must never stop the abort
        pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        world.Abort(1)


def _write_status(kind: str, payload: dict) -> None:
    """Write ``rank-<r>.<kind>`` atomically into the status directory; never raise."""
    try:
        path = os.path.join(_status_dir, f"rank-{_rank}.{kind}")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
    except Exception:
        pass
