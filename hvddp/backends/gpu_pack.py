"""Device-side fusion: pack many tensors into one GPU buffer and unpack them, one launch each.

A batch of small allreduces is copied into one fusion buffer on the device, reduced with one
collective, and copied back out. Each copy is a single kernel launch over a table that the host
builds: per tensor a source pointer, a destination pointer and an element count, and per
thread block the tensor and the first element it copies. Scale factors (prescale into the
buffer; postscale and Average's 1/size out of it) and dtype conversions (float16/bfloat16
widened to float32 for MPI, int16 to int32 and bool to uint8 for NCCL) are folded into the copies,
computed the way the CPU path computes them (``executor._scaled_copy``) so both paths give the
same bits.

The plan (offsets, alignment, block table, wire dtypes) is plain Python and numpy and is tested
on the CPU; only ``launch_copy`` needs CuPy.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "ITEMSIZE", "ALIGN_BYTES", "BLOCK_THREADS", "BLOCK_ELEMS", "PackPlan", "make_plan",
    "nccl_wire_dtype", "mpi_wire_dtype", "split_by", "pointer_table", "kernel_source",
    "kernel_name", "launch_copy", "storage_dtype",
]

ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
ALIGN_BYTES = 64  # every tensor starts on a 64-byte boundary of the fusion buffer
BLOCK_THREADS = 256
PER_THREAD = 8  # elements one thread copies: all loaded before any is stored, to keep loads in flight
BLOCK_ELEMS = BLOCK_THREADS * PER_THREAD  # elements one thread block copies


def storage_dtype(name: str) -> str:
    """The CuPy dtype that holds ``name``'s bits (CuPy may have no bfloat16: use uint16)."""
    return "uint16" if name == "bfloat16" else name


def nccl_wire_dtype(dtype: str, bf16: bool = True) -> str:
    """The dtype a tensor is reduced in by NCCL, which has no bool and no int16.

    Args:
        dtype: the tensor's dtype name.
        bf16: whether this NCCL has ``ncclBfloat16`` (NCCL >= 2.10); else bfloat16 is widened.
    """
    if dtype == "bool":
        return "uint8"  # values 0/1: Min is logical and, Max logical or
    if dtype == "int16":
        return "int32"
    if dtype == "bfloat16" and not bf16:
        return "float32"
    return dtype


def mpi_wire_dtype(dtype: str) -> str:
    """The dtype a staged tensor is reduced in by MPI, which has no half types (as on the CPU)."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def split_by(keys: Sequence, order: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Group indices by key, groups in order of first appearance, indices in order.

    A CPU fusion batch may hold float16, bfloat16 and float32 tensors together (all reduce in
    float32 on MPI); on NCCL each reduces in its own type, so the GPU path splits the batch.
    """
    groups: Dict[object, List[int]] = {}
    for i in (range(len(keys)) if order is None else order):
        groups.setdefault(keys[i], []).append(i)
    return list(groups.values())


class PackPlan(NamedTuple):
    """Where each tensor of a batch lives in the fusion buffer, and how blocks split the copy.

    Attributes:
        wire: dtype of the fusion buffer.
        counts: elements per tensor.
        offsets: element offset of each tensor in the buffer (aligned to ``ALIGN_BYTES``).
        total: elements the buffer needs (the last tensor's end, not padded).
        blocks: int64 array of shape (2, nblocks): the tensor index and first element of each
            thread block. Tensors of zero elements get no block.
        tail: the pointer table's part that depends on the plan alone (counts, then blocks), so a
            launch converts only the pointers.
    """

    wire: str
    counts: Tuple[int, ...]
    offsets: Tuple[int, ...]
    total: int
    blocks: np.ndarray
    tail: np.ndarray

    @property
    def nblocks(self) -> int:
        return int(self.blocks.shape[1])


