"""Make one rank's failure end the whole job instead of leaving the others waiting.

``install()`` is called by ``hvddp.init()`` before its first collective. In a multi-process
world it replaces ``sys.excepthook``: an exception that escapes the main thread on any rank
prints that rank's traceback (rank-prefixed) and calls ``MPI_Abort`` on ``COMM_WORLD``, which
makes the launcher stop every rank at once. Without it, the failing rank would run its exit
handlers, other ranks could wait for it forever in a collective, and the job would hang. This is
what ``python -m mpi4py`` does; with ``install()`` a plain ``python train.py`` gets it too.

When the job runs under ``hvddprun``, each rank also leaves small status files in the directory
that ``hvddprun`` names in ``HVDDP_RUNNER_STATUS_DIR`` (rank, pid, host; the exception, if
any; a mark once it exited cleanly), and runs under a small monitor process (``rank_monitor``,
this file run as a script) that records how its rank ended (exit code or signal) before the MPI
launcher tears the job down. ``report`` turns those files into hvddprun's verdict: which rank
failed first and how, and a failure even when the launcher reported success although a rank
vanished (``os._exit(0)``). ``remove_leaked_shm`` removes the shared memory killed ranks leave.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as the rank monitor: hvddp/ must not shadow standard modules
    del sys.path[0]

import atexit
import glob
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["install", "installed", "world_broken", "world_restored", "STATUS_DIR_VARIABLE", "rank_monitor", "report", "remove_leaked_shm"]

# Private channel from hvddprun to its ranks (not a user setting, so not in config.py).
STATUS_DIR_VARIABLE = "HVDDP_RUNNER_STATUS_DIR"

_lock = threading.Lock()
_installed = False
_rank = -1
_size = 0
_status_dir: Optional[str] = None
_broken: Optional[str] = None
_pid = 0  # the rank's: a process forked from it (a DataLoader's worker) is not the rank


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
    global _installed, _rank, _size, _status_dir, _pid
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
        _pid = os.getpid()
        os.register_at_fork(after_in_child=_forked_from_the_rank)
        _status_dir = os.environ.get(STATUS_DIR_VARIABLE) or None
        if _status_dir:
            _write_status("start", {"rank": _rank, "size": _size, "pid": os.getpid(),
                                    "host": socket.gethostname()})
        # Registered before init() registers shutdown(), so it runs after it, and before
        # mpi4py finalizes MPI.
        atexit.register(_at_exit, world)
        _installed = True
        return True


def _forked_from_the_rank() -> None:
    """In a process forked from a rank (a DataLoader's or a fork Pool's worker): close its copy of
    the rank's PMI socket (MPICH's PMI_FD).

    Hydra ends the job when that socket closes before the rank finalized; a worker holding a copy
    kept a killed rank's job running until the worker noticed and exited (5 s for a DataLoader's),
    and a worker's own PMI traffic (MPI_Finalize at its exit) would be read as the rank's. The
    rank's abort-on-exception and exit hooks do nothing in such a process either.
    """
    fd = os.environ.get("PMI_FD", "")
    if fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def world_broken(reason: str) -> None:
    """Record that this rank's collectives can no longer complete (a fatal stall, a failed engine).

    Call it where the engine stops with such an error. At exit the process then aborts the job
    instead of finalizing MPI: ``MPI_Finalize`` would wait for ranks that are stuck elsewhere (in
    their own code, not in a collective) and never get there, and the job would hang after every
    rank that could see the error has already reported it. A no-op unless ``install()`` ran.
    """
    global _broken
    if _installed and _broken is None:
        _broken = reason


def world_restored() -> None:
    """Forget an earlier ``world_broken``: every rank of the world has since met in a collective
    (``hvddp.init()`` again after the error), so none is stuck where ``MPI_Finalize`` would wait
    for it, and a job that recovered must not be aborted at its exit."""
    global _broken
    _broken = None


def _at_exit(world) -> None:
    if os.getpid() != _pid:  # a process forked from the rank
        return
    if _broken is None:
        if _status_dir:
            _write_status("done", {"rank": _rank})
        return
    if _status_dir:
        _write_status("failed", {"rank": _rank, "error": _broken.splitlines()[0][:300],
                                 "time": time.time()})
    _report_and_abort(world, f"[hvddp rank {_rank}] exiting after a fatal hvddp error; aborting the "
                             f"job (MPI_Abort) instead of finalizing MPI, which would wait for ranks "
                             f"that may never get there. The error: {_broken.splitlines()[0][:500]}\n")


def _abort_on_exception(previous, etype, value, tb, world) -> None:
    if os.getpid() != _pid:  # a process forked from the rank: its exception ends it alone
        previous(etype, value, tb)
        return
    text = ""
    try:
        text = "".join(traceback.format_exception(etype, value, tb))
        if _status_dir:
            _write_status("failed", {"rank": _rank, "error": f"{etype.__name__}: {value}",
                                     "traceback": text, "time": time.time()})
        header = (f"[hvddp rank {_rank}] uncaught {etype.__name__} on rank {_rank} of {_size} "
                  f"(pid {os.getpid()} on {socket.gethostname()}); aborting the job with MPI_Abort "
                  f"so that the other ranks do not wait for it. Traceback of rank {_rank}:\n")
        if previous is sys.__excepthook__:
            text = header + text
        else:  # a custom hook (IPython, rich, ...) prints the traceback its own way
            _write_stderr(header)
            previous(etype, value, tb)
            text = ""
    except BaseException:  # reporting must never stop the abort
        pass
    _report_and_abort(world, text)


def _write_stderr(text: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:
        pass


def _report_and_abort(world, text: str) -> None:
    """Write ``text`` in one piece, give the launcher a moment to forward it, then abort."""
    _write_stderr(text)
    try:
        time.sleep(0.2)  # launchers stop forwarding output once they see the abort
    except BaseException:  # a second Ctrl-C must not skip the abort
        pass
    world.Abort(1)
    # MPICH 5.0.2's MPI_Abort can return before the launcher kills the job: exit here, so that
    # atexit does not run (it would report this rank done, and shut hvddp down under the peers)
    os._exit(1)


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


# The rank monitor ---------------------------------------------------------------------------
# hvddprun runs each rank as a child of a small monitor process: this file run as a script,
# `python hvddp/_faults.py --rank-monitor -- cmd...`, importing neither hvddp, numpy nor MPI.
# The monitor is what the MPI launcher starts and watches; it sees how its rank ended (exit code,
# signal), writes that down with the rank's number before the launcher tears the job down, and
# turns "exited 0 without finishing" into a failure.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGALRM")
# signals a rank handles and goes on (a checkpoint before Slurm's time limit): not the launcher stopping it
_CONTINUE_SIGNALS = ("SIGUSR1", "SIGUSR2")
_LAUNCHER_STOP_WAIT_S = 3.0  # how long a monitor waits for hydra to stop the job after its rank failed


def signal_at_parent_death(signum: int = signal.SIGKILL) -> None:  # in a child, between fork and exec
    """The child gets ``signum`` when its parent dies (Linux' PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signum)
    except Exception:  # not Linux: the launcher's own cleanup has to do
        pass


_die_with_parent = signal_at_parent_death  # the rank: SIGKILL


# Launchers' processes that start the ranks and signal each one's whole process group: MPICH's
# hydra proxy, Open MPI 5's PRRTE (prterun on the launching node, prted on the others)
_GROUP_SIGNALLERS = ("hydra_pmi_proxy", "prterun", "prted", "prte")


def _signals_reach_the_group() -> bool:
    """True when this process leads its process group and its parent is a launcher's process
    that signals each process it started as a group (``_GROUP_SIGNALLERS``)."""
    try:
        with open(f"/proc/{os.getppid()}/comm") as f:
            parent = f.read().strip()
    except OSError:
        return False
    return os.getpgrp() == os.getpid() and parent in _GROUP_SIGNALLERS


def _in_my_group(pid: int) -> bool:
    """Whether process ``pid`` is in this process's group (False once it is gone)."""
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:
        return False


def _describe(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = (" (a kill from outside the process: often the out-of-memory killer, see `dmesg`)"
                if -code == signal.SIGKILL else "")
        return f"was killed by signal {-code} ({name}){hint}"
    return f"exited with code {code}"


def _release_pmi_socket(stopped: list) -> None:
    """Close this monitor's copy of its failed rank's PMI socket, then wait a moment to be stopped.

    Hydra's proxy stops the other ranks when it reads EOF on a rank's PMI socket before that rank
    finalized. The monitor inherited the socket (PMI_FD) with the rest of the rank's descriptors,
    so the EOF used to come only from the monitor's own exit, which also closes its stdout and
    stderr and ends in SIGCHLD. When the proxy woke on stderr's close and reaped the monitor before
    it read the PMI socket (2 busy cores, or a slowed proxy), hydra 5.0.2 did not clean up, and the
    other ranks waited in their collective until the job was killed from outside. Closed while
    the monitor lives and its stdio is open, the EOF is read first and the proxy kills every rank,
    this monitor included; if nothing comes (no hydra, the rank finalized, auto-cleanup disabled),
    the monitor exits as before after a short wait.
    """
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit():
        return
    try:
        os.close(int(fd))
    except OSError:
        return
    signals = len(stopped)
    deadline = time.monotonic() + _LAUNCHER_STOP_WAIT_S
    while time.monotonic() < deadline and len(stopped) == signals:  # a forwarded stop ends the wait
        time.sleep(0.02)


def rank_monitor(command: Sequence[str]) -> int:
    """Run one rank's ``command`` as a child; report how it ended; return its exit status.

    The child inherits every file descriptor (MPICH's PMI_FD) and dies with the monitor
    (PR_SET_PDEATHSIG), so killing the monitor, as launchers do, kills the rank too.
    """
    directory = os.environ.get(STATUS_DIR_VARIABLE, "")
    rank = next((os.environ[v] for v in _RANK_VARIABLES if os.environ.get(v, "").isdigit()), "?")
    signals = {getattr(signal, name) for name in _FORWARDED_SIGNALS if hasattr(signal, name)}
    # blocked from here on and taken with sigtimedwait (Linux), which says who sent each; the
    # rank unblocks them before its exec
    signal.pthread_sigmask(signal.SIG_BLOCK, signals | {signal.SIGCHLD})

    def child_setup():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals | {signal.SIGCHLD})
        _die_with_parent()

    try:
        child = subprocess.Popen(list(command), close_fds=False, preexec_fn=child_setup)
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals | {signal.SIGCHLD})
        print(f"hvddprun: rank {rank}: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127

    stopped = []  # signals the launcher sent: the rank did not fail by itself
    # The rank stays in this monitor's process group, so that a launcher's kill of the group
    # also ends what the rank started (a DataLoader's workers). Hydra's proxy (and Open MPI's
    # PRRTE) makes each monitor a group leader and signals the whole group: the rank has the
    # signal already (a forwarded copy ran its SIGTERM handler twice), so what the proxy sends
    # is not passed on, nor what a process of the group sends the group (the rank's own killpg). What anyone else sends is
    # (to the monitor alone, from `ps`; a kill of the whole group from outside cannot be told
    # apart and reaches the rank twice, as can one from a process of the group that is gone
    # by the time it is looked up), and a rank that then dies of it failed by it. Other
    # launchers may signal the monitor alone: everything but the group's own is passed on there.
    proxy = os.getppid() if _signals_reach_the_group() else None
    leader = os.getpgrp() == os.getpid()  # (then the group is this monitor's, the rank's and theirs)
    code = None
    while code is None:
        info = signal.sigtimedwait(signals | {signal.SIGCHLD}, 1.0)  # 1 s: a missed SIGCHLD
        if info is not None and info.si_signo != signal.SIGCHLD:
            from_proxy = proxy is not None and info.si_pid == proxy
            # (si_pid 0: a sender outside this PID namespace, such as a container's host)
            from_group = leader and not from_proxy and info.si_pid > 0 and _in_my_group(info.si_pid)
            goes_on = signal.Signals(info.si_signo).name in _CONTINUE_SIGNALS
            if (from_proxy or (proxy is None and not from_group)) and not goes_on:
                stopped.append(info.si_signo)
            if not (from_proxy or from_group):
                try:
                    child.send_signal(info.si_signo)
                except OSError:
                    pass
        code = child.poll()

    def note(signum, _frame):  # the rank has ended: a signal now is the launcher stopping the job
        stopped.append(signum)

    for signum in signals:
        signal.signal(signum, note)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals | {signal.SIGCHLD})
    started = os.path.exists(os.path.join(directory, f"rank-{rank}.start")) if directory else False
    finished = os.path.exists(os.path.join(directory, f"rank-{rank}.done")) if directory else True
    failed = os.path.exists(os.path.join(directory, f"rank-{rank}.failed")) if directory else False
    vanished = code == 0 and started and not finished and not stopped
    if (code != 0 and not stopped) or vanished:
        host = os.uname().nodename if hasattr(os, "uname") else "?"
        what = _describe(code) if code else "exited with code 0 without finishing (os._exit?)"
        if directory and not failed:
            try:
                tmp = os.path.join(directory, f".rank-{rank}.exit.tmp")
                with open(tmp, "w") as f:
                    json.dump({"rank": rank, "pid": child.pid, "host": host, "code": code,
                               "what": what, "time": time.time()}, f)
                os.replace(tmp, os.path.join(directory, f"rank-{rank}.exit"))
            except OSError:
                pass
        if not failed:  # an uncaught exception already printed its own traceback
            print(f"hvddprun: rank {rank} (pid {child.pid} on {host}) {what}; the launcher will "
                  f"now stop the other ranks.", file=sys.stderr, flush=True)
        if not finished:  # it left without finalizing: let hydra see that while this monitor lives
            _release_pmi_socket(stopped)
    if vanished:
        return 1  # make the launcher fail the job now, not report success later
    if code < 0:  # end the way the rank ended, so the launcher reports the same signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


