"""Rank-side tests of hvddp.torch.DistributedOptimizer; run on every rank by tests/test_torch.py.

Parity: N ranks, each on its B/N rows, must match one process on all B rows (that reference
is trained on every rank alongside, without collectives), and all replicas must end
bit-identical.
"""

import copy
import gc
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hvddp
import hvddp.torch as hvd

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()
B = 12  # global batch: divides by 1, 2, 3 and 4
STEPS = 5
HAS_CPU_GRAD_SCALER = hasattr(torch.amp, "GradScaler")  # torch >= 2.3


class Net(torch.nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        if extra:
            self.unused = torch.nn.Linear(8, 3)  # never used on any rank
            self.branch = torch.nn.Linear(8, 3)  # used by the first shard only

    def forward(self, x, use_branch: bool = False):
        h = torch.tanh(self.fc1(x))
        y = self.fc2(h)
        if use_branch:
            y = y + self.branch(h)
        return y


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(B, 6, generator=g), torch.randn(B, 3, generator=g)


def shard(t: torch.Tensor, s: int = R) -> torch.Tensor:
    return t[s * B // N:(s + 1) * B // N]


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.5),
}


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_replicas_identical(model: torch.nn.Module, name: str) -> None:
    mine = flat(model)
    every = hvd.allgather(mine[None], name=f"replicas.{name}")
    for r in range(N):
        assert torch.equal(every[r], mine), f"rank {r}'s parameters differ from rank {R}'s"


def assert_parity(model, ref, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def train_step(model, ref, opt, ref_opt, step: int, zero_models: bool = False) -> None:
    """One step of the reference (all B rows, one process) and of this rank (its shard);
    ``zero_models``: the gradients zeroed by the models' ``zero_grad()``, not the optimizers'."""
    for zeroed in (ref, model) if zero_models else (ref_opt, opt):
        zeroed.zero_grad()
    x, y = batch(step)
    sum(shard_loss(ref, x, y, s) for s in range(N)).div(N).backward()
    shard_loss(model, x, y, R).backward()
    ref_opt.step()
    opt.step()


def shard_loss(model, x, y, s):
    return F.mse_loss(model(shard(x, s), use_branch=getattr(model, "branch", None) is not None and s == 0),
                      shard(y, s))


def train_pair(kind, extra=False, bpps=1, set_later=False, **kwargs):
    torch.manual_seed(0)
    ref = Net(extra)
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS[kind](ref.parameters())
    opt = hvd.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=1 if set_later else bpps, **kwargs)
    if set_later:  # Horovod's setter
        opt.set_backward_passes_per_step(bpps)
        assert opt.backward_passes_per_step == bpps
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(bpps):
            x, y = batch(step, micro)
            # one process on all B rows: the mean of the shard losses is the batch's mean loss
            sum(shard_loss(ref, x, y, s) for s in range(N)).div(N).backward()
            shard_loss(model, x, y, R).backward()
        ref_opt.step()
        opt.step()
    return model, ref


# parity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_parity_with_one_process(kind):
    model, ref = train_pair(kind)
    assert_parity(model, ref)
    assert not torch.equal(flat(model), flat(Net()))  # it trained
    assert_replicas_identical(model, f"parity.{kind}")


@pytest.mark.parametrize("kind", ["sgd", "adam", "sgd-set-later"])
def test_parity_backward_passes_per_step_2(kind):
    # two local backward passes are summed (as in Horovod), then reduced once
    model, ref = train_pair(kind.split("-")[0], bpps=2, set_later=kind.endswith("set-later"))
    assert_parity(model, ref)
    assert_replicas_identical(model, f"bpps.{kind}")


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_parity_unused_and_rank_dependent_parameters(kind):
    """A parameter no rank has a gradient for keeps a None gradient, so the update leaves it
    alone as one process does (its zeros made AdamW's weight decay shrink it); one only the
    first shard uses is averaged with the others' zeros."""
    model, ref = train_pair(kind, extra=True)
    assert_parity(model, ref)
    assert torch.equal(model.unused.weight, ref.unused.weight)
    assert model.unused.weight.grad is None and model.branch.weight.grad is not None
    assert not torch.equal(model.branch.weight, Net(extra=True).branch.weight) or N == 1
    assert_replicas_identical(model, f"unused.{kind}")


@pytest.mark.parametrize("groups", [2, "explicit", "num_groups"])
def test_parity_groups(groups):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    # explicit: two groups; fc2.bias is left out and reduced on its own
    grouping = groups if groups != "explicit" else [[model.fc1.weight, model.fc2.weight], [model.fc1.bias]]
    ref_opt = OPTIMIZERS["sgd"](ref.parameters())
    if groups == "num_groups":  # Horovod's deprecated spelling, passed by position as in Horovod
        with pytest.warns(DeprecationWarning, match="num_groups"):
            opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model.named_parameters(),
                                           hvd.Compression.none, 1, hvd.Average, 1.0, 2)
        assert [len(g) for g in opt._hvddp_groups] == [2, 2]
    else:
        opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                       named_parameters=model.named_parameters(), groups=grouping)
    for step in range(STEPS):
        train_step(model, ref, opt, ref_opt, step)
    assert_parity(model, ref)
    assert_replicas_identical(model, f"groups.{groups}")


def test_ranks_that_group_differently_fail_every_rank():
    """Rank 0 groups two parameters in one order, the others in the other: group members went
    under group names, so the ranks submitted different names and waited for ever; under the
    parameters' names they meet and raise. (Each rank submits its group at once, so the ranks
    meet whatever the timing; a member one rank sends on its own after the others' group failed
    can still wait: see the README.)"""
    if N == 1:
        pytest.skip("needs more than one rank")
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   groups=[params[:2] if R == 0 else params[1::-1]])
    model(torch.randn(4, 6)).sum().backward()
    with pytest.raises(hvd.HvddpError, match=r"group differs across ranks: rank 0 a group of 2 \(id"):
        opt.step()
    opt.zero_grad()  # the engine goes on: the same grouping on every rank trains
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=[params[:2]])
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert_replicas_identical(model, "regrouped")


@pytest.mark.parametrize("others", ["ungrouped", "by_layer"])
@pytest.mark.parametrize("grouper", [0, -1])
def test_a_rank_that_groups_while_the_others_do_not_fails_every_rank(grouper, others):
    """One rank groups the first and last layers' weights, the others reduce each on its own as
    their hooks fire (or group by layer): the last layer's weight, sent first, fails the group;
    the first layer's, sent later in the backward pass, waited for ever (the grouping rank would
    not send it again). Now every rank raises, whatever the timing: the others' backward pass is
    slowed between the two layers (so the late member comes after the failure), or not."""
    if N == 1:
        pytest.skip("needs more than one rank")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    for slowed in (True, False):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       groups=[[model[0].weight, model[1].weight]] if R == grouper % N else
                                       None if others == "ungrouped" else [list(model[0].parameters()),
                                                                           list(model[1].parameters())])
        hidden = model[0](torch.randn(4, 6))
        if slowed and R != grouper % N:
            hidden.register_hook(lambda g: time.sleep(0.3))
        model[1](hidden).sum().backward()
        with pytest.raises(hvd.HvddpError, match=r"group differs across ranks|was sent late"):
            opt.step()
        opt.zero_grad()
        del opt
        gc.collect()  # (the failed step's traceback holds the old wrapper)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert_replicas_identical(model, f"regrouped.{grouper}.{others}")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("op,predivide", [(hvd.Average, 1.0), (hvd.Average, 4.0), (hvd.Sum, 1.0)])
