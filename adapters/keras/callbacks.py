"""Keras callbacks for data-parallel training with hvddp (Horovod's, for Keras 3)."""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Callable, Optional, Union

import keras
import numpy as np

import hvddp
from hvddp import ProcessSet, _grouping, global_process_set
from hvddp.checkpoint import root_of

from . import _backend, _keras2
from .functions import broadcast_variables
from .optimizer import average_accumulators

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

_log = logging.getLogger("hvddp")


def _sync_jax_state(model: Any) -> None:
    # The JAX trainer keeps the training state outside the variables between the batches of an
    # epoch; write it back and make the next step re-read the variables.
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None and _backend.name() == "jax":
        sync()


class BroadcastGlobalVariablesCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Copy ``root_rank``'s model and optimizer variables to every rank when training begins (or,
    for a model that its first step builds, at the end of that step, where Horovod always does).

    Differently initialised replicas (or a checkpoint restored on one rank) start equal. The
    optimizer is built first if it is not yet, so its slots are broadcast too; gradient
    accumulators between the passes of an update are averaged over the ranks first (see
    ``optimizer.average_accumulators``).

    Args:
        root_rank: the rank whose values win, a global rank in ``process_set``; by default (None)
            the set's first member: rank 0 for the global set.
        device: accepted for Horovod compatibility; ignored.
        local_variables: a variable or a list of them that keep each rank's own values (not
            broadcast; see also ``register_local_var``). The optimizer's variables are all
            broadcast, as in Horovod.
        process_set: the ranks taking part (also accepted at ``local_variables``' position,
            where earlier hvddp versions had it).
    """

    def __init__(self, root_rank: Optional[int] = None, device: str = "", local_variables: Any = None,
                 process_set: ProcessSet = global_process_set):
        super().__init__()
        if isinstance(local_variables, ProcessSet):  # hvddp's earlier positional order
            process_set, local_variables = local_variables, None
        if root_rank is not None and (isinstance(root_rank, (bool, np.bool_)) or
                                      not isinstance(root_rank, numbers.Integral)):
            raise TypeError(f"{type(self).__name__}: root_rank must be an int (a rank), or None for the process "
                            f"set's first member; Received: root_rank={root_rank!r}.")
        self.root_rank = None if root_rank is None else int(root_rank)
        self.process_set = _grouping.check_process_set(process_set, type(self).__name__)
        self.broadcast_done = False
        self._local = {}
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own value (Horovod's)."""
        if not (isinstance(var, keras.Variable) or hasattr(var, "assign")):
            raise ValueError(f"BroadcastGlobalVariablesCallback: local variables must be variables; "
                             f"Received: {type(var).__name__}.")
        self._local[id(var)] = var  # kept alive, so its id stays its own

    def on_train_begin(self, logs=None):
        # A model without an Input is built by its first step (TensorFlow backend): then broadcast
        # at the end of that step, as Horovod always does, rather than nothing now. The ranks
        # agree on when (a model may be built on some ranks only, e.g. by a checkpoint rank 0
        # loaded), or some would broadcast while others reduce their first gradients.
        from .checkpoint import _restored_per_rank, _settle_pending_rng

        _settle_pending_rng(self.model)  # (a resume's RNG states, also without CheckpointCallback)
        if self.broadcast_done:
            return
        if not self.process_set.included():  # trains on its own, as the optimizer does there
            # (a root outside the set is refused on every rank, not only on the members)
            root_of(self.root_rank, type(self).__name__, self.process_set)
            self.broadcast_done = True
            return
        # ... and on skipping it when every rank's load_checkpoint just restored the ranks' own
        # local state (the broadcast would copy the root's slots over it); a load on some ranks
        # only (rank 0 restores, the callback copies) still broadcasts
        flags = [int(bool(self.model.built)), int(_restored_per_rank(self.model))]
        built, restored = hvddp.allreduce(np.array(flags, dtype=np.int32), op=hvddp.Min,
                                          name="keras.bcast_cb.built", process_set=self.process_set)
        if int(restored):
            self.broadcast_done = True
        elif int(built):
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self):
        optimizer = getattr(self.model, "optimizer", None)
        variables = shared_variables(self.model, optimizer, self._local)
        average_accumulators(optimizer, self.process_set, "keras.bcast_cb.accumulators")  # (between passes)
        try:
            root = root_of(self.root_rank, type(self).__name__, self.process_set)
        except ValueError:  # not a member: broadcast_variables refuses it on every rank (raised
            root = self.root_rank  # here on some ranks only, it left the others waiting in it)
        broadcast_variables(variables, root, process_set=self.process_set, prefix="keras.bcast_cb")
        self.broadcast_done = True


