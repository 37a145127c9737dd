"""Rank-side script of tests/test_checkpoint.py: hvddp.checkpoint's collective contract.

    mpiexec -n 2 python -m mpi4py tests/mpi_faults_checkpoint.py DIR

Prints `CHECKPOINT OK` on each rank when every check passed.
"""

import hashlib
import os
import sys

import numpy as np

import hvddp
from hvddp import checkpoint

directory = sys.argv[1]
hvddp.init()
rank = hvddp.rank()
path = os.path.join(directory, "sub", "state.pkl")

# A fresh start: no file, the same answer everywhere.
assert checkpoint.load(path) is None and checkpoint.load(path, default=("fresh",)) == ("fresh",)

# Rank 0's object is written (the others' is ignored) and comes back on every rank.
mine = {"step": 5 + rank, "w": np.arange(6.0) * (rank + 1), "name": "λ"}
checkpoint.save(mine, path)
assert os.path.exists(path) if rank == 0 else True
back = checkpoint.load(path)
assert back["step"] == 5 and back["name"] == "λ" and np.array_equal(back["w"], np.arange(6.0)), back

# A failing write fails on every rank and leaves the previous checkpoint intact.
blocker = os.path.join(directory, "not-a-directory")
if rank == 0:
    open(blocker, "w").close()
hvddp.barrier()
for bad_path, obj in ((os.path.join(blocker, "x.pkl"), mine), (path, lambda: None)):  # unwritable; unpicklable
    try:
        checkpoint.save(obj, bad_path)
    except checkpoint.CheckpointError as exc:
        assert "rank 0 could not write it" in str(exc) and "intact" in str(exc), exc
    else:
        raise AssertionError(f"saving {obj!r} to {bad_path} did not fail")
assert checkpoint.load(path)["step"] == 5
assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp." in n]  # no temporary left

# A file that is not a checkpoint fails on every rank alike.
garbage = os.path.join(directory, "garbage.pkl")
if rank == 0:
    with open(garbage, "wb") as f:
        f.write(b"\x80\x05not a pickle")
hvddp.barrier()
try:
    checkpoint.load(garbage)
except checkpoint.CheckpointError as exc:
    assert "not a valid hvddp checkpoint" in str(exc), exc
else:
    raise AssertionError("garbage loaded")

# Raw bytes, larger than one MPI message chunk, and an empty file.
blob = os.urandom(5 << 20) if rank == 0 else None
checkpoint.save_bytes(blob, os.path.join(directory, "blob.bin"))
got = checkpoint.load_bytes(os.path.join(directory, "blob.bin"))
digest = hvddp.allgather_object(hashlib.sha256(got).hexdigest())
assert len(got) == 5 << 20 and len(set(digest)) == 1, digest
checkpoint.save_bytes(b"", os.path.join(directory, "empty.bin"))
assert checkpoint.load_bytes(os.path.join(directory, "empty.bin")) == b""

# hvddp.torch's saver gathers its state on the root inside the write: a state that cannot be
# gathered there (a "scheduler" without state_dict) fails on every rank; nobody is left waiting.
import torch  # noqa: E402

from hvddp.torch import checkpoint as torch_checkpoint  # noqa: E402

class Unsaveable:  # a scheduler whose state cannot be gathered
    def state_dict(self):
        raise AttributeError("no state here")

    def load_state_dict(self, state):
        pass


try:
    torch_checkpoint.save_checkpoint(os.path.join(directory, "torch.pt"), torch.nn.Linear(2, 2),
                                     scheduler=Unsaveable())
except checkpoint.CheckpointError as exc:
    assert "AttributeError" in str(exc) and "rank 0 could not write it" in str(exc), exc
else:
    raise AssertionError("a state the root could not gather was saved")
assert hvddp.allreduce(np.ones(1), name="after.torch.checkpoint", op=hvddp.Sum)[0] == hvddp.size()

# A file that does not fit what load_checkpoint is given: CheckpointError on every rank, naming
# what does not fit (an Adam state went into an SGD silently, and failed at its first step with
# KeyError 'momentum'; a shape mismatch raised torch's RuntimeError)
path = os.path.join(directory, "adam.pt")
net = torch.nn.Linear(2, 2)
torch_checkpoint.save_checkpoint(path, net, torch.optim.Adam(net.parameters()))


def assert_refused(path, model_, optimizer_, words):
    try:
        torch_checkpoint.load_checkpoint(path, model_, optimizer_)
    except checkpoint.CheckpointError as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(f"a checkpoint that does not fit was loaded ({words})")