def test_compressed_cpu_gradients_are_what_the_compressed_allreduce_gives(name, op, predivide):
    """float32 CPU gradients under fp16/bf16 compression are rounded and summed in float32 by
    torch (4x faster than the core's numpy casts of 16-bit tensors): bit for bit what
    hvd.allreduce(compression=...) of each gradient gives, through MPI (small) and the single-copy
    path (large), grouped or not."""
    compression = getattr(hvd.Compression, name)
    # odd ranks wrap with the core's compressor, the same cast (it failed on torch tensors)
    wrapping = getattr(hvddp.Compression, name) if R % 2 else compression
    torch.manual_seed(R)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 3))  # 360 KB, 3.6 KB, ...
    for groups in (None, 2):
        grads = [torch.randn_like(p) * 10 for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=op,
                                       named_parameters=model.named_parameters(), compression=wrapping,
                                       gradient_predivide_factor=predivide, groups=groups)
        opt.synchronize()
        post = predivide if op is hvd.Average else 1.0
        for i, (p, g) in enumerate(zip(model.parameters(), grads)):
            want = hvd.allreduce(g, op=op, compression=compression, prescale_factor=1.0 / predivide,
                                 postscale_factor=post, name=f"want.{name}.{groups}.{i}")
            assert p.grad.dtype == torch.float32, (name, groups, i)
            if N == 2:  # (with more ranks the float32 sum's order may differ between paths)
                assert torch.equal(p.grad, want), (name, groups, i)
            else:
                torch.testing.assert_close(p.grad, want, rtol=2e-2, atol=1e-3)
        with opt.skip_synchronize():
            opt.step()
    # a sparse gradient in a group goes dense and comes back sparse, compressed the usual way;
    # a rank without it fills zeros (its float32 zeros and the others' densified copies went
    # out as float32 and float16: "dtype differs")
    emb = torch.nn.Embedding(6, 2, sparse=True)
    if R == 0 or N == 1:
        emb(torch.tensor([R % 6, 5])).sum().mul(1.37).backward()
    else:
        emb.weight.grad = None
    dense = emb.weight.grad.to_dense() if emb.weight.grad is not None else torch.zeros_like(emb.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), op=op, groups=1,
                                   named_parameters=[("emb", emb.weight)], compression=compression,
                                   gradient_predivide_factor=predivide)
    opt.synchronize()
    want = hvd.allreduce(dense, op=op, compression=compression, prescale_factor=1.0 / predivide,
                         postscale_factor=predivide if op is hvd.Average else 1.0, name=f"want.{name}.emb")
    assert emb.weight.grad.layout == torch.sparse_coo
    if N == 2:
        assert torch.equal(emb.weight.grad.to_dense(), want)
    else:
        torch.testing.assert_close(emb.weight.grad.to_dense(), want, rtol=2e-2, atol=1e-3)
    with opt.skip_synchronize():
        opt.step()


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_parity_compression(name, dtype):
    """The reference rounds each shard's gradient to 16 bits, averages in float32 and rounds the
    average to 16 bits once, which is what the compressor and the core do."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS["sgd"](ref.parameters())
    opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, name))
    exact = copy.deepcopy(ref)
    exact_opt = OPTIMIZERS["sgd"](exact.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        grads = []
        for s in range(N):
            ref_opt.zero_grad()
            shard_loss(ref, x, y, s).backward()
            grads.append([p.grad.to(dtype).float() for p in ref.parameters()])
        inv = torch.tensor(1.0 / N, dtype=torch.float32)
        for i, p in enumerate(ref.parameters()):
            p.grad = (sum(g[i] for g in grads) * inv).to(dtype).float()
        ref_opt.step()
        exact_opt.zero_grad()
        sum(shard_loss(exact, x, y, s) for s in range(N)).div(N).backward()
        exact_opt.step()
        opt.zero_grad()
        shard_loss(model, x, y, R).backward()
        opt.step()
    assert_parity(model, ref, rtol=1e-4, atol=1e-6)
    assert_parity(model, exact, rtol=5e-2, atol=5e-3)
    assert_replicas_identical(model, f"compression.{name}")


def test_sparse_gradients_both_ways():
    """Sparse gradients by allgather, and dense (sparse_as_dense=True), then sparse again for the
    update as in Horovod: SparseAdam, which refuses dense gradients, trains either way."""
    for as_dense, make in ((False, lambda ps: torch.optim.SGD(ps, lr=0.5)),
                           (True, lambda ps: torch.optim.SGD(ps, lr=0.5)),
                           (False, lambda ps: torch.optim.SparseAdam(ps, lr=0.1)),
                           (True, lambda ps: torch.optim.SparseAdam(ps, lr=0.1))):
        torch.manual_seed(0)
        ref = torch.nn.Embedding(10, 4, sparse=True)
        model = copy.deepcopy(ref)
        ref_opt = make(list(ref.parameters()))
        opt = hvd.DistributedOptimizer(make(list(model.parameters())),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=as_dense)
        idx = torch.arange(B) % 10
        for step in range(3):
            ref_opt.zero_grad()
            opt.zero_grad()
            sum(ref(shard(idx, s)).pow(2).sum() for s in range(N)).div(N).backward()
            model(shard(idx)).pow(2).sum().backward()
            ref_opt.step()
            opt.step()
        assert_parity(model, ref)
        assert_replicas_identical(model, f"sparse.{as_dense}.{type(ref_opt).__name__}")


@pytest.mark.parametrize("how", ["wrapped", "added_later", "bias_only", "grouped"])
def test_parameters_unfrozen_after_wrapping_are_reduced(how):
    """fc1 frozen when the optimizer is wrapped (or in a group added later), unfrozen after two
    steps: from then on its gradient is averaged like the others (parity, identical replicas).
    ``bias_only``: only fc1.bias is unfrozen, fc1.weight stays frozen (a tensor other than the
    unfrozen one is still in the frozen list). ``grouped``: ``groups`` lists every parameter, the
    frozen ones too, which are left out of the group, as in Horovod."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.fc1.requires_grad_(False)
    make = OPTIMIZERS["sgd"]
    ref_opt = make(ref.parameters())
    if how == "added_later":
        inner = make(model.fc2.parameters())
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.fc2.named_parameters())
        opt.add_param_group({"params": list(model.fc1.parameters())})
    else:
        groups = [list(model.parameters())] if how == "grouped" else None
        opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                       groups=groups)
    for step in range(STEPS):
        if step == 2:
            for m in (ref, model):
                (m.fc1.bias if how == "bias_only" else m.fc1).requires_grad_(True)
        train_step(model, ref, opt, ref_opt, step)
    assert_parity(model, ref)
    assert_replicas_identical(model, f"unfrozen.{how}")


@pytest.mark.parametrize("groups", [None, 1])
def test_sparse_parameter_without_a_gradient_on_some_ranks(groups):
    """A sparse embedding that only some ranks use in a step: the others have no gradient and
    submit dense zeros, meet the sparse ranks' allgather in a MismatchError, and every rank
    resubmits it as sparse; afterwards the zero-gradient ranks know and go sparse at once.
    In a group the sparse gradient is reduced dense, next to the other ranks' zeros."""
    if N == 1:
        pytest.skip("needs two ranks")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 3, sparse=True)
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, ids=None):
            y = self.lin(x).sum()
            return y if ids is None else y + self.lin(self.emb(ids)).sum()

    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), groups=groups)
    x = torch.ones(2, 3)
    users = [{0}, set(range(N)), {N - 1}, set()]  # which ranks use the embedding, step by step
    for step, who in enumerate(users):
        ids = [torch.tensor([step % 10, (3 * s + 1) % 10]) for s in range(N)]
        ref_opt.zero_grad()
        opt.zero_grad()
        sum(ref(x, ids[s] if s in who else None) for s in range(N)).div(N).backward()
        model(x, ids[R] if R in who else None).backward()
        ref_opt.step()
        opt.step()
        assert_parity(model, ref)
    assert_replicas_identical(model, f"sparse.partial.{groups}")


def test_sparse_adam_trains_an_embedding_no_rank_looked_up_in_the_first_step():
    """No rank looks the embedding up in step 0: its gradient stays None, as in one process
    (its reduced zeros were dense, and SparseAdam refused them on every rank); later steps match
    one process."""
    torch.manual_seed(0)
    ref = torch.nn.Embedding(6, 2, sparse=True)
    model = copy.deepcopy(ref)
    other = torch.nn.Parameter(torch.ones(2))
    ref_other = torch.nn.Parameter(torch.ones(2))
    ref_opt = [torch.optim.SparseAdam(ref.parameters(), lr=0.1), torch.optim.SGD([ref_other], lr=0.1)]
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.1),
                                          named_parameters=[("first.emb", model.weight)])
    dense_opt = hvd.DistributedOptimizer(torch.optim.SGD([other], lr=0.1), named_parameters=[("first.other", other)])
    for step in range(3):
        for o in ref_opt + [sparse_opt, dense_opt]:
            o.zero_grad()
        ids = [torch.tensor([(step + s) % 6]) for s in range(N)]
        loss = sum(ref_other.sum() + (ref(ids[s]).sum() if step else 0) for s in range(N)) / N
        loss.backward()
        (other.sum() + (model(ids[R]).sum() if step else 0)).backward()
        for o in ref_opt + [sparse_opt, dense_opt]:
            o.step()
        assert torch.allclose(model.weight, ref.weight, rtol=1e-5, atol=1e-6), step
    assert_replicas_identical(model, "sparse.adam.first")


