"""hvddp.tensorflow: hvddp collectives as TensorFlow ops, ``DistributedGradientTape``,
``broadcast_variables``, and the runtime functions, for custom TensorFlow training loops.

Example:
    import tensorflow as tf
    import hvddp.tensorflow as hvd

    hvd.init()
    ...
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
"""

from __future__ import annotations

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("hvddp.tensorflow needs TensorFlow: pip install 'tensorflow-cpu>=2.16' "
                      "(or tensorflow).") from exc

from hvddp import (Adasum, Average, BackendUnavailableError, HvddpError, LauncherMismatchError,
                   Max, Min,
                   MismatchError, NotInitializedError, ProcessSet, Product, ShutdownError, StallError, Sum,
                   add_process_set, barrier, ccl_built, cross_rank,
                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set, init,
                   is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                   mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built, shutdown, size,
                   start_timeline, stop_timeline)

from . import compression, elastic, mpi_ops
from .compression import Compression, Compressor
from .elastic import HostsUpdatedInterrupt
from .functions import (DistributedOptimizer, allgather_object, broadcast_, broadcast_global_variables,
                        broadcast_object, broadcast_object_fn, broadcast_variables, local_rank_op, local_size_op,
                        process_set_included_op, rank_op, size_op)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .sync_batch_norm import SyncBatchNormalization
from .ops import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                  grouped_reducescatter, join, reducescatter)

# Horovod's TensorFlow package raises this name for every failed collective; scripts catch it by it
HorovodInternalError = HvddpError


def _install_keras_guards() -> None:
    """Install ``hvddp.keras``' trainer guards: Keras' ``jit_compile="auto"`` then picks no XLA for
    a model whose own ``train_step`` reduces with ``DistributedGradientTape`` (a Horovod port that
    imports only this package), which XLA cannot compile. Keras 3 only; without it, nothing."""
    try:
        import keras
    except ImportError:  # pragma: no cover - depends on the environment
        return
    if keras.__version__.startswith("3."):
        import hvddp.keras  # noqa: F401  (installs them)


_install_keras_guards()

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "nccl_built",
    "cuda_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression", "Compressor",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall", "reducescatter",
    "grouped_reducescatter", "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op",
    "barrier", "join", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer", "SyncBatchNormalization",
    "broadcast_", "broadcast_variables", "broadcast_global_variables",
    "HvddpError", "NotInitializedError", "BackendUnavailableError", "MismatchError", "ShutdownError",
    "StallError", "LauncherMismatchError", "start_timeline", "stop_timeline", "elastic", "HostsUpdatedInterrupt",
    "HorovodInternalError", "compression", "mpi_ops",
]
