"""The background thread: the only caller of MPI after ``init()``.

Each cycle:
1. New submissions are sorted into cached ones (announced as one bit each) and uncached ones.
2. One bitwise-AND allreduce of the bit vector (plus flag bits) tells which cached entries are
   ready on every rank and whether anyone has uncached requests or is shutting down.
3. If so, a slow round: uncached requests go to rank 0, which answers with the ordered list of
   responses (and cache evictions, join state, a fatal error); every rank applies it.
4. Every rank executes the same ready set in the same order; fusion happens in the executor.

Waits that may be long (negotiation) poll nonblocking MPI requests with a sleeping backoff, so a
rank waiting for a slower peer does not steal the core its training thread runs on.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import _faults
from ..backends import mpi as mpi_backend
from ..exceptions import HvddpError, MismatchError, ShutdownError, StallError
from .cache import ResponseCache
from .coordinator import Coordinator, Decision
from .executor import Entry, Executor
from ..handles import defer_wakeups, wake_deferred
from .messages import GROUP_FAILURE, Kind
from .names import AutoNames

log = logging.getLogger("hvddp")

NEW, BIT, UNSENT, SENT = 0, 1, 2, 3
FLAG_NO_UNSENT = 0x01
FLAG_NOT_SHUTDOWN = 0x02
# The other six bits: cleared by a rank with work pending in a process set smaller than the
# world, bit 2 + (the set's id % 6). A rank outside such a set never submits to it, so nothing
# would wake it from its idle wait while the set's members wait in every cycle for it.
FLAG_SET_WORK_SHIFT, FLAG_SET_WORK_BITS = 2, 6
IDLE_WAIT_S = 0.05
EAGER_S = 1.0  # how long an outsider keeps cycling without idle waits after it last saw such work
TRACE = 5  # HVDDP_LOG_LEVEL=TRACE: a line per cycle that ran collectives
SHUTDOWN_GRACE_CYCLES = 8  # cycles a shutdown waits at most for negotiations in flight


def _listed(names: Sequence[str], limit: int = 12) -> str:
    """Names for a log line: the first ``limit`` and how many more."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")



