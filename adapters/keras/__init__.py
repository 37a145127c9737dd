"""hvddp.keras: data-parallel training for Keras 3 on the TensorFlow, torch and JAX backends.

A Horovod Keras script ports by changing its import to ``import hvddp.keras as hvd``.

Example:
    import keras
    import hvddp.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)
"""

from __future__ import annotations

try:
    import keras as _keras
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("hvddp.keras needs Keras 3.5 or later: pip install 'keras>=3.5' and a backend "
                      "(tensorflow-cpu, torch or jax).") from exc

import re as _re

_release = tuple(int(n) for n in _re.findall(r"\d+", _keras.__version__)[:2])  # (3, 15) for 3.15.1
if _release[:1] != (3,):
    raise ImportError(f"hvddp.keras supports Keras 3; found keras {_keras.__version__}.")
# 3.5 reworked the optimizers' gradient accumulation (the optimizer's step counter, which
# backward_passes_per_step and the callbacks' accumulator averaging use): on Keras 3.0-3.4
# DistributedOptimizer would fail inside a step instead of here
if _release < (3, 5):
    raise ImportError(f"hvddp.keras needs Keras 3.5 or later; found keras {_keras.__version__} "
                      f"(pip install -U 'keras>=3.5'; TensorFlow 2.16 and later accept it).")

from hvddp import (Adasum, Average, BackendUnavailableError, Compression, HvddpError, LauncherMismatchError,
                   Max, Min,
                   MismatchError, NotInitializedError, ProcessSet, Product, ShutdownError, StallError, Sum,
                   add_process_set, allgather_object, barrier, broadcast_object, ccl_built, cross_rank,
                   cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set, init,
                   is_homogeneous, is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled,
                   mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built, shutdown, size,
                   start_timeline, stop_timeline)

from . import callbacks, checkpoint, elastic
from ._jit import install_auto_jit_guard as _install_auto_jit_guard
from ._jit import install_error_unwrapping as _install_error_unwrapping
from .callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                        LearningRateWarmupCallback, MetricAverageCallback)
from .checkpoint import CheckpointCallback, load_checkpoint, save_checkpoint
from .elastic import HostsUpdatedInterrupt
from .functions import (allgather, allreduce, broadcast, broadcast_global_variables, broadcast_variables,
                        reducescatter)
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, is_distributed, load_model

_install_auto_jit_guard()
_install_error_unwrapping()

HorovodInternalError = HvddpError  # Horovod's name for what a failed collective raises

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "nccl_built",
    "cuda_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression",
    "DistributedOptimizer", "PartialDistributedOptimizer", "is_distributed", "load_model", "callbacks",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "allreduce", "allgather", "reducescatter", "broadcast", "broadcast_variables",
    "broadcast_global_variables", "barrier", "join", "broadcast_object", "allgather_object",
    "HvddpError", "HorovodInternalError", "NotInitializedError", "BackendUnavailableError", "MismatchError",
    "ShutdownError", "StallError", "LauncherMismatchError", "start_timeline", "stop_timeline", "checkpoint",
    "CheckpointCallback",
    "save_checkpoint", "load_checkpoint", "elastic", "HostsUpdatedInterrupt",
]
