"""Adasum: combine gradients by how much they agree instead of averaging them, over MPI.

For two gradients ``a`` and ``b`` of one tensor, Adasum (Maleki et al., "Scaling Distributed
Training with Adaptive Summation", MLSys 2021) is

    (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add, equal ones average, and the result lies between. Ranks combine in a
binary tree by rank, as Horovod's does: at level 1 each rank pairs with ``rank ^ 1``, then each
pair with the next pair (``rank ^ 2``), and so on, so the process set's size must be a power of
two. Here the partners swap whole buffers at each level (Horovod halves them, which moves fewer
bytes at large sizes; the tree and the formula are the same). The dot product and the norms are
taken per tensor, in float64, 64K elements at a time (so the float64 temporaries stay small
however large the tensor); a norm below sqrt(DBL_MIN) leaves its coefficient at 1 (so a joined
rank's zeros change nothing). The lower-ranked side of each pair computes the three sums and
sends them to its partner, so both sides apply the same coefficients to the same operands in the
same order and stay bit-identical. Memory: one receive buffer the size of the batch.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
from mpi4py import MPI

_TAG = 0x4ADA  # the engine's communicators carry no other point-to-point traffic
_TINY = float(np.sqrt(sys.float_info.min))
_PIECE = 1 << 16  # elements per float64 temporary (512 KiB)


def combine(comm: MPI.Comm, buf: np.ndarray, counts: Sequence[int], chunk_bytes: int) -> None:
    """Replace ``buf`` (tensors of ``counts`` elements, back to back) by their Adasum over ``comm``.

    Collective: every rank passes the same dtype and counts; the size must be a power of two.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size & (size - 1):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, got {size}.")
    other = np.empty_like(buf)
    sums = np.empty((len(counts), 3), dtype=np.float64)
    level = 1
    while level < size:
        peer = rank ^ level
        _swap(comm, buf, other, peer, chunk_bytes)
        lower = not rank & level
        left, right = (buf, other) if lower else (other, buf)
        if lower:
            _sums(left, right, counts, sums)
            comm.Send([sums, MPI.DOUBLE], dest=peer, tag=_TAG)
        else:
            comm.Recv([sums, MPI.DOUBLE], source=peer, tag=_TAG)
        start = 0
        for (dot, left_sq, right_sq), n in zip(sums.tolist(), counts):
            ca = 1.0 - dot / left_sq * 0.5 if left_sq >= _TINY else 1.0
            cb = 1.0 - dot / right_sq * 0.5 if right_sq >= _TINY else 1.0
            for at in range(start, start + n, _PIECE):  # float64 a piece at a time: bounded memory
                stop = min(at + _PIECE, start + n)
                a = left[at:stop].astype(np.float64)
                a *= ca
                a += cb * right[at:stop].astype(np.float64)
                buf[at:stop] = a
            start += n
        level <<= 1


def _sums(left: np.ndarray, right: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
    start = 0
    for i, n in enumerate(counts):
        dot = left_sq = right_sq = 0.0
        for at in range(start, start + n, _PIECE):
            a = left[at:min(at + _PIECE, start + n)].astype(np.float64)
            b = right[at:min(at + _PIECE, start + n)].astype(np.float64)
            dot += float(np.dot(a, b))
            left_sq += float(np.dot(a, a))
            right_sq += float(np.dot(b, b))
        out[i] = (dot, left_sq, right_sq)
        start += n


def _swap(comm: MPI.Comm, mine: np.ndarray, theirs: np.ndarray, peer: int, chunk_bytes: int) -> None:
    send, recv = mine.view(np.uint8), theirs.view(np.uint8)
    step = max(int(chunk_bytes), 1)
    for at in range(0, send.size, step):
        stop = min(at + step, send.size)
        comm.Sendrecv([send[at:stop], MPI.BYTE], dest=peer, sendtag=_TAG,
                      recvbuf=[recv[at:stop], MPI.BYTE], source=peer, recvtag=_TAG)
