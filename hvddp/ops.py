"""Public numpy-level collectives: validate, name, enqueue, return a handle.

Every collective is identified by a name. Ranks must submit the same names with matching
parameters (dtype, shape, op, ...), in any order; a disagreement raises ``MismatchError`` on every
rank. Names default to a per-process counter per kind (``allreduce.noname.3``), which matches
across ranks when every rank makes the same unnamed calls in the same order. Synchronous forms
block until the result is ready; ``_async`` forms return a ``Handle`` at once; forms ending in
``_`` write the result into their input. In a size-1 run every collective is a local copy (or
no copy) with the same scaling rules.
"""

from __future__ import annotations

import hashlib
import numbers
import pickle
import sys
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ._dtypes import bfloat16
from .backends import device as _device  # protocol checks only; imports no CuPy
from .engine.executor import Entry
from .engine.messages import Kind, ReduceOp, Request
from .handles import Handle
from . import runtime
from .runtime import ProcessSet, _state, global_process_set

_monotonic = time.monotonic

__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "join", "broadcast_object", "allgather_object",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

SUPPORTED_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                    "float32", "float64", "bool")
# dtype -> name; numpy's dtype.name is slow enough to matter on the submission path.
ADASUM_DTYPES = ("float16", "bfloat16", "float32", "float64")
_DTYPE_NAMES = {np.dtype(n): n for n in SUPPORTED_DTYPES if n != "bfloat16"}


def _learn_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16, which then joins ``_DTYPE_NAMES`` (not imported
    up front: see hvddp._dtypes)."""
    if dtype.name != "bfloat16" or "ml_dtypes" not in sys.modules or dtype != bfloat16():
        return False
    _DTYPE_NAMES[dtype] = "bfloat16"
    return True


def _auto_name(kind: str, process_set: ProcessSet) -> str:
    """The next name for an unnamed call of ``kind`` on ``process_set``, counted per set (and
    per ``init()``): calls that only a set's members make must not shift the names of calls on
    other sets. Taken once the process set is known to be valid, before the call's other
    arguments are checked: a call refused for those takes its name and announces the refusal
    (``_refusing``), as the ranks that made it validly took theirs."""
    ps_id = process_set.process_set_id
    return runtime._state().auto_names.take(f"{kind}.noname." if ps_id == 0 else f"{kind}.ps{ps_id}.noname.")


def _check_name(name: Any, fn: str) -> Optional[str]:
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"{fn}: name must be a str or None, got {type(name).__name__} {name!r}.")
    # '' is no name, as in Horovod (its names are '<op>.noname.<n>' when empty): refusing it on
    # one rank left the peers, whose call was unnamed, waiting on it
    return name or None


class Refusal:
    """For adapters: what to pass in place of a tensor that the adapter's own checks refused,
    before the core saw the call. The core raises ``error`` where it checks the tensors, after
    taking the call's name, so the refusal is announced to the other ranks (see ``_refusing``)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def announce_refusal(core_fn: Callable, error: BaseException, group: Any = None, **kwargs: Any) -> None:
    """For adapters: announce ``error``, raised by the adapter's own checks of a call, through
    ``core_fn`` (the core collective the call would have made, with the call's ``name``,
    ``process_set``, ... in ``kwargs``), so the ranks that made the call validly fail with
    ``MismatchError`` instead of waiting. ``group``: a grouped call's tensors as given (one
    ``Refusal`` per entry; one for a "list" that is none, so its group fails); None otherwise.
    What the core raises (the refusal itself, or an error in the other arguments) is dropped: the
    caller raises ``error``."""
    refusal = Refusal(error)
    if group is None:
        tensors: Any = refusal
    else:
        tensors = [refusal] * len(group) if isinstance(group, (list, tuple)) and group else [refusal]
    try:
        core_fn(tensors, **kwargs)
    except Exception:
        pass


