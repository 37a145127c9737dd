"""Execution of agreed responses on CPU buffers: fusion, in-place reduction, copy-out scaling.

Every rank executes the same response list in the same order; this module turns that list
into MPI calls. Small allreduces with the same fusion key are packed into one reusable buffer
(prescale folded into the copy in, postscale and Average's 1/size into the copy out); a tensor
alone in its batch is reduced on its own memory. float16 and bfloat16 have no MPI type: they
are reduced in float32, the widening folded into the pack copy and the rounding into the
unpack, which costs twice the bytes on the wire and sums more accurately than half precision.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

try:  # numpy >= 2.0
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - numpy 1.x
    _byte_bounds = np.byte_bounds


from .._dtypes import numpy_dtype as _dtype
from ..exceptions import HvddpError
from ..handles import RAISED as _RAISED
from .messages import Kind, ReduceOp, Request
from .pool import OutputPool

HALF_TYPES = ("float16", "bfloat16")


def wire_dtype(dtype: str) -> str:
    return "float32" if dtype in HALF_TYPES else dtype


class Entry:
    """A request this rank submitted, with its buffers and the handle to complete."""

    __slots__ = ("request", "key", "input", "output", "writeback", "handle", "index", "submitted",
                 "state", "slot", "group_keys", "sig", "cache_version", "ready", "raised")

    def __init__(self, request: Request, input_: Optional[np.ndarray], output: Optional[np.ndarray],
                 handle, index: int, submitted: float, writeback: Optional[np.ndarray] = None) -> None:
        self.request = request
        self.key = (request.ps_id, request.name)  # request.key(), made once
        self.input = input_
        self.output = output  # set for in-place ops; allocated at execution otherwise
        self.writeback = writeback  # a non-contiguous in-place target, written at the end
        self.handle = handle
        self.index = index
        self.submitted = submitted
        self.state = 0
        self.slot = -1
        self.group_keys: Tuple[tuple, ...] = ()
        self.sig = request.signature()
        self.cache_version = -1
        self.ready = None  # device inputs: the event after which the producer's writes are done
        self.raised = _RAISED[0]  # group failures this rank's code had met when it made the call

    def complete(self, value) -> None:
        if self.writeback is not None and value is not None:
            np.copyto(self.writeback, value.reshape(self.writeback.shape))
            value = self.writeback
        self.handle._set_part(self.index, value)

    def fail(self, error: BaseException) -> None:
        self.handle._fail(error)



class Executor:
    """Runs one cycle's agreed work on this rank."""

    def __init__(self, config, process_sets, timeline=None) -> None:
        self.config = config
        self.process_sets = process_sets  # ps_id -> runtime ProcessSet
        self.timeline = timeline
        self._fusion: Dict[str, np.ndarray] = {}
        self.pool = OutputPool()
        from ..backends import mpi as mpi_backend  # imports mpi4py.MPI, so only once running

        self.mpi = mpi_backend
        self.gpu = None  # the GpuExecutor, made on the first device item
        self._cma: Dict[int, object] = {}  # ps_id -> CrossMemory, or None where it cannot run

    def _gpu(self):
        if self.gpu is None:
            from ..backends.gpu import GpuExecutor  # imports CuPy

            self.gpu = GpuExecutor(self.config, self.process_sets, cpu_executor=self,
                                   timeline=self.timeline)
        return self.gpu

    def _gpu_or_none(self):
        """The GpuExecutor, or None where it cannot be made (its batches then fail, named)."""
        try:
            return self._gpu()
        except Exception:
            return None

    def _cross_memory(self, ps_id: int, nbytes: int):
        """The single-copy path for ``nbytes`` on ``ps``, or None (then MPI reduces).

        Decided from agreed sizes only, so every member asks at the same batch; the first ask
        per process set is a collective probe.
        """
        config = self.config
        if not config.cma or nbytes < config.cma_threshold_bytes:
            return None
        cma = self._cma.get(ps_id, False)
        if cma is False:
            from ..backends.cma import CrossMemory

            cma = self._cma[ps_id] = CrossMemory.probe(self.process_sets[ps_id].comm)
        return cma

    def forget_process_set(self, ps_id: int) -> None:
        self._cma.pop(ps_id, None)
        if self.gpu is not None:
            self.gpu.forget_process_set(ps_id)

    def close(self) -> None:
        """Finish device work in flight and release NCCL communicators (engine thread, at exit)."""
        if self.gpu is not None:
            self.gpu.close()

    def _fusion_buffer(self, dtype: str, count: int) -> np.ndarray:
        buf = self._fusion.get(dtype)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=_dtype(dtype))
            self._fusion[dtype] = buf
        return buf[:count]

    # ------------------------------------------------------------------------------------
    def run(self, items: Sequence[Tuple[Request, Optional[Entry], object]]) -> None:
        """Execute ``(agreed request, local entry or None, info)`` items in a fixed order.

        Allreduces are grouped by fusion key (process set, op, scale factors, wire dtype,
        device) into batches of at most ``fusion_threshold_bytes``; a tensor at least that large
        is reduced on its own memory. Other collectives run one by one, before the batches.
        """
        batches: Dict[tuple, list] = {}
        threshold = self.config.fusion_threshold_bytes
        cpu_entries = []  # this rank's CPU allreduces, checked for shared memory below
        dev_entries = []  # and its device ones, checked the same way on the GPU executor
        inplace = dev_inplace = False  # one of them writes into its input
        for item in items:
            request = item[0]
            if request.kind is not Kind.ALLREDUCE:
                if item[1] is not None and item[1].output is not None:
                    written = item[1].writeback if item[1].writeback is not None else item[1].output
                    if cpu_entries and request.device == "cpu":
                        _keep_inputs(cpu_entries, written)  # an in-place broadcast runs before them
                    elif dev_entries and request.device != "cpu":
                        self.gpu.keep_inputs(dev_entries, written)
                if request.device == "cpu" or request.kind in (Kind.BARRIER, Kind.JOIN):
                    self._run_one(*item)
                else:
                    self._device_one(*item)
                continue
            entry = item[1]
            if entry is not None and request.device == "cpu":
                cpu_entries.append(entry)
                inplace = inplace or entry.output is entry.input
            elif entry is not None and self._gpu_or_none() is not None:
                dev_entries.append(entry)
                dev_inplace = dev_inplace or entry.output is not None
            _, _, nbytes, key = _meta(request)
            groups = batches.get(key)
            if groups is None:
                groups = batches[key] = []
            _fuse(groups, item, nbytes, threshold)
        if inplace and len(cpu_entries) > 1:
            _unalias(cpu_entries)
        if dev_inplace and len(dev_entries) > 1:
            self.gpu.unalias(dev_entries)
        for key, groups in batches.items():
            if key[5] == "cpu" and key[1] != ReduceOp.ADASUM:
                cma = self._cross_memory(key[0], sum(g[0] for g in groups))
                if cma is not None:
                    # on their own memory, small fused tensors through the staging buffers, and
                    # half types widened in fusion buffers (which go through cross-memory too)
                    direct, staged, widened = [], [], []
                    for _, batch in groups:
                        for item in batch:
                            if item[0].dtype != key[4]:
                                widened.append(item)
                            elif len(batch) > 1 and _meta(item[0])[2] < cma.packed_below_bytes:
                                staged.append(item)
                            else:
                                direct.append(item)
                    if direct:
                        self._allreduce_many(cma, direct)
                    if staged:
                        self._allreduce_many(cma, staged, packed=True)
                    for batch in _batched(widened, threshold):
                        self._allreduce_batch(batch)
                    continue
            for _, batch in groups:
                if batch[0][0].device == "cpu":
                    self._allreduce_batch(batch)
                else:
                    self._device_batch(batch)
        if self.gpu is not None:
            self.gpu.flush()  # complete the cycle's device handles once hvddp's stream passed them

    def _device_one(self, request: Request, entry: Optional[Entry], info) -> None:
        try:
            gpu = self._gpu()
        except Exception as exc:
            if entry is not None:
                entry.fail(exc if isinstance(exc, HvddpError) else HvddpError(
                    f"{request.kind.value} {request.name!r}: the GPU path is unavailable: {exc}"))
            return
        gpu.run_one(request, entry, info)

    def _device_batch(self, batch: list) -> None:
        try:
            gpu = self._gpu()
        except Exception as exc:
            error = exc if isinstance(exc, HvddpError) else HvddpError(
                f"allreduce of {[item[0].name for item in batch]}: the GPU path is unavailable: {exc}")
            for _, entry, _ in batch:
                if entry is not None:
                    entry.fail(error)
            return
        gpu.allreduce_batch(batch)

    def _run_one(self, request: Request, entry: Optional[Entry], info) -> None:
        tl = self.timeline
        if tl:
            tl.activity(request.key(), f"MPI_{request.kind.value.upper()}")
        try:
            result = self._dispatch(request, entry, info)
        except Exception as exc:  # reported on the caller's thread; the engine goes on
            _fatal_if_local(exc)
            if entry is not None:
                entry.fail(exc if isinstance(exc, HvddpError) else
                           HvddpError(f"{request.kind.value} {request.name!r} failed: {exc}"))
            return
        finally:
            if tl:
                tl.end((request.key(),))
        if entry is not None:
            entry.complete(result)

    def _dispatch(self, request: Request, entry: Optional[Entry], info):
        ps = self.process_sets[request.ps_id]
        comm = ps.comm
        kind = request.kind
        if kind is Kind.BARRIER:
            return None
        if kind is Kind.JOIN:
            return info
        dtype = _dtype(request.dtype)
        row_shape = tuple(request.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        if kind is Kind.BROADCAST:
            if entry.output is not None:  # in place
                out = entry.output
                self.mpi.bcast_bytes(comm, out, request.root)
                return out
            if ps.rank == request.root:
                out = entry.input.copy()
            else:
                out = np.empty(request.shape, dtype=dtype)
            self.mpi.bcast_bytes(comm, out, request.root)
            return out.reshape(request.shape)
        if kind is Kind.ALLGATHER:
            dims = info
            out = np.empty((sum(dims),) + row_shape, dtype=dtype)
            self.mpi.allgatherv_bytes(comm, entry.input, out, [d * row_bytes for d in dims])
            return out
        if kind is Kind.ALLTOALL:
            matrix = info
            me = ps.rank
            send = [c * row_bytes for c in matrix[me]]
            recv_splits = [row[me] for row in matrix]
            out = np.empty((sum(recv_splits),) + row_shape, dtype=dtype)
            self.mpi.alltoallv_bytes(comm, entry.input, send, out, [c * row_bytes for c in recv_splits])
            return out, np.asarray(recv_splits, dtype=np.int32)
        if kind is Kind.REDUCESCATTER:
            return self._reducescatter(request, entry, ps, dtype, row_shape)
        raise HvddpError(f"internal error: no executor for {kind!r}")

    def _reducescatter(self, request, entry, ps, dtype, row_shape):
        rows = request.shape[0] if request.shape else 0
        base, extra = divmod(rows, ps.size)
        row_counts = [base + (1 if r < extra else 0) for r in range(ps.size)]
        row_elems = int(np.prod(row_shape, dtype=np.int64))
        counts = [c * row_elems for c in row_counts]
        wire = _dtype(wire_dtype(request.dtype))
        src = entry.input.reshape(-1)
        if wire != dtype or request.prescale != 1.0:
            tmp = np.empty(src.size, dtype=wire)
            _scaled_copy(tmp, src, request.prescale)
            src = tmp
        recv = np.empty(counts[ps.rank], dtype=wire)
        self.mpi.reduce_scatter(ps.comm, src, recv, counts, request.op)
        out = np.empty((row_counts[ps.rank],) + row_shape, dtype=dtype)
        _scaled_copy(out.reshape(-1), recv, _post_factor(request, ps.size))
        return out

    # ------------------------------------------------------------------------------------
    def _allreduce_batch(self, batch: list) -> None:
        request0 = batch[0][0]
        adasum = request0.op == ReduceOp.ADASUM  # always packed: the combine rewrites its buffer
        ps = self.process_sets[request0.ps_id]
        chunk = self.config.mpi_chunk_bytes
        pre = request0.prescale
        post = _post_factor(request0, ps.size)
        wire = wire_dtype(request0.dtype)
        tl = self.timeline
        sent = False  # whether this rank has reached the batch's collective call
        try:
            if len(batch) == 1 and wire == request0.dtype and not adasum:
                request, entry, _ = batch[0]
                src, dst = _buffers(request, entry, self.pool)
                if tl:
                    tl.activity(request.key(), "MPI_ALLREDUCE")
                if pre != 1.0 and entry is not None:  # (a joined rank's identity stays unscaled)
                    _scaled_copy(dst, src, pre)
                    src = dst
                sent = True
                if src is dst:
                    self.mpi.allreduce_inplace(ps.comm, dst, request.op, chunk)
                else:
                    self.mpi.allreduce(ps.comm, src, dst, request.op, chunk)
                if post != 1.0:
                    _scaled_copy(dst, dst, post)
            else:
                sizes = [_meta(item[0])[0] for item in batch]
                buf = self._fusion_buffer(wire, sum(sizes))
                if tl:
                    tl.activities([item[0].key() for item in batch], "MEMCPY_IN_FUSION_BUFFER")
                offset = 0
                views = []
                for (request, entry, _), n in zip(batch, sizes):
                    view = buf[offset:offset + n]
                    offset += n
                    views.append(view)
                    if entry is None:
                        view.fill(joined_value(request.op, view.dtype))
                    else:
                        _scaled_copy(view, entry.input.reshape(-1), pre)
                cma = None if adasum else self._cross_memory(request0.ps_id, buf.nbytes)
                if tl:
                    tl.activities([item[0].key() for item in batch], "MPI_ADASUM_ALLREDUCE" if adasum
                                  else "CMA_ALLREDUCE" if cma is not None else "MPI_ALLREDUCE")
                sent = True
                if adasum:
                    from ..backends import adasum as adasum_backend

                    adasum_backend.combine(ps.comm, buf, sizes, chunk)
                elif cma is not None:
                    cma.allreduce(buf, buf, request0.op)
                else:
                    self.mpi.allreduce_inplace(ps.comm, buf, request0.op, chunk)
                if tl:
                    tl.activities([item[0].key() for item in batch], "MEMCPY_OUT_FUSION_BUFFER")
                for (request, entry, _), view in zip(batch, views):
                    if entry is None:
                        continue
                    if entry.output is None:
                        entry.output = self.pool.empty(request.shape, _dtype(request.dtype))
                    _scaled_copy(entry.output.reshape(-1), view, post)
        except Exception as exc:
            if tl:  # (its spans end with it)
                tl.end([item[0].key() for item in batch])
            _fatal_if_local(exc, before_the_call=not sent)
            _fail(batch, exc)
            return
        if tl:
            tl.end([item[0].key() for item in batch])
        _complete(batch)

    def _allreduce_many(self, cma, group: list, packed: bool = False) -> None:
        """Reduce tensors of one fusion key through cross-memory attach.

        With ``packed`` False tensors are reduced on their own memory: the peers read each
        array's slices where they are. Small fused ones go through the path's staging buffers.
        Either way Average's 1/size (and any postscale) is applied by each slice's owner while the
        slice is in cache.
        """
        request0 = group[0][0]
        ps = self.process_sets[request0.ps_id]
        pre = request0.prescale
        post = _post_factor(request0, ps.size)
        names = [item[0].key() for item in group] if self.timeline else None
        sent = False  # whether this rank has reached the group's collective call
        try:
            srcs, dsts = [], []
            for request, entry, _ in group:
                src, dst = _buffers(request, entry, self.pool)
                if pre != 1.0 and entry is not None:  # into a private array: an output may be
                    # shared (see _unalias); a joined rank's identity stays unscaled
                    scaled = src if src is dst else np.empty_like(src)
                    _scaled_copy(scaled, src, pre)
                    src = scaled
                srcs.append(src)
                dsts.append(dst)
            if names:
                self.timeline.activities(names, "CMA_ALLREDUCE")
            sent = True
            (cma.allreduce_packed if packed else cma.allreduce_many)(srcs, dsts, request0.op, post)
        except Exception as exc:
            if names:  # (its spans end with it)
                self.timeline.end(names)
            _fatal_if_local(exc, before_the_call=not sent)
            _fail(group, exc)
            return
        if names:
            self.timeline.end(names)
        _complete(group)


_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
             "bfloat16": 2, "float32": 4, "float64": 8}


