"""Process state: ``init``/``shutdown``, ranks and sizes, process sets, capability queries."""

from __future__ import annotations

import atexit
import logging
import numbers
import os
import sys
import threading
from typing import Any, Iterable, List, Optional, Sequence, Union

from . import _logging, config as _config
from .engine.names import AutoNames
from .exceptions import BackendUnavailableError, LauncherMismatchError, NotInitializedError

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built",
    "mpi_enabled", "nccl_built", "cuda_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set",
]

_lock = threading.RLock()


class ProcessSet:
    """A subset of ranks that can run collectives among themselves.

    Create one with the world ranks it holds, pass it to ``init(process_sets=...)`` or register
    it later with ``add_process_set`` (on every rank, in the same order), then give it to any
    collective as ``process_set=``. A ``root_rank`` (``broadcast`` and the like) is a global rank,
    as ``hvddp.rank()`` numbers them, that must be a member of the set, as in Horovod.

    Example:
        evens = hvddp.add_process_set([0, 2])
        if evens.included():
            hvddp.allreduce(x, process_set=evens)
    """

    def __init__(self, ranks: Optional[Iterable[int]] = None) -> None:
        self._mpi_comm = None  # Horovod's ProcessSet(comm): resolved by init(process_sets=...)
        self._parts: Optional[List["ProcessSet"]] = None  # the split's parts, this one among them
        if ranks is None:
            self.ranks: Optional[List[int]] = None
        elif _is_mpi_comm(ranks):
            self.ranks = None
            self._mpi_comm = ranks
        else:
            try:
                ranks = list(ranks)
            except TypeError:
                raise TypeError(f"ProcessSet ranks must be a list of world ranks (or an MPI communicator); "
                                f"Received: {ranks!r} ({type(ranks).__name__}).") from None
            if not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in ranks):
                raise TypeError(f"ProcessSet ranks must be ints, got {ranks!r}.")
            ranks = [int(r) for r in ranks]  # (numpy integers too, as Horovod's sorted() takes them)
            if len(set(ranks)) != len(ranks) or not ranks:
                raise ValueError(f"ProcessSet ranks must be distinct and non-empty, got {ranks!r}.")
            self.ranks = sorted(ranks)
        self.process_set_id: Optional[int] = None
        self.comm = None
        self._rank = -1

    def __repr__(self) -> str:
        if self._mpi_comm is not None and self.ranks is None:
            return f"ProcessSet(comm={self._mpi_comm!r}, not registered)"
        return f"ProcessSet(id={self.process_set_id}, ranks={self.ranks})"

    # A set is one registered object per process (it holds its communicator): copies of a module
    # or optimizer that refers to it share it, and a pickle stores its ranks only.
    def __copy__(self) -> "ProcessSet":
        return self

    def __deepcopy__(self, memo) -> "ProcessSet":
        return self

    def __reduce__(self):
        if self._mpi_comm is not None and self.ranks is None:  # as mpi4py refuses to pickle the communicator
            raise TypeError("a ProcessSet made from a communicator cannot be pickled before init() has "
                            "registered it (its ranks are not known yet).")
        if self is global_process_set:
            return _restore_process_set, ("global",)
        return _restore_process_set, (None if self.ranks is None else list(self.ranks), self.process_set_id)

    def _require(self) -> None:
        _state()
        if self.process_set_id is None:
            raise ValueError(f"{self!r} is not registered: {self._how_to_register()}.")

    def _how_to_register(self) -> str:
        if self._mpi_comm is not None:
            return "a set made from a communicator is registered by init(process_sets=[...])"
        return "pass it to init(process_sets=...) or add_process_set() first"

    def included(self) -> bool:
        """Return True if this process is a member."""
        self._require()
        return self._rank >= 0

    def rank(self) -> int:
        """Return this process's rank within the set, or -1 when it is not a member."""
        self._require()
        return self._rank

    def size(self) -> int:
        """Return the number of ranks in the set."""
        self._require()
        return len(self.ranks)


_GLOBAL = object()


def _restore_process_set(ranks: Union[str, None, List[int]], ps_id: Any = _GLOBAL) -> ProcessSet:
    """Unpickle a set: the global one; the registered set with the same id and ranks; else the
    first registered with these ranks; else a new unregistered ``ProcessSet(ranks)`` (register it
    with ``add_process_set`` to use it). ``(None,)`` is how the first pickles named the global set."""
    if ranks == "global" or (ranks is None and ps_id is _GLOBAL):
        return global_process_set
    if _S is not None and ranks is not None:
        views = [v for v in _S.process_sets.values()
                 if v.owner is not global_process_set and list(v.ranks) == ranks]
        for view in sorted(views, key=lambda v: v.owner.process_set_id != ps_id):
            return view.owner
    return ProcessSet(ranks)