def make_plan(counts: Sequence[int], wire: str, align_bytes: int = ALIGN_BYTES,
              block_elems: int = BLOCK_ELEMS) -> PackPlan:
    """Lay out ``counts`` elements of dtype ``wire`` in one buffer and split the copy into blocks."""
    if wire not in ITEMSIZE:
        raise ValueError(f"unknown wire dtype {wire!r}; known: {', '.join(ITEMSIZE)}.")
    itemsize = ITEMSIZE[wire]
    if align_bytes % itemsize:
        raise ValueError(f"align_bytes={align_bytes} is not a multiple of {wire}'s size {itemsize}.")
    align = align_bytes // itemsize
    offsets = []
    end = 0
    for n in counts:
        if n < 0:
            raise ValueError(f"element count must be >= 0, got {n}.")
        start = -(-end // align) * align
        offsets.append(start)
        end = start + int(n)
    per = [-(-int(n) // block_elems) for n in counts]
    nblocks = sum(per)
    blocks = np.empty((2, nblocks), dtype=np.int64)
    if nblocks:
        blocks[0] = np.repeat(np.arange(len(counts), dtype=np.int64), per)
        first = np.cumsum([0] + per[:-1])
        blocks[1] = (np.arange(nblocks, dtype=np.int64) - np.repeat(first, per)) * block_elems
    counts = tuple(int(n) for n in counts)
    tail = np.concatenate([np.asarray(counts, dtype=np.int64), blocks.reshape(-1)])
    return PackPlan(wire, counts, tuple(offsets), end, blocks, tail)


def pointer_table(plan: PackPlan, src: Sequence[int], dst: Sequence[int]) -> np.ndarray:
    """The int64 table one copy kernel reads: src[n], dst[n], count[n], block tensor, block start.

    A source pointer of 0 makes the kernel write zeros (a joined rank's contribution).
    """
    n = len(plan.counts)
    if len(src) != n or len(dst) != n:
        raise ValueError(f"need {n} source and destination pointers, got {len(src)} and {len(dst)}.")
    table = np.empty(3 * n + 2 * plan.nblocks, dtype=np.int64)
    table[:n] = src
    table[n:2 * n] = dst
    table[2 * n:] = plan.tail
    return table


def reference_copy(plan: PackPlan, sources: Sequence[Optional[np.ndarray]], scale: float,
                   pack: bool, buffer: np.ndarray, outputs: Sequence[np.ndarray]) -> None:
    """What the kernel does, in numpy, through the CPU path's ``_scaled_copy`` (for tests)."""
    from ..engine.executor import _scaled_copy

    for i, (n, off) in enumerate(zip(plan.counts, plan.offsets)):
        view = buffer[off:off + n]
        if pack:
            if sources[i] is None:
                view.fill(0)
            else:
                _scaled_copy(view, sources[i].reshape(-1), scale)
        else:
            _scaled_copy(outputs[i].reshape(-1), view, scale)


# Kernel source ------------------------------------------------------------------------------
# No CUDA headers (NVRTC under CuPy may not find cuda_fp16.h): half conversions are the PTX
# instructions cuda_fp16.hpp itself uses, bfloat16 is done on the bits (round to nearest even).
HALF_PRELUDE = r"""
__device__ __forceinline__ float hv_h2f(unsigned short h) {
    float f; asm("{cvt.f32.f16 %0, %1;}" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short hv_f2h(float f) {
    unsigned short h; asm("{cvt.rn.f16.f32 %0, %1;}" : "=h"(h) : "f"(f)); return h; }
"""
BF16_PRELUDE = r"""
__device__ __forceinline__ float hv_b2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short hv_f2b(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16); }
"""

_CTYPE = {"bool": "unsigned char", "uint8": "unsigned char", "int8": "signed char",
          "int16": "short", "int32": "int", "int64": "long long", "float16": "unsigned short",
          "bfloat16": "unsigned short", "float32": "float", "float64": "double"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _load(dtype: str, expr: str, ctype: str) -> str:
    """``expr`` (a raw element) as a value of C type ``ctype``."""
    if dtype == "float16":
        return f"({ctype})hv_h2f({expr})"
    if dtype == "bfloat16":
        return f"({ctype})hv_b2f({expr})"
    return f"({ctype})({expr})"


def _store(dtype: str, value: str) -> str:
    """The raw element of ``dtype`` for ``value`` (float/double/long long)."""
    if dtype == "float16":
        return f"hv_f2h((float)({value}))"
    if dtype == "bfloat16":
        return f"hv_f2b((float)({value}))"
    if dtype == "bool":
        return f"(unsigned char)(({value}) != 0)"
    return f"({_CTYPE[dtype]})({value})"


def kernel_name(src: str, dst: str) -> str:
    return f"hvddp_copy_{src}_{dst}"


def kernel_source(src: str, dst: str, prelude: bool = True) -> str:
    """CUDA source of the table-driven copy ``dst = src * scale`` for one dtype pair.

    Math follows ``executor._scaled_copy``: unscaled copies convert directly (through float for
    half types); scaled floats multiply in float32, or float64 when either side is float64;
    scaled integers divide exactly by k when the scale is 1/k (an Average), else multiply in
    float64; both truncate toward zero.
    """
    for d in (src, dst):
        if d not in _CTYPE:
            raise ValueError(f"no kernel for dtype {d!r}; known: {', '.join(_CTYPE)}.")
    s_t, d_t = _CTYPE[src], _CTYPE[dst]
    floaty = src in _FLOATS or dst in _FLOATS
    if floaty and (src in _FLOATS) != (dst in _FLOATS):
        raise ValueError(f"no kernel between {src} and {dst}: the GPU path only widens and narrows "
                         f"within floats or within integers.")
    if floaty:
        wide = "double" if "float64" in (src, dst) else "float"
        plain = _store(dst, _load(src, "x", wide))
        scaled = _store(dst, f"{_load(src, 'x', wide)} * ({wide})scale")
    else:
        plain = _store(dst, _load(src, "x", "long long"))
        scaled = f"trunc({_load(src, 'x', 'double')} * scale)"
        if "bool" not in (src, dst):  # an Average's 1/k divides exactly (C's / truncates toward zero)
            scaled = f"(k >= 2 && 1.0 / (double)k == scale ? {_load(src, 'x', 'long long')} / k : (long long){scaled})"
        scaled = _store(dst, scaled)
    name = kernel_name(src, dst)
    head = HALF_PRELUDE + BF16_PRELUDE if prelude else ""
    return head + f"""
extern "C" __global__ void {name}(const long long* table, long long n, long long nblocks,
                                  double scale, int scaled) {{
    const long long b = blockIdx.x;
    if (b >= nblocks) return;
    const long long e = table[3 * n + b];
    const long long first = table[3 * n + nblocks + b] + threadIdx.x;
    const long long count = table[2 * n + e];
    const {s_t}* s = (const {s_t}*)table[e];
    const long long k = scale > 0.0 && scale <= 0.5 ? llround(1.0 / scale) : 0;
    {d_t}* d = ({d_t}*)table[n + e];
    {s_t} xs[{PER_THREAD}];
    #pragma unroll
    for (int j = 0; j < {PER_THREAD}; ++j) {{  // every load first: {PER_THREAD} in flight per thread
        const long long i = first + (long long)j * {BLOCK_THREADS};
        xs[j] = s && i < count ? s[i] : ({s_t})0;
    }}
    #pragma unroll
    for (int j = 0; j < {PER_THREAD}; ++j) {{
        const long long i = first + (long long)j * {BLOCK_THREADS};
        const {s_t} x = xs[j];
        if (i < count) d[i] = scaled ? {scaled} : {plain};
    }}
}}
"""


_kernels: Dict[Tuple[str, str], object] = {}


def _kernel(src: str, dst: str):
    key = (src, dst)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy

        kernel = _kernels[key] = cupy.RawKernel(kernel_source(src, dst), kernel_name(src, dst))
    return kernel


def launch_copy(plan: PackPlan, src_dtype: str, dst_dtype: str, src: Sequence[int],
                dst: Sequence[int], scale: float, stream) -> object:
    """Copy every tensor of ``plan`` in one launch on ``stream``; return the device table.

    The caller keeps the returned table (and the buffers) alive until the stream has passed the
    kernel; CuPy's memory pool is stream-ordered, so allocating under ``with stream`` suffices.

    Args:
        plan: the layout; its block table decides the grid.
        src_dtype, dst_dtype: dtype names of the sources and destinations.
        src, dst: device pointers per tensor (0 as a source writes zeros).
        scale: factor folded into the copy (1.0 for a plain copy).
        stream: a CuPy stream.
    """
    import cupy

    if not plan.nblocks:
        return None
    table_host = pointer_table(plan, src, dst)
    with stream:
        table = cupy.asarray(table_host)
        _kernel(src_dtype, dst_dtype)(
            (plan.nblocks,), (BLOCK_THREADS,),
            (table, np.int64(len(plan.counts)), np.int64(plan.nblocks), np.float64(scale),
             np.int32(scale != 1.0)))
    return table


def expected_blocks(counts: Sequence[int], block_elems: int = BLOCK_ELEMS) -> int:
    return sum(math.ceil(n / block_elems) for n in counts)