for model_, optimizer_, words in ((net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   "holds the state of optimizer class Adam; load_checkpoint was given class SGD"),
                                  (torch.nn.Linear(3, 2), None, "its model state does not fit the model given")):
    assert_refused(path, model_, optimizer_, words)
# a shape mismatch after entries that fit, or an optimizer of other groups: refused before
# anything is copied (torch copied the entries before the mismatch, then raised)
path = os.path.join(directory, "two.pt")
two = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
torch_checkpoint.save_checkpoint(path, two, torch.optim.SGD(two.parameters(), lr=0.1))
other = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))
fits = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
two_groups = torch.optim.SGD([{"params": list(fits[0].parameters())}, {"params": list(fits[1].parameters())}], lr=0.1)
for model_, optimizer_, words in ((other, None, "shapes differ: 1.weight: saved (2, 3), model (4, 3); "
                                                "1.bias: saved (2,), model (4,)); nothing was loaded"),
                                  (fits, two_groups, "parameters per group: saved [4], optimizer [2, 2]")):
    before = {k: v.clone() for k, v in model_.state_dict().items()}
    assert_refused(path, model_, optimizer_, words)
    for key, value in model_.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was loaded from a refused checkpoint"
lazy = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Linear(3, 2))  # takes the saved shapes
torch_checkpoint.load_checkpoint(path, lazy)
saved = hvddp.broadcast(two[0].weight.detach().numpy(), 0, name="saved.lazy")  # (rank 0's was saved)
assert np.array_equal(lazy[0].weight.detach().numpy(), saved)
assert hvddp.allreduce(np.ones(1), name="after.torch.load", op=hvddp.Sum)[0] == hvddp.size()

# Arguments that are bad on one rank, or differ between ranks, raise on every rank before anything
# is written or loaded (a different rng= hung: only some ranks gathered RNG states; a model that did
# not fit on one rank raised there alone and the others loaded; a non-path path raised a bare
# TypeError naming neither the argument nor the function).
from hvddp import MismatchError  # noqa: E402


def raises(kind, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as exc:
        assert all(w in str(exc) for w in words), (kind, words, exc)
        return exc
    raise AssertionError(f"{fn.__name__}{args} did not raise {kind.__name__} ({words})")


other_rank = 1 - rank if hvddp.size() == 2 else None
good = os.path.join(directory, "good.pt")
torch_checkpoint.save_checkpoint(good, two, torch.optim.SGD(two.parameters(), lr=0.1))
raises(TypeError, ["save_checkpoint: path must be a file path", "path=123"],
       torch_checkpoint.save_checkpoint, 123, two)
raises(TypeError, ["load_checkpoint: path must be a file path"], torch_checkpoint.load_checkpoint, 123, two)
raises(TypeError, ["save: path must be a file path"], checkpoint.save, {}, None)
if hvddp.size() == 2:
    raises(MismatchError, ["save_checkpoint: the ranks passed different rng", "rank 0: True", "rank 1: False"],
           torch_checkpoint.save_checkpoint, good, two, rng=rank == 0)
    if rank == 1:
        raises(TypeError, ["path=None"], checkpoint.save, {}, None)
    else:
        raises(MismatchError, ["save: rank 1 refused its arguments (TypeError", "path=None"],
               checkpoint.save, {}, path)
    raises(MismatchError, ["load_checkpoint: the ranks passed different optimizer"],
           torch_checkpoint.load_checkpoint, good, two, torch.optim.SGD(two.parameters(), lr=0.1) if rank else None)
    # rank 1's model does not fit: refused everywhere, nothing loaded anywhere
    mine = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2 + 2 * rank))
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    raises(checkpoint.CheckpointError, ["shapes differ"] if rank == 1 else
           ["load_checkpoint: checkpoint", "failed on rank 1", "shapes differ", "nothing was loaded on any rank"],
           torch_checkpoint.load_checkpoint, good, mine)
    assert all(torch.equal(v, before[k]) for k, v in mine.state_dict().items())
    # rank 1's model has a module more: its shapes fit, torch's strict loading refuses it there,
    # after rank 0 loaded; rank 0 is told the replicas now differ
    more = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2), *[torch.nn.Linear(2, 2)] * rank)
    raises(checkpoint.CheckpointError, ["its model state does not fit", "Missing key"] if rank == 1 else
           ["failed on rank 1", "Missing key", "replicas now differ"], torch_checkpoint.load_checkpoint, good, more)