@functools.lru_cache(maxsize=16384)
def _meta(request: Request) -> tuple:
    """(elements, wire dtype, wire bytes, fusion key) of an allreduce request; memoized."""
    numel = math.prod(request.shape)
    wire = wire_dtype(request.dtype)
    key = (request.ps_id, request.op, request.prescale, request.postscale, wire, request.device)
    return numel, wire, numel * _ITEMSIZE[wire], key


def _fuse(groups: list, item, nbytes: int, threshold: int) -> None:
    """Add ``item`` (``nbytes`` on the wire) to the last ``[bytes, items]`` fusion batch of
    ``groups`` if it fits in ``threshold``, else start one (a tensor that large starts its own)."""
    if nbytes < threshold and groups and groups[-1][0] + nbytes <= threshold:
        groups[-1][0] += nbytes
        groups[-1][1].append(item)
    else:
        groups.append([nbytes, [item]])


def _batched(items: list, threshold: int) -> list:
    """``items`` in fusion batches, as ``run`` forms them."""
    groups: list = []
    for item in items:
        _fuse(groups, item, _meta(item[0])[2], threshold)
    return [batch for _, batch in groups]


def _keep_inputs(entries: list, written: np.ndarray) -> None:
    """Give a private copy to the input of every allreduce agreed before an in-place collective
    that writes ``written``: that one runs now and the allreduces after it, in their batches, so
    they would reduce what it wrote instead of the values submitted."""
    for entry in entries:
        if np.may_share_memory(entry.input, written):
            entry.input = entry.input.copy()  # the output stays where the caller wants it


