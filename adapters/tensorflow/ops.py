"""hvddp collectives as TensorFlow ops, usable eagerly and inside ``tf.function``.

Each op runs the numpy-level core through ``tf.numpy_function`` (stateful, so inside a
``tf.function`` TensorFlow keeps the collectives in program order). All the ops have gradients
(the matching collective runs backward, as in Horovod). The ops cannot run inside
XLA-compiled functions (``jit_compile=True``); they raise a ``ValueError`` that says so.

Signatures follow Horovod 0.28's, positional order included; ``ignore_name_scope`` and the
``device_*`` arguments are accepted and ignored (hvddp names ops as below, not by name scope).

Names: every collective matches across ranks by name. Without ``name=``, an eager call takes
the next value of a per-process counter (so ranks must make the same unnamed calls in the same
order) and a call inside ``tf.function`` gets a name fixed when the function is traced (the
function's name plus a counter within its graph), so it is the same on every run.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

import hvddp
from hvddp import Compression, ProcessSet, global_process_set

from hvddp import _grouping, _staged
from hvddp.ops import SUPPORTED_DTYPES, _factor

from .compression import numpy_side

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter", "join"]

_graph_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # outermost graph -> counters


def _auto_name(kind: str, process_set: ProcessSet) -> str:
    """The name of an unnamed collective: the same on every rank that runs the same program.

    Counted per process set (calls only a set's members make must not shift other sets' names).
    Eagerly, by one counter per process; in a traced function, by a counter of the innermost
    ``tf.function`` being traced (out of loop and branch bodies, not out of a nested function),
    under that function's name. Not by TensorFlow's own names: a loop or branch body is named
    with a process-wide counter, and name scopes carry Keras layer names, so both differ on a
    rank that traced or built one more thing than the others. Not by the outermost function's:
    a nested function's trace is cached apart from its caller, so a rank that first traced it
    alone (or inside another function) would reuse names its peers never submit.
    """
    tag = kind if process_set is global_process_set else f"{kind}.ps{process_set.process_set_id}"
    if tf.executing_eagerly():  # (the core's counts: a joined rank's move past its peers' calls)
        return hvddp.runtime._state().auto_names.take(f"tf.{tag}.noname.")
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, ControlFlowFuncGraph) and isinstance(getattr(graph, "outer_graph", None),
                                                                 FuncGraph):  # out of loop/branch bodies
        graph = graph.outer_graph
    counter = _graph_counters.setdefault(graph, {}).setdefault(tag, itertools.count())
    return f"tf.{tag}.{graph.name}.{next(counter)}"


def _name(name: Optional[str], kind: str, process_set: ProcessSet) -> str:
    _grouping.check_process_set(process_set, kind)
    if name is None:
        return _auto_name(kind, process_set)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind}: name must be a non-empty str or None; Received: name={name!r}.")
    return name


def _announcing(core_fn: Any, name: str, process_set: ProcessSet, group: Any = None, **kwargs: Any):
    """This call's own checks, a refusal announced when running eagerly (see
    ``_grouping.announcing``). Not while a ``tf.function`` is traced: the traced call may never
    run (a branch not taken, a trace without a run), and collectives traced before it would keep
    its peers waiting anyway, so there a refusal raises on this rank alone, when it is traced."""
    if tf.executing_eagerly():
        return _grouping.announcing(core_fn, name, process_set, group, **kwargs)
    return contextlib.nullcontext()


def _scales(prescale_factor: Any, postscale_factor: Any, fn: str) -> Tuple[float, float]:
    """The scale factors as floats, checked as the core checks them (a real, finite number),
    before the op is made: a factor refused in the engine would fail this rank alone."""
    return _scale(prescale_factor, fn, "prescale_factor"), _scale(postscale_factor, fn, "postscale_factor")


def _scale(value: Any, fn: str, arg: str) -> float:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        if not tf.executing_eagerly() or value.shape.rank != 0:
            raise TypeError(f"{fn}: {arg} must be a Python number (it is fixed when the op is made), "
                            f"got {'a symbolic' if not tf.executing_eagerly() else 'a non-scalar'} "
                            f"{type(value).__name__} of shape {value.shape}. Pass a float (such as "
                            f"1.0 / hvd.size()).")
        value = value.numpy()
    return _factor(value, fn, arg)


def _check_xla(fn: str) -> None:
    if tf.executing_eagerly():
        return
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"hvddp.tensorflow.{fn} cannot run inside an XLA-compiled function: hvddp's collectives "
            f"call into Python (tf.numpy_function), which XLA cannot compile. Compile the step "
            f"without XLA: tf.function(jit_compile=False), or model.compile(jit_compile=False) "
            f"(jit_compile='auto' already turns XLA off for models with an hvddp optimizer or a "
            f"train_step, test_step or predict_step of their own).")


def _dense(tensor: Any, fn: str) -> tf.Tensor:
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)  # hvddp reduces sparse gradients as dense ones
    if isinstance(tensor, (tf.RaggedTensor, tf.SparseTensor)):  # (TensorFlow's own error said "no len()")
        raise TypeError(f"{fn}: tensor is a {type(tensor).__name__}, which hvddp does not reduce or gather; "
                        f"pass a dense tensor (.to_tensor(), or tf.sparse.to_dense()) or its values.")
    tensor = tf.convert_to_tensor(tensor)
    if tf.executing_eagerly() and not (tensor.dtype.is_floating or tensor.dtype.is_integer or tensor.dtype.is_bool):
        # (strings and complex numbers: the core saw them as numpy's object or complex dtypes.
        # Eagerly only, where the refusal is announced: in a traced function it would raise on
        # this rank alone while the others wait, so there the core refuses it when the step runs)
        raise TypeError(f"{fn}: tensor has dtype {tensor.dtype.name}, which hvddp does not support; "
                        f"supported: {', '.join(SUPPORTED_DTYPES)} (and uint16, uint32, uint64 for the "
                        f"collectives that move data without arithmetic). Cast it first, e.g. "
                        f"tf.cast(tensor, tf.float32).")
    return tensor


def _set_rank(process_set: ProcessSet) -> int:
    return process_set.rank()


def _size(process_set: ProcessSet) -> int:
    return process_set.size()


def _py(fn, inputs: List[tf.Tensor], touts: List[tf.DType], op_name: str):
    return tf.numpy_function(_noting(fn), inputs, touts, stateful=True, name=op_name)


def _noting(fn):
    """``fn``, noting what it raises: in a graph TensorFlow re-raises it as its own UnknownError
    (``hvddp.keras``' ``fit`` raises it as itself)."""
    def run(*args):
        try:
            return fn(*args)
        except Exception as exc:
            _staged.note(exc)
            raise

    return run


def _outputs(outs) -> List[tf.Tensor]:
    """A multi-output ``_py`` op's results as a list (TensorFlow gives one tensor bare)."""
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


# allreduce --------------------------------------------------------------------------------
def _allreduce_raw(tensor: tf.Tensor, name: str, op, pre: float, post: float, compression,
                   process_set: ProcessSet) -> tf.Tensor:
    compression = numpy_side(compression)

    def body(x):
        c, ctx = compression.compress(np.asarray(x))
        out = hvddp.allreduce(c, name=name, op=op, prescale_factor=pre, postscale_factor=post,
                              process_set=process_set)
        return np.asarray(compression.decompress(out, ctx), dtype=x.dtype)

    out = _py(body, [tensor], [tensor.dtype], "HvddpAllreduce")
    out = out[0] if isinstance(out, (list, tuple)) else out
    out.set_shape(tensor.shape)
    return out


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> tf.Tensor:
    """Reduce ``tensor`` across ranks; return a tensor of the same shape and dtype.

    Every member of ``process_set`` must run the op with the same name, dtype, shape, op and
    scale factors. Blocks until every rank has contributed (inside a ``tf.function``, when the
    op executes). A size-1 run returns ``postscale * prescale * tensor`` (Average: the tensor).
    ``tf.IndexedSlices`` are gathered with Average and Sum, as in Horovod (every rank's rows in
    rank order, the values scaled; ``compression`` does not apply) and reduced as dense tensors
    with the other ops. The gradient of an Average (Sum) allreduce
    is the Average (Sum) allreduce of the incoming gradient with the same scale factors; the
    other ops have none (``None``, where Horovod reduces the incoming gradient with the same op,
    which is not the derivative of Min, Max, Product or Adasum).

    Args:
        tensor: a ``tf.Tensor`` (or anything ``tf.convert_to_tensor`` takes).
        average: legacy flag; True is ``op=Average``, False ``op=Sum``.
        device_dense, device_sparse: accepted for Horovod compatibility; ignored.
        compression: ``hvddp.Compression.none``, ``.fp16`` or ``.bf16``, applied around the reduction.
        op: ``hvddp.Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, or ``Adasum``
            (float tensors on a process set whose size is a power of two; see the core's
            ``hvddp.allreduce``). Sparse tensors are combined as dense ones with the ops other
            than Average and Sum.
        prescale_factor, postscale_factor: multiply the input before and the result after.
        name: the name that matches this op across ranks (see the module docstring when None).
        process_set: the ranks taking part.

    Raises:
        ValueError: a bad argument (Adasum: a size that is no power of two, or a tensor that is
            not floating-point, on every rank when the op is made), or the op is traced under XLA.
        hvddp.MismatchError (eagerly; wrapped in a ``tf.errors`` error in graphs): ranks disagree.

    Example:
        mean = hvddp.tensorflow.allreduce(tf.constant([1.0 * hvd.rank()]), name="mean_rank")
    """
    name = _name(name, "allreduce", process_set)
    with _announcing(hvddp.allreduce, name, process_set):
        op = _grouping.check_op(op, average, "allreduce", adasum=True)
        _grouping.check_compression(compression, "allreduce")
        pre, post = _scales(prescale_factor, postscale_factor, "allreduce")
        sparse = isinstance(tensor, tf.IndexedSlices) and op in (hvddp.Average, hvddp.Sum)
        if not sparse:
            tensor = _dense(tensor, "allreduce")
            _check_adasum(op, [tensor], process_set, "allreduce")
    _check_xla("allreduce")
    if sparse:  # Horovod's: every rank's rows, scaled (as the gradient tape does)
        return _gathered_slices(tensor, name, op, pre, post, process_set)
    if op not in (hvddp.Average, hvddp.Sum):
        return _allreduce_raw(tensor, name, op, pre, post, compression, process_set)

    @tf.custom_gradient
    def _op(x):
        def grad(dy):
            return allreduce(dy, compression=compression, op=op, prescale_factor=pre,
                             postscale_factor=post, name=name + ".grad", process_set=process_set)
        return _allreduce_raw(x, name, op, pre, post, compression, process_set), grad

    return _op(tensor)


def _grouped_raw(tensors: List[tf.Tensor], base: str, labels: Sequence[str], op, pre, post, compression,
                 process_set, counts: int = 0) -> List[tf.Tensor]:
    compression = numpy_side(compression)

    def body(*xs):
        return _grouping.reduce_group(xs, base, labels, op, pre, post, compression, process_set, counts)

    outs = _outputs(_py(body, tensors, [t.dtype for t in tensors], "HvddpGroupedAllreduce"))
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: Optional[str] = None) -> List[tf.Tensor]:
    """Reduce a list of tensors as one atomic group (one op, one engine submission).

    Members are named ``<name>.<i>``. Same contract as ``allreduce`` for each member (Adasum:
    coefficients per member).
    """
    if isinstance(tensors, (list, tuple)) and not tensors:
        return []
    name = _name(name, "grouped_allreduce", process_set)
    with _announcing(hvddp.grouped_allreduce, name, process_set, tensors):
        op = _grouping.check_op(op, average, "grouped_allreduce", adasum=True)
        _grouping.check_compression(compression, "grouped_allreduce")
        tensors = [_dense(t, "grouped_allreduce") for t in _tensor_list(tensors, "grouped_allreduce")]
        _check_adasum(op, tensors, process_set, "grouped_allreduce")
        pre, post = _scales(prescale_factor, postscale_factor, "grouped_allreduce")
    if not tensors:  # (an empty iterable)
        return []
    _check_xla("grouped_allreduce")
    labels = [f"{name}.{i}" for i in range(len(tensors))]
    if op not in (hvddp.Average, hvddp.Sum):
        return _grouped_raw(tensors, name, labels, op, pre, post, compression, process_set)

    @tf.custom_gradient
    def _op(*xs):
        def grad(*dys):
            return grouped_allreduce(list(dys), compression=compression, op=op, prescale_factor=pre,
                                     postscale_factor=post, name=name + ".grad", process_set=process_set)
        return _grouped_raw(list(xs), name, labels, op, pre, post, compression, process_set), grad

    return list(_op(*tensors))


