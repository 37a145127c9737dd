"""Framework-free helpers for reducing a list of gradients as one named group.

Shared by ``hvddp.keras`` and ``hvddp.tensorflow``: it uses numpy and the core only, so Keras on
the torch and JAX backends can use it without importing TensorFlow, and the bodies of
``tf.numpy_function`` calls stay plain Python.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, List, Optional, Sequence, Set

import numpy as np

import hvddp

_checked: Set[str] = set()


def group_name(prefix: str, labels: Sequence[str]) -> str:
    """Return a name for a group of tensors that depends only on their labels (paths)."""
    digest = hashlib.blake2b("\x00".join(labels).encode(), digest_size=6).hexdigest()
    return f"{prefix}.{digest}"


def check_group_once(base: str, labels: Sequence[str], shapes: Sequence[tuple], dtypes: Sequence[str],
                     process_set: Any) -> None:
    """On the first use of ``base`` in this process, check every rank reduces the same list.

    Ranks whose variable lists differ would otherwise wait on different group names until the
    stall warning. Costs one small ``allgather_object`` per distinct group.

    Raises:
        hvddp.MismatchError: the lists differ; the message names the first difference.
    """
    if base in _checked:
        return
    prefix = base.rsplit(".", 1)[0]
    index = sum(1 for b in _checked if b.rsplit(".", 1)[0] == prefix)
    mine = [(label, tuple(int(d) for d in shape), str(dtype))
            for label, shape, dtype in zip(labels, shapes, dtypes)]
    every = hvddp.allgather_object(mine, name=f"{prefix}.check.{index}", process_set=process_set)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            raise hvddp.MismatchError(_describe(every[0], theirs, rank))
    _checked.add(base)


def _describe(first: list, other: list, rank: int) -> str:
    if len(first) != len(other):
        return (f"ranks reduce different numbers of gradients: rank 0 has {len(first)}, rank {rank} "
                f"has {len(other)}. Every rank must build the same model and pass the same variables.")
    for (l0, s0, d0), (l1, s1, d1) in zip(first, other):
        if (l0, s0, d0) != (l1, s1, d1):
            return (f"gradient lists differ across ranks: rank 0 has {l0!r} {s0} {d0}, rank {rank} "
                    f"has {l1!r} {s1} {d1}. Every rank must build the same model.")
    return "gradient lists differ across ranks."


def reduce_group(arrays: Sequence[np.ndarray], base: str, labels: Sequence[str], op: Any,
                 prescale_factor: float, postscale_factor: float, compression: Any,
                 process_set: Any) -> List[np.ndarray]:
    """Compress, reduce as one grouped allreduce named ``base``, decompress; keep dtypes.

    Raises:
        hvddp.HvddpError: the reduction failed; a mismatch names the variable behind the member.
    """
    arrays = [np.asarray(a) for a in arrays]
    compressed, ctxs = [], []
    for a in arrays:
        c, ctx = compression.compress(a)
        compressed.append(c)
        ctxs.append(ctx)
    try:
        reduced = hvddp.grouped_allreduce(compressed, name=base, op=op, prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor, process_set=process_set)
    except hvddp.MismatchError as exc:
        raise hvddp.MismatchError(_name_member(str(exc), base, labels)) from None
    if len(compressed) == 1 and not isinstance(reduced, list):
        reduced = [reduced]  # the core returns a bare array for a one-member group
    return [np.asarray(compression.decompress(r, ctx), dtype=a.dtype)
            for r, ctx, a in zip(reduced, ctxs, arrays)]


def _name_member(message: str, base: str, labels: Sequence[str]) -> str:
    match = re.search(re.escape(base) + r"\.(\d+)", message)
    if match and int(match.group(1)) < len(labels):
        return f"{message} (member {match.group(1)} is the gradient of {labels[int(match.group(1))]!r})"
    return message


def average_factors(op: Any, gradient_predivide_factor: float, size: int):
    """Return ``(op, prescale, postscale)`` for Average with a gradient pre-division factor."""
    if gradient_predivide_factor == 1.0:
        return op, 1.0, 1.0
    return hvddp.Sum, 1.0 / gradient_predivide_factor, gradient_predivide_factor / size


def check_op(op: Any, average: Optional[bool], fn: str, default: Any = hvddp.Average) -> Any:
    """Validate ``op``/``average`` like the core does; return a ``hvddp.ReduceOp``."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{fn}: pass either op= or the legacy average=, not both "
                             f"(got op={op!r}, average={average!r}).")
        return hvddp.Average if average else hvddp.Sum
    if op is None:
        return default
    try:
        op = hvddp.ReduceOp(op)
    except ValueError:
        raise ValueError(f"{fn}: op must be one of hvddp.Average, Sum, Min, Max, Product; "
                         f"Received: op={op!r}.") from None
    if op is hvddp.Adasum:
        raise ValueError(f"{fn}: op=Adasum is not implemented in hvddp; use Average or Sum.")
    return op


def check_predivide(op: Any, gradient_predivide_factor: Any, fn: str) -> float:
    """Validate ``gradient_predivide_factor`` (only meaningful with Average)."""
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)):
        raise TypeError(f"{fn}: gradient_predivide_factor must be a number; "
                        f"Received: gradient_predivide_factor={gradient_predivide_factor!r}.")
    factor = float(gradient_predivide_factor)
    if not factor > 0:
        raise ValueError(f"{fn}: gradient_predivide_factor must be > 0; Received: {factor!r}.")
    if factor != 1.0 and op is not hvddp.Average:
        raise ValueError(f"{fn}: gradient_predivide_factor only applies with op=Average; "
                         f"Received: op={op!r}, gradient_predivide_factor={factor!r}.")
    return factor
