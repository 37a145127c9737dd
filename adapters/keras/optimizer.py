"""``DistributedOptimizer`` for Keras 3 and ``load_model``.

The wrapper is an instance of a subclass of the wrapped optimizer's class, created once per
class with the same name and module, whose ``apply`` (and ``stateless_apply``, used by the JAX
trainer) averages the gradients across ranks before handing them to the class's own method.
``get_config`` is the wrapped class's, so a saved model names, say, ``Adam`` from
``keras.optimizers`` and reloads without hvddp.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Dict, List, Optional

import keras
import numpy as np

import hvddp
from hvddp import Compression, ProcessSet, global_process_set

from hvddp import _grouping

from . import _backend, _keras2

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "is_distributed"]

_LossScaleOptimizer = keras.optimizers.LossScaleOptimizer
# keras.optimizers.MultiOptimizer and its OptimizerMap came in Keras 3.15: before, no optimizer has a map
_OptimizerMap = getattr(keras.optimizers, "OptimizerMap", None)
_classes: Dict[type, type] = {}


def _default_settings() -> Dict[str, Any]:
    return {"op": hvddp.Average, "gradient_predivide_factor": 1.0, "compression": Compression.none,
            "process_set": global_process_set, "postscale": 1.0, "passthrough": False, "in_stateless": False,
            "local": {}, "scale_local_gradients": True, "deferred": False, "deferred_variables": None, "passes": 1,
            "sparse_as_dense": False}


class _CallableList(list):
    """A list that gives itself back when called, so ``opt.variables()`` (Keras 2's method) and
    ``opt.variables`` (Keras 3's property) both work on the wrapper, as on Horovod's."""

    def __call__(self) -> "_CallableList":
        return self


class _DistributedOptimizerMixin:
    """Averages gradients across ranks in ``apply``/``stateless_apply``; everything else is the
    wrapped class's. Settings live in ``self._hvddp`` (a plain dict, not tracked by Keras)."""

    _hvddp: Optional[Dict[str, Any]] = None

    @property
    def variables(self):
        """The wrapped class's ``variables``, also callable: Horovod 0.28.1's wrapper kept Keras 2
        scripts' ``hvd.broadcast_variables(opt.variables(), root_rank=0)`` working."""
        return _CallableList(super().variables)

    def _hvddp_settings(self) -> Dict[str, Any]:
        settings = self.__dict__.get("_hvddp")
        if settings is None:  # created by from_config (e.g. a custom_objects mapping)
            settings = _default_settings()
            config = self.get_config()  # accumulated passes summed, as DistributedOptimizer's and
            # load_model's defaults do (with 1.0, the copy's update was the passes' count too small)
            settings.update(postscale=_passes_postscale(config, False), passes=_passes(config))
            object.__setattr__(self, "_hvddp", settings)
        return settings

    def _hvddp_allreduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        if _backend.name() == "torch":  # torch.compile (jit_compile=True): the whole reduction
            # outside the graph, as one call. Traced, its numpy reads (which gradients exist)
            # broke the graph inside it, and the frame resumed there was compiled again at every
            # step until dynamo's recompile limit (a warning, then that frame ran eagerly).
            import torch

            return torch.compiler.disable(self._hvddp_allreduce_now)(grads, variables)
        return self._hvddp_allreduce_now(grads, variables)

    def _hvddp_allreduce_now(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        settings = self._hvddp_settings()
        if len(grads) == len(variables) and any(_overwritten(v) for v in variables):
            return self._hvddp_reduce_overwritten(grads, variables, settings)
        return self._hvddp_allreduce_gradients(grads, variables, settings)

    def _hvddp_reduce_overwritten(self, grads: List[Any], variables: List[Any],
                                  settings: Dict[str, Any]) -> List[Any]:
        """Float8 training's scales and amax histories (``overwrite_with_gradient``): their
        "gradient" is the variable's next value, which Keras assigns (the maximum over
        accumulated passes). Across ranks that is the maximum too, as one process computes it on
        the whole batch (a scale grows with the amax it is made from); never averaged, summed or
        scaled by the passes, which made them drift by the factor every step."""
        ps = settings["process_set"]
        local = settings["local"]  # a local layer's scales are this rank's own: left as they are
        kept = {i for i, v in enumerate(variables) if _overwritten(v) and id(v) in local}
        which = [i for i, v in enumerate(variables)
                 if _overwritten(v) and grads[i] is not None and i not in kept]
        chosen = set(which) | kept
        rest = [i for i in range(len(grads)) if i not in chosen]
        out = list(grads)
        if which and ps.included() and ps.size() > 1:
            maxed = _backend.reduce_gradients([grads[i] for i in which], [variables[i] for i in which],
                                              [_label(variables[i], i) for i in which], "keras.grads.overwrite",
                                              hvddp.Max, 1.0, 1.0, Compression.none, ps)
            for i, g in zip(which, maxed):
                out[i] = g
        if rest:
            reduced = self._hvddp_allreduce_gradients([grads[i] for i in rest], [variables[i] for i in rest],
                                                      settings)
            for i, g in zip(rest, reduced):
                out[i] = g
        return out

    def _hvddp_allreduce_gradients(self, grads: List[Any], variables: List[Any],
                                   settings: Dict[str, Any]) -> List[Any]:
        ps = settings["process_set"]
        local = [id(v) in settings["local"] for v in variables] if settings["local"] else []
        if not ps.included():  # a rank outside the set trains on its own gradients, as in Horovod
            factors = [_local_factor(settings) if is_local else settings["postscale"]  # (summed passes)
                       for is_local in local or [False] * len(grads)]
            return [_scaled(g, f) for g, f in zip(grads, factors)]
        if ps.size() == 1:  # nothing to reduce, and nothing to compress for it (as Horovod at one
            # rank): the summed passes' scale alone, in the backend's ops (so XLA compiles the step)
            return [_scaled(g, settings["postscale"]) for g in grads]
        if len(grads) != len(variables):
            raise ValueError(f"{type(self).__name__}: got {len(grads)} gradients for the {len(variables)} "
                             f"variables it updates; pass one gradient per trainable variable. If a "
                             f"layer's `trainable` changed after this optimizer was built (fine-tuning), "
                             f"compile the model again with a new DistributedOptimizer: Keras' optimizers "
                             f"do not take on new variables.")
        if any(local):  # registered local variables keep this rank's gradient
            _check_no_global_clipnorm(self)
            return self._hvddp_reduce_shared(grads, variables, local, settings)
        return self._hvddp_reduce(grads, variables, settings)

    def _hvddp_reduce_shared(self, grads: List[Any], variables: List[Any], local: List[bool],
                             settings: Dict[str, Any]) -> List[Any]:
        """Reduce the gradients of the variables that are not local; scale the local ones.

        Under loss scaling, the finite check must decide the same on every rank, but each rank's
        local gradients are its own: whether they are all finite travels in the group, and where
        some rank's are not, every rank's local gradients become NaN, so every rank skips the step.
        """
        shared = [i for i, is_local in enumerate(local) if not is_local]
        mine = [i for i, is_local in enumerate(local) if is_local and grads[i] is not None]
        members, member_vars = [grads[i] for i in shared], [variables[i] for i in shared]
        check = isinstance(self, _LossScaleOptimizer)  # the same on every rank (the lists match)
        if check:
            finite = keras.ops.all(keras.ops.stack([keras.ops.all(keras.ops.isfinite(_values(grads[i])))
                                                    for i in mine])) if mine else keras.ops.convert_to_tensor(True)
            members.append(keras.ops.reshape(keras.ops.cast(keras.ops.logical_not(finite), "float32"), (1,)))
            member_vars.append(_Member("(whether local gradients are finite)"))
        reduced = self._hvddp_reduce(members, member_vars, settings, counts=int(check))
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        factor = _local_factor(settings)
        if check:  # NaN where some rank's local gradients were not finite, in the same multiply
            factor = keras.ops.where(reduced[-1][0] > 0, float("nan"), factor)
        for i in mine:
            out[i] = _scaled(out[i], keras.ops.cast(factor, _values(out[i]).dtype) if check else factor)
        return out

    def _hvddp_reduce(self, grads: List[Any], variables: List[Any], settings: Dict[str, Any],
                      counts: int = 0) -> List[Any]:
        """Reduce ``grads`` as one group; the last ``counts`` are bookkeeping members (see
        ``_grouping.reduce_group``)."""
        ps = settings["process_set"]
        present = [g is not None for g in grads]
        grads = [keras.ops.zeros(v.shape, dtype=v.dtype) if g is None else g
                 for g, v in zip(grads, variables)]
        labels = [_label(v, i) for i, v in enumerate(variables)]
        # which ranks have each gradient: not while JAX traces (its fit never gives None, and the
        # flags could not be read there); an eager apply on JAX may get None, as the others may
        flagged = _backend.name() != "jax" or not _backend.jax_tracing(grads)
        if flagged:  # which ranks have each gradient, as one more member: 1 per gradient, then a 1
            grads.append(keras.ops.convert_to_tensor(np.array(present + [True], dtype="float32")))
            variables = variables + [None]
            labels = labels + ["(which gradients exist)"]
            counts += 1
        reduced = _backend.reduce_gradients(grads, variables, labels, "keras.grads", settings["op"],
                                            settings["gradient_predivide_factor"], settings["postscale"],
                                            settings["compression"], ps, counts, settings["sparse_as_dense"])
        return _drop_absent(reduced[:-1], reduced[-1], present, labels[:-1]) if flagged else reduced

    def __deepcopy__(self, memo):
        """A copy that reduces as this one does, with its state (Keras copies an optimizer through
        its saved form, which names the wrapped class: the copy averaged nothing). Registered
        local variables stay registered: they are the model's, which is not copied."""
        settings = self._hvddp_settings()
        with _objects_kept(self):
            twin = type(self).from_config(self.get_config())
        _reshare(twin, self)
        _copy_unconfigured(twin, self)
        # (a copy of a LossScaleOptimizer's inner one reduces itself: nothing wraps it any more)
        object.__setattr__(twin, "_hvddp", dict(settings, local=dict(settings["local"]), passthrough=False,
                                                in_stateless=False, deferred=False, deferred_variables=None))
        if self.built:
            twin.build(list(self._trainable_variables))
            _copy_state(twin, self)
        memo[id(self)] = twin
        return twin

    def __reduce__(self):
        raise TypeError(f"a DistributedOptimizer ({type(self).__name__}) cannot be pickled: Keras pickles an "
                        f"optimizer by its class, which hvddp makes at run time. Save the model (model.save; "
                        f"hvd.load_model wraps its optimizer again), or pickle the plain optimizer and wrap it "
                        f"after unpickling.")

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: it is not reduced (Horovod's). It is divided by
        the process set's size when the optimizer was made with ``scale_local_gradients=True``.
        Not with ``global_clipnorm`` (``ValueError``): see ``_check_no_global_clipnorm``."""
        _check_no_global_clipnorm(self)
        self._hvddp_settings()["local"][id(var)] = var  # kept alive, so its id stays its own

    def apply(self, grads, trainable_variables=None):
        """Average ``grads`` across ranks, then apply them with the wrapped optimizer's rule.

        A ``None`` gradient is sent as zeros, so every rank submits the same group; one that no
        rank had is handed on as ``None`` (the wrapped optimizer skips it, as in one process).
        With accumulated passes the average waits for the update pass (``_clip_gradients``).
        """
        settings = self._hvddp_settings()
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = list(trainable_variables if trainable_variables is not None
                         else getattr(self, "_trainable_variables", []))
        deferred = self._hvddp_deferred(variables)
        if not (settings["passthrough"] or settings["in_stateless"] or deferred):
            _check_adasum_every_pass(settings)
            grads = self._hvddp_allreduce(grads, variables)
        settings["deferred"] = deferred
        try:
            return super().apply(grads, trainable_variables)
        finally:
            settings["deferred"] = False

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Average ``grads`` across ranks, then run the wrapped class's ``stateless_apply``."""
        settings = self._hvddp_settings()
        grads = list(grads)
        if not (settings["passthrough"] or self._hvddp_deferred(list(self._trainable_variables))):
            _check_adasum_every_pass(settings)
            grads = self._hvddp_allreduce(grads, list(self._trainable_variables))
        settings["in_stateless"] = True
        try:
            return super().stateless_apply(optimizer_variables, grads, trainable_variables)
        finally:
            settings["in_stateless"] = False

    def _hvddp_deferred(self, variables: List[Any]) -> bool:
        """Whether this optimizer accumulates passes itself and averages only their sum, once per
        update (Horovod's ``backward_passes_per_step``: one reduction per update, not per pass).
        Not under a ``LossScaleOptimizer`` (its finite check must see averaged gradients at every
        pass) nor with float8 scales (Keras assigns them at every pass): there each pass is
        averaged before Keras accumulates it, the same sum with more traffic."""
        settings = self._hvddp_settings()
        return (not settings["passthrough"] and (self.gradient_accumulation_steps or 1) > 1
                and not isinstance(self, _LossScaleOptimizer) and not any(_overwritten(v) for v in variables))

    def _backend_apply_gradients(self, grads, trainable_variables):
        settings = self._hvddp_settings()
        if not settings.get("deferred"):
            return super()._backend_apply_gradients(grads, trainable_variables)
        settings["deferred_variables"] = list(trainable_variables)  # (Keras dropped the None ones)
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            settings["deferred_variables"] = None

    def _clip_gradients(self, grads):
        """With deferred passes, average the accumulated gradients across ranks on the update pass,
        before clipping (and weight decay), as one process clips the whole batch's gradients.

        Keras calls this with the passes' mean on the update pass (the TensorFlow and torch
        backends only then; JAX at every pass, keeping the update only on that one), so the
        reduction runs under ``cond`` on the update pass alone, inside compiled steps too.
        Which gradients are None is each rank's (Keras drops them first): ranks that differ there
        get a ``MismatchError`` naming the variables, on every rank.
        """
        variables = self._hvddp_settings().get("deferred_variables")
        if variables is not None:
            grads = list(grads)
            update = (self._iterations + 1) % self.gradient_accumulation_steps == 0
            grads = keras.ops.cond(update, lambda: self._hvddp_allreduce(list(grads), variables),
                                   lambda: list(grads))
        return super()._clip_gradients(grads)

    def build(self, var_list):
        outer = _enclosing_loss_scale_optimizer(self)
        if outer is not None:
            _move_reduction_to(outer, self)
        return super().build(var_list)


def average_accumulators(optimizer: Any, process_set: ProcessSet, name: str) -> None:
    """Make the gradient accumulators of an optimizer that defers its passes (``_hvddp_deferred``)
    their average over its process set.

    Between updates each rank's accumulators hold its own passes' sum: the one part of the
    optimizer's state that differs between replicas. Copied from rank 0 to every rank (a
    broadcast, a checkpoint rank 0 writes), the next update would use rank 0's partial sum
    instead of the ranks' average; the average gives the update leaving them would (the update is
    linear in them; with Adasum, close to it). Local variables' accumulators stay the rank's own.
    Only when every rank's optimizer is at the same iteration: where they differ (a state restored
    on some ranks only, say rank 0's from ``hvd.load_model``, or workers an elastic job just
    added), the others' accumulators are no partial sums of the same update, and the root's are
    copied as they are. Collective over ``process_set``'s members when it is the optimizer's set
    (same on every rank); otherwise, and outside the set, nothing happens.
    """
    if not isinstance(optimizer, _DistributedOptimizerMixin) or not optimizer.built:
        return
    settings = optimizer._hvddp_settings()
    ps = settings["process_set"]
    if ps is not process_set or not ps.included() or ps.size() == 1:
        return
    variables = list(optimizer._trainable_variables)
    if not optimizer._hvddp_deferred(variables):
        return
    # the passes run (Keras' ``iterations`` counts updates: the partial sums of passes 1, 5, 9...
    # of 2-pass updates were copied from rank 0 unaveraged)
    step = int(np.asarray(_backend.to_numpy(optimizer._iterations)))
    low, negated_high = hvddp.allreduce(np.array([step, -step], dtype=np.int64), op=hvddp.Min,
                                        name=f"{name}.iterations", process_set=ps)
    if low != -negated_high or step % optimizer.gradient_accumulation_steps == 0:
        return  # not in step (see above), or at an update's end, where every accumulator is zero
    shared = [v for v in variables if id(v) not in settings["local"]]
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in shared]
    if not accumulators:
        return
    values = [np.array(_backend.to_numpy(a)) for a in accumulators]
    averaged = _grouping.reduce_group(values, name, [_label(v, i) for i, v in enumerate(shared)], hvddp.Average, 1.0, 1.0,
                                      Compression.none, ps)
    for accumulator, value in zip(accumulators, averaged):
        accumulator.assign(value)


def _check_adasum_every_pass(settings: Dict[str, Any]) -> None:
    """Refuse Adasum where each accumulated pass is reduced on its own (see ``_hvddp_deferred``):
    the Adasum of each pass, summed, is not the Adasum of the sums, which Horovod takes. Raised on
    every rank (they share the configuration), before anything is reduced."""
    if settings["op"] is hvddp.Adasum and settings["passes"] > 1:
        raise ValueError(
            f"DistributedOptimizer: op=Adasum with {settings['passes']} passes per step combines the "
            f"accumulated passes once, where the optimizer accumulates them itself; under a "
            f"LossScaleOptimizer (the mixed_float16 policy) or with float8 layers each pass is reduced "
            f"on its own, and the Adasum of each pass summed is not the Adasum of the sums. Use "
            f"op=Average there, or one pass per step.")


def _check_no_global_clipnorm(optimizer: Any) -> None:
    """Local variables and ``global_clipnorm`` do not mix: the norm would take in each rank's own
    local gradients, so each rank would clip the averaged gradients by its own factor and the
    replicas drift apart (1e-3 after an epoch, silently, in Horovod too). Raised on every rank
    (they share the configuration) when a local variable is registered and at each step."""
    clip = getattr(optimizer, "global_clipnorm", None) or getattr(
        getattr(optimizer, "inner_optimizer", None), "global_clipnorm", None)
    if clip:
        raise ValueError(
            f"{type(optimizer).__name__}: global_clipnorm={clip} with local variables (registered with "
            f"register_local_var, or PartialDistributedOptimizer's local_layers): the global norm "
            f"would include each rank's own local gradients, so every rank would clip the averaged "
            f"gradients by a different factor and the replicas would drift apart. Use clipnorm (per "
            f"variable) or clipvalue, or no local variables.")


def _label(variable: Any, index: int) -> str:
    """How error messages name ``variable``'s gradient: a Keras variable's ``path``, a plain
    ``tf.Variable``'s ``name`` (Keras 3 optimizers take those too), else its position."""
    for attr in ("path", "name"):
        value = getattr(variable, attr, None)
        if isinstance(value, str) and value:
            return value
    return f"variable{index}"


def _overwritten(variable: Any) -> bool:
    """Whether Keras assigns ``variable`` its gradient instead of applying it (float8 scales)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


class _Member:
    """A group member that is no variable's gradient: what ``_hvddp_reduce`` reads of a variable."""

    __slots__ = ("shape", "dtype", "path")

    def __init__(self, path: str) -> None:
        self.shape, self.dtype, self.path = (1,), "float32", path


def _local_factor(settings: Dict[str, Any]) -> float:
    """What a local variable's gradient is multiplied by: the passes' postscale, and 1/size of
    the process set with ``scale_local_gradients`` (Horovod's, on every rank)."""
    size = settings["process_set"].size() if settings["scale_local_gradients"] else 1
    return settings["postscale"] / size


def _is_slices(grad: Any) -> bool:
    return type(grad).__name__ == "IndexedSlices"  # tf's (torch tensors also have .indices/.values)


def _values(grad: Any) -> Any:
    return grad.values if _is_slices(grad) else grad


def _scaled(grad: Any, factor: Any) -> Any:
    if grad is None or (isinstance(factor, float) and factor == 1.0):
        return grad
    if _is_slices(grad):
        return type(grad)(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def _drop_absent(reduced: List[Any], flags: Any, present: List[bool], labels: List[str]) -> List[Any]:
    """None for the gradients no rank had (see ``hvddp.tensorflow.ops.drop_absent``, which the
    TensorFlow backend uses, also inside a ``tf.function``)."""
    if _backend.name() == "tensorflow":
        from hvddp.tensorflow.ops import drop_absent

        return drop_absent(reduced, flags, present, "hvddp.keras", labels)
    share = np.asarray(keras.ops.convert_to_numpy(flags), dtype=np.float64)
    return [None if share[i] == 0.0 else r for i, r in enumerate(reduced)]


def _enclosing_loss_scale_optimizer(inner: Any) -> Optional[Any]:
    """The ``LossScaleOptimizer`` whose ``build`` is building ``inner``, if any.

    Keras' ``compile`` wraps the optimizer in a ``LossScaleOptimizer`` under the
    ``mixed_float16`` policy. Averaging inside it would run only on ranks whose gradients are
    finite, so the reduction moves to the outer optimizer, before its finite check.
    """
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _LossScaleOptimizer) and candidate.inner_optimizer is inner:
            return None if isinstance(candidate, _DistributedOptimizerMixin) else candidate
        frame = frame.f_back
    return None


def _move_reduction_to(outer: Any, inner: Any) -> None:
    frame = None if _tracing_tf_function() else sys._getframe(1)
    while frame is not None:  # building lazily inside the outer optimizer's first apply?
        if frame.f_code.co_name in ("apply", "stateless_apply") and frame.f_locals.get("self") is outer:
            raise ValueError(
                "a LossScaleOptimizer wraps an hvddp DistributedOptimizer and is being built inside "
                "its first apply(): the average would run after the loss-scale finite check, where a "
                "rank with overflowing gradients skips it. Wrap the other way round, "
                "hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt)), or build the "
                "LossScaleOptimizer itself (model.optimizer after compile) before the first step: "
                "model.optimizer.build(model.trainable_variables).")
        frame = frame.f_back
    # the outer one reduces from now on: not in pass-through mode even when ``inner`` is (compiled
    # again, a new LossScaleOptimizer around it, the earlier one having taken its reduction)
    settings = dict(inner._hvddp_settings(), passthrough=False, in_stateless=False)
    outer.__class__ = _distributed_class(type(outer))
    object.__setattr__(outer, "_hvddp", settings)
    inner._hvddp_settings()["passthrough"] = True


def _tracing_tf_function() -> bool:
    """True while TensorFlow traces a ``tf.function`` (Keras' TF trainer builds the optimizer
    there). A function that creates variables is traced again before it runs, and that second
    trace sees the moved reduction, so building inside the first ``apply`` is safe there."""
    if _backend.name() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


def _distributed_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizerMixin, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__,
                    "__doc__": base.__doc__})
        _classes[base] = cls
        _serialize_as(cls, base)
    return cls


def _serialize_as(cls: type, base: type) -> None:
    """Make Keras serialize ``cls`` exactly as ``base`` (e.g. ``keras.optimizers.Adam``).

    Only the object-to-name direction is registered: loading the file yields ``base``.
    """
    try:
        from keras.src import api_export
        from keras.src.saving import object_registration
    except ImportError:  # pragma: no cover - Keras moved its registry; files still reload via module
        return
    public = api_export.REGISTERED_OBJS_TO_NAMES.get(base)
    if public is not None:
        api_export.REGISTERED_OBJS_TO_NAMES[cls] = public
    # a class the user registered (register_keras_serializable(package=...)) is saved under its
    # registered name, "package>Name", which is what loading looks up
    custom = object_registration.GLOBAL_CUSTOM_NAMES.get(base)
    if custom is not None:
        object_registration.GLOBAL_CUSTOM_NAMES[cls] = custom


def is_distributed(optimizer: Any) -> bool:
    """Return True if ``optimizer`` (or the optimizer a ``LossScaleOptimizer`` wraps) averages
    gradients with hvddp."""
    if isinstance(optimizer, _DistributedOptimizerMixin):
        return True
    return isinstance(optimizer, _LossScaleOptimizer) and isinstance(optimizer.inner_optimizer,
                                                                     _DistributedOptimizerMixin)


def _settings(op, gradient_predivide_factor, compression, process_set, postscale=1.0,
              passes: int = 1) -> Dict[str, Any]:
    op = _grouping.check_op(op, None, "DistributedOptimizer", adasum=True)
    if op not in (hvddp.Average, hvddp.Sum, hvddp.Adasum):
        raise ValueError(f"DistributedOptimizer: op must be hvddp.Average, hvddp.Sum or hvddp.Adasum; "
                         f"Received: op={op!r}.")
    factor = _grouping.check_predivide(op, gradient_predivide_factor, "DistributedOptimizer")
    _grouping.check_process_set(process_set, "DistributedOptimizer")
    if op is hvddp.Adasum:
        _grouping.check_adasum_size(process_set, "DistributedOptimizer")
    _grouping.check_compression(compression, "DistributedOptimizer")
    settings = _default_settings()
    settings.update(op=op, gradient_predivide_factor=factor, compression=compression, process_set=process_set,
                    postscale=float(postscale), passes=passes)
    return settings


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                         device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = hvddp.Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """Return a copy of ``optimizer`` that averages gradients across ranks before each update.

    Works with ``model.fit`` (and ``apply``/``apply_gradients`` in custom loops) on the
    tensorflow, torch and jax backends. Each step's gradients are reduced as one group under one
    fixed name; every rank must train the same model (a different one raises on every rank). A
    gradient no rank has is skipped, as in one process; one only some ranks have is averaged
    with zeros from the others. The result is an instance of a subclass of ``optimizer``'s class with the same name
    and config, so ``model.save`` writes a plain Keras optimizer; ``load_model`` wraps it again.
    Under the ``mixed_float16`` policy the average is taken before the loss-scale finite check
    (also when ``compile`` adds the ``LossScaleOptimizer`` around this one), so every rank
    skips or takes the same steps. On the TensorFlow backend the reduction cannot run inside
    XLA: ``jit_compile=True`` raises in a job of more than one rank, ``jit_compile="auto"``
    compiles without XLA.

    Args:
        optimizer: any ``keras.optimizers.Optimizer`` (including ``LossScaleOptimizer``). Its
            state is copied if it is already built.
        name: a new name for the optimizer; the wrapped one's by default.
        device_dense, device_sparse, num_groups, groups: accepted for Horovod compatibility;
            every step's gradients form one group.
        sparse_as_dense: reduce sparse gradients (``tf.IndexedSlices`` on the TensorFlow
            backend) as dense tensors instead of gathering every rank's rows.
        compression: ``hvddp.Compression.none``, ``.fp16`` or ``.bf16``.
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after (Average only).
        op: ``hvddp.Average`` (default), ``hvddp.Sum``, or ``hvddp.Adasum``: each step's
            gradients are combined by Adasum, per tensor (an extension: Horovod's Keras
            optimizers take Average and Sum only; its gradient tape combines this way)
            (float gradients, a process set whose size is a power of two; with accumulated
            passes, their sum is combined once per update, not under a ``LossScaleOptimizer``
            or with float8 layers; Horovod's guidance: the learning rate needs no scaling by the
            number of ranks).
            Local variables' gradients are not combined, as with any op.
        backward_passes_per_step: apply the update every this many batches, accumulating
            gradients in between (Keras' ``gradient_accumulation_steps``). Each rank sums its
            passes and the sums are averaged across ranks once per update (Horovod's); under a
            ``LossScaleOptimizer`` or with float8 layers every pass is averaged (the same
            result, more traffic). A gradient that is None must then be None on every rank.
        average_aggregated_gradients: with ``backward_passes_per_step > 1``, average the
            accumulated gradients over the passes instead of summing them (Horovod's default).
            An optimizer made with Keras' own ``gradient_accumulation_steps=N`` must say which:
            this (Keras' average) or ``backward_passes_per_step=N`` (the sum).
        process_set: the ranks that average.
        scale_local_gradients: divide the gradients of variables registered with
            ``optimizer.register_local_var(var)`` (kept on each rank, not reduced) by the
            process set's size, as Horovod does.

    Raises:
        TypeError, ValueError: a bad argument (named in the message); an optimizer with its own
            ``gradient_accumulation_steps`` and neither argument above; with ``op=Adasum``, a
            process set whose size is not a power of two, on every rank, before anything is
            reduced (with more than one pass per step where each pass is reduced: at the first
            step).

    Example:
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 keras.optimizers.Optimizer; Received: "
                        f"optimizer={_keras2.describe(optimizer)}.{_keras2.fix(optimizer)}")
    if is_distributed(optimizer):
        raise ValueError("DistributedOptimizer: this optimizer already averages gradients with hvddp; "
                         "wrap it once.")
    if isinstance(backward_passes_per_step, (bool, np.bool_)) \
            or not isinstance(backward_passes_per_step, numbers.Integral) or backward_passes_per_step < 1:
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step must be an int >= 1; "
                         f"Received: backward_passes_per_step={backward_passes_per_step!r}.")
    backward_passes_per_step = int(backward_passes_per_step)
    for arg, value in (("average_aggregated_gradients", average_aggregated_gradients),
                       ("sparse_as_dense", sparse_as_dense), ("scale_local_gradients", scale_local_gradients)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"DistributedOptimizer: {arg} must be True or False; Received: {arg}={value!r}.")
    with _objects_kept(optimizer):
        wrapped = _rebuilt(optimizer, backward_passes_per_step, name, op, gradient_predivide_factor,
                           compression, process_set, average_aggregated_gradients, scale_local_gradients,
                           sparse_as_dense)
    if optimizer.built:
        wrapped.build(list(optimizer._trainable_variables))
        _copy_state(wrapped, optimizer)
    return wrapped


def _rebuilt(optimizer, backward_passes_per_step, name, op, gradient_predivide_factor, compression,
             process_set, average_aggregated_gradients, scale_local_gradients, sparse_as_dense):
    """The wrapper: ``optimizer``'s class made distributed, from ``optimizer``'s config."""
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        target = _accumulation_config(config)
        if target is None:  # (Keras accumulates no gradients for it: every batch would update)
            raise ValueError(f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step} "
                             f"needs an optimizer that accumulates gradients (Keras' "
                             f"gradient_accumulation_steps), and a {type(optimizer).__name__} has none; "
                             f"Received: {type(optimizer).__name__}. Accumulate with a single optimizer "
                             f"(or a LossScaleOptimizer around one), or pass backward_passes_per_step=1.")
        existing = target.get("gradient_accumulation_steps")
        if existing not in (None, backward_passes_per_step):
            raise ValueError(f"DistributedOptimizer: the optimizer already has gradient_accumulation_steps="
                             f"{existing}; Received: backward_passes_per_step={backward_passes_per_step}.")
        target["gradient_accumulation_steps"] = backward_passes_per_step
    elif _passes(config) > 1 and not average_aggregated_gradients:
        _refuse_unchosen_passes(_passes(config))
    settings = _settings(op, gradient_predivide_factor, compression, process_set,
                         _passes_postscale(config, average_aggregated_gradients), _passes(config))
    settings["scale_local_gradients"] = bool(scale_local_gradients)
    settings["sparse_as_dense"] = bool(sparse_as_dense)
    if name is not None:
        config["name"] = name
    cls = _distributed_class(type(optimizer))
    wrapped = cls.from_config(config)
    _reshare(wrapped, optimizer)
    _copy_unconfigured(wrapped, optimizer)
    object.__setattr__(wrapped, "_hvddp", settings)
    return wrapped


def _refuse_unchosen_passes(passes: int) -> None:
    """An optimizer made with Keras' own ``gradient_accumulation_steps`` and wrapped with neither
    ``backward_passes_per_step`` nor ``average_aggregated_gradients``: Keras averages the passes,
    Horovod's default sums them, and which one the script meant is unknown (summed, each update
    was ``passes`` times the one the same optimizer makes in one process, silently; with
    ``clipnorm`` it was clipped at a ``passes`` times larger norm)."""
    raise ValueError(
        f"DistributedOptimizer: the optimizer has Keras' own gradient_accumulation_steps={passes}, "
        f"whose passes Keras averages, where Horovod's backward_passes_per_step sums them; say which: "
        f"average_aggregated_gradients=True (Keras' average, as one process computes it) or "
        f"backward_passes_per_step={passes} (Horovod's sum); Received: backward_passes_per_step=1, "
        f"average_aggregated_gradients=False. (PartialDistributedOptimizer takes neither: wrap with "
        f"DistributedOptimizer and register the local layers' weights with register_local_var.)")


@keras.saving.register_keras_serializable(package="hvddp", name="KeptObject")
class _Kept(keras.optimizers.schedules.LearningRateSchedule):
    """Stands in for an object of an optimizer's while hvddp takes its config and makes the
    wrapper from it (a learning-rate schedule or function, a MultiOptimizer's selector):
    ``from_config`` gives back the object itself. Keras would serialize it and look it up again,
    which fails for what plain training never needs to serialize: a schedule without
    ``get_config`` or not registered, a function, a lambda."""

    objects: Dict[int, Any] = {}

    def __init__(self, key: int) -> None:
        self.key = key

    def __call__(self, step):  # pragma: no cover (never in an optimizer: from_config replaces it)
        raise RuntimeError("hvddp's stand-in for a learning rate was called")

    def get_config(self) -> Dict[str, Any]:
        return {"key": self.key}

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> Any:
        return cls.objects[config["key"]]


def _is_map(value: Any) -> bool:
    return _OptimizerMap is not None and isinstance(value, _OptimizerMap)


def _family(optimizer: Any) -> List[Any]:
    """``optimizer``, a LossScaleOptimizer's inner one, a MultiOptimizer's (its map's default,
    then by key: one object under two keys is listed twice), in a fixed order."""
    out = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        out += _family(inner)
    mapping = optimizer.__dict__.get("_optimizer_map")
    if _is_map(mapping):  # by key: a rebuilt map has an
        subs = [mapping.default_optimizer] + [mapping[k] for k in sorted(mapping)]  # optimizer per key
        out += [o for sub in subs if sub is not None for o in _family(sub)]
    return out


def _kept_kind(attribute: str, value: Any) -> bool:
    if attribute == "_optimizer_map":  # a selector function (an OptimizerMap is rebuilt)
        return callable(value) and not _is_map(value)
    return isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(value) and not isinstance(value, keras.Variable) and not keras.ops.is_tensor(value))


class _objects_kept:
    """Within: ``optimizer``'s config (and its inner optimizers') holds ``_Kept`` stand-ins for
    its schedules, learning-rate functions and selector, and ``from_config`` restores the objects."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer, self.swapped = optimizer, []

    def __enter__(self) -> None:
        for opt in {id(o): o for o in _family(self.optimizer)}.values():  # (one object may be in it twice)
            for attribute in ("_learning_rate", "_optimizer_map"):
                value = opt.__dict__.get(attribute)
                if value is not None and _kept_kind(attribute, value):
                    _Kept.objects[id(value)] = value
                    opt.__dict__[attribute] = _Kept(id(value))
                    self.swapped.append((opt, attribute, value))

    def __exit__(self, *exc) -> None:
        for opt, attribute, value in reversed(self.swapped):
            opt.__dict__[attribute] = value
            _Kept.objects.pop(id(value), None)


