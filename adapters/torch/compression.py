"""Gradient compression on torch tensors: cast floats to 16 bits for the collective and back.

A compressor's ``compress(tensor)`` returns ``(compressed, ctx)``; ``decompress(compressed, ctx)``
restores the original dtype. The core reduces float16 and bfloat16 in float32 (MPI has no half
types), so on the CPU path compression changes the rounding of the result, not the bytes on
the wire; it is kept for Horovod compatibility and for the GPU path.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface: ``compress`` then ``decompress`` round-trips a tensor's dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return ``(compressed tensor, context needed to decompress it)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` restored to the dtype recorded in ``ctx``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Leave tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    target: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype not in (torch.float16, torch.bfloat16):
            return tensor.to(cls.target), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Cast float32/float64 tensors to float16 for the collective and back afterwards."""

    target = torch.float16


class BF16Compressor(_CastCompressor):
    """Cast float32/float64 tensors to bfloat16 for the collective and back afterwards."""

    target = torch.bfloat16


class Compression:
    """Namespace of compressors, as in Horovod: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def native(compression: Any) -> Any:
    """This module's compressor for the core's ``hvddp.Compression.none``, ``.fp16`` or ``.bf16``
    (the same casts, on torch tensors; the core's cast numpy arrays only and failed on a tensor);
    any other compressor as given."""
    from hvddp.compression import Compression as Core

    for core, ours in ((Core.none, Compression.none), (Core.fp16, Compression.fp16), (Core.bf16, Compression.bf16)):
        if compression is core:
            return ours
    return compression
