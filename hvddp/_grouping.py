"""Framework-free helpers for reducing a list of gradients as one named group.

Shared by ``hvddp.keras`` and ``hvddp.tensorflow``: it uses numpy and the core only, so Keras on
the torch and JAX backends can use it without importing TensorFlow, and the bodies of
``tf.numpy_function`` calls stay plain Python.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np

import hvddp
from hvddp.exceptions import REFUSED


@contextlib.contextmanager
def announcing(core_fn: Callable, name: Optional[str], process_set: Any, group: Any = None,
               **kwargs: Any) -> Iterator[None]:
    """Run an adapter's own checks of a call; a ``ValueError`` or ``TypeError`` they raise is
    announced under the call's ``name`` through ``core_fn`` (``hvddp.ops.announce_refusal``;
    ``group``: a grouped call's tensors as given), then raised here. ``name`` None: the core's
    automatic name, the one the valid ranks' core call takes."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        hvddp.ops.announce_refusal(core_fn, exc, group, name=name, process_set=process_set, **kwargs)
        raise

def rows_here(rows: int, size: int, rank: int) -> int:
    """The rows of a reducescatter result on ``rank`` (the first ``rows % size`` get one more)."""
    return rows // size + (1 if rank < rows % size else 0)


def check_same_lists(name: str, labels: Sequence[str], shapes: Sequence[tuple], dtypes: Sequence[str],
                     process_set: Any, broadcast: str = "", root_rank: Any = None) -> None:
    """Check that every rank passes as many tensors, of the same shapes and dtypes, in order.

    ``broadcast``: the broadcasting function checking its variables (named in the message), or
    '' for a gradient reduction. Its ``root_rank`` is checked here too, on every rank at once
    (``root_refusal``).

    Collective: one small ``allgather_object`` named ``name``. Labels (variable paths) only
    name the tensors in the message: Keras numbers its layers per process (``dense_1`` on a rank
    that built one layer more), so the same model may carry different paths on different ranks.

    Raises:
        hvddp.MismatchError: the lists differ; the message names the first difference.
        TypeError, ValueError: ``root_rank`` is not a member of ``process_set`` on this rank
            (``hvddp.MismatchError`` on the others, naming it).
    """
    mine = [(label, tuple(int(d) for d in shape), str(dtype))
            for label, shape, dtype in zip(labels, shapes, dtypes)]
    problem = root_refusal(broadcast, root_rank, process_set) if broadcast and root_rank is not None else None
    every = hvddp.allgather_object((mine, None if problem is None else str(problem)), name=name,
                                   process_set=process_set)
    ranks = process_set.ranks or list(range(hvddp.size()))  # errors name global ranks, not positions in the set
    raise_root_refusals(broadcast, problem, [why for _, why in every], ranks)
    every = [theirs for theirs, _ in every]
    for rank, theirs in zip(ranks, every):
        message = _describe(every[0], theirs, rank, broadcast, ranks[0])
        if message:
            raise hvddp.MismatchError(message)


def root_refusal(fn: str, root_rank: Any, process_set: Any) -> Optional[Exception]:
    """This rank's refusal of ``root_rank`` for ``fn`` (not a member of ``process_set``), or None.

    Exchanged before any broadcast (``raise_root_refusals``): a rank that refused it only at its
    first broadcast raised there alone, and left the others waiting for the rest. A rank outside
    the set raises here, naming ``fn``."""
    view = hvddp.ops._process_set(process_set, fn)[1]
    try:
        hvddp.ops._root(fn, root_rank, view, process_set)
    except (TypeError, ValueError) as exc:
        return exc
    return None


def raise_root_refusals(fn: str, mine: Optional[Exception], whys: Sequence[Optional[str]],
                        ranks: Sequence[int]) -> None:
    """Raise this rank's own ``root_refusal``, or ``MismatchError`` naming the first rank whose
    refusal (``whys``, every rank's message in ``ranks``' order) was exchanged; else nothing."""
    if mine is not None:
        raise mine
    bad = next(((r, why) for r, why in zip(ranks, whys) if why is not None), None)
    if bad is not None:
        why = bad[1][len(fn) + 2:] if bad[1].startswith(f"{fn}: ") else bad[1]
        raise hvddp.MismatchError(f"{fn}: rank {bad[0]} refused its root_rank ({why}); no rank broadcasts. "
                                  f"Pass a root_rank in the set, the same on every rank.")


