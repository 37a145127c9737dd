"""Collectives on torch tensors, zero-copy on CPU, differentiable where Horovod's are.

Every function mirrors its Horovod namesake (same positional order) and forwards to the numpy
core in ``hvddp``: CPU tensors are handed over as numpy views of their own memory, so the
in-place forms (``allreduce_``, ``broadcast_``, ...) reduce straight into the tensor. Tensors on
another device are staged through host memory. The contract across ranks is the core's:
every member of ``process_set`` submits the same ``name`` with the same dtype, shape (dim 0 may
differ for allgather) and op; a disagreement raises ``hvddp.MismatchError`` (a RuntimeError) on
every rank, and a second pending op with the same name is a ``ValueError``. In a size-1 run each
collective returns a copy of its input, scaled as the op says.

Autograd (as in Horovod): ``allreduce``, ``grouped_allreduce``, ``allgather``,
``grouped_allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` and
``grouped_reducescatter`` are differentiable. The backward of allreduce is the same allreduce of
the gradient (Average/Sum; also with the scale factors), of allgather an Average-allreduce of
the gradient sliced to this rank's rows, of broadcast an Average-allreduce kept on the root only,
of alltoall the reverse alltoall, of reducescatter an allgather (times the size for Sum, as
Horovod's; with Average, as Horovod's, the allgather itself). In-place and ``_async`` forms are not differentiable.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch

import hvddp
from hvddp import Average, ProcessSet, ReduceOp, Sum, global_process_set
# the runtime names Horovod's horovod.torch.mpi_ops has too, for scripts that import them from there
from hvddp import (Adasum, HvddpError, Max, Min, Product, add_process_set, ccl_built, cross_rank, cross_size,
                   cuda_built, ddl_built, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                   local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                   remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)

from hvddp._grouping import check_compression
from hvddp.ops import Refusal, announce_refusal

from ._convert import Handle, TensorArgumentError, as_tensor, check_tensor, source, target
from ._sparse import with_shape_row, without_shape_rows
from .compression import Compression, Compressor, native

__all__ = [
    "Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier",
    # as in Horovod's module
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "nccl_built",
    "cuda_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built", "rocm_built", "start_timeline",
    "stop_timeline", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average",
    "Sum", "Min", "Max", "Product", "Adasum", "Compression", "HorovodInternalError",
]

# Horovod's torch package raises this name for every failed collective; scripts catch it by it
HorovodInternalError = HvddpError


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _announced(core_fn: Callable) -> Callable:
    """Decorate a collective whose own checks (``check_tensor``, ...) may raise
    ``TensorArgumentError`` before the core sees the call: the refusal is then announced through
    ``core_fn``, given ``Refusal`` in place of the tensors (the core raises it where it checks
    them, after taking the name it would have given the call), so that ranks which made the call
    validly fail with ``MismatchError`` instead of waiting for this one."""
    core_params = inspect.signature(core_fn).parameters

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        first = next(iter(sig.parameters))  # tensor or tensors, as in the core

        @functools.wraps(fn)
        def announcing(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TensorArgumentError as exc:
                if not getattr(exc, "hvddp_announced", False):  # (an inner collective did)
                    exc.hvddp_announced = True
                    _announce(core_fn, core_params, sig, first, exc, args, kwargs)
                raise

        return announcing

    return wrap


def _compressor(compression: Any, fn: str) -> Compressor:
    """``compression`` if it can compress, else a ``TensorArgumentError`` naming it (announced to
    the other ranks like a bad tensor)."""
    try:
        return native(check_compression(compression, fn))
    except TypeError as exc:
        raise TensorArgumentError(str(exc)) from None


def _announce(core_fn, core_params, sig, first: str, exc: BaseException, args, kwargs) -> None:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return
    announce_refusal(core_fn, exc, bound.arguments.get(first) if first == "tensors" else None,
                     **{k: v for k, v in bound.arguments.items() if k in core_params and k != first})


def _tensors(tensors: Any, fn: str) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TensorArgumentError(f"{fn}: tensors must be a list or tuple of torch tensors, got "
                                  f"{type(tensors).__name__}.")
    return [check_tensor(t, fn, f"tensors[{i}]") for i, t in enumerate(tensors)]


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _out(like: torch.Tensor):
    return lambda results: as_tensor(results[0], like)


def _outs(likes: Sequence[torch.Tensor]):
    def finish(results):
        arrays = results[0]
        if not isinstance(arrays, list):  # the core returns a one-member group's array bare
            arrays = [arrays]
        return [as_tensor(a, t) for a, t in zip(arrays, likes)]
    return finish


def _inplace(tensors: Sequence[torch.Tensor], copy_backs, single: bool):
    def finish(results):
        for copy_back in copy_backs:
            if copy_back is not None:
                copy_back()
        for t in tensors:  # written behind autograd's back: a tensor saved for backward then
            torch.autograd.graph.increment_version(t)  # raises torch's in-place error, not a wrong gradient
        return tensors[0] if single else list(tensors)
    return finish


# allreduce --------------------------------------------------------------------------------
@_announced(hvddp.allreduce_async)
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` across ranks; ``synchronize(handle)`` returns a new tensor.

    Every member of ``process_set`` must submit ``name`` with the same dtype, shape, op and scale
    factors. The result is ``postscale * op(prescale * tensor_r for every rank r)``; Average
    divides by the set's size (integers truncate toward zero). ``tensor`` is not modified.

    Args:
        tensor: a dense tensor of a supported dtype (bool only with Min/Max).
        average: legacy flag; True means ``op=Average``, False ``op=Sum``.
        name: the name that matches this call across ranks; automatic when None.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, or ``Adasum`` (float
            CPU tensors on a power-of-two process set).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part; every rank by default.

    Returns:
        A ``Handle``.

    Raises:
        TypeError, ValueError: a bad argument, or ``name`` already pending.
    """
    check_tensor(tensor, "allreduce")
    core = hvddp.allreduce_async(source(tensor), average, name, op, prescale_factor,
                                 postscale_factor, process_set)
    return Handle(core.name, [core], _out(tensor))


