"""Horovod's elastic API at a fixed size: the framework-agnostic part (``hvddp.torch.elastic``,
``hvddp.keras.elastic`` and ``hvddp.tensorflow.elastic`` add their states and samplers).

Horovod's elastic mode re-forms a job when hosts come or go; that needs its own launcher and
Gloo. An MPI job's ranks are fixed when ``mpiexec`` starts it, so hvddp keeps what still means
something at a fixed size, and a Horovod elastic script runs after changing its import line:

- ``run(func)``: ``func(state, ...)`` first syncs ``state`` from rank 0, then runs, once. An
  error is raised as it is, on the ranks it reaches: there is no re-formed job to retry in, so
  nothing is retried; resume a failed job from a checkpoint.
- ``State`` and ``ObjectState``: ``commit()`` keeps a copy in memory, ``restore()`` goes back to
  it, ``sync()`` gives every rank rank 0's. The hosts never change, so ``check_host_updates()``
  finds nothing, ``HostsUpdatedInterrupt`` is never raised, and reset callbacks never run.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, List

from .ops import broadcast_object
from .runtime import rank

__all__ = ["run", "State", "ObjectState", "VariablesState", "HostsUpdatedInterrupt"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises this in ``commit()`` when hosts were added or removed; an MPI job's hosts
    never change, so hvddp never raises it (scripts that catch it keep working)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


def run(func: Callable) -> Callable:
    """Decorate a training function taking a ``State`` first: sync the state from rank 0, then
    call the function once and return what it returns.

    Example:
        @hvd.elastic.run
        def train(state):
            while state.epoch < epochs:
                ...
                state.epoch += 1
                state.commit()

        train(hvd.elastic.ObjectState(epoch=0))
    """
    @functools.wraps(func)
    def wrapper(state: "State", *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"hvddp elastic run: the decorated function's first argument must be a "
                            f"hvddp elastic State (such as ObjectState); Received: "
                            f"{type(state).__name__}.")
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper


class State:
    """What a training function commits, restores and syncs; subclasses say how."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable] = []

    def register_reset_callbacks(self, callbacks: List[Callable]) -> None:
        """Keep callbacks for a reset of the job; the ranks of an MPI job never change, so they never run."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Reset, then run the registered callbacks (what Horovod does once the job re-forms)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state in memory, for ``restore()``; then check for host changes."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Hosts never change in an MPI job: nothing to raise."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called by ``on_reset``; nothing to do at a fixed size."""


class ObjectState(State):
    """Plain attributes, given as keyword arguments: ``state.epoch``, ``state.batch``, ...

    ``commit()`` records their current values; ``restore()`` sets them back to the last commit;
    ``sync()`` sets them, on every rank, to rank 0's last commit (so commit before syncing what
    changed since). A value is recorded as a deep copy, so changing a list after a commit does not
    change the commit (Horovod keeps a reference). An object with ``state_dict()`` and
    ``load_state_dict()`` (a learning-rate scheduler, a ``GradScaler``) stays the same object:
    its ``state_dict()`` is recorded, and restoring or syncing loads one into it, so whatever
    refers to it (a scheduler to its optimizer) keeps working.
    """

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank,
                 **kwargs: Any) -> None:
        for name, value in kwargs.items():  # the objects given, as in Horovod
            setattr(self, name, value)
        self._saved_state = {name: _record(value) for name, value in kwargs.items()}
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: _record(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, saved in self._saved_state.items():
            if isinstance(saved, _Recorded):
                getattr(self, name).load_state_dict(_copy(saved.state))
            else:
                setattr(self, name, _copy(saved))  # later changes must not reach the commit


class _Recorded:
    """The ``state_dict()`` of an attribute that is kept in place (picklable, for ``sync``)."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def __getstate__(self) -> Any:
        return (self.state,)  # never falsy, so that unpickling calls __setstate__

    def __setstate__(self, state: Any) -> None:
        self.state = state[0]


def _record(value: Any) -> Any:
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return _Recorded(_copy(value.state_dict()))
    return _copy(value)


def _copy(value: Any) -> Any:
    """A deep copy, so that a commit is not changed through the live object; the object itself
    when it cannot be copied (a lock, an open file)."""
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


class VariablesState(ObjectState):
    """Framework variables (with ``assign``) and plain attributes, committed, restored and synced
    together; a subclass says which variables (``_live_variables``), how to read one into numpy
    (``_value``) and how to broadcast them from rank 0 (``_broadcast``)."""

    def __init__(self, **kwargs: Any) -> None:
        self._save_variables()
        super().__init__(**kwargs)

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        self._live_variables()  # (a framework may need to bring the variables up to date first)
        for variable, value in self._saved_variables:
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        self._broadcast(self._live_variables())
        self._save_variables()
        super().sync()

    def _save_variables(self) -> None:
        self._saved_variables = [(v, self._value(v)) for v in self._live_variables()]

    def _live_variables(self) -> list:
        raise NotImplementedError

    def _value(self, variable: Any) -> Any:
        raise NotImplementedError

    def _broadcast(self, variables: list) -> None:
        raise NotImplementedError
