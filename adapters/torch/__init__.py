"""hvddp.torch: Horovod's PyTorch API on hvddp; port a script by changing its import line.

    import hvddp.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Launch with ``mpiexec -n 2 python train.py``. CPU tensors reach the collectives zero-copy
(numpy views of their memory); ``DistributedOptimizer`` reduces each gradient as soon as
backward has produced it. ``import hvddp`` alone never imports torch: only this package does.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("hvddp.torch needs PyTorch: `pip install torch` (or `pip install "
                      "hvddp[torch]`).") from _exc

from hvddp import (Adasum, Average, BackendUnavailableError, HvddpError, LauncherMismatchError, Max, Min,
                   MismatchError, NotInitializedError, ProcessSet, Product, ReduceOp, ShutdownError,
                   StallError, Sum, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                   ddl_built, gloo_built, gloo_enabled, global_process_set, init, is_homogeneous,
                   is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                   nccl_built, rank, remove_process_set, rocm_built, shutdown, size, start_timeline,
                   stop_timeline)

from . import checkpoint, elastic
from .checkpoint import load_checkpoint, save_checkpoint
from .compression import Compression, Compressor
from .elastic import HostsUpdatedInterrupt
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (Handle, HorovodInternalError, allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async,
                      grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async,
                      join, poll, reducescatter, reducescatter_async, sparse_allreduce_async,
                      synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "nccl_built",
    "cuda_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "HvddpError", "HorovodInternalError", "MismatchError", "NotInitializedError", "ShutdownError",
    "StallError", "BackendUnavailableError", "LauncherMismatchError",
    "Compression", "Compressor", "Handle",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier",
    "broadcast_object", "allgather_object", "broadcast_parameters", "broadcast_optimizer_state",
    "DistributedOptimizer", "SyncBatchNorm", "start_timeline", "stop_timeline",
    "checkpoint", "save_checkpoint", "load_checkpoint", "elastic", "HostsUpdatedInterrupt",
]
