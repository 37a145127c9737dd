"""Worker for test_gpu.py: the GPU executor end to end on the CPU stand-in for CuPy, any np.

Runs benchmarks/gpu_check.py's own allreduce and collective checks (the ones a GPU machine will
run) through ``GpuExecutor`` on both paths: NCCL (its stand-in moves bytes with MPI) and staging
(real pinned-host staging code, real MPI). Exits non-zero on any failure.

    HVDDP_FAKE_KERNELS=/path/kernels.so mpiexec -n 2 python -m mpi4py tests/mpi_gpu_fake.py
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import fake_cupy  # noqa: E402

fake_cupy.install(os.environ["HVDDP_FAKE_KERNELS"])

from mpi4py import MPI  # noqa: E402

spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(os.path.dirname(HERE),
                                                                         "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    failed = 0
    for ops in ("NCCL", "MPI"):
        gx, _ = gpu_check.make_executor(ops, comm)
        assert gx.path == ops, (gx.path, ops)
        n, failures = gpu_check.allreduce_cases(gx, comm, size, rank, f"fake.{ops}")
        m, more = gpu_check.other_collectives(gx, size, rank, f"fake.{ops}")
        assert len(gx.pending) == 0
        for f in failures + more:
            print(f"FAIL {ops}: {f}", flush=True)
        failed += len(failures) + len(more)
        print(f"{ops} np={size}: {n} allreduce tensors, {m} other checks, "
              f"{len(failures) + len(more)} failures", flush=True)
    if gx.nccl is None and fake_cupy.RawKernel.launches == 0:
        print("FAIL: no kernel was launched", flush=True)
        failed += 1
    failed = comm.allreduce(failed)
    if rank == 0:
        print(f"TOTAL FAILURES {failed}", flush=True)
    return 1 if failed else 0


def join_on_own_device() -> int:
    """One GPU per rank (rank r's arrays on device r): a rank that has joined takes part in its
    peers' allreduces on its own device (it used the engine thread's current device, 0, and
    waited on an NCCL communicator its peers never made: the job hung)."""
    import numpy as np

    import hvddp

    rank = MPI.COMM_WORLD.Get_rank()
    fake_cupy.ndarray.device = property(lambda self: fake_cupy._Dev(rank))
    hvddp.init()
    x = fake_cupy.asarray(np.full(4, float(rank + 1), dtype=np.float32))
    assert np.asarray(hvddp.allreduce(x, name="own.first", op=hvddp.Sum)).tolist() == [3.0] * 4
    if rank == 0:  # rank 1 has joined: it contributes zeros, on its device 1
        assert np.asarray(hvddp.allreduce(x, name="own.second", op=hvddp.Sum)).tolist() == [1.0] * 4
    assert hvddp.join() in (0, 1)
    print(f"rank {rank}: joined on its own device", flush=True)
    hvddp.shutdown()
    return 0


def out_of_memory_on_one_rank() -> int:
    """Rank 1 alone cannot allocate a device output (CuPy's OutOfMemoryError is a MemoryError):
    the job ends, naming it (its handles failed and its peer waited in the collective for ever)."""
    import numpy as np

    import hvddp
    from hvddp.backends import gpu

    hvddp.init()
    x = fake_cupy.asarray(np.ones(1000, dtype=np.float32))
    hvddp.allreduce(x, name="warm", op=hvddp.Sum)
    if hvddp.rank() == 1:
        def no_memory(self, shape, dtype):
            raise MemoryError("out of device memory (simulated)")
        gpu.GpuExecutor._empty = no_memory
    try:  # (a script that goes on after a failed step: its peer must not wait in the step for ever)
        hvddp.allreduce(x, name="big", op=hvddp.Sum)
        print(f"rank {hvddp.rank()}: the allreduce returned", flush=True)
    except hvddp.HvddpError as exc:
        print(f"rank {hvddp.rank()}: raised {exc}", flush=True)
    hvddp.barrier()
    return 0


def outputs_ordered_after_the_default_stream() -> int:
    """Every device output is allocated on the legacy default stream's pool, where memory a user
    freed may still be read by work queued there: hvddp's stream must wait for that stream after
    the allocation and before writing the output. The staging path allocated broadcast/allgather/
    alltoall/reducescatter outputs after its wait (and after MPI, while the user's thread queues
    more work), so its host-to-device copy could overwrite memory still in use."""
    import numpy as np

    import hvddp
    from hvddp.backends import gpu

    log = []
    empty = gpu.GpuExecutor._empty

    def logged_empty(self, shape, dtype):
        log.append("alloc")
        return empty(self, shape, dtype)

    record, wait, set_ = fake_cupy.Event.record, fake_cupy.Stream.wait_event, fake_cupy.ndarray.set

    def logged_record(self, stream=None):
        self.on_null = stream is fake_cupy.Stream.null
        return record(self, stream)

    def logged_wait(self, event):
        if getattr(event, "on_null", False):
            log.append("wait")
        return wait(self, event)

    def logged_set(self, arr, stream=None):
        log.append("write")
        return set_(self, arr, stream)

    gpu.GpuExecutor._empty = logged_empty
    fake_cupy.Event.record = logged_record
    fake_cupy.Stream.wait_event = logged_wait
    fake_cupy.ndarray.set = logged_set
    hvddp.init()
    rank, size = hvddp.rank(), hvddp.size()
    x = fake_cupy.asarray(np.arange(2 * size, dtype=np.float32) + rank)
    hvddp.broadcast(x, root_rank=0, name="order.bc")
    hvddp.allgather(x, name="order.ag")
    hvddp.alltoall(x, name="order.a2a")
    hvddp.reducescatter(x, name="order.rs", op=hvddp.Sum)
    pending = False  # an output allocated and not yet ordered after the default stream
    for what in log:
        if what == "alloc":
            pending = True
        elif what == "wait":
            pending = False
        elif what == "write" and pending:
            raise AssertionError(f"an output was written before hvddp's stream waited for the default "
                                 f"stream after allocating it: {log}")
    print(f"rank {rank}: outputs ordered ({log.count('alloc')} allocations)", flush=True)
    hvddp.shutdown()
    return 0


def pinned_memory_stays_bounded() -> int:
    """Staged collectives of ever-new sizes (allgathers of growing length, allreduces of growing
    batches) reuse the pinned staging buffers, grown at least twofold: CuPy's pinned pool keeps
    every freed block by exact size, so one allocation per call (or per new size) made the pinned
    host memory grow with each size staged."""
    import numpy as np

    import hvddp

    calls = []
    empty_pinned = sys.modules["cupyx"].empty_pinned

    def counted(shape, dtype=np.float64, order="C"):
        calls.append(int(np.prod(shape)))
        return empty_pinned(shape, dtype=dtype, order=order)

    sys.modules["cupyx"].empty_pinned = counted
    hvddp.init()
    rank = hvddp.rank()
    for n in range(1, 201):
        x = fake_cupy.asarray(np.full((n, 3), float(rank), np.float32))
        got = np.asarray(hvddp.allgather(x, name=f"grow.ag.{n}"))
        assert got.shape == (hvddp.size() * n, 3) and got[-1, 0] == hvddp.size() - 1
        got = np.asarray(hvddp.allreduce(x, name=f"grow.ar.{n}", op=hvddp.Sum))
        assert got[0, 0] == sum(range(hvddp.size()))
    assert len(calls) <= 20, f"{len(calls)} pinned allocations for 400 staged collectives: {calls}"
    print(f"rank {rank}: {len(calls)} pinned allocations", flush=True)
    hvddp.shutdown()
    return 0


if __name__ == "__main__":
    modes = {"join-own-device": join_on_own_device, "out-of-memory": out_of_memory_on_one_rank,
             "output-order": outputs_ordered_after_the_default_stream,
             "pinned-growth": pinned_memory_stays_bounded}
    sys.exit(modes[sys.argv[1]]() if sys.argv[1:] else main())
