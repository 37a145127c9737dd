"""hvddp: data-parallel training in the Horovod mould, on mpi4py (CPU) and NCCL (GPU).

The core works on numpy arrays and never imports a deep-learning framework; the adapters
``hvddp.torch``, ``hvddp.keras`` and ``hvddp.tensorflow`` wrap it for each framework.

Example:
    import numpy as np, hvddp
    hvddp.init()
    total = hvddp.allreduce(np.ones(3) * hvddp.rank(), op=hvddp.Sum)
"""

from __future__ import annotations

from .compression import Compression
from .exceptions import (BackendUnavailableError, HvddpError, LauncherMismatchError, MismatchError,
                         NotInitializedError, ShutdownError, StallError)
from .handles import Handle, poll, synchronize
from .ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather, allgather_async,
                  allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                  alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                  broadcast_object, grouped_allgather, grouped_allgather_async, grouped_allreduce,
                  grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                  grouped_reducescatter, grouped_reducescatter_async, join, reducescatter,
                  reducescatter_async)
from .runtime import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                      gloo_built, gloo_enabled, global_process_set, init, is_homogeneous, is_initialized,
                      local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                      remove_process_set, rocm_built, shutdown, size)
from .timeline import start_timeline, stop_timeline
from . import checkpoint  # noqa: E402  (rank-0 atomic checkpoints; collective save/load)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "nccl_built",
    "cuda_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
    "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
    "broadcast_object", "allgather_object", "poll", "synchronize", "Handle", "Compression",
    "start_timeline", "stop_timeline", "HvddpError", "NotInitializedError", "BackendUnavailableError",
    "MismatchError", "ShutdownError", "StallError", "LauncherMismatchError", "checkpoint", "__version__",
]