@pytest.mark.parametrize("how", ["groups", "sparse_as_dense"])
def test_sparse_adam_when_some_ranks_reduce_an_embedding_as_dense(how):
    """Reduced as dense (in a group, or sparse_as_dense=True) in a step only some ranks look the
    embedding up: every rank gets it back sparse for SparseAdam (the ranks that filled zeros kept
    it dense and raised, while the others stepped), matching one process."""
    if N == 1:
        pytest.skip("needs two ranks")
    torch.manual_seed(0)
    ref = torch.nn.Embedding(6, 2, sparse=True)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.1),
                                   named_parameters=[(f"dense.{how}", model.weight)],
                                   **({"groups": 1} if how == "groups" else {"sparse_as_dense": True}))
    for step, who in enumerate([{0}, set(range(N)), {N - 1}]):
        ref_opt.zero_grad()
        opt.zero_grad()
        ids = [torch.tensor([(step + 2 * s) % 6]) for s in range(N)]
        sum(ref(ids[s]).sum() for s in who).div(N).backward()
        if R in who:
            model(ids[R]).sum().backward()
        ref_opt.step()
        opt.step()
        assert torch.allclose(model.weight, ref.weight, rtol=1e-5, atol=1e-6), step
    assert_replicas_identical(model, f"sparse.dense.{how}")


def test_sparse_gradients_of_embeddings_of_other_sizes_raise_on_every_rank():
    """An embedding of 5 rows on rank 0, 12 elsewhere (a model that differs by rank; no
    broadcast_parameters): the step raises on every rank, not a gradient holding row 11 in a
    5-row tensor built without checks."""
    if N == 1:
        pytest.skip("needs two ranks")
    emb = torch.nn.Embedding(5 if R == 0 else 12, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=[("emb.size", emb.weight)])
    emb(torch.tensor([0 if R == 0 else 11])).sum().backward()
    with pytest.raises(hvd.MismatchError, match=r"the sparse gradient 'grad\d*.emb.size'.*different shapes"):
        opt.step()
    assert hvd.allgather_object("after") == ["after"] * N


def test_a_gradient_sparse_on_one_rank_and_dense_on_another_raises_on_every_rank():
    """The table also used directly on rank 1 alone (a dense gradient there): rank 1 raised while
    rank 0 retried the sparse allgather, which rank 1 never joins, and waited for ever."""
    if N == 1:
        pytest.skip("needs two ranks")
    emb = torch.nn.Embedding(6, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=[("emb.mixed", emb.weight)])
    loss = emb(torch.tensor([1, 2])).sum()
    if R == 1:
        loss = loss + emb.weight.sum()
    loss.backward()
    with pytest.raises(hvd.MismatchError, match=r"'grad\d*.emb.mixed' was submitted as different collectives"):
        opt.step()
    assert hvd.allgather_object("after.mixed") == ["after.mixed"] * N


# behaviour -------------------------------------------------------------------------------------
def test_optimizers_and_sync_batch_norms_on_a_subset_leave_global_names_alone():
    """Built only on a set's members (a natural process-set pattern), they must not shift the
    names the next global DistributedOptimizer and SyncBatchNorm reduce under."""
    if N < 3:
        pytest.skip("needs a set that leaves a rank out")
    subset = hvd.add_process_set([0, 1])
    if subset.included():
        local = Net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(local.parameters(), lr=0.1),
                                       named_parameters=local.named_parameters(), process_set=subset)
        norm = hvd.SyncBatchNorm(4, process_set=subset)
        norm(torch.ones(2, 4))
        local(torch.ones(2, 6)).sum().backward()
        opt.step()
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    norm = hvd.SyncBatchNorm(4)
    x = torch.full((2, 4), float(R))
    out = norm(x)  # the global batch's mean is the mean of the ranks
    torch.testing.assert_close(out, torch.full_like(x, float(R) - (N - 1) / 2) / torch.sqrt(
        torch.tensor(sum((r - (N - 1) / 2) ** 2 for r in range(N)) / N + norm.eps)))
    model(torch.ones(2, 6) * R).sum().backward()
    opt.step()
    assert_replicas_identical(model, "subset.first")
    hvd.remove_process_set(subset)


def test_wrapper_keeps_class_state_and_round_trips_state_dict():
    model = Net()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert opt.state is base.state and opt.param_groups is base.param_groups
    x, y = batch(0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.step()
    saved = opt.state_dict()
    assert len(saved["state"]) == 4
    plain = torch.optim.SGD(Net().parameters(), lr=0.5)
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["lr"] == 0.1
    other = Net()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.3),
                                    named_parameters=other.named_parameters())
    opt2.load_state_dict(saved)
    assert torch.equal(opt2.state[other.fc1.weight]["momentum_buffer"],
                       opt.state[model.fc1.weight]["momentum_buffer"])
    opt.zero_grad()
    opt2.zero_grad()
    with pytest.raises(ValueError, match="already distributed"):
        hvd.DistributedOptimizer(opt)


