"""Worker for test_gpu.py and benchmarks/gpu_check.py: hvddp's public collectives on device
arrays, through the real engine.

With ``HVDDP_FAKE_KERNELS`` set, device arrays are tests/fake_cupy.py's (host memory, g++-compiled
kernels, NCCL over MPI); without it, they are real CuPy arrays on rank r's GPU r (mod the number of
GPUs: ranks sharing one GPU need ``HVDDP_GPU_OPERATIONS=MPI``).

    HVDDP_FAKE_KERNELS=/path/kernels.so mpiexec -n 2 python -m mpi4py tests/mpi_gpu_wired.py
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

KERNELS = os.environ.get("HVDDP_FAKE_KERNELS")
if KERNELS:
    import fake_cupy  # noqa: E402

    cupy = fake_cupy.install(KERNELS)
else:
    import cupy  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import hvddp  # noqa: E402
from hvddp.backends import device  # noqa: E402


def dev(a):
    return cupy.asarray(a)


def host(a):
    """A device (or host) array's values in host memory: real CuPy refuses np.asarray."""
    return cupy.asnumpy(a) if hasattr(cupy, "asnumpy") else np.asarray(a)


def main() -> int:
    hvddp.init()
    rank, size = hvddp.rank(), hvddp.size()
    if not KERNELS:
        cupy.cuda.Device(hvddp.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    x = dev(np.arange(6, dtype=np.float32) + 100 * rank)
    out = hvddp.allreduce(x, name="wired.probe", op=hvddp.Sum)
    # (the stand-in's arrays are numpy subclasses: this fails if the CPU path took them)
    expect = sum(np.arange(6, dtype=np.float32) + 100 * r for r in range(size))
    assert isinstance(out, cupy.ndarray) and out is not x, type(out)
    assert np.array_equal(host(out), expect), out

    # Average of every dtype, fused in one cycle (async, then wait), a bfloat16 one by label
    handles = []
    for i, dt in enumerate(("float32", "float64", "float16", "int32", "int64", "uint8", "int16")):
        a = dev((np.arange(10) + 3 * rank + i).astype(dt))
        handles.append((dt, hvddp.allreduce_async(a, name=f"wired.avg.{dt}")))
    bits = dev((np.arange(8, dtype=np.float32) + rank).astype(ml_dtypes.bfloat16).view(np.int16))
    hb = hvddp.allreduce_async(device.Labeled(bits, "bfloat16"), name="wired.avg.bf16")
    for dt, h in handles:
        got = host(h.wait())
        want = np.mean([(np.arange(10) + 3 * r + [*("float32", "float64", "float16", "int32", "int64",
                                                      "uint8", "int16")].index(dt)).astype(np.float64)
                        for r in range(size)], axis=0)
        if dt.startswith("float"):
            assert np.allclose(got.astype(np.float64), want, rtol=1e-3), (dt, got, want)
        else:
            assert np.array_equal(got, np.trunc(want).astype(dt)), (dt, got, want)
    got = host(hb.wait()).view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.allclose(got, np.arange(8) + (size - 1) / 2, rtol=1e-2), got

    # in place, non-contiguous: written back into the caller's strided view
    base = dev(np.zeros((4, 6), dtype=np.float32) + rank + 1)
    view = base[:, ::2]
    res = hvddp.allreduce_(view, name="wired.inplace.strided", op=hvddp.Sum)
    assert res is view, "in-place allreduce must return its input"
    assert np.array_equal(host(base)[:, ::2], np.full((4, 3), sum(range(1, size + 1)), np.float32))
    assert np.array_equal(host(base)[:, 1::2], np.full((4, 3), rank + 1, np.float32))

    # memory shared by collectives of one cycle, one of them writing it: each reduces the values
    # submitted, as on the CPU path (device batches run one after another: a later one read what
    # an earlier one had written). Separate calls give the array to the reader first: calls of
    # different cycles are not protected, so the README's contract keeps an array given to a
    # pending in-place call out of other calls until it has completed.
    for where in ("dev", "cpu"):
        arr = dev if where == "dev" else np.asarray
        n = 600_000  # overlapping in-place views in one group, each past the fusion threshold
        buf = arr(np.arange(n, dtype=np.float32) % 7 + rank)
        hvddp.grouped_allreduce_([buf[:2 * n // 3], buf[n // 3:]], op=hvddp.Sum, name=f"wired.alias.overlap.{where}")
        assert np.array_equal(host(buf), sum(np.arange(n, dtype=np.float32) % 7 + r for r in range(size))), where
        t = arr(np.arange(4, dtype=np.float32) + 10 * rank)
        h2 = hvddp.allreduce_async(t[1:], op=hvddp.Max, name=f"wired.alias.max.{where}")
        h1 = hvddp.allreduce_async_(t, op=hvddp.Sum, name=f"wired.alias.sum.{where}")
        h1.wait()
        assert np.array_equal(host(h2.wait()), np.arange(1, 4, dtype=np.float32) + 10 * (size - 1)), where
        assert np.array_equal(host(t), sum(np.arange(4, dtype=np.float32) + 10 * r for r in range(size)))
        c = arr(np.arange(6, dtype=np.float32) + rank)
        h2 = hvddp.allreduce_async(c, op=hvddp.Max, name=f"wired.alias.whole.{where}")
        h1 = hvddp.allreduce_async_(c[::2], op=hvddp.Sum, name=f"wired.alias.strided.{where}")  # written back
        assert np.array_equal(host(h2.wait()), np.arange(6, dtype=np.float32) + size - 1), where
        h1.wait()
        y = arr(np.full(3, rank + 1.0, np.float32))
        h1 = hvddp.allreduce_async(y, op=hvddp.Sum, name=f"wired.alias.a.{where}")
        h2 = hvddp.broadcast_async_(y, root_rank=0, name=f"wired.alias.b.{where}")  # runs first in a cycle
        assert np.array_equal(host(h1.wait()), np.full(3, size * (size + 1) / 2, np.float32)), where
        h2.wait()

    # grouped allreduce, broadcast, allgather (uneven), alltoall, reducescatter
    g = hvddp.grouped_allreduce([dev(np.ones(3, np.float32) * rank), dev(np.ones(2, np.int64))],
                                name="wired.group", op=hvddp.Sum)
    assert np.array_equal(host(g[0]), np.full(3, sum(range(size)), np.float32))
    assert np.array_equal(host(g[1]), np.full(2, size, np.int64))
    b = hvddp.broadcast(dev(np.arange(5, dtype=np.int32) * (rank + 1)), root_rank=size - 1, name="wired.bc")
    assert np.array_equal(host(b), np.arange(5, dtype=np.int32) * size)
    # a 0-d tensor (BatchNorm's num_batches_tracked): the staging path failed on every rank
    b0 = hvddp.broadcast(dev(np.array(7.0 + rank, np.float32)), root_rank=size - 1, name="wired.bc0")
    assert host(b0).shape == () and float(host(b0)) == 6.0 + size, b0
    ag = hvddp.allgather(dev(np.full((rank + 1, 2), rank, np.float64)), name="wired.ag")
    assert np.array_equal(host(ag), np.concatenate([np.full((r + 1, 2), r, np.float64)
                                                          for r in range(size)]))
    a2a, splits = hvddp.alltoall(dev(np.arange(2 * size, dtype=np.float32) + 10 * rank),
                                 splits=[2] * size, name="wired.a2a")
    assert list(splits) == [2] * size
    assert np.array_equal(host(a2a), np.concatenate(
        [np.arange(2 * rank, 2 * rank + 2, dtype=np.float32) + 10 * r for r in range(size)]))
    # rows past sum(splits) are not sent (they failed with AttributeError on device arrays)
    a2a, splits = hvddp.alltoall(dev(np.arange(3 * size, dtype=np.float32) + 10 * rank),
                                 splits=[1] * size, name="wired.a2a.short")
    assert list(splits) == [1] * size
    assert np.array_equal(host(a2a), np.array([rank + 10 * r for r in range(size)], np.float32)), a2a
    rs = hvddp.reducescatter(dev(np.ones((2 * size + 1, 3), np.float32)), name="wired.rs", op=hvddp.Sum)
    assert host(rs).shape[1] == 3 and np.all(host(rs) == size)

    # staged collectives of ever-new sizes keep reusing their pinned buffers, grown twofold (CuPy's
    # pinned pool keeps each freed block by its exact size; the stand-in's test counts the same)
    staged = os.environ.get("HVDDP_GPU_OPERATIONS", "").upper() == "MPI" or not device.nccl_built()
    if not KERNELS and staged:
        import cupyx

        calls, empty_pinned = [], cupyx.empty_pinned

        def counted(shape, *args, **kwargs):
            calls.append(shape)
            return empty_pinned(shape, *args, **kwargs)

        cupyx.empty_pinned = counted
        for n in range(1, 101):  # 16 KiB apart: distinct block sizes for the pool
            got = hvddp.allgather(dev(np.full((n, 4096), float(rank), np.float32)), name=f"wired.grow.{n}")
            assert host(got).shape == (size * n, 4096)
        cupyx.empty_pinned = empty_pinned
        assert len(calls) <= 10, f"{len(calls)} pinned allocations for 100 staged allgathers: {calls}"
        print(f"rank {rank}: {len(calls)} pinned allocations for 100 staged allgathers of 100 sizes", flush=True)

    # GPU on one rank, CPU on the other: an error on every rank, not a hang
    if size > 1:
        t = dev(np.ones(3, np.float32)) if rank == 0 else np.ones(3, np.float32)
        try:
            hvddp.allreduce(t, name="wired.mixed")
        except hvddp.HvddpError as exc:
            assert "device" in str(exc), exc
        else:
            raise AssertionError("a device mismatch across ranks did not raise")
    # Adasum on device arrays: staged through the host (NCCL has none), per tensor, as on the CPU
    if size & (size - 1) == 0:
        from adasum_reference import adasum_reference

        def part(r, n, seed):
            common = np.random.default_rng(seed).standard_normal(n)
            return (common + 0.7 * np.random.default_rng(seed + 1 + r).standard_normal(n)).astype(np.float32)

        # sizes that leave gaps between the fused buffer's aligned offsets
        shapes = [(3, 5), (70001, 15), (9, 50), (1, 60)]
        got = hvddp.grouped_allreduce([dev(part(rank, n, seed)) for n, seed in shapes], name="wired.adasum",
                                      op=hvddp.Adasum, postscale_factor=2.0)
        for out, (n, seed) in zip(got, shapes):
            want = 2.0 * adasum_reference([part(r, n, seed) for r in range(size)])
            assert np.allclose(host(out), want, rtol=1e-5, atol=1e-5), (n, np.abs(host(out) - want).max())
        bits = hvddp.allgather_object(host(got[0]).tobytes(), name="wired.adasum.bits")
        assert all(b == bits[0] for b in bits), "replicas differ"
        half = hvddp.allreduce(dev(part(rank, 33, 7).astype(np.float16)), name="wired.adasum.half", op=hvddp.Adasum)
        want = adasum_reference([part(r, 33, 7).astype(np.float16) for r in range(size)])
        assert np.allclose(host(half).astype(np.float64), want, rtol=1e-2, atol=1e-2)
    try:
        hvddp.allreduce(dev(np.ones(3, np.int32)), name="wired.adasum.int", op=hvddp.Adasum)
    except ValueError as exc:
        assert "int32; op=Adasum combines floating-point" in str(exc), exc
    else:
        raise AssertionError("Adasum on an integer device array did not raise")
    timeline = os.environ.get("HVDDP_TIMELINE")
    if timeline:
        timeline_steps(rank, size)
    hvddp.shutdown()
    if timeline and rank == 0:
        check_timeline(timeline, "MPI_{}_STAGED" if staged else "NCCL_{}")
    print(f"WIRED OK rank {rank}", flush=True)
    return 0


def timeline_steps(rank: int, size: int) -> None:
    """Three steps of device collectives for the timeline (``HVDDP_TIMELINE``): fused small
    allreduces, one past the fusion threshold, a broadcast and an allgather."""
    for step in range(3):
        handles = [hvddp.allreduce_async(dev(np.full(n, rank + step, np.float32)), name=f"tl.ar{i}")
                   for i, n in enumerate((10, 1000, 600_000))]
        handles.append(hvddp.broadcast_async(dev(np.full(3, rank, np.int32)), 0, name="tl.bc"))
        handles.append(hvddp.allgather_async(dev(np.full((rank + 1, 2), rank, np.int64)), name="tl.ag"))
        outs = [host(h.wait()) for h in handles]
        assert all(o[0] == step + (size - 1) / 2 for o in outs[:3]), [o[0] for o in outs[:3]]
        assert outs[3].tolist() == [0, 0, 0] and len(outs[4]) == size * (size + 1) // 2


def check_timeline(path: str, engine: str) -> None:
    """Every span in the file ends, nested within its row, and each device collective of
    timeline_steps has one span a step, with its engine phase inside (they stayed open from the
    first step to shutdown, the later steps' negotiations nested inside)."""
    from mpirun import timeline_spans

    spans = timeline_spans(path)
    for i in range(3):
        assert spans[f"allreduce.tl.ar{i}"].count("ALLREDUCE") == 3, spans[f"allreduce.tl.ar{i}"]
    assert spans["allreduce.tl.ar2"].count(engine.format("ALLREDUCE")) == 3, spans["allreduce.tl.ar2"]
    for kind, name in (("BROADCAST", "broadcast.tl.bc"), ("ALLGATHER", "allgather.tl.ag")):
        assert spans[name].count(kind) == 3 and spans[name].count(engine.format(kind)) == 3, spans[name]
    print(f"timeline spans ok: {len(spans)} rows, every span closed", flush=True)


if __name__ == "__main__":
    sys.exit(main())