# The engine reads .rank/.size/.comm/.ranks; give it those names without the checks.
class _Ps:
    __slots__ = ("ranks", "comm", "rank", "size", "owner")

    def __init__(self, owner: ProcessSet) -> None:
        self.owner = owner
        self.ranks = owner.ranks
        self.comm = owner.comm
        self.rank = owner._rank
        self.size = len(owner.ranks)


global_process_set = ProcessSet()


class _State:
    def __init__(self) -> None:
        self.pid = os.getpid()  # another one: a process forked from this rank (see _forked)
        self.comm = None
        self.rank = 0
        self.size = 1
        self.local_comm = None
        self.cross_comm = None
        self.local_rank = 0
        self.local_size = 1
        self.cross_rank = 0
        self.cross_size = 1
        self.homogeneous = True
        self.thread_level = 0
        self.config = None
        self.engine = None
        self.process_sets = {}  # id -> _Ps (engine view)
        self.next_ps_id = 1
        self.pending_process_sets = {}  # name of an add_process_set call -> the caller's object
        self.timeline = None
        self.auto_names = AutoNames()  # the counts of unnamed calls (see ops._auto_name)


_S: Optional[_State] = None


def _forked() -> None:
    """In a process forked from a rank (a DataLoader's or a fork Pool's worker).

    The rank's queries (``rank()``, ``size()``...) still answer, as in Horovod; its collectives
    raise at once (they run on the rank's engine thread, which a fork does not copy: they used to
    wait forever), and its exit neither shuts the rank's hvddp down (that waited on the engine
    too) nor writes to the rank's timeline.
    """
    global _lock
    _lock = threading.RLock()  # (another thread may have held it at the fork)
    state = _S
    if state is not None and state.engine is not None:
        state.engine.forked(state.rank)
        if state.timeline:
            state.timeline.forget_in_child()


os.register_at_fork(after_in_child=_forked)
_atexit_registered = False
_singleton_cleanup_registered = False  # the exit-time removal of Open MPI's singleton segment


def _state() -> _State:
    s = _S
    if s is None:
        raise NotInitializedError(_not_initialized())
    return s


def _not_initialized() -> str:
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return "hvddp is not initialized: call hvddp.init() first (after hvddp.shutdown(), init() again)."
    # a process that multiprocessing started with 'spawn' or 'forkserver' (one forked from an
    # initialized process has its state) imported hvddp afresh: init() there is another MPI job
    return ("hvddp is not initialized in this process, a child process started by multiprocessing (e.g. "
            "a DataLoader worker with multiprocessing_context='spawn' or 'forkserver'), which imported "
            "hvddp afresh. Do not call hvddp.init() there (it would start a second MPI job, or fail): "
            "read what it needs (hvddp.rank(), hvddp.size()) in the parent and pass it on, e.g. as the "
            "dataset's attributes or bound into worker_init_fn with functools.partial.")


def _import_mpi():
    global _singleton_cleanup_registered
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            "mpi4py is not importable: `pip install mpi4py mpich` (or build mpi4py against your "
            f"cluster's MPI). Original error: {exc}") from exc
    if not _singleton_cleanup_registered and MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() == 1:
        # Open MPI leaks a singleton's 16 MiB shared-memory segment: removed at exit (where it is
        # still mapped, MPI finalizing later), whichever call started MPI (init(), or mpi_built()
        # in a script that never calls init()), also when init() raises (a bad HVDDP_* value)
        from . import _faults

        _singleton_cleanup_registered = True
        atexit.register(_faults.remove_singleton_segments, MPI.Get_library_version())
    return MPI