def _describe(first: list, other: list, rank: int, broadcast: str = "", first_rank: int = 0) -> str:
    """What differs between ``first_rank``'s list and ``rank``'s (shapes and dtypes), or ''."""
    if len(first) != len(other):
        names0, names1 = [entry[0] for entry in first], [entry[0] for entry in other]
        only = [f"only rank {r} has {', '.join(repr(n) for n in extra)}"
                for r, extra in ((first_rank, [n for n in names0 if n not in names1]),
                                 (rank, [n for n in names1 if n not in names0])) if extra]
        counts = (f"rank {first_rank} has {len(first)}, rank {rank} has {len(other)}"
                  f"{' (' + '; '.join(only) + ')' if only else ''}. Every rank must build the same model "
                  f"and pass the same variables")
        if broadcast:
            return f"{broadcast}: ranks broadcast different numbers of variables: {counts}."
        return (f"ranks reduce different numbers of tensors: {counts} (and, in hvddp.keras with "
                f"backward_passes_per_step > 1, have the same None gradients).")
    for i, ((l0, s0, d0), (l1, s1, d1)) in enumerate(zip(first, other)):
        if (s0, d0) != (s1, d1):
            return (f"{broadcast + ': ' if broadcast else ''}tensor lists differ across ranks at position "
                    f"{i}: rank {first_rank} has {l0!r} {s0} {d0}, rank {rank} has {l1!r} {s1} {d1}. Every rank must "
                    f"build the same model.")
    return ""


def reduce_group(arrays: Sequence[np.ndarray], base: str, labels: Sequence[str], op: Any,
                 prescale_factor: float, postscale_factor: float, compression: Any,
                 process_set: Any, counts: int = 0) -> List[np.ndarray]:
    """Compress, reduce as one grouped allreduce named ``base``, decompress; keep dtypes.

    ``base`` is fixed per caller (not derived from the tensors): ranks whose lists differ then
    meet under one name and get a ``MismatchError`` on every rank, where names derived from the
    lists would leave each rank waiting on a name the others never submit.

    The last ``counts`` members are bookkeeping (which ranks have each gradient, whether local
    gradients are finite), read as shares or as "some rank set it". They travel uncompressed (a
    compressor of your own may be lossy) in the group, except with ``op=Adasum``, whose result is
    no share: then they go in a second group, ``<base>.counts``, summed, submitted before waiting
    on either.

    Raises:
        hvddp.HvddpError: the reduction failed; a mismatch names the variables that differ.
    """
    arrays = [np.asarray(a) for a in arrays]
    split = len(arrays) - counts if op is hvddp.Adasum and counts else len(arrays)
    members = len(arrays) - counts
    compressed, ctxs = [], []
    for i, a in enumerate(arrays[:split]):
        c, ctx = compression.compress(a) if i < members else (a, None)
        compressed.append(c)
        ctxs.append(ctx)
    handles = [hvddp.grouped_allreduce_async(compressed, name=base, op=op, prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor, process_set=process_set)]
    if split < len(arrays):
        handles.append(hvddp.grouped_allreduce_async(arrays[split:], name=f"{base}.counts", op=hvddp.Sum,
                                                     postscale_factor=postscale_factor, process_set=process_set))
    results, mismatch, failure = [], None, None
    for handle in handles:  # wait on every handle, so none is left pending after an error
        try:
            out = handle.wait()
        except hvddp.MismatchError as exc:
            mismatch = mismatch or exc
            continue
        except Exception as exc:  # any other failure: still wait for the rest, then raise it
            failure = failure or exc
            continue
        results.append(out if isinstance(out, list) else [out])  # a one-member group gives a bare array
    if failure is not None and mismatch is None:
        raise failure
    if mismatch is not None and REFUSED in str(mismatch):  # (the refusing ranks compare nothing)
        raise mismatch
    if mismatch is not None:  # on every rank alike: compare the lists to say where
        message = _name_member(str(mismatch), base, labels)
        try:
            # the tensors only: the bookkeeping members' count follows theirs, and counted in
            # they made a 4-variable model "6 tensors" in the message
            check_same_lists(f"{base}.explain", labels[:members], [a.shape for a in arrays[:members]],
                             [a.dtype.name for a in arrays[:members]], process_set)
        except hvddp.MismatchError as detail:
            message = f"{detail} ({message})"
        raise hvddp.MismatchError(message) from None
    out = [np.asarray(compression.decompress(r, ctx) if i < members else r, dtype=a.dtype)
           for i, (r, ctx, a) in enumerate(zip(results[0], ctxs, arrays))]
    if split < len(arrays):
        out += [np.asarray(r, dtype=a.dtype) for r, a in zip(results[1], arrays[split:])]
    return out