def _unalias(entries: list) -> None:
    """Give a private copy to every input that another entry's in-place result would overwrite.

    Batches run one after another and the single-copy path writes slices in no fixed order, so
    an input sharing memory with another in-place allreduce of the same cycle (one array
    reduced in place twice, overlapping views, the same array in and out of place, or a strided
    in-place view whose result is copied back into the array another entry reads) could be read
    after it changed. With the copy every result reduces the values as submitted. Local only:
    what each rank reads changes, not which calls it makes.
    """
    k = len(entries)
    inputs = [e.input for e in entries]
    start = np.fromiter(map(address, inputs), dtype=np.int64, count=k)
    strided = [i for i, e in enumerate(entries) if e.writeback is not None]
    if not strided and not shares_memory(start, inputs):
        return  # the usual case
    end = start + np.fromiter((a.nbytes for a in inputs), dtype=np.int64, count=k)
    written = np.fromiter((e.output is e.input for e in entries), dtype=bool, count=k)
    written &= end > start
    # where each entry's result lands: its input when in place, else the view written back
    w_start, w_end = start.copy(), end.copy()
    for i in strided:
        w_start[i], w_end[i] = _byte_bounds(entries[i].writeback)
    for i, entry in enumerate(entries):
        if end[i] == start[i]:
            continue
        hit = written & (w_start < end[i]) & (w_end > start[i])
        hit[i] = False
        if hit.any():
            entry.input = entry.input.copy()  # the output stays where the caller wants it