def _log_start(state, MPI) -> None:
    """HVDDP_LOG_LEVEL=INFO (or lower): one line from rank 0 with the job and the settings."""
    if not _logging.log.isEnabledFor(logging.INFO):
        return
    cfg = state.config
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    _logging.log.info(
        "initialized: %d rank(s), %d on this node, %d node(s); %s, thread level %s; fusion %d bytes, "
        "cycle %g ms, MPI pieces %d bytes, response cache %d, single-copy %s (from %d bytes), "
        "stall check %s%s, timeline %s", state.size, state.local_size, state.cross_size,
        " ".join(MPI.Get_library_version().splitlines()[0].split()), levels.get(state.thread_level, state.thread_level),
        cfg.fusion_threshold_bytes, cfg.cycle_time_ms, cfg.mpi_chunk_bytes, cfg.cache_capacity,
        "allowed" if cfg.cma else "off", cfg.cma_threshold_bytes,
        "off" if cfg.stall_check_disable else f"{cfg.stall_check_time_s:g} s",
        f", shutdown after {cfg.stall_shutdown_time_s:g} s" if cfg.stall_shutdown_time_s > 0 else "",
        cfg.timeline or "off")


_LAUNCHER_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def _check_launcher(world_size: int, MPI) -> None:
    """Refuse to run N separate size-1 jobs when the launcher started N processes."""
    if world_size != 1:
        return
    # the MPI launcher that started this process speaks for it: an `mpiexec -n 1` inside a srun
    # step (PMI_SIZE=1, SLURM_STEP_NUM_TASKS=2) is a size-1 run, not a mismatch
    direct = [var for var in _LAUNCHER_VARS[:2] if os.environ.get(var, "").isdigit()]
    for var in direct or _LAUNCHER_VARS[2:]:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            library = MPI.Get_library_version().splitlines()[0].strip()
            hint = {
                "PMI_SIZE": "an MPICH-family mpiexec (hydra)",
                "OMPI_COMM_WORLD_SIZE": "Open MPI's mpirun",
                "SLURM_STEP_NUM_TASKS": "srun",
            }[var]
            raise LauncherMismatchError(
                f"the launcher started {value} processes ({var}={value}, set by {hint}), but MPI "
                f"reports a world of size 1 in each: the launcher does not belong to the MPI "
                f"library mpi4py loaded ({library}). Launch with that library's own mpiexec "
                f"(`hvddprun`, or the `mpiexec` next to the Python that has mpi4py), or rebuild "
                f"mpi4py against the launcher's MPI; for srun, pass the --mpi=pmi2/pmix option "
                f"your site uses.")


def _register(state: _State, ps: ProcessSet, ps_id: int, world) -> None:
    """Create the communicator of ``ps``: collective over the whole world communicator. Its
    ranks were checked on every rank before (``_check_process_sets``, ``add_process_set``)."""
    if ps.ranks is None:
        ps.ranks = list(range(state.size))
    group = world.Get_group().Incl(ps.ranks)
    comm = world.Create(group)
    group.Free()
    ps.process_set_id = ps_id
    ps._rank = ps.ranks.index(state.rank) if state.rank in ps.ranks else -1
    ps.comm = comm if ps._rank >= 0 else None
    state.process_sets[ps_id] = _Ps(ps)


# Settings that decide which MPI calls a cycle makes: ranks that differ would desynchronize.
_AGREED = ("fusion_threshold_bytes", "mpi_chunk_bytes", "cache_capacity", "cma", "cma_threshold_bytes",
           "gpu_operations")


def _check_config_agrees(comm, cfg) -> None:
    """Raise on every rank when a setting in ``_AGREED`` differs between ranks."""
    suffixes = [next(k for k, v in _config.VARIABLES.items() if v[0] == field) for field in _AGREED]
    # each rank's value, and which variable it came from (HVDDP_ or HOROVOD_; None: the default)
    rows = comm.allgather([(getattr(cfg, field), (_config._lookup(os.environ, suffix) or (None,))[0])
                           for field, suffix in zip(_AGREED, suffixes)])
    for i, suffix in enumerate(suffixes):
        values = [row[i][0] for row in rows]
        if len(set(values)) > 1:
            read = [row[i][1] for row in rows]
            listed = ", ".join(f"rank {r}: {v!r} ({where or 'the default'})"
                               for r, (v, where) in enumerate(zip(values, read)))
            names = sorted({where for where in read if where}) or ["HVDDP_" + suffix]
            from mpi4py import MPI
            if "open mpi" in MPI.Get_library_version().lower():  # (-genv is hydra's: unknown to it)
                how = (f"mpirun -x HVDDP_{suffix}=..., or hvddprun, which forwards HVDDP_* variables; "
                       f"Open MPI passes an exported variable only to the ranks on the launching node")
            else:
                how = f"mpiexec -genv HVDDP_{suffix}=..., or export it before launching"
            raise ValueError(f"environment variable {' / '.join(names)} differs across ranks ({listed}); "
                             f"every rank must use the same value. Set it for the whole job ({how}).")


