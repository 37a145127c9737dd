"""Raw MPI allreduce rate by message size, beside a memcpy of the same bytes, in one run.

    mpiexec -n 2 python -m mpi4py benchmarks/mpi_sizes.py

The numbers behind hvddp's defaults: the fusion batch (HVDDP_FUSION_THRESHOLD) and the largest
single reduction call (HVDDP_MPI_CHUNK_BYTES). Each rank is pinned to one core; in-place
float32 sums; the median of five rounds after an untimed one, rank 0's time. It prints
rates (GB/s), not ratios: the memcpy beside each size is the peer to read them against.
"""

import argparse
import os
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help only
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    except (AttributeError, OSError):
        pass
    if rank == 0:
        print(f"{comm.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"{'bytes':>10} {'allreduce us':>13} {'GB/s':>6} {'copy us':>9} {'GB/s':>6}")
    for nbytes in [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        buf = np.zeros(nbytes // 4, np.float32)
        dst = np.empty_like(buf)
        reps = max(3, min(200, (32 << 20) // nbytes))
        reduce_t, copy_t = [], []
        for round_ in range(6):  # round 0 first touches the buffers and is not counted
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)
            reduce_t.append((time.perf_counter() - t0) / reps)
            t0 = time.perf_counter()
            for _ in range(reps):
                np.copyto(dst, buf)
            copy_t.append((time.perf_counter() - t0) / reps)
        r, c = float(np.median(reduce_t[1:])), float(np.median(copy_t[1:]))
        if rank == 0:
            label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"{label:>10} {r * 1e6:>13.1f} {nbytes / r / 1e9:>6.2f} {c * 1e6:>9.1f} {nbytes / c / 1e9:>6.2f}")


if __name__ == "__main__":
    main()