assert hvddp.allreduce(np.ones(1), name="after.disagreeing.checkpoints", op=hvddp.Sum)[0] == hvddp.size()

# A bytes path works, as os.PathLike paths do (the temporary name mixed str and bytes)
checkpoint.save({"b": 1}, os.fsencode(os.path.join(directory, "bytes.pkl")))
assert checkpoint.load(os.fsencode(os.path.join(directory, "bytes.pkl"))) == {"b": 1}

# A path that is a symbolic link: the file it names is replaced, the link stays (os.replace put
# a plain file in the link's place).
if rank == 0:
    target, link = os.path.join(directory, "target.pkl"), os.path.join(directory, "link.pkl")
    checkpoint.atomic_write(target, b"old")
    os.symlink(target, link)
    checkpoint.atomic_write(link, b"new")
    assert os.path.islink(link) and open(target, "rb").read() == b"new"

# An empty path raises (it loaded as a fresh start, and a save wrote a temporary file in the
# parent directory); a name too long for a temporary name beside it is still saved (the
# temporary name ran past 255 bytes); numpy integers as epoch/step are saved as ints (the default
# weights_only load refused the file at resume time), a non-integer is refused on every rank.
raises(ValueError, ["load: path must name a file", "path=''"], checkpoint.load, "", default=1)
raises(ValueError, ["load_checkpoint: path must name a file"], torch_checkpoint.load_checkpoint, "", two)
long_name = os.path.join(directory, "c" * 240)
checkpoint.save({"long": 1}, long_name)
assert checkpoint.load(long_name) == {"long": 1}
assert not [n for n in os.listdir(directory) if ".tmp." in n]
counted = os.path.join(directory, "counted.pt")
torch_checkpoint.save_checkpoint(counted, two, epoch=np.int64(2), step=np.int32(7))
state = torch_checkpoint.load_checkpoint(counted, two)
assert (state["epoch"], state["step"]) == (2, 7) and type(state["epoch"]) is int, state
raises(TypeError, ["save_checkpoint: epoch must be an int", "epoch=1.5"],
       torch_checkpoint.save_checkpoint, counted, two, epoch=1.5)
# where each rank passes its own path, the errors name the file rank 0 read (rank 1 named its own)
own = os.path.join(directory, "garbage.pkl" if rank == 0 else "absent.pkl")
raises(checkpoint.CheckpointError, [f"checkpoint {garbage!r} is not a valid"], checkpoint.load, own)
# a scheduler of another class is refused like an optimizer of another class (it loaded, and
# the cosine schedule went on with the step schedule's attributes)
sched_net = torch.nn.Linear(2, 2)
sgd = torch.optim.SGD(sched_net.parameters(), lr=1.0)
torch_checkpoint.save_checkpoint(counted, sched_net, sgd, scheduler=torch.optim.lr_scheduler.StepLR(sgd, 1))
cosine = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=10)
raises(checkpoint.CheckpointError, ["holds the state of scheduler class StepLR",
                                    "load_checkpoint was given class CosineAnnealingLR"],
       torch_checkpoint.load_checkpoint, counted, sched_net, sgd, scheduler=cosine)

# ... and so is a chain of schedulers whose phases are of other classes (SequentialLR's state
# holds its phases': a cosine phase loaded silently with the step phase's attributes, and a chain
# of other length raised IndexError on the ranks that had it, while the others waited for ever)
def chained(second):
    warm = torch.optim.lr_scheduler.LinearLR(sgd, 0.5, total_iters=2)
    return torch.optim.lr_scheduler.SequentialLR(sgd, [warm, *second], milestones=[2][:len(second)])


torch_checkpoint.save_checkpoint(counted, sched_net, sgd, scheduler=chained([torch.optim.lr_scheduler.StepLR(sgd, 1)]))
raises(checkpoint.CheckpointError, ["holds the state of scheduler class SequentialLR(LinearLR, StepLR)",
                                    "given class SequentialLR(LinearLR, CosineAnnealingLR)"],
       torch_checkpoint.load_checkpoint, counted, sched_net, sgd,
       scheduler=chained([torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=10)]))
if hvddp.size() == 2:
    raises(checkpoint.CheckpointError, ["given class SequentialLR(LinearLR)"] + ([] if rank else ["failed on rank 1"]),
           torch_checkpoint.load_checkpoint, counted, sched_net, sgd,
           scheduler=chained([] if rank else [torch.optim.lr_scheduler.StepLR(sgd, 1)]))


