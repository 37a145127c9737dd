"""Gradient compression for the wire: cast float tensors to 16 bits before a collective.

A compressor's ``compress(x)`` returns ``(compressed, ctx)`` and ``decompress(compressed, ctx)``
restores the original dtype. hvddp reduces 16-bit floats in float32 internally (MPI has no half
types), so compression saves the memory of the copy the collective reads, not wire bytes, on
the MPI path; on NCCL it halves the bytes moved.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ._dtypes import bfloat16

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface: ``compress`` then ``decompress`` round-trips a tensor's dtype."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Leave tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    target: Any = None

    @classmethod
    def compress(cls, tensor):
        dtype = tensor.dtype
        if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize > 2:
            return tensor.astype(cls.target), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.astype(ctx)


class FP16Compressor(_CastCompressor):
    """Cast float32/float64 to float16 for the collective and back afterwards."""

    target = np.float16


class _Bfloat16:
    """ml_dtypes' bfloat16, imported when first read (see hvddp._dtypes)."""

    def __get__(self, obj, owner):
        return bfloat16()


class BF16Compressor(_CastCompressor):
    """Cast float32/float64 to bfloat16 for the collective and back afterwards."""

    target = _Bfloat16()


class Compression:
    """Namespace of compressors, as in Horovod: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