def test_subclass_with_zero_argument_super():
    model = Net()
    cls = type(hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1)))

    class Counting(cls):
        calls = 0

        def step(self, closure=None):
            Counting.calls += 1
            return super().step(closure)

    opt = Counting(model.parameters(), lr=0.1, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    x, y = batch(0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.synchronize()
    grad = model.fc1.weight.grad.clone()
    assert torch.equal(hvd.broadcast(grad, 0, name="subclass.grad"), grad)  # averaged everywhere
    with opt.skip_synchronize():
        opt.step()
    assert Counting.calls == 1


def test_synchronize_clip_skip_synchronize_and_no_double_reduction():
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = batch(0)
    sum(shard_loss(ref, x, y, s) for s in range(N)).backward()  # Sum: no division by N
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    shard_loss(model, x, y, R).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        opt.step()
    assert_parity(model, ref)
    # step() right after synchronize() must not reduce (sum) the gradients a second time
    opt.zero_grad()
    ref_opt.zero_grad()
    x, y = batch(1)
    sum(shard_loss(ref, x, y, s) for s in range(N)).backward()
    ref_opt.step()
    shard_loss(model, x, y, R).backward()
    opt.synchronize()
    opt.step()
    assert_parity(model, ref)


def test_step_inside_skip_synchronize_without_synchronize_is_refused():
    """Horovod's step() there updates from gradients still being averaged in place (the replicas
    part silently); hvddp finishes the averaging, applies nothing and raises, on every rank, and
    the next step() applies the averaged gradients once, as one process would."""
    model, ref, opt, ref_opt = _pair()
    x, y = batch(0)
    before = flat(model).clone()
    shard_loss(model, x, y, R).backward()
    if N > 1:
        with pytest.raises(hvd.HvddpError, match="skip_synchronize.*synchronize\\(\\) after"):
            with opt.skip_synchronize():
                opt.step()
        assert torch.equal(flat(model), before)
    (sum(shard_loss(ref, x, y, s) for s in range(N)) / N).backward()
    ref_opt.step()
    opt.step()
    assert_parity(model, ref)
    assert_replicas_identical(model, "skip.unsynchronized")


def parity_closures(model, ref, opt, ref_opt, x, y):
    """step() closures: this rank's shard through ``opt``; the whole batch through ``ref_opt``."""
    def closure():
        opt.zero_grad()
        loss = shard_loss(model, x, y, R)
        loss.backward()
        return loss

    def ref_closure():
        ref_opt.zero_grad()
        loss = sum(shard_loss(ref, x, y, s) for s in range(N)) / N
        loss.backward()
        return loss

    return closure, ref_closure


def test_step_with_closure_averages_its_gradients():
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = batch(0)
    closure, ref_closure = parity_closures(model, ref, opt, ref_opt, x, y)
    opt.step(closure)
    ref_opt.step(ref_closure)
    assert_parity(model, ref)


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_reads_the_averaged_loss(line_search):
    """LBFGS reads the closure's loss (its line search, and its test to stop early): step(closure)
    averages it, so every rank takes the steps one process takes on the whole batch (with each
    rank's own loss, the line search chose different steps and the replicas parted silently; the
    early stop made the ranks call the closure a different number of times and they stalled)."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    make = lambda params: torch.optim.LBFGS(params, lr=1, max_iter=5, line_search_fn=line_search)
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters())
    ref_opt = make(ref.parameters())
    x, y = batch(0)
    x = x * (1 + torch.arange(B) / 4).reshape(-1, 1)  # shards of unlike losses
    closure, ref_closure = parity_closures(model, ref, opt, ref_opt, x, y)
    for _ in range(3):
        got, want = opt.step(closure), ref_opt.step(ref_closure)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert_parity(model, ref, rtol=1e-4, atol=1e-5)
    assert_replicas_identical(model, f"lbfgs.{line_search}")
    # a number comes back averaged, as a float; what is neither a number nor a tensor, as it was
    other = Net()
    sgd = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.0),
                                   named_parameters=other.named_parameters())
    for returned, expected in ((R + 1, (N + 1) / 2), (np.array(R + 1.0), (N + 1) / 2), ((R, "aux"), (R, "aux")),
                               (None, None)):
        def closure():
            sgd.zero_grad()
            shard_loss(other, x, y, R).backward()
            return returned
        assert sgd.step(closure) == expected


def test_predivide_factor_and_sum():
    for kwargs, scale in (({"gradient_predivide_factor": 2.0}, 1.0 / N), ({"op": hvd.Sum}, 1.0)):
        model = Net()
        hvd.broadcast_parameters(model.state_dict(), 0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
        x, y = batch(0)
        # this rank's own gradient, from a copy without hooks (p.grad is reduced in place as
        # soon as backward produces it, so it must not be read before synchronize())
        twin = copy.deepcopy(model)
        (mine,) = torch.autograd.grad(F.mse_loss(twin(shard(x)), shard(y)), [twin.fc2.bias])
        F.mse_loss(model(shard(x)), shard(y)).backward()
        opt.synchronize()
        total = hvd.allreduce(mine, op=hvd.Sum, name=f"predivide.check.{sorted(kwargs)}")
        torch.testing.assert_close(model.fc2.bias.grad, total * scale, rtol=1e-6, atol=1e-7)
        opt.zero_grad()


def test_zero_grad_refused_while_pending_and_set_to_none():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = batch(0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) was called after backward.*'fc1.bias'.*a GAN's "
                                           r"generator step .*turn off requires_grad on these parameters"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(model.fc1.weight.grad, torch.zeros_like(model.fc1.weight))
    opt.zero_grad()
    assert model.fc1.weight.grad is None
    # a pass short of backward_passes_per_step (an epoch's odd last batch): named as such
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2,
                                   named_parameters=model.named_parameters())
    F.mse_loss(model(shard(x)), shard(y)).backward()
    if N > 1:
        with pytest.raises(hvd.HvddpError, match=r"fewer than backward_passes_per_step=2 passes .* before join"):
            opt.zero_grad()
    opt.step()


def test_changing_backward_passes_mid_step_is_refused():
    """Between backward and step the old count is in use (reductions may be in flight): a change
    then would let replicas diverge, so it raises on every rank; after step() it applies."""
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 6)).sum().backward()
    if N > 1:
        with pytest.raises(hvd.HvddpError, match="right after step"):
            opt.set_backward_passes_per_step(2)
    opt.step()
    opt.zero_grad()
    opt.backward_passes_per_step = 2
    for _ in range(2):
        model(torch.ones(2, 6)).sum().backward()
    opt.step()
    assert opt.backward_passes_per_step == 2


def test_too_many_backward_passes_is_an_error():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    x, y = batch(0)
    for _ in range(2):
        F.mse_loss(model(shard(x)), shard(y)).backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2"):
        F.mse_loss(model(shard(x)), shard(y)).backward()
    # autograd added the third pass into the gradient before the hook refused it: synchronize()
    # says that (it said the gradient was "modified in place or replaced (e.g. by
    # clip_grad_norm_)"), applies nothing, and leaves a clean state
    with pytest.raises(hvd.HvddpError, match=r"not averages of 2 backward pass.*'fc\d\.\w+' was accumulated once more"):
        opt.synchronize()
    opt.zero_grad()
    for _ in range(2):
        F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.step()
    assert_replicas_identical(model, "passes.recovered")


@pytest.mark.parametrize("differs", ["compression", "compression grouped", "sparse_as_dense", "op sparse"])
def test_ranks_wrapped_with_different_settings_fail_every_rank(differs):
    """A float32 gradient goes out as float32 under every compression, so rank 0 under
    Compression.none and rank 1 under fp16 reduced alike and only rank 1 rounded: the replicas
    parted silently. A rank with sparse_as_dense sent dense what rank 0 allgathered, and rank 0
    waited for ever. A sparse gradient's op is applied after its allgather: rank 0 with Sum and
    rank 1 with Average updated by different amounts, silently. Now every rank raises, and nothing
    is updated."""
    if N == 1:
        return
    torch.manual_seed(0)
    if differs in ("sparse_as_dense", "op sparse"):
        model = torch.nn.Embedding(10, 3, sparse=True)
        kwargs = {"sparse_as_dense": R == 1} if differs == "sparse_as_dense" else \
            {"op": hvd.Sum if R == 0 else hvd.Average}
    else:
        model = Net()
        kwargs = {"compression": hvd.Compression.none if R == 0 else
                  hvd.Compression.fp16 if differs == "compression" else
                  (hvd.Compression.fp16 if R % 2 else hvd.Compression.bf16)}
        if differs == "compression grouped":
            kwargs["groups"] = 1
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kwargs)
    before = flat(model).clone()
    for step in range(2):  # and again: the wrapper is not left half-way
        opt.zero_grad()
        if differs in ("sparse_as_dense", "op sparse"):
            model(torch.tensor([1, 2 + R])).sum().backward()
        else:
            x, y = batch(step)
            shard_loss(model, x, y, R).backward()
        with pytest.raises(hvd.HvddpError, match="wrapped their optimizers with different settings"):
            opt.step()
        assert torch.equal(flat(model), before)
    assert hvd.allreduce(torch.ones(1), name="after.settings", op=hvd.Sum).item() == N


def test_step_with_a_closure_inside_skip_synchronize_is_refused():
    """The closure's backward() made gradients the block kept from being averaged: the update
    used each rank's own (the replicas parted silently) and the next zero_grad() blamed a
    missing step()."""
    model, ref, opt, ref_opt = _pair()
    x, y = batch(0)
    before = flat(model).clone()

    def closure():
        opt.zero_grad()
        loss = shard_loss(model, x, y, R)
        loss.backward()
        return loss

    if N > 1:
        with pytest.raises(hvd.HvddpError, match=r"step\(closure\) ran inside .*skip_synchronize"):
            with opt.skip_synchronize():
                opt.step(closure)
        assert torch.equal(flat(model), before)
    opt.zero_grad()
    (sum(shard_loss(ref, x, y, s) for s in range(N)) / N).backward()
    ref_opt.step()
    opt.step(closure)
    assert_parity(model, ref)
    assert_replicas_identical(model, "skip.closure")


def test_mismatched_models_fail_on_every_rank():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2 + (R == 0))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="shape differs"):
        opt.step()
    opt.zero_grad()
    # the optimizer is usable again
    model2 = torch.nn.Linear(4, 2)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=model2.named_parameters())
    model2(torch.ones(1, 4) * R).sum().backward()
    opt2.step()


def test_bad_arguments():
    model = Net()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="`backward_passes_per_step` must be >= 1, got 0"):
        hvd.DistributedOptimizer(sgd(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(sgd(), named_parameters=[("w", model.fc1.weight), ("w", model.fc1.bias)])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(sgd(), named_parameters=[("w", model.fc1.weight)])
    with pytest.raises(TypeError, match="cannot be deep-copied.*wrap the copy"):
        copy.deepcopy(hvd.DistributedOptimizer(sgd()))
    with pytest.raises(ValueError, match="op=Adasum combines CPU tensors only"):
        hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2, device="meta").parameters(), lr=0.1),
                                 op=hvd.Adasum)
    with pytest.raises(ValueError, match="`groups`.*do not apply with op=Adasum"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, groups=2)
    with pytest.raises(ValueError, match="gradient_predivide_factor applies only to op=Average"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="only to op=Average"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(model)
    with pytest.raises(ValueError, match="more than one group"):
        hvd.DistributedOptimizer(sgd(), groups=[[model.fc1.weight], [model.fc1.weight]])
    with pytest.raises(TypeError, match=r"`groups\[0\]` holds a str; groups are lists of parameters"):
        hvd.DistributedOptimizer(sgd(), groups=[[model.fc1.weight, "fc1.bias"]])


def test_replaced_optimizer_stops_reducing():
    model = Net()
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    x, y = batch(0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    first.step()
    first.zero_grad()
    # a new optimizer over the same model (e.g. another schedule); the old one is dropped
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    for _ in range(2):  # the old hooks would raise "more than backward_passes_per_step" here
        F.mse_loss(model(shard(x)), shard(y)).backward()
        first.step()
        first.zero_grad()


def test_a_second_live_wrapper_on_the_same_parameters_is_named():
    """An old wrapper an LR scheduler still holds keeps its hooks and counts the passes it never
    steps; the error says so (it blamed backward_passes_per_step and reentrant checkpoints)."""
    import gc

    model = Net()
    old = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    schedule = torch.optim.lr_scheduler.StepLR(old, 1)
    x, y = batch(0)
    new = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    F.mse_loss(model(shard(x)), shard(y)).backward()
    new.step()
    new.zero_grad()
    with pytest.raises(hvd.HvddpError, match="another DistributedOptimizer, still alive, also wraps"):
        F.mse_loss(model(shard(x)), shard(y)).backward()
    del schedule, old
    gc.collect()
    new.synchronize()  # (the parameters the refused backward reached before the error)
    new.zero_grad()
    for _ in range(2):  # the old wrapper is gone: training goes on
        F.mse_loss(model(shard(x)), shard(y)).backward()
        new.step()
        new.zero_grad()


def test_step_hooks_run_once_also_after_load_state_dict():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.load_state_dict(opt.state_dict())
    x, y = batch(0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.step()
    assert calls == ["pre"]


def test_one_core_defers_every_cpu_gradient_to_synchronize():
    """A rank that may use one CPU core only (or HVDDP_OVERLAP=0) submits nothing during backward;
    step() submits every gradient at once, with the same results. With more cores (and the
    setting unset) the hooks submit during backward."""
    import os

    setting = os.environ.get("HVDDP_OVERLAP", "auto")
    cores = os.sched_getaffinity(0)

    def make():
        torch.manual_seed(0)
        model = Net()
        return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())

    os.sched_setaffinity(0, {min(cores)})
    try:
        model, opt = make()  # the decision is taken here, from this thread's cores
    finally:
        os.sched_setaffinity(0, cores)
    assert opt._hvddp_defer_cpu is (setting != "1")
    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(2):
        x, y = batch(step)
        sum(shard_loss(ref, x, y, s) for s in range(N)).div(N).backward()
        shard_loss(model, x, y, R).backward()
        assert opt._hvddp_flights == [], "a gradient went out during backward"
        with pytest.raises(hvd.HvddpError, match="zero_grad"):  # still counts as pending
            opt.zero_grad()
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert_parity(model, ref)
    assert_replicas_identical(model, "deferred")

    if len(cores) > 1 and setting == "auto":
        model, opt = make()
        assert not opt._hvddp_defer_cpu
        shard_loss(model, *batch(0), R).backward()
        assert len(opt._hvddp_flights) == len(list(model.parameters()))  # out during backward
        opt.step()


def test_broadcast_optimizer_state_with_different_groups_raises_on_every_rank():
    """The root compares too: before, only the other ranks raised, and the root's broadcasts waited."""
    if N == 1:
        pytest.skip("needs two ranks")
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    groups = [{"params": a.parameters()}, {"params": b.parameters()}] if R == N - 1 else [
        {"params": list(a.parameters()) + list(b.parameters())}]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=f"rank {N - 1} has \\[2, 2\\]"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)


def test_broadcast_optimizer_state_of_another_optimizer_class_raises_on_every_rank():
    """An Adam's settings loaded into an SGD left it without "momentum": only that rank raised,
    at its next step, while the root went on."""
    if N == 1:
        pytest.skip("needs two ranks")
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(lin.parameters()) if R == 0 else torch.optim.SGD(lin.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"the root rank 0 has a torch.optim.adam.Adam, but rank 1 has a "
                                         r"torch.optim.sgd.SGD"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    # a key that only the root's groups have (a scheduler's, or a checkpoint loaded there) is fine
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1 * (R + 1), momentum=0.9)
    if R == 0:
        torch.optim.lr_scheduler.StepLR(sgd, step_size=1)  # adds "initial_lr" to its groups
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1)


