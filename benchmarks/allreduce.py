"""Allreduce throughput: hvddp against raw MPI on the same bytes, measured in one run.

    mpiexec -n 2 python -m mpi4py benchmarks/allreduce.py [--rounds 20]

Three workloads: 200 float32 arrays of 100 KiB, the same bytes as 800 arrays of 25 KiB (where
the per-tensor cost shows), and a ResNet-50-like mix (161 arrays, 25.6M floats, the parameter
shapes of ResNet-50). Five ways to reduce each plus a reference,
interleaved round by round, each rank pinned to one core; the table shows medians over rounds
(the slowest rank's time per round) and ratios against the faster raw MPI way:

  raw per-array    one in-place MPI Allreduce per array
  raw hand-fused   pack into 4 MiB buffers, one Allreduce each, unpack
  contiguous       the same bytes already in one array, reduced in 4 MiB pieces (a floor for
                   what any packing scheme can reach; no copies at all)
  hvddp in place   hvddp.allreduce_async_(op=Sum) for every array, then synchronize all: the
                   same in-place contract as the raw ways (and as gradients in training)
  hvddp            hvddp.allreduce_async(op=Sum): out of place, so every result is a new array:
                   the reduction reads the inputs and writes separate outputs, memory the
                   in-place raw ways never touch
  raw out of place one MPI Allreduce per array into a separate output array: not one of the
                   ways the ratios are taken against, but the like-for-like peer of the line
                   above (the outputs are allocated once, as hvddp's pool reuses its results)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import hvddp

CHUNK = 4 << 20


def resnet50_shapes():
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out_ch = width * 4
            shapes += [(width, in_ch, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if b == 0:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 2048), (1000,)]
    return shapes


def raw_per_array(comm, arrays):
    for a in arrays:
        comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT], MPI.SUM)


def raw_hand_fused(comm, arrays, buf):
    limit = CHUNK // 4
    batch, used = [], 0

    def flush():
        if not batch:
            return
        off = 0
        for a in batch:
            buf[off:off + a.size] = a.reshape(-1)
            off += a.size
        comm.Allreduce(MPI.IN_PLACE, [buf[:off], MPI.FLOAT], MPI.SUM)
        off = 0
        for a in batch:
            a.reshape(-1)[:] = buf[off:off + a.size]
            off += a.size

    for a in arrays:
        if used + a.size > limit and batch:
            flush()
            batch, used = [], 0
        if a.size >= limit:  # big ones in place, in pieces
            for s in range(0, a.size, limit):
                comm.Allreduce(MPI.IN_PLACE, [a.reshape(-1)[s:s + limit], MPI.FLOAT], MPI.SUM)
            continue
        batch.append(a)
        used += a.size
    flush()


def raw_out_of_place(comm, arrays, outputs):
    for a, out in zip(arrays, outputs):
        comm.Allreduce([a, MPI.FLOAT], [out, MPI.FLOAT], MPI.SUM)


def contiguous(comm, flat):
    step = CHUNK // 4
    for s in range(0, flat.size, step):
        comm.Allreduce(MPI.IN_PLACE, [flat[s:s + step], MPI.FLOAT], MPI.SUM)


def with_hvddp(arrays, tag, inplace=False):
    submit = hvddp.allreduce_async_ if inplace else hvddp.allreduce_async
    handles = [submit(a, op=hvddp.Sum, name=f"{tag}.{i}") for i, a in enumerate(arrays)]
    for h in handles:
        hvddp.synchronize(h)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    for flag, least in (("rounds", 1), ("warmup", 0)):
        if getattr(args, flag) < least:
            parser.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}.")
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:  # before init(): hvddp's engine thread inherits the affinity it is started with
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    except (AttributeError, OSError):
        pass
    hvddp.init()
    rng = np.random.default_rng(rank)
    workloads = {
        "200 x 100 KiB": [rng.standard_normal(25600).astype(np.float32) for _ in range(200)],
        "800 x 25 KiB": [rng.standard_normal(6400).astype(np.float32) for _ in range(800)],
        "ResNet-50 mix": [rng.standard_normal(s).astype(np.float32) for s in resnet50_shapes()],
    }
    if rank == 0:
        print(f"hvddp allreduce benchmark: {size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"{args.rounds} rounds (+{args.warmup} warm-up), medians of the slowest rank")
    for label, arrays in workloads.items():
        nbytes = sum(a.nbytes for a in arrays)
        flat = np.concatenate([a.reshape(-1) for a in arrays])
        buf = np.empty(CHUNK // 4, dtype=np.float32)
        outputs = [np.empty_like(a) for a in arrays]
        tag = label[:3]  # one set of names for both hvddp ways (800 tensors under two names each
        # would not fit the response cache's 1024 entries)
        methods = {
            "raw per-array": lambda: raw_per_array(comm, arrays),
            "raw hand-fused": lambda: raw_hand_fused(comm, arrays, buf),
            "contiguous": lambda: contiguous(comm, flat),
            "hvddp in place": lambda: with_hvddp(arrays, tag, True),
            "hvddp": lambda: with_hvddp(arrays, tag),
            "raw out of place": lambda: raw_out_of_place(comm, arrays, outputs),
        }
        # first, the same numbers: hvddp's out-of-place results against raw MPI's
        raw_out_of_place(comm, arrays, outputs)
        handles = [hvddp.allreduce_async(a, op=hvddp.Sum, name=f"{tag}.check.{i}") for i, a in enumerate(arrays)]
        for h, want in zip(handles, outputs):
            np.testing.assert_allclose(hvddp.synchronize(h), want, rtol=1e-6, atol=1e-6)
        times = {m: [] for m in methods}
        for r in range(args.warmup + args.rounds):
            for m, fn in methods.items():
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if r >= args.warmup:
                    times[m].append(dt)
        med = {m: float(np.median(v)) * 1e3 for m, v in times.items()}
        best_raw = min(med["raw per-array"], med["raw hand-fused"])
        if rank == 0:
            print(f"\n{label}: {len(arrays)} arrays, {nbytes / 1e6:.1f} MB (hvddp's results checked "
                  f"against raw MPI's)")
            print(f"  {'method':<16}{'median ms':>10}{'GB/s':>8}{'vs best raw':>13}")
            for m, v in med.items():
                print(f"  {m:<16}{v:>10.2f}{nbytes / v / 1e6:>8.2f}{v / best_raw:>12.2f}x")
            print(f"  hvddp (out of place) vs raw out of place: {med['hvddp'] / med['raw out of place']:.2f}x")
    hvddp.shutdown()


if __name__ == "__main__":
    main()
