"""Collectives on numpy values or backend tensors, and ``broadcast_variables``, for Keras."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import keras
import numpy as np

import hvddp
from hvddp import Compression, ProcessSet, global_process_set

from hvddp import _grouping

from . import _backend

__all__ = ["allreduce", "allgather", "reducescatter", "broadcast", "broadcast_variables"]


def _announcing(core_fn: Any, name: Optional[str], process_set: ProcessSet, value: Any):
    """This call's own checks of ``value``, a refusal announced (``_grouping.announcing``),
    except for a value ``jax.jit`` traces: the traced call may never run (a branch not taken),
    and the collectives traced before it would keep its peers waiting anyway, so there a
    refusal raises on this rank alone, when it is traced."""
    if _backend.name() == "jax" and not _backend.is_numpy(value) and _backend.jax_tracing([value]):
        return contextlib.nullcontext()
    return _grouping.announcing(core_fn, name, process_set)


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Any = Compression.none, process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``value`` across ranks (Average by default) and return the result.

    ``value`` is a tensor of the active Keras backend, or a list of numbers, made one (the result
    is one too; usable inside ``tf.function`` and ``jax.jit``), or a numpy array or number: on
    the TensorFlow backend made ``tf.constant(value)`` as in Horovod (a ``tf.Tensor`` comes
    back), on the others the result is a numpy array.
    Every rank makes the same call with the same name, shape and dtype. Blocks. ``op=Adasum``
    combines float values on a process set whose size is a power of two (else ``ValueError`` on
    every rank, before anything is sent).
    """
    _grouping.check_process_set(process_set, "allreduce")
    value = _backend.unwrap(value)
    if _backend.name() == "tensorflow" and not _backend.is_numpy(value):  # (checks and announces itself)
        from hvddp.tensorflow import allreduce as tf_allreduce

        return tf_allreduce(value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, name=name, process_set=process_set)
    if _backend.name() == "torch" and _backend.needs_grad(value):
        # differentiable, as on TensorFlow: hvddp.torch's op (the numpy path detached it silently)
        import hvddp.torch as hvd_torch

        same = {Compression.none: hvd_torch.Compression.none, Compression.fp16: hvd_torch.Compression.fp16,
                Compression.bf16: hvd_torch.Compression.bf16}
        with _announcing(hvddp.allreduce, name, process_set, value):  # (the others wait in it)
            if not any(compression is c for c in same):
                raise ValueError(f"allreduce: a torch tensor autograd records takes hvd.Compression.none, "
                                 f".fp16 or .bf16 (the gradient flows through those); Received: "
                                 f"compression={compression!r}.")
        return hvd_torch.allreduce(value, average=average, name=name, compression=same[compression], op=op,
                                   prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                   process_set=process_set)
    with _announcing(hvddp.allreduce, name, process_set, value):
        compression = _grouping.check_compression(compression, "allreduce")
        op = _grouping.check_op(op, average, "allreduce", adasum=True)
        if op is hvddp.Adasum and not _backend.is_numpy(value):  # (the core checks numpy values)
            _grouping.check_adasum_size(process_set, "allreduce")
            if "float" not in keras.backend.standardize_dtype(value.dtype):
                raise ValueError(f"allreduce: value has dtype {keras.backend.standardize_dtype(value.dtype)}; "
                                 f"op=Adasum combines floating-point values only. Cast it first.")
    if _backend.is_numpy(value):
        c, ctx = compression.compress(np.asarray(value))
        out = hvddp.allreduce(c, name=name, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, process_set=process_set)
        return compression.decompress(out, ctx)

    def fn(x):
        c, ctx = compression.compress(x)
        out = hvddp.allreduce(c, name=name, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, process_set=process_set)
        return [np.asarray(compression.decompress(out, ctx), dtype=x.dtype)]

    return _backend.call(fn, [value])[0]


def _torch_op(fn: str):
    """``hvddp.torch``'s differentiable collective ``fn``, for a torch tensor that autograd records
    (differentiable, as on TensorFlow: the numpy path detached it, and its gradient went missing
    silently); it checks and announces its arguments itself."""
    import hvddp.torch as hvd_torch

    return getattr(hvd_torch, fn)


