"""``TorchState`` and the handlers that commit, restore and sync its framework objects (Horovod's
``horovod.torch.elastic.state``, with its registry: ``set_handler_registry(get_handler_registry() +
[(MyType, MyHandler)])`` makes ``TorchState`` sync ``MyType`` values with ``MyHandler``)."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

import hvddp
from hvddp import rank
from hvddp.elastic import ObjectState, _check_same_attributes

from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = ["TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "get_handler_registry", "set_handler_registry"]


class StateHandler:
    """How one framework object in a ``TorchState`` is committed (``save``), rolled back
    (``restore``) and made rank 0's (``sync``); ``value`` is the object. Subclass it for a kind of
    object ``TorchState`` does not know, and add the pair to the registry."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define save()")

    def restore(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define restore()")

    def sync(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define sync()")

    def set_value(self, value: Any) -> None:
        """Track ``value`` instead (``state.model = other``); it is committed as it is now."""
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """Committed as a copy of ``state_dict()`` and restored from a copy of that
    (``load_state_dict`` may adopt the tensors it is given, which later steps would then change)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: synced with ``broadcast_parameters`` (buffers included)."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer``: synced with ``broadcast_optimizer_state``."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """An ``ElasticSampler``: synced to rank 0's ``state_dict()``; its seed, ``shuffle`` and
    dataset length must agree across ranks (each rank computes the epoch's order itself: with
    per-rank seeds the shares overlapped, dropping and repeating samples silently)."""

    def sync(self) -> None:
        sampler = self.value
        rows = hvddp.allgather_object(((sampler.seed, sampler.shuffle, len(sampler.dataset)), sampler.state_dict()))
        if any(row[0] != rows[0][0] for row in rows):
            raise hvddp.MismatchError(
                "ElasticSampler: the ranks' samplers differ in (seed, shuffle, len(dataset)): "
                + "; ".join(f"rank {r}: {row[0]}" for r, row in enumerate(rows))
                + ". Every rank must build it with the same dataset, shuffle and seed (a per-rank "
                  "seed makes the ranks' shares overlap); it gives each rank its share itself.")
        sampler.load_state_dict(rows[0][1])


_registry: List[Tuple[type, Type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> List[Tuple[type, Type[StateHandler]]]:
    """The (type, handler class) pairs ``TorchState`` tries in order; the first ``isinstance``
    match handles a value, and a value no pair matches is a plain attribute."""
    return _registry


def set_handler_registry(registry: List[Tuple[type, Type[StateHandler]]]) -> None:
    """Replace the registry (for the ``TorchState`` objects made from now on)."""
    global _registry
    pairs = list(registry)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], type)
                and isinstance(pair[1], type) and issubclass(pair[1], StateHandler)):
            raise TypeError("set_handler_registry takes (type, StateHandler subclass) pairs; "
                            f"received {pair!r}")
    _registry = pairs


def _handler_for(value: Any) -> Optional[Type[StateHandler]]:
    for kind, handler in _registry:
        if isinstance(value, kind):
            return handler
    return None


class TorchState(ObjectState):
    """A model, an optimizer, ``ElasticSampler``s and plain attributes, committed and synced together.

    Models keep a copy of ``state_dict()`` on commit and are synced with ``broadcast_parameters``;
    optimizers likewise with ``broadcast_optimizer_state``; samplers keep their ``state_dict()``
    and sync rank 0's. Other attributes follow ``ObjectState`` (a scheduler stays the same object).
    Assigning ``state.model = other`` makes ``other`` the one tracked.

    Example:
        state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=1, batch=0)
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, StateHandler] = {}
        plain = {}
        for name, value in kwargs.items():
            kind = _handler_for(value)
            if kind is not None:
                handlers[name] = kind(value)
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        # the handlers sync with collectives of their own, in order: ranks whose states hold other
        # objects (a model on one rank only, a sampler under another name) waited on each other
        # for ever; raise on every rank instead
        layout = [(name, f"handled by {type(handler).__name__}") for name, handler in self._handlers.items()]
        layout += [(name, "a plain value") for name in sorted(self._saved_state)]  # (in any order)
        _check_same_attributes(hvddp.allgather_object(layout, "TorchState.sync.check"), "TorchState.sync")
        for handler in self._handlers.values():
            handler.sync()
            handler.save()  # a restore before the next commit returns to rank 0's, on every rank
        super().sync()
