"""``SyncBatchNormalization``: a Keras ``BatchNormalization`` whose training statistics span every
rank's batch (Horovod's ``horovod.tensorflow.SyncBatchNormalization``, for Keras 3 on TensorFlow)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import hvddp
from hvddp import ProcessSet, global_process_set

from .ops import allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization over the concatenation of every rank's batch, in training.

    Each rank sends the per-channel sums of its inputs and of their squares, and its row count,
    in one differentiable allreduce; mean and variance are those of all ranks' rows together
    (ranks may hold different batch sizes), so N ranks on B/N rows each normalize as
    ``BatchNormalization`` on B rows in one process, moving statistics included. Inference, and
    masked inputs, use the local statistics, as ``BatchNormalization`` does.

    Args:
        fused: must be False (as in Horovod: the fused kernel computes its own statistics).
        process_set: the ranks whose batches are normalized together.
        **kwargs: ``keras.layers.BatchNormalization``'s arguments.
    """

    def __init__(self, fused: Any = False, process_set: ProcessSet = global_process_set, **kwargs) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True; pass fused=False.")
        super().__init__(**kwargs)
        self._hvddp_process_set = process_set

    def _moments(self, inputs, mask):
        ps = self._hvddp_process_set
        if mask is not None or ps.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        wide = tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
        x = tf.cast(inputs, wide)
        shape = tf.shape(x)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), wide)
        local = tf.concat([tf.reduce_sum(x, axis=axes), tf.reduce_sum(tf.square(x), axis=axes),
                           tf.reshape(count, [1])], axis=0)
        total = allreduce(local, op=hvddp.Sum, process_set=ps)
        channels = (tf.shape(local)[0] - 1) // 2
        n = total[-1]
        mean = total[:channels] / n
        variance = tf.maximum(total[channels:2 * channels] / n - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    def get_config(self):
        return dict(super().get_config(), fused=False)
