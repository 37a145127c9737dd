"""Single-copy allreduce between ranks on one node, through Linux cross-memory attach.

MPI moves every byte of a shared-memory allreduce through a staging segment (copied in by the
sender, out by the receiver) and reduces into a temporary; an Average then needs one more pass
for its 1/size. When every rank of a communicator is on one node and may access its peers'
memory (``process_vm_readv``/``process_vm_writev``: same user, not refused by Yama or seccomp),
hvddp does less:

1. the ranks swap the addresses of their input and output arrays (one small ``Allgather``);
2. rank r owns slice r (1/size) of every array. Piece by piece, it reads the peers' inputs for
   that piece straight from their memory into a cache-sized scratch array, reduces them with its
   own into its output, scales the piece while it is in cache (Average's 1/size costs no extra
   pass) and writes it, still in cache, into every peer's output;
3. a final ``Allreduce`` of an ok-flag tells every rank that all pieces arrived (and that no peer
   touches its arrays any more), so a failure raises on all ranks instead of leaving wrong data.

In place is safe: the input piece a rank reads from a peer lies in the slice that rank owns, and
the owner is the only one to write there, after reading it. Each slice is computed by one rank
and copied to the others, so all ranks end bit-identical. ``probe()`` decides, collectively,
whether a communicator can use this path; ``HVDDP_CMA=0`` turns it off.

That suits large arrays. For a fusion group of small ones (``allreduce_packed``) the per-array
steps cost more than the copies they save, so they are packed into two staging buffers mapped
once per communicator (on huge pages), and the same slice-owner scheme runs on the staged
chunks, one chunk packed while the other is reduced.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Optional

import numpy as np
from mpi4py import MPI

from ..engine.executor import _scaled_copy, address, shares_memory
from ..engine.messages import ReduceOp
from .mpi import ieee_maximum, ieee_minimum

SCRATCH_BYTES = 256 << 10  # fits in L2 next to the slice being reduced
STAGE_BYTES = 4 << 20  # each of the two staging buffers of allreduce_packed
_HUGE_PAGE = 2 << 20
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
# -0.0 below +0.0, as on the MPI path: every slice's zeros get the same sign whichever rank owns it
_FLOAT_UFUNCS = {**_UFUNCS, ReduceOp.MIN: ieee_minimum, ReduceOp.MAX: ieee_maximum}


def _rescaling(dtype: np.dtype, scale: float):
    """What multiplies a reduced piece by ``scale`` in place (None for 1): in its own type for
    floats; integers divided exactly by k when scale is 1/k (an Average), else in float64."""
    if scale == 1.0:
        return None
    if dtype.kind == "f":
        factor = dtype.type(scale)
        return lambda acc: np.multiply(acc, factor, out=acc)
    return lambda acc: _scaled_copy(acc, acc, scale)


def _ufunc(dtype: np.dtype, op: int):
    return (_BOOL_UFUNCS if dtype.kind == "b" else _FLOAT_UFUNCS if dtype.kind == "f" else _UFUNCS)[op]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_IOV_MAX = 1024  # Linux's limit on iovecs per process_vm_readv/writev call


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        functions = (libc.process_vm_readv, libc.process_vm_writev)
    except (OSError, AttributeError):
        return None
    for fn in functions:
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return libc


def _allow_peers(libc) -> bool:
    """Under Yama's ptrace_scope=1 only ancestors may attach: let same-user processes. True if set."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return False
    if scope != "1":
        return False
    return libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) == 0


