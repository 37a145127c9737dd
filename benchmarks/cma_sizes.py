"""hvddp's single-copy (cross-memory attach) reduction against MPI, by array size, in one run.

    mpiexec -n 2 python -m mpi4py benchmarks/cma_sizes.py [--rounds 7] [--warmup 1]

The numbers behind HVDDP_CMA_THRESHOLD. Each size reduces 80 MiB per rank spread over distinct
arrays (as gradients are: every step reads memory the caches no longer hold), float32, in place,
rounds interleaved after an untimed one, each rank pinned to one core; medians of the slowest rank:

  MPI              one in-place MPI Allreduce per array (Sum)
  MPI + 1/size     the same, then the Average's scaling pass over each array
  single copy      hvddp's CrossMemory.allreduce per array (Sum)
  single + 1/size  the same with the Average's 1/size folded in, as the engine runs it
  single, grouped  every array in one CrossMemory.allreduce_many call (a fusion group), 1/size

The last line (one 4 MiB x 20) repeats one array 20 times, cache-hot, to show what distinct memory costs.
"""

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from hvddp.backends.cma import CrossMemory
from hvddp.engine.messages import ReduceOp

TOTAL = 80 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = parser.parse_args()
    for flag, least in (("rounds", 1), ("warmup", 0)):
        if getattr(args, flag) < least:
            parser.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}.")
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    except (AttributeError, OSError):
        pass
    cma = CrossMemory.probe(comm)
    if cma is None:
        if rank == 0:
            print("a single-copy reduction needs 2 or more ranks" if size < 2 else
                  "cross-memory attach is not available here (or the ranks are not on one node)")
        return
    scale = 1.0 / size
    ways = {
        "MPI": lambda arrays: [comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT], MPI.SUM) for a in arrays],
        "MPI + 1/size": lambda arrays: [(comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT], MPI.SUM),
                                         np.multiply(a, np.float32(scale), out=a)) for a in arrays],
        "single copy": lambda arrays: [cma.allreduce(a, a, ReduceOp.SUM) for a in arrays],
        "single + 1/size": lambda arrays: [cma.allreduce(a, a, ReduceOp.AVERAGE, scale) for a in arrays],
        "single, grouped": lambda arrays: cma.allreduce_many(arrays, arrays, ReduceOp.AVERAGE, scale),
    }
    if rank == 0:
        print(f"{size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}; ms per 80 MiB "
              f"per rank (ratio to MPI)")
        print(f"{'array':>16}" + "".join(f"{w:>22}" for w in ways))
    cases = [(f"{n >> 20} MiB x {TOTAL // n}" if n >= 1 << 20 else f"{n >> 10} KiB x {TOTAL // n}",
              n, TOTAL // n, TOTAL // n) for n in (64 << 10, 256 << 10, 1 << 20, 4 << 20)]
    cases.append(("one 4 MiB x 20", 4 << 20, 1, 20))
    for label, nbytes, distinct, calls in cases:
        arrays = [np.ones(nbytes // 4, np.float32) for _ in range(distinct)]
        arrays = [arrays[i % distinct] for i in range(calls)]
        times = {w: [] for w in ways}
        for round_ in range(args.warmup + args.rounds):
            for way, fn in ways.items():
                if way == "single, grouped" and distinct < calls:
                    continue  # one array listed twice in a group is not a valid call
                comm.Barrier()
                t0 = time.perf_counter()
                fn(arrays)
                elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if round_ >= args.warmup:  # the first touches of the arrays are not timed
                    times[way].append(elapsed)
        if rank == 0:
            base = float(np.median(times["MPI"]))
            cells = []
            for way in ways:
                if not times[way]:
                    cells.append(f"{'-':>22}")
                    continue
                t = float(np.median(times[way]))
                cells.append(f"{t * 1e3:>13.1f} ({t / base:.2f}x)")
            print(f"{label:>16}" + "".join(cells))


if __name__ == "__main__":
    main()
