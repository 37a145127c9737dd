"""Variable helpers for TensorFlow: broadcast variables from a root rank, and the Keras-optimizer
entry points Horovod's TensorFlow package has."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import numpy as np
import tensorflow as tf

import hvddp
from hvddp import Compression, ProcessSet, _grouping, global_process_set

from .gradient_tape import source_label
from .ops import _check_root, _check_xla, _noting

__all__ = ["broadcast_", "broadcast_variables", "broadcast_global_variables", "DistributedOptimizer", "size_op",
           "rank_op", "local_size_op", "local_rank_op", "process_set_included_op", "broadcast_object",
           "broadcast_object_fn", "allgather_object"]


def _no_session(session: Any, fn: str) -> None:
    if session is not None:
        raise TypeError(f"{fn}: TensorFlow 1 sessions are not supported (hvddp runs TensorFlow 2, "
                        f"eagerly or in tf.function); Received: session={session!r}. Leave session=None.")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable ``obj`` on every rank (``hvddp.broadcast_object``), with
    Horovod's TensorFlow signature: ``session`` must be None (no TensorFlow 1)."""
    _no_session(session, "broadcast_object")
    return hvddp.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set):
    """Horovod's: a function ``fn(obj)`` that returns ``root_rank``'s ``obj`` on every rank."""
    _no_session(session, "broadcast_object_fn")

    def broadcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, None, name, process_set)

    return broadcast


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (``hvddp.allgather_object``), with Horovod's
    TensorFlow signature: ``session`` must be None (no TensorFlow 1)."""
    _no_session(session, "allgather_object")
    return hvddp.allgather_object(obj, name=name, process_set=process_set)


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Optional[Any]:
    """Assign ``root_rank``'s values to ``variables`` on every rank.

    Call it after the variables exist, typically once before training so that differently
    initialised replicas start equal: eagerly, or inside a ``tf.function`` (as Horovod's TF2
    examples do on the first batch), where it runs as one op when the function runs. Every
    rank passes the same variables in the same order; one small exchange first compares the
    lists (count, shapes, dtypes), so a different model on some rank raises ``MismatchError``
    on every rank.

    Args:
        variables: ``tf.Variable`` or Keras variables.
        root_rank: the rank whose values win.
        process_set: the ranks taking part.
        inplace: accepted for Horovod compatibility; the variables are always assigned.

    Random-number generator states among them (a Keras ``Dropout`` layer's ``SeedGenerator``,
    part of ``model.variables``) are left out: each rank keeps its own, so dropout masks differ
    across ranks, as ``BroadcastGlobalVariablesCallback`` leaves them.

    Returns:
        None eagerly; inside a ``tf.function``, the op that assigns them.
    """
    _grouping.check_process_set(process_set, "broadcast_variables")
    variables = [v for v in variables if not _grouping.random_state(v)]
    labels = [source_label(v, i) for i, v in enumerate(variables)]
    # refused here: announced under the first exchange's name, which the other ranks wait on
    with _grouping.announcing(hvddp.allgather, f"{_CHECK}.size", process_set):
        _check_root(root_rank, process_set, "broadcast_variables")
        for v, label in zip(variables, labels):
            dtype = _dtype_name(v)
            if dtype not in _BROADCASTABLE:
                raise TypeError(f"broadcast_variables: {label} has dtype {dtype}, which hvddp does not "
                                f"broadcast (supported: {', '.join(sorted(_BROADCASTABLE))}); leave it out "
                                f"of the list, or set it from hvd.broadcast_object.")
    if tf.executing_eagerly():
        values = _broadcast_values([np.asarray(v.numpy()) for v in variables], labels, root_rank, process_set)
        for v, value in zip(variables, values):
            v.assign(tf.convert_to_tensor(value, dtype=v.dtype))
        return None
    if not variables:
        return tf.no_op()
    _check_xla("broadcast_variables")
    tensors = [tf.convert_to_tensor(v) for v in variables]

    def body(*values):
        return _broadcast_values([np.asarray(x) for x in values], labels, root_rank, process_set)

    outs = tf.numpy_function(_noting(body), tensors, [t.dtype for t in tensors], stateful=True,
                             name="HvddpBroadcastVariables")
    assigns = []
    for v, t, out in zip(variables, tensors, outs):
        out.set_shape(t.shape)
        assigns.append(v.assign(out))
    return tf.group(*assigns)


def broadcast_(variables: Iterable[Any], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Horovod's in-place broadcast: assign ``root_rank``'s values to ``variables`` (as
    ``broadcast_variables`` does, eagerly or in a ``tf.function``) and return the new values.
    ``name`` is accepted for Horovod compatibility."""
    variables = list(variables)
    op = broadcast_variables(variables, root_rank, process_set)
    if op is None:
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([op]):
        return [tf.identity(v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v))
                for v in variables]