def _array(tensor: Any, fn: str, arg: str = "tensor") -> np.ndarray:
    if type(tensor) is np.ndarray:
        array = tensor
    elif type(tensor) is Refusal:
        raise tensor.error
    elif isinstance(tensor, _device.DeviceInput):  # checked already (alltoall, reducescatter)
        return tensor
    elif _device.is_device_array(tensor) or isinstance(tensor, _device.Labeled):
        try:  # a CUDA tensor (CuPy, or torch/JAX/... through DLPack): viewed, not copied
            return _device.describe(tensor)
        except TypeError as exc:
            raise TypeError(f"{fn}: {arg}: {exc}") from None
    elif isinstance(tensor, np.ndarray):  # a subclass (np.matrix, from scipy's todense()): its own
        array = tensor.view(np.ndarray)  # reshape(-1) stays 2-D, and pieces of it were whole rows
    elif isinstance(tensor, (np.generic, numbers.Number)) and not isinstance(tensor, (str, bytes)):
        array = np.asarray(tensor)
    else:
        raise TypeError(f"{fn}: {arg} must be a numpy array, got {type(tensor).__name__}. For torch "
                        f"or Keras tensors use hvddp.torch / hvddp.keras; convert lists with np.asarray.")
    if array.dtype not in _DTYPE_NAMES and not _learn_bfloat16(array.dtype):
        if not array.dtype.isnative and array.dtype.newbyteorder("=") in _DTYPE_NAMES:
            raise TypeError(f"{fn}: {arg} has dtype {array.dtype.str}, {array.dtype.name} in non-native "
                            f"byte order, which hvddp does not reduce or send; convert it first with "
                            f".astype({array.dtype.name!r}).")
        raise TypeError(f"{fn}: {arg} has dtype {array.dtype}, which hvddp does not support; "
                        f"supported: {', '.join(SUPPORTED_DTYPES)}. Cast it first (e.g. .astype(np.float32)).")
    return array


def _process_set(process_set: Any, fn: str):
    state = _state()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{fn}: process_set must be an hvddp.ProcessSet, got {type(process_set).__name__}.")
    if process_set.process_set_id is None or process_set.process_set_id not in state.process_sets:
        raise ValueError(f"{fn}: {process_set!r} is not registered; {process_set._how_to_register()}.")
    view = state.process_sets[process_set.process_set_id]
    if view.rank < 0:
        raise ValueError(f"{fn}: this rank ({state.rank}) is not a member of {process_set!r}; only its "
                         f"members may call collectives on it.")
    return state, view


def _op(op: Any, average: Any, fn: str, default: ReduceOp = Average,
        adasum: bool = False) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError(f"{fn}: pass either op= or the legacy average=, not both "
                             f"(got op={op!r}, average={average!r}).")
        return Average if average else Sum
    if op is None:
        return default
    ops = f"hvddp.Average, Sum, Min, Max, Product{', Adasum' if adasum else ''}"
    if isinstance(op, bool) or not isinstance(op, (int, ReduceOp)):
        raise ValueError(f"{fn}: op must be one of {ops}; got {op!r}.")
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"{fn}: op must be one of {ops}; got {op!r}.") from None
    if op is ReduceOp.ADASUM and not adasum:
        raise ValueError(f"{fn}: op=Adasum applies to allreduce and grouped_allreduce only; use "
                         f"Average or Sum here.")
    return op


def _check_adasum_size(size: int, process_set: ProcessSet, fn: str) -> None:
    """Adasum pairs ranks level by level (1 with 2, pairs with pairs, ...), as Horovod's does:
    the set's size must be a power of two. The same on every member, so every member raises."""
    if size & (size - 1):
        raise ValueError(f"{fn}: op=Adasum needs a process set whose size is a power of two (as in "
                         f"Horovod); {process_set!r} has {size} ranks. Launch 1, 2, 4, 8, ... ranks, "
                         f"or use Average.")


def _is_one(value: Any) -> bool:
    """Whether a scale factor is the number 1 (types first: ``==`` on an array is an array)."""
    return isinstance(value, (float, int)) and not isinstance(value, bool) and value == 1.0


def _factor(value: Any, fn: str, arg: str) -> float:
    if _is_one(value):
        return 1.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {arg} must be a real number, got {type(value).__name__} {value!r}. Pass "
                        f"one float (such as 1.0 / hvddp.size()).")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{fn}: {arg} must be finite, got an integer too large for a float.") from None
    if not np.isfinite(value):
        raise ValueError(f"{fn}: {arg} must be finite, got {value!r}.")
    return value


def _check_reduce(array: np.ndarray, op: ReduceOp, fn: str, arg: str = "tensor",
                  pre: float = 1.0, post: float = 1.0) -> None:
    if op is ReduceOp.ADASUM:
        dtype = array.dtype_name if isinstance(array, _device.DeviceInput) else _DTYPE_NAMES[array.dtype]
        if dtype not in ADASUM_DTYPES:
            raise ValueError(f"{fn}: {arg} has dtype {dtype}; op=Adasum combines floating-point tensors "
                             f"only ({', '.join(ADASUM_DTYPES)}). Cast it first.")
        return
    if array.dtype.kind == "b":
        if op not in (Min, Max):
            raise ValueError(f"{fn}: {arg} is bool, which reduces only with op=Min (logical and) or "
                             f"op=Max (logical or); got op={op!r}. Cast to an integer dtype to count.")
        if pre != 1.0 or post != 1.0:
            raise ValueError(f"{fn}: {arg} is bool; prescale_factor and postscale_factor must be 1 "
                             f"for bool, got {pre!r} and {post!r}.")