def _tensor_list(tensors: Any, fn: str) -> Any:
    """``tensors`` unless it is one tensor or array, which a grouped op would otherwise iterate:
    a 2-d tensor became a group of its rows, each reduced on its own, with no error."""
    if isinstance(tensors, (tf.Tensor, tf.Variable, tf.IndexedSlices, np.ndarray, np.generic)):
        raise TypeError(f"{fn}: tensors must be a list or tuple of tensors, got one {type(tensors).__name__} "
                        f"of shape {list(tensors.shape)}; pass [tensor] for a group of one.")
    return tensors


def _check_adasum(op: Any, tensors: Sequence[tf.Tensor], process_set: ProcessSet, fn: str) -> None:
    """What the core refuses for Adasum at submission, refused when the op is made (so also when
    a ``tf.function`` is traced, not as a ``tf.errors`` error when it runs)."""
    if op is not hvddp.Adasum:
        return
    _grouping.check_adasum_size(process_set, fn)
    for i, t in enumerate(tensors):
        if not t.dtype.is_floating:
            arg = f"tensors[{i}]" if fn.startswith("grouped") else "tensor"
            raise ValueError(f"{fn}: {arg} has dtype {t.dtype.name}; op=Adasum combines floating-point "
                             f"tensors only (float16, bfloat16, float32, float64). Cast it first.")


