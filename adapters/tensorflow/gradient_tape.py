"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient`` averages across ranks."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import tensorflow as tf

import hvddp
from hvddp import Compression, ProcessSet, global_process_set

from hvddp import _grouping
from .ops import drop_absent, reduce_gradients

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "source_label"]


def source_label(source: Any, index: int) -> str:
    """Return how error messages name ``source``'s gradient (not a collective's name: paths may
    differ across ranks of one model).

    Keras variables use ``variable.path``; ``tf.Variable`` its ``name``; other sources their
    position in the list.
    """
    path = getattr(source, "path", None)
    if isinstance(path, str) and path:
        return path
    if isinstance(source, tf.Variable):
        return source.name
    return f"source{index}"


class _DistributedGradientTapeMixin:
    """Methods added to the wrapped tape's class; state lives in the tape's own attributes."""

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """Return the gradients of ``target``, averaged across ranks (or summed, or combined by
        Adasum: the tape's ``op``).

        Same arguments as ``tf.GradientTape.gradient``, and Horovod's ``use_generic_names`` in
        Horovod's position (accepted; hvddp's names never carry the sources' names); an
        ``unconnected_gradients`` passed fourth, TensorFlow's position, is taken as that.
        Every rank must call it with the same
        sources (same shapes and dtypes). A ``None`` gradient is reduced as zeros, so where
        another rank has a gradient this rank gets the average (Adasum leaves the zeros out: the
        others' combination); one that no rank had stays ``None`` (an optimizer then skips it, as
        in one process). Inside a ``tf.function`` a gradient that is ``None`` on some ranks only
        raises on every rank. Sparse gradients (``tf.IndexedSlices``) are gathered (every rank's rows,
        scaled as the average; as one process's on the whole batch), or reduced as dense ones
        with ``sparse_as_dense=True``.

        Gradients of sources registered with ``register_local_source`` are not reduced: they
        come back as this rank's own, divided by the process set's size when the tape was made
        with ``scale_local_gradients=True`` (Horovod's default).

        Raises:
            hvddp.MismatchError: ranks pass different sources (names the first difference).
        """
        if isinstance(use_generic_names, (tf.UnconnectedGradients, str)):  # TensorFlow's 4th
            unconnected_gradients = use_generic_names
        outer = self._hvddp["outer"]
        if outer is not None and outer._recording and not outer._persistent:
            # called inside the with block of the tape wrapped there: stop its recording, as
            # TensorFlow's gradient() does for a non-persistent tape (its __exit__ then does nothing)
            outer._pop_tape()
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        settings = self._hvddp
        ps = settings["process_set"]
        local = [_is_local(s, settings["local"]) for s in flat_sources]
        if not ps.included():  # outside the set: its own gradients, as in Horovod
            return tf.nest.pack_sequence_as(sources, self._scale_local(list(flat_grads), local))
        if hvddp.size() == 1 and ps is global_process_set and settings["compression"] is Compression.none:
            return grads
        shared = [i for i, is_local in enumerate(local) if not is_local]
        labels = [source_label(flat_sources[i], i) for i in shared]
        # which ranks have each gradient, as one more member of the group: 1 per gradient, then a 1
        present = [flat_grads[i] is not None for i in shared]
        flags = tf.constant(np.array(present + [True], dtype=np.float32))
        reduced: List[Any] = reduce_gradients([flat_grads[i] for i in shared] + [flags],
                                              [flat_sources[i] for i in shared] + [flags],
                                              labels + ["(which gradients exist)"], "tf.grads", settings["op"],
                                              settings["gradient_predivide_factor"], settings["compression"],
                                              ps, counts=1, sparse_as_dense=settings["sparse_as_dense"])
        reduced = drop_absent(reduced[:-1], reduced[-1], present, "hvddp.tensorflow.DistributedGradientTape",
                              labels)
        out = list(flat_grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        return tf.nest.pack_sequence_as(sources, self._scale_local(out, local))

    def _scale_local(self, grads: List[Any], local: List[bool]) -> List[Any]:
        """Divide the local sources' gradients by the set's size (``scale_local_gradients``)."""
        if self._hvddp["scale_local_gradients"]:
            size = self._hvddp["process_set"].size()
            grads = [_divided(g, size) if is_local and g is not None else g for g, is_local in zip(grads, local)]
        return grads

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank: ``gradient()`` does not reduce it (Horovod's)."""
        self._hvddp["local"][_ref(source)] = source  # kept alive, so its id stays its own

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """Horovod's: ``gradient()``, split into ``([(local source, gradient)], [(other source,
        gradient)])`` in the order of ``sources``; ``use_generic_names`` as in ``gradient()``."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        # flattened: one variable given alone would zip its elements with its gradient's
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)))
        local = self._hvddp["local"]
        return ([p for p in pairs if _is_local(p[0], local)], [p for p in pairs if not _is_local(p[0], local)])


def _ref(source: Any) -> Any:
    return source.ref() if hasattr(source, "ref") else id(source)


def _is_local(source: Any, local: dict) -> bool:
    return bool(local) and _ref(source) in local


def _divided(grad: Any, size: int) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


_classes = {}


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Any = Compression.none, sparse_as_dense: bool = False,
                            op: Any = hvddp.Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None,
                            process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages the gradients across ranks (``op``).

    The result is a ``tf.GradientTape`` (of a subclass of the tape's class) sharing the tape's
    recording; wrap it after the ``with`` block, or wrap a fresh tape and enter the wrapper.
    All of a call's gradients go to the engine as one group, under one fixed name.

    Args:
        gradtape: the ``tf.GradientTape`` to wrap.
        device_dense, device_sparse, num_groups, groups: accepted for Horovod compatibility;
            hvddp always reduces one group per ``gradient()`` call.
        sparse_as_dense: reduce sparse gradients (``tf.IndexedSlices``) as dense tensors
            instead of gathering every rank's rows.
        compression: ``hvddp.Compression.none``, ``.fp16`` or ``.bf16``.
        op: ``hvddp.Average`` (default), ``hvddp.Sum``, or ``hvddp.Adasum``: the gradients are
            combined by Adasum (as Horovod's tape does), per tensor, which needs a process set
            whose size is a power of two (Horovod's guidance: the learning rate needs no
            scaling by the number of ranks). Local sources are not combined, as with any op.
        gradient_predivide_factor: divide by this before the sum and by ``size / factor`` after
            (Average only).
        process_set: the ranks that average.
        scale_local_gradients: divide the gradients of sources registered with
            ``tape.register_local_source(variable)`` (kept local, not reduced) by the process
            set's size, as Horovod does.

    Raises:
        TypeError, ValueError: a bad argument (``op=Adasum`` on a process set whose size is not a
            power of two raises ``ValueError`` here, on every rank, before anything is reduced).

    Example:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape; Received: "
                        f"gradtape={type(gradtape).__name__}.")
    if isinstance(gradtape, _DistributedGradientTapeMixin):
        raise ValueError("DistributedGradientTape: this tape is already distributed; wrap it once.")
    _grouping.check_process_set(process_set, "DistributedGradientTape")
    op = _grouping.check_op(op, None, "DistributedGradientTape", adasum=True)
    if op not in (hvddp.Average, hvddp.Sum, hvddp.Adasum):
        raise ValueError(f"DistributedGradientTape: op must be hvddp.Average, hvddp.Sum or hvddp.Adasum; "
                         f"Received: op={op!r}.")
    factor = _grouping.check_predivide(op, gradient_predivide_factor, "DistributedGradientTape")
    _grouping.check_compression(compression, "DistributedGradientTape")
    if op is hvddp.Adasum:
        _grouping.check_adasum_size(process_set, "DistributedGradientTape")
    base = type(gradtape)
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedGradientTapeMixin, base), {"__module__": base.__module__})
        _classes[base] = cls
    tape = object.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    # Wrapped inside its ``with`` block (Horovod's examples allow it), ``gradtape`` is recording;
    # the copy must not think so too, or both would pop the one tape off TensorFlow's stack and
    # the process crashes. The original's __exit__ stops the recording both share.
    tape._recording = False
    tape._hvddp = {"outer": gradtape if gradtape._recording else None,  # still in its with block
                   "op": op, "gradient_predivide_factor": factor, "compression": compression,
                   "process_set": process_set, "local": {},
                   "scale_local_gradients": bool(scale_local_gradients), "sparse_as_dense": bool(sparse_as_dense)}
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = hvddp.Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """``DistributedGradientTape`` that keeps the gradients of ``local_layers`` on each rank.

    ``local_layers`` is a Keras layer or a list of them; their trainable weights are registered
    with ``register_local_source``, so their gradients are not reduced (and are divided by the
    process set's size when ``scale_local_gradients``, as in Horovod). The other arguments are
    ``DistributedGradientTape``'s.
    """
    from hvddp.keras.optimizer import local_layer_weights

    weights = local_layer_weights(local_layers, "PartialDistributedGradientTape")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for weight in weights:
        tape.register_local_source(weight)
    return tape
