"""Checkpoints that survive a crash: written atomically by one rank, read by one and broadcast.

Framework-agnostic building blocks; ``hvddp.torch.checkpoint`` and ``hvddp.keras.checkpoint``
build model/optimizer/RNG checkpoints on them.

* ``atomic_write(path, data)`` (local, any process): writes a temporary file next to ``path``,
  flushes and fsyncs it, renames it over ``path`` and fsyncs the directory. A crash at any point
  leaves either the previous file or the new one, never a torn mix.
* ``save_bytes`` / ``load_bytes`` (collective): the root rank writes or reads, and every rank
  gets the same outcome: the same bytes, ``None`` when there is no checkpoint yet, or the same
  ``CheckpointError`` when the root could not write or read it.
* ``save`` / ``load`` (collective): the same for any picklable object (numpy arrays, dicts).
  ``load`` unpickles, so load only checkpoints you wrote yourself.

Example:
    state = hvddp.checkpoint.load("ckpt/state.pkl")          # None on a fresh start
    start = 0 if state is None else state["step"]
    for step in range(start, steps):
        ...
        if step % 100 == 0:
            hvddp.checkpoint.save({"step": step + 1, "w": w}, "ckpt/state.pkl")
"""

from __future__ import annotations

import glob
import hashlib
import operator
import os
import pickle
import socket
import time
import uuid
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Union

import numpy as np

from .exceptions import HvddpError, MismatchError
from .runtime import ProcessSet, global_process_set, rank as _global_rank

__all__ = ["CheckpointError", "atomic_write", "save_bytes", "load_bytes", "save", "load"]

Data = Union[bytes, bytearray, memoryview, Callable[[BinaryIO], None]]


class CheckpointError(HvddpError):
    """The root rank could not write or read a checkpoint; raised on every rank alike."""


# room left in a file name (255 bytes on Linux file systems) for ".tmp.<pid>.<12 hex>.<8 hex>"
_NAME_ROOM = 255 - len(".tmp.4194304.") - 12 - 9 - 1
# which host wrote a temporary file: a process id means something on its own host only
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
# a temporary file another host left is deleted once it is this old (its writer may still run)
FOREIGN_STALE_S = 24 * 3600


def _tmp_prefix(path: str) -> str:
    """The start of the temporary files' names for ``path``: ``.<name>.tmp.``, with ``<name>``
    shortened when the whole would not fit in a file name."""
    directory, name = os.path.split(os.path.abspath(path))
    raw = os.fsencode(name)
    if len(raw) > _NAME_ROOM:
        name = os.fsdecode(raw[:_NAME_ROOM])  # (a character cut in two keeps its bytes)
    return os.path.join(directory, f".{name}.tmp.")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Union[str, os.PathLike], data: Data) -> None:
    """Replace the file at ``path`` with ``data`` atomically; not collective.

    Args:
        path: the checkpoint file; its directory is created if missing.
        data: the bytes, or a function that writes them to the binary file object it is given
            (e.g. ``lambda f: torch.save(state, f)``) so large states need not exist twice.

    Raises:
        OSError: the file could not be written (``path`` is untouched then).
        TypeError: ``data`` is neither bytes-like nor callable.
    """
    path = file_path(path, "atomic_write")
    if os.path.islink(path):  # replace the file the link names, as writing through it would
        path = os.path.realpath(path)
    if not (callable(data) or isinstance(data, (bytes, bytearray, memoryview))):
        raise TypeError(f"atomic_write: data must be bytes or a function that writes to a file, "
                        f"got {type(data).__name__}.")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = _tmp_prefix(path)
    # one temporary file per writer (process, thread, call): concurrent writers of one path
    # must not write into, rename or delete each other's
    tmp = f"{prefix}{os.getpid()}.{uuid.uuid4().hex[:12]}.{_HOST}"
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    for stale in glob.glob(glob.escape(prefix) + "*"):  # left by writers that crashed
        if _writer_alive(stale, stale[len(prefix):]):
            continue  # another writer's file, still being written
        try:
            os.unlink(stale)
        except OSError:
            pass


def _writer_alive(stale: str, suffix: str) -> bool:
    """Whether the process that named a temporary file ``<pid>.<random>.<host>`` may still write it.

    On its own host, whether that process runs. A file from another host (a shared file system)
    counts as being written until it is ``FOREIGN_STALE_S`` old: that host's process ids mean
    nothing here (a save on one node deleted another node's file while it was being written).
    """
    parts = suffix.split(".")
    try:
        pid = int(parts[0])
    except ValueError:
        return False  # not one of ours (or an older naming): stale
    if len(parts) >= 3 and parts[2] != _HOST:
        try:
            return time.time() - os.path.getmtime(stale) < FOREIGN_STALE_S
        except OSError:
            return True  # gone already
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def file_path(path: Any, fn: str) -> str:
    """``path`` as a str, or an error naming ``fn``'s argument (TypeError; ValueError when empty)."""
    try:
        path = os.fsdecode(os.fspath(path))  # (bytes as str: the temporary name is built from it)
    except TypeError:
        raise TypeError(f"{fn}: path must be a file path (str, bytes or os.PathLike); Received: "
                        f"path={path!r} ({type(path).__name__}).") from None
    if not path:
        raise ValueError(f"{fn}: path must name a file; Received: path={path!r}.")
    return path


