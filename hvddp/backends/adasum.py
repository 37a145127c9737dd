"""Adasum: combine gradients by how much they agree instead of averaging them, over MPI.

For two gradients ``a`` and ``b`` of one tensor, Adasum (Maleki et al., "Scaling Distributed
Training with Adaptive Summation", MLSys 2021) is

    (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add, equal ones average, and the result lies between. Ranks combine in a
binary tree by rank, as Horovod's does: at level 1 each rank pairs with ``rank ^ 1``, then each
pair with the next pair (``rank ^ 2``), and so on, so the process set's size must be a power of
two. As in Horovod, the buffer is halved at each level (vector halving, distance doubling): the
two partners swap halves of the part they hold, each combines the half it keeps, and the dot
product and norms of every tensor are summed over the ranks that hold its pieces (in a fixed
order, so every one of them gets the same sums). After the last level each rank holds
1/size of the result, computed by it alone; the halves then travel back the same way, so every
rank ends with the same bits. Each rank sends and receives about twice the buffer in all, and a
receive buffer of half its size is the only extra memory.

The sums are taken per tensor, in float64, 64K elements at a time (so the float64 temporaries
stay small however large the tensor); a norm below sqrt(DBL_MIN) leaves its coefficient at 1
(so a joined rank's zeros change nothing).
"""

from __future__ import annotations

import sys
from typing import List, Sequence, Tuple

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
    bounds = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).tolist()
    received = np.empty((buf.size + 1) // 2, dtype=buf.dtype)
    lo, hi = 0, buf.size  # the part of the buffer this rank holds
    held: List[Tuple[int, int]] = []
    level = 1
    while level < size:
        peer = rank ^ level
        lower = not rank & level  # holds the left operand: the lower block's combination
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        theirs = received[:keep[1] - keep[0]]
        _exchange(comm, buf[give[0]:give[1]], theirs, peer, chunk_bytes)
        mine = buf[keep[0]:keep[1]]
        left, right = (mine, theirs) if lower else (theirs, mine)
        sums = _partial_sums(left, right, keep[0], bounds)
        sums = _block_sum(comm, rank, level, sums)  # over the 2 * level ranks sharing the tensors
        _scaled_add(mine, left, right, keep[0], bounds, sums)
        held.append((lo, hi))
        lo, hi = keep
        level <<= 1
    while held:  # back up the tree: swap the parts held, the parent part is then whole
        level >>= 1
        parent_lo, parent_hi = held.pop()
        other = (hi, parent_hi) if lo == parent_lo else (parent_lo, lo)
        _exchange(comm, buf[lo:hi], buf[other[0]:other[1]], rank ^ level, chunk_bytes)
        lo, hi = parent_lo, parent_hi


def _overlaps(start: int, n: int, bounds: list):
    """``(tensor index, offset in the part, offset past it)`` for every tensor meeting the part
    ``[start, start + n)`` of the buffer."""
    stop = start + n
    first = int(np.searchsorted(bounds, start, side="right")) - 1
    for i in range(max(first, 0), len(bounds) - 1):
        a, b = max(bounds[i], start), min(bounds[i + 1], stop)
        if bounds[i] >= stop:
            break
        if b > a:
            yield i, a - start, b - start


def _partial_sums(left: np.ndarray, right: np.ndarray, start: int, bounds: list) -> np.ndarray:
    """Per tensor, (left.right, left.left, right.right) over this part, in float64."""
    sums = np.zeros((len(bounds) - 1, 3), dtype=np.float64)
    for i, a0, b0 in _overlaps(start, left.size, bounds):
        for at in range(a0, b0, _PIECE):
            a = left[at:min(at + _PIECE, b0)].astype(np.float64)
            b = right[at:min(at + _PIECE, b0)].astype(np.float64)
            sums[i] += (np.dot(a, b), np.dot(a, a), np.dot(b, b))
    return sums


def _block_sum(comm: MPI.Comm, rank: int, level: int, sums: np.ndarray) -> np.ndarray:
    """The sum of ``sums`` over the block of ``2 * level`` ranks around this one, by recursive
    doubling; each step adds the lower partner's to the upper's in that order, so both partners,
    and at the end every rank of the block, hold the same bits."""
    theirs = np.empty_like(sums)
    step = 1
    while step <= level:
        comm.Sendrecv([sums, MPI.DOUBLE], dest=rank ^ step, sendtag=_TAG,
                      recvbuf=[theirs, MPI.DOUBLE], source=rank ^ step, recvtag=_TAG)
        sums = sums + theirs if not rank & step else theirs + sums
        step <<= 1
    return sums


def _scaled_add(out: np.ndarray, left: np.ndarray, right: np.ndarray, start: int, bounds: list,
                sums: np.ndarray) -> None:
    """``out = ca * left + cb * right`` per tensor, with each tensor's coefficients from ``sums``."""
    for i, a0, b0 in _overlaps(start, out.size, bounds):
        dot, left_sq, right_sq = sums[i].tolist()
        ca = 1.0 - dot / left_sq * 0.5 if left_sq >= _TINY else 1.0
        cb = 1.0 - dot / right_sq * 0.5 if right_sq >= _TINY else 1.0
        for at in range(a0, b0, _PIECE):
            stop = min(at + _PIECE, b0)
            a = left[at:stop].astype(np.float64)
            a *= ca
            a += cb * right[at:stop].astype(np.float64)
            out[at:stop] = a


def _exchange(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, peer: int, chunk_bytes: int) -> None:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it, in chunks; the two may differ in
    length (by the one element of an odd split): the peer's are the same two, swapped."""
    out, into = send.view(np.uint8), recv.view(np.uint8)
    step = max(int(chunk_bytes), 1)
    for at in range(0, max(out.size, into.size, 1), step):
        comm.Sendrecv([out[at:at + step], MPI.BYTE], dest=peer, sendtag=_TAG,
                      recvbuf=[into[at:at + step], MPI.BYTE], source=peer, recvtag=_TAG)