def allgather(value: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's ``value`` along the first dimension, in rank order.

    Numpy in, numpy out; a backend tensor in, a backend tensor out. The first dimension may
    differ across ranks, except inside ``jax.jit``, where shapes are static and must match.
    """
    _grouping.check_process_set(process_set, "allgather")
    value = _backend.unwrap(value)
    if _backend.is_numpy(value):
        return hvddp.allgather(np.asarray(value), name=name, process_set=process_set)
    backend = _backend.name()
    if backend == "tensorflow":
        from hvddp.tensorflow import allgather as tf_allgather

        return tf_allgather(value, name=name, process_set=process_set)
    if backend == "torch" and _backend.needs_grad(value):
        return _torch_op("allgather")(value, name=name, process_set=process_set)

    shape = tuple(value.shape)
    with _announcing(hvddp.allgather, name, process_set, value):
        if not shape:
            raise ValueError("allgather: value is 0-d; pass at least a 1-d tensor.")
    out_shape = (shape[0] * process_set.size(),) + shape[1:]
    traced = backend == "jax" and _backend.jax_tracing([value])  # (then the shape is static)

    def fn(x):
        if traced:  # every rank's row count first (the same answer everywhere, so all raise)
            rows = hvddp.allgather(np.array([x.shape[0]], dtype=np.int64), process_set=process_set,
                                   name=None if name is None else f"{name}.rows").tolist()
            if len(set(rows)) > 1:
                raise ValueError(f"allgather {name or ''}: inside jax.jit every rank must pass the same "
                                 f"first dimension (shapes are static there); the ranks passed {rows} rows. "
                                 f"Gather outside jax.jit, or pad to a common size.")
        return [np.asarray(hvddp.allgather(x, name=name, process_set=process_set), dtype=x.dtype)]

    return _backend.call(fn, [value], [out_shape])[0]


def reducescatter(value: Any, name: Optional[str] = None, op: Any = None,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``value`` across ranks (Average by default) and return this rank's rows of the
    result (the first ``rows % size`` ranks get one more), as Horovod's Keras ``reducescatter``.

    Numpy in, numpy out (a ``tf.Tensor`` on the TensorFlow backend, as for ``allreduce``); a
    backend tensor in, a backend tensor out.
    """
    _grouping.check_process_set(process_set, "reducescatter")
    value = _backend.unwrap(value)
    backend = _backend.name()
    if backend == "tensorflow" and not _backend.is_numpy(value):  # (checks and announces itself)
        from hvddp.tensorflow import reducescatter as tf_reducescatter

        return tf_reducescatter(value, name=name, op=op, process_set=process_set)
    if backend == "torch" and _backend.needs_grad(value):
        return _torch_op("reducescatter")(value, name=name, op=hvddp.Average if op is None else op,
                                          process_set=process_set)
    with _announcing(hvddp.reducescatter, name, process_set, value):
        op = _grouping.check_op(op, None, "reducescatter")
        if not _backend.is_numpy(value) and not tuple(value.shape):  # (the core checks numpy values)
            raise ValueError("reducescatter: value is 0-d; pass at least a 1-d tensor.")
    if _backend.is_numpy(value):
        return hvddp.reducescatter(np.asarray(value), name=name, op=op, process_set=process_set)

    def fn(x):
        return [np.asarray(hvddp.reducescatter(x, name=name, op=op, process_set=process_set), dtype=x.dtype)]

    shape = tuple(value.shape)
    size, rank = process_set.size(), process_set.rank()
    out_shape = (_grouping.rows_here(shape[0], size, rank),) + shape[1:]
    return _backend.call(fn, [value], [out_shape])[0]


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``value`` on every rank (numpy or backend tensor, as given)."""
    _grouping.check_process_set(process_set, "broadcast")
    value = _backend.unwrap(value)
    if _backend.is_numpy(value):
        return hvddp.broadcast(np.asarray(value), root_rank, name=name, process_set=process_set)
    if _backend.name() == "tensorflow":
        from hvddp.tensorflow import broadcast as tf_broadcast

        return tf_broadcast(value, root_rank, name=name, process_set=process_set)
    if _backend.name() == "torch" and _backend.needs_grad(value):
        return _torch_op("broadcast")(value, root_rank, name=name, process_set=process_set)

    def fn(x):
        return [np.asarray(hvddp.broadcast(x, root_rank, name=name, process_set=process_set), dtype=x.dtype)]

    return _backend.call(fn, [value])[0]


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, prefix: str = "keras.bcast") -> None:
    """Assign ``root_rank``'s values to Keras ``variables`` on every rank; call eagerly.

    Every rank passes the same variables in the same order (e.g. ``model.variables``). One
    small exchange first compares the lists (count, shapes, dtypes; paths may differ, as Keras
    numbers layers per process), so a different model on some rank is an error on every rank
    that names the variable, not a hang.

    Args:
        variables: Keras variables (any backend).
        root_rank: the rank whose values win.
        process_set: the ranks taking part.
        prefix: the first part of the collectives' names (calls in flight at once need
            different prefixes).

    Random-number generator states among them (a ``Dropout`` layer's ``SeedGenerator``) are
    left out: each rank keeps its own, so dropout masks differ across ranks, as
    ``BroadcastGlobalVariablesCallback`` leaves them.
    """
    _grouping.check_process_set(process_set, "broadcast_variables")
    variables = [v for v in variables if not _grouping.random_state(v)]
    values = [np.array(_backend.to_numpy(v)) for v in variables]
    _grouping.check_same_lists(f"{prefix}.check", [getattr(v, "path", f"variable {i}") for i, v in
                                                   enumerate(variables)],
                               [a.shape for a in values], [a.dtype.name for a in values], process_set,
                               broadcast="broadcast_variables", root_rank=root_rank)
    handles = [hvddp.broadcast_async(_grouping.wire(value), root_rank, name=f"{prefix}.{i}", process_set=process_set)
               for i, value in enumerate(values)]
    for v, value, handle in zip(variables, values, handles):
        v.assign(handle.wait().view(value.dtype))


def broadcast_global_variables(root_rank: int) -> None:
    """Raise, as Horovod's Keras package does under TensorFlow 2: Keras 3 has no global variables.

    Raises:
        HvddpError (a RuntimeError): always, naming the two ways that do work.
    """
    raise hvddp.HvddpError(
        f"broadcast_global_variables({root_rank!r}): Keras 3 keeps no global variable collection. "
        f"Use hvd.broadcast_variables(model.variables, root_rank={root_rank!r}) after the model is built, "
        f"or pass hvd.callbacks.BroadcastGlobalVariablesCallback({root_rank!r}) to fit().")

