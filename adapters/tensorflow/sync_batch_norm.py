"""``SyncBatchNormalization``: a Keras ``BatchNormalization`` whose training statistics span every
rank's batch (Horovod's ``horovod.tensorflow.SyncBatchNormalization``, for Keras 3 on TensorFlow)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import hvddp
from hvddp import _grouping, global_process_set
from hvddp.keras._keras2 import describe, is_keras2

from .ops import allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization over the concatenation of every rank's batch, in training.

    Two differentiable allreduces per training call: the per-channel sums with the row count,
    then the per-channel sums of squared deviations from that global mean (two passes: one sum of
    squares would lose the variance of a channel whose mean is large next to its spread). Ranks
    may hold different batch sizes, so N ranks on B/N rows each normalize as
    ``BatchNormalization`` on B rows in one process, moving statistics included. Inference, and
    masked inputs, use the local statistics, as ``BatchNormalization`` does. ``get_config``
    keeps the process set's ranks, so a clone or a reloaded model syncs over the same ranks.

    Args:
        fused: must be False (as in Horovod: the fused kernel computes its own statistics).
        process_set: the ranks whose batches are normalized together (or their list of ranks).
        **kwargs: ``keras.layers.BatchNormalization``'s arguments.
    """

    def __init__(self, fused: Any = False, process_set: Any = global_process_set, **kwargs) -> None:
        if fused in (True, None):
            raise ValueError(f"SyncBatchNormalization does not support the fused kernel (it computes its own "
                             f"statistics); pass fused=False. Received: fused={fused!r}.")
        super().__init__(**kwargs)
        # its allreduces cannot be XLA-compiled: jit_compile="auto" (on a GPU machine XLA, when
        # every layer supports it) must see that, whatever the optimizer
        self.supports_jit = False
        if process_set is None or isinstance(process_set, (list, tuple)):  # from get_config
            from hvddp.runtime import _restore_process_set

            process_set = _restore_process_set("global" if process_set is None else list(process_set), None)
        self._hvddp_process_set = _grouping.check_process_set(process_set, "SyncBatchNormalization")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a Keras 2 (tf_keras) functional model would record this Keras 3 layer as plain
        # TensorFlow ops: its gamma and beta untracked, untrained, its moving statistics frozen
        symbolic = [x for x in tf.nest.flatten((args, kwargs)) if is_keras2(x)]
        if symbolic:
            raise TypeError(f"SyncBatchNormalization is a Keras 3 layer; Received: an input of type "
                            f"{describe(symbolic[0])}, which a tf_keras functional model would record as plain "
                            f"TensorFlow ops, without the layer's weights or moving statistics. Build the model "
                            f"from `import keras` (Keras 3), or call the layer inside a tf_keras subclassed "
                            f"model's call(), which tracks its weights.")
        return super().__call__(*args, **kwargs)

    def _moments(self, inputs, mask):
        ps = self._hvddp_process_set
        if mask is not None or ps.size() == 1 or not ps.included():  # (a rank outside the set
            return super()._moments(inputs, mask)  # normalizes its own batch, as hvddp.torch's)
        axes = list(self._reduction_axes)
        wide = tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
        x = tf.cast(inputs, wide)
        local = tf.reduce_sum(x, axis=axes, keepdims=True)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), wide)
        totals = allreduce(tf.concat([tf.reshape(local, [-1]), tf.reshape(count, [1])], axis=0),
                           op=hvddp.Sum, process_set=ps)
        n = totals[-1]
        mean = tf.reshape(totals[:-1] / n, tf.shape(local))
        squares = tf.reduce_sum(tf.square(x - mean), axis=axes)
        variance = allreduce(squares, op=hvddp.Sum, process_set=ps) / n
        return tf.cast(tf.reshape(mean, [-1]), inputs.dtype), tf.cast(variance, inputs.dtype)

    def get_config(self):
        ps = self._hvddp_process_set
        return dict(super().get_config(), fused=False,
                    process_set=None if ps is global_process_set else list(ps.ranks))