def test_broadcast_optimizer_state_sends_sparse_state_whole():
    """SGD's momentum of a sparse embedding is a sparse tensor: it was refused (dense only)."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    torch.manual_seed(R)
    emb.weight.data.normal_()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    emb(torch.tensor([1, 2 + R])).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    buf = opt.state[emb.weight]["momentum_buffer"]
    assert buf.is_sparse
    everyone = hvd.allgather_object(buf.to_dense())
    assert all(torch.equal(b, everyone[0]) for b in everyone)
    assert torch.equal(everyone[0][2], torch.ones(3)) and torch.equal(everyone[0][1], torch.ones(3))


def test_broadcast_parameters_refuses_a_name_twice_on_every_rank():
    """Two models' named_parameters() in one list: the second 'weight' met the first's pending
    broadcast (a ValueError about renaming a call the user does not name), half broadcast."""
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"the names \['bias', 'weight'\] appear more than once"):
        hvd.broadcast_parameters(list(a.named_parameters()) + list(b.named_parameters()), root_rank=0)
    hvd.broadcast_parameters(a.state_dict(), root_rank=0)  # and the next call meets


# Adasum ----------------------------------------------------------------------------------------
POWER_OF_TWO = N & (N - 1) == 0


def test_ranks_that_chose_different_ops_fail_every_rank():
    """op=Adasum on rank 0, Average on the others: the updates went under other names than the
    gradients, and the Average ranks waited for ever on their per-step allreduce."""
    if N == 1 or not POWER_OF_TWO:
        pytest.skip("needs a power-of-two number of ranks above one")
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   op=hvd.Adasum if R == 0 else hvd.Average)
    m(torch.randn(4, 3)).sum().backward()
    with pytest.raises(hvd.HvddpError, match=r"op differs across ranks: rank 0 Adasum, rank 1 Average"):
        opt.step()


def adasum_tree(vectors):
    """Horovod's Adasum of per-rank tensors: the pairwise tree by rank, in float64."""
    level = [v.double().reshape(-1) for v in vectors]
    tiny = torch.finfo(torch.float64).tiny ** 0.5
    while len(level) > 1:
        pairs = zip(level[0::2], level[1::2])
        level = [(1 - (a @ b) / (a @ a) / 2 if a @ a >= tiny else 1.0) * a
                 + (1 - (a @ b) / (b @ b) / 2 if b @ b >= tiny else 1.0) * b for a, b in pairs]
    return level[0]