@_announced(hvddp.allreduce_async)
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` in place; ``synchronize(handle)`` returns ``tensor``.

    Do not read or write ``tensor`` until the handle is synchronized: the engine writes into
    its memory. Same contract as ``allreduce_async``.
    """
    check_tensor(tensor, "allreduce_")
    buf, copy_back = target(tensor)
    core = hvddp.allreduce_async_(buf, average, name, op, prescale_factor, postscale_factor, process_set)
    return Handle(core.name, [core], _inplace([tensor], [copy_back], True))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it; blocks. Not differentiable."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set).wait()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, name, op, prescale_factor, postscale_factor, process_set)
        return allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                               process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        average, name, op, pre, post, process_set = ctx.args
        _check_differentiable(op, average)
        # the public, differentiable collective, as Horovod's: under create_graph=True (a gradient
        # penalty, a Hessian-vector product) the second backward goes through it too
        grad = allreduce(grad_output.contiguous(), average, _grad_name(name), op=op, prescale_factor=pre,
                         postscale_factor=post, process_set=process_set)
        return grad, None, None, None, None, None, None


def _check_differentiable(op, average) -> None:
    if average is None and op is not None and ReduceOp(op) not in (Average, Sum):
        raise RuntimeError(f"allreduce with op={ReduceOp(op)!r} is not differentiable in hvddp; "
                           f"only Average and Sum are. Detach the input (tensor.detach()).")


@_announced(hvddp.allreduce_async)
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Compressor = Compression.none, op: Optional[ReduceOp] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return a new tensor; blocks; differentiable.

    ``compression`` casts the tensor (e.g. to float16) for the collective and back afterwards.
    See ``allreduce_async`` for the contract across ranks.
    """
    check_tensor(tensor, "allreduce")
    compression = _compressor(compression, "allreduce")
    compressed, ctx = compression.compress(tensor)
    if _needs_grad(compressed):
        out = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                               process_set)
    else:
        out = allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                              process_set).wait()
    return compression.decompress(out, ctx)


@_announced(hvddp.grouped_allreduce_async)
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            names: Optional[Sequence[str]] = None) -> Handle:
    """Start reducing a list of tensors as one atomic group; the result is a list of new tensors.

    Members are named ``<name>.<i>``, or ``names`` (one per tensor); every rank passes the same
    number of tensors with the same shapes and dtypes in the same order.
    """
    tensors = _tensors(tensors, "grouped_allreduce")
    core = hvddp.grouped_allreduce_async([source(t) for t in tensors], average, name, op,
                                         prescale_factor, postscale_factor, process_set, names)
    return Handle(core.name, [core], _outs(tensors))


@_announced(hvddp.grouped_allreduce_async)
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set,
                             names: Optional[Sequence[str]] = None) -> Handle:
    """Start reducing a list of tensors in place as one group; the result is the list."""
    tensors = _tensors(tensors, "grouped_allreduce_")
    bufs = [target(t) for t in tensors]
    core = hvddp.grouped_allreduce_async_([b for b, _ in bufs], average, name, op, prescale_factor,
                                          postscale_factor, process_set, names)
    return Handle(core.name, [core], _inplace(tensors, [c for _, c in bufs], False))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[ReduceOp] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       names: Optional[Sequence[str]] = None) -> List[torch.Tensor]:
    """Reduce a list of tensors in place as one group and return it; blocks."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set, names).wait()


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, names, *tensors):
        ctx.args = (average, name, op, prescale_factor, postscale_factor, process_set, names)
        return tuple(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                             postscale_factor, process_set, names).wait())

    @staticmethod
    def backward(ctx, *grads):
        average, name, op, pre, post, process_set, names = ctx.args
        _check_differentiable(op, average)
        out = grouped_allreduce([g.contiguous() for g in grads], average, _grad_name(name), op=op,
                                prescale_factor=pre, postscale_factor=post, process_set=process_set,
                                names=None if names is None else [_grad_name(n) for n in names])
        return (None,) * 7 + tuple(out)


@_announced(hvddp.grouped_allreduce_async)
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Compressor = Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      names: Optional[Sequence[str]] = None) -> List[torch.Tensor]:
    """Reduce a list of tensors as one group and return new tensors; blocks; differentiable."""
    tensors = _tensors(tensors, "grouped_allreduce")
    compression = _compressor(compression, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if _needs_grad(*compressed):
        outs = list(_GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                            process_set, names, *compressed))
    else:
        outs = grouped_allreduce_async(compressed, average, name, op, prescale_factor,
                                       postscale_factor, process_set, names).wait()
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp = Average,
                           process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    The result (from ``synchronize``) is an uncoalesced sparse tensor holding every rank's
    entries, values divided by the set's size for ``op=Average`` (a true division, as in Horovod:
    integer values come back as floats, where a dense integer Average truncates). Only Average
    and Sum apply.
    Uses the names ``<name>.indices`` and ``<name>.values``; with ``name=None``, an automatic
    name (the n-th unnamed sparse allreduce on the set).
    """
    hvddp.ops._process_set(process_set, "sparse_allreduce_async")
    if name is None:
        name = hvddp.ops._auto_name("sparse_allreduce", process_set)
    elif not isinstance(name, str) or not name:
        raise TypeError(f"sparse_allreduce_async: name must be a non-empty str or None, got {name!r}.")
    try:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            raise TypeError(f"sparse_allreduce_async: tensor must be a sparse COO torch tensor, got "
                            f"{getattr(tensor, 'layout', type(tensor).__name__)}.")
        if op not in (Average, Sum):  # (ReduceOp members and their ints)
            raise ValueError(f"sparse_allreduce_async: op must be Average or Sum, got {op!r}.")
        op = ReduceOp(op)
        t = tensor.coalesce() if not tensor.is_coalesced() else tensor
        values = check_tensor(t.values().contiguous(), "sparse_allreduce_async", "tensor values")
        indices, values = with_shape_row(t.indices().t(), values, tensor.shape, op)
    except Exception as exc:  # announced under both names, so ranks that made the call fail too
        for part in ("values", "indices"):
            try:
                hvddp.allgather_async(Refusal(exc), f"{name}.{part}", process_set)
            except Exception:  # (the refusal, announced)
                pass
        raise
    h_values = hvddp.allgather_async(source(values), f"{name}.values", process_set)
    h_indices = hvddp.allgather_async(source(indices), f"{name}.indices", process_set)
    ranks = process_set.ranks  # (registered: the world's ranks for the global set), in gathered order

    def finish(results):
        values_all = as_tensor(results[0], tensor)
        indices_all = as_tensor(results[1], tensor)
        indices_all, values_all = without_shape_rows(indices_all, values_all, tensor.shape, ranks,
                                                     f"sparse_allreduce_async {name!r}")
        if op == Average:
            values_all = values_all / len(ranks)
        return torch.sparse_coo_tensor(indices_all.t(), values_all, tensor.shape, check_invariants=False)

    return Handle(name, [h_values, h_indices], finish)


# allgather --------------------------------------------------------------------------------
@_announced(hvddp.allgather_async)
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0, in rank order.

    Dim 0 may differ across ranks; dtype and the other dimensions must match.
    """
    check_tensor(tensor, "allgather")
    core = hvddp.allgather_async(source(tensor), name, process_set)
    return Handle(core.name, [core], _out(tensor))


def _rows_offset(rows: int, name: Optional[str], process_set: ProcessSet):
    counts = hvddp.allgather(torch.tensor([rows], dtype=torch.int64).numpy(),
                             None if name is None else f"{name}.rows", process_set)
    return int(counts[:process_set.rank()].sum())


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        out = allgather_async(tensor, name, process_set).wait()  # (the core refuses a 0-d tensor)
        ctx.args = (tensor.shape[0], name, process_set)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        rows, name, process_set = ctx.args
        grad = allreduce(grad_output.contiguous(), None, _grad_name(name), op=Average,
                         process_set=process_set)
        offset = _rows_offset(rows, _grad_name(name), process_set)
        return grad.narrow(0, offset, rows), None, None


@_announced(hvddp.allgather_async)
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; blocks; differentiable."""
    check_tensor(tensor, "allgather")
    if _needs_grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return allgather_async(tensor, name, process_set).wait()


@_announced(hvddp.grouped_allgather_async)
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start allgathering a list of tensors as one group; the result is a list."""
    tensors = _tensors(tensors, "grouped_allgather")
    core = hvddp.grouped_allgather_async([source(t) for t in tensors], name, process_set)
    return Handle(core.name, [core], _outs(tensors))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.args = ([t.shape[0] for t in tensors], name, process_set)
        return tuple(grouped_allgather_async(list(tensors), name, process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        rows, name, process_set = ctx.args
        # only floating members have gradients (an int or bool member's are zeros of its dtype,
        # which an Average refuses); dtypes agree across ranks, so every rank picks the same ones
        floating = [i for i, g in enumerate(grads) if g.is_floating_point()]
        reduced = grouped_allreduce([grads[i].contiguous() for i in floating], None, _grad_name(name),
                                    op=Average, process_set=process_set) if floating else []
        counts = hvddp.allgather(torch.tensor([rows], dtype=torch.int64).numpy(),
                                 None if name is None else f"{name}.grad.rows", process_set)
        offsets = counts[:process_set.rank()].sum(axis=0).tolist()
        out = [None] * len(grads)
        for i, g in zip(floating, reduced):
            out[i] = g.narrow(0, int(offsets[i]), rows[i])
        return (None, None) + tuple(out)


@_announced(hvddp.grouped_allgather_async)
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Allgather a list of tensors as one group; blocks; differentiable."""
    tensors = _tensors(tensors, "grouped_allgather")
    if _needs_grad(*tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return grouped_allgather_async(tensors, name, process_set).wait()


# broadcast --------------------------------------------------------------------------------
@_announced(hvddp.broadcast_async)
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank; the result is a new tensor.

    ``root_rank`` is a global rank (``hvd.rank()``), a member of ``process_set``, as in Horovod;
    shape and dtype must match on every rank.
    """
    check_tensor(tensor, "broadcast")
    core = hvddp.broadcast_async(source(tensor), root_rank, name, process_set)
    return Handle(core.name, [core], _out(tensor))


@_announced(hvddp.broadcast_async)
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place."""
    check_tensor(tensor, "broadcast_")
    buf, copy_back = target(tensor)
    core = hvddp.broadcast_async_(buf, root_rank, name, process_set)
    return Handle(core.name, [core], _inplace([tensor], [copy_back], True))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values in place and return it; blocks."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        root_rank, name, process_set = ctx.args
        grad = allreduce(grad_output.contiguous(), None, _grad_name(name), op=Average,
                         process_set=process_set)
        if hvddp.rank() != root_rank:  # zeros still in the graph (not zeros_like): a second
            # backward (create_graph=True) meets the allreduce above on every rank, not the root alone
            grad = grad.masked_fill(torch.ones((), dtype=torch.bool, device=grad.device), 0)
        return grad, None, None, None


@_announced(hvddp.broadcast_async)
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank as a new tensor; blocks; differentiable."""
    check_tensor(tensor, "broadcast")
    if _needs_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return broadcast_async(tensor, root_rank, name, process_set).wait()


# alltoall ---------------------------------------------------------------------------------
def _splits_list(splits: Any) -> Optional[List[int]]:
    if splits is None:
        return None
    if isinstance(splits, (torch.Tensor, np.ndarray)):  # (int() would truncate 1.9 to 1: rows unsent)
        if splits.ndim != 1 or splits.shape[0] and not _integer_dtype(splits.dtype):
            raise TensorArgumentError(f"alltoall: splits must be a 1-D tensor or array of ints (rows to send "
                                      f"to each rank); got {splits.dtype} of shape {list(splits.shape)}: "
                                      f"{splits!r}.")
        return [int(s) for s in splits.tolist()]  # (empty: an even split)
    if not isinstance(splits, Sequence):
        raise TensorArgumentError(f"alltoall: splits must be a list, tuple, array or tensor of ints (rows to send "
                        f"to each rank), or None; got {type(splits).__name__} {splits!r}.")
    return list(splits)


def _integer_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return np.dtype(dtype).kind in "iu"


@_announced(hvddp.alltoall_async)
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` to rank ``i`` and receiving theirs.

    Equal splits when None (dim 0 must divide by the set's size). The handle's result is
    ``(output, received_splits)``, ``received_splits`` an int32 tensor.
    """
    check_tensor(tensor, "alltoall")
    core = hvddp.alltoall_async(source(tensor), _splits_list(splits), name, process_set)

    def finish(results):
        output, received = results[0]
        return as_tensor(output, tensor), torch.from_numpy(received)

    return Handle(core.name, [core], finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = alltoall_async(tensor, splits, name, process_set).wait()
        ctx.args = (received, name, process_set, tensor.shape[0])
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        received, name, process_set, rows = ctx.args
        grad, _ = alltoall(grad_output.contiguous(), received, _grad_name(name), process_set)
        if grad.shape[0] < rows:  # rows past sum(splits) were not sent: their gradient is zero
            grad = torch.cat([grad, grad.new_zeros((rows - grad.shape[0],) + tuple(grad.shape[1:]))])
        return grad, None, None, None


@_announced(hvddp.alltoall_async)
def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Exchange slices of ``tensor`` with every rank; blocks; differentiable.

    Returns:
        The received tensor; with ``splits`` given, ``(output, received_splits)``.
    """
    check_tensor(tensor, "alltoall")
    if _needs_grad(tensor):
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = alltoall_async(tensor, splits, name, process_set).wait()
    return output if splits is None else (output, received)


# reducescatter ----------------------------------------------------------------------------
@_announced(hvddp.reducescatter_async)
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` across ranks, keeping this rank's slice of dim 0.

    Rows are split as evenly as possible, the first ``rows % size`` ranks getting one more.
    """
    check_tensor(tensor, "reducescatter")
    core = hvddp.reducescatter_async(source(tensor), name, op, process_set, prescale_factor,
                                     postscale_factor)
    return Handle(core.name, [core], _out(tensor))


def _scatter_grad_factor(op, pre, post, process_set) -> float:
    op = Average if op is None else ReduceOp(op)
    if op not in (Average, Sum):
        raise RuntimeError(f"reducescatter with op={op!r} is not differentiable in hvddp; only "
                           f"Average and Sum are.")
    # Horovod's: the allgathered gradient times size for Sum, as it is for Average
    return pre * post * (process_set.size() if op == Sum else 1)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (name, op, process_set, prescale_factor, postscale_factor)
        return reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                   postscale_factor).wait()

    @staticmethod
    def backward(ctx, grad_output):
        name, op, process_set, pre, post = ctx.args
        factor = _scatter_grad_factor(op, pre, post, process_set)
        grad = allgather(grad_output.contiguous(), _grad_name(name), process_set)
        return grad * factor, None, None, None, None, None


@_announced(hvddp.reducescatter_async)
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Compressor = Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's slice; blocks; differentiable."""
    check_tensor(tensor, "reducescatter")
    compression = _compressor(compression, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    if _needs_grad(compressed):
        out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                  postscale_factor).wait()
    return compression.decompress(out, ctx)


@_announced(hvddp.grouped_reducescatter_async)
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: ReduceOp = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each tensor in a list, as one group."""
    tensors = _tensors(tensors, "grouped_reducescatter")
    core = hvddp.grouped_reducescatter_async([source(t) for t in tensors], name, op, process_set,
                                             prescale_factor, postscale_factor)
    return Handle(core.name, [core], _outs(tensors))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (name, op, process_set, prescale_factor, postscale_factor)
        return tuple(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                 postscale_factor).wait())

    @staticmethod
    def backward(ctx, *grads):
        name, op, process_set, pre, post = ctx.args
        factor = _scatter_grad_factor(op, pre, post, process_set)
        out = grouped_allgather([g.contiguous() for g in grads], _grad_name(name), process_set)
        return (None,) * 5 + tuple(g * factor for g in out)


@_announced(hvddp.grouped_reducescatter_async)
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Compressor = Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatter each tensor in a list, as one group; blocks; differentiable."""
    tensors = _tensors(tensors, "grouped_reducescatter")
    compression = _compressor(compression, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if _needs_grad(*compressed):
        outs = list(_GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                                postscale_factor, *compressed))
    else:
        outs = grouped_reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                           postscale_factor).wait()
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# handles, join, barrier -------------------------------------------------------------------
def poll(handle: Any) -> bool:
    """Return True if the operation behind ``handle`` has completed; never blocks."""
    if isinstance(handle, Handle):
        return handle.done()
    return hvddp.poll(handle)


def synchronize(handle: Any, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle`` and return its result (a tensor, a list, or a pair for alltoall).

    Raises:
        hvddp.HvddpError: the collective failed; raised on every rank alike.
        TimeoutError: ``timeout`` seconds passed first.
    """
    if isinstance(handle, Handle):
        return handle.wait(timeout)
    return hvddp.synchronize(handle, timeout)


def join(device: int = -1) -> int:
    """Declare that this rank has no more batches; return the last rank to join.

    Until every rank has joined, this rank contributes zeros to the others' Sum and Average
    allreduces (so a ``DistributedOptimizer`` step on the other ranks still completes), and the
    op's identity to Min, Max and Product. ``device`` is ignored.
    """
    return hvddp.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of ``process_set`` has called ``barrier``."""
    hvddp.barrier(process_set)