# Status of the ranks after the run --------------------------------------------------------------
def failed_ranks(directory: str) -> List[int]:
    """The ranks that have failed so far (an uncaught exception, or an abnormal end the rank
    monitor saw before the rank finished with hvddp), from their status files; hvddprun checks
    this while the launcher runs. A non-zero exit after a clean finish is the launcher's call."""
    try:
        names = set(os.listdir(directory))
    except OSError:
        return []
    found = (re.fullmatch(r"rank-(\d+)\.(failed|exit)", name) for name in names)
    return sorted(int(m.group(1)) for m in found
                  if m and (m.group(2) == "failed" or f"rank-{m.group(1)}.done" not in names))


def _read_status(directory: str) -> Dict[str, Dict[int, dict]]:
    status: Dict[str, Dict[int, dict]] = {"start": {}, "done": {}, "failed": {}, "exit": {}}
    for name in os.listdir(directory):
        match = re.fullmatch(r"rank-(\d+)\.(start|done|failed|exit)", name)
        if not match:
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                status[match.group(2)][int(match.group(1))] = json.load(f)
        except (OSError, ValueError):
            continue
    return status


def report(directory: str, np_: int, returncode: int, stopped_by: Optional[str] = None,
           monitored: bool = True) -> Tuple[int, List[str]]:
    """Explain a run from the ranks' status files; return the exit code to use and the lines.

    Ranks leave files once they called ``hvddp.init()`` (start, done, failed) and, under the rank
    monitor, when they ended abnormally (exit). The first rank to end abnormally is named as the
    cause, except that a ``ShutdownError`` (a peer left while this rank waited for it) comes after
    any other failure or exit, whatever the clock says: the peer announces its shutdown before its
    monitor sees it exit. When only such errors are left, the ranks that finished are named as the
    ones that left. A rank that neither failed nor finished makes the run fail even if the
    launcher returned 0. ``stopped_by`` names the signal hvddprun got and passed on, if any: ranks
    that ended without a word then were stopped, not lost. ``monitored``: the ranks ran under
    the rank monitor (hvddprun's default), which records every abnormal end it sees.
    """
    status = _read_status(directory)
    started, done, failed, exits = status["start"], status["done"], status["failed"], status["exit"]
    lines: List[str] = []

    def who(rank: int) -> str:
        info = started.get(rank) or exits.get(rank) or {}
        return f"rank {rank} (pid {info.get('pid', '?')} on {info.get('host', '?')})"

    events = []  # (follows another rank's failure, time, rank, what happened)
    for rank, info in failed.items():
        error = str(info.get("error", "?"))
        events.append((error.startswith("ShutdownError"), info.get("time", float("inf")), rank,
                       f"raised {error}"))
    for rank, info in exits.items():
        events.append((False, info.get("time", float("inf")), rank, str(info.get("what", "failed"))))
    events.sort(key=lambda e: e[:3])
    leavers = sorted(r for r in done if r not in failed and r not in exits)
    vanished = sorted(r for r in started if r not in done and r not in failed and r not in exits)
    if stopped_by:  # what the ranks did then follows from the signal: none of them is the cause
        lines.append(f"hvddprun: stopped by {stopped_by}, which it passed on to the launcher.")
        lines += [f"hvddprun: then {who(rank)} {what}" for _, _, rank, what in events]
        if vanished:
            lines.append(f"hvddprun: the launcher stopped {', '.join(who(r) for r in vanished)}.")
    elif events:
        if all(e[0] for e in events) and leavers:
            # only peers' ShutdownErrors: ranks that finished left while the others still waited (a
            # rank's exit code is not known at its exit: sys.exit(2) reads like the end of the script)
            lines.append(f"hvddprun: the first rank{'s' if len(leavers) > 1 else ''} to fail: "
                         f"{', '.join(who(r) for r in leavers)}, which left the job (hvddp shut down at its "
                         f"exit: the script ended early, or called sys.exit() or shutdown()) while other "
                         f"ranks still had collectives pending.")
            after = events
        elif all(e[0] for e in events) and (quitters := _shut_down_ranks(failed, events)):
            # only ShutdownErrors, and the rank(s) they name still running when the launcher
            # stopped the job: those called shutdown() early, not the ranks that waited for them
            lines.append(f"hvddprun: the first rank{'s' if len(quitters) > 1 else ''} to fail: "
                         f"{', '.join(who(r) for r in quitters)}, which shut hvddp down (shutdown(), "
                         f"or the process's exit) while other ranks still had collectives pending.")
            after = [e for e in events if e[2] not in quitters]
        else:
            _, _, rank, what = events[0]
            lines.append(f"hvddprun: the first rank to fail: {who(rank)}, which {what}")
            after = events[1:]
            code = exits.get(rank, {}).get("code") if rank not in failed else None
            if isinstance(code, int) and returncode != 0:
                # the failing rank's own code (os._exit(7): 7; 1 for an exit with 0 before it
                # finished), not the launcher's (hydra's: the signal it stopped the others with, 9)
                returncode = code if code > 0 else 128 - code if code < 0 else 1
        lines += [f"hvddprun: then {who(rank)} {what}" for _, _, rank, what in after]
        lines.append("hvddprun: the job was aborted.")
        if vanished:
            lines.append(f"hvddprun: the launcher then stopped {', '.join(f'rank {r}' for r in vanished)}.")
    elif vanished and returncode != 0 and not monitored:
        lines.append("hvddprun: no rank finished cleanly (run without the rank monitor, the launcher "
                     "names at most a pid): " + ", ".join(who(r) for r in vanished) + ".")
    elif vanished and returncode != 0:
        lines.append("hvddprun: the launcher stopped " + ", ".join(who(r) for r in vanished) + " before "
                     "it finished, and no rank reported a failure: a rank ended the job outside "
                     "hvddp (MPI_Abort, or sys.exit(N) under python -m mpi4py, after hvddp shut "
                     "down); the launcher's own message above names it.")
    if returncode == 0 and len(started) == np_ and (vanished or exits):
        lines.append("hvddprun: the launcher reported success, but not every rank finished; failing "
                     "the job.")
        return 1, lines
    return returncode, lines