def reduce_gradients(grads: Sequence[Any], sources: Sequence[Any], labels: Sequence[str], prefix: str,
                     op: Any, gradient_predivide_factor: float, compression: Any,
                     process_set: ProcessSet, counts: int = 0, sparse_as_dense: bool = False) -> List[Any]:
    """Average (or Sum, or Adasum) a step's gradients as one grouped submission named ``prefix``.

    ``None`` gradients are reduced as zeros (every rank submits the same names; Adasum leaves a
    rank's zeros out), so the result is never ``None``. The last ``counts`` members are
    bookkeeping (see ``_grouping.reduce_group``). Sparse gradients (``tf.IndexedSlices``, an
    embedding's) are gathered, as Horovod does unless ``sparse_as_dense``: every rank's rows,
    scaled as the average would be, which is the sparse gradient one process gets on the whole
    batch (optimizers such as Adam update only the rows a sparse gradient names, so a dense one
    gives other numbers). Used by ``DistributedGradientTape`` and ``hvddp.keras``.
    """
    _check_xla("DistributedGradientTape/DistributedOptimizer")
    try:
        return _reduce_gradients(grads, sources, labels, prefix, op, gradient_predivide_factor, compression,
                                 process_set, counts, sparse_as_dense)
    except hvddp.MismatchError as exc:
        if sparse_as_dense or op not in (hvddp.Average, hvddp.Sum) or _SPARSE_HINT in str(exc):
            raise
        if "called join()" in str(exc):  # the gather of a sparse gradient, after a rank joined
            raise hvddp.MismatchError(
                f"{exc} (sparse gradients (tf.IndexedSlices) are gathered, which cannot run once a "
                f"rank has joined; pass sparse_as_dense=True to reduce them as dense tensors, to "
                f"which joined ranks contribute zeros)") from None
        if "different numbers of tensors" in str(exc):
            # what a gradient sparse on some ranks only does first: the ranks' dense groups differ
            # in size (it is left out of the group where it is sparse)
            raise hvddp.MismatchError(
                f"{prefix}: the ranks reduce different numbers of dense gradients, which a gradient "
                f"that is sparse (tf.IndexedSlices) on some ranks and dense or None on others does: "
                f"{_SPARSE_FIX}. (Or the ranks pass different variables: {exc})") from None
        raise hvddp.MismatchError(f"{exc} ({_SPARSE_HINT})") from None