def init(comm=None, process_sets: Union[None, str, Sequence[ProcessSet]] = None) -> None:
    """Initialize hvddp: MPI, the communicators and the background engine.

    Idempotent: a second call while initialized does nothing (a process set it lists that is not
    registered yet raises ``ValueError``: register it with ``add_process_set``). Collective:
    every rank calls it.
    Without a launcher (``python train.py``) it is a size-1 run.

    Args:
        comm: an mpi4py communicator to run on, or a list of world ranks to use (the others
            get a size-1 world of their own); ``MPI.COMM_WORLD`` by default.
        process_sets: ``ProcessSet`` objects to register now (same list on every rank), or
            Horovod's ``"dynamic"``, which hvddp does not need (``add_process_set`` always works).

    Raises:
        LauncherMismatchError: the launcher said N > 1 processes but MPI says size 1.
        ValueError: an ``HVDDP_*`` variable has a bad value (named in the message).
    """
    global _S, _atexit_registered
    with _lock:
        if _S is not None:
            _refuse_late_sets(process_sets)
            return
        try:
            cfg, bad_env = _config.from_env(), None
        except ValueError as exc:  # raised below on every rank, not here on this one alone
            cfg, bad_env = None, exc
        MPI = _import_mpi()
        world = MPI.COMM_WORLD
        from . import _faults

        _faults.install(world)  # one rank's uncaught exception ends the job, even without -m mpi4py
        made = None  # a communicator made here from a list of ranks
        given = isinstance(comm, MPI.Comm)  # (its members alone call init: nothing on the world)
        every = None if given else _agree_on_world(world, comm, bad_env)  # None: the whole world
        if given:
            if comm == MPI.COMM_NULL:
                raise ValueError("init(comm=MPI.COMM_NULL): this rank is not in that communicator "
                                 "(a Split or Create that left it out); pass a communicator it "
                                 "belongs to, or a list of world ranks.")
            base = comm
        elif every is None:
            base = world
        else:
            ranks = every[world.Get_rank()]
            # disjoint lists make separate worlds (one launch split into jobs); a rank's list must
            # be the list of every rank it names, or Create would wait for ranks that make another
            clash = next(((r, m) for r, theirs in enumerate(every) for m in theirs if every[m] != theirs), None)
            if clash is not None:
                r, m = clash
                raise ValueError(f"init(comm=...): rank {r} passed {every[r]}, which names rank {m}, but rank "
                                 f"{m} passed {every[m]}; every rank a list names must pass that same list "
                                 f"(disjoint lists make separate worlds).")
            if world.Get_rank() in ranks:
                group = world.Get_group().Incl(ranks)
                base = made = world.Create(group)
                group.Free()
            else:
                world.Create(MPI.GROUP_EMPTY)
                base = MPI.COMM_SELF
        _check_launcher(world.Get_size(), MPI)
        _raise_together(base, bad_env)
        state = _State()
        state.config = cfg
        state.comm = base.Dup()
        if made is not None:
            made.Free()  # (only its duplicate is kept)
        state.rank = state.comm.Get_rank()
        state.size = state.comm.Get_size()
        state.thread_level = MPI.Query_thread()
        _logging.configure(cfg.log_level, state.rank)
        unknown = _config.ignored()
        if unknown and state.rank == 0:
            _logging.log.warning("these environment variables set nothing in hvddp and are ignored: %s "
                                 "(its settings: README.md, 'Environment variables')", ", ".join(unknown))
        if state.thread_level < MPI.THREAD_SERIALIZED and state.size > 1:
            raise BackendUnavailableError(
                "MPI was initialized without thread support (need MPI_THREAD_SERIALIZED or better, "
                "hvddp runs collectives on a background thread). Do not set "
                "mpi4py.rc.thread_level below 'serialized'.")
        try:  # before anything is registered or opened (process set ids, the timeline file)
            _check_config_agrees(state.comm, cfg)
            extra_sets = _check_process_sets(state.comm, process_sets)
        except (TypeError, ValueError):
            state.comm.Free()
            raise
        from .timeline import Timeline
        problem = None
        try:
            part = state.size < world.Get_size() and world.Get_rank() != 0  # (see from_config)
            state.timeline = Timeline.from_config(cfg, state.rank, f".world{world.Get_rank()}" if part else "")
        except OSError as exc:  # rank 0 opens the file; every rank must fail alike
            variable = _config.variable_name("TIMELINE")  # (or its alias)
            problem = (f"environment variable {variable}={cfg.timeline!r} is not usable on rank 0: "
                       f"{exc}. Fix or unset {variable}.")
        problem = state.comm.bcast(problem, root=0)
        if problem:
            if state.timeline:
                state.timeline.close()
            state.comm.Free()
            raise ValueError(problem)
        state.local_comm = state.comm.Split_type(MPI.COMM_TYPE_SHARED, key=state.rank)
        state.local_rank = state.local_comm.Get_rank()
        state.local_size = state.local_comm.Get_size()
        state.cross_comm = state.comm.Split(state.local_rank, state.rank)
        state.cross_rank = state.cross_comm.Get_rank()
        state.cross_size = state.cross_comm.Get_size()
        sizes = state.comm.allgather(state.local_size)
        state.homogeneous = len(set(sizes)) == 1
        global_process_set.ranks = None
        _register(state, global_process_set, 0, state.comm)
        for ps in extra_sets:
            _register(state, ps, state.next_ps_id, state.comm)
            state.next_ps_id += 1
        from .engine.loop import Engine

        def make_process_set(kind, request, world_comm):
            from .engine.messages import Kind
            if kind is Kind.ADD_PROCESS_SET:
                ps = state.pending_process_sets.pop(request.name, None) or ProcessSet(request.extra)
                _register(state, ps, state.next_ps_id, world_comm)
                state.next_ps_id += 1
                return ps
            ps_id = request.extra[0]
            view = state.process_sets.pop(ps_id, None)
            if view is not None:
                if view.comm is not None:
                    view.comm.Free()
                view.owner.process_set_id = None
                view.owner.comm = None
                view.owner._rank = -1
            return None

        state.engine = Engine(state.comm, cfg, state.process_sets, make_process_set, state.timeline,
                          state.auto_names)
        if state.rank == 0:
            _log_start(state, MPI)
        _S = state
        if not given or state.size == world.Get_size():
            # every rank of the world met in init()'s collectives: an earlier fatal error (a stall
            # the script caught, shutdown(), init() again) no longer leaves any rank stuck
            _faults.world_restored()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def shutdown() -> None:
    """Stop the engine and release the communicators. Idempotent; also runs at exit.

    Pending collectives on every rank fail with ``ShutdownError``.
    """
    global _S
    with _lock:
        state = _S
        if state is None:
            return
        _S = None
        if state.pid != os.getpid():  # a process forked from the rank: nothing of it to stop
            return
        try:
            state.engine.stop()
        finally:
            if state.timeline:
                state.timeline.close()
            stopped = not state.engine.running()
            for view in list(state.process_sets.values()):  # members or not: a later init()
                if stopped and view.comm is not None:          # registers them afresh everywhere
                    view.comm.Free()
                view.owner.comm = None
                if view.owner is not global_process_set:
                    view.owner.process_set_id = None
                    _forget_parts(view.owner)
            global_process_set.process_set_id = None
            if stopped:  # MPI has a few thousand communicator ids: init/shutdown loops ran out
                for comm in (state.local_comm, state.cross_comm, state.comm):
                    comm.Free()