def _entry(kind: Kind, array: np.ndarray, name: str, view, handle: Handle, index: int,
           inplace: bool = False, **fields) -> Entry:
    if isinstance(array, _device.DeviceInput):
        return _device_entry(kind, array, name, view, handle, index, inplace, **fields)
    contiguous = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    writeback = None
    output = None
    if inplace:  # (writable: _check_inplace ran before the call took its name)
        output = contiguous
        if contiguous is not array:
            writeback = array
    request = Request(kind, view.owner.process_set_id, name, _DTYPE_NAMES[array.dtype], array.shape,
                      **fields)
    return Entry(request, contiguous, output, handle, index, time.monotonic(), writeback)


def _device_entry(kind: Kind, dev, name: str, view, handle: Handle, index: int, inplace: bool,
                  **fields) -> Entry:
    """The entry of a device tensor: contiguous on the device, ready after its producer's work."""
    array = dev.array
    contiguous = array if array.flags.c_contiguous else _device.import_cupy().ascontiguousarray(array)
    output = writeback = None
    if inplace:
        output = contiguous
        if contiguous is not array:
            writeback = array
    request = Request(kind, view.owner.process_set_id, name, dev.dtype_name, tuple(array.shape),
                      device=_device.DEVICE_KIND, **fields)
    entry = Entry(request, contiguous, output, handle, index, time.monotonic(), writeback)
    # recorded on CuPy's current stream: after the producer's writes (DLPack orders the producer's
    # stream before it) and after the contiguous copy, if one was made
    entry.ready = _device.ready_event(contiguous)
    return entry


def _group_id(names: Sequence[str], ps_id: int) -> str:
    """A group's key in the engine: its members' names and its process set (the same names may
    form a group on two sets at once, as two data-parallel groups' optimizers do)."""
    return hashlib.blake2b(f"{ps_id}\x00".encode() + "\x00".join(names).encode(), digest_size=8).hexdigest()


class _refusing:
    """``with _refusing(state, view, kind, names):`` around the checks of a call's own arguments
    (tensors, dtypes, op, factors, root, splits), once its names are known. When they raise
    (``TypeError``, ``ValueError``, anything), this rank announces the refusal under those names
    and the error propagates: a rank that made the call validly then fails with ``MismatchError``
    naming this rank and the reason, instead of waiting for it forever."""

    __slots__ = ("state", "view", "kind", "names")

    def __init__(self, state, view, kind: Kind, names: Sequence[str]) -> None:
        self.state, self.view, self.kind, self.names = state, view, kind, names

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, Exception) and self.names:
            ps_id = self.view.owner.process_set_id
            names = self.names
            group = (_group_id(names, ps_id), len(names)) if len(names) > 1 else None
            why = f"{exc_type.__name__}: {exc}"
            handle = Handle(names[0], parts=len(names))
            now = time.monotonic()
            entries = [Entry(Request(self.kind, ps_id, n, "", (), group=group, refused=why), None, None,
                             handle, i, now) for i, n in enumerate(names)]
            _group_keys(entries)
            self.state.engine.submit_refused(entries)
        return False


def _group_keys(entries: List[Entry]) -> None:
    if len(entries) > 1:
        keys = tuple(e.key for e in entries)
        for e in entries:
            e.group_keys = keys


def _submit(state, entries: List[Entry]) -> None:
    _group_keys(entries)
    state.engine.submit(entries)


def _check_inplace(fn: str, arg: str, tensor: Any, array: Any) -> None:
    """An in-place collective writes its result into ``tensor``: a writable numpy array (or a
    device tensor). Checked before the call takes an automatic name."""
    if hasattr(array, "dtype_name"):  # a device tensor
        return
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"{fn}: {arg} must be a writable numpy array for an in-place collective, "
                        f"got {type(tensor).__name__}; use the out-of-place form.")
    if not tensor.flags.writeable:
        raise ValueError(f"{fn}: {arg} is read-only; in-place collectives need a writable array "
                         f"(use the out-of-place form).")


# allreduce --------------------------------------------------------------------------------
def _allreduce_one(tensor: Any, name: Optional[str], process_set: ProcessSet, inplace: bool,
                   op: int) -> Optional[Handle]:
    """The common case (one contiguous numpy array, default op and factors) in few steps.

    Returns None when anything is unusual; the general path then validates and explains.
    """
    state = runtime._S
    if state is None or type(tensor) is not np.ndarray or not (name is None or type(name) is str and name):
        return None
    view = state.process_sets.get(process_set.process_set_id)
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    flags = tensor.flags
    if view is None or view.rank < 0 or dtype_name is None or dtype_name == "bool" or \
            not flags.c_contiguous or (inplace and not flags.writeable):
        return None
    if name is None:  # only now: a counter consumed here must not be consumed again
        name = _auto_name("allreduce", process_set)
    handle = Handle(name, 1, tensor)
    request = Request(Kind.ALLREDUCE, process_set.process_set_id, name, dtype_name, tensor.shape, op)
    state.engine.submit_one(Entry(request, tensor, tensor if inplace else None, handle, 0, _monotonic()))
    return handle


