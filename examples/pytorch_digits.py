"""Train a small CNN on scikit-learn's digits (8x8 images, shipped with scikit-learn) with hvddp.

Each rank trains on its shard of every epoch (``DistributedSampler``); gradients are averaged by
``hvd.DistributedOptimizer`` while backward runs; metrics are reduced with ``hvd.allreduce`` (the training
loss averaged, the test loss and accuracy summed over the ranks' shares, each test sample once).
Rank 0 alone shows the progress bar, logs, and writes the checkpoint (atomically, with
``hvd.save_checkpoint``); ``--resume`` restarts from it (rank 0 reads it, every rank loads the same
state, and each rank's random generators continue where they were).

    mpiexec -n 2 python -m mpi4py examples/pytorch_digits.py
    mpiexec -n 2 python -m mpi4py examples/pytorch_digits.py --checkpoint /tmp/digits.ckpt --resume
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hvddp.torch as hvd

log = logging.getLogger("pytorch_digits")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def datasets():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return (TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
            TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te)))


def average(value: float, name: str) -> float:
    """The mean of ``value`` over all ranks."""
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def total(value: float, name: str) -> float:
    """The sum of ``value`` over all ranks."""
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name, op=hvd.Sum).item()


def evaluate(model, loader) -> tuple:
    """Test loss and accuracy over the whole test set, each sample counted once."""
    model.eval()
    # the sampler pads every rank's share to one length by repeating the first samples; they come
    # last on the ranks that get them (sampler positions rank, rank + size, ... past the end of
    # the dataset) and are left out
    real = len(range(hvd.rank(), len(loader.dataset), hvd.size()))
    loss = correct = 0.0
    seen = 0
    with torch.no_grad():
        for x, y in loader:
            keep = max(0, min(len(y), real - seen))
            seen += len(y)
            if keep:
                out = model(x[:keep])
                loss += F.cross_entropy(out, y[:keep], reduction="sum").item()
                correct += (out.argmax(1) == y[:keep]).sum().item()
    n = len(loader.dataset)  # the ranks' sums over their shares, which together are the test set
    return total(loss, "test.loss") / n, total(correct, "test.correct") / n


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="per rank; scaled by the number of ranks")
    parser.add_argument("--checkpoint", default=os.path.join("checkpoints", "pytorch_digits.ckpt"),
                        help="where rank 0 saves the model and optimizer (default: %(default)s, gitignored)")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint if it exists")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                        format=f"[rank {hvd.rank()}] %(message)s")

    train_set, test_set = datasets()
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    # rank 0 reads the checkpoint and every rank loads the same state (None: no checkpoint yet)
    state = hvd.load_checkpoint(args.checkpoint, model, optimizer) if args.resume else None
    if state is None:  # a fresh start: every replica starts from rank 0's weights and optimizer state
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        start_epoch = 0
    else:
        for group in optimizer.param_groups:  # this job's rate (the checkpoint's was for its size)
            group["lr"] = args.lr * hvd.size()
        start_epoch = state["epoch"]
        log.info("resumed from %s after epoch %d, learning rate %g (--lr times %d ranks)", args.checkpoint,
                 start_epoch, optimizer.param_groups[0]["lr"], hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    begin = time.perf_counter()
    accuracy = None
    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        total = 0.0
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=hvd.rank() != 0,
                   leave=False)
        for x, y in bar:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        train_loss = average(total / len(train_loader), "train.loss")
        test_loss, accuracy = evaluate(model, test_loader)
        log.info("epoch %2d  train loss %.4f  test loss %.4f  test accuracy %.2f%%",
                 epoch + 1, train_loss, test_loss, 100 * accuracy)
        # every rank calls it, rank 0 writes: a temporary file renamed over the last checkpoint, so a
        # crash while writing leaves the previous one intact
        hvd.save_checkpoint(args.checkpoint, model, optimizer, epoch=epoch + 1)
    if accuracy is None:  # resumed after the last epoch: nothing to train, the model is tested as it is
        _, accuracy = evaluate(model, test_loader)
    log.info("ranks %d  test accuracy %.2f%%  training time %.1f s  checkpoint %s", hvd.size(),
             100 * accuracy, time.perf_counter() - begin, args.checkpoint)
    return accuracy


if __name__ == "__main__":
    main()