_addressof, _char = ctypes.addressof, ctypes.c_char


def address(a: np.ndarray) -> int:
    """The address of a contiguous array's first byte: ``a.ctypes.data``, three times faster."""
    try:
        return _addressof(_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):  # read-only or empty
        return a.ctypes.data


def shares_memory(starts: np.ndarray, arrays: list) -> bool:
    """Whether any two of ``arrays`` (beginning at addresses ``starts``) overlap; one sort."""
    ends = starts + np.fromiter((a.nbytes for a in arrays), dtype=np.int64, count=len(arrays))
    keep = ends > starts
    order = np.argsort(starts[keep], kind="stable")
    starts, ends = starts[keep][order], ends[keep][order]
    return starts.size > 1 and bool((np.maximum.accumulate(ends)[:-1] > starts[1:]).any())


def _fatal_if_local(exc: Exception, before_the_call: bool = False) -> None:
    """Re-raise what only this rank can have hit, so that the engine stops (and the job ends).

    A failure every rank meets alike (an agreed error) fails the handles and the engine goes on.
    One rank that cannot allocate an output or a copy, or meets any error before it reaches the
    collective call (``before_the_call``: packing a fusion batch, say), fails before its peers'
    call returns: they would wait in it forever. Re-raised, it stops this rank's engine, fails
    its handles with the cause, and marks the world broken, so that the job ends rather than hangs.
    """
    if before_the_call or isinstance(exc, MemoryError):
        raise exc


