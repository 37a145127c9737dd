"""Rank-side script of tests/test_faults.py: train a little, then fail in the way argv[1] says.

    mpiexec -n 2 python [-m mpi4py] tests/fault_scripts/faults.py MODE [--install]

Modes (rank 1 misbehaves at step 3 while rank 0 waits in a collective):
  ok        every rank finishes
  raise     rank 1 raises RuntimeError; rank 0 waits in an allreduce
  raise_raw rank 1 raises; rank 0 waits outside hvddp, in a raw MPI bcast from rank 1 (this one
            hangs forever unless something aborts the job)
  sigkill   rank 1 sends itself SIGKILL
  sigkill_forked  rank 1 forks a worker (as a DataLoader does; it sleeps 60 s) and then sends
            itself SIGKILL
  exit0     rank 1 calls os._exit(0)
  exit3     rank 1 calls os._exit(3)
  skip      rank 1 skips step 3's allreduce (stall)
  skip_cached  rank 0 submits a name rank 1 never does, while both keep running a cached one
  slow      rank 1 sleeps 3 s before step 3's allreduce
  stuck     rank 1 sleeps 600 s before step 3's allreduce (stuck in its own code)
  skip_reinit  as skip; every rank catches the StallError, shuts down, calls init() again and
            finishes (exit 0)
--install calls hvddp._faults.install() explicitly (hvddp.init() does it once wired).
"""

import os
import signal
import sys
import time

import numpy as np

import hvddp
import hvddp._faults

mode = sys.argv[1]


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: lines of two ranks must not interleave
    sys.stdout.flush()


hvddp.init()
if "--install" in sys.argv:
    hvddp._faults.install()
if "--patch-engine" in sys.argv:  # what the core request asks Engine._stop_with to do
    from hvddp.engine import loop

    _stop_with = loop.Engine._stop_with

    def _patched(self, error, *args):
        if not isinstance(error, hvddp.ShutdownError):
            hvddp._faults.world_broken(f"{type(error).__name__}: {error}")
        return _stop_with(self, error, *args)

    loop.Engine._stop_with = _patched
rank, size = hvddp.rank(), hvddp.size()
say(f"rank {rank}: started pid {os.getpid()} installed={hvddp._faults.installed()}")
start = time.monotonic()
if mode == "sigkill_forked" and rank == 1 and os.fork() == 0:
    time.sleep(60)  # a worker: it ends with os._exit, as multiprocessing's do
    os._exit(0)
if mode == "oom":  # rank 1 cannot allocate an allgather's output: it fails alone, before MPI
    from hvddp.engine import executor

    if rank == 1:
        real_dispatch = executor.Executor._dispatch

        def failing_dispatch(self, request, entry, info):
            if request.name == "gather.big":
                raise MemoryError("simulated: cannot allocate the output")
            return real_dispatch(self, request, entry, info)

        executor.Executor._dispatch = failing_dispatch
    try:
        hvddp.allgather(np.ones((4, 2)), name="gather.big")
        say(f"rank {rank}: gathered")
    except hvddp.HvddpError as exc:
        say(f"rank {rank}: GATHER FAILED: {exc}")
    sys.exit(0)  # caught and gone on: the exit must end the job (rank 0 waits inside MPI)
if mode == "local_failure":  # rank 1 alone fails packing a fusion batch, before its MPI call
    x = [np.ones(4), np.ones(5)]
    hvddp.grouped_allreduce(x, name="warm")
    if rank == 1:
        from hvddp.engine import executor

        def broken_buffer(self, dtype, count):
            raise RuntimeError("simulated: a failure on this rank alone")

        executor.Executor._fusion_buffer = broken_buffer
    try:
        hvddp.grouped_allreduce(x, name="packed")
        say(f"rank {rank}: reduced")
    except hvddp.HvddpError as exc:
        say(f"rank {rank}: REDUCE FAILED: {exc}")
    sys.exit(0)  # caught and gone on: the exit must end the job (rank 0 waits inside MPI)
if mode == "communicators":  # process sets never removed, until MPI makes no more communicators
    from mpi4py import MPI

    if "open mpi" in MPI.Get_library_version().lower():
        # Open MPI makes 65,532 (MPICH about 2,000): take all but a few hundred with raw MPI first
        group = MPI.COMM_WORLD.Get_group()
        held = [MPI.COMM_WORLD.Create(group) for _ in range(65000)]
        group.Free()
    try:
        for count in range(5000):
            hvddp.add_process_set([0, 1])
        say(f"rank {rank}: registered 5000")
    except hvddp.HvddpError as exc:
        say(f"rank {rank}: ADD FAILED after {count}: {exc}")
    sys.exit(0)
try:
    if mode == "skip_cached":  # the stall must end the job although every cycle has cached work
        x = np.ones(4)
        for _ in range(3):
            hvddp.allreduce(x, name="cached")
        pending = hvddp.allreduce_async(x, name="skipped") if rank == 0 else None
        for _ in range(500):
            hvddp.allreduce(x, name="cached")
            time.sleep(0.02)
    for step in range(8):
        if rank == 1 and step == 3:
            say(f"rank 1: misbehaving ({mode}) at step {step}")
            if mode in ("sigkill", "sigkill_forked", "exit0", "exit3"):
                # rank 0's engine writes its timeline at the end of each cycle: let the cycle that
                # finished step 2 end before the launcher kills rank 0 (a test reads that timeline;
                # dying at once, rank 1 sometimes beat it: a CI run saw no step 2 there)
                time.sleep(0.5)
            if mode in ("raise", "raise_raw"):
                raise RuntimeError(f"boom on rank 1 at step {step}")
            if mode in ("sigkill", "sigkill_forked"):
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "exit0":
                os._exit(0)
            if mode == "exit3":
                os._exit(3)
            if mode in ("skip", "skip_reinit"):
                continue
            if mode == "slow":
                time.sleep(3)
            if mode == "stuck":  # alive, engine running, main thread busy elsewhere for long
                time.sleep(600)
        if mode == "raise_raw" and rank == 0 and step == 3:
            from mpi4py import MPI

            MPI.COMM_WORLD.bcast(None, root=1)  # waits for rank 1 outside hvddp
        out = hvddp.allreduce(np.full(4, float(rank + step)), name=f"grad.step{step}", op=hvddp.Sum)
        assert out.tolist() == [float(sum(r + step for r in range(size)))] * 4, out
except hvddp.StallError as exc:
    say(f"rank {rank}: STALLERROR after {time.monotonic() - start:.1f} s: {exc}")
    if mode != "skip_reinit":
        sys.exit(3)
    hvddp.shutdown()
    hvddp.init()
    out = hvddp.allreduce(np.ones(4), name="after.reinit", op=hvddp.Sum)
    assert out.tolist() == [float(size)] * 4, out
say(f"rank {rank}: finished")
