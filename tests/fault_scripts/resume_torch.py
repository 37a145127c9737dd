"""Rank-side script of tests/test_checkpoint.py: train, checkpoint, maybe die, resume.

    mpiexec -n 2 python -m mpi4py tests/fault_scripts/resume_torch.py CKPT OUT [--die-at S] [--no-rng]

A small MLP with dropout on synthetic data; each rank samples its batches with the global torch
RNG (seeded per rank), so the resumed run matches the uninterrupted one only if model, Adam
state, step and every rank's RNG state all come back. A checkpoint every 5 steps; with
--die-at S, rank 1 SIGKILLs itself at step S. Rank 0 writes the final weights to OUT.
"""

import os
import signal
import sys

import torch

import hvddp.torch as hvd
from hvddp.torch.checkpoint import load_checkpoint, save_checkpoint

STEPS, EVERY = 24, 5
ckpt, out = sys.argv[1], sys.argv[2]
die_at = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else -1
restore_rng = "--no-rng" not in sys.argv

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
torch.manual_seed(1000 + rank)  # per-rank streams: dropout masks and batches differ by rank
data_gen = torch.Generator().manual_seed(7)
x = torch.randn(256, 20, generator=data_gen)
y = (x[:, :3].sum(1, keepdim=True) > 0).float()
shard = slice(rank, None, hvd.size())
xs, ys = x[shard], y[shard]

init_gen = torch.Generator().manual_seed(rank)  # different on purpose: broadcast must fix it
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                            torch.nn.Linear(32, 1))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=init_gen) * 0.3)
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())

state = load_checkpoint(ckpt, model, optimizer, rng=restore_rng)
if state is None:
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    start = 0
else:
    start = state["step"]
    assert state["extra"] == {"note": "resume test"}, state
print(f"rank {rank}: starting at step {start}", flush=True)

for step in range(start, STEPS):
    if step == die_at and rank == 1:
        print(f"rank 1: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    idx = torch.randint(0, xs.shape[0], (16,))
    optimizer.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xs[idx]), ys[idx])
    loss.backward()
    optimizer.step()
    if (step + 1) % EVERY == 0:
        save_checkpoint(ckpt, model, optimizer, step=step + 1, extra={"note": "resume test"})
        print(f"rank {rank}: checkpoint at step {step + 1}", flush=True)

if rank == 0:
    torch.save(model.state_dict(), out)
print(f"rank {rank}: done", flush=True)