def is_initialized() -> bool:
    """Return True between ``init()`` and ``shutdown()``."""
    return _S is not None


def rank() -> int:
    """Return this process's rank in the world communicator (0 .. size-1)."""
    return _state().rank


def size() -> int:
    """Return the number of processes."""
    return _state().size


def local_rank() -> int:
    """Return this process's rank among the processes on its node."""
    return _state().local_rank


def local_size() -> int:
    """Return the number of processes on this node."""
    return _state().local_size


def cross_rank() -> int:
    """Return the rank of this node among the nodes (ranks with the same local rank)."""
    return _state().cross_rank


def cross_size() -> int:
    """Return the number of nodes (processes with this local rank)."""
    return _state().cross_size


def is_homogeneous() -> bool:
    """Return True if every node runs the same number of processes."""
    return _state().homogeneous


def _is_mpi_comm(value: Any) -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(value, mpi.Comm)


def _forget_parts(ps: ProcessSet) -> None:
    """A set made from a communicator finds its ranks again at the next init() (its world may differ)."""
    if ps._mpi_comm is not None:
        ps.ranks, ps._parts = None, None


def _comm_ranks(sub, world) -> List[int]:
    """The ranks of ``world`` (hvddp's world communicator) that communicator ``sub`` holds."""
    if sub == sys.modules["mpi4py.MPI"].COMM_NULL:  # this rank is in none of the split's parts
        raise ValueError("init(process_sets=...): a ProcessSet was made from MPI.COMM_NULL; every rank "
                         "needs a communicator that holds it (e.g. from COMM_WORLD.Split).")
    group, world_group = sub.Get_group(), world.Get_group()
    try:  # on the class: mpi4py 3.x has a classmethod (group1, ranks1, group2), 4.x a method
        ranks = type(group).Translate_ranks(group, list(range(sub.Get_size())), world_group)
    finally:
        group.Free()
        world_group.Free()
    if any(r < 0 for r in ranks):  # MPI.UNDEFINED
        raise ValueError("init(process_sets=...): a ProcessSet's communicator holds processes outside "
                         "hvddp's world communicator.")
    return sorted(ranks)


