"""``hvddp.tensorflow.mpi_ops``: Horovod's ``horovod.tensorflow.mpi_ops`` under hvddp's name (the
collectives as TensorFlow ops, the rank and size ops, the runtime functions), for scripts that
import from it. The same objects as ``hvddp.tensorflow``'s."""

from __future__ import annotations

from hvddp import (Adasum, Average, Max, Min, ProcessSet, Product, Sum, add_process_set, barrier, ccl_built,
                   cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set,
                   init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                   mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built, shutdown, size,
                   start_timeline, stop_timeline)

from .functions import broadcast_, local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from .ops import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                  grouped_reducescatter, join, reducescatter)

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "rank_op", "local_rank_op",
    "size_op", "local_size_op", "process_set_included_op", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "grouped_allreduce",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter",
    "join", "barrier", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]