class Flaky(Unsaveable):  # a scheduler of the saved class whose loading fails on rank 1 alone
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        if rank == 1:
            raise IndexError("list index out of range")


torch_checkpoint.save_checkpoint(counted, scheduler=Flaky())
if hvddp.size() == 2:  # (an IndexError was not caught: rank 1 raised it alone, rank 0 waited for ever)
    raises(checkpoint.CheckpointError, ["IndexError: list index out of range"] +
           ([] if rank else ["failed on rank 1", "replicas now differ"]),
           torch_checkpoint.load_checkpoint, counted, scheduler=Flaky())

# Objects of the wrong kind are named by their argument (a state dict given as the model raised a
# bare AttributeError, or failed as if the disk had; an optimizer given as the model was saved)
raises(TypeError, ["load_checkpoint: model must be a torch.nn.Module, got OrderedDict",
                   "pass the model itself, not its state_dict()"],
       torch_checkpoint.load_checkpoint, good, two.state_dict())
raises(TypeError, ["save_checkpoint: model must be a torch.nn.Module, got SGD."],
       torch_checkpoint.save_checkpoint, good, sgd)
raises(TypeError, ["save_checkpoint: optimizer must be a torch.optim.Optimizer", "got dict"],
       torch_checkpoint.save_checkpoint, good, two, sgd.state_dict())
raises(TypeError, ["scheduler must have state_dict() and load_state_dict()", "got object"],
       torch_checkpoint.save_checkpoint, good, two, scheduler=object())
raises(TypeError, ["rng must be True or False, got rng='no'"], torch_checkpoint.load_checkpoint, good, two, rng="no")

# RNG states come back whatever map_location moves the tensors to (torch restores them from CPU
# tensors only: with a GPU map_location the restore failed after the model had loaded)
torch.manual_seed(10 + rank)
np.random.seed(20 + rank)
torch_checkpoint.save_checkpoint(counted)
want = (torch.rand(3), np.random.rand(3))
torch.manual_seed(99)
np.random.seed(99)
torch_checkpoint.load_checkpoint(counted, map_location="meta")  # (meta: a device that is not the CPU)
assert torch.equal(torch.rand(3), want[0]) and np.array_equal(np.random.rand(3), want[1])

# A torn file (a copy cut short, an empty file) says so and what to do (it said "EOFError: " or
# "ValueError: negative seek value -892" and no more)
whole = open(good, "rb").read()
for cut, name in ((len(whole) // 2, "torn.pt"), (0, "empty.pt")):
    if rank == 0:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(whole[:cut])
    hvddp.barrier()
    raises(checkpoint.CheckpointError, [name, f"({cut} bytes: empty, truncated or corrupt",
                                        "move it away to start afresh, or load an earlier checkpoint"],
           torch_checkpoint.load_checkpoint, os.path.join(directory, name), two)

# op=Adasum keeps each rank's own optimizer state (it runs the update on the rank's own gradients):
# every rank's is saved and each rank gets its own back (rank 0's momentum was loaded on every
# rank, and a resumed job went on differently from the uninterrupted one)
if hvddp.size() == 2:
    from hvddp.torch import DistributedOptimizer  # noqa: E402

    def adasum_net():
        net_ = torch.nn.Linear(3, 2)
        with torch.no_grad():
            net_.weight.fill_(0.5)
            net_.bias.zero_()
        return net_, DistributedOptimizer(torch.optim.SGD(net_.parameters(), lr=0.1, momentum=0.9),
                                          named_parameters=net_.named_parameters(), op=hvddp.Adasum)

    net, ada = adasum_net()
    net(torch.full((4, 3), 1.0 + rank)).pow(2).sum().backward()
    ada.step()
    own = ada.state[net.weight]["momentum_buffer"].clone()
    assert not torch.equal(*hvddp.allgather_object(own)), "the ranks' momenta should differ"
    adasum_path = os.path.join(directory, "adasum.pt")
    torch_checkpoint.save_checkpoint(adasum_path, net, ada)
    net, ada = adasum_net()
    torch_checkpoint.load_checkpoint(adasum_path, net, ada)
    assert torch.equal(ada.state[net.weight]["momentum_buffer"], own), "this rank's momentum was not restored"
    plain = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # one state for all: rank 0's
    torch_checkpoint.load_checkpoint(adasum_path, optimizer=plain)
    assert torch.equal(*hvddp.allgather_object(plain.state[net.weight]["momentum_buffer"]))

sys.stdout.write(f"rank {rank}: CHECKPOINT OK\n")
sys.stdout.flush()
