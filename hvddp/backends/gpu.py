"""Execution of agreed responses on CUDA buffers: NCCL, or staging through host memory and MPI.

The engine hands device items here (entries whose ``.input`` is a CuPy array; requests with
``device == "cuda"``). Per batch, the GPU executor

1. makes hvddp's stream (one per device, non-blocking) wait on the event each input's producer
   recorded at submission (``entry.ready``; without one, an event recorded now on the legacy
   default stream, which covers producers on torch's default stream);
2. packs the batch into a device fusion buffer in one kernel launch per source dtype (prescale
   and widening folded in), reduces it with one NCCL call (``ncclAvg`` for Average where NCCL
   has it) or, on the staging path, copies it to pinned host memory and reduces it with MPI;
3. unpacks it in one launch per output dtype (postscale, 1/size when NCCL did not average and
   narrowing folded in), records an event on hvddp's stream, and keeps every buffer alive;
4. completes the handles once that event has passed: ``poll()`` without blocking, ``flush()``
   by waiting (events are created with blocking sync, so a waiting engine does not spin).

Results are CuPy arrays on the input's device (bfloat16 as uint16 bit arrays; the adapter views
them back). Outputs are allocated on the legacy default stream and hvddp's stream waits for it,
so memory a user freed with work still queued there is not overwritten early.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import bfloat16
from ..engine.executor import _fatal_if_local, joined_value
from ..engine.messages import Kind, ReduceOp, Request
from ..exceptions import HvddpError
from . import gpu_pack
from .gpu_pack import ITEMSIZE, make_plan, mpi_wire_dtype, nccl_wire_dtype, split_by, storage_dtype

__all__ = ["GpuExecutor", "Completions", "choose_path", "post_factor"]

log = logging.getLogger("hvddp")
_warned: set = set()


def choose_path(requested: str, nccl_available: bool) -> Tuple[str, Optional[str]]:
    """``("NCCL" | "MPI", warning or None)`` for ``HVDDP_GPU_OPERATIONS`` and what is installed."""
    if requested == "NCCL" and nccl_available:
        return "NCCL", None
    if requested == "NCCL":
        why = ("NCCL is not available (CuPy's cupy.cuda.nccl did not load)", "install the NCCL wheel "
               "CuPy asks for (nvidia-nccl-cu12 or -cu13) for the device path")
    else:
        why = ("HVDDP_GPU_OPERATIONS=MPI", "unset it to reduce on the device with NCCL")
    return "MPI", (f"GPU collectives are staged through pinned host memory and reduced by MPI ({why[0]}); "
                   f"this costs a device-to-host and a host-to-device copy per batch; {why[1]}.")


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def post_factor(request: Request, size: int, averaged: bool) -> float:
    """The factor folded into the copy out: postscale, and 1/size unless the reduction averaged."""
    factor = request.postscale
    if request.op == ReduceOp.AVERAGE and not averaged:
        factor = factor / size
    return factor


def wire_for(dtype: str, path: str, bf16: bool) -> str:
    return nccl_wire_dtype(dtype, bf16) if path == "NCCL" else mpi_wire_dtype(dtype)


class Completions:
    """Entries waiting for an event on hvddp's stream, completed in order once it has passed.

    Works with any event object that has ``done`` (property or method) and ``synchronize()``.
    With a ``timeline``, each item's tensors end their timeline spans when it completes or fails:
    the device work runs after the engine has enqueued it.
    """

    def __init__(self, timeline=None) -> None:
        self._items: Deque[Tuple[Any, List[Tuple[Any, Any]], Any, Sequence[tuple]]] = deque()
        self.timeline = timeline

    def __len__(self) -> int:
        return len(self._items)

    def add(self, event: Any, results: List[Tuple[Any, Any]], keep: Any = None,
            keys: Sequence[tuple] = ()) -> None:
        """Complete each ``(entry, value)`` of ``results`` after ``event``; hold ``keep`` until then;
        then end the timeline spans of ``keys`` (every request of the batch, a joined rank's too)."""
        self._items.append((event, results, keep, keys))

    @staticmethod
    def _done(event: Any) -> bool:
        done = event.done
        return done() if callable(done) else bool(done)

    def poll(self) -> int:
        """Complete every leading item whose event has passed; never blocks. Return how many."""
        n = 0
        while self._items and self._done(self._items[0][0]):
            self._finish(self._items.popleft())
            n += 1
        return n

    def flush(self) -> int:
        """Wait for every event in turn and complete its entries. Return how many items."""
        n = 0
        while self._items:
            item = self._items.popleft()
            try:
                item[0].synchronize()
            except Exception as exc:  # a failed kernel or NCCL call shows up here
                self._end_spans(item)
                _fail_all(item[1], HvddpError(f"GPU collective failed: {exc}"))
                continue
            self._finish(item)
            n += 1
        return n

    def fail_all(self, error: BaseException) -> None:
        while self._items:
            item = self._items.popleft()
            self._end_spans(item)
            _fail_all(item[1], error)

    def _finish(self, item) -> None:
        self._end_spans(item)
        for entry, value in item[1]:
            _complete(entry, value)

    def _end_spans(self, item) -> None:
        if item[3] and self.timeline:
            self.timeline.end(item[3])


def _complete(entry, value) -> None:
    """Complete ``entry``; a non-contiguous in-place target was already written on the device."""
    writeback = getattr(entry, "writeback", None)
    if writeback is not None:
        entry.writeback = None
        value = writeback
    entry.complete(value)


def _fail_all(results, error: BaseException) -> None:
    for entry, _ in results:
        if entry is not None:
            entry.fail(error)


class GpuExecutor:
    """Runs device items of one cycle; same shape as the CPU ``Executor``.

    Args:
        config: the ``Config`` (``gpu_operations``, ``mpi_chunk_bytes``).
        process_sets: ps_id -> the engine's process-set view (``.comm``, ``.rank``, ``.size``).
        cpu_executor: the CPU executor, whose ``_dispatch`` the staging path reuses for
            broadcast, allgather, alltoall and reducescatter.
    """

    def __init__(self, config, process_sets, cpu_executor=None, timeline=None) -> None:
        from .device import import_cupy, nccl_built

        self.cupy = import_cupy()
        self.config = config
        self.process_sets = process_sets
        self.cpu = cpu_executor
        self.timeline = timeline
        self.path, warning = choose_path(config.gpu_operations, nccl_built())
        world = process_sets.get(0)
        if warning and getattr(world, "rank", 0) == 0:  # the same on every rank: rank 0 says it
            warn_once("staging", warning)
        self.nccl = None
        self.bf16 = False
        if self.path == "NCCL":
            from .nccl import NcclBackend

            self.nccl = NcclBackend()
            self.bf16 = self.nccl.has_bf16()
        from . import mpi

        self.mpi = mpi
        self.pending = Completions(timeline)
        self._streams: Dict[int, Any] = {}
        self._fusion: Dict[Tuple[int, str], Any] = {}
        self._pinned: Dict[Tuple[int, str], np.ndarray] = {}
        self._last_device: Dict[int, int] = {}  # process set id -> the device its last entry was on

    # Resources ---------------------------------------------------------------------------
    def stream(self, device_id: int):
        """hvddp's own (non-blocking) stream on ``device_id``."""
        s = self._streams.get(device_id)
        if s is None:
            with self.cupy.cuda.Device(device_id):
                s = self._streams[device_id] = self.cupy.cuda.Stream(non_blocking=True)
        return s

    def _fusion_buffer(self, device_id: int, wire: str, count: int, stream):
        key = (device_id, wire)
        buf = self._fusion.get(key)
        if buf is None or buf.size < count:
            with stream:
                buf = self._fusion[key] = self.cupy.empty(max(count, 1), dtype=storage_dtype(wire))
        return buf

    def _host_buffer(self, wire: str, count: int, device_id: int = 0) -> np.ndarray:
        """``count`` elements of this device's pinned staging buffer for ``wire``.

        Reused by every staged collective on the device: each first queues its device-to-host
        copy on the device's stream and waits for it, so the previous one's host-to-device copy
        has been read. It grows at least twofold: CuPy's pinned pool keeps every freed block, by
        exact size, for ever, so growing to each new size (or allocating per call) made the
        pinned host memory grow with every distinct size staged.
        """
        key = (device_id, storage_dtype(wire))
        buf = self._pinned.get(key)
        if buf is None or buf.size < count:
            import cupyx

            size = max(count, 1) if buf is None else max(count, 2 * buf.size)
            buf = self._pinned[key] = cupyx.empty_pinned(size, dtype=key[1])
        return buf[:count]

    def _empty(self, shape, dtype: str):
        """An output on the legacy default stream's pool (see the module docstring)."""
        with self.cupy.cuda.Stream.null:
            return self.cupy.empty(shape, dtype=storage_dtype(dtype))

    def _after_default_stream(self, stream) -> None:
        """Make ``stream`` wait for the work queued so far on the legacy default stream."""
        null_event = self.cupy.cuda.Event(block=True, disable_timing=True)
        null_event.record(self.cupy.cuda.Stream.null)
        stream.wait_event(null_event)

    def _order_after_producers(self, entries, stream) -> None:
        """Make ``stream`` wait for each input's producer event and for the default stream."""
        self._after_default_stream(stream)
        seen = set()
        for entry in entries:
            event = getattr(entry, "ready", None) if entry is not None else None
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                stream.wait_event(event)

    def keep_inputs(self, entries, written) -> None:
        """Give a private copy to the input of every device allreduce agreed before an in-place
        collective that writes ``written``: that one runs now and the allreduces after it, so
        they would reduce what it wrote (the device twin of ``executor._keep_inputs``)."""
        lo, hi = _bounds(written)
        for entry in entries:
            start, end = _bounds(entry.input)
            if start < hi and lo < end:
                self._private_input(entry)

    def unalias(self, entries) -> None:
        """Give a private copy to every device allreduce input that another entry's in-place
        result overwrites: batches run one after another, so it would be read after it changed
        (one array reduced in place and also out of place, or two overlapping views; the device
        twin of ``executor._unalias``). Local only: what this rank reads changes, not its calls."""
        writes = [(i, _bounds(e.writeback if e.writeback is not None else e.output))
                  for i, e in enumerate(entries) if e.output is not None]
        for i, entry in enumerate(entries):
            start, end = _bounds(entry.input)
            if any(j != i and lo < end and start < hi for j, (lo, hi) in writes):
                self._private_input(entry)

    def _private_input(self, entry) -> None:
        """Copy ``entry.input`` on hvddp's stream, after its producer: the batches that read it
        later run on the same stream."""
        device_id = entry.input.device.id
        with self.cupy.cuda.Device(device_id):
            stream = self.stream(device_id)
            if entry.ready is not None:
                stream.wait_event(entry.ready)
            with stream:
                entry.input = entry.input.copy()  # the output stays where the caller wants it

    def _device_of(self, entry, ps_id: int) -> int:
        """The device of ``entry``'s input; for a rank that has joined (no entry), the device its
        last entry on that process set was on: the engine thread's current device is device 0,
        whatever the rank trains on, so its NCCL calls would wait on a communicator its peers
        never make."""
        if entry is not None and entry.input is not None:
            device = self._last_device[ps_id] = entry.input.device.id
            return device
        device = self._last_device.get(ps_id)
        return self.cupy.cuda.Device().id if device is None else device

    def _record(self, stream, results, keep, requests) -> None:
        """Complete ``results`` once ``stream`` has passed this point; the timeline spans of
        ``requests`` end then too."""
        event = self.cupy.cuda.Event(block=True, disable_timing=True)
        event.record(stream)
        self.pending.add(event, results, keep, [r.key() for r in requests] if self.timeline else ())

    # Completion --------------------------------------------------------------------------
    def poll(self) -> int:
        return self.pending.poll()

    def flush(self) -> int:
        return self.pending.flush()

    def forget_process_set(self, ps_id: int) -> None:
        """Destroy the NCCL communicators of a removed process set (call on every member)."""
        if self.nccl is not None:
            self.nccl.forget(ps_id)

    def close(self) -> None:
        from ..exceptions import ShutdownError

        try:
            self.flush()
        finally:
            self.pending.fail_all(ShutdownError("hvddp shut down while a GPU collective was pending."))
            if self.nccl is not None:
                self.nccl.close()

    # Allreduce ---------------------------------------------------------------------------
    def allreduce_batch(self, batch: Sequence[Tuple[Request, Any, Any]]) -> None:
        """Reduce a fused batch of device allreduces (same process set, op and scale factors)."""
        devices = [self._device_of(item[1], item[0].ps_id) for item in batch]
        wires = [wire_for(item[0].dtype, self.path, self.bf16) for item in batch]
        for group in split_by(list(zip(devices, wires))):
            items = [batch[i] for i in group]
            try:
                self._allreduce_group(items, devices[group[0]], wires[group[0]])
            except Exception as exc:
                _fatal_if_local(exc)  # (out of device memory on one rank: its peers would wait)
                error = exc if isinstance(exc, HvddpError) else HvddpError(
                    f"allreduce of {[item[0].name for item in items]} on the GPU failed: {exc}")
                if self.timeline:
                    self.timeline.end([item[0].key() for item in items])
                _fail_all([(item[1], None) for item in items], error)

    def _allreduce_group(self, items, device_id: int, wire: str) -> None:
        cupy = self.cupy
        request0 = items[0][0]
        ps = self.process_sets[request0.ps_id]
        with cupy.cuda.Device(device_id):
            stream = self.stream(device_id)
            comm = (self.nccl.comm(request0.ps_id, ps, device_id)
                    if self.path == "NCCL" and request0.op != ReduceOp.ADASUM else None)
            outputs = []
            for request, entry, _ in items:
                if entry is None:
                    outputs.append(None)
                elif entry.output is not None:
                    outputs.append(entry.output)
                else:
                    outputs.append(self._empty(request.shape, request.dtype))
            self._order_after_producers([item[1] for item in items], stream)
            if self.timeline:  # enqueue time: the device work itself runs later on the stream
                self.timeline.activities([it[0].key() for it in items],
                                         "NCCL_ALLREDUCE" if comm is not None else "MPI_ALLREDUCE_STAGED")
            pre = request0.prescale
            keep: List[Any] = [items, outputs]
            isz = ITEMSIZE[wire]
            request, entry, _ = items[0]
            adasum = request0.op == ReduceOp.ADASUM  # staged through the host: NCCL has no Adasum
            if (len(items) == 1 and entry is not None and wire == request.dtype
                    and self.path == "NCCL" and not adasum):
                # one tensor: reduced from its own memory into the output, no fusion copies
                count = outputs[0].size
                plan = make_plan([count], wire)
                src, dst = entry.input.data.ptr, outputs[0].data.ptr
                if pre != 1.0:
                    keep.append(gpu_pack.launch_copy(plan, wire, wire, [src], [dst], pre, stream))
                    src = dst
                averaged = False
                if count:
                    averaged = self.nccl.allreduce(comm, src, dst, count, wire, request.op, stream)
                post = post_factor(request, ps.size, averaged)
                if post != 1.0:
                    keep.append(gpu_pack.launch_copy(plan, wire, wire, [dst], [dst], post, stream))
            else:
                counts = [int(np.prod(it[0].shape, dtype=np.int64)) for it in items]
                plan = make_plan(counts, wire)
                buf = self._fusion_buffer(device_id, wire, plan.total, stream)
                keep.append(buf)
                base = buf.data.ptr
                fused = [base + off * isz for off in plan.offsets]
                dtypes = [it[0].dtype for it in items]
                for sub in split_by(dtypes):  # one pack launch per source dtype
                    sub_plan = make_plan([counts[i] for i in sub], wire)
                    src = [0 if items[i][1] is None else items[i][1].input.data.ptr for i in sub]
                    keep.append(gpu_pack.launch_copy(sub_plan, dtypes[sub[0]], wire, src,
                                                     [fused[i] for i in sub], pre, stream))
                if request0.op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
                    identity = joined_value(request0.op, buf.dtype)
                    if wire == "bfloat16":  # the buffer holds bfloat16 bits: the float identity's
                        identity = int(np.asarray(joined_value(request0.op, bfloat16()), bfloat16()).view(np.uint16))
                    with stream:  # a joined rank's slices (packed as zeros) hold the op's identity
                        for i, it in enumerate(items):
                            if it[1] is None and counts[i]:
                                buf[plan.offsets[i]:plan.offsets[i] + counts[i]].fill(identity)
                averaged = False
                if plan.total:
                    if adasum:
                        self._staged_adasum(ps, buf[:plan.total], wire, plan, stream)
                    elif comm is not None:
                        averaged = self.nccl.allreduce(comm, base, base, plan.total, wire,
                                                       request0.op, stream)
                    else:
                        self._staged_allreduce(ps, buf[:plan.total], wire, request0.op, stream)
                post = post_factor(request0, ps.size, averaged)
                live = [i for i, it in enumerate(items) if it[1] is not None]
                for sub in split_by([dtypes[i] for i in live]):
                    idx = [live[j] for j in sub]
                    sub_plan = make_plan([counts[i] for i in idx], wire)
                    keep.append(gpu_pack.launch_copy(sub_plan, wire, dtypes[idx[0]],
                                                     [fused[i] for i in idx],
                                                     [outputs[i].data.ptr for i in idx], post, stream))
            results = []
            for (request, entry, _), out in zip(items, outputs):
                if entry is None:
                    continue
                if entry.writeback is not None:
                    with stream:
                        entry.writeback[...] = out.reshape(entry.writeback.shape)
                results.append((entry, out))
            self._record(stream, results, keep, [item[0] for item in items])

    def _staged_allreduce(self, ps, buf, wire: str, op: int, stream) -> None:
        """Device buffer -> pinned host -> MPI allreduce in place -> device, on ``stream``."""
        host = self._host_buffer(wire, buf.size, buf.device.id)
        buf.get(stream=stream, out=host)  # async into pinned memory
        stream.synchronize()
        self.mpi.allreduce_inplace(ps.comm, host, op, self.config.mpi_chunk_bytes)
        buf.set(host, stream=stream)

    def _staged_adasum(self, ps, buf, wire: str, plan, stream) -> None:
        """Device buffer -> pinned host -> Adasum over MPI (``backends.adasum``) -> device.

        The fused buffer starts every tensor on an aligned offset: the gaps go to the Adasum as
        tensors of their own, zeroed first (zeros stay zeros), so each tensor keeps its own sums.
        """
        from . import adasum

        host = self._host_buffer(wire, buf.size, buf.device.id)
        buf.get(stream=stream, out=host)
        stream.synchronize()
        values = host.view(bfloat16()) if wire == "bfloat16" else host  # (stored as uint16 bits)
        layout = []
        ends = list(plan.offsets[1:]) + [plan.total]
        for start, n, end in zip(plan.offsets, plan.counts, ends):
            values[start + n:end] = 0
            layout += [n, end - start - n]
        adasum.combine(ps.comm, values, layout, self.config.mpi_chunk_bytes)
        buf.set(host, stream=stream)

    # Other collectives -------------------------------------------------------------------
    def run_one(self, request: Request, entry, info) -> None:
        """Run one device broadcast/allgather/alltoall/reducescatter; errors go to the entry."""
        if self.timeline:  # enqueue time, as for allreduces; the span ends when the stream passes
            kind = request.kind.value.upper()
            self.timeline.activity(request.key(), f"NCCL_{kind}" if self.path == "NCCL" else f"MPI_{kind}_STAGED")
        try:
            device_id = self._device_of(entry, request.ps_id)
            with self.cupy.cuda.Device(device_id):
                if self.path == "NCCL":
                    self._nccl_one(request, entry, info, device_id)
                else:
                    self._staged_one(request, entry, info, device_id)
        except Exception as exc:
            _fatal_if_local(exc)
            if self.timeline:
                self.timeline.end((request.key(),))
            if entry is not None:
                entry.fail(exc if isinstance(exc, HvddpError) else
                           HvddpError(f"{request.kind.value} {request.name!r} on the GPU failed: {exc}"))

    def _nccl_one(self, request: Request, entry, info, device_id: int) -> None:
        ps = self.process_sets[request.ps_id]
        stream = self.stream(device_id)
        comm = self.nccl.comm(request.ps_id, ps, device_id)
        kind = request.kind
        dtype = request.dtype
        row_shape = tuple(request.shape[1:])
        row_elems = int(np.prod(row_shape, dtype=np.int64))
        row_bytes = row_elems * ITEMSIZE[dtype]
        src = entry.input
        keep: List[Any] = [entry, src]
        if kind is Kind.BROADCAST:
            out = entry.output if entry.output is not None else self._empty(request.shape, dtype)
            self._order_after_producers([entry], stream)
            if out.nbytes:
                self.nccl.broadcast(comm, src.data.ptr, out.data.ptr, out.nbytes, request.root, stream)
            value = out
        elif kind is Kind.ALLGATHER:
            dims = info
            out = self._empty((sum(dims),) + row_shape, dtype)
            self._order_after_producers([entry], stream)
            if out.nbytes:
                self.nccl.allgatherv(comm, src.data.ptr, out.data.ptr, [d * row_bytes for d in dims], stream)
            value = out
        elif kind is Kind.ALLTOALL:
            matrix = info
            me = ps.rank
            recv_splits = [row[me] for row in matrix]
            out = self._empty((sum(recv_splits),) + row_shape, dtype)
            self._order_after_producers([entry], stream)
            self.nccl.alltoallv(comm, me, src.data.ptr, [c * row_bytes for c in matrix[me]],
                                out.data.ptr, [c * row_bytes for c in recv_splits], stream)
            value = (out, np.asarray(recv_splits, dtype=np.int32))
        elif kind is Kind.REDUCESCATTER:
            rows = request.shape[0] if request.shape else 0
            base, extra = divmod(rows, ps.size)
            row_counts = [base + (1 if r < extra else 0) for r in range(ps.size)]
            counts = [c * row_elems for c in row_counts]
            wire = wire_for(dtype, "NCCL", self.bf16)
            out = self._empty((row_counts[ps.rank],) + row_shape, dtype)
            self._order_after_producers([entry], stream)
            send = src.data.ptr
            total = sum(counts)
            if wire != dtype or request.prescale != 1.0:
                with stream:
                    tmp = self.cupy.empty(max(total, 1), dtype=storage_dtype(wire))
                keep.append(tmp)
                keep.append(gpu_pack.launch_copy(make_plan([total], wire), dtype, wire, [send],
                                                 [tmp.data.ptr], request.prescale, stream))
                send = tmp.data.ptr
            with stream:
                recv = self.cupy.empty(max(counts[ps.rank], 1), dtype=storage_dtype(wire))
            keep.append(recv)
            averaged = False
            if total:
                averaged = self.nccl.reducescatterv(comm, send, recv.data.ptr, counts, wire, request.op,
                                                    ps.rank, ITEMSIZE[wire], stream)
            keep.append(gpu_pack.launch_copy(make_plan([counts[ps.rank]], wire), wire, dtype,
                                             [recv.data.ptr], [out.data.ptr],
                                             post_factor(request, ps.size, averaged), stream))
            value = out
        else:
            raise HvddpError(f"internal error: no GPU executor for {kind!r}")
        if entry.writeback is not None:
            with stream:
                entry.writeback[...] = value.reshape(entry.writeback.shape)
        keep.append(value)
        self._record(stream, [(entry, value)], keep, [request])

    def _staged_one(self, request: Request, entry, info, device_id: int) -> None:
        """Copy the input to the host, run the CPU executor's collective, copy the result back."""
        if self.cpu is None:
            raise HvddpError("internal error: the staging path needs the CPU executor.")
        stream = self.stream(device_id)
        self._order_after_producers([entry], stream)
        host_in = self._host_buffer(request.dtype, entry.input.size, device_id).reshape(entry.input.shape)
        entry.input.get(stream=stream, out=host_in)
        if request.dtype == "bfloat16":
            host_in = host_in.view(bfloat16())
        host_out = None
        if entry.output is not None:
            host_out = host_in if entry.output is entry.input else _to_host(entry.output, request.dtype, stream)
        stream.synchronize()
        stand_in = _HostEntry(host_in, host_out)
        result = self.cpu._dispatch(request, stand_in, info)
        splits = None
        if request.kind is Kind.ALLTOALL:
            result, splits = result
        if entry.output is not None:
            out = entry.output
        else:  # allocated after MPI: wait again for what the user queued meanwhile (module doc)
            out = self._empty(result.shape, request.dtype)
            self._after_default_stream(stream)
        # (reshaped: np.ascontiguousarray makes a 0-d result 1-d, which CuPy's set refuses)
        out.set(_bits(np.ascontiguousarray(result).reshape(out.shape)), stream=stream)
        if entry.writeback is not None:
            with stream:
                entry.writeback[...] = out.reshape(entry.writeback.shape)
        value = (out, splits) if splits is not None else out
        self._record(stream, [(entry, value)], [entry, result, out], [request])


class _HostEntry:
    """What ``Executor._dispatch`` reads from an entry: a host input and an in-place output."""

    __slots__ = ("input", "output")

    def __init__(self, input_: np.ndarray, output: Optional[np.ndarray]) -> None:
        self.input = input_
        self.output = output


def _bounds(array) -> Tuple[int, int]:
    """The device addresses ``[start, end)`` that ``array``'s elements span (empty: start == end)."""
    start = end = array.data.ptr
    if array.size == 0:
        return start, end
    for n, stride in zip(array.shape, array.strides):
        if stride < 0:
            start += (n - 1) * stride
        else:
            end += (n - 1) * stride
    return start, end + array.itemsize


def _to_host(array, dtype: str, stream) -> np.ndarray:
    """A host copy of a device array (enqueued on ``stream``; synchronize before reading)."""
    import cupyx

    host = cupyx.empty_pinned(array.shape, dtype=storage_dtype(dtype))
    array.get(stream=stream, out=host)
    return host.view(bfloat16()) if dtype == "bfloat16" else host


def _bits(array: np.ndarray) -> np.ndarray:
    """A host array as CuPy can take it: bfloat16 as its uint16 bits."""
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16)
    return array
