"""Reach the numpy-level core from each Keras backend, eagerly and inside compiled steps.

- tensorflow: the ops of ``hvddp.tensorflow`` (``tf.numpy_function``; not under XLA).
- torch: tensors to numpy and back, outside ``torch.compile`` graphs.
- jax: ``jax.experimental.io_callback(ordered=True)`` under ``jax.jit``; eager arrays directly.

Only the active backend's framework is imported, and only when first needed.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

import hvddp

from hvddp import _grouping, _staged
from hvddp._dtypes import bfloat16


def name() -> str:
    import keras

    return keras.backend.backend()


def unwrap(value: Any) -> Any:
    """Return a Keras variable's current value, or a list or tuple of numbers as a tensor of the
    active backend (as Horovod's Keras package makes one of it), or, on the TensorFlow backend,
    a numpy value or number as ``tf.constant(value)`` (Horovod's, so a tensor comes back as
    there); anything else unchanged."""
    import keras

    if isinstance(value, (list, tuple)):
        return keras.ops.convert_to_tensor(value)
    if is_numpy(value) and name() == "tensorflow":
        import tensorflow as tf

        return tf.constant(value)
    return value.value if isinstance(value, keras.Variable) else value


def needs_grad(value: Any) -> bool:
    """A torch tensor autograd is recording (torch backend only)."""
    import torch

    from hvddp.torch.mpi_ops import _needs_grad

    return isinstance(value, torch.Tensor) and _needs_grad(value)


def is_numpy(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic, int, float, bool))


# torch ------------------------------------------------------------------------------------
def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.cpu().contiguous().view(torch.int16).numpy().view(bfloat16())
    return t.cpu().numpy()


def _torch_from_numpy(a: np.ndarray, like: Any) -> Any:
    import torch

    a = np.asarray(a)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        a = a.copy(order="C")
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(a).to(like.device)


def _torch_call(fn: Callable[..., List[np.ndarray]], tensors: Sequence[Any]) -> List[Any]:
    import torch

    @torch.compiler.disable
    def run(*ts):
        return [_torch_from_numpy(a, t) for a, t in zip(fn(*[_torch_to_numpy(t) for t in ts]), ts)]

    return run(*tensors)


# jax --------------------------------------------------------------------------------------
# Set when an hvddp callback raised. On a GPU, JAX keeps that error in the token that orders
# io_callback(ordered=True) effects, and every later ordered callback of the process then fails
# with the same error before it runs (seen on an H200: after one MismatchError, a correct new
# model could not train). CPU executions leave the token clean.
_callback_failed = threading.Event()


def _renew_effect_tokens() -> None:
    """After a failed callback, wait out in-flight work and give JAX fresh effect tokens.

    Runs where hvddp is traced or called eagerly, on the dispatching thread (JAX keeps its tokens
    per thread), so a model traced after the failure trains. A step compiled before it keeps
    failing until something is traced again (``model.compile`` makes Keras retrace).
    """
    if not _callback_failed.is_set():
        return
    _callback_failed.clear()
    try:
        from jax._src import dispatch

        tokens = dispatch.runtime_tokens
        pending = list(tokens.current_tokens.values()) + list(tokens.output_runtime_tokens.values())
    except (ImportError, AttributeError):  # a JAX without these internals: nothing to renew
        return
    for token in pending:
        try:
            token.block_until_ready()
        except Exception:  # the failure already reached its caller
            pass
    tokens.clear()


def jax_tracing(tensors: Sequence[Any] = ()) -> bool:
    """Whether JAX is tracing (``jax.jit``, ``lax.cond``, ``jax.grad``...): then a collective must
    be staged (``io_callback``) even when its inputs are concrete arrays the traced function
    closes over, else it would run once, at trace time (Keras' accumulation ``cond`` traces both
    branches of an eager ``apply`` so)."""
    import jax

    if any(isinstance(t, jax.core.Tracer) for t in tensors):
        return True
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # a JAX without it: a fresh array is a tracer exactly while tracing
        return isinstance(jax.numpy.zeros(()), jax.core.Tracer)
    return not trace_state_clean()


def _jax_call(fn: Callable[..., List[np.ndarray]], tensors: Sequence[Any],
              out_shapes: Optional[Sequence[tuple]] = None) -> List[Any]:
    import jax
    from jax.experimental import io_callback

    if not jax_tracing(tensors):
        # eager: the core, directly (through io_callback an eager call was many times slower,
        # and its errors came wrapped in JAX's JaxRuntimeError, not hvddp's types)
        _renew_effect_tokens()
        jax.effects_barrier()  # after the collectives of steps still running (ordered effects)
        return [jax.numpy.asarray(a) for a in fn(*[np.asarray(t) for t in tensors])]
    shapes = out_shapes or [tuple(t.shape) for t in tensors]
    result = [jax.ShapeDtypeStruct(s, t.dtype) for s, t in zip(shapes, tensors)]

    def callback(*arrays):
        try:
            return [np.asarray(a) for a in fn(*[np.asarray(a) for a in arrays])]
        except BaseException as exc:
            _callback_failed.set()
            _staged.note(exc)  # JAX re-raises it as a JaxRuntimeError: fit() raises it as itself
            raise

    _renew_effect_tokens()
    try:
        return list(io_callback(callback, result, *tensors, ordered=True))
    except ValueError as exc:
        if "JVP" not in str(exc):
            raise
        raise ValueError("hvddp.keras collectives are not differentiable on the JAX backend (they run "
                         "through jax.experimental.io_callback); reduce outside jax.grad, or use the "
                         "TensorFlow or torch backend, whose allreduce is.") from exc


def call(fn: Callable[..., List[np.ndarray]], tensors: Sequence[Any],
         out_shapes: Optional[Sequence[tuple]] = None) -> List[Any]:
    """Run ``fn`` (numpy arrays in, same-dtype numpy arrays out) on backend tensors.

    ``out_shapes`` is needed under ``jax.jit`` when outputs differ in shape from inputs.
    """
    backend = name()
    if backend == "torch":
        return _torch_call(fn, tensors)
    if backend == "jax":
        return _jax_call(fn, tensors, out_shapes)
    if backend == "tensorflow":
        import tensorflow as tf

        from hvddp.tensorflow.ops import _check_xla, _noting

        _check_xla("hvddp.keras collective")
        outs = tf.numpy_function(_noting(fn), list(tensors), [t.dtype for t in tensors],
                                 stateful=True, name="HvddpKeras")
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for o, t, s in zip(outs, tensors, out_shapes or [None] * len(tensors)):
            o.set_shape(t.shape if s is None else s)
        return outs
    raise hvddp.BackendUnavailableError(
        f"hvddp.keras supports the tensorflow, torch and jax backends; Received: KERAS_BACKEND={backend!r}.")


def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any], labels: Sequence[str], prefix: str,
                     op: Any, gradient_predivide_factor: float, postscale: float, compression: Any,
                     process_set: Any, counts: int = 0, sparse_as_dense: bool = False) -> List[Any]:
    """Reduce a step's (non-None) gradients as one grouped submission on the active backend; the
    last ``counts`` are bookkeeping members (see ``_grouping.reduce_group``). TensorFlow's sparse
    gradients are gathered unless ``sparse_as_dense`` (see ``hvddp.tensorflow.ops.reduce_gradients``)."""
    backend = name()
    if backend == "tensorflow":
        import tensorflow as tf

        from hvddp.tensorflow.ops import reduce_gradients as tf_reduce

        reduced = tf_reduce(grads, variables, labels, prefix, op, gradient_predivide_factor, compression,
                            process_set, counts, sparse_as_dense)
        if postscale == 1.0:
            return reduced
        return [tf.IndexedSlices(r.values * postscale, r.indices, r.dense_shape) if isinstance(r, tf.IndexedSlices)
                else r * postscale for r in reduced]
    def reduce(*tensors):
        size = process_set.size()
        red_op, pre, post = _grouping.average_factors(op, gradient_predivide_factor, size)
        post *= postscale
        def fn(*arrays):
            return _grouping.reduce_group(arrays, prefix, labels, red_op, pre, post, compression, process_set,
                                          counts)

        return call(fn, tensors)

    if backend == "torch":
        import torch

        reduce = torch.compiler.disable(reduce)  # torch.compile: run the exchange outside the graph
    return reduce(*grads)


def to_numpy(value: Any) -> np.ndarray:
    """Return an eager backend tensor (or Keras variable) as a numpy array."""
    if hasattr(value, "numpy") and name() != "torch":
        return np.asarray(value.numpy())
    if name() == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            return _torch_to_numpy(value)
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))