class Engine:
    """Owns the world communicator's duplicate and runs every collective on its thread."""

    def __init__(self, comm: MPI.Comm, config, process_sets, make_process_set, timeline=None,
                 auto_names: Optional[AutoNames] = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.config = config
        self.process_sets = process_sets
        self._make_process_set = make_process_set
        self.timeline = timeline
        self.auto_names = auto_names or AutoNames()
        self.cache = ResponseCache(config.cache_capacity)
        self.executor = Executor(config, process_sets, timeline)
        self.coordinator = (Coordinator(self.size, process_sets, self.cache, config, timeline)
                            if self.rank == 0 else None)
        # ``with self._lock`` (a C-level lock) guards the queue; the condition over the same
        # lock wakes an idle engine, and is notified only while the engine sleeps on it.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._sleeping = False
        self._queue: List[Entry] = []
        self._names: set = set()
        self._refused: set = set()  # keys of calls refused here, still being negotiated
        # key -> the calls waiting behind its refusal, in order: (entries, the refused keys
        # each still waits for, whether it is a refusal too)
        self._parked: Dict[tuple, List[tuple]] = {}
        self._join_behind: Optional[List[Entry]] = None  # a join waiting for parked calls
        self._pending: Dict[tuple, Entry] = {}
        self._join_mode = False
        self._shutdown_requested = False
        self._shutdown_cycles = 0
        self._eager_until = 0.0  # cycle without idle waits until then: a set without us has work
        self._error: Optional[HvddpError] = None  # set once the engine has stopped
        self._bits = np.zeros(1 + (config.cache_capacity + 7) // 8, dtype=np.uint8)
        self._want = np.zeros(((config.cache_capacity + 7) // 8) * 8, dtype=bool)
        self._nonmember_version = -1
        self._nonmember = np.zeros_like(self._want)
        stall = config.stall_check_time_s
        if config.stall_shutdown_time_s > 0:
            stall = min(stall, config.stall_shutdown_time_s)
        self._demote_s = max(0.05, min(2.0, stall / 4))
        self._debug = log.isEnabledFor(logging.DEBUG)  # (the level is set before the engine starts)
        self._trace = log.isEnabledFor(TRACE)
        self._thread = threading.Thread(target=self._run, name="hvddp-engine", daemon=True)
        self._thread.start()

    # User thread -------------------------------------------------------------------------
    def submit(self, entries: List[Entry]) -> None:
        """Queue entries (all or none); a name already pending is a ``ValueError``.

        A name held by a call this rank refused (``submit_refused``: the caller raised, and is
        now retrying) parks the entries instead and returns at once: they are queued when the
        refusal has met the other ranks' calls, so the retry meets their next ones. A ``join``
        waits behind parked calls, so that they still meet the ranks that joined."""
        with self._lock:
            if self._error is not None:
                request = entries[0].request
                raise type(self._error)(f"{request.kind.value} {request.name!r} was submitted after hvddp's engine "
                                        f"stopped, so it never runs: {self._error}")
            keys = [e.key for e in entries]
            for key in keys:
                if key in self._names and not self._behind_refusals(key):
                    raise ValueError(
                        f"a collective named {key[1]!r} is already pending; wait for it (or give "
                        f"this one another name) before submitting it again.")
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise ValueError(f"the name {dup[1]!r} appears twice in one grouped call; names "
                                 f"must be unique.")
            self._names.update(keys)
            if entries[0].request.kind is Kind.JOIN and self._parked:
                self._join_behind = entries
                return
            if not self._park(entries, refused=False):
                self._queue.extend(entries)
                self._cv.notify()

    def submit_refused(self, entries: List[Entry]) -> None:
        """Announce calls this rank refused (their requests carry the reason), so that ranks
        which made them validly fail with a ``MismatchError`` instead of waiting for this one.
        Behind an earlier refusal under the same name it is parked, as a retry is. Not announced
        when a name is held by a valid call here (that earlier call meets the others) or
        appears twice (the others refuse such a call without submitting it)."""
        keys = [e.key for e in entries]
        with self._lock:
            if self._error is not None or len(set(keys)) != len(keys) or \
                    any(k in self._names and not self._behind_refusals(k) for k in keys):
                return
            for entry in entries:
                entry.sig = None  # never announced through the cache: rank 0 must see the reason
            self._names.update(keys)
            if not self._park(entries, refused=True):
                self._start(entries, refused=True)

    # (the helpers below run under the lock)
    def _behind_refusals(self, key: tuple) -> bool:
        """Whether a new call under ``key`` would wait only behind refusals (not a valid call)."""
        return key in self._refused and all(p[2] for p in self._parked.get(key, ()))

    def _park(self, entries: List[Entry], refused: bool) -> bool:
        """Park ``entries`` behind the refusals holding some of their names; False if none does."""
        held = {e.key for e in entries if e.key in self._refused}
        if not held:
            return False
        parked = (entries, held, refused)
        for key in held:
            self._parked.setdefault(key, []).append(parked)
        return True

    def _start(self, entries: List[Entry], refused: bool) -> None:
        if refused:
            self._refused.update(e.key for e in entries)
        self._queue.extend(entries)
        self._cv.notify()

    def _release_refused(self, key: tuple) -> None:
        """A refusal met the others: free its name, or pass it to the next call parked behind it
        (started once none of its names waits on a refusal); then a held ``join`` may go."""
        self._refused.discard(key)
        queue = self._parked.get(key)
        if not queue:
            self._parked.pop(key, None)
            self._names.discard(key)
        else:
            parked = queue.pop(0)
            if not queue:
                del self._parked[key]
            parked[1].discard(key)
            if not parked[1]:
                self._start(parked[0], parked[2])
        self._release_join()

    def _release_join(self) -> None:
        if self._join_behind is not None and not self._parked:
            self._start(self._join_behind, refused=False)
            self._join_behind = None

    def _all_parked(self) -> List[Entry]:
        batches = {id(p): p for queue in self._parked.values() for p in queue}
        return [e for p in batches.values() for e in p[0]] + (self._join_behind or [])

    def submit_one(self, entry: Entry) -> None:
        """``submit([entry])`` without the list: the per-gradient hot path."""
        key = entry.key
        with self._lock:
            if self._error is not None or key in self._names:
                pass  # the general path raises the right error
            else:
                self._names.add(key)
                self._queue.append(entry)
                if self._sleeping:
                    self._cv.notify()
                    self._sleeping = False  # woken: the submissions behind this one need not
                return
        self.submit([entry])

    def forked(self, rank: int) -> None:
        """In a process forked from the rank: its engine thread did not come along; fail calls."""
        self._lock = threading.Lock()  # (the engine thread may have held it at the fork)
        self._cv = threading.Condition(self._lock)
        # and the calls in flight at the fork fail too (their handles would wait forever)
        self._stop_with(HvddpError(
            f"this process was forked from rank {rank} (a DataLoader's or a Pool's worker, say), "
            f"and hvddp's collectives run on the rank's engine thread, which a fork does not copy; "
            f"make collectives in the rank itself."))

    def stop(self) -> None:
        """Ask every rank's engine to stop (collectively) and wait for this one to end."""
        with self._lock:
            self._shutdown_requested = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def running(self) -> bool:
        """Whether the engine thread is still alive (it may be using the communicators)."""
        return self._thread.is_alive()

    # Engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        cycle_s = self.config.cycle_time_ms / 1000.0
        last = 0.0
        try:
            while True:
                with self._lock:
                    idle = not self._queue and not self._pending and not self._shutdown_requested
                    if idle and time.monotonic() >= self._eager_until:
                        # a request after idleness starts a cycle at once
                        self._sleeping = True
                        self._cv.wait(IDLE_WAIT_S)
                        self._sleeping = False
                    else:
                        idle = False
                if not idle:  # a busy engine lets requests gather for fusion
                    wait = last + cycle_s - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                last = time.monotonic()
                going_on = self._cycle(last)
                if self.timeline:  # the cycle's events reach the file (a killed job keeps them)
                    self.timeline.flush()
                if not going_on:
                    return
        except BaseException as exc:  # never die silently: fail every waiting handle
            log.exception("hvddp engine failed on rank %d", self.rank)
            self._stop_with(HvddpError(f"hvddp engine failed on rank {self.rank}: {exc!r}"))
        finally:
            try:
                self.executor.close()  # device work in flight, NCCL communicators
            except Exception:
                log.exception("hvddp: releasing the GPU path failed on rank %d", self.rank)

    def _cycle(self, now: float) -> bool:
        with self._lock:
            new, self._queue = self._queue, []
            shutdown = self._shutdown_requested
        for entry in new:
            self._pending[entry.key] = entry
        if self.timeline and self.timeline.mark_cycles:  # HVDDP_TIMELINE_MARK_CYCLES or start_timeline()
            self.timeline.mark_cycle()

        unsent = self._classify(now)
        if self.coordinator is not None:
            self.coordinator.check_stalls(now)  # once per cycle; may make a fatal stall to announce
        flags = 0xFF
        if unsent or (self.coordinator is not None and self.coordinator.wants_round()):
            flags &= ~FLAG_NO_UNSENT
        if shutdown:
            flags &= ~FLAG_NOT_SHUTDOWN
        if len(self.process_sets) > 1:  # (with the global set alone, no pass over the pending work)
            for ps_id in {entry.request.ps_id for entry in self._pending.values()}:
                if ps_id and self._is_subset(ps_id):
                    flags &= ~(1 << (FLAG_SET_WORK_SHIFT + ps_id % FLAG_SET_WORK_BITS))
        bits = self._bits
        bits[0] = flags
        if self.cache.capacity:
            self._refresh_nonmember()
            want = self._want
            want[:] = self._nonmember
            for entry in self._pending.values():
                if entry.state == BIT:
                    want[entry.slot] = True
            bits[1:] = np.packbits(want)
        mpi_backend.wait(self.comm.Iallreduce(MPI.IN_PLACE, [bits, MPI.UINT8_T], MPI.BAND))
        flags = int(bits[0])
        set_work = ~flags & (((1 << FLAG_SET_WORK_BITS) - 1) << FLAG_SET_WORK_SHIFT)
        if set_work and self._outside_a_set_with(set_work):
            self._eager_until = time.monotonic() + EAGER_S
        # A rank asked to shut down: agreed work still runs, and while some rank has requests
        # to negotiate, a few more cycles run (so a refusal its peers wait on reaches them as
        # the MismatchError it is, not as a ShutdownError, also when it first evicts their
        # cached announcement); then everything still pending fails. (The flags are the same
        # on every rank, so every rank stops in the same cycle.)
        shutting_down = not flags & FLAG_NOT_SHUTDOWN
        if shutting_down:
            self._shutdown_cycles += 1
            shutting_down = bool(flags & FLAG_NO_UNSENT) or self._shutdown_cycles > SHUTDOWN_GRACE_CYCLES
        work = self._fast_ready(bits) if self.cache.capacity else []
        cached = len(work)
        set_changes = []  # process sets to add or remove once this cycle's collectives ran
        if not flags & FLAG_NO_UNSENT:
            decision = self._slow_round(unsent, now)
            if decision.fatal:  # also fails what the fast path took out of _pending this cycle
                self._stop_with(StallError(decision.fatal), [entry for _, entry, _ in work if entry is not None])
                return False
            work.extend(self._apply(decision, set_changes))
        if work and self._trace:
            log.log(TRACE, "cycle: running %d collective(s), %d of them announced through the response "
                    "cache: %s", len(work), cached, _listed([f"{q.kind.value} {q.name}" for q, _, _ in work]))
        if work:
            with self._lock:
                for _, entry, _ in work:
                    if entry is not None:
                        self._names.discard(entry.key)
            defer_wakeups()
            try:
                self.executor.run(work)
            except BaseException as exc:  # the engine stops; these are no longer pending anywhere
                self._fail_taken([entry for _, entry, _ in work] + [entry for _, entry in set_changes], exc)
                raise
            finally:
                wake_deferred()
        for i, (response, entry) in enumerate(set_changes):
            try:
                self._change_process_set(response, entry)
            except BaseException as exc:  # (making a communicator failed: MPICH's ~2,000 at most)
                self._fail_taken([entry for _, entry in set_changes[i:]], exc,
                                 "; every registered process set holds an MPI communicator, and an MPI "
                                 "library makes a limited number (about 2,000 with MPICH, 65,000 with Open "
                                 "MPI): remove the sets no longer used with remove_process_set()")
                raise
        if shutting_down:
            self._shutdown_collectively()
            return False
        return True

    def _classify(self, now: float) -> List[Entry]:
        """Decide per pending entry: announce by cache bit, or send to rank 0 (once)."""
        unsent = []
        cache = self.cache
        version = cache.version
        use_cache = cache.capacity > 0 and not self._join_mode
        demote_before = now - self._demote_s
        pending = self._pending
        groups_ok: Dict[int, bool] = {}  # id(group_keys) -> every member pending and cached
        for entry in pending.values():
            state = entry.state
            if state in (SENT, UNSENT):  # UNSENT: a sibling in this loop already listed it
                continue
            if state == BIT and entry.cache_version == version and entry.submitted > demote_before \
                    and use_cache:
                continue  # still announced by the same slot
            slot = None
            if use_cache and entry.request.kind is Kind.ALLREDUCE and entry.submitted > demote_before:
                slot = cache.lookup(entry.sig)
                keys = entry.group_keys
                if slot is not None and keys:
                    ok = groups_ok.get(id(keys))
                    if ok is None:  # once per group, not once per member
                        ok = groups_ok[id(keys)] = all(
                            sibling is not None and sibling.state not in (SENT, UNSENT)
                            and cache.lookup(sibling.sig) is not None
                            for sibling in map(pending.get, keys))
                    if not ok:
                        slot = None
            if slot is None:
                entry.state = UNSENT
                unsent.append(entry)
                for key in entry.group_keys:  # a group travels one way
                    sibling = pending.get(key)
                    if sibling is not None and sibling.state in (NEW, BIT):
                        sibling.state = UNSENT
                        unsent.append(sibling)
            else:
                if entry.state == NEW and self.timeline:
                    self.timeline.negotiate_start(entry.key, entry.request.kind.value)
                    self.timeline.negotiate_rank_ready(entry.key, self.rank, entry.request.kind.value)
                entry.state = BIT
                entry.slot = slot
                entry.cache_version = version
        return unsent

    def _is_subset(self, ps_id: int) -> bool:
        ps = self.process_sets.get(ps_id)
        return ps is not None and ps.size < self.size

    def _outside_a_set_with(self, set_work: int) -> bool:
        """Whether this rank is outside a process set whose flag bit is in ``set_work``."""
        for ps_id, ps in list(self.process_sets.items()):
            if ps.rank < 0 and set_work >> (FLAG_SET_WORK_SHIFT + ps_id % FLAG_SET_WORK_BITS) & 1:
                return True
        return False

    def _refresh_nonmember(self) -> None:
        if self._nonmember_version == self.cache.version:
            return
        self._nonmember[:] = False
        for slot, request in self.cache.slots():
            ps = self.process_sets.get(request.ps_id)
            if ps is None or ps.rank < 0:
                self._nonmember[slot] = True
        self._nonmember_version = self.cache.version

    def _fast_ready(self, bits: np.ndarray) -> list:
        ready = np.flatnonzero(np.unpackbits(bits[1:]))
        if ready.size == 0:
            return []
        cache = self.cache
        items = []
        groups: Dict[str, list] = {}
        for slot in ready.tolist():
            try:
                request = cache.request(slot)
            except KeyError:
                continue
            if request.group is not None:
                groups.setdefault(request.group[0], []).append((slot, request))
                continue
            items.append((slot, request))
        for members in groups.values():
            if len(members) == members[0][1].group[1]:
                items.extend(members)
        items.sort()
        work = []
        for slot, request in items:
            cache.touch(slot)
            ps = self.process_sets.get(request.ps_id)
            if ps is None or ps.rank < 0:
                continue
            entry = self._pending.pop(request.key())
            work.append((request, entry, None))
        return work

    def _slow_round(self, unsent: List[Entry], now: float) -> Decision:
        for entry in unsent:
            entry.state = SENT
        # (a cached name demoted after waiting says how long: the stall clock counts from its submission)
        fresh = now - 0.05
        requests = [e.request if e.submitted > fresh and not e.raised else
                    e.request._replace(waited=max(0.0, now - e.submitted), raised=e.raised) for e in unsent]
        payload = np.frombuffer(pickle.dumps(requests, protocol=5), dtype=np.uint8)
        comm = self.comm
        counts = np.zeros(self.size if self.rank == 0 else 1, dtype=np.int64)
        mine = np.array([payload.size], dtype=np.int64)
        mpi_backend.wait(comm.Igather([mine, MPI.INT64_T], [counts, MPI.INT64_T], root=0))
        if self.rank == 0:
            total = int(counts.sum())
            gathered = np.empty(max(total, 1), dtype=np.uint8)
            displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
            mpi_backend.wait(comm.Igatherv([payload, MPI.BYTE],
                                           [gathered, (counts.tolist(), displs.tolist()), MPI.BYTE], root=0))
            for r in range(self.size):
                chunk = gathered[displs[r]:displs[r] + counts[r]]
                self.coordinator.ingest(r, pickle.loads(chunk.tobytes()), now)
            decision = self.coordinator.decide(now)
            blob = np.frombuffer(pickle.dumps(decision, protocol=5), dtype=np.uint8)
            length = np.array([blob.size], dtype=np.int64)
        else:
            mpi_backend.wait(comm.Igatherv([payload, MPI.BYTE], None, root=0))
            length = np.zeros(1, dtype=np.int64)
        mpi_backend.wait(comm.Ibcast([length, MPI.INT64_T], root=0))
        if self.rank != 0:
            blob = np.empty(int(length[0]), dtype=np.uint8)
        mpi_backend.wait(comm.Ibcast([blob, MPI.BYTE], root=0))
        if self.rank != 0:
            decision = pickle.loads(blob.tobytes())
        if self._debug:
            self._log_round(unsent, decision)
        return decision

    def _log_round(self, unsent: List[Entry], decision: Decision) -> None:
        """HVDDP_LOG_LEVEL=DEBUG: what this rank sent to rank 0 and what rank 0 decided; rank 0
        also says which names still wait for which ranks."""
        done = [f"{r.kind.value} {r.name}" for r in decision.responses if r.error is None]
        failed = [f"{r.kind.value} {r.name}" for r in decision.responses if r.error is not None]
        log.debug("negotiation: sent %d request(s)%s; agreed %d%s; failed %d%s%s", len(unsent),
                  f" ({_listed([e.request.name + (' refused' if e.request.refused else '') for e in unsent])})"
                  if unsent else "",
                  len(done), f" ({_listed(done)})" if done else "",
                  len(failed), f" ({_listed(failed)})" if failed else "",
                  f"; response cache evicts {_listed([k[1] for k in decision.evict])}" if decision.evict else "")
        if self.coordinator is not None and self.coordinator.table:
            waiting = [f"{key[1]} (from ranks {sorted(w.requests)})" for key, w in self.coordinator.table.items()]
            log.debug("negotiation: still waiting: %s", _listed(waiting))

    def _apply(self, decision: Decision, set_changes: list) -> list:
        """This rank's share of ``decision``: the collectives to execute now; process-set
        additions and removals go to ``set_changes``, to run after them (a removal decided in the
        same round as a collective on that set must not pull the set from under it)."""
        for key in decision.evict:
            self.cache.evict(key)
        self._join_mode = decision.join_mode
        work = []
        for response in decision.responses:
            ps = self.process_sets.get(response.ps_id)
            member = ps is not None and ps.rank >= 0
            # (a collective on a set removed since comes back as an error for its submitters)
            entry = self._pending.pop(response.key(), None) if member or ps is None else None
            if entry is None and member:  # joined: a peer's call, run (or refused) here too
                self.auto_names.seen(response.name)
            if response.error is not None:
                if entry is not None:
                    with self._lock:
                        if entry.request.refused is not None:
                            self._release_refused(response.key())
                        else:
                            self._names.discard(response.key())
                    error = MismatchError(response.error)
                    error.group_failure = response.info == GROUP_FAILURE  # (counted when raised: handles.RAISED)
                    entry.fail(error)
                continue
            kind = response.kind
            if kind in (Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET):
                set_changes.append((response, entry))
                continue
            if kind is Kind.ALLREDUCE and not decision.join_mode:
                self.cache.put(response.request)
            if member:
                work.append((response.request, entry, response.info))
        return work

    def _change_process_set(self, response, entry: Optional[Entry]) -> None:
        kind = response.kind
        if kind is Kind.REMOVE_PROCESS_SET:
            ps_id = response.request.extra[0]
            self.cache.evict_process_set(ps_id)
            self.executor.forget_process_set(ps_id)
            # this rank's collectives on the set that its other members never submitted
            with self._lock:
                orphans = [e for e in self._pending.values() if e.request.ps_id == ps_id]
                orphans += [e for e in self._queue if e.request.ps_id == ps_id]
                self._queue = [e for e in self._queue if e.request.ps_id != ps_id]
                for key in [k for k in self._parked if k[0] == ps_id]:
                    for entries, _, _ in self._parked.pop(key):
                        orphans += [e for e in entries if e not in orphans]
                for e in orphans:
                    self._pending.pop(e.key, None)
                    self._names.discard(e.key)
                    self._refused.discard(e.key)
                self._release_join()
            if self.coordinator is not None:  # rank 0 forgets them too: no stall, no late answer
                self.coordinator.forget_process_set(ps_id)
                if self.timeline:  # (its own, announced through the cache, never reached the table)
                    for e in orphans:
                        self.timeline.negotiate_end(e.key)
            for e in orphans:
                e.fail(MismatchError(f"{e.request.kind.value} {e.request.name!r}: its process set (id "
                                     f"{ps_id}) was removed before every member submitted it."))
        result = self._make_process_set(kind, response.request, self.comm)
        if entry is not None:
            with self._lock:
                self._names.discard(response.key())
            entry.complete(result)

    def _fail_taken(self, entries: Sequence[Optional[Entry]], exc: BaseException, hint: str = "") -> None:
        """Fail the entries a cycle took out of ``_pending`` when the engine stops in it (the
        engine's own stop fails only what is still pending)."""
        lines = str(exc).strip().splitlines()  # (an MPI error's last line says what went wrong)
        why = f"{type(exc).__name__}: {lines[-1].strip()}" if lines else repr(exc)
        for entry in entries:
            if entry is not None:
                entry.fail(HvddpError(f"{entry.request.kind.value} {entry.request.name!r}: hvddp "
                                      f"engine failed on rank {self.rank}: {why}{hint}."))

    def _shutdown_collectively(self) -> None:
        who = self.comm.allgather(self._shutdown_requested)
        ranks = [r for r, flag in enumerate(who) if flag]
        self._stop_with(ShutdownError(
            f"hvddp was shut down on rank(s) {ranks} (shutdown(), or the process's exit); the collectives pending "
            f"then never complete. Call shutdown() only after every rank has finished its "
            f"collectives."))

    def _stop_with(self, error: HvddpError, taken: Sequence[Entry] = ()) -> None:
        if not isinstance(error, ShutdownError):
            # a peer stuck outside hvddp never sees this error: end the job at exit, not hang
            _faults.world_broken(f"{type(error).__name__}: {error}")
        with self._lock:
            self._error = error
            entries = list(taken) + list(self._pending.values()) + self._queue + self._all_parked()
            self._pending.clear()
            self._queue = []
            self._names.clear()
            self._refused.clear()
            self._parked.clear()
            self._join_behind = None
        for entry in entries:
            request = entry.request
            where = f" on process set {request.ps_id}" if request.ps_id else ""
            entry.fail(type(error)(f"{request.kind.value} {request.name!r}{where}: {error}"))