def _reduce_gradients(grads, sources, labels, prefix, op, gradient_predivide_factor, compression, process_set,
                      counts, sparse_as_dense):
    size = _size(process_set)
    red_op, pre, post = _grouping.average_factors(op, gradient_predivide_factor, size)
    n = len(grads) - counts
    if sparse_as_dense or red_op not in (hvddp.Average, hvddp.Sum) or not n:
        return _reduce_dense(grads, sources, labels, prefix, op, gradient_predivide_factor, compression,
                             process_set, counts)
    # The dense group goes first, with one more bookkeeping member: which gradients are sparse on
    # this rank (then a 1). Where the ranks differ (a gradient sparse on one rank and None, sent
    # as zeros, on another), every rank raises before any gather, instead of one rank waiting on
    # a gather no other makes, or two gathers of different variables meeting under one name.
    is_sparse = [isinstance(g, tf.IndexedSlices) for g in grads[:n]]
    sparse = [i for i in range(n) if is_sparse[i]]
    rest = [i for i in range(len(grads)) if i >= n or not is_sparse[i]]
    kinds = tf.constant(np.array(is_sparse + [True], dtype=np.float32))
    reduced = _reduce_dense([grads[i] for i in rest] + [kinds], [sources[i] for i in rest] + [kinds],
                            [labels[i] for i in rest] + ["(which gradients are sparse)"], prefix, op,
                            gradient_predivide_factor, compression, process_set, counts + 1)
    share = reduced[-1][:-1] / reduced[-1][-1]
    differ = tf.logical_and(share > 0.0, share < 1.0)
    if tf.executing_eagerly():
        if bool(tf.reduce_any(differ)):
            which = [labels[i] for i in range(n) if bool(differ[i])]
            raise hvddp.MismatchError(f"{prefix}: the gradients of {which} are sparse (tf.IndexedSlices) on "
                                      f"some ranks and not on others ({_SPARSE_HINT}).")
        check = []
    else:
        check = [tf.debugging.Assert(tf.logical_not(tf.reduce_any(differ)), [
            f"{prefix}: some gradients are sparse (tf.IndexedSlices) on some ranks and not on others "
            f"({_SPARSE_HINT}). Whether each is sparse, averaged over the ranks:", share])]
    out: List[Any] = [None] * len(grads)
    for i, r in zip(rest, reduced[:-1]):
        out[i] = r
    with tf.control_dependencies(check + [r for r in reduced if isinstance(r, tf.Tensor)]):
        for k, i in enumerate(sparse):  # (named by position: ranks may label variables apart)
            out[i] = _gathered_slices(grads[i], f"{prefix}.sparse.{k}", red_op, pre, post, process_set)
    return out


