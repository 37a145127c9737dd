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

from .exceptions import MismatchError
from .ops import _dumps, allgather_object, broadcast_object
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
    change the commit (Horovod keeps a reference).

    An object with ``state_dict()`` and ``load_state_dict()`` (a learning-rate scheduler, a
    ``GradScaler``) is kept in place instead: a commit records the object and a copy of its
    ``state_dict()``; a restore puts that object back and loads the copy into it, so whatever
    refers to it (a scheduler to its optimizer) keeps working; a sync loads rank 0's current
    ``state_dict()`` into it, as models and optimizers sync their current values (a rank that
    holds no such object there gets a copy of rank 0's; rank 0, if it replaced its object since
    the commit, gets the committed one back, as a restore). A value rank 0 cannot pickle (a lock)
    fails the sync with a ``TypeError`` naming its attribute, on every rank; so do attributes that
    are not rank 0's (a ``MismatchError`` naming them).
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
        for name, saved in self._saved_state.items():
            if isinstance(saved, _Recorded):
                setattr(self, name, saved.obj)  # the committed object, even if another was assigned
                saved.obj.load_state_dict(_copy(saved.state))
            else:
                setattr(self, name, _copy(saved))  # later changes must not reach the commit

    def sync(self) -> None:
        names = list(self._saved_state)
        # which ranks hold an object kept in place under each name: a rank without one (None
        # until rank 0 evaluates, say) where rank 0 has one is sent a copy of rank 0's object;
        # and the names, which must be rank 0's (else a rank kept its own value of an attribute
        # rank 0 lacks, silently, or one with no attributes returned and left the rest waiting)
        rows = allgather_object((names, [_stateful(getattr(self, name)) for name in names]))
        _check_same_attributes([[(name, None) for name in sorted(row[0])] for row in rows],
                              f"{type(self).__name__}.sync")
        held = [row[1] for row in rows]
        root = self._rank() == 0
        outgoing = {}
        for i, name in enumerate(names if root else ()):
            saved, current = self._saved_state[name], getattr(self, name)
            source = current if _stateful(current) else saved.obj if isinstance(saved, _Recorded) else None
            if source is None:  # a plain commit: every rank takes a copy
                outgoing[name] = saved
            else:  # rank 0's current state, or its commit's when its value is no longer the object
                state = current.state_dict() if source is current else saved.state
                outgoing[name] = _Synced(state, None if all(row[i] for row in held) else source)
        if root:
            outgoing = _sendable(outgoing)
        received = self._bcast_object(outgoing)
        if isinstance(received, _Unsendable):  # on every rank, none left waiting
            raise TypeError(f"ObjectState.sync: rank 0's {received.what} cannot be pickled "
                            f"({received.why}); keep such values (locks, open files, sockets) out of "
                            f"the state, or give them state_dict()/load_state_dict() that return "
                            f"picklable values.")
        for name, value in received.items():
            if isinstance(value, _Synced):
                current = getattr(self, name)
                if _stateful(current):
                    target = current
                else:  # rank 0: its committed object back; the others: the copy sent
                    target = self._saved_state[name].obj if root else value.whole
                target.load_state_dict(value.state)
                setattr(self, name, target)
                self._saved_state[name] = _record(target)
            else:
                self._saved_state[name] = value
                setattr(self, name, _copy(value))


def _check_same_attributes(rows: List[list], what: str) -> None:
    """Raise ``MismatchError`` (on every rank: ``rows`` is every rank's, from an allgather) unless
    each rank's ``[(name, kind), ...]`` is rank 0's: the state's attributes, in order, and the kind
    of each (``None`` where any kind will do)."""
    differ = []
    for r, row in enumerate(rows[1:], 1):
        if row == rows[0]:
            continue
        root, mine = dict(rows[0]), dict(row)
        parts = []
        missing = [name for name in root if name not in mine]
        extra = [name for name in mine if name not in root]
        kinds = [f"{name!r} is {mine[name]} there, {root[name]} on rank 0" for name in root
                 if name in mine and mine[name] != root[name]]
        if missing:
            parts.append(f"lacks {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"has {', '.join(map(repr, extra))}, which rank 0 lacks")
        parts += kinds
        if not parts:
            parts.append(f"has them in another order: {[name for name, _ in row]}, rank 0 "
                         f"{[name for name, _ in rows[0]]}")
        differ.append(f"rank {r} {' and '.join(parts)}")
    if differ:
        raise MismatchError(f"{what}: the ranks' states differ from rank 0's: {'; '.join(differ)}. "
                            f"Every rank must build the state with the same attributes (the same "
                            f"keyword arguments, in the same order, each of the same kind), since a "
                            f"sync gives every rank rank 0's value of each.")


class _Unsendable:
    """What ``sync`` sends in place of rank 0's values when some cannot be pickled: which, and why."""

    def __init__(self, what: str, why: str) -> None:
        self.what, self.why = what, why


def _sendable(outgoing: dict) -> Any:
    """``outgoing``, or an ``_Unsendable`` naming the attributes that cannot be pickled (checked
    on rank 0 before the broadcast, so that every rank learns their names)."""
    try:
        _dumps(outgoing)
        return outgoing
    except Exception as exc:
        first = exc
    bad = []
    for name, value in outgoing.items():
        try:
            _dumps(value)
        except Exception as exc:
            bad.append((name, exc))
    if not bad:  # (only the whole fails: say so)
        return _Unsendable("state", f"{type(first).__name__}: {first}")
    names = ", ".join(repr(name) for name, _ in bad)
    return _Unsendable(f"attribute{'s' if len(bad) > 1 else ''} {names}",
                       f"{type(bad[0][1]).__name__}: {bad[0][1]}")


class _Synced:
    """What ``sync`` sends for an object kept in place: rank 0's ``state_dict()``, and the object
    itself when some rank has none under that name."""

    def __init__(self, state: Any, whole: Any) -> None:
        self.state, self.whole = state, whole


class _Recorded:
    """An attribute kept in place: the object and a copy of its ``state_dict()``; only the state
    travels when pickled (for ``sync``)."""

    __slots__ = ("obj", "state")

    def __init__(self, obj: Any, state: Any) -> None:
        self.obj, self.state = obj, state

    def __getstate__(self) -> Any:
        return (self.state,)  # never falsy, so that unpickling calls __setstate__

    def __setstate__(self, state: Any) -> None:
        self.obj, self.state = None, state[0]


def _stateful(value: Any) -> bool:
    return not isinstance(value, type) and callable(getattr(value, "state_dict", None)) \
        and callable(getattr(value, "load_state_dict", None))


def _record(value: Any) -> Any:
    return _Recorded(value, _copy(value.state_dict())) if _stateful(value) else _copy(value)


def _copy(value: Any) -> Any:
    """A deep copy, so that a commit is not changed through the live object; a dict or list that
    cannot be copied whole is copied item by item, and an item that cannot be copied at all (a
    lock, an open file) is kept as it is."""
    try:
        return copy.deepcopy(value)
    except Exception:
        if isinstance(value, dict):
            return {k: _copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [_copy(v) for v in value]
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