def _check_process_sets(comm, process_sets) -> List[ProcessSet]:
    """The sets ``init(process_sets=...)`` registers, checked on every rank at once: each one is a
    communicator that every rank creates in the same order, so a list that differs across ranks
    (or is bad on one rank) would leave ranks waiting in ``init()`` for each other.

    A set made from an mpi4py communicator (Horovod's ``ProcessSet(comm)``, typically one part of
    ``COMM_WORLD.Split``) may hold different ranks on different ranks: every part found at that
    position is registered, in the order of its lowest rank, and each rank's object becomes the
    part that holds it.

    Raises:
        TypeError, ValueError: on every rank, naming the rank and what it passed.
    """
    size = comm.Get_size()
    sets, mine, problem = [], None, None
    if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
        process_sets = None  # Horovod's switch for add/remove after init; always on here
    try:
        if isinstance(process_sets, ProcessSet):
            raise TypeError(f"init(process_sets=...) takes a list of ProcessSet objects, got one "
                            f"ProcessSet ({process_sets!r}): pass [it].")
        if process_sets is not None and (isinstance(process_sets, (str, bytes)) or
                                         not isinstance(process_sets, Iterable)):
            raise TypeError(f"init(process_sets=...) takes a list of ProcessSet objects (or \"dynamic\"), "
                            f"got {type(process_sets).__name__} {process_sets!r}.")
        sets, listed = [], set()
        for ps in process_sets or ():  # each object once: listed twice, it is registered once
            if ps is not global_process_set and id(ps) not in listed:
                listed.add(id(ps))
                sets.append(ps)
        for ps in sets:
            if not isinstance(ps, ProcessSet):
                raise TypeError(f"init(process_sets=...) takes ProcessSet objects, got {type(ps).__name__}.")
            _forget_parts(ps)  # what an earlier, failed init() resolved
            bad = [r for r in ps.ranks or () if not 0 <= r < size] if ps._mpi_comm is None else []
            if bad:
                raise ValueError(f"init(process_sets=...): ProcessSet ranks {bad} are out of range for "
                                 f"world size {size}.")
        mine = [("comm", _comm_ranks(ps._mpi_comm, comm)) if ps._mpi_comm is not None
                else ("ranks", list(ps.ranks) if ps.ranks is not None else list(range(size))) for ps in sets]
    except (TypeError, ValueError) as exc:
        problem = exc
    every = _raise_together(comm, problem, mine, "process_sets")
    shape = [[kind if kind == "comm" else (kind, ranks) for kind, ranks in lists] for lists in every]
    differ = [r for r, lists in enumerate(shape) if lists != shape[0]]
    if differ:
        def shown(lists):  # a rank list as given; a communicator as the ranks it holds
            return "[" + ", ".join(str(ranks) if kind == "ranks" else f"communicator of {ranks}"
                                   for kind, ranks in lists) + "]"
        raise ValueError(f"init(process_sets=...) differs across ranks: rank 0 passed {shown(every[0])}, "
                         + ", ".join(f"rank {r} {shown(every[r])}" for r in differ)
                         + ". Pass the same sets, in the same order, on every rank (a ProcessSet made "
                         "from a communicator at the same position everywhere).")
    out = []
    for i, ps in enumerate(sets):
        if ps._mpi_comm is None:
            out.append(ps)
            continue
        parts = sorted({tuple(lists[i][1]) for lists in every}, key=lambda ranks: ranks[0])
        seen: set = set()
        for part in parts:  # the same parts on every rank: all raise alike
            if seen & set(part):
                raise ValueError(f"init(process_sets=...): the communicators at position {i} overlap "
                                 f"(parts {[list(p) for p in parts]}) instead of splitting the ranks.")
            seen |= set(part)
        siblings = []
        for part in parts:
            if part == tuple(mine[i][1]):
                ps.ranks = list(part)
                siblings.append(ps)
            else:
                siblings.append(ProcessSet(list(part)))
        for part in siblings:  # remove_process_set removes them together, in this order everywhere
            part._parts = siblings
        out += siblings
    return out