def _reduce_dense(grads, sources, labels, prefix, op, gradient_predivide_factor, compression, process_set,
                  counts) -> List[tf.Tensor]:
    """``reduce_gradients`` with every gradient reduced as a dense tensor (None as zeros)."""
    size = _size(process_set)
    red_op, pre, post = _grouping.average_factors(op, gradient_predivide_factor, size)
    dense = []
    for g, s in zip(grads, sources):
        if g is None:
            dense.append(tf.zeros_like(tf.convert_to_tensor(s)))
        else:
            dense.append(_dense(g, "gradient"))
    if not dense:
        return []
    if red_op not in (hvddp.Average, hvddp.Sum):
        return _grouped_raw(dense, prefix, labels, red_op, pre, post, compression, process_set, counts)
    n = len(dense) - counts

    @tf.custom_gradient
    def _op(*xs):
        def grad(*dys):  # (a gradient penalty, say: as grouped_allreduce's, differentiable again)
            back = reduce_gradients(list(dys[:n]), xs[:n], labels[:n], prefix + ".grad", op,
                                    gradient_predivide_factor, compression, process_set)
            return back + [None] * counts
        return _grouped_raw(list(xs), prefix, labels, red_op, pre, post, compression, process_set, counts), grad

    return list(_op(*dense))


_SPARSE_FIX = ("a sparse gradient is gathered, not reduced, so it must be sparse on every rank; compute "
               "it the same way on every rank, or pass sparse_as_dense=True to reduce it as a dense tensor")
_SPARSE_HINT = "if a gradient is a tf.IndexedSlices on some ranks and dense or None on others: " + _SPARSE_FIX


def _gathered_slices(grad: tf.IndexedSlices, name: str, op: Any, pre: float, post: float,
                     process_set: ProcessSet) -> tf.IndexedSlices:
    """Every rank's rows of a sparse gradient, in rank order, the values scaled as the Average or
    Sum ``op`` with these scale factors would scale them (``factor`` below).

    Differentiable as the dense reduction is: the values' gradient is ``factor`` times the sum
    over ranks of the incoming gradient's rows for this rank (allgather's own gradient is the
    average over ranks, hence the size in ``_summed_in_backward``)."""
    values = allgather(grad.values, name=name + ".values", ignore_name_scope=True, process_set=process_set)
    indices = allgather(grad.indices, name=name + ".indices", ignore_name_scope=True, process_set=process_set)
    size = _size(process_set)
    values = _summed_in_backward(values, float(size))
    factor = pre * post / (size if op == hvddp.Average else 1)
    if factor != 1.0:
        values = values * tf.cast(factor, values.dtype)
    return tf.IndexedSlices(values, indices, grad.dense_shape)


def _summed_in_backward(x: tf.Tensor, size: float) -> tf.Tensor:
    """``x``; its gradient is the incoming one times ``size``."""
    @tf.custom_gradient
    def identity(t):
        return tf.identity(t), lambda dy: dy * tf.cast(size, dy.dtype)

    return identity(x)


def drop_absent(reduced: List[Any], flags: Any, present: List[bool], who: str, labels: List[str]) -> List[Any]:
    """None for the gradients no rank had, so an optimizer skips them as it would in one process
    (no weight decay, no momentum step on an unused variable).

    ``flags`` is the reduced presence vector: entry i over the last entry (which every rank set
    to 1, so the ratio undoes Average's and any other scaling) is the share of ranks that had
    gradient i. Eagerly that decides per variable. In a ``tf.function`` it is not known when the
    step is traced: a gradient is dropped where it was None here (TensorFlow's None is a property
    of the traced graph, the same on every rank of one model), and a runtime check raises on
    every rank if some rank had it after all, naming those gradients (``labels``).
    """
    if not tf.executing_eagerly():
        share = flags[:-1] / flags[-1]
        partial = tf.logical_and(share > 0.0, share < 1.0)
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(partial)), [
            f"{who}: a gradient is None on some ranks and not on others inside a tf.function "
            "(rank-dependent model code?); every rank must compute the same gradients. The "
            "gradients:", tf.boolean_mask(tf.constant(labels, dtype=tf.string), partial),
            "the share of ranks that have each of them:", tf.boolean_mask(share, partial)])
        with tf.control_dependencies([check]):
            return [tf.identity(r) if p else None for r, p in zip(reduced, present)]
    share = np.asarray(flags, dtype=np.float64)
    return [None if share[i] == 0.0 else r for i, r in enumerate(reduced)]