def counter(value: Any, fn: str, arg: str) -> int:
    """An ``epoch``/``step`` argument as a Python int (numpy integers too), or a TypeError: the
    file must load with the loaders' safe defaults, which refuse numpy scalars."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {arg} must be an int; Received: {arg}={value!r} "
                        f"({type(value).__name__}).") from None


def _members(process_set: ProcessSet) -> List[int]:
    from .runtime import size

    return list(process_set.ranks) if process_set.ranks is not None else list(range(size()))


def agree(fn: str, describe: Callable[[], Dict[str, Any]], process_set: ProcessSet = global_process_set,
          ) -> List[Dict[str, Any]]:
    """Check that every rank called ``fn`` with valid arguments, and the same ones, before the call
    does anything; collective (one allgather, so a bad argument on one rank cannot leave the
    others waiting in a later collective of the call; small, unless ranks pass their own data
    along: an Adasum optimizer's state reaches every rank through it).

    ``describe`` checks this rank's arguments (raising for a bad one) and returns a dict: entries
    whose key starts with ``_`` are this rank's own data passed along (its RNG states), the
    others must be equal on every rank.

    Returns:
        Every rank's description, in the set's rank order.

    Raises:
        On a rank whose arguments were bad, that error; on the others ``MismatchError`` naming the
        rank and its error. ``MismatchError`` on every rank when the ranks passed different values,
        naming the argument and each rank's value.
    """
    from .ops import allgather_object

    error: Optional[BaseException] = None
    try:
        mine: Any = ("ok", describe())
    except Exception as exc:  # announced below, then raised here
        error = exc
        mine = ("error", f"{type(exc).__name__}: {exc}")
    every = allgather_object(mine, name=f"__hvddp.checkpoint.{fn}.arguments", process_set=process_set)
    if error is not None:
        raise error
    members = _members(process_set)
    for member, (status, value) in zip(members, every):
        if status == "error":
            raise MismatchError(f"{fn}: rank {member} refused its arguments ({value}); every rank must call "
                                f"{fn} with valid arguments, so none of them went on.")
    descriptions = [value for _, value in every]
    for key in descriptions[0]:
        if key.startswith("_"):
            continue
        values = [d.get(key) for d in descriptions]
        if any(v != values[0] for v in values):
            each = ", ".join(f"rank {m}: {v!r}" for m, v in zip(members, values))
            raise MismatchError(f"{fn}: the ranks passed different {key} ({each}); every rank must call "
                                f"{fn} with the same arguments.")
    return descriptions


def all_succeeded(fn: str, path: Any, error: Optional[BaseException], done: str,
                  process_set: ProcessSet = global_process_set) -> None:
    """After a step each rank ran on its own objects (checking or loading them): raise on every
    rank when it failed on any; collective. ``error`` is this rank's (None when it succeeded) and
    is raised as it is here; the other ranks raise ``CheckpointError`` naming the failing rank.
    ``done`` says what the other ranks did meanwhile (e.g. "nothing was loaded")."""
    from .ops import allgather_object

    why = None if error is None else f"{type(error).__name__}: {error}"
    every = allgather_object(why, name=f"__hvddp.checkpoint.{fn}.outcome", process_set=process_set)
    if error is not None:
        raise error
    for member, failure in zip(_members(process_set), every):
        if failure is not None:
            raise CheckpointError(f"{fn}: checkpoint {path!r} failed on rank {member} ({failure}); {done}.")


def root_of(root_rank: Any, fn: str, process_set: ProcessSet) -> int:
    """The rank that reads or writes for ``fn``: ``root_rank`` (a global rank, a member of
    ``process_set``), or by default (None) the set's first member: rank 0 for the global set."""
    members = process_set.ranks if process_set.ranks is not None else [0]
    if root_rank is None:
        return members[0]
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"{fn}: root_rank must be an int, got {type(root_rank).__name__} {root_rank!r}.")
    if int(root_rank) not in members:
        raise ValueError(f"{fn}: root_rank is a global rank and must be one of {process_set!r}'s members "
                         f"{members}, got {root_rank}; leave it out for the set's first member.")
    return int(root_rank)


def _checked(fn: str, path: Any, root_rank: Any, process_set: ProcessSet) -> tuple:
    """(path, root rank) of a call every rank made with valid and equal arguments (``agree``)."""
    mine = {}

    def describe() -> Dict[str, Any]:
        mine["path"] = file_path(path, fn)
        return {"root_rank": root_of(root_rank, fn, process_set)}

    root = agree(fn, describe, process_set)[0]["root_rank"]
    return mine["path"], root


