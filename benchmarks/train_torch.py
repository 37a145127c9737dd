"""Training throughput: one process vs hvddp at np=2 vs PyTorch DDP (gloo) at np=2, in one run.

    python benchmarks/train_torch.py [--steps 20] [--warmup 5] [--repeats 2]

The model is 20 x [Linear(1024, 1024) + LayerNorm + ReLU] + Linear(1024, 10) (21.0M parameters in
82 tensors), batch 64 per rank, SGD with momentum, cross-entropy on random data. Every rank runs
one compute thread and is pinned to its own core (``os.sched_setaffinity``, set before torch is
imported so every thread of the rank, hvddp's engine and gloo's included, stays on that core).
The driver runs four configurations one after the other (``--repeats`` rounds, best round kept
for each): one process, hvddp with its defaults (pinned to one core, a rank's DistributedOptimizer
submits every gradient at ``step()``), hvddp with ``HVDDP_OVERLAP=1`` (each gradient during
backward, as with more cores), and DDP; then it prints ms/step (the slowest rank's mean over the
timed steps), global samples/s, the ratios, and where each rank's CPU time went: the training thread, and every other
thread of the process (hvddp's engine, gloo's workers). With one core per rank the two add up:
communication that runs on the same core is not hidden by overlap. The workers are this same
file with ``--mode``.

After the table, a floor: how long plain numpy takes for the memory traffic one rank's share of
the reduction cannot avoid, measured in the single-process run on fresh gradients, and the ratio
to one process that even a reduction at that floor could reach with one core per rank.

glibc's malloc serves the 4 MiB gradients with fresh ``mmap`` pages whenever its dynamic mmap
threshold happens to sit below 4 MiB, and ``zero_grad()`` (which frees them) then makes every step
page-fault ~80 MB in again: one process measured 150-156 ms/step in that mode and 126-129 ms/step
out of it, on the same machine, depending on what was allocated before. The driver therefore
fixes the threshold for every run (``MALLOC_MMAP_THRESHOLD_=32 MiB``,
``MALLOC_TRIM_THRESHOLD_=1 GiB``; PyTorch's CPU performance guide suggests jemalloc or tcmalloc
for the same reason); ``--default-malloc`` leaves glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
WIDTH, DEPTH, BATCH = 1024, 20, 64


def _pin(index: int) -> int:
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _model():
    import torch

    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, 10))
    return torch.nn.Sequential(*layers)


def _data() -> tuple:
    """The one synthetic batch every step trains on: (inputs, labels), seeded."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _loop(model, optimizer, steps: int, warmup: int, sync) -> tuple:
    """Train; return this rank's mean (wall, main-thread CPU, other threads' CPU) s per timed step."""
    import torch.nn.functional as F

    x, y = _data()
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start, main, process = time.perf_counter(), time.thread_time(), time.process_time()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    wall = time.perf_counter() - start
    main = time.thread_time() - main
    return wall / steps, main / steps, (time.process_time() - process - main) / steps


