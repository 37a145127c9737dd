"""A Chrome-trace (JSON array) timeline of every collective, written by rank 0.

Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing. Each tensor is a row named
``<kind>.<name>`` (``allreduce.grad.fc1.weight``; on a process set other than the global one,
followed by `` (process set <id>)``): a ``NEGOTIATE_<KIND>`` span with an instant
mark per rank as that rank announces it, then the ``<KIND>`` span with its phases
(``MEMCPY_IN_FUSION_BUFFER``, ``MPI_ALLREDUCE``, ``MEMCPY_OUT_FUSION_BUFFER``; on a GPU
``NCCL_<KIND>`` or ``MPI_<KIND>_STAGED`` from when the engine enqueues it until hvddp's stream
has passed it). With
``HVDDP_TIMELINE_MARK_CYCLES=1`` every engine cycle is a ``CYCLE_START`` mark.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from typing import Dict, Iterable, List, Optional

_log = logging.getLogger("hvddp")

__all__ = ["Timeline", "start_timeline", "stop_timeline"]

_quote = functools.lru_cache(maxsize=4096)(json.dumps)  # span names and rank marks repeat
_OTHER_KINDS = ("allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
                "add_process_set", "remove_process_set")  # (every Kind but allreduce)


class Timeline:
    """Event writer; a no-op (falsy) until a file is open."""

    def __init__(self, rank: int, tag: str = "") -> None:
        self.rank = rank
        self.tag = tag  # put before the path's extension (see from_config)
        self._lock = threading.Lock()
        self._file = None
        self._held: List[str] = []  # events written since the last flush()
        self._t0 = 0.0
        self._pids: Dict[tuple, int] = {}  # (process set id, name, kind) -> its row
        self._open_spans: Dict[tuple, list] = {}  # (process set id, name) -> stack of open span names
        self.mark_cycles = False
        self._kinds: Dict[tuple, str] = {}  # (process set id, name) -> the kind of its last operation
        self._ready: Dict[tuple, set] = {}  # (process set id, name) -> ranks marked in its open negotiation

    @classmethod
    def from_config(cls, config, rank: int, tag: str = "") -> "Timeline":
        """``tag``: for a world that is part of the job (``init(comm=...)``), whose rank 0 is
        not the job's: ``.world<its job rank>``, so that the parts' rank 0s, which all write, do
        not truncate one file (one part's trace was lost)."""
        timeline = cls(rank, tag)
        if config.timeline and config.timeline.upper() != "DYNAMIC":
            timeline.start(config.timeline, config.timeline_mark_cycles)
        return timeline

    def __bool__(self) -> bool:
        return self._file is not None

    def start(self, path: str, mark_cycles: bool = False) -> None:
        if self.rank != 0:
            return
        with self._lock:
            if self._file is not None:
                self._close_locked()
            if self.tag:
                root, ext = os.path.splitext(path)
                path = f"{root}{self.tag}{ext}"
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            # events are held and written at the end of every engine cycle (flush()), so that a
            # job that is aborted or killed (no shutdown()) still leaves its trace up to its last
            # cycle; written line by line, the timeline made the engine 3.5-4.6x slower. (Held
            # here, not in the file's buffer: a process forked from the rank drops them, where
            # its exit would have flushed a buffer's copy into the file a second time.)
            self._held = []
            self._file = open(path, "w", buffering=1, encoding="utf-8")
            self._path = path
            self._written = 0  # bytes of whole flushes in the file (where a failed write is cut back to)
            self._t0 = time.monotonic()
            self._pids = {}
            self._open_spans = {}
            self._kinds = {}
            self._ready = {}
            self.mark_cycles = mark_cycles
            self._write("[\n")
            self._emit({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "hvddp engine"}})
            self._emit({"name": "start_time_since_epoch_in_micros", "ph": "M", "pid": 0,
                        "args": {"value": int(time.time() * 1e6)}})

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def flush(self) -> None:
        """Write the events held since the last flush (the engine calls it once per cycle)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is None or not self._held:
            return
        text, self._held = "".join(self._held), []
        try:
            self._file.write(text)  # (line-buffered: it reaches the file now)
            self._file.flush()
        except OSError as exc:
            self._give_up(exc)
        else:
            self._written += len(text.encode("utf-8"))

    def forget_in_child(self) -> None:
        """In a process forked from rank 0: drop the file and what is held, unwritten."""
        self._held = []
        self._file = None

    def _close_locked(self) -> None:
        if self._file is None:
            return
        for key, stack in self._open_spans.items():
            while stack:
                self._event(key, "E", stack.pop())
        self._write('{"name": "trace_end", "ph": "M", "pid": 0, "args": {}}\n]\n')
        self._flush_locked()
        file, self._file = self._file, None
        self._pids, self._open_spans, self._kinds, self._ready = {}, {}, {}, {}
        if file is None:  # (a write above failed and gave up the file)
            return
        try:
            file.close()
        except OSError as exc:
            self._file = file
            self._give_up(exc)

    # ------------------------------------------------------------------------------------
    def _now(self) -> int:
        return int((time.monotonic() - self._t0) * 1e6)

    def _emit(self, event: dict) -> None:
        self._write(json.dumps(event) + ",\n")

    def _write(self, text: str) -> None:
        if self._file is not None:  # (None: an earlier write failed)
            self._held.append(text)

    def _give_up(self, exc: OSError) -> None:
        """A write failed (a full disk, say): stop the timeline, not the training (as Horovod)."""
        _log.error("writing the timeline %s failed (%s); no more timeline events are written",
                   getattr(self, "_path", "?"), exc)
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass
        try:  # back to the last whole flush: the file ends with whole events, so it loads once
            os.truncate(self._path, self._written)  # closed with "]" (see the README)
        except (OSError, AttributeError):
            pass

    def _pid(self, key: tuple) -> int:
        kind = self._kinds.get(key, "allreduce")
        row = key + (kind,)  # a name used by operations of two kinds: a row each
        pid = self._pids.get(row)
        if pid is None:
            pid = self._pids[row] = len(self._pids) + 1
            ps_id, name = key
            label = f"{kind}.{name}"
            if ps_id:  # the same name may be used on several sets: a row per set
                label += f" (process set {ps_id})"
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def _event(self, key: tuple, phase: str, what: str, ts: Optional[int] = None, extra: str = "") -> None:
        """One event; ``extra``: more JSON members (``, "s": "p"``); ``ts``: its time if known."""
        if ts is None:
            ts = self._now()
        self._write(f'{{"name": {_quote(what)}, "ph": "{phase}", "ts": {ts}, "pid": {self._pid(key)}, '
                    f'"tid": 0{extra}}},\n')

    def _locked(fn):  # noqa: N805 - a decorator used inside the class body
        def wrapper(self, *args):
            with self._lock:
                if self._file is not None:
                    fn(self, *args)
        wrapper.__name__ = fn.__name__
        return wrapper

    @_locked
    def negotiate_start(self, key: tuple, kind: str) -> None:
        stack = self._open_spans.setdefault(key, [])
        if any(span.startswith("NEGOTIATE_") for span in stack):
            return  # one negotiation, one span: when ranks call two kinds under a name, on the first's row
        self._kinds[key] = kind
        span = f"NEGOTIATE_{kind.upper()}"
        self._event(key, "B", span)
        stack.append(span)

    @_locked
    def negotiate_rank_ready(self, key: tuple, rank: int, kind: str) -> None:
        self._kinds.setdefault(key, kind)  # (a negotiation begun before this file: its row's kind)
        ready = self._ready.setdefault(key, set())
        if rank in ready:  # (rank 0's own cached announcement, then sent when the others were late)
            return
        ready.add(rank)
        self._event(key, "i", str(rank), extra=f', "s": "p", "args": {{"rank": {int(rank)}}}')

    @_locked
    def negotiate_end(self, key: tuple) -> None:
        self._ready.pop(key, None)
        stack = self._open_spans.get(key)
        if stack and stack[-1].startswith("NEGOTIATE_"):
            self._event(key, "E", stack.pop())
            if not stack:
                del self._open_spans[key]

    @_locked
    def activities(self, keys: Iterable[tuple], activity: str) -> None:
        """Enter ``activity`` for each key (ending its previous one; opening the op span)."""
        ts = self._now()  # (one moment: the keys enter it together)
        for key in keys:
            self._ready.pop(key, None)
            stack = self._open_spans.setdefault(key, [])
            if key not in self._kinds:  # not negotiated (a join's), or before this file began:
                # the row's kind is fixed here, once (an Adasum or staged allreduce's second
                # activity moved its events to a row of its own, its spans open on the first)
                name = activity.lower()  # (MPI_BROADCAST, NCCL_ALLGATHER, MPI_ALLTOALL_STAGED, ...)
                self._kinds[key] = next((k for k in _OTHER_KINDS if k in name), "allreduce")
            if stack and stack[-1].startswith("NEGOTIATE_"):
                self._event(key, "E", stack.pop(), ts)
            if not stack:
                kind = self._kinds.get(key, "allreduce").upper()
                self._event(key, "B", kind, ts)
                stack.append(kind)
            elif len(stack) > 1:
                self._event(key, "E", stack.pop(), ts)
            self._event(key, "B", activity, ts)
            stack.append(activity)

    def activity(self, key: tuple, activity: str) -> None:
        self.activities((key,), activity)

    @_locked
    def end(self, keys: Iterable[tuple]) -> None:
        ts = self._now()
        for key in keys:
            self._ready.pop(key, None)
            stack = self._open_spans.pop(key, None)
            while stack:
                self._event(key, "E", stack.pop(), ts)

    @_locked
    def mark_cycle(self) -> None:
        self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "ts": self._now(), "pid": 0, "tid": 0})


def _timeline() -> Timeline:
    from .runtime import _state

    return _state().timeline


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline to ``file_path`` (rank 0 writes; other ranks do nothing).

    Works with ``HVDDP_TIMELINE=DYNAMIC`` or any other setting; a running timeline is closed and
    a new one started. Not collective (a rank may call it alone), so a path rank 0 cannot write
    raises there only.

    Raises:
        OSError: on rank 0, ``file_path`` cannot be opened for writing (the same kind as ``open``'s,
            its message naming the call and the fix).
    """
    try:
        _timeline().start(file_path, mark_cycles)
    except OSError as exc:
        raise type(exc)(exc.errno, f"start_timeline({file_path!r}): rank 0, which writes the timeline, "
                                   f"cannot open that path ({exc.strerror}); pass a path in a writable "
                                   f"directory") from exc


def stop_timeline() -> None:
    """Close the timeline file (valid JSON from then on)."""
    _timeline().close()