@pytest.mark.skipif(not POWER_OF_TWO, reason="Adasum needs a power-of-two size (refusal tested below)")
@pytest.mark.parametrize("passes", [1, 2])
def test_adasum_combines_each_ranks_update_as_horovod_does(passes):
    """Each rank's own SGD-with-momentum update (its momentum built from its own gradients) from
    the same parameters, combined per parameter by the Adasum tree, is what every replica ends
    with; simulated here for every rank's shard."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), op=hvd.Adasum,
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    momentum = [[None] * len(list(ref.parameters())) for _ in range(N)]  # each rank's buffers
    gap = 0.0  # how far Adasum lands from the plain average of the updates
    for step in range(3):
        updates = []
        for s in range(N):
            local = copy.deepcopy(ref)
            for micro in range(passes):
                x, y = batch(step, micro)
                shard_loss(local, x, y, s).backward()
            for i, p in enumerate(local.parameters()):
                buf = momentum[s][i]
                momentum[s][i] = p.grad.clone() if buf is None else buf * 0.9 + p.grad
            updates.append([-0.1 * b for b in momentum[s]])
        with torch.no_grad():
            for i, q in enumerate(ref.parameters()):
                combined = adasum_tree([u[i] for u in updates]).reshape(q.shape)
                gap = max(gap, float((combined - torch.stack([u[i] for u in updates]).double().mean(0)).abs().max()))
                q.add_(combined.float())
        opt.zero_grad()
        for micro in range(passes):
            x, y = batch(step, micro)
            shard_loss(model, x, y, R).backward()
            if micro < passes - 1 and N > 1:  # passes being accumulated must not be dropped
                with pytest.raises(hvd.HvddpError, match="fewer than backward_passes_per_step=2"):
                    opt.zero_grad()
        opt.step()
        assert_parity(model, ref, rtol=1e-5, atol=1e-6)
        assert_replicas_identical(model, f"adasum.{passes}.{step}")
    assert N == 1 or gap > 1e-3  # the check above tells Adasum from averaging


@pytest.mark.skipif(not POWER_OF_TWO, reason="Adasum needs a power-of-two size (refusal tested below)")
def test_adasum_with_adam_keeps_each_ranks_state_and_identical_replicas():
    torch.manual_seed(1)
    model = Net()
    start = flat(model).clone()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), op=hvd.Adasum,
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step)
        shard_loss(model, x, y, R).backward()
        if N > 1:
            with pytest.raises(hvd.HvddpError, match="before step"):
                opt.zero_grad()
        opt.step()
        assert_replicas_identical(model, f"adasum.adam.{step}")
    assert not torch.equal(flat(model), start)
    assert all(int(state["step"]) == 3 for state in opt.state.values())  # each rank's own moments
    with pytest.raises(hvd.HvddpError, match="skip_synchronize"):
        with opt.skip_synchronize():
            pass
    # the updates are made during backward from the still-scaled gradients: a GradScaler is refused
    # (torch < 2.3 has no CPU GradScaler: step() gets the argument a scaler's step() passes)
    scaler = torch.amp.GradScaler("cpu") if HAS_CPU_GRAD_SCALER else None
    opt.zero_grad()
    loss = shard_loss(model, *batch(7), R)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    with pytest.raises(TypeError, match="cannot step through a GradScaler"):
        scaler.step(opt) if scaler is not None else opt.step(grad_scaler=object())


def test_adasum_needs_a_power_of_two_number_of_ranks():
    model = Net()
    if POWER_OF_TWO:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
        return
    with pytest.raises(ValueError, match=rf"op=Adasum needs a process set whose size is a power of two.*has {N} ranks"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)


def apply_to_live_replicas(replicas, updates, live, adasum):
    """One step of every rank's replica under join(): each rank's ``updates`` (zeros from a
    joined rank) combined, as the Average over all N ranks or by Adasum, and added to the
    replicas of the ranks still stepping."""
    with torch.no_grad():
        for i, p in enumerate(replicas[0].parameters()):
            each = [u[i] for u in updates]
            combined = adasum_tree(each).reshape(p.shape).float() if adasum else torch.stack(each).sum(0) / N
            for replica, stepping in zip(replicas, live):
                if stepping:
                    list(replica.parameters())[i].add_(combined)


@pytest.mark.parametrize("how", ["average", "passes", "groups", "adasum"])
def test_uneven_data_with_join_follows_each_ranks_replica(how):
    """Uneven data (per-rank datasets): rank r runs 2 + r steps in the first epoch and N - r in the
    second, then calls join(). A rank still stepping gets the Average over all N ranks, a joined
    one counting as zeros (as in Horovod), or the Adasum of the live ranks' updates. Each rank's
    parameters follow a simulation of every rank's replica (they part once one has joined), join()
    returns the rank with the most steps, and a metric averaged after join() counts every rank."""
    if how == "adasum" and not POWER_OF_TWO:
        pytest.skip("Adasum needs a power-of-two size")
    passes = 2 if how == "passes" else 1
    kwargs = {"groups": 2} if how == "groups" else {"op": hvd.Adasum} if how == "adasum" else {}
    torch.manual_seed(0)
    model = Net()
    replicas = [copy.deepcopy(model) for _ in range(N)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    for epoch, steps in enumerate([[2 + r for r in range(N)], [N - r for r in range(N)]]):
        for step in range(max(steps)):  # the replicas: a joined rank's update is zeros
            updates = []
            for s, replica in enumerate(replicas):
                replica.zero_grad()
                for micro in range(passes):
                    x, y = batch(10 * epoch + step, micro)
                    shard_loss(replica, x, y, s).backward()
                live = step < steps[s]
                updates.append([-0.1 * p.grad * live for p in replica.parameters()])
            apply_to_live_replicas(replicas, updates, [step < n for n in steps], how == "adasum")
        for step in range(steps[R]):
            opt.zero_grad()
            for micro in range(passes):
                x, y = batch(10 * epoch + step, micro)
                shard_loss(model, x, y, R).backward()
            opt.step()
        assert hvd.join() == steps.index(max(steps))
        assert_parity(model, replicas[R])
        metric = hvd.allreduce(torch.tensor(float(steps[R])), name=f"join.metric.{how}.{epoch}")
        assert metric.item() == pytest.approx(sum(steps) / N)


@pytest.mark.parametrize("how", ["average", "passes", "adasum"])
def test_join_between_backward_and_step_applies_that_steps_reductions(how):
    """A rank out of data may call join() between its last backward() and step() (as in Horovod,
    step() then applies reductions that finished): join() sends what that step still owes the
    other ranks first (the gradients not sent yet: all of them under HVDDP_OVERLAP=0, with
    passes the last step's single pass of two; zeros for `unused`; the check of which ranks had
    each gradient), so step() makes no collective after join(). Sent after it, they met the
    others' next step's: a peer averaged without rank 0's gradients, or dropped its gradient of
    `branch` (only shard 0 uses it) as no rank's, silently. The ranks with fewer steps end the
    first epoch so, no rank the second, every rank the third; the ranks compare with their
    replicas after the second and the third (and raise alike)."""
    if how == "adasum" and not POWER_OF_TWO:
        pytest.skip("Adasum needs a power-of-two size")
    passes = 2 if how == "passes" else 1
    kwargs = {"op": hvd.Adasum} if how == "adasum" else {}
    torch.manual_seed(0)
    model = Net(extra=True)
    replicas = [copy.deepcopy(model) for _ in range(N)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    errors = []
    ramp, down = [2 + r for r in range(N)], [N - r for r in range(N)]
    for epoch, (steps, who) in enumerate([(ramp, "short"), (down, "none"), (ramp, "every")]):
        def late(s, step):  # rank s joins between backward() and step()
            return step == steps[s] - 1 and (who == "every" or who == "short" and steps[s] < max(steps))

        for step in range(max(steps)):  # the replicas, as in the test above
            updates = []
            for s, replica in enumerate(replicas):
                replica.zero_grad()
                for micro in range(1 if late(s, step) else passes):
                    shard_loss(replica, *batch(20 + 10 * epoch + step, micro), s).backward()
                live = step < steps[s]
                updates.append([-0.1 * live * (p.grad if p.grad is not None else torch.zeros_like(p))
                                for p in replica.parameters()])
            apply_to_live_replicas(replicas, updates, [step < n for n in steps], how == "adasum")
        last = None
        for step in range(steps[R]):
            opt.zero_grad()
            for micro in range(1 if late(R, step) else passes):
                shard_loss(model, *batch(20 + 10 * epoch + step, micro), R).backward()
            if late(R, step):
                last = hvd.join()
            opt.step()
        if last is None:
            last = hvd.join()
        assert last == steps.index(max(steps))
        try:
            assert_parity(model, replicas[R])
        except AssertionError as exc:
            errors.append(f"rank {R}, epoch {epoch}: {exc}")
        if epoch:  # (not after the first: a step() that still sent after join() would hang on it)
            every = [e for errs in hvd.allgather_object(errors, name=f"late.join.{how}.{epoch}") for e in errs]
            assert not every, "\n".join(every)


@pytest.mark.skipif(not POWER_OF_TWO, reason="Adasum needs a power-of-two size (refusal tested above)")
def test_adasum_two_optimizers_groups_added_unfrozen_scheduler_and_passes():
    torch.manual_seed(2)
    a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    c.weight.requires_grad_(False)
    base = torch.optim.SGD(list(a.parameters()), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt1 = hvd.DistributedOptimizer(base, op=hvd.Adasum)  # both unnamed: noname.0.0, ...
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(list(b.parameters()) + [c.weight], lr=0.1), op=hvd.Adasum)
    opt1.load_state_dict(opt1.state_dict())  # keeps the scheduler's link
    extra = torch.nn.Parameter(torch.ones(4))
    opt2.add_param_group({"params": [extra]})
    c.weight.requires_grad_(True)  # unfrozen after wrapping
    before = [p.detach().clone() for p in (a.weight, b.weight, c.weight, extra)]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(R))
    loss = (b(torch.tanh(a(x))) + c(x) + (x * extra).sum(1, keepdim=True)).pow(2).mean()
    loss.backward()
    opt1.step()
    opt2.step()
    sched.step()
    after = [p.detach() for p in (a.weight, b.weight, c.weight, extra)]
    assert all(not torch.equal(p, q) for p, q in zip(before, after))  # every one trained
    for i, p in enumerate(after):
        assert_replicas_identical(torch.nn.ParameterList([torch.nn.Parameter(p)]), f"adasum.two.{i}")
    assert opt1.param_groups[0]["lr"] == 0.05
    opt2.set_backward_passes_per_step(2)
    assert opt2.backward_passes_per_step == 2


def test_zero_grad_keeps_the_wrapped_optimizers_signature_and_default():
    """As Horovod: the wrapped class's own zero_grad gets the call's arguments (a zero_grad that
    takes none raised TypeError on set_to_none; one that defaults to False got True)."""
    class Old(torch.optim.SGD):
        def zero_grad(self):  # an older third-party optimizer
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

    class Keeps(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = False):
            super().zero_grad(set_to_none=set_to_none)

    for kind, kept in ((Old, False), (Keeps, True)):
        model = Net()
        opt = hvd.DistributedOptimizer(kind(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
        x, y = batch(0)
        F.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
        opt.zero_grad()
        assert (model.fc1.weight.grad is not None) == kept, kind.__name__
        if kept:
            assert not model.fc1.weight.grad.any()


class _InPlaceFixedPoint(hvd.Compressor):
    """A compressor that scales the gradient up in place for the wire, and back."""

    @staticmethod
    def compress(tensor):
        return tensor.mul_(1024.0), 1024.0

    @staticmethod
    def decompress(tensor, ctx):
        return tensor / ctx


def test_a_compressor_that_compresses_in_place_is_decompressed():
    """decompress() was skipped when compress() returned the gradient itself: the update used the
    compressed values (1024x too large), silently."""
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   compression=_InPlaceFixedPoint)
    (w * (R + 1.0)).sum().backward()
    opt.step()
    want = -sum(range(1, N + 1)) / N
    assert torch.allclose(w.detach(), torch.full((3,), want)), w


def test_a_complex_parameter_is_refused_by_name():
    """(it failed inside backward(), naming no parameter and suggesting a numpy cast; so it still
    did with op=Adasum, and for a group added after wrapping)"""
    model = torch.nn.Linear(2, 2)
    model.register_parameter("phase", torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64)))
    for op in (hvd.Average, hvd.Adasum):
        with pytest.raises(TypeError, match=r"parameter 'phase' is torch.complex64.*torch.view_as_real"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=op)
    for op in (hvd.Average, hvd.Adasum) if N & (N - 1) == 0 else (hvd.Average,):  # (Adasum: 2^k ranks)
        w = torch.nn.Parameter(torch.ones(2))
        z = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
        plain = torch.optim.SGD([w], lr=0.1)
        opt = hvd.DistributedOptimizer(plain, named_parameters=[("w", w)], op=op)
        with pytest.raises(TypeError, match=r"parameter 'noname.1.0' \(of a parameter group added after "
                                            r"wrapping\) is torch.complex64.*torch.view_as_real"):
            opt.add_param_group({"params": [z]})
        assert len(opt.param_groups) == 1  # (not added)
        plain.add_param_group({"params": [z]})  # on the wrapped optimizer: refused at step()
        (w * (R + 1.0)).sum().backward()
        with pytest.raises(TypeError, match=r"parameter 'noname.1.0' \(of a parameter group added"):
            opt.step()


def _pair(kind="sgd", **kwargs):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS[kind](ref.parameters())
    opt = hvd.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()),
                                   named_parameters=model.named_parameters(), **kwargs)
    return model, ref, opt, ref_opt


def test_a_gradient_changed_before_it_was_averaged_is_an_error_and_the_recipe_works():
    """DDP-style `backward(); clip_grad_norm_(); step()`: the gradients are in flight (or not yet
    sent) when clipped, so the update would use a per-rank mix; every rank raises, naming the
    fix, in both submission modes (before, replicas silently drifted apart by up to 5e-2).
    Horovod's recipe (synchronize, clip, step in skip_synchronize) matches one process."""
    model, ref, opt, ref_opt = _pair()
    x, y = batch(0)
    shard_loss(model, x, y, R).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    if N > 1:
        with pytest.raises(hvd.HvddpError, match=r"modified in place .* Call optimizer.synchronize\(\) first"):
            opt.step()
    opt.zero_grad()
    shard_loss(model, x, y, R).backward()
    model.fc1.weight.grad = model.fc1.weight.grad.clamp(-0.01, 0.01)  # replaced by a local tensor
    if N > 1:
        with pytest.raises(hvd.HvddpError, match=r"'fc1.weight' was modified in place or replaced"):
            opt.step()
    opt.zero_grad()
    for step in range(3):
        x, y = batch(step)
        ref_opt.zero_grad()
        opt.zero_grad()
        sum(shard_loss(ref, x, y, s) for s in range(N)).div(N).backward()
        shard_loss(model, x, y, R).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
    assert_parity(model, ref)
    assert_replicas_identical(model, "clip.recipe")


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_a_gradient_changed_on_one_rank_only_is_an_error_on_every_rank(how):
    """A change on the last rank only (a rank-dependent fix-up of its gradients): before, that rank
    alone raised and the others updated, so the replicas parted (or the job waited on the rank
    that raised). Every rank refuses the update now, naming the parameter."""
    model, ref, opt, ref_opt = _pair()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = batch(0)
    shard_loss(model, x, y, R).backward()
    if R == N - 1:
        if how == "in_place":
            model.fc2.weight.grad.mul_(0.5)
        else:
            model.fc2.weight.grad = model.fc2.weight.grad.clone()
    if N > 1:
        with pytest.raises(hvd.HvddpError, match=r"'fc2.weight' was modified in place or replaced"):
            opt.step()
    assert_replicas_identical(model, f"one.rank.changed.{how}")
    opt.zero_grad()
    train_step(model, ref, opt, ref_opt, 1)  # the next step trains as usual
    assert_replicas_identical(model, f"one.rank.changed.{how}.after")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_compressed_copy_changed_before_it_was_averaged_is_an_error(name):
    """float64 gradients go out as compressed copies: with every gradient reduced through a
    copy, a clip before step() was overwritten by the average without a word (HVDDP_OVERLAP=1)."""
    torch.manual_seed(0)
    model = Net().double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, name))
    x, y = batch(0)
    F.mse_loss(model(shard(x).double()), shard(y).double()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    if N > 1:
        with pytest.raises(hvd.HvddpError, match="modified in place or replaced"):
            opt.step()
    opt.zero_grad()


class Joined(torch.nn.Module):
    """ViT-style position embeddings: two parameters joined by torch.cat. Autograd hands out
    their gradients as pieces of one buffer, which share a version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_cls = torch.nn.Parameter(torch.randn(1, 1, 6) * 0.1)
        self.pos_patch = torch.nn.Parameter(torch.randn(1, 2, 6) * 0.1)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):  # x: (rows, 6) -> three tokens each
        tokens = x[:, None, :] + torch.cat([self.pos_cls, self.pos_patch], 1)
        return self.head(tokens).mean(1)


@pytest.mark.parametrize("bpps, set_to_none", [(1, True), (2, True), (1, False)])
def test_gradients_sharing_one_buffer_are_not_taken_for_modified(bpps, set_to_none):
    """Adding into one such gradient (a second backward pass, or accumulating into zeroed
    gradients) bumped the other's version too, and step() raised "modified in place" on every
    rank although nothing touched it; Horovod and one process train on. Still refused: such a
    gradient replaced before it was averaged."""
    torch.manual_seed(0)
    ref = Joined()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=bpps)
    for step in range(3):
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(bpps):
            x, y = batch(step, micro)
            sum(F.mse_loss(ref(shard(x, s)), shard(y, s)) for s in range(N)).div(N).backward()
            F.mse_loss(model(shard(x)), shard(y)).backward()
        ref_opt.step()
        opt.step()
    assert_parity(model, ref)
    assert_replicas_identical(model, f"joined.{bpps}.{set_to_none}")
    if N > 1 and bpps == 1:
        opt.zero_grad(set_to_none=set_to_none)
        x, y = batch(9)
        F.mse_loss(model(shard(x)), shard(y)).backward()
        model.pos_cls.grad = model.pos_cls.grad.clamp(-0.01, 0.01)
        with pytest.raises(hvd.HvddpError, match=r"'pos_cls' was modified in place or replaced"):
            opt.step()
        opt.zero_grad()


@pytest.mark.skipif(not HAS_CPU_GRAD_SCALER, reason="torch.amp.GradScaler('cpu') needs torch >= 2.3")
@pytest.mark.parametrize("how", ["scaler.step", "synchronize+unscale_", "unscale_ first"])
def test_grad_scaler_steps_on_the_average_and_skips_alike(how):
    """torch.amp.GradScaler: scaler.step(optimizer) unscales and checks for inf/NaN on the
    averaged gradients, so when one rank overflows every rank skips (before, the plain call
    unscaled gradients still in flight: 2e2 apart after one step, or NaN on one rank only).
    scaler.unscale_ before the gradients are averaged is an error naming the fix."""
    model, ref, opt, ref_opt = _pair()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(4):
        x, y = batch(step)
        if step == 2:  # rank N-1's shard overflows: the average is inf on every rank
            x = x.clone()
            x[(N - 1) * B // N] = float("inf")
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_scaler.scale(sum(shard_loss(ref, x, y, s) for s in range(N)).div(N)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        scaler.scale(shard_loss(model, x, y, R)).backward()
        if how == "unscale_ first":
            scaler.unscale_(opt)
            if N > 1:
                with pytest.raises(hvd.HvddpError, match=r"unscale_\(optimizer\) ran before the gradients"):
                    scaler.step(opt)
                return
        if how == "synchronize+unscale_":
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.get_scale() == 2.0 ** 7  # the overflow halved it, on every rank
    assert_parity(model, ref)
    assert_replicas_identical(model, f"scaler.{how}")


def test_a_parameter_frozen_after_wrapping_stays_put():
    """Frozen after wrapping (grad None on every rank): not reduced as zeros, which momentum and
    weight decay would still turn into steps (it moved 3e-2 over 3 steps before)."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
                                   named_parameters=model.named_parameters(), groups=[[model.fc1.weight, model.fc1.bias]])
    for step in range(5):
        if step == 2:
            model.fc1.requires_grad_(False)
            frozen = model.fc1.weight.detach().clone()
        opt.zero_grad()
        x, y = batch(step)
        shard_loss(model, x, y, R).backward()
        opt.step()
    assert torch.equal(model.fc1.weight, frozen) and model.fc1.weight.grad is None
    model.fc1.requires_grad_(True)  # and it trains again
    opt.zero_grad()
    shard_loss(model, *batch(9), R).backward()
    opt.step()
    assert not torch.equal(model.fc1.weight, frozen)
    assert_replicas_identical(model, "frozen.after")