def shared_variables(model: Any, optimizer: Any, local: Any = ()) -> list:
    """The variables replicas share, current (JAX's trainer state written back first): the
    model's, less its random-number generator states (dropout masks differ between replicas) and
    the ``local`` ones (ids), then the optimizer's, which is built first if it is not yet so that
    its slots come too."""
    _sync_jax_state(model)
    layers = getattr(model, "_flatten_layers", lambda: [])()
    seeds = {id(g.state) for layer in layers for g in getattr(layer, "_seed_generators", ())}
    variables = [v for v in model.variables if id(v) not in seeds and id(v) not in local]
    if optimizer is not None:
        if not optimizer.built and model.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    return variables


class MetricAverageCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Replace each epoch's metric values (``logs``) by their average across ranks.

    Place it before callbacks that read the metrics (``ModelCheckpoint``, ``EarlyStopping``,
    ``ReduceLROnPlateau``); Keras' own ``History`` and progress bar come after user callbacks.
    Every rank must report the same metric names and shapes; where they differ (validation data
    given to one rank only), every rank raises ``MismatchError`` naming them.
    """

    def __init__(self, device: str = "", process_set: ProcessSet = global_process_set):
        """``device`` is accepted for Horovod compatibility and ignored."""
        super().__init__()
        self.process_set = _grouping.check_process_set(process_set, type(self).__name__)

    def on_epoch_end(self, epoch, logs=None):
        if not self.process_set.included():  # outside the set: this rank's own values
            return
        # empty logs compared too: a rank that returned early left the others waiting on it
        values = {k: _numeric(v) for k, v in (logs or {}).items()}
        values = {k: v for k, v in values.items() if v is not None}
        # compared first: a name one rank lacked left the others waiting on its reduction
        mine = sorted((k, v.shape) for k, v in values.items())
        every = hvddp.allgather_object(mine, name="keras.metric.names", process_set=self.process_set)
        if any(theirs != every[0] for theirs in every):
            ranks = self.process_set.ranks or list(range(hvddp.size()))
            raise hvddp.MismatchError(
                f"MetricAverageCallback: at the end of epoch {epoch} the ranks log different metrics "
                f"(name, shape): " + "; ".join(f"rank {r}: {names}" for r, names in zip(ranks, every))
                + ". Every rank must compile the same metrics and get validation data alike (or none).")
        handles = [(k, hvddp.allreduce_async(values[k].astype(np.float64), name=f"keras.metric.{k}",
                                             process_set=self.process_set))
                   for k in sorted(values)]
        for key, handle in handles:
            mean = handle.wait()
            # a number stays a number; a metric with one value per class (F1Score(average=None))
            # an array of its shape and float dtype
            logs[key] = float(mean) if values[key].ndim == 0 else mean.astype(values[key].dtype)


def _numeric(value: Any) -> Optional[np.ndarray]:
    """A metric's value as a float numpy array (0-d for a number), or None if it is not numeric."""
    try:
        array = np.asarray(_backend.to_numpy(value) if hasattr(value, "numpy") else value)
    except (TypeError, ValueError):
        return None
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":  # (ml_dtypes' bfloat16 is kind "V")
        return array
    return array.astype(np.float64) if array.dtype.kind in "biu" else None


class LearningRateScheduleCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in [start, end).

    With ``staircase=True`` (or a constant ``multiplier``) the rate changes at the start of each
    epoch, using the integer epoch; otherwise before every batch, using the fractional epoch
    ``epoch + batch / steps_per_epoch``. The rate is written to ``logs["learning_rate"]`` at
    each epoch end.

    Args:
        initial_lr: the base rate; the optimizer's rate when training begins if None.
        multiplier: a number, or a function of the (fractional) epoch. A number holds for the
            whole range, as Horovod's examples use it (Horovod 0.28.1's code raises it to the
            power ``epoch - start_epoch``; pass that as a function to get it).
        start_epoch: first epoch the schedule applies to.
        end_epoch: first epoch it no longer applies to (None: to the end).
        staircase: adjust once per epoch (True) or every batch (False).
        momentum_correction: accepted for Horovod compatibility. Keras 3 optimizers compile
            their momentum as a constant into the training step, so it is not rescaled.
        steps_per_epoch: batches per epoch; taken from ``fit`` when None.
        verbose: log the rate set at the start of each epoch, on rank 0.
    """

    def __init__(self, initial_lr: Optional[float], multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__()
        who = type(self).__name__
        if initial_lr is not None:
            try:  # a real number: a scalar, 0-d array or tensor, or the optimizer's rate variable
                value = _backend.to_numpy(initial_lr)
                if isinstance(initial_lr, bool) or value.shape != () or value.dtype.kind not in "iuf":
                    raise TypeError  # (strings, bools, complex numbers, several values)
                initial_lr = float(value)
            except Exception:  # (what each backend raises for a value it cannot convert differs)
                raise TypeError(f"{who}: initial_lr must be a number, or None for the optimizer's rate; "
                                f"Received: initial_lr={initial_lr!r}.") from None
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
            self.staircase = staircase
        else:
            try:  # a number, or anything float() takes (a 0-d array or tensor)
                if multiplier is None or isinstance(multiplier, bool):
                    raise TypeError
                value = float(multiplier)
            except (TypeError, ValueError):
                raise TypeError(f"{who}: multiplier must be a number or a function of the epoch; "
                                f"Received: multiplier={multiplier!r}.") from None
            self.multiplier = lambda epoch: value
            self.staircase = True
        for arg, epoch in (("start_epoch", start_epoch), ("end_epoch", end_epoch)):
            if (epoch is not None or arg == "start_epoch") and (
                    isinstance(epoch, (bool, np.bool_)) or not isinstance(epoch, numbers.Real)):
                raise TypeError(f"{who}: {arg} must be a number (an epoch){', or None' if arg == 'end_epoch' else ''}; "
                                f"Received: {arg}={epoch!r}.")
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.momentum_correction = momentum_correction
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(
                steps_per_epoch, numbers.Integral) or steps_per_epoch < 1):
            raise TypeError(f"{who}: steps_per_epoch must be a positive int, or None to take fit()'s; "
                            f"Received: steps_per_epoch={steps_per_epoch!r}.")
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self.verbose = verbose
        self.current_epoch = 0

    def _active(self) -> bool:
        return self.current_epoch >= self.start_epoch and (self.end_epoch is None
                                                           or self.current_epoch < self.end_epoch)

    def _set_lr(self, epoch: float) -> None:
        _sync_jax_state(self.model)
        new_lr = self.initial_lr * self.multiplier(epoch)
        self.model.optimizer.learning_rate = new_lr
        if self.verbose and hvddp.rank() == 0 and epoch == int(epoch):  # (once per epoch: at its start)
            # printed, as Keras' own verbose callbacks and Horovod's do (asked for: not a warning)
            print(f"\nEpoch {int(epoch) + 1}: learning rate set to {new_lr:g}.", flush=True)

    def on_train_begin(self, logs=None):
        if self.end_epoch is not None and self.end_epoch <= self.start_epoch:
            # no epoch to set a rate in (warmup_epochs=0): nothing to check, nor batches to count
            # (a generator without steps_per_epoch raised "pass steps_per_epoch=")
            return
        _check_settable_rate(self.model.optimizer, type(self).__name__)
        if self.initial_lr is None:
            self.initial_lr = float(_backend.to_numpy(self.model.optimizer.learning_rate))
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__}: could not tell the number of batches per epoch (fit() "
                                 f"got data of unknown length, such as a generator without steps_per_epoch); "
                                 f"pass steps_per_epoch= to the callback or to fit().")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self._active():
            return
        if self.staircase:
            if batch == 0:
                self._set_lr(self.current_epoch)
        else:
            self._set_lr(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(_backend.to_numpy(self.model.optimizer.learning_rate))


def _check_settable_rate(optimizer: Any, who: str) -> None:
    """Refuse an optimizer whose learning rate is a schedule or a function (its own, or under a
    ``LossScaleOptimizer`` its inner one's, which the outer one's setter sets): no number can be
    set in its place, and the callback failed at the first batch, with Keras' ``TypeError``
    naming no callback, or, for a function, ``AttributeError: 'function' object has no attribute
    'assign'``. The same on every rank (the ranks compile the same optimizer)."""
    while isinstance(getattr(optimizer, "inner_optimizer", None), keras.optimizers.Optimizer):
        optimizer = optimizer.inner_optimizer
    rate = getattr(optimizer, "__dict__", {}).get("_learning_rate")
    if rate is None or isinstance(rate, keras.Variable) or not callable(rate):
        return
    what = ("a LearningRateSchedule" if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
            else "a function")
    raise TypeError(f"{who} sets the optimizer's learning rate, and this optimizer's learning_rate is {what}, "
                    f"which cannot be set to a number; Received: learning_rate={rate!r}. Give the optimizer a float "
                    f"learning rate for the callback to set, or leave the callback out and build what it does "
                    f"into the schedule (a warm-up: keras.optimizers.schedules.CosineDecay(..., warmup_target=..., "
                    f"warmup_steps=...)).")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` up to ``initial_lr`` over the first
    ``warmup_epochs`` epochs, adjusting before every batch (Goyal et al., 2017).

    Before batch ``b`` of epoch ``e`` (``S`` batches per epoch, ``N`` ranks) the rate is::

        initial_lr / N * ((e + (b + 1) / S) * (N - 1) / warmup_epochs + 1)

    so it reaches ``initial_lr`` on the last batch of the warm-up. ``initial_lr`` is the rate
    already scaled for ``N`` ranks (typically ``base_lr * hvd.size()``).

    Args:
        initial_lr: the rate at the end of the warm-up; the optimizer's rate if None.
        warmup_epochs: epochs to ramp over.
        momentum_correction: see ``LearningRateScheduleCallback``.
        steps_per_epoch: batches per epoch; taken from ``fit`` when None.
        verbose: log on rank 0 when the warm-up ends.
    """

    def __init__(self, initial_lr: Optional[float], warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, numbers.Real) or warmup_epochs < 0:
            raise ValueError(f"LearningRateWarmupCallback: warmup_epochs must be a number of epochs >= 0 "
                             f"(0: no warm-up); Received: warmup_epochs={warmup_epochs!r}.")
        self.warmup_epochs = warmup_epochs

        def multiplier(epoch: float) -> float:
            size = hvddp.size()
            epoch += 1.0 / self.steps_per_epoch
            # (at most 1: a fractional warmup_epochs ends inside an epoch that still calls this)
            return min(1.0, 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1))

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         verbose=0)
        self.warmup_verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        last = math.ceil(self.warmup_epochs) - 1  # the epoch in which the warm-up ends
        if epoch == last:
            # initial_lr from here on: with steps_per_execution k, Keras calls on_train_batch_begin
            # once per k steps, so the warm-up's last call set the rate of batch S - k, not S - 1
            self._set_lr(self.warmup_epochs - 1.0 / self.steps_per_epoch)
        if epoch == last and self.warmup_verbose and hvddp.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warm-up to "
                  f"{float(_backend.to_numpy(self.model.optimizer.learning_rate)):g}.", flush=True)