def _member_names(fn: str, base: Optional[str], names: Optional[Sequence[str]], count: int,
                  kind: str, process_set: ProcessSet) -> Tuple[str, List[str]]:
    """Names of a group's members: ``names`` when given, else ``<base>.<i>``."""
    if names is not None:
        if isinstance(names, str) or len(names) != count:
            raise ValueError(f"{fn}: names must be a list of {count} strings (one per tensor), got {names!r}.")
        for i, n in enumerate(names):
            if not isinstance(n, str) or not n:
                raise TypeError(f"{fn}: names[{i}] must be a non-empty str, got {type(n).__name__} {n!r}.")
        if len(set(names)) != len(names):
            raise ValueError(f"{fn}: names must be distinct (one per tensor), got {list(names)!r}.")
        names = list(names)
        return base or names[0], names
    if not count:  # an empty group takes no automatic name: nothing of it reaches the engine,
        return base or kind, []  # so a joined rank would never count it
    base = base or _auto_name(kind, process_set)
    return base, [f"{base}.{i}" for i in range(count)]


def _allreduce(fn: str, tensors: Sequence[Any], average, name, op, prescale_factor, postscale_factor,
               process_set, inplace: bool, grouped: bool, names: Optional[Sequence[str]] = None) -> Handle:
    if not grouped and average is None and (op is None or type(op) is ReduceOp and op is not Adasum) \
            and _is_one(prescale_factor) and _is_one(postscale_factor) and type(process_set) is ProcessSet:
        handle = _allreduce_one(tensors[0], name, process_set, inplace, int(op or 0))
        if handle is not None:
            return handle
    state, view = _process_set(process_set, fn)
    name = _check_name(name, fn)
    if grouped:
        if not _is_list(tensors) and _is_list(names):
            names = names[:1]
        try:
            base, names = _member_names(fn, name, names, _members(tensors), "grouped_allreduce", process_set)
        except (TypeError, ValueError):
            # refused under the names that are usable, which ranks that made the call validly
            # may wait on (the group fails whole there); None usable: nothing to announce
            usable = list(dict.fromkeys(n for n in names if isinstance(n, str) and n)) \
                if isinstance(names, (list, tuple)) else []
            with _refusing(state, view, Kind.ALLREDUCE, usable):
                raise
    else:
        names = [name or _auto_name("allreduce", process_set)]
    with _refusing(state, view, Kind.ALLREDUCE, names):
        if grouped:
            tensors = _seq(tensors, fn)
        op = _op(op, average, fn, adasum=True)
        if op is ReduceOp.ADASUM:
            _check_adasum_size(view.size, process_set, fn)
        pre = _factor(prescale_factor, fn, "prescale_factor")
        post = _factor(postscale_factor, fn, "postscale_factor")
        arrays = [_array(t, fn, f"tensors[{i}]" if grouped else "tensor") for i, t in enumerate(tensors)]
        for i, (a, t) in enumerate(zip(arrays, tensors)):
            arg = f"tensors[{i}]" if grouped else "tensor"
            _check_reduce(a, op, fn, arg, pre, post)
            if inplace:
                _check_inplace(fn, arg, t, a)
    handle = Handle(base if grouped else names[0], parts=len(arrays), keep=tensors, grouped=grouped)
    group = (_group_id(names, view.owner.process_set_id), len(names)) if grouped and len(names) > 1 else None
    entries = [_entry(Kind.ALLREDUCE, a, n, view, handle, i, inplace, op=int(op), prescale=pre,
                      postscale=post, group=group) for i, (a, n) in enumerate(zip(arrays, names))]
    if not entries:
        handle._set_now([])
        return handle
    _submit(state, entries)
    return handle