@pytest.mark.parametrize("groups", ["mixed", "int", "mixed_model_zero_grad"])
def test_groups_with_a_parameter_frozen_at_wrapping_match_one_process(groups):
    """fc1.weight frozen when wrapped, on every rank, in a group with trained parameters (a
    fine-tuning script that unfreezes a layer later): the group reduces its trained members, then
    fc1.weight too from the step after it is unfrozen; one process throughout. With
    ``model.zero_grad()`` instead of the optimizer's, step() is the first to see it unfrozen: it
    is reduced on its own that step, with its group from the next. The groups also hold a branch
    only the first rank uses, so that a group goes during backward on that rank and waits for
    step() on the others (which then sent it whole with fc1.weight: every rank raised)."""
    torch.manual_seed(0)
    ref = Net(extra=True)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.fc1.weight.requires_grad_(False)
    grouping = 2 if groups == "int" else [[model.fc1.weight, model.fc2.weight, model.branch.weight],
                                          [model.fc1.bias, model.fc2.bias, model.branch.bias, model.unused.weight]]
    ref_opt = OPTIMIZERS["sgd"](ref.parameters())
    opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                   named_parameters=model.named_parameters(), groups=grouping)
    frozen = model.fc1.weight.detach().clone()
    for step in range(STEPS):
        if step == 2:
            for m in (ref, model):
                m.fc1.weight.requires_grad_(True)
        train_step(model, ref, opt, ref_opt, step, zero_models=groups == "mixed_model_zero_grad")
        assert torch.equal(model.fc1.weight, frozen) == (step < 2)
        assert_parity(model, ref)
    assert_replicas_identical(model, f"groups.frozen.{groups}")