def _reshare(wrapped: Any, optimizer: Any) -> None:
    """One optimizer under several keys of a MultiOptimizer's map (or also its default) is one
    object again in the wrapper: the config holds a copy per key, and copies would each keep
    their own state (and Keras' torch AdamW fails on one whose variables are all excluded from
    weight decay, as a bias-only copy is)."""
    mine, theirs = wrapped.__dict__.get("_optimizer_map"), optimizer.__dict__.get("_optimizer_map")
    if not (_is_map(mine) and _is_map(theirs)):
        return
    first: Dict[int, Any] = {}
    for key in [None] + list(theirs._optimizer_map):  # None: the default optimizer
        original = theirs._default_optimizer if key is None else theirs._optimizer_map[key]
        copy = mine._default_optimizer if key is None else mine._optimizer_map[key]
        shared = first.setdefault(id(original), copy)
        if shared is not copy and key is not None:
            mine._optimizer_map[key] = shared
    if len(first) != len(wrapped._inner_optimizers):  # (as MultiOptimizer's __init__ lists them)
        inner: List[Any] = []
        for opt in list(mine._optimizer_map.values()) + [mine._default_optimizer]:
            if not any(opt is seen for seen in inner):
                inner.append(opt)
        wrapped._inner_optimizers = inner


_UNCONFIGURED = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern")


def _copy_unconfigured(wrapped: Any, optimizer: Any) -> None:
    """What ``get_config`` leaves out and ``from_config`` cannot restore: the variables and name
    patterns given to ``exclude_from_weight_decay`` (without them, an AdamW's biases and norms
    were decayed). A LossScaleOptimizer's inner optimizer's too, and a MultiOptimizer's."""
    mine_all, theirs_all = _family(wrapped), _family(optimizer)
    if len(mine_all) != len(theirs_all):
        mine_all, theirs_all = mine_all[:1], theirs_all[:1]
    for mine, theirs in zip(mine_all, theirs_all):
        for attribute in _UNCONFIGURED:
            if attribute in theirs.__dict__:
                setattr(mine, attribute, theirs.__dict__[attribute])
        if hasattr(mine, "_exclude_from_weight_decay_cache"):
            mine._exclude_from_weight_decay_cache = {}


def _copy_state(wrapped: Any, optimizer: Any) -> None:
    """Copy ``optimizer``'s variables into ``wrapped``'s, matched by name (their paths differ by
    the optimizer's name). Variables only ``wrapped`` has (the gradient accumulators that
    ``backward_passes_per_step`` adds) keep their initial zeros: matched by position, the state
    landed in the wrong variables, or failed on a shape."""
    theirs: Dict[str, List[Any]] = {}
    for variable in optimizer.variables:
        theirs.setdefault(variable.name, []).append(variable)
    for mine in wrapped.variables:
        same = theirs.get(mine.name)
        if same:
            mine.assign(same.pop(0))


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: Any = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = hvddp.Average,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """``DistributedOptimizer`` that keeps the gradients of ``local_layers`` on each rank
    (Horovod's): their trainable weights are registered with ``register_local_var``. The other
    arguments are ``DistributedOptimizer``'s, in Horovod's order for this function."""
    weights = local_layer_weights(local_layers, "PartialDistributedOptimizer")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for weight in weights:
        wrapped.register_local_var(weight)
    return wrapped


def _is_layer(obj: Any) -> bool:
    return isinstance(obj, keras.layers.Layer) or (
        not isinstance(obj, type) and hasattr(obj, "trainable_weights") and hasattr(obj, "built"))


def local_layer_weights(local_layers: Any, who: str) -> List[Any]:
    """The trainable weights of ``local_layers`` (a Keras layer, a list of them, or None). A layer
    is anything with ``trainable_weights`` and ``built``, as Horovod reads it: a Keras 2
    (``tf_keras``) layer too, whose weights the TensorFlow tape keeps as well as Keras 3's."""
    if local_layers is None:
        return []
    if isinstance(local_layers, (str, bytes)) or not (_is_layer(local_layers) or hasattr(local_layers, "__iter__")):
        raise ValueError(f"{who}: local_layers must be a Keras layer or a list of them (the layer "
                         f"objects, not their names); Received: {type(local_layers).__name__} "
                         f"{local_layers!r}.")
    layers = [local_layers] if _is_layer(local_layers) else list(local_layers)
    bad = [f"{type(layer).__name__} {layer!r}" for layer in layers if not _is_layer(layer)]
    if bad:
        raise ValueError(f"{who}: local_layers must be Keras layers (the layer objects, not their "
                         f"names); Received: {', '.join(bad)}.")
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        raise ValueError(f"{who}: local layers {unbuilt} are not built yet, so they have no weights "
                         f"to keep local; build the model first (call it on a batch, or give it an "
                         f"Input), then make the optimizer.")
    return [weight for layer in layers for weight in layer.trainable_weights]


def _accumulation_config(config: dict) -> Optional[dict]:
    """The config dict that holds ``gradient_accumulation_steps`` (a LossScaleOptimizer's inner);
    None where there is none (a MultiOptimizer's)."""
    inner = config.get("inner_optimizer", {}).get("config", {})
    if "gradient_accumulation_steps" in inner:  # (before Keras 3.13 a LossScaleOptimizer's own
        return inner  # config also had the key, None: the inner optimizer's passes were missed)
    return config if "gradient_accumulation_steps" in config else None


def _passes(config: dict) -> int:
    """The batches accumulated per update (``gradient_accumulation_steps``; 1 without)."""
    return int((_accumulation_config(config) or {}).get("gradient_accumulation_steps") or 1)


def _passes_postscale(config: dict, average_aggregated_gradients: bool) -> float:
    """Keras averages accumulated passes; Horovod sums them unless told to average."""
    return 1.0 if average_aggregated_gradients else float(_passes(config))


def load_model(filepath: Any, custom_optimizers: Optional[List[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression: Any = Compression.none,
               legacy_opts: bool = False, op: Any = hvddp.Average, gradient_predivide_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, average_aggregated_gradients: bool = False,
               **kwargs: Any) -> keras.Model:
    """Load a model saved with ``model.save`` and make its optimizer average across ranks.

    The optimizer keeps its restored state (slots, iteration count). Every rank loads the file
    (save it on rank 0, then reach a ``hvd.barrier()`` or similar before loading). A saved
    ``gradient_accumulation_steps`` (``backward_passes_per_step``) sums the passes again, as
    ``DistributedOptimizer`` did, unless ``average_aggregated_gradients``.

    Args:
        filepath: the ``.keras`` file.
        custom_optimizers: optimizer classes defined by the user, registered by class name.
        custom_objects: passed to ``keras.models.load_model``.
        compression, op, gradient_predivide_factor, process_set, average_aggregated_gradients:
            as in ``DistributedOptimizer``.
        legacy_opts: Horovod's switch for Keras 2's legacy optimizers, in Horovod's position;
            accepted and ignored (Keras 3 has none).
        **kwargs: passed to ``keras.models.load_model``.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    try:
        model = keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    except Exception as exc:
        version = _keras2.saved_version(filepath)
        if version is None or version.startswith("3."):
            raise
        raise ValueError(f"load_model: {filepath!r} was saved by Keras {version} (Keras 2: tf_keras, or "
                         f"tf.keras before TensorFlow 2.16), and Keras 3 could not load it ({type(exc).__name__}: "
                         f"{exc}). hvd.load_model makes Keras 3 models; load this file with Keras 2 "
                         f"(tf.keras.models.load_model with TF_USE_LEGACY_KERAS=1) and train it with "
                         f"hvddp.tensorflow's DistributedGradientTape, or save the model again from Keras 3."
                         ) from exc
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not is_distributed(optimizer):
        config = optimizer.get_config()
        settings = _settings(op, gradient_predivide_factor, compression, process_set,
                             _passes_postscale(config, average_aggregated_gradients), _passes(config))
        optimizer.__class__ = _distributed_class(type(optimizer))
        object.__setattr__(optimizer, "_hvddp", settings)
    if optimizer is not None and _backend.name() == "tensorflow" and getattr(model, "jit_compile", False) is True:
        # Keras saves jit_compile resolved: "auto" on a machine with a GPU became True, and the
        # file recompiles with it before the optimizer is hvddp's. XLA cannot run hvddp's step.
        model.jit_compile = False
    return model