def allreduce_async(tensor: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` across ranks; return a handle whose result is a new array.

    Every member of ``process_set`` must submit ``name`` with the same dtype, shape, op and
    scale factors. The result is ``postscale * op(prescale * tensor_r for each rank r)``, with
    Average dividing the sum by the set's size (integers truncate toward zero). float16 and
    bfloat16 are reduced in float32 and rounded once at the end. ``tensor`` is not modified.

    Args:
        tensor: a numpy array of a supported dtype (bool only with Min/Max).
        average: legacy flag; True means ``op=Average``, False ``op=Sum``.
        name: the name that matches this call across ranks; automatic when None.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, or ``Adasum`` (float
            tensors on a power-of-two process set; see ``hvddp.backends.adasum``).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part; every rank by default.

    Returns:
        A ``Handle``; ``synchronize(handle)`` returns the reduced array.

    Raises:
        TypeError, ValueError: a bad argument (named in the message), or ``name`` already pending.
    """
    return _allreduce("allreduce", [tensor], average, name, op, prescale_factor, postscale_factor,
                      process_set, False, False)


def allreduce(tensor: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None,
              op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``tensor`` across ranks and return the result; blocks. See ``allreduce_async``."""
    return allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def allreduce_async_(tensor: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` in place (it must be writable); the handle's result is ``tensor``."""
    return _allreduce("allreduce_", [tensor], average, name, op, prescale_factor, postscale_factor,
                      process_set, True, False)


def allreduce_(tensor: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``tensor`` in place across ranks and return it; blocks."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def grouped_allreduce_async(tensors: Sequence[np.ndarray], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            names: Optional[Sequence[str]] = None) -> Handle:
    """Start reducing a list of arrays as one atomic group (they complete together).

    Members are named ``<name>.<i>``, or by ``names`` (one per tensor, e.g. parameter names,
    which then appear in errors). Same contract as ``allreduce_async`` for each member; the
    handle's result is the list of reduced arrays.
    """
    return _allreduce("grouped_allreduce", tensors, average, name, op,
                      prescale_factor, postscale_factor, process_set, False, True, names)


def grouped_allreduce(tensors: Sequence[np.ndarray], average: Optional[bool] = None,
                      name: Optional[str] = None, op: Optional[ReduceOp] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      names: Optional[Sequence[str]] = None) -> List[np.ndarray]:
    """Reduce a list of arrays as one group and return the results; blocks."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                   process_set, names).wait()


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set,
                             names: Optional[Sequence[str]] = None) -> Handle:
    """Start reducing a list of arrays in place as one group."""
    return _allreduce("grouped_allreduce_", tensors, average, name, op,
                      prescale_factor, postscale_factor, process_set, True, True, names)


def grouped_allreduce_(tensors: Sequence[np.ndarray], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[ReduceOp] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       names: Optional[Sequence[str]] = None) -> List[np.ndarray]:
    """Reduce a list of arrays in place as one group; blocks."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set, names).wait()


def _is_list(tensors: Any) -> bool:
    return isinstance(tensors, (list, tuple))


def _members(tensors: Any) -> int:
    """How many names a grouped call takes: one per tensor, or one for a call refused because
    ``tensors`` is no list (announced under the first member's name: its group then fails)."""
    return len(tensors) if _is_list(tensors) else 1


def _seq(tensors: Any, fn: str) -> list:
    if not _is_list(tensors):
        raise TypeError(f"{fn}: tensors must be a list or tuple of arrays, got {type(tensors).__name__}.")
    return list(tensors)


# allgather --------------------------------------------------------------------------------
def _gather_like(kind: Kind, fn: str, tensors: Sequence[Any], name, process_set, grouped: bool,
                 finish: Optional[Callable] = None, check: Optional[Callable] = None, **fields) -> Handle:
    """allgather, alltoall and reducescatter: ``check(arrays, view)`` checks the kind's own
    arguments and returns the arrays to send and the request's fields."""
    state, view = _process_set(process_set, fn)
    name = _check_name(name, fn)
    auto = f"grouped_{kind.value}" if grouped else kind.value
    if grouped and not _members(tensors):  # (empty: no automatic name, as in _member_names)
        base = name or auto
    else:
        base = name or _auto_name(auto, process_set)
    names = [f"{base}.{i}" for i in range(_members(tensors))] if grouped else [base]
    with _refusing(state, view, kind, names):
        if grouped:
            tensors = _seq(tensors, fn)
        arrays = [_array(t, fn, f"tensors[{i}]" if grouped else "tensor") for i, t in enumerate(tensors)]
        for i, a in enumerate(arrays):
            if a.ndim == 0:
                raise ValueError(f"{fn}: {'tensors[%d]' % i if grouped else 'tensor'} is 0-d; {kind.value} "
                                 f"works on the first dimension, so pass at least a 1-d array "
                                 f"(e.g. x.reshape(1)).")
        if check is not None:
            arrays, more = check(arrays, view)
            fields.update(more)
    handle = Handle(base, parts=len(arrays), keep=tensors, finish=finish, grouped=grouped)
    group = (_group_id(names, view.owner.process_set_id), len(names)) if grouped and len(names) > 1 else None
    entries = [_entry(kind, a, n, view, handle, i, group=group, **fields)
               for i, (a, n) in enumerate(zip(arrays, names))]
    if not entries:
        handle._set_now([])
        return handle
    _submit(state, entries)
    return handle


def allgather_async(tensor: np.ndarray, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along the first dimension (in rank order).

    The first dimension may differ across ranks; dtype and the other dimensions must match.
    """
    return _gather_like(Kind.ALLGATHER, "allgather", [tensor], name, process_set, False)


def allgather(tensor: np.ndarray, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along the first dimension; blocks."""
    return allgather_async(tensor, name, process_set).wait()


def grouped_allgather_async(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start allgathering a list of arrays as one group; the result is a list."""
    return _gather_like(Kind.ALLGATHER, "grouped_allgather", tensors,
                        name, process_set, True)


def grouped_allgather(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Allgather a list of arrays as one group; blocks."""
    return grouped_allgather_async(tensors, name, process_set).wait()


# broadcast --------------------------------------------------------------------------------
def _root(fn: str, root_rank, view, process_set) -> int:
    """The set's own index of ``root_rank``, a global rank (``hvddp.rank()``'s numbering, as in
    Horovod) that must be a member of the set; checked, for ``fn``'s errors."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"{fn}: root_rank must be an int, got {type(root_rank).__name__} {root_rank!r}.")
    root_rank = int(root_rank)
    if root_rank not in view.ranks:
        members = f"one of its members {list(view.ranks)}" if process_set is not global_process_set \
            else f"in [0, {view.size})"
        raise ValueError(f"{fn}: root_rank is a global rank (as hvddp.rank() numbers them) and must be "
                         f"{members} for {process_set!r}, got {root_rank}.")
    return view.ranks.index(root_rank)


def _broadcast(fn: str, tensor, root_rank, name, process_set, inplace: bool) -> Handle:
    state, view = _process_set(process_set, fn)
    name = _check_name(name, fn) or _auto_name("broadcast", process_set)
    with _refusing(state, view, Kind.BROADCAST, [name]):
        root_rank = _root(fn, root_rank, view, process_set)
        array = _array(tensor, fn)
        if inplace:
            _check_inplace(fn, "tensor", tensor, array)
    handle = Handle(name, keep=tensor)
    _submit(state, [_entry(Kind.BROADCAST, array, name, view, handle, 0, inplace, root=root_rank)])
    return handle


def broadcast_async(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank; the result is a new array.

    ``root_rank`` is a global rank (``hvddp.rank()``), a member of ``process_set``, as in
    Horovod. Shape and dtype must match on every rank.
    """
    return _broadcast("broadcast", tensor, root_rank, name, process_set, False)


def broadcast(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return ``root_rank``'s ``tensor`` on every rank; blocks."""
    return broadcast_async(tensor, root_rank, name, process_set).wait()


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place."""
    return _broadcast("broadcast_", tensor, root_rank, name, process_set, True)


def broadcast_(tensor: np.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Overwrite ``tensor`` with ``root_rank``'s values in place; blocks."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# alltoall ---------------------------------------------------------------------------------
def alltoall_async(tensor: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start scattering slices of ``tensor``'s first dimension to every rank and gathering theirs.

    ``splits[i]`` rows go to rank ``i``, from the top; rows past ``sum(splits)`` are not sent
    (as in Horovod: a buffer padded to a capacity sends only its filled rows). With no splits
    (None or empty, as Horovod reads an empty list) the first dimension is split evenly and
    must divide by the set's size. The handle's result is ``(output, received_splits)``.
    """
    return _gather_like(Kind.ALLTOALL, "alltoall", [tensor], name, process_set, False,
                        check=lambda arrays, view: _alltoall_splits(arrays[0], splits, view, name))


def _alltoall_splits(array, splits, view, name=None):
    """alltoall's rows to send (the first ``sum(splits)``) and its ``splits`` field, checked."""
    fn = f"alltoall {name!r}" if isinstance(name, str) and name else "alltoall"
    rows = array.shape[0]
    if splits is not None and not isinstance(splits, (str, bytes)) and np.size(splits) == 0:
        splits = None
    if splits is None:
        if rows % view.size:
            raise ValueError(f"{fn}: tensor's first dimension ({rows}) does not divide by the number of "
                             f"ranks ({view.size}); pass splits= to send uneven slices.")
        splits = [rows // view.size] * view.size
    else:
        splits = np.asarray(splits).reshape(-1) if not isinstance(splits, (list, tuple)) else list(splits)
        if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in splits):
            raise TypeError(f"{fn}: splits must be integers, got {list(splits)!r}.")
        splits = [int(s) for s in splits]
        if len(splits) != view.size or any(s < 0 for s in splits) or sum(splits) > rows:
            raise ValueError(f"{fn}: splits must be {view.size} non-negative integers (one per rank of the "
                             f"set) summing to at most the first dimension ({rows}), got {splits!r}.")
        if sum(splits) < rows:  # (a device tensor's DeviceInput is a tuple: slice its array)
            array = array._replace(array=array.array[:sum(splits)]) \
                if isinstance(array, _device.DeviceInput) else array[:sum(splits)]
    return [array], {"splits": tuple(splits)}


def alltoall(tensor: np.ndarray, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Exchange slices of ``tensor`` with every rank; blocks.

    Returns:
        The received array; with ``splits`` given, ``(output, received_splits)``.
    """
    output, received = alltoall_async(tensor, splits, name, process_set).wait()
    return output if splits is None else (output, received)


# reducescatter ----------------------------------------------------------------------------
def _reducescatter(fn, tensors, name, op, process_set, prescale_factor, postscale_factor, grouped):
    def check(arrays, view):
        op_ = _op(op, None, fn)
        pre = _factor(prescale_factor, fn, "prescale_factor")
        post = _factor(postscale_factor, fn, "postscale_factor")
        for i, a in enumerate(arrays):
            _check_reduce(a, op_, fn, f"tensors[{i}]" if grouped else "tensor", pre, post)
        return arrays, {"op": int(op_), "prescale": pre, "postscale": post}

    return _gather_like(Kind.REDUCESCATTER, fn, tensors, name, process_set, grouped, check=check)


def reducescatter_async(tensor: np.ndarray, name: Optional[str] = None, op: Optional[ReduceOp] = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` across ranks and keeping this rank's slice of the first dimension.

    Rows are split as evenly as possible, the first ``rows % size`` ranks getting one more.
    ``op`` defaults to Average. Shape must match on every rank.
    """
    return _reducescatter("reducescatter", [tensor], name, op, process_set, prescale_factor,
                          postscale_factor, False)


def reducescatter(tensor: np.ndarray, name: Optional[str] = None, op: Optional[ReduceOp] = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``tensor`` across ranks and return this rank's slice; blocks."""
    return reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor).wait()


def grouped_reducescatter_async(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                                op: Optional[ReduceOp] = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each array in a list, as one group."""
    return _reducescatter("grouped_reducescatter", tensors, name, op,
                          process_set, prescale_factor, postscale_factor, True)


def grouped_reducescatter(tensors: Sequence[np.ndarray], name: Optional[str] = None,
                          op: Optional[ReduceOp] = None, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> List[np.ndarray]:
    """Reducescatter each array in a list, as one group; blocks."""
    return grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                       postscale_factor).wait()


# barrier, join, objects -------------------------------------------------------------------
def _control(kind: Kind, name: str, process_set: ProcessSet, fn: str, extra=None) -> Handle:
    state, view = _process_set(process_set, fn)
    handle = Handle(name)
    request = Request(kind, view.owner.process_set_id, name, "", (), extra=extra)
    _submit(state, [Entry(request, None, None, handle, 0, time.monotonic())])
    return handle


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of ``process_set`` has called ``barrier``."""
    _process_set(process_set, "barrier")  # first: a refused call must not take a name
    _control(Kind.BARRIER, _auto_name("barrier", process_set), process_set, "barrier").wait()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; return the last rank to join.

    Until every rank has joined, this rank takes part in other ranks' allreduces with each
    op's identity (zeros for Sum and Average, which still divides by the full size; the largest
    value for Min, the smallest for Max, one for Product), so ranks with uneven amounts of data
    can finish their epochs. allgather, broadcast, alltoall and reducescatter raise on every rank
    that makes them while some rank has joined without making them first (the joined ranks go on
    waiting here). ``device``
    is accepted for Horovod compatibility and ignored.

    First, every object registered in ``_before_join`` (an adapter's optimizer between
    ``backward()`` and ``step()``) sends the reductions its current step still owes: the other
    ranks' matching calls are being made now, and the ones this rank made after joining would
    meet their next step's instead.
    """
    for owner in list(_before_join):
        owner._hvddp_before_join()
    return _control(Kind.JOIN, "__join__", global_process_set, "join").wait()


# objects with a ``_hvddp_before_join()`` that join() calls first (see join); held weakly
_before_join: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _process_set_call(what: str, check: Callable[[], Any]):
    """The start of ``add_process_set``/``remove_process_set``: the call's name, then ``check()``
    (its own argument checks); returns ``(state, name, check())``. A rank whose check raises
    announces the refusal under that name, so the others raise too instead of pairing it with
    this rank's next add or remove."""
    state, view = _process_set(global_process_set, f"{what}_process_set")
    # adds and removes count together: an add on one rank meets a remove on another and both
    # raise (with a counter each, their names never met, and both waited for ever)
    name = _auto_name("__process_set_change", global_process_set)
    kind = Kind.ADD_PROCESS_SET if what == "add" else Kind.REMOVE_PROCESS_SET
    with _refusing(state, view, kind, [name]):
        result = check()
    return state, name, result


def _process_set_op(what: str, ps: ProcessSet, state, name: Optional[str] = None):
    name = name or _auto_name("__process_set_change", global_process_set)
    if what == "add":
        state.pending_process_sets[name] = ps
        handle = _control(Kind.ADD_PROCESS_SET, name, global_process_set, "add_process_set",
                          extra=tuple(ps.ranks))
        try:
            return handle.wait()
        finally:  # (registered: already taken; refused, say by a mismatch: not kept)
            state.pending_process_sets.pop(name, None)
    else:
        handle = _control(Kind.REMOVE_PROCESS_SET, name, global_process_set, "remove_process_set",
                          extra=(ps.process_set_id,))
    return handle.wait()


def _pickled(obj: Any):
    """(the pickled bytes as uint8, None), or (None, the exception) when ``obj`` cannot be pickled."""
    try:
        return np.frombuffer(_dumps(obj), dtype=np.uint8), None
    except Exception as exc:  # pickling runs user code (__reduce__): any error is this rank's
        return None, exc


def _dumps(obj: Any) -> bytes:
    """``cloudpickle`` where it is installed (as Horovod: lambdas and local functions travel too),
    else ``pickle``; ``pickle.loads`` reads both."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (two broadcasts: size, bytes)."""
    name = _check_name(name, "broadcast_object")
    state, view = _process_set(process_set, "broadcast_object")
    name = name or _auto_name("broadcast_object", process_set)
    with _refusing(state, view, Kind.BROADCAST, [f"{name}.size"]):
        is_root = view.rank == _root("broadcast_object", root_rank, view, process_set)
    data, failure = _pickled(obj) if is_root else (None, None)
    length = np.array([data.size if data is not None else -1], dtype=np.int64)
    length = broadcast(length, root_rank, f"{name}.size", process_set)
    if int(length[0]) < 0:  # the root could not pickle it: every rank raises, none waits
        why = f" ({type(failure).__name__}: {failure})" if failure is not None else ""
        raise TypeError(f"broadcast_object: rank {root_rank} could not pickle its object{why}; send only "
                        f"picklable values (no locks, open files or sockets).") from failure
    buf = data if is_root else np.zeros(int(length[0]), dtype=np.uint8)
    buf = broadcast(buf, root_rank, f"{name}.data", process_set)
    return _unpickled_together(lambda: obj if is_root else pickle.loads(buf.tobytes()), name, process_set,
                               "broadcast_object")


def _world_ranks(process_set: ProcessSet, positions: List[int]) -> List[int]:
    """The ranks (``hvddp.rank()``, as errors name them everywhere) at ``positions`` in the set."""
    ranks = process_set.ranks
    return [ranks[i] for i in positions] if ranks is not None else positions


def _unpickled_together(load: Callable[[], Any], name: str, process_set: ProcessSet, fn: str) -> Any:
    """``load()`` (unpickling what arrived), agreed by every rank of the set: a rank that cannot
    (a class that exists only on the sender, a ``__reduce__`` that fails) raises, and so does
    every other, naming it, instead of returning while that one rank alone fails."""
    try:
        value, failure = load(), None
    except Exception as exc:  # whatever the object's own code raised
        value, failure = None, exc
    ok = allgather(np.array([failure is None], dtype=np.uint8), f"{name}.ok", process_set)
    bad = _world_ranks(process_set, [i for i, flag in enumerate(ok.tolist()) if not flag])
    if bad:
        why = f" (here: {type(failure).__name__}: {failure})" if failure is not None else ""
        raise TypeError(f"{fn}: rank(s) {bad} could not unpickle the object they "
                        f"received{why}; send values every rank can rebuild (classes importable on "
                        f"every rank, the same library versions).") from failure
    return value


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    name = _check_name(name, "allgather_object")
    _process_set(process_set, "allgather_object")
    name = name or _auto_name("allgather_object", process_set)
    data, failure = _pickled(obj)
    sizes = allgather(np.array([data.size if data is not None else -1], dtype=np.int64), f"{name}.size",
                      process_set)
    if (sizes < 0).any():  # some rank could not pickle its object: every rank raises, none waits
        bad = _world_ranks(process_set, [i for i, n in enumerate(sizes.tolist()) if n < 0])
        why = f" (here: {type(failure).__name__}: {failure})" if failure is not None else ""
        raise TypeError(f"allgather_object: rank(s) {bad} could not pickle their "
                        f"object{why}; send only picklable values (no locks, open files or sockets).") from failure
    gathered = allgather(data, f"{name}.data", process_set)

    def load() -> List[Any]:
        out, offset = [], 0
        for n in sizes.tolist():
            out.append(pickle.loads(gathered[offset:offset + n].tobytes()))
            offset += n
        return out

    return _unpickled_together(load, name, process_set, "allgather_object")