# allgather --------------------------------------------------------------------------------
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ across ranks; dtype and the other dimensions must match.
    The gradient averages the incoming gradient across ranks (Horovod's) and returns this rank's rows.
    """
    name = _name(name, "allgather", process_set)
    with _announcing(hvddp.allgather, name, process_set):
        tensor = _dense(tensor, "allgather")
        if tensor.shape.rank == 0:
            raise ValueError("allgather: tensor is 0-d; pass at least a 1-d tensor (e.g. tf.reshape(t, [1])).")
    _check_xla("allgather")

    def body(x):
        # (uint16/32/64 travel as their bits, as Horovod's TF ops take uint16)
        return _grouping.unwire(hvddp.allgather(_grouping.wire(x), name=name, process_set=process_set), x.dtype)

    def grad_body(dy, rows):
        total = hvddp.allreduce(dy, name=name + ".grad", op=hvddp.Average, process_set=process_set)
        sizes = hvddp.allgather(np.asarray([rows], dtype=np.int64), name=name + ".grad.rows",
                                process_set=process_set)
        start = int(sizes[:_set_rank(process_set)].sum())
        return np.ascontiguousarray(total[start:start + int(rows)])

    @tf.custom_gradient
    def _op(x):
        out = _py(body, [x], [x.dtype], "HvddpAllgather")
        out = out[0] if isinstance(out, (list, tuple)) else out
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(dy):
            rows = tf.shape(x, out_type=tf.int64)[0]
            g = _py(grad_body, [dy, rows], [dy.dtype], "HvddpAllgatherGrad")
            g = g[0] if isinstance(g, (list, tuple)) else g
            g.set_shape(x.shape)
            return g
        return out, grad

    return _op(tensor)


# broadcast --------------------------------------------------------------------------------
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (shape and dtype must match).

    The gradient is the average of the incoming gradients on ``root_rank`` (Horovod's) and zero elsewhere.
    """
    name = _name(name, "broadcast", process_set)
    with _announcing(hvddp.broadcast, name, process_set, root_rank=root_rank):
        _check_root(root_rank, process_set, "broadcast")
        tensor = _dense(tensor, "broadcast")
    _check_xla("broadcast")

    def body(x):
        return _grouping.unwire(hvddp.broadcast(_grouping.wire(x), root_rank, name=name, process_set=process_set),
                                x.dtype)

    @tf.custom_gradient
    def _op(x):
        out = _py(body, [x], [x.dtype], "HvddpBroadcast")
        out = out[0] if isinstance(out, (list, tuple)) else out
        out.set_shape(x.shape)

        def grad(dy):
            total = allreduce(dy, op=hvddp.Average, name=name + ".grad", process_set=process_set)
            return total if hvddp.rank() == root_rank else tf.zeros_like(total)
        return out, grad

    return _op(tensor)


def _check_root(root_rank: Any, process_set: ProcessSet, fn: str) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"{fn}: root_rank must be an int; Received: root_rank={root_rank!r}.")
    members = list(range(hvddp.size())) if process_set is global_process_set else process_set.ranks
    if root_rank not in members:  # a global rank, as in Horovod
        raise ValueError(f"{fn}: root_rank is a global rank (as hvd.rank() numbers them) and must be one "
                         f"of {process_set!r}'s members {members}; Received: root_rank={root_rank}.")
    if not process_set.included():
        raise ValueError(f"{fn}: this rank ({hvddp.rank()}) is not a member of {process_set!r}; call it "
                         f"on the set's members {members} only.")