def _floor(model, optimizer, reps: int = 7) -> float:
    """Median s per step that plain numpy, in this one process, needs for the memory traffic one
    rank of a 2-rank reduction cannot avoid: read its half of every fresh gradient and a peer's
    copy of that half (separate memory standing in for the other rank's gradients), write the
    sum into both. No MPI, no system calls, no synchronization, no 1/size scaling: what reducing
    the gradients would cost a one-core rank if it could address the peer's memory directly.
    """
    import numpy as np
    import torch.nn.functional as F

    x, y = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    peer = [np.ones(p.numel() // 2, dtype=np.float32) for p in params]
    piece = (128 << 10) // 4  # cache-sized pieces: the copy reads what the add just wrote
    times = []
    for _ in range(reps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # fresh gradients, caches as a step leaves them
        start = time.perf_counter()
        for p, theirs in zip(params, peer):
            mine = p.grad.view(-1).numpy()[:theirs.size]
            for s in range(0, theirs.size, piece):
                a, b = mine[s:s + piece], theirs[s:s + piece]
                np.add(a, b, out=a)
                np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _slowest(rows) -> list:
    """The (seconds, main CPU, other CPU) row of the rank whose steps took longest, so the CPU
    figures printed beside a step time are that rank's own, not maxima taken over different ranks."""
    return rows[int(rows[:, 0].argmax())].tolist()


def worker(mode: str, steps: int, warmup: int) -> None:
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    core = _pin(rank)
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model()
    if mode == "single":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        seconds, main, other = _loop(model, optimizer, steps, warmup, lambda: None)
        floor = _floor(model, optimizer)
        ranks = 1
    elif mode == "hvddp":
        import hvddp.torch as hvd

        hvd.init()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        seconds, main, other = _loop(model, optimizer, steps, warmup, hvd.barrier)
        rows = hvd.allgather(torch.tensor([[seconds, main, other]], dtype=torch.float64),
                             name="bench.seconds")
        seconds, main, other = _slowest(rows)
        ranks = hvd.size()
    elif mode == "ddp":
        import torch.distributed as dist

        size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        seconds, main, other = _loop(ddp, optimizer, steps, warmup, dist.barrier)
        rows = [torch.zeros(1, 3, dtype=torch.float64) for _ in range(size)]
        dist.all_gather(rows, torch.tensor([[seconds, main, other]], dtype=torch.float64))
        seconds, main, other = _slowest(torch.cat(rows))
        ranks = size
        dist.destroy_process_group()
    else:
        raise ValueError(f"--mode must be single, hvddp or ddp, got {mode!r}.")
    if rank == 0:
        result = {"mode": mode, "ranks": ranks, "ms_per_step": seconds * 1e3, "main_cpu_ms": main * 1e3,
                  "other_cpu_ms": other * 1e3, "core": core}
        if mode == "single":
            result["floor_ms"] = floor * 1e3
        print("RESULT " + json.dumps(result), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (configuration, worker mode, environment, table label): the hvddp runs differ only in HVDDP_OVERLAP
CONFIGS = (("single", "single", {}, "one process"), ("hvddp", "hvddp", {}, "hvddp"),
           ("hvddp-overlap", "hvddp", {"HVDDP_OVERLAP": "1"}, "hvddp, HVDDP_OVERLAP=1"),
           ("ddp", "ddp", {}, "torch DDP (gloo)"))


def _run(mode: str, args, extra_env: dict) -> dict:
    py = sys.executable
    mpiexec = os.path.join(os.path.dirname(py), "mpiexec")
    worker_args = [HERE, "--mode", mode, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for prefix in ("HVDDP_", "HOROVOD_"):
        env.pop(prefix + "OVERLAP", None)
    env.update(extra_env)
    if not args.default_malloc:
        env.update(MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    if mode == "single":
        cmd = [py] + worker_args
    elif mode == "hvddp":
        cmd = [mpiexec, "-n", str(args.np), py, "-m", "mpi4py"] + worker_args
    else:
        cmd = [mpiexec, "-n", str(args.np), py] + worker_args
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{mode} run failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "hvddp", "ddp"], help="(worker) one configuration")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the four runs; best kept")
    parser.add_argument("--np", type=int, default=2, help="ranks of the hvddp and DDP runs")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's dynamic mmap threshold (runs may then be bimodal)")
    args = parser.parse_args()
    for flag, least in (("steps", 1), ("warmup", 0), ("repeats", 1), ("np", 1)):
        if getattr(args, flag) < least:
            parser.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}.")
    if args.mode:
        worker(args.mode, args.steps, args.warmup)
        return
    best = {}
    floors = []  # every single-process run's
    for _ in range(args.repeats):
        for config, mode, extra_env, _ in CONFIGS:
            result = _run(mode, args, extra_env)
            if config == "single":
                floors.append(result["floor_ms"])
            if config not in best or result["ms_per_step"] < best[config]["ms_per_step"]:
                best[config] = result
    single = best["single"]["ms_per_step"]
    ddp = best["ddp"]["ms_per_step"]
    print(f"model: {DEPTH} x [Linear({WIDTH},{WIDTH}) + LayerNorm + ReLU] + Linear({WIDTH},10), "
          f"batch {BATCH}/rank of synthetic data (one random batch and random labels), 1 thread/rank, "
          f"pinned; {args.steps} timed steps, best of {args.repeats}; "
          f"malloc: {'glibc defaults' if args.default_malloc else 'fixed mmap threshold'}")
    print("| run | ranks | ms/step | samples/s | vs one process | vs DDP | CPU ms/step: training thread "
          "+ other threads (slowest rank) |")
    print("|---|---|---|---|---|---|---|")
    for config in ("single", "ddp", "hvddp", "hvddp-overlap"):
        label = next(c[3] for c in CONFIGS if c[0] == config)
        r = best[config]
        throughput = r["ranks"] * BATCH / (r["ms_per_step"] / 1e3)
        vs_single = throughput / (BATCH / (single / 1e3))
        vs_ddp = throughput / (best["ddp"]["ranks"] * BATCH / (ddp / 1e3))
        print(f"| {label} | {r['ranks']} | {r['ms_per_step']:.1f} | {throughput:.0f} | "
              f"{vs_single:.2f}x | {vs_ddp:.2f}x | {r['main_cpu_ms']:.1f} + {max(r['other_cpu_ms'], 0.0):.1f} |")
    if args.np != 2:  # the floor is one rank's share of a 2-rank reduction: no bound for this run
        print(f"\n(no floor line: it is measured for np=2, this run used --np {args.np})")
        return
    floor = min(floors)
    engine = best["hvddp"]["other_cpu_ms"]
    print(f"\nfloor: one rank's share of the gradient traffic at np=2 (read its half of every gradient "
          f"and a peer's, write the sum to both) takes plain numpy {floor:.1f} ms/step in one process. "
          f"With one core per rank, a step costs one process's {single:.1f} ms plus its reduction, so "
          f"even at the floor np=2 reaches at most {2 * single / (single + floor):.2f}x one process; "
          f"hvddp's engine used {engine:.1f} ms/step of CPU, {engine / floor:.1f}x the floor.")


if __name__ == "__main__":
    main()
