"""Synthetic-data training throughput with hvddp, in the form of Horovod's benchmark script.

    mpiexec -n 2 python -m mpi4py examples/pytorch_synthetic_benchmark.py --model mlp

Models: ``mlp`` (20 x [Linear(1024, 1024) + LayerNorm + ReLU] + Linear(1024, 10), 21M
parameters), ``convnet`` (a small CNN on 3x32x32 images), or any torchvision model name when
torchvision is installed (``resnet50`` as in Horovod's script). Prints img/sec per rank for each
iteration and the total with a 95% interval, on rank 0. For ratios against one process and
against PyTorch DDP measured in the same run, see ``benchmarks/train_torch.py``. Trains on the
GPU of its local rank where CUDA is available (``--no-cuda`` keeps it on the CPU); ranks that
share one GPU need ``HVDDP_GPU_OPERATIONS=MPI``.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

import hvddp.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="mlp", help="mlp, convnet, or a torchvision model")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size per rank")
parser.add_argument("--num-warmup-batches", type=int, default=5, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="train on the CPU even where CUDA is available")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="reduce gradients with Adasum instead of averaging them (a power-of-two "
                         "number of ranks; hvddp.torch's Adasum optimizer takes CPU parameters only, so "
                         "add --no-cuda on a GPU machine)")


def build_model(name: str):
    if name == "mlp":
        layers = []
        for _ in range(20):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)), (1024,), 10
    if name == "convnet":
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        return net, (3, 32, 32), 10
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"model {name!r}: not built in (mlp, convnet) and torchvision is not installed "
                         f"(pip install torchvision).")
    return getattr(models, name)(), (3, 224, 224), 1000


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:  # one GPU per rank on each node, by local rank
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)

    model, shape, classes = build_model(args.model)
    model.to(device)
    # Average sums the ranks' batches into one larger batch, so its learning rate grows with the
    # number of ranks; Adasum combines the ranks' updates and keeps one rank's learning rate
    optimizer = optim.SGD(model.parameters(), lr=0.01 * (1 if args.use_adasum else hvd.size()))
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, *shape, device=device)
    target = torch.randint(0, classes, (args.batch_size,), device=device)

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def timed(steps: int) -> float:
        start = timeit.default_timer()
        for _ in range(steps):
            benchmark_step()
        if cuda:  # kernels run asynchronously: wait for them before reading the clock
            torch.cuda.synchronize()
        return timeit.default_timer() - start

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({params / 1e6:.1f}M parameters)")
    log(f"Batch size: {args.batch_size} (synthetic data: one random batch and random labels)")
    unit = "GPU" if cuda else "CPU"
    log(f"Number of {unit}s: {hvd.size()}")
    log("Running warmup...")
    timed(args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timed(args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {unit}")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {unit}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {unit}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
