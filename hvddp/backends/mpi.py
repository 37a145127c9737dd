"""CPU collectives on mpi4py's buffer methods: in place, zero copy, split into chunks.

MPICH's bandwidth collapses above ~16 MB per call on one node, so every reduction is issued in
pieces of ``chunk_bytes`` (4 MiB by default; ``HVDDP_MPI_CHUNK_BYTES``). Waits that may be long
(negotiation) use nonblocking calls polled with a sleeping backoff, so that a waiting rank does
not busy-poll a core away from the training thread that shares it.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..engine.messages import ReduceOp

_MPI_TYPES = {
    "bool": MPI.C_BOOL,
    "uint8": MPI.UINT8_T,
    "int8": MPI.INT8_T,
    "int16": MPI.INT16_T,
    "int32": MPI.INT32_T,
    "int64": MPI.INT64_T,
    "float32": MPI.FLOAT,
    "float64": MPI.DOUBLE,
}

# keyed by dtype object: numpy's dtype.name is slow enough to matter per tensor
_TYPE_OF = {np.dtype(name): mpitype for name, mpitype in _MPI_TYPES.items()}

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVERAGE: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
}

_BOOL_OPS = {ReduceOp.MIN: MPI.LAND, ReduceOp.MAX: MPI.LOR}


def _numpy_op(ufunc, types) -> MPI.Op:
    """An MPI op that reduces with a numpy ufunc; ``types``: (MPI datatype, numpy dtype) pairs."""
    def reduce(inbuf, inoutbuf, datatype) -> None:
        dtype = next(d for t, d in types if datatype == t)
        ufunc(np.frombuffer(inbuf, dtype=dtype), np.frombuffer(inoutbuf, dtype=dtype),
              out=np.frombuffer(inoutbuf, dtype=dtype))

    return MPI.Op.Create(reduce, commute=True)


def _symmetric(ufunc, keep_sign_if_both: bool):
    """``ufunc`` (numpy's minimum or maximum) made symmetric in its arguments' sign bits: numpy
    returns either zero of a tie (and either NaN of two), so ranks combining in different orders
    ended with different bits (+0.0 on one, -0.0 on another). A minimum is negative exactly when
    either argument is, a maximum when both are, so the result takes that sign bit: -0.0 ranks
    below +0.0 (IEEE 754-2019's minimum and maximum), other values keep their sign, and a NaN's
    sign no longer depends on the order. Of two NaNs the one with the larger payload is kept (numpy
    keeps the first), so NaNs of different payloads end as the same bits on every rank too."""
    both = np.bitwise_and if keep_sign_if_both else np.bitwise_or

    def reduce(a, b, out=None):
        if out is None:
            out = np.empty_like(a)
        ints = _SAME_SIZE_INT[a.dtype]
        sign = ints(np.iinfo(ints).min)  # the sign bit alone
        scratch = np.empty(min(a.size, _BLOCK), dtype=ints)
        a_bits, b_bits, bits = a.view(ints), b.view(ints), out.view(ints)
        for start in range(0, a.size, _BLOCK):  # a cache-sized block at a time: four passes over
            stop = min(start + _BLOCK, a.size)  # memory would cost four times one
            signs = scratch[:stop - start]
            both(a_bits[start:stop], b_bits[start:stop], out=signs)  # before out (maybe b) changes
            nans = np.isnan(a[start:stop])
            nans &= np.isnan(b[start:stop])
            payloads = None
            if nans.any():  # two NaNs: the larger payload, whichever came first (numpy keeps the first)
                payloads = np.maximum(a_bits[start:stop][nans] & ~sign, b_bits[start:stop][nans] & ~sign)
                payloads |= signs[nans] & sign
            ufunc(a[start:stop], b[start:stop], out=out[start:stop])
            if payloads is not None:
                bits[start:stop][nans] = payloads
            if keep_sign_if_both:  # clear the sign unless both had it
                np.bitwise_or(signs, ~sign, out=signs)
                np.bitwise_and(bits[start:stop], signs, out=bits[start:stop])
            else:  # set it if either had it
                np.bitwise_and(signs, sign, out=signs)
                np.bitwise_or(bits[start:stop], signs, out=bits[start:stop])
        return out

    return reduce


_SAME_SIZE_INT = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}
_BLOCK = 65536  # elements per pass (256-512 KiB): numpy's call overhead against cache misses
ieee_minimum = _symmetric(np.minimum, keep_sign_if_both=False)
ieee_maximum = _symmetric(np.maximum, keep_sign_if_both=True)

# Float Min/Max with numpy's ``minimum``/``maximum``: NaN wins, as it does on the single-copy path
# and in numpy and torch. MPI's own MIN/MAX compare with ``<``, so whether a NaN survived
# depended on its rank and on the algorithm MPI chose for the size.
_FLOATS = ((MPI.DOUBLE, np.float64), (MPI.FLOAT, np.float32))
_FLOAT_OPS = {ReduceOp.MIN: _numpy_op(ieee_minimum, _FLOATS), ReduceOp.MAX: _numpy_op(ieee_maximum, _FLOATS)}
# Sums of 8- and 16-bit integers with numpy's ``add``, which wraps around on overflow as the
# single-copy path, numpy and torch do. Open MPI 5's vectorized MPI_SUM saturates them instead
# (255 + 1 = 255 in uint8, once an array is long enough for its vector code: 16 bytes for the
# 5.0.11 wheel, so 8 elements of int16), so an overflowing sum depended on the MPI
# library and on the array's length.
_SMALL_INTS = ((MPI.INT8_T, np.int8), (MPI.UINT8_T, np.uint8), (MPI.INT16_T, np.int16))
_SMALL_INT_SUM = _numpy_op(np.add, _SMALL_INTS)

SPIN_S = 50e-6  # short waits: keep testing, a peer is usually about to arrive
MAX_BACKOFF_S = 200e-6  # long waits: sleep between tests, at most this long (~5% of a core)


def mpi_op(op: int, dtype) -> MPI.Op:
    """The MPI op for an hvddp op on ``dtype`` (a name or a numpy dtype); bool uses logical ops,
    float Min/Max ops that propagate NaN."""
    kind = getattr(dtype, "kind", "")
    if dtype == "bool" or kind == "b":
        return _BOOL_OPS[op]
    if (kind == "f" or dtype in ("float32", "float64")) and op in _FLOAT_OPS:
        return _FLOAT_OPS[op]
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE) and dtype in ("int8", "uint8", "int16"):  # (names or dtypes)
        return _SMALL_INT_SUM
    return _MPI_OPS[op]


def wait(request: MPI.Request, max_backoff_s: float = MAX_BACKOFF_S) -> None:
    """Complete a nonblocking request without spinning a core: test, then sleep and back off.

    MPI progresses only inside MPI calls, so both sides must keep testing; the sleep is capped
    low because two ranks sleeping in turn would otherwise add their sleeps up.
    """
    if request.Test():
        return
    deadline = time.perf_counter() + SPIN_S
    while time.perf_counter() < deadline:
        if request.Test():
            return
    delay = 10e-6
    while not request.Test():
        time.sleep(delay)
        delay = min(delay * 2, max_backoff_s)


def allreduce_inplace(comm: MPI.Comm, buf: np.ndarray, op: int, chunk_bytes: int) -> None:
    """Reduce a flat contiguous array in place, ``chunk_bytes`` at a time."""
    mpitype = _TYPE_OF[buf.dtype]
    mop = mpi_op(op, buf.dtype)
    step = max(1, chunk_bytes // buf.itemsize)
    n = buf.size
    if n <= step:
        comm.Allreduce(MPI.IN_PLACE, [buf, mpitype], mop)
        return
    for start in range(0, n, step):
        comm.Allreduce(MPI.IN_PLACE, [buf[start:start + step], mpitype], mop)


def allreduce(comm: MPI.Comm, src: np.ndarray, dst: np.ndarray, op: int, chunk_bytes: int) -> None:
    """Reduce flat contiguous ``src`` into ``dst`` (same dtype and size), chunk by chunk."""
    mpitype = _TYPE_OF[src.dtype]
    mop = mpi_op(op, src.dtype)
    step = max(1, chunk_bytes // src.itemsize)
    n = src.size
    if n <= step:
        comm.Allreduce([src, mpitype], [dst, mpitype], mop)
        return
    for start in range(0, n, step):
        stop = start + step
        comm.Allreduce([src[start:stop], mpitype], [dst[start:stop], mpitype], mop)


def reduce_scatter(comm: MPI.Comm, src: np.ndarray, dst: np.ndarray, counts: list, op: int) -> None:
    mpitype = _TYPE_OF[src.dtype]
    comm.Reduce_scatter([src, mpitype], [dst, mpitype], counts, mpi_op(op, src.dtype))


def allgatherv_bytes(comm: MPI.Comm, src: np.ndarray, dst: np.ndarray, counts: list) -> None:
    displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64).tolist()
    comm.Allgatherv([_bytes(src), MPI.BYTE], [_bytes(dst), (counts, displs), MPI.BYTE])


def bcast_bytes(comm: MPI.Comm, buf: np.ndarray, root: int) -> None:
    comm.Bcast([_bytes(buf), MPI.BYTE], root=root)


def alltoallv_bytes(comm: MPI.Comm, src: np.ndarray, send_counts: list,
                    dst: np.ndarray, recv_counts: list) -> None:
    sdispl = np.concatenate([[0], np.cumsum(send_counts[:-1])]).astype(np.int64).tolist()
    rdispl = np.concatenate([[0], np.cumsum(recv_counts[:-1])]).astype(np.int64).tolist()
    comm.Alltoallv([_bytes(src), (send_counts, sdispl), MPI.BYTE],
                   [_bytes(dst), (recv_counts, rdispl), MPI.BYTE])


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)
