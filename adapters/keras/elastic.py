"""hvddp.keras.elastic: Horovod's elastic Keras API, at a fixed size.

``run``, ``ObjectState`` and ``HostsUpdatedInterrupt`` are ``hvddp.elastic``'s (see there: an MPI
job's ranks are fixed, so ``run`` syncs the state from rank 0 and calls once; nothing is
retried). Added here, on every Keras backend:

- ``KerasState(model, optimizer=None, **attrs)``: the model's and the optimizer's variables
  (the model's ``optimizer`` when none is given) and plain attributes, committed, restored and
  synced from rank 0 together.
- ``CommitStateCallback(state, batches_per_commit=1)``, ``UpdateBatchStateCallback(state)``,
  ``UpdateEpochStateCallback(state)``: commit during ``fit`` (every N batches and at each epoch's
  end), and keep ``state.batch`` (the last finished batch of the epoch, 0 between epochs) and
  ``state.epoch`` (epochs finished) current.
"""

from __future__ import annotations

import numbers
from typing import Any

import keras
import numpy as np

from hvddp import global_process_set
from hvddp.elastic import HostsUpdatedInterrupt, ObjectState, State, VariablesState, run

from . import _backend, _keras2
from .callbacks import shared_variables
from .functions import broadcast_variables
from .optimizer import average_accumulators

__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState", "HostsUpdatedInterrupt", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


class KerasState(VariablesState):
    """A Keras model, its optimizer and plain attributes (``epoch=0, batch=0``, ...).

    ``commit()`` copies the values of the model's and the optimizer's variables (building the
    optimizer first if the model is built and it is not; random-number generator states stay
    each rank's own, as with ``BroadcastGlobalVariablesCallback``); ``restore()`` assigns them
    back; ``sync()`` broadcasts rank 0's variables and attributes to every rank.

    Args:
        model: a ``keras.Model``.
        optimizer: its optimizer; default ``model.optimizer``.
        backend: accepted for Horovod compatibility; ignored.
        **kwargs: the plain attributes.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not isinstance(model, keras.Model):
            raise TypeError(f"KerasState: model must be a keras.Model (Keras 3); Received: "
                            f"{_keras2.describe(model)}.{_keras2.fix(model)}")
        if not model.built:  # it has no variables yet: nothing would be kept or synced
            raise ValueError("KerasState: the model must be built first (give it a keras.Input, or call "
                             "model.build(input_shape)), as in Horovod; Received: an unbuilt model.")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("KerasState: no optimizer to keep: compile the model first, or pass optimizer=; "
                             "Received: a model without one and optimizer=None.")
        self.model = model
        self.optimizer = optimizer
        super().__init__(**kwargs)

    def _live_variables(self) -> list:
        return shared_variables(self.model, self.optimizer)  # JAX: the trainer's state written back first

    def _value(self, variable: Any) -> Any:
        return np.array(_backend.to_numpy(variable))

    def _broadcast(self, variables: list) -> None:
        average_accumulators(self.optimizer, global_process_set, "keras.elastic.accumulators")  # (between passes)
        broadcast_variables(variables, root_rank=0, prefix="keras.elastic")


# Horovod's Keras packages name it so too
TensorFlowKerasState = KerasState


class CommitStateCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Commit ``state`` after every ``batches_per_commit`` training batches and at every epoch's
    end; the count starts again with each ``fit``."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, numbers.Integral) \
                or batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be an int >= 1; "
                             f"Received: batches_per_commit={batches_per_commit!r}.")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._remaining = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self._remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self._remaining -= 1
        if self._remaining == 0:
            self.state.commit()
            self._remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Keep ``state.batch`` at the index of the last finished batch of the epoch; 0 at its end."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs finished, counted from its value when the
    first epoch of ``fit`` began: ``fit(epochs=total - state.epoch)`` and
    ``fit(epochs=total, initial_epoch=state.epoch)`` both count on from there."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._offset = None

    def on_train_begin(self, logs=None):
        self._offset = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None:
            self._offset = self.state.epoch - epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._offset + epoch + 1