_CHECK = "tf.bcast.check"  # the name of broadcast_variables' first exchange (an allgather_object)
_BROADCASTABLE = frozenset(hvddp.ops.SUPPORTED_DTYPES) | frozenset(_grouping._SIGNED)  # (those as bits)


def _dtype_name(variable: Any) -> str:
    try:
        return tf.as_dtype(variable.dtype).name
    except (TypeError, ValueError):
        return str(getattr(variable, "dtype", type(variable).__name__))


def _broadcast_values(values: List[np.ndarray], labels: List[str], root_rank: int,
                      process_set: ProcessSet) -> List[np.ndarray]:
    _grouping.check_same_lists(_CHECK, labels, [a.shape for a in values],
                               [a.dtype.name for a in values], process_set, broadcast="broadcast_variables")
    handles = [hvddp.broadcast_async(_grouping.wire(value), root_rank, name=f"tf.bcast.{i}",
                                     process_set=process_set) for i, value in enumerate(values)]
    return [np.asarray(h.wait()).view(value.dtype) for value, h in zip(values, handles)]


def broadcast_global_variables(root_rank: int) -> None:
    """Raise, as Horovod's TensorFlow package does under eager TensorFlow 2.

    Raises:
        HvddpError (a RuntimeError): always, naming ``broadcast_variables`` instead.
    """
    raise hvddp.HvddpError(
        f"broadcast_global_variables({root_rank!r}): TensorFlow 2 keeps no global variable collection. "
        f"Use hvd.broadcast_variables(model.variables + optimizer.variables, root_rank={root_rank!r}) "
        f"once they exist (eagerly, or on the first step inside a tf.function).")


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: Any = hvddp.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer so that it averages gradients across ranks, as Horovod's
    ``horovod.tensorflow.DistributedOptimizer`` does for Keras optimizers: it is
    ``hvddp.keras.DistributedOptimizer`` (see there); ``use_locking`` is accepted and ignored.
    TensorFlow 1's legacy optimizers do not exist in Keras 3. ``op=hvddp.Adasum`` combines the
    gradients by Adasum, as Horovod's Keras optimizer does (Horovod 0.28's TensorFlow entry point
    refuses Adasum for Keras optimizers; this one passes it on).

    Raises:
        TypeError: ``optimizer`` is not a ``keras.optimizers.Optimizer``.
    """
    import keras

    from hvddp.keras import DistributedOptimizer as keras_distributed
    from hvddp.keras._keras2 import describe

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"hvddp.tensorflow.DistributedOptimizer wraps a Keras 3 keras.optimizers.Optimizer "
                        f"(TF1's legacy optimizers and Keras 2's, tf_keras, are not supported); Received: "
                        f"optimizer={describe(optimizer)}. For a custom loop, hvd.DistributedGradientTape(tape) "
                        f"averages the gradients instead, with any optimizer; or build the optimizer from "
                        f"`import keras` (Keras 3).")

    return keras_distributed(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                             compression=compression, sparse_as_dense=sparse_as_dense,
                             gradient_predivide_factor=gradient_predivide_factor, op=op,
                             backward_passes_per_step=backward_passes_per_step,
                             average_aggregated_gradients=average_aggregated_gradients,
                             num_groups=num_groups, groups=groups, process_set=process_set,
                             scale_local_gradients=scale_local_gradients)


# Horovod's graph-era ops: the runtime's numbers as int32 tensors ------------------------------
def _set_view(process_set_id: int):
    from hvddp.runtime import _state

    view = _state().process_sets.get(process_set_id)
    if view is None:
        raise ValueError(f"process_set_id={process_set_id!r} names no registered process set "
                         f"(ps.process_set_id of one that init() or add_process_set() registered).")
    return view


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set with this id (0: all of them), as an int32 tensor."""
    return tf.constant(_set_view(process_set_id).size, dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank is in the process set with this id, else 0, as an int32 tensor."""
    return tf.constant(int(_set_view(process_set_id).rank >= 0), dtype=tf.int32, name=name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This rank, as an int32 tensor."""
    return tf.constant(hvddp.rank(), dtype=tf.int32, name=name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this node, as an int32 tensor."""
    return tf.constant(hvddp.local_size(), dtype=tf.int32, name=name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This rank's index on its node, as an int32 tensor."""
    return tf.constant(hvddp.local_rank(), dtype=tf.int32, name=name)