def _shut_down_ranks(failed: Dict[int, dict], events: list) -> List[int]:
    """The ranks the ``ShutdownError`` events name as shut down ("on rank(s) [1, 2]"), that did
    not fail themselves."""
    named = set()
    for _, _, rank, _ in events:
        match = re.search(r"shut down on rank\(s\) \[([\d, ]*)\]", str(failed.get(rank, {}).get("error", "")))
        if match:
            named.update(int(r) for r in match.group(1).split(",") if r.strip())
    return sorted(r for r in named if r not in failed)


# Shared-memory segments left by ranks that were killed ------------------------------------------
_SHM_PATTERNS = ("mpich_shm_*", "sm_segment.*", "vader_segment.*", "shm-col-space-*")


def _mapped_files() -> set:
    """Every file some live process maps or holds open (Linux /proc)."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        found.add(line.split(None, 5)[-1].strip().replace(" (deleted)", ""))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    found.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def remove_leaked_shm(since: float, directory: str = "/dev/shm") -> List[str]:
    """Unlink MPI shared-memory segments created after ``since`` that no live process uses.

    MPICH (and Open MPI) unlink their node-local segments at a clean exit; a rank killed by a
    signal or an abort leaves them behind in memory-backed ``/dev/shm``, one per job and node.
    Only segments that no process maps or holds open are removed, so concurrent jobs are safe.

    Returns:
        The paths removed.
    """
    if not os.path.isdir(directory) or not os.path.isdir("/proc"):
        return []
    candidates = []
    for pattern in _SHM_PATTERNS:
        for path in glob.glob(os.path.join(directory, pattern)):
            try:
                if os.stat(path).st_mtime >= since - 1 and os.stat(path).st_uid == os.getuid():
                    candidates.append(path)
            except OSError:
                continue
    if not candidates:
        return []
    time.sleep(0.2)  # let a segment that is being created get mapped by its creator
    busy = _mapped_files()
    return _unlink([path for path in candidates if path not in busy])


def _unlink(paths) -> List[str]:
    """Unlink ``paths``; return those removed (one gone meanwhile, or not ours, is skipped)."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def remove_singleton_segments(library: str, maps: str = "/proc/self/maps") -> List[str]:
    """Unlink the ``/dev/shm`` segments of an Open MPI process started without a launcher.

    Open MPI (5.0.x) never removes the 16 MiB ``sm_segment.*`` of a singleton (``python
    train.py``, no mpirun), so every such run left one behind in memory-backed ``/dev/shm``.
    The segment stays usable while mapped; unlinking it only frees it when the process ends.
    Under a launcher, or with another MPI, this does nothing; a launcher's environment that
    promised more ranks than the one this process got (another Open MPI's mpirun: init() refused
    the mismatch) still left a singleton, whose segment is removed.

    Returns:
        The paths removed.
    """
    size = os.environ.get("OMPI_COMM_WORLD_SIZE")
    launched = size == "1" or (size is None and "PMIX_RANK" in os.environ)  # (registered at size 1 only)
    if "open mpi" not in library.lower() or launched:
        return []
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/dev/shm/sm_segment." in line}
    except OSError:
        return []
    return _unlink(sorted(paths))


if __name__ == "__main__":  # the rank monitor: python hvddp/_faults.py --rank-monitor -- cmd...
    args = sys.argv[1:]
    if args[:1] != ["--rank-monitor"]:
        sys.exit("usage: _faults.py --rank-monitor -- command...")
    sys.exit(rank_monitor(args[2:] if args[1:2] == ["--"] else args[1:]))
