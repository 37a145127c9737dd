"""hvddp.tensorflow.compression (Horovod's ``horovod.tensorflow.compression``): ``Compression.none``,
``.fp16``, ``.bf16`` and the ``Compressor`` interface.

The built-in compressors cast a ``tf.Tensor`` with TensorFlow (``Compression.fp16.compress(t)``
returns a tensor and the dtype to restore) and the arrays hvddp reduces with numpy, inside the
reduction. A compressor of your own (a class with ``compress(tensor) -> (compressed, ctx)`` and
``decompress(tensor, ctx)``) is given ``tf.Tensor``s, as in Horovod: ``numpy_side`` wraps it for
the reduction, which runs on numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvddp import compression as _core

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]

Compressor = _core.Compressor
NoneCompressor = _core.NoneCompressor


class _TensorFlowCast:
    """A cast compressor that also takes ``tf.Tensor``s (a numpy array goes to the core's)."""

    tf_target: Any = None

    @classmethod
    def compress(cls, tensor):
        if isinstance(tensor, (tf.Tensor, tf.Variable)):
            dtype = tensor.dtype
            if dtype.is_floating and dtype.size > 2:
                return tf.cast(tensor, cls.tf_target), dtype
            return tensor, None
        return super().compress(tensor)

    @classmethod
    def decompress(cls, tensor, ctx):
        if isinstance(tensor, (tf.Tensor, tf.Variable)):
            return tensor if ctx is None else tf.cast(tensor, ctx)
        return super().decompress(tensor, ctx)


class FP16Compressor(_TensorFlowCast, _core.FP16Compressor):
    """Cast float32/float64 to float16 for the collective and back afterwards."""

    tf_target = tf.float16


class BF16Compressor(_TensorFlowCast, _core.BF16Compressor):
    """Cast float32/float64 to bfloat16 for the collective and back afterwards."""

    tf_target = tf.bfloat16


class Compression:
    """Namespace of compressors, as in Horovod: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_BUILT_IN = (NoneCompressor, _core.FP16Compressor, _core.BF16Compressor, FP16Compressor, BF16Compressor)


class _ThroughTensorFlow:
    """A compressor of your own, called on the numpy arrays a reduction works on: each goes in
    as a ``tf.Tensor`` (reductions run eagerly, inside ``tf.numpy_function``) and comes out as
    an array."""

    def __init__(self, compressor: Any) -> None:
        self.compressor = compressor

    def compress(self, array: np.ndarray):
        compressed, ctx = self.compressor.compress(tf.convert_to_tensor(array))
        return np.asarray(compressed), ctx

    def decompress(self, array: np.ndarray, ctx: Any) -> np.ndarray:
        return np.asarray(self.compressor.decompress(tf.convert_to_tensor(array), ctx))

    def __repr__(self) -> str:
        return repr(self.compressor)


def numpy_side(compression: Any) -> Any:
    """What a reduction's numpy body calls for ``compression``: a built-in compressor as it is, one
    of your own through TensorFlow."""
    if compression in _BUILT_IN or isinstance(compression, _ThroughTensorFlow):
        return compression
    return _ThroughTensorFlow(compression)
