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


if __name__ == "__main__":
    sys.exit(main())