@pytest.mark.parametrize("kind", ["ungrouped", "grouped", "adasum"])
@pytest.mark.parametrize("how", ["frozen_later", "frozen_at_wrapping", "unfrozen_later"])
def test_a_parameter_frozen_on_one_rank_only_raises_on_every_rank(how, kind):
    """fc1 frozen (after wrapping, or when wrapped) on the last rank only, or unfrozen on the first
    rank only: the ranks that train it waited for ever on its reduction (the others left it
    alone, or sent another number of presence bytes). Every rank raises naming it, no update is
    applied, and once the ranks agree again training goes on. ``grouped``: fc1's group is frozen
    whole where it is frozen (nothing of it was submitted there). ``adasum``: op=Adasum, whose
    ranks that tracked fc1 waited for ever on its change (frozen when wrapped, or unfrozen, on
    some ranks only), or whose frozen rank took the others' change (frozen later)."""
    if kind == "adasum" and not POWER_OF_TWO:
        pytest.skip("Adasum needs a power-of-two size")
    grouped = kind == "grouped"
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    odd = R == N - 1 if how != "unfrozen_later" else R == 0  # the rank that differs
    model.fc1.requires_grad_({"frozen_at_wrapping": not odd, "unfrozen_later": False}.get(how, True))
    groups = [[model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.fc2.bias]] if grouped else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), groups=groups,
                                   **({"op": hvd.Adasum} if kind == "adasum" else {}))
    if how != "frozen_at_wrapping":
        train_step(model, copy.deepcopy(model), opt, torch.optim.SGD(Net().parameters(), lr=0.1), 0)
        model.fc1.requires_grad_(not odd if how == "frozen_later" else odd)
    before = flat(model)
    opt.zero_grad()
    shard_loss(model, *batch(1), R).backward()
    if N > 1:
        with pytest.raises(hvd.MismatchError, match=r"'fc1.weight' is frozen on some ranks and trains on others"):
            opt.step()
        assert torch.equal(flat(model), before)
    model.fc1.requires_grad_(True)  # the ranks agree again
    for step in (2, 3):
        opt.zero_grad()
        shard_loss(model, *batch(step), R).backward()
        opt.step()
    assert not torch.equal(flat(model), before)
    assert_replicas_identical(model, f"frozen.one.rank.{how}.{kind}")


@pytest.mark.parametrize("op", ["Average", "Adasum"])
def test_calls_on_the_wrapped_optimizer_after_wrapping_reach_the_wrapper(op):
    """The wrapped optimizer's add_param_group (its parameters are averaged too: replicas drifted
    1e-1 apart before) and load_state_dict (the wrapper kept the old lr and state; with Adasum
    the load raised AttributeError)."""
    if op == "Adasum" and not POWER_OF_TWO:
        pytest.skip("Adasum needs a power-of-two size (refusal tested above)")
    torch.manual_seed(0)
    model, extra = Net(), torch.nn.Linear(3, 3)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=getattr(hvd, op))
    base.add_param_group({"params": extra.parameters(), "lr": 0.05})
    torch.manual_seed(R)  # extra starts apart on every rank; averaging alone cannot join it
    hvd.broadcast_parameters(extra.state_dict(), root_rank=0)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step)
        F.mse_loss(extra(model(shard(x))), shard(y)).backward()
        opt.step()
    assert_replicas_identical(extra, "base.add_param_group")
    state = copy.deepcopy(base.state_dict())
    state["param_groups"][0]["lr"] = 0.01
    base.load_state_dict(state)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    assert opt.param_groups[0]["lr"] == 0.01
    import io
    with pytest.raises(TypeError, match="cannot be pickled.*Save optimizer.state_dict"):
        torch.save(opt, io.BytesIO())