def _refuse_late_sets(process_sets: Any) -> None:
    """A second ``init()`` registers nothing: say so for a set it lists that is not registered,
    rather than let a later collective call it unregistered after the user passed it to init."""
    if not isinstance(process_sets, (list, tuple)):
        return
    late = [ps for ps in process_sets if isinstance(ps, ProcessSet) and ps.process_set_id is None]
    if late:
        how = ("a set made from a communicator can only be given to the first init()"
               if late[0]._mpi_comm is not None else "register it with hvddp.add_process_set(ps) on every rank")
        raise ValueError(f"init(process_sets=...): hvddp is already initialized, so this call registers "
                         f"nothing, and {late[0]!r} is not registered; {how}.")


def _checked_rank_list(comm: Sequence[Any], world_size: int):
    """``(ranks as ints, None)`` for ``init(comm=[...])``, or ``(None, the error)`` for a bad list."""
    bad = [r for r in comm if isinstance(r, bool) or not isinstance(r, numbers.Integral)]
    if bad:
        return None, TypeError(f"init(comm=...): a list of world ranks holds ints; received {list(comm)!r} "
                               f"(with {type(bad[0]).__name__} {bad[0]!r}): convert them with int().")
    ranks = [int(r) for r in comm]
    outside = [r for r in ranks if not 0 <= r < world_size]
    if not ranks or outside or len(set(ranks)) != len(ranks):
        why = ("it is empty" if not ranks else f"{outside} are not world ranks (0 to {world_size - 1})"
               if outside else "it repeats a rank")
        return None, ValueError(f"init(comm=...): received {ranks}, but {why}; pass distinct world "
                                f"ranks from 0 to {world_size - 1}.")
    return ranks, None


def _agree_on_world(world, comm: Any, bad_env: Optional[Exception]) -> Optional[List[List[int]]]:
    """Check, on every rank of the world at once, what each rank that was given no communicator
    passed as ``comm``: nothing (the whole world) or a list of world ranks. Returns every rank's
    list, or None when every rank passed nothing.

    One allgather carries this rank's errors too (a bad list or type, a bad ``HVDDP_*`` value), so
    that every rank raises, naming the rank and what it passed: ranks that passed different kinds
    (``init()`` on one, ``init(comm=[0, 1])`` on another) or a bad list met each other's collectives
    mismatched, and one raised a bare TypeError while the others waited in ``init()`` for ever.
    """
    ranks, problem = None, None
    if comm is not None:
        if isinstance(comm, (str, bytes)) or not isinstance(comm, Iterable):
            problem = TypeError(f"init(comm=...) takes an mpi4py communicator or a list of world ranks, "
                                f"got {type(comm).__name__} {comm!r}.")
        else:  # a list, tuple, range or numpy array of ranks
            ranks, problem = _checked_rank_list(list(comm), world.Get_size())
    error = problem or bad_env
    mine = None if error is None else (type(error).__name__, str(error),
                                       "init(comm=...)" if problem is not None else "environment")
    every = world.allgather((comm is None, ranks, mine))
    if error is not None:
        raise error
    first = next(((r, e) for r, (_, _, e) in enumerate(every) if e is not None), None)
    if first is not None:
        r, (kind, message, source) = first
        raise (TypeError if kind == "TypeError" else ValueError)(f"rank {r}'s {source}: {message}")
    whole = [r for r, (none, _, _) in enumerate(every) if none]
    if len(whole) == len(every):
        return None
    if whole:
        listing = next(r for r, (none, _, _) in enumerate(every) if not none)
        raise ValueError(f"init(comm=...): rank(s) {whole} passed no comm (the whole world) and rank {listing} "
                         f"passed {every[listing][1]}; pass the same kind on every rank: a list of world ranks "
                         f"on every rank, or none.")
    return [theirs for _, theirs, _ in every]


