"""What hvddp costs on one GPU: plain PyTorch vs DDP (NCCL) vs hvddp, one process, in one run.

    python benchmarks/train_gpu.py [--models mlp,resnet50] [--steps 30] [--rounds 5]

One process holds three copies of the same model, each with SGD (momentum 0.9) on the same
synthetic batch (random inputs and labels, clearly not real data): plain PyTorch,
``torch.nn.parallel.DistributedDataParallel`` on a one-rank NCCL group, and
``hvddp.torch.DistributedOptimizer`` at size 1 (its gradients go through the engine, the GPU
executor and a one-rank NCCL communicator like any other step). Rounds are interleaved (each
round runs every configuration once) and the median round is reported, with the ratio of each
configuration's step time to plain PyTorch's. At one rank nothing is exchanged, so the ratio is
the library's own per-step cost: hooks, negotiation, fusion copies, launches. Scaling across GPUs
needs a machine with several (one GPU cannot host two NCCL ranks).

Models: ``mlp`` (20 x [Linear(1024, 1024) + LayerNorm + ReLU] + Linear(1024, 10): 21M parameters
in 82 tensors, a short step, so overhead shows), ``convnet`` (a small CNN), and any torchvision
name (``resnet50``: 25.6M parameters in 161 tensors). Without CUDA it runs on the CPU with a gloo
group, which checks the script, not the GPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,resnet50", help="comma-separated model names")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hvddp.torch as hvd
    from pytorch_synthetic_benchmark import build_model

    hvd.init()
    if hvd.size() != 1:
        raise SystemExit(f"run as one process (python benchmarks/train_gpu.py), not under a launcher of "
                         f"{hvd.size()} ranks: the script measures the per-step cost at one rank.")
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    where = torch.cuda.get_device_name(device) if cuda else "CPU (no CUDA: checks the script only)"
    print(f"device: {where}; torch {torch.__version__}; batch {args.batch_size}; {args.steps} steps x "
          f"{args.rounds} interleaved rounds", flush=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        base, shape, classes = build_model(name)
        data = torch.randn(args.batch_size, *shape, device=device)
        target = torch.randint(0, classes, (args.batch_size,), device=device)
        models, steps = {}, {}
        for config in ("torch", "DDP", "hvddp"):
            model = copy.deepcopy(base).to(device)
            models[config] = model
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if config == "DDP":
                model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
            elif config == "hvddp":
                optimizer = hvd.DistributedOptimizer(
                    optimizer, named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()])

            def step(model=model, optimizer=optimizer):
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
            steps[config] = step
        times = {config: [] for config in steps}
        for _ in range(args.rounds):
            for config, step in steps.items():
                for _ in range(args.warmup):
                    step()
                sync()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                times[config].append((time.perf_counter() - start) / args.steps)
        # every configuration took the same steps from the same start: at one rank, hvddp and DDP
        # must land where plain PyTorch did (up to nondeterministic kernels such as cuDNN's)
        flat = {c: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for c, m in models.items()}
        drift = {c: (flat[c] - flat["torch"]).abs().max().item() for c in ("DDP", "hvddp")}
        params = sum(p.numel() for p in base.parameters())
        tensors = sum(1 for _ in base.parameters())
        ref = statistics.median(times["torch"])
        for config in steps:
            med = statistics.median(times[config])
            rows.append((f"{name} ({params / 1e6:.1f}M in {tensors} tensors)", config, med * 1e3,
                         min(times[config]) * 1e3, med / ref,
                         "" if config == "torch" else f"{drift[config]:.1e}"))
    print()
    print("| model | configuration | ms/step (median) | best | / plain PyTorch | max param diff vs PyTorch |")
    print("|---|---|---|---|---|---|")
    for model, config, med, best, ratio, diff in rows:
        print(f"| {model} | {config} | {med:.2f} | {best:.2f} | {ratio:.3f}x | {diff} |")
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
