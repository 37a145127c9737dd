"""Single-copy allreduce between ranks on one node, through Linux cross-memory attach.

MPI moves every byte of a shared-memory allreduce through a staging segment (copied in by the
sender, out by the receiver) and reduces into a temporary; an Average then needs one more pass
for its 1/size. When every rank of a communicator is on one node and may read its peers' memory
(``process_vm_readv``: same user, not refused by Yama or seccomp), hvddp does less:

1. the ranks swap the addresses of their input and output arrays (one small ``Allgather``);
2. rank r reduces slice r of the array (1/size of it), reading each peer's slice of the input
   straight from the peer's memory, piece by piece into a cache-sized scratch array, and scales
   it while it is still in cache (Average's 1/size costs no extra pass);
3. after a barrier, each rank copies the other slices, reduced and scaled, from their owners
   into its output;
4. a final ``Allreduce`` of an ok-flag tells every rank that every copy succeeded (and that no
   peer still reads its arrays), so a failure raises on all ranks instead of leaving wrong data.

Each slice is computed by one rank and copied to the others, so all ranks end bit-identical.
``probe()`` decides, collectively, whether a communicator can use this path; ``HVDDP_CMA=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

import numpy as np
from mpi4py import MPI

from ..engine.messages import ReduceOp

SCRATCH_BYTES = 256 << 10  # fits in L2 next to the slice being reduced
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}
_BOOL_UFUNCS = {ReduceOp.MIN: np.logical_and, ReduceOp.MAX: np.logical_or}


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_IOV_MAX = 1024  # Linux's limit on iovecs per process_vm_readv call


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        read = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    read.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                     ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    read.restype = ctypes.c_ssize_t
    return libc


def _allow_peers(libc) -> None:
    """Under Yama's ptrace_scope=1 only ancestors may read a process: let same-user peers."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return
    if scope == "1":
        libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)


class CrossMemory:
    """Single-copy allreduce on one communicator whose ranks all share a node."""

    def __init__(self, comm: MPI.Comm, libc, pids: list) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._read_fn = libc.process_vm_readv
        self._pids = pids
        self._addrs = np.zeros((self.size, 2), dtype=np.int64)
        self._mine = np.zeros(2, dtype=np.int64)
        self._flag = np.zeros(1, dtype=np.int32)
        self._scratch = np.empty(SCRATCH_BYTES, dtype=np.uint8)
        self._local_iov = (_IoVec * _IOV_MAX)()
        self._remote_iov = (_IoVec * _IOV_MAX)()
        self._error: Optional[str] = None

    @classmethod
    def probe(cls, comm: MPI.Comm) -> Optional["CrossMemory"]:
        """Collective over ``comm``: a ``CrossMemory`` on every rank, or None on every rank."""
        size = comm.Get_size()
        if size < 2:
            return None
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        ok = node.Get_size() == size
        node.Free()
        libc = _libc() if ok else None
        ok = libc is not None
        if not comm.allreduce(ok, op=MPI.LAND):
            return None
        _allow_peers(libc)
        pids = comm.allgather(os.getpid())
        marker = np.array([1000003 * (comm.Get_rank() + 1)], dtype=np.int64)
        addrs = comm.allgather(marker.ctypes.data)
        self = cls(comm, libc, pids)
        seen = np.zeros(1, dtype=np.int64)
        for peer in range(size):
            if peer == self.rank:
                continue
            try:
                remote = self._remote_iov
                remote[0].base, remote[0].len = addrs[peer], seen.nbytes
                self._readv(peer, seen.ctypes.data, seen.nbytes, 1)
            except OSError:
                ok = False
                break
            if int(seen[0]) != 1000003 * (peer + 1):
                ok = False
                break
        ok = comm.allreduce(ok, op=MPI.LAND)  # peers are done reading ``marker`` after this
        del marker
        return self if ok else None

    def allreduce(self, src: np.ndarray, dst: np.ndarray, op: int, scale: float = 1.0) -> None:
        """``dst = reduce(src of every rank) * scale`` for one flat contiguous array pair."""
        self.allreduce_many([src], [dst], op, scale)

    def allreduce_many(self, srcs: list, dsts: list, op: int, scale: float = 1.0) -> None:
        """``dsts[i] = reduce(srcs[i] of every rank) * scale`` for flat contiguous arrays.

        ``srcs[i]`` may be ``dsts[i]`` (in place); all arrays share one dtype; ``scale`` must be
        1.0 unless it is floating point. The arrays need not be adjacent: this is fusion without
        a fusion buffer. Collective: every rank passes the same sizes in the same order.
        """
        comm, rank, size = self.comm, self.rank, self.size
        k = len(dsts)
        mine = np.empty((k, 2), dtype=np.int64)
        for i in range(k):
            mine[i, 0] = srcs[i].ctypes.data
            mine[i, 1] = dsts[i].ctypes.data
        addrs = np.empty((size, k, 2), dtype=np.int64)
        comm.Allgather([mine, MPI.INT64_T], [addrs, MPI.INT64_T])
        counts = np.fromiter((d.size for d in dsts), dtype=np.int64, count=k)
        item = dsts[0].itemsize
        # bounds[r, i]: where rank r's slice of array i starts (row size: where it ends)
        bounds = counts[None, :] * np.arange(size + 1, dtype=np.int64)[:, None] // size
        ok = 1
        try:
            self._reduce_slices(srcs, dsts, addrs, bounds, op, scale)
        except OSError as exc:
            self._error, ok = str(exc), 0
        comm.Barrier()  # every slice is reduced (and scaled) by its owner
        if ok:
            try:
                self._gather_slices(dsts, addrs, bounds)
            except OSError as exc:
                self._error, ok = str(exc), 0
        flag = self._flag
        flag[0] = ok
        # also the barrier after which no peer reads this rank's arrays any more
        comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT32_T], MPI.MIN)
        if not flag[0]:
            mine_error, self._error = self._error, None
            raise OSError(f"single-copy allreduce failed on "
                          f"{'this rank: ' + mine_error if mine_error else 'another rank'}; set "
                          f"HVDDP_CMA=0 to reduce through MPI instead.")

    def _reduce_slices(self, srcs, dsts, addrs, bounds, op: int, scale: float) -> None:
        """Reduce this rank's slice of every array, scratch-sized pieces at a time."""
        dtype = dsts[0].dtype
        ufunc = (_BOOL_UFUNCS if dtype.kind == "b" else _UFUNCS)[op]
        factor = dtype.type(scale) if scale != 1.0 else None
        item = dtype.itemsize
        room = max(1, SCRATCH_BYTES // item)
        scratch = self._scratch.view(dtype)
        scratch_base = self._scratch.ctypes.data
        rank = self.rank
        peers = [p for p in range(self.size) if p != rank]
        remote = self._remote_iov
        pieces = []  # (array index, start, stop), together at most one scratch-full

        def flush(used):
            for n_peer, peer in enumerate(peers):
                src_addrs = addrs[peer, :, 0]
                for j, (i, start, stop) in enumerate(pieces):
                    remote[j].base = int(src_addrs[i]) + start * item
                    remote[j].len = (stop - start) * item
                self._readv(peer, scratch_base, used * item, len(pieces))
                offset = 0
                for i, start, stop in pieces:
                    end = offset + stop - start
                    out = dsts[i][start:stop]
                    ufunc(out if n_peer else srcs[i][start:stop], scratch[offset:end], out=out)
                    offset = end
            if factor is not None:
                for i, start, stop in pieces:
                    out = dsts[i][start:stop]
                    np.multiply(out, factor, out=out)

        used = 0
        lo, hi = bounds[rank].tolist(), bounds[rank + 1].tolist()
        for i in range(len(dsts)):
            start, stop = lo[i], hi[i]
            while start < stop:
                take = min(stop - start, room - used)
                pieces.append((i, start, start + take))
                used += take
                start += take
                if used == room or len(pieces) == _IOV_MAX:
                    flush(used)
                    pieces.clear()
                    used = 0
        if pieces:
            flush(used)

    def _gather_slices(self, dsts, addrs, bounds) -> None:
        """Copy every peer's reduced slices into this rank's outputs, many per system call."""
        item = dsts[0].itemsize
        local, remote = self._local_iov, self._remote_iov
        outs = [d.ctypes.data for d in dsts]
        for peer in range(self.size):
            if peer == self.rank:
                continue
            lo, hi = bounds[peer].tolist(), bounds[peer + 1].tolist()
            dst_addrs = addrs[peer, :, 1].tolist()
            n = 0
            for i in range(len(dsts)):
                if hi[i] <= lo[i]:
                    continue
                nbytes = (hi[i] - lo[i]) * item
                local[n].base = outs[i] + lo[i] * item
                remote[n].base = dst_addrs[i] + lo[i] * item
                local[n].len = remote[n].len = nbytes
                n += 1
                if n == _IOV_MAX:
                    self._readv_iov(peer, n)
                    n = 0
            if n:
                self._readv_iov(peer, n)

    def _readv(self, peer: int, local_base: int, nbytes: int, count: int) -> None:
        """Read ``count`` remote iovecs into one local range."""
        local = self._local_iov
        local[0].base = local_base
        local[0].len = nbytes
        self._call(peer, 1, count, nbytes)

    def _readv_iov(self, peer: int, count: int) -> None:
        """Read ``count`` remote iovecs into as many local ones (pairwise the same lengths)."""
        local = self._local_iov
        self._call(peer, count, count, sum(local[j].len for j in range(count)))

    def _call(self, peer: int, n_local: int, n_remote: int, expected: int) -> None:
        done = self._read_fn(self._pids[peer], self._local_iov, n_local, self._remote_iov, n_remote, 0)
        if done != expected:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from rank {peer} (pid {self._pids[peer]}) read "
                               f"{done} of {expected} bytes: {os.strerror(err) if done < 0 else 'short read'}")