def _raise_together(comm, error: Optional[Exception], payload: Any = None, source: str = "environment") -> list:
    """Raise ``error`` (a ``ValueError`` or ``TypeError`` found on this rank alone, in its
    ``source``) on every rank of ``comm``: a rank that raised alone would leave the others waiting
    in ``init()``'s next collective (without ``-m mpi4py``). Returns every rank's ``payload``,
    gathered in the same collective."""
    every = comm.allgather((payload, None if error is None else (type(error).__name__, str(error))))
    if error is not None:
        raise error
    first = next(((r, e) for r, (_, e) in enumerate(every) if e is not None), None)
    if first is not None:
        kind = TypeError if first[1][0] == "TypeError" else ValueError
        raise kind(f"rank {first[0]}'s {source}: {first[1][1]}")
    return [p for p, _ in every]


def mpi_threads_supported() -> bool:
    """Return True if MPI provides MPI_THREAD_MULTIPLE."""
    MPI = _import_mpi()
    return _state().thread_level == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    """Return True: the MPI backend (mpi4py) is always part of hvddp."""
    try:
        _import_mpi()
    except BackendUnavailableError:
        return False
    return True


def mpi_enabled() -> bool:
    """Return True when collectives run over MPI (always, once initialized)."""
    return mpi_built()


def cuda_built() -> bool:
    """Return True if CuPy is importable and sees a CUDA device (cached; imports CuPy once)."""
    from .backends.device import cuda_built as _cuda_built

    return _cuda_built()


def nccl_built() -> int:
    """Return NCCL's version code (e.g. 22105 for 2.21.5) if CuPy's NCCL binding loads and a CUDA
    device is visible, else 0: an int, as Horovod's (true when NCCL is there)."""
    from .backends.device import nccl_version

    return nccl_version()


def gloo_built() -> bool:
    """Return False: hvddp has no Gloo controller (MPI on the CPU, NCCL on the GPU)."""
    return False


def gloo_enabled() -> bool:
    """Return False: hvddp has no Gloo controller."""
    return False


def ccl_built() -> bool:
    """Return False: hvddp has no oneCCL backend."""
    return False


def ddl_built() -> bool:
    """Return False: hvddp has no IBM DDL backend."""
    return False


def rocm_built() -> bool:
    """Return False: hvddp has no ROCm path."""
    return False


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set after ``init()``. Every rank must call it, in the same order.

    Args:
        process_set: a ``ProcessSet`` or a list of world ranks.

    Returns:
        The registered ``ProcessSet``.

    Raises:
        ValueError: a bad argument on this rank (ranks out of range, a set already registered);
            the other ranks then raise ``MismatchError`` naming this one.
        MismatchError: ranks passed different rank lists, or another rank refused its argument.
    """
    from . import ops

    def checked() -> ProcessSet:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps._mpi_comm is not None:
            raise ValueError("add_process_set(): a ProcessSet made from a communicator can only be registered "
                             "by init(process_sets=[...]) (as in Horovod); pass a list of ranks here.")
        if ps.ranks is None:
            raise ValueError("add_process_set() needs explicit ranks; the global set always exists.")
        if ps.process_set_id is not None:
            raise ValueError(f"{ps!r} is already registered.")
        bad = [r for r in ps.ranks if not 0 <= r < _state().size]
        if bad:
            raise ValueError(f"add_process_set: ranks {bad} are out of range for world size {_state().size}.")
        return ps

    state, name, ps = ops._process_set_call("add", checked)
    return ops._process_set_op("add", ps, state, name)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator. Every rank calls it.

    Returns:
        True (as Horovod's).

    Raises:
        ValueError: the global set or an unregistered one on this rank; the other ranks then
            raise ``MismatchError`` naming this one.
        MismatchError: ranks named different sets, or another rank refused its argument.
    """
    from . import ops

    def checked() -> None:
        if process_set is global_process_set:
            raise ValueError("the global process set cannot be removed.")
        if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
            raise ValueError(f"remove_process_set: {process_set!r} is not a registered process set.")

    state, name, _ = ops._process_set_call("remove", checked)
    # a set made from a communicator is a different part on different ranks: every part goes,
    # in the order init() registered them, the same on every rank
    for i, part in enumerate(process_set._parts or [process_set]):
        ops._process_set_op("remove", part, state, name if i == 0 else None)
    return True