def _fail(batch: list, exc: Exception) -> None:
    """Fail every local entry of a batch of allreduces with one error naming them all."""
    error = HvddpError(f"allreduce of {[item[0].name for item in batch]} failed: {exc}")
    for _, entry, _ in batch:
        if entry is not None:
            entry.fail(error)


def _complete(batch: list) -> None:
    for _, entry, _ in batch:
        if entry is not None:
            entry.complete(entry.output)


def _post_factor(request: Request, size: int) -> float:
    factor = request.postscale
    if request.op == ReduceOp.AVERAGE:
        factor = factor / size
    return factor


def joined_value(op: int, dtype: np.dtype):
    """What a rank that has joined contributes to an allreduce: the op's identity, so that the
    result is the other ranks' reduction (zeros for Sum, Average and Adasum; the dtype's largest
    value for Min, its smallest for Max, one for Product). Average still divides by the whole
    set's size, as in Horovod; Horovod's joined ranks contribute zeros to every op, which makes
    a Min over positive values 0."""
    if op not in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return op == ReduceOp.MIN
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if op == ReduceOp.MIN else info.min
    return np.inf if op == ReduceOp.MIN else -np.inf  # float16/32/64, bfloat16


def _buffers(request: Request, entry: Optional[Entry], pool: OutputPool):
    """Source and destination of a direct (unfused) reduction."""
    if entry is None:  # a joined rank contributes the op's identity
        dtype = _dtype(request.dtype)
        own = np.full(int(np.prod(request.shape, dtype=np.int64)), joined_value(request.op, dtype), dtype=dtype)
        return own, own
    src = entry.input.reshape(-1)
    if entry.output is entry.input:  # in place: one buffer, reduced with MPI_IN_PLACE
        return src, src
    if entry.output is None:
        entry.output = pool.empty(request.shape, src.dtype)
    return src, entry.output.reshape(-1)


