"""``ElasticSampler`` (Horovod's ``horovod.torch.elastic.sampler``)."""

from __future__ import annotations

import math
import random
from typing import Any, Dict, Iterator, List

import torch

from hvddp import rank, size

__all__ = ["ElasticSampler"]


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