_UNSET = object()  # (an argument not given)


class BestModelCheckpoint(_keras2.Keras3Callback, keras.callbacks.ModelCheckpoint):
    """Horovod's: ``keras.callbacks.ModelCheckpoint`` that saves the model (or, with
    ``save_weights_only``, its weights) each time ``monitor`` improves (``save_best_only=True``),
    written by rank 0 only.

    Horovod's leaves ``filepath`` to its Spark estimator and passes None, which Keras 3
    refuses; here it is a keyword after Horovod's arguments (a ``.keras`` file, or a
    ``.weights.h5`` one with ``save_weights_only=True``, as Keras 3 asks). Put a
    ``MetricAverageCallback`` before it so that the monitored value is the ranks' average.
    Horovod's two modules order the arguments differently: ``horovod.tensorflow.keras``
    ``(monitor, verbose, save_weights_only, mode, save_freq)``, ``horovod.keras`` ``(monitor,
    verbose, mode, save_freq)``; a string third argument is read as the second's ``mode``.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: Any = False,
                 mode: Any = _UNSET, save_freq: Any = _UNSET, *, filepath: Optional[str] = None):
        if isinstance(save_weights_only, str):  # horovod.keras's order: (monitor, verbose, mode, save_freq)
            if save_freq is not _UNSET:
                raise TypeError(f"BestModelCheckpoint: a third argument {save_weights_only!r} is read as mode "
                                f"(horovod.keras's order: monitor, verbose, mode, save_freq), so a fifth is one "
                                f"too many; Received: save_freq={save_freq!r}.")
            save_weights_only, mode, save_freq = False, save_weights_only, mode
        if not isinstance(save_weights_only, bool):
            raise TypeError(f"BestModelCheckpoint: save_weights_only must be True or False; Received: "
                            f"{type(save_weights_only).__name__} {save_weights_only!r}.")
        mode = "auto" if mode is _UNSET else mode
        save_freq = "epoch" if save_freq is _UNSET else save_freq
        if filepath is None:
            raise ValueError("BestModelCheckpoint needs filepath='best.keras' (Horovod's gets one from its Spark "
                             "estimator); Received: filepath=None.")
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def on_train_batch_end(self, batch, logs=None):
        if hvddp.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if hvddp.rank() == 0:
            super().on_epoch_end(epoch, logs)