def _divisor(factor: float) -> int:
    """k when ``factor`` is exactly 1/k for an integer k >= 2 (an Average's scale), else 0."""
    if not 0.0 < factor <= 0.5:
        return 0
    k = round(1.0 / factor)
    return k if 1.0 / k == factor else 0


def _truncating_divide(dst: np.ndarray, src: np.ndarray, k: int) -> None:
    """``dst = src / k`` for integers, truncated toward zero, exact at any magnitude.

    ``src - fmod(src, k)`` is a multiple of k (fmod keeps the dividend's sign), so the floor
    division after it is exact and rounds toward zero; float64 would lose integers above 2**53.
    """
    if k > np.iinfo(src.dtype).max:  # |src| < k: every quotient is 0 (and k fits no such array)
        dst[...] = 0
        return
    k = src.dtype.type(k)
    np.floor_divide(src - np.fmod(src, k), k, out=dst, casting="unsafe")


def _scaled_copy(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``dst = src * factor`` in one pass (a plain copy when factor is 1), casting to dst.

    Float math runs in the wider of the two dtypes (float32 for half types); integer results
    are truncated toward zero: exactly when the factor is 1/k (an Average), else through float64.
    """
    if factor == 1.0:
        if dst is not src:
            np.copyto(dst, src, casting="unsafe")
    elif dst.dtype.kind in "iu" and src.dtype.kind in "iu" and (k := _divisor(factor)):
        _truncating_divide(dst, src, k)
    elif dst.dtype.kind in "iub" or src.dtype.kind in "iub":
        scaled = src * factor
        np.copyto(dst, scaled if dst.dtype.kind == "f" else np.trunc(scaled), casting="unsafe")
    else:
        wide = np.float64 if np.float64 in (dst.dtype.type, src.dtype.type) else np.float32
        np.multiply(src, wide(factor), out=dst, casting="unsafe")