def _name_member(message: str, base: str, labels: Sequence[str]) -> str:
    match = re.search(re.escape(base) + r"\.(\d+)", message)
    if match and int(match.group(1)) < len(labels) and "group differs" not in message:
        return f"{message} (member {match.group(1)} is the gradient of {labels[int(match.group(1))]!r})"
    return message


def average_factors(op: Any, gradient_predivide_factor: float, size: int):
    """Return ``(op, prescale, postscale)`` for Average with a gradient pre-division factor."""
    if gradient_predivide_factor == 1.0:
        return op, 1.0, 1.0
    return hvddp.Sum, 1.0 / gradient_predivide_factor, gradient_predivide_factor / size


def check_op(op: Any, average: Optional[bool], fn: str, default: Any = hvddp.Average,
             adasum: bool = False) -> Any:
    """Validate ``op``/``average`` like the core does; return a ``hvddp.ReduceOp``.

    ``adasum``: whether ``fn`` takes ``op=Adasum`` (allreduce, grouped_allreduce, and the
    gradient reductions of ``DistributedGradientTape``/``DistributedOptimizer``).
    """
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
        raise ValueError(f"{fn}: op must be one of hvddp.Average, Sum, Min, Max, Product"
                         f"{', Adasum' if adasum else ''}; Received: op={op!r}.") from None
    if op is hvddp.Adasum and not adasum:
        raise ValueError(f"{fn}: op=Adasum applies to allreduce, grouped_allreduce and the gradients of "
                         f"DistributedGradientTape/DistributedOptimizer only; use Average or Sum here.")
    return op


def check_adasum_size(process_set: Any, fn: str) -> None:
    """Refuse ``op=Adasum`` on a process set whose size is not a power of two (as the core does at
    submission), where the op or the optimizer is made: the size is the same on every rank, so
    every rank raises, before any collective is submitted.

    Raises:
        ValueError: the size is not a power of two.
    """
    from .ops import _check_adasum_size

    _check_adasum_size(process_set.size(), process_set, fn)


def check_process_set(process_set: Any, fn: str) -> Any:
    """Validate ``process_set`` where it is given (a list of ranks or an int failed later, as an
    AttributeError naming neither)."""
    if not isinstance(process_set, hvddp.ProcessSet):
        raise TypeError(f"{fn}: process_set must be an hvddp ProcessSet (hvd.global_process_set, or one "
                        f"from hvd.add_process_set(ranks)); Received: process_set={process_set!r} "
                        f"({type(process_set).__name__}).")
    return process_set


def random_state(variable: Any) -> bool:
    """Whether a Keras variable is a random-number generator's state (the ``SeedGenerator`` of a
    ``Dropout`` layer): replicas keep their own, so that their dropout masks differ as those of
    the samples in one process's batch do, so broadcasts leave it out."""
    name = getattr(variable, "name", None)
    return isinstance(name, str) and name.split(":")[0].rsplit("/", 1)[-1] == "seed_generator_state"


def check_compression(compression: Any, fn: str) -> Any:
    """Validate ``compression`` where it is given, not when the first reduction runs."""
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"{fn}: compression must be hvddp.Compression.none, .fp16 or .bf16 (or have "
                        f"compress/decompress); Received: compression={compression!r}.")
    return compression


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


# The core has no uint16/32/64: broadcasts send their bits as the signed type of the same width.
_SIGNED = {"uint16": np.int16, "uint32": np.int32, "uint64": np.int64}


def wire(array: np.ndarray) -> np.ndarray:
    """``array``, or a view of its bits as a type the core moves (for copies such as broadcast)."""
    signed = _SIGNED.get(array.dtype.name)
    return array if signed is None else array.view(signed)


def unwire(array: Any, dtype: Any) -> np.ndarray:
    """A result of a copy collective on ``wire(x)`` as ``x``'s ``dtype`` again."""
    array = np.asarray(array)
    return array.view(dtype) if np.dtype(dtype).name in _SIGNED else np.asarray(array, dtype=dtype)