class CrossMemory:
    """Single-copy allreduce on one communicator whose ranks all share a node."""

    # fused arrays smaller than this go through the staging buffers (on 2 ranks, staged was
    # 1.3-1.6x faster for 25 KiB arrays, even at 100 KiB, 1.25-1.6x slower at 400 KiB)
    packed_below_bytes = 64 << 10

    def __init__(self, comm: MPI.Comm, libc, pids: list) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._readv_fn = libc.process_vm_readv
        self._writev_fn = libc.process_vm_writev
        self._pids = pids
        self._flag = np.zeros(1, dtype=np.int32)
        # one region per peer, so that each piece is reduced over every peer before the next
        self._region_bytes = max(SCRATCH_BYTES // max(self.size - 1, 1) // 64 * 64, 64 << 10)
        self._scratch = np.empty(self._region_bytes * max(self.size - 1, 1), dtype=np.uint8)
        self._local_table = np.zeros((_IOV_MAX, 2), dtype=np.uint64)  # [base, length] rows numpy
        self._local_iov = (_IoVec * _IOV_MAX).from_buffer(self._local_table)  # fills (_copy_own)
        self._remote_iov = (_IoVec * _IOV_MAX)()
        self._error: Optional[str] = None
        self._stages: Optional[list] = None  # [mapping, the two buffers, each rank's address of them]

    @classmethod
    def probe(cls, comm: MPI.Comm) -> Optional["CrossMemory"]:
        """Collective over ``comm``: a ``CrossMemory`` on every rank, or None on every rank.

        Every rank reads a marker from each peer and, only if it read the right one, writes one
        into it; then each checks what it got. Under Yama's ptrace_scope=1 a first failure is
        retried after letting same-user processes attach (``PR_SET_PTRACER``).
        """
        size, rank = comm.Get_size(), comm.Get_rank()
        if size < 2:
            return None
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        ok = node.Get_size() == size
        node.Free()
        libc = _libc() if ok else None
        if not comm.allreduce(libc is not None, op=MPI.LAND):
            return None
        self = cls(comm, libc, comm.allgather(os.getpid()))
        if self._exchange_markers():
            return self
        if comm.allreduce(_allow_peers(libc), op=MPI.LOR) and self._exchange_markers():
            return self
        return None

    def _exchange_markers(self) -> bool:
        comm, size, rank = self.comm, self.size, self.rank
        marker = np.array([_marker(rank, rank)], dtype=np.int64)
        inbox = np.zeros(size, dtype=np.int64)  # slot q: written by rank q
        addrs = comm.allgather((marker.ctypes.data, inbox.ctypes.data))
        seen = np.zeros(1, dtype=np.int64)
        ok = True
        for peer in range(size):
            if peer == rank:
                continue
            try:
                self._one(self._readv_fn, peer, seen, addrs[peer][0])
                if int(seen[0]) != _marker(peer, peer):  # not the process we think it is
                    ok = False
                    break
                note = np.array([_marker(rank, peer)], dtype=np.int64)
                self._one(self._writev_fn, peer, note, addrs[peer][1] + rank * 8)
            except OSError:
                ok = False
                break
        comm.Barrier()  # every write has landed
        ok = ok and all(int(inbox[q]) == _marker(q, rank) for q in range(size) if q != rank)
        ok = comm.allreduce(ok, op=MPI.LAND)  # and no peer touches ``marker``/``inbox`` after this
        del marker, inbox
        return ok

    def _one(self, fn, peer: int, local: np.ndarray, address: int) -> None:
        self._local_iov[0].base, self._local_iov[0].len = local.ctypes.data, local.nbytes
        self._remote_iov[0].base, self._remote_iov[0].len = address, local.nbytes
        self._call(fn, peer, 1, 1, local.nbytes)

    def allreduce(self, src: np.ndarray, dst: np.ndarray, op: int, scale: float = 1.0) -> None:
        """``dst = reduce(src of every rank) * scale`` for one flat contiguous array pair."""
        self.allreduce_many([src], [dst], op, scale)

    def allreduce_many(self, srcs: list, dsts: list, op: int, scale: float = 1.0) -> None:
        """``dsts[i] = reduce(srcs[i] of every rank) * scale`` for flat contiguous arrays.

        ``srcs[i]`` may be ``dsts[i]`` (in place); all arrays share one dtype; integer results
        are divided exactly by k when scale is 1/k (an Average), else scaled in float64, and
        truncated toward zero. The arrays need not be adjacent: this
        is fusion without a fusion buffer. Outputs may share memory (the same array twice in a
        group) as long as no input does: the slices' owners then all write final values there.
        Collective: every rank passes the same sizes in the same order.
        """
        comm, size = self.comm, self.size
        k = len(dsts)
        ins = list(map(address, srcs))
        outs = [a if d is s else address(d) for a, s, d in zip(ins, srcs, dsts)]
        mine = np.array([ins, outs], dtype=np.int64).T.copy()
        shared = k > 1 and shares_memory(mine[:, 1], dsts)
        addrs = np.empty((size, k, 2), dtype=np.int64)
        comm.Allgather([mine, MPI.INT64_T], [addrs, MPI.INT64_T])
        ok = 1
        try:
            self._reduce_and_push(srcs, dsts, addrs, op, scale, shared)
        except Exception as exc:  # whatever it was, the peers must still hear of it
            ok = 0
            self._note(exc)
        # also the barrier after which no peer touches this rank's arrays any more
        if not self._all_ok(ok):
            self._raise_failure(int(self._flag[0]))

    def _all_ok(self, ok: bool) -> bool:
        """Whether every rank is ok (collective: an ``Allreduce`` of an ok-flag, also a barrier);
        if not, ``self._flag[0]`` names the first rank that failed."""
        flag = self._flag
        flag[0] = self.size if ok else self.rank
        self.comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT32_T], MPI.MIN)
        return flag[0] == self.size

    def _note(self, exc: Exception) -> None:
        self._error = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"

    def _raise_failure(self, first: int) -> None:
        """Raise, on every rank alike, that rank ``first`` (the lowest to fail) failed."""
        mine_error, self._error = self._error, None
        where = f"this rank: {mine_error}" if mine_error else f"rank {first} of the process set"
        raise OSError(f"single-copy allreduce failed on {where}; set HVDDP_CMA=0 to reduce "
                      f"through MPI instead.")

    def _reduce_and_push(self, srcs, dsts, addrs, op: int, scale: float, shared: bool) -> None:
        """Reduce this rank's slice of every array and write it to the peers, a scratch at a time.

        ``shared``: some outputs overlap, so another rank may write final values into an output
        piece at any time; the piece is then reduced in the scratch and written once.
        """
        dtype = dsts[0].dtype
        ufunc = _ufunc(dtype, op)
        rescale = _rescaling(dtype, scale)
        item = dtype.itemsize
        room = max(1, self._region_bytes // item)  # elements per peer region
        scratch = self._scratch.view(dtype)
        scratch_base = self._scratch.ctypes.data
        rank, size = self.rank, self.size
        peers = [p for p in range(size) if p != rank]
        local, remote = self._local_iov, self._remote_iov
        readv, writev, call = self._readv_fn, self._writev_fn, self._call
        where = addrs.tolist()  # where[peer][i] = [input address, output address]
        mine = where[rank]
        # (array index, byte offset, bytes, output view, input view), at most a region-full
        pieces = []

        def flush(used):
            n = len(pieces)
            nbytes = used * item
            for m, peer in enumerate(peers):  # every peer's inputs, each into its own region
                theirs = where[peer]
                for j, (i, offset, length, _, _) in enumerate(pieces):
                    remote[j].base = theirs[i][0] + offset
                    remote[j].len = length
                local[0].base, local[0].len = scratch_base + m * room * item, nbytes
                call(readv, peer, 1, n, nbytes)
            at = 0
            for _, _, length, out, src in pieces:  # each piece over every peer, then the next
                stop = at + length // item
                acc = scratch[at:stop] if shared else out
                ufunc(src, scratch[at:stop], out=acc)
                for m in range(1, len(peers)):
                    ufunc(acc, scratch[m * room + at:m * room + stop], out=acc)
                if rescale is not None:
                    rescale(acc)
                if shared:
                    np.copyto(out, acc)
                at = stop
            for j, (i, offset, length, _, _) in enumerate(pieces):
                local[j].base = mine[i][1] + offset
                local[j].len = length
            for peer in peers:  # push: the same pieces, still in cache
                theirs = where[peer]
                for j, (i, offset, length, _, _) in enumerate(pieces):
                    remote[j].base = theirs[i][1] + offset
                    remote[j].len = length
                call(writev, peer, n, n, nbytes)

        used = 0
        for i, d in enumerate(dsts):
            count = d.size
            start, stop = count * rank // size, count * (rank + 1) // size
            src = srcs[i]
            while start < stop:
                take = min(stop - start, room - used)
                end = start + take
                pieces.append((i, start * item, take * item, d[start:end], src[start:end]))
                used += take
                start = end
                if used == room or len(pieces) == _IOV_MAX:
                    flush(used)
                    pieces.clear()
                    used = 0
        if pieces:
            flush(used)

    def allreduce_packed(self, srcs: list, dsts: list, op: int, scale: float = 1.0) -> None:
        """``allreduce_many`` for many small arrays: packed through two staging buffers.

        Per array the direct way costs several Python-level steps and system calls on both
        sides; here each rank packs its arrays into a staging buffer of ``STAGE_BYTES`` with one
        system call per chunk (the kernel gathers the pieces), and the peers read and write only
        the staging buffers, whose addresses are exchanged once. Chunk by chunk: rank r reduces
        slice r of every rank's staged chunk and writes the result into every peer's staging
        buffer, while the next chunk is packed into the other buffer; one small ``Allreduce``
        per chunk (of an ok-flag, so a failure stops every rank at once) separates the steps;
        then each rank unpacks (one system call scatters the chunk). Collective: every rank
        passes the same sizes in the same order.
        """
        if self._stages is None:
            self._stages = self._make_stages()
        bases = self._stages[2]
        own = bases[self.rank]
        dtype = dsts[0].dtype
        item = dtype.itemsize
        k = len(dsts)
        sizes = np.fromiter((d.size for d in dsts), dtype=np.int64, count=k)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        total = int(ends[-1]) if k else 0
        ins = np.fromiter(map(address, srcs), dtype=np.int64, count=k)
        outs = ins if all(d is s for d, s in zip(dsts, srcs)) else \
            np.fromiter(map(address, dsts), dtype=np.int64, count=k)
        per_chunk = STAGE_BYTES // item
        chunks = [(c, min(c + per_chunk, total)) for c in range(0, total, per_chunk)]
        failed = False

        def move(fn, arrays: np.ndarray, c: int) -> None:
            """Between the arrays (at addresses ``arrays``) and staging buffer c % 2: chunk c."""
            lo, hi = chunks[c]
            first = int(np.searchsorted(ends, lo, side="right"))
            last = int(np.searchsorted(starts, hi, side="left"))
            begin = np.maximum(starts[first:last], lo)
            lengths = (np.minimum(ends[first:last], hi) - begin) * item
            at = arrays[first:last] + (begin - starts[first:last]) * item
            keep = lengths > 0
            self._copy_own(fn, at[keep], lengths[keep], own + c % 2 * STAGE_BYTES)

        def pack(c: int) -> None:
            move(self._writev_fn, ins, c)

        def unpack(c: int) -> None:
            move(self._readv_fn, outs, c)

        def step(work, *args) -> None:
            nonlocal failed
            if not failed:
                try:
                    work(*args)
                except Exception as exc:  # whatever it was, the peers must still hear of it
                    failed = True
                    self._note(exc)

        def sync() -> bool:  # the steps' barrier; False on every rank once any rank failed
            return self._all_ok(not failed)

        if chunks:
            step(pack, 0)
        going = sync()
        for c, (lo, hi) in enumerate(chunks):  # pack c+1 while the peers may still read c
            step(self._reduce_staged, c % 2, hi - lo, dtype, op, scale, bases)
            if c + 1 < len(chunks):
                step(pack, c + 1)
            going = sync()
            if not going:
                break
            step(unpack, c)
        if going and chunks:
            going = sync()  # the last chunk's unpacking
        if not going:
            self._raise_failure(int(self._flag[0]))

    def _make_stages(self) -> list:
        """Two staging buffers in one private anonymous mapping aligned to huge pages (moving
        them between processes costs the kernel less than 4 KiB pages), and every rank's
        address. Collective: a rank that cannot map them makes every rank raise."""
        nbytes = 2 * STAGE_BYTES
        region, start = None, 0
        try:
            region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            whole = np.frombuffer(region, dtype=np.uint8)
            skip = -whole.ctypes.data % _HUGE_PAGE
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
                except (OSError, ValueError):
                    pass  # without huge pages it is only slower
            buf = whole[skip:skip + nbytes]
            buf.fill(0)  # every page present before a peer reads it
            start = buf.ctypes.data
        except (OSError, ValueError, MemoryError) as exc:
            self._error = f"mapping {nbytes >> 20} MiB of staging buffers: {exc}"
        bases = self.comm.allgather(start)
        if not all(bases):
            self._raise_failure(bases.index(0))
        return [region, [buf[:STAGE_BYTES], buf[STAGE_BYTES:]], bases]

    def _reduce_staged(self, which: int, count: int, dtype, op: int, scale: float, bases: list) -> None:
        """Reduce this rank's slice of the staged chunk ``which`` over every peer, a scratch at a
        time, and write each reduced piece into every peer's staging buffer."""
        rank, size, item = self.rank, self.size, dtype.itemsize
        ufunc = _ufunc(dtype, op)
        rescale = _rescaling(dtype, scale)
        start, stop = count * rank // size, count * (rank + 1) // size
        offset = which * STAGE_BYTES
        mine = self._stages[1][which].view(dtype)
        room = max(1, self._region_bytes // item)
        scratch = self._scratch.view(dtype)
        scratch_base = self._scratch.ctypes.data
        peers = [p for p in range(size) if p != rank]
        local, remote = self._local_iov, self._remote_iov
        while start < stop:
            end = min(stop, start + room)
            nbytes = (end - start) * item
            acc = mine[start:end]
            for m, peer in enumerate(peers):
                local[0].base, local[0].len = scratch_base + m * room * item, nbytes
                remote[0].base, remote[0].len = bases[peer] + offset + start * item, nbytes
                self._call(self._readv_fn, peer, 1, 1, nbytes)
            for m in range(len(peers)):
                ufunc(acc, scratch[m * room:m * room + end - start], out=acc)
            if rescale is not None:
                rescale(acc)
            local[0].base, local[0].len = acc.ctypes.data, nbytes
            for peer in peers:
                remote[0].base, remote[0].len = bases[peer] + offset + start * item, nbytes
                self._call(self._writev_fn, peer, 1, 1, nbytes)
            start = end

    def _copy_own(self, fn, at: np.ndarray, lengths: np.ndarray, staged: int) -> None:
        """Between this rank's pieces (addresses ``at``, byte ``lengths``) and its own staging
        memory from ``staged`` on: ``process_vm_writev`` packs, ``process_vm_readv`` unpacks; the
        kernel walks the pieces, a thousand per call, where numpy would take a call per piece."""
        table, remote = self._local_table, self._remote_iov
        for s in range(0, at.size, _IOV_MAX):
            n = min(_IOV_MAX, at.size - s)
            table[:n, 0] = at[s:s + n]
            table[:n, 1] = lengths[s:s + n]
            nbytes = int(lengths[s:s + n].sum())
            remote[0].base, remote[0].len = staged, nbytes
            self._call(fn, self.rank, n, 1, nbytes)
            staged += nbytes

    def _call(self, fn, peer: int, n_local: int, n_remote: int, expected: int) -> None:
        done = fn(self._pids[peer], self._local_iov, n_local, self._remote_iov, n_remote, 0)
        if done != expected:
            err = ctypes.get_errno()
            what = "process_vm_readv from" if fn is self._readv_fn else "process_vm_writev to"
            raise OSError(err, f"{what} rank {peer} (pid {self._pids[peer]}) moved {done} of "
                               f"{expected} bytes: {os.strerror(err) if done < 0 else 'short transfer'}")


def _marker(owner: int, reader: int) -> int:
    return 1000003 * (owner + 1) + 7919 * (reader + 1)
