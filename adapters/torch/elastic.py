"""hvddp.torch.elastic: Horovod's elastic API for PyTorch scripts, at a fixed size.

``run``, ``ObjectState`` and ``HostsUpdatedInterrupt`` are ``hvddp.elastic``'s (see there: an MPI
job's ranks are fixed, so ``run`` syncs and calls once, and nothing is retried). Added here:

- ``TorchState``: a model, an optimizer, ``ElasticSampler``s and plain attributes, committed,
  restored and synced from rank 0 together.
- ``ElasticSampler``: shards a dataset over the ranks, reshuffled per epoch, and skips the samples
  recorded as processed this epoch (a count, the same on every rank).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Dict, Iterator, List

import torch

from hvddp import rank, size
from hvddp.elastic import HostsUpdatedInterrupt, ObjectState, State, run

from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


class _Handler:
    """How one framework object in a ``TorchState`` is synced; it is committed as a copy of its
    ``state_dict()`` and restored from a copy of that (``load_state_dict`` may adopt the tensors
    it is given, which later steps would then change)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


def _handler_for(value: Any):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler
    if isinstance(value, ElasticSampler):
        return _SamplerHandler
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
        handlers: Dict[str, _Handler] = {}
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
        for handler in self._handlers.values():
            handler.sync()
            handler.save()  # a restore before the next commit returns to rank 0's, on every rank
        super().sync()


class ElasticSampler(torch.utils.data.Sampler):
    """This rank's share of a dataset, skipping the samples the job processed this epoch.

    Each epoch's order is the dataset's indices, shuffled alike on every rank (Python's
    ``random.Random(seed + epoch)``, as Horovod 0.28.1) when ``shuffle``. The samples not yet
    processed are that order from position ``processed_num`` on; they are padded by repeating the
    first ones to a multiple of the number of ranks and dealt out round-robin: rank r takes
    positions r, r + size, ... So after every rank has drawn b batches of ``batch_size``, the
    first ``b * batch_size * size`` positions are exactly the samples processed, and
    ``record_batch(i, batch_size)``, called for each batch on every rank, counts them in
    ``processed_num``: a count that is the same on every rank, so that ``restore()``, a sync or a
    checkpoint of ``state_dict()`` (Horovod's format: ``epoch``, ``processed_num``) written by
    rank 0 resumes every rank where the job stopped.

    Args:
        dataset: anything with ``len()``.
        shuffle: reshuffle every epoch (default True).
        seed: the shuffle's base seed; the same on every rank.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, and nothing processed yet. Call it when an epoch ends,
        as Horovod advises: called when one begins, it would also undo the count a resumed
        mid-epoch state brought back."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` drawn by every rank as processed (``batch_idx`` is
        accepted for Horovod compatibility; batches are counted in the order drawn)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        """Count ``indices``, this rank's share of one batch drawn by every rank, as processed (the
        older Horovod form of ``record_batch``)."""
        self.record_batch(0, len(list(indices)))

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """The dataset indices of this rank's ``batch_idx``-th batch of ``batch_size`` this epoch."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Recompute this rank's share from the ranks, the epoch and ``processed_num``."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:  # pad, repeating from the start
            padded += padded[:self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]  # this rank's share

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples
