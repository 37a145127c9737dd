"""Sparse gradients for ``DistributedOptimizer``: one allgather per parameter, under its own name.

A sparse COO gradient travels as one byte array with a row per stored entry: the entry's
indices (int64) followed by its values. One collective under the parameter's reduction name
(not two, as ``sparse_allreduce_async`` uses) means a rank that got no gradient for the
parameter this step, and so submits dense zeros by allreduce under that name, meets the sparse
ranks' allgather in a ``MismatchError`` on every rank instead of a stall; the optimizer then
knows the parameter is sparse and resubmits as ``sparse_rows_async(None, ...)`` (no rows).

Each rank also sends one row whose indices are its tensor's sparse shape (``with_shape_row``):
entries are below the shape, so every rank finds the ranks' shape rows among what it gathered
and, when some rank's shape differs, raises on every rank (an index past the shape would
otherwise land in a sparse tensor built without checks). The shape row's first value holds the
rank's op (0 Average, 1 Sum), applied by each rank to what it gathered: ranks that passed
different ops raise on every rank, as a dense allreduce's do, instead of parting silently.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import hvddp
from hvddp import Average, MismatchError, ProcessSet, ReduceOp

from ._convert import Handle, as_numpy, as_tensor


def sparse_rows_async(grad: Optional[torch.Tensor], param: torch.Tensor, name: str, op: ReduceOp,
                      process_set: ProcessSet) -> Handle:
    """Start gathering every rank's entries of a sparse gradient of ``param``.

    ``grad`` is a sparse COO tensor, or None for a rank without a gradient (it contributes no
    rows, shaped as an embedding's gradient: one sparse dimension). The result is an uncoalesced
    sparse tensor of ``param``'s shape holding every rank's entries, values divided by the set's
    size for Average; a rank whose rows differ in size raises ``MismatchError`` on every rank.
    """
    if grad is None:
        sparse_dim = 1
        indices = torch.empty((0, 1), dtype=torch.int64)
        values = torch.empty((0,) + tuple(param.shape[1:]), dtype=param.dtype)
    else:
        grad = grad if grad.is_coalesced() else grad.coalesce()
        sparse_dim = grad.sparse_dim()
        indices = _fresh(grad.indices().t())
        values = _fresh(grad.values())
    indices, values = with_shape_row(indices, values, param.shape, op)
    nnz = indices.shape[0]
    dense = tuple(values.shape[1:])
    value_bytes = math.prod(dense) * values.element_size()
    rows = torch.cat([indices.view(torch.uint8).reshape(nnz, sparse_dim * 8),
                      values.reshape(nnz, math.prod(dense)).view(torch.uint8).reshape(nnz, value_bytes)],
                     dim=1)
    core = hvddp.allgather_async(as_numpy(rows), name, process_set)
    ranks = process_set.ranks  # (registered: the world's ranks for the global set), in gathered order

    def finish(results):
        gathered = as_tensor(results[0], rows)
        total = gathered.shape[0]
        all_indices = _fresh(gathered[:, :sparse_dim * 8]).view(torch.int64)
        all_values = _fresh(gathered[:, sparse_dim * 8:]).view(values.dtype).reshape((total,) + dense)
        all_indices, all_values = without_shape_rows(all_indices, all_values, param.shape, ranks,
                                                     f"the sparse gradient {name!r}")
        if op == Average:
            all_values = all_values / len(ranks)
        out = torch.sparse_coo_tensor(all_indices.t(), all_values, param.shape, check_invariants=False)
        return out.to(param.device)  # staged through host memory; the gradient lives with the parameter

    return Handle(name, [core], finish)


def with_shape_row(indices: torch.Tensor, values: torch.Tensor, shape: torch.Size, op: ReduceOp):
    """``indices`` (nnz, sparse_dim) and ``values`` with a first row holding the sparse shape
    (values zero but the first: ``op``'s code, 1 for Sum); as they are without sparse dimensions
    (no index to check)."""
    sparse_dim = indices.shape[1]
    if sparse_dim == 0:
        return indices, values
    row = torch.tensor([list(shape[:sparse_dim])], dtype=torch.int64, device=indices.device)
    zeros = torch.zeros((1,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    if zeros.numel():
        zeros.view(-1)[0] = int(op == ReduceOp.SUM)
    return torch.cat([row, indices]), torch.cat([zeros, values])


def without_shape_rows(indices: torch.Tensor, values: torch.Tensor, shape: torch.Size, ranks: list,
                       what: str):
    """Every rank's entries gathered with ``with_shape_row`` over the set of ``ranks``, the shape
    rows taken out; a ``MismatchError`` (on every rank: each finds fewer rows of its own shape
    than ranks, or an entry past it; or shape rows whose op codes differ) when the ranks' shapes
    or ops differ."""
    size = len(ranks)
    if indices.shape[1] == 0:
        return indices, values
    bound = torch.tensor(list(shape[:indices.shape[1]]), dtype=torch.int64, device=indices.device)
    is_shape = (indices == bound).all(dim=1)
    found = int(is_shape.sum())
    if found != size or bool((indices >= bound).any(dim=1).logical_and_(~is_shape).any()):
        # (no count of the ranks that agree: a peer's entry can sit at this rank's shape row)
        raise MismatchError(f"{what}: the ranks' tensors have different shapes (this rank's is "
                            f"{tuple(shape)}, and not every rank's is); every rank must reduce a tensor of the "
                            f"same shape (for a model's gradients: the same model on every rank, as "
                            f"broadcast_parameters checks).")
    codes = values[is_shape].reshape(size, -1)[:, :1].flatten().tolist()
    if any(c != codes[0] for c in codes):
        names = {0: "Average", 1: "Sum"}
        ops = ", ".join(f"rank {r} {names.get(int(c), c)}" for r, c in zip(ranks, codes))
        raise MismatchError(f"{what}: op differs across ranks: {ops}; pass the same op on every rank.")
    keep = ~is_shape
    return indices[keep], values[keep]


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy whose last stride is 1, as ``view(dtype)`` needs: ``contiguous()`` keeps
    other strides on size-1 and empty dimensions."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)