def save_bytes(data: Optional[Data], path: Union[str, os.PathLike], root_rank: Optional[int] = None,
               process_set: ProcessSet = global_process_set) -> None:
    """Write ``data`` to ``path`` from ``root_rank`` only, atomically; every rank calls it.

    Returns only after the file is on disk (fsynced and renamed), on every rank, so a rank that
    goes on after ``save_bytes`` can rely on the checkpoint. Other ranks' ``data`` is ignored
    (pass None).

    Raises:
        CheckpointError: on every rank, when the root could not write the file; the previous
            checkpoint at ``path`` is then intact.
    """
    _write("save_bytes", data, path, root_rank, process_set)


def _write(fn: str, data: Optional[Data], path: Any, root_rank: Any, process_set: ProcessSet) -> None:
    path, root_rank = _checked(fn, path, root_rank, process_set)
    write_agreed(fn, data, path, root_rank, process_set)


def write_agreed(fn: str, data: Optional[Data], path: str, root_rank: int, process_set: ProcessSet) -> None:
    """``save_bytes`` for a call whose arguments every rank has already agreed on (``agree``)."""
    from .ops import broadcast_object

    error = None
    if _global_rank() == root_rank:
        try:
            if data is None:
                raise TypeError(f"{fn}: the root rank must pass the data to write, got None.")
            atomic_write(path, data)
        except Exception as exc:  # reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
    # (named: a rank that never calls it shows up in the stall warning as a checkpoint's)
    error = broadcast_object(error, root_rank, name="__hvddp.checkpoint.saved", process_set=process_set)
    if error is not None:
        raise CheckpointError(f"checkpoint {path!r}: rank {root_rank} could not write it "
                              f"({error}); the previous checkpoint, if any, is intact.")


def load_bytes(path: Union[str, os.PathLike], root_rank: Optional[int] = None,
               process_set: ProcessSet = global_process_set) -> Optional[bytes]:
    """Read ``path`` on ``root_rank`` and return its bytes on every rank; every rank calls it.

    Only the root needs to see the file (other nodes need no shared filesystem).

    Returns:
        The file's bytes on every rank, or None on every rank when the root has no file at
        ``path`` (a fresh start).

    Raises:
        CheckpointError: on every rank, when the file exists but the root cannot read it.
    """
    return _read("load_bytes", path, root_rank, process_set)


def _read(fn: str, path: Any, root_rank: Any, process_set: ProcessSet) -> Optional[bytes]:
    path, root_rank = _checked(fn, path, root_rank, process_set)
    return read_agreed(path, root_rank, process_set)


def read_agreed(path: str, root_rank: int, process_set: ProcessSet, with_path: bool = False) -> Any:
    """``load_bytes`` for a call whose arguments every rank has already agreed on (``agree``);
    with ``with_path``, ``(bytes or None, the root's path)``, for errors that name the file read."""
    from .ops import broadcast, broadcast_object

    payload = None
    header: Any = None
    if _global_rank() == root_rank:
        try:
            with open(path, "rb") as f:
                payload = f.read()
            header = ("ok", len(payload))
        except FileNotFoundError:
            header = ("missing", 0)
        except Exception as exc:
            header = ("error", f"{type(exc).__name__}: {exc}")
        header += (path,)
    # (the root's path: where each rank passed its own, the errors name the file that was read)
    status, value, path = broadcast_object(header, root_rank, name="__hvddp.checkpoint.header",
                                           process_set=process_set)
    if status == "missing":
        return (None, path) if with_path else None
    if status == "error":
        raise CheckpointError(f"checkpoint {path!r}: rank {root_rank} could not read it ({value}).")
    if payload is not None:
        buf = np.frombuffer(payload, dtype=np.uint8)
    else:
        buf = np.empty(value, dtype=np.uint8)
    buf = broadcast(buf, root_rank, name="__hvddp.checkpoint.data", process_set=process_set)
    data = payload if payload is not None else buf.tobytes()
    return (data, path) if with_path else data


def save(obj: Any, path: Union[str, os.PathLike], root_rank: Optional[int] = None,
         process_set: ProcessSet = global_process_set) -> None:
    """Pickle ``obj`` (the root rank's) to ``path`` atomically; collective like ``save_bytes``.

    Raises:
        CheckpointError: on every rank, when the root could not pickle or write it.
    """
    from .runtime import _state

    _state()
    # (only the root's function runs; save_bytes checks the arguments on every rank first)
    _write("save", lambda f: pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL), path, root_rank, process_set)


def load(path: Union[str, os.PathLike], default: Any = None, root_rank: Optional[int] = None,
         process_set: ProcessSet = global_process_set) -> Any:
    """Return the object pickled at ``path`` (read by the root) on every rank; collective.

    Args:
        path: a file written by ``save``. It is unpickled: load only files you trust.
        default: what every rank gets when the root has no file at ``path``.

    Raises:
        CheckpointError: on every rank, when the file cannot be read or unpickled.
    """
    path, root_rank = _checked("load", path, root_rank, process_set)
    data, path = read_agreed(path, root_rank, process_set, with_path=True)
    return default if data is None else unpickled(path, data)


def unpickled(path: str, data: bytes) -> Any:
    """The object pickled in ``data``, read from ``path``; the same bytes on every rank fail alike."""
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path!r} is not a valid hvddp checkpoint "
                              f"({type(exc).__name__}: {exc}).") from exc