# alltoall, reducescatter ---------------------------------------------------------------------
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i``; gather the rows sent to this rank.

    Without ``splits`` the first dimension is split evenly (it must divide by the number of
    ranks) and the received tensor is returned; with ``splits``, ``(received, received_splits)``
    (int32), as in Horovod 0.28. The gradient sends the
    received rows' gradients back where they came from (the reverse alltoall).
    """
    name = _name(name, "alltoall", process_set)
    with _announcing(hvddp.alltoall, name, process_set):
        tensor = _dense(tensor, "alltoall")
        if splits is None:
            splits_t = tf.zeros([0], tf.int64)
        else:  # (a cast would truncate 1.9 to 1 and leave rows unsent; Horovod's op takes int32)
            splits_t = tf.convert_to_tensor(splits)
            if splits_t.shape.num_elements() == 0 and splits_t.shape.rank == 1:
                splits_t = tf.zeros([0], splits_t.dtype if splits_t.dtype.is_integer else tf.int64)  # even
            if not splits_t.dtype.is_integer:
                raise TypeError(f"alltoall: splits must be integers (rows to send to each rank), got "
                                f"dtype {splits_t.dtype.name}: {splits!r}.")
            if splits_t.shape.rank is not None and splits_t.shape.rank != 1:
                raise ValueError(f"alltoall: splits must be 1-D (one row count per rank), got shape "
                                 f"{splits_t.shape.as_list()}: {splits!r}.")
            splits_t = tf.cast(splits_t, tf.int64)
    _check_xla("alltoall")
    size = _size(process_set)

    def body(x, s):
        given = None if s.size == 0 else [int(v) for v in s]
        out, received = hvddp.alltoall_async(_grouping.wire(x), given, name=name, process_set=process_set).wait()
        return _grouping.unwire(out, x.dtype), np.asarray(received, dtype=np.int32)

    def grad_body(dy, back, rows):
        out, _ = hvddp.alltoall_async(dy, [int(v) for v in back], name=name + ".grad",
                                      process_set=process_set).wait()
        out = np.asarray(out, dtype=dy.dtype)
        if out.shape[0] < rows:  # rows past sum(splits) were not sent: their gradient is zero
            out = np.concatenate([out, np.zeros((int(rows) - out.shape[0],) + out.shape[1:], out.dtype)])
        return out

    @tf.custom_gradient
    def _op(x):
        out, received = _py(body, [x, splits_t], [x.dtype, tf.int32], "HvddpAlltoall")
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([size])

        def grad(dy, _d_received):
            g = _py(grad_body, [dy, received, tf.shape(x)[0]], [dy.dtype], "HvddpAlltoallGrad")
            g = g[0] if isinstance(g, (list, tuple)) else g
            g.set_shape(x.shape)
            return g
        return (out, received), grad

    out, received = _op(tensor)
    return out if splits is None else (out, received)


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none, op: Any = None,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's rows (first ``rows % size`` ranks
    get one more). ``op`` defaults to Average; ``compression`` (e.g. ``Compression.fp16``) casts
    around the reduction. The gradient (Average and Sum) is the allgather of the rows'
    gradients, times the size for Sum and the scale factors (Horovod's factors)."""
    name = _name(name, "reducescatter", process_set)
    with _announcing(hvddp.reducescatter, name, process_set):
        op = _grouping.check_op(op, None, "reducescatter")
        compression = numpy_side(_grouping.check_compression(compression, "reducescatter"))
        tensor = _dense(tensor, "reducescatter")
        if tensor.shape.rank == 0:
            raise ValueError("reducescatter: tensor is 0-d; pass at least a 1-d tensor.")
        pre, post = _scales(prescale_factor, postscale_factor, "reducescatter")
    _check_xla("reducescatter")

    def body(x):
        c, ctx = compression.compress(np.asarray(x))
        out = hvddp.reducescatter(c, name=name, op=op, process_set=process_set, prescale_factor=pre,
                                  postscale_factor=post)
        return np.asarray(compression.decompress(out, ctx), dtype=x.dtype)

    def grad_body(dy):
        factor = pre * post * (_size(process_set) if op == hvddp.Sum else 1)  # Horovod's
        total = hvddp.allgather(dy, name=name + ".grad", process_set=process_set)
        return np.asarray(total * factor, dtype=dy.dtype)

    @tf.custom_gradient
    def _op(x):
        out = _py(body, [x], [x.dtype], "HvddpReducescatter")
        out = out[0] if isinstance(out, (list, tuple)) else out
        rows = x.shape[0]
        if rows is not None:
            size, rank = _size(process_set), _set_rank(process_set)
            rows = _grouping.rows_here(rows, size, rank)
        out.set_shape(tf.TensorShape([rows]).concatenate(x.shape[1:]))

        def grad(dy):
            if op not in (hvddp.Average, hvddp.Sum):  # no derivative: None, as allreduce's
                return None
            g = _py(grad_body, [dy], [dy.dtype], "HvddpReducescatterGrad")
            g = g[0] if isinstance(g, (list, tuple)) else g
            g.set_shape(x.shape)
            return g
        return out, grad

    return _op(tensor)


# grouped allgather, grouped reducescatter -----------------------------------------------------
def _check_group_inputs(tensors: Sequence[tf.Tensor], fn: str) -> None:
    """A grouped op's members must each be at least 1-d (``fn`` names the errors)."""
    for i, t in enumerate(tensors):
        if t.shape.rank == 0:
            raise ValueError(f"{fn}: tensors[{i}] is 0-d; pass at least 1-d tensors.")


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Allgather each tensor of a list as one atomic group (one op, one engine submission).

    Members are named ``<name>.<i>``; each has ``allgather``'s contract and gradient.
    """
    if isinstance(tensors, (list, tuple)) and not tensors:
        return []
    name = _name(name, "grouped_allgather", process_set)
    with _announcing(hvddp.grouped_allgather, name, process_set, tensors):
        tensors = [_dense(t, "grouped_allgather") for t in _tensor_list(tensors, "grouped_allgather")]
        _check_group_inputs(tensors, "grouped_allgather")
    if not tensors:  # (an empty iterable)
        return []
    _check_xla("grouped_allgather")

    def body(*xs):
        outs = hvddp.grouped_allgather([_grouping.wire(x) for x in xs], name=name, process_set=process_set)
        return [_grouping.unwire(o, x.dtype) for o, x in zip(outs, xs)]

    def grad_body(*args):  # the incoming gradients, then this rank's row counts
        k = len(args) // 2
        dys, rows = args[:k], [int(r) for r in args[k:]]
        totals = hvddp.grouped_allreduce(list(dys), name=name + ".grad", op=hvddp.Average, process_set=process_set)
        counts = hvddp.allgather(np.asarray([rows], dtype=np.int64), name=name + ".grad.rows",
                                 process_set=process_set)
        starts = counts[:_set_rank(process_set)].sum(axis=0)
        return [np.ascontiguousarray(t[int(s):int(s) + r]) for t, s, r in zip(totals, starts, rows)]

    @tf.custom_gradient
    def _op(*xs):
        outs = _outputs(_py(body, list(xs), [x.dtype for x in xs], "HvddpGroupedAllgather"))
        for o, x in zip(outs, xs):
            o.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(*dys):
            rows = [tf.shape(x, out_type=tf.int64)[0] for x in xs]
            gs = _outputs(_py(grad_body, list(dys) + rows, [dy.dtype for dy in dys], "HvddpGroupedAllgatherGrad"))
            for g, x in zip(gs, xs):
                g.set_shape(x.shape)
            return gs
        return outs, grad

    return list(_op(*tensors))


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Any = Compression.none,
                          op: Any = None, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None) -> List[tf.Tensor]:
    """Reducescatter each tensor of a list as one atomic group (one op, one engine submission).

    Members are named ``<name>.<i>``; each has ``reducescatter``'s contract and gradient.
    """
    if isinstance(tensors, (list, tuple)) and not tensors:
        return []
    name = _name(name, "grouped_reducescatter", process_set)
    with _announcing(hvddp.grouped_reducescatter, name, process_set, tensors):
        op = _grouping.check_op(op, None, "grouped_reducescatter")
        compression = numpy_side(_grouping.check_compression(compression, "grouped_reducescatter"))
        tensors = [_dense(t, "grouped_reducescatter") for t in _tensor_list(tensors, "grouped_reducescatter")]
        _check_group_inputs(tensors, "grouped_reducescatter")
        pre, post = _scales(prescale_factor, postscale_factor, "grouped_reducescatter")
    if not tensors:  # (an empty iterable)
        return []
    _check_xla("grouped_reducescatter")

    def body(*xs):
        packed = [compression.compress(np.asarray(x)) for x in xs]
        outs = hvddp.grouped_reducescatter([c for c, _ in packed], name=name, op=op, process_set=process_set,
                                           prescale_factor=pre, postscale_factor=post)
        return [np.asarray(compression.decompress(o, ctx), dtype=x.dtype) for o, (_, ctx), x in zip(outs, packed, xs)]

    def grad_body(*dys):
        factor = pre * post * (_size(process_set) if op == hvddp.Sum else 1)  # Horovod's
        totals = hvddp.grouped_allgather(list(dys), name=name + ".grad", process_set=process_set)
        return [np.asarray(t * factor, dtype=dy.dtype) for t, dy in zip(totals, dys)]

    @tf.custom_gradient
    def _op(*xs):
        outs = _outputs(_py(body, list(xs), [x.dtype for x in xs], "HvddpGroupedReducescatter"))
        size, rank = _size(process_set), _set_rank(process_set)
        for o, x in zip(outs, xs):
            rows = x.shape[0]
            if rows is not None:
                rows = _grouping.rows_here(rows, size, rank)
            o.set_shape(tf.TensorShape([rows]).concatenate(x.shape[1:]))

        def grad(*dys):
            if op not in (hvddp.Average, hvddp.Sum):  # no derivative: None, as allreduce's
                return [None] * len(dys)
            gs = _outputs(_py(grad_body, list(dys), [dy.dtype for dy in dys], "HvddpGroupedReducescatterGrad"))
            for g, x in zip(gs, xs):
                g.set_shape(x.shape)
            return gs
        return outs, grad

    return list(_op(*tensors))


# join ------------------------------------------------------------------------------------
def join() -> tf.Tensor:
    """This rank has no more data (Horovod's op): until every rank has joined, it takes part in
    the other ranks' allreduces with zeros; returns the last rank to join, an int32 scalar
    tensor. An op, as in Horovod: inside a ``tf.function`` it joins each time the function runs
    (a plain Python call would run once, while the function is traced)."""
    _check_xla("join")
    with tf.control_dependencies(_earlier_side_effects()):
        out = _outputs(_py(lambda: np.int32(hvddp.join()), [], [tf.int32], "HvddpJoin"))[0]
    out.set_shape([])
    return out


def _earlier_side_effects() -> List[tf.Operation]:
    """Inside a ``tf.function``: the stateful ops traced so far in this graph and the graphs around
    it, which the join must follow. TensorFlow chains the stateful ops without resource inputs (the collectives) in
    program order, but not with those that have some: a training loop (a ``While`` or
    ``ReduceDataset`` op capturing the variables) would run after the join, or beside it."""
    found = []
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    while graph is not None and graph.building_function:  # also those of the enclosing functions
        found += [op for op in graph.get_operations() if op._is_stateful]  # (a cond branch, a loop body)
        graph = getattr(graph, "outer_graph", None)
    return found
