"""hvddp.torch.elastic at a fixed size, run by every rank under mpiexec (tests/test_torch.py)."""

import threading

import pytest
import torch

import hvddp.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def _gathered(values):
    return hvd.allgather_object(values)


def test_sampler_deals_every_index_once_per_epoch_padding_the_last_round():
    dataset = list(range(10))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        mine = list(sampler)
        assert len(mine) == len(sampler) == -(-10 // SIZE)
        shares = _gathered(mine)
        dealt = [i for share in shares for i in share]
        assert sorted(set(dealt)) == dataset  # every sample, on some rank
        assert len(dealt) - len(set(dealt)) == len(sampler) * SIZE - 10  # only the padding repeats
    orders = [list(hvd.elastic.ElasticSampler(dataset, seed=3)), list(hvd.elastic.ElasticSampler(dataset, seed=4))]
    assert orders[0] != orders[1] or SIZE >= 10  # the seed shuffles
    padded = dataset + dataset[:len(sampler) * SIZE - 10]
    assert list(hvd.elastic.ElasticSampler(dataset, shuffle=False)) == padded[RANK::SIZE]  # round-robin


def test_sampler_counts_what_the_job_processed_the_same_on_every_rank():
    dataset = list(range(12))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    state = hvd.elastic.TorchState(train_sampler=sampler, epoch=0)
    first = sampler.get_indices(0, 2)  # this rank's first batch of two
    sampler.record_batch(0, 2)
    assert sampler.processed_num == 2 * SIZE  # counted alike on every rank
    done = set().union(*map(set, _gathered(first)))
    state.commit()
    state.sync()  # the shares are dealt again from what is left (as in Horovod, at sync or restore)
    left = _gathered(list(sampler))
    assert set().union(*map(set, left)) == set(dataset) - done  # the rest, and only the rest
    assert all(len(share) == -(-(12 - 2 * SIZE) // SIZE) for share in left)
    sampler.record_batch(0, 2)
    state.restore()  # back to the commit, each rank on its own: the count is the job's
    assert sampler.processed_num == 2 * SIZE and _gathered(list(sampler)) == left
    checkpoint = hvd.broadcast_object(sampler.state_dict(), root_rank=0)  # rank 0's, loaded everywhere
    assert checkpoint == {"epoch": 0, "processed_num": 2 * SIZE}  # Horovod 0.28.1's format
    resumed = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    resumed.load_state_dict(checkpoint)
    assert list(resumed) == list(sampler)
    sampler.set_epoch(1)  # a new epoch starts from everything again
    assert sampler.processed_num == 0 and len(sampler) == -(-12 // SIZE)


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _step(model, optimizer, scale=1.0):
    optimizer.zero_grad()
    (model(torch.ones(4, 3)) * scale).sum().backward()
    optimizer.step()


def test_a_restore_before_any_commit_returns_every_rank_to_rank_zeros_synced_state():
    model, optimizer = _model_and_optimizer(seed=RANK)
    state = hvd.elastic.TorchState(model, optimizer, epoch=RANK)
    state.sync()
    _step(model, optimizer)
    state.restore()
    assert same(_gathered(model.weight.detach().tolist())) and state.epoch == 0


def same(values):
    return all(v == values[0] for v in values)


def test_torch_state_syncs_from_rank_zero_commits_and_restores():
    model, optimizer = _model_and_optimizer(seed=RANK)  # different on every rank
    _step(model, optimizer, scale=RANK + 1.0)  # rank-dependent momentum
    state = hvd.elastic.TorchState(model, optimizer, epoch=RANK, batch=7 * RANK)
    state.sync()
    weights = _gathered(model.weight.detach().tolist())
    momenta = _gathered(optimizer.state[model.weight]["momentum_buffer"].tolist())
    assert all(w == weights[0] for w in weights) and all(m == momenta[0] for m in momenta)
    assert (state.epoch, state.batch) == (0, 0)
    _step(model, optimizer)
    state.epoch, state.batch = 1, 3
    state.commit()
    kept = (model.weight.detach().clone(), optimizer.state[model.weight]["momentum_buffer"].clone())
    _step(model, optimizer)
    state.epoch, state.batch = 2, 9
    assert not torch.equal(model.weight, kept[0])
    state.restore()
    assert torch.equal(model.weight, kept[0])
    assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], kept[1])
    assert (state.epoch, state.batch) == (1, 3)
    _step(model, optimizer)
    state.restore()  # the commit itself was not changed by the step after the first restore
    assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], kept[1])
    other, _ = _model_and_optimizer(seed=99)
    state.model = other  # the state now tracks the new model
    state.commit()
    with torch.no_grad():
        other.weight.add_(1.0)
    state.restore()
    assert torch.equal(other.weight, _model_and_optimizer(seed=99)[0].weight)


def test_a_scheduler_stays_the_same_object_and_drives_the_real_optimizer():
    model, optimizer = _model_and_optimizer(seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, epoch=0)
    state.sync()
    state.commit()
    _step(model, optimizer)
    scheduler.step()
    state.restore()
    assert state.scheduler is scheduler and scheduler.last_epoch == 0
    _step(model, optimizer)
    state.scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.05  # the scheduler still drives this optimizer


def test_kept_objects_sync_rank_zeros_current_state_and_restore_the_committed_object():
    model, optimizer = _model_and_optimizer(seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    if RANK == 0:  # e.g. resumed from a checkpoint before training: rank 0's current state wins
        for _ in range(3):
            _step(model, optimizer)
            scheduler.step()
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, model_cls=torch.nn.Linear)
    state.sync()
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    assert state.model_cls is torch.nn.Linear  # a class is a plain value, though it has state_dict
    state.commit()
    state.scheduler = None
    state.restore()
    assert state.scheduler is scheduler and scheduler.last_epoch == 3


def test_sync_where_ranks_hold_different_kinds_of_value_gives_every_rank_rank_zeros():
    """An object with state_dict() on rank 0 only (the best model it alone evaluated), and a
    committed scheduler that rank 0 alone replaced by None: sync raised AttributeError on some
    ranks only ('NoneType' has no load_state_dict) and the others went on."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    torch.manual_seed(RANK)
    model, optimizer = _model_and_optimizer(seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = hvd.elastic.ObjectState(best=None, scheduler=scheduler, epoch=0)
    if RANK == 0:
        state.best = torch.nn.Linear(2, 2)
        scheduler.step()
    state.commit()
    if RANK == 0:
        state.scheduler = None  # not committed: the sync gives rank 0 its committed object back
    state.sync()
    assert state.scheduler is scheduler and scheduler.last_epoch == 1
    assert isinstance(state.best, torch.nn.Linear)
    weights = _gathered(state.best.weight.detach().tolist())
    assert all(w == weights[0] for w in weights), weights
    state.best.weight.data.fill_(7.0)  # a kept object from now on: a restore loads its commit
    state.restore()
    assert state.best.weight.detach().tolist() == weights[0]


def test_samplers_built_differently_on_some_rank_fail_the_sync_on_every_rank():
    """A per-rank seed (a DistributedSampler habit) dropped and repeated samples silently."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    for kwargs in ({"seed": RANK}, {"shuffle": RANK == 0}, {"dataset": list(range(10 + RANK))}):
        sampler = hvd.elastic.ElasticSampler(**{"dataset": list(range(10)), **kwargs})
        with pytest.raises(hvd.MismatchError, match=r"ElasticSampler: the ranks' samplers differ .*rank 1: "):
            hvd.elastic.TorchState(sampler=sampler).sync()
    sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=5)
    sampler.processed_num = 2 * SIZE if RANK == 0 else 0
    hvd.elastic.TorchState(sampler=sampler).sync()
    assert sampler.processed_num == 2 * SIZE and len(sampler) == -(-(10 - 2 * SIZE) // SIZE)


class _Locked:
    """state_dict() holds something deepcopy refuses: the rest is still copied item by item."""

    def __init__(self):
        self.items, self.lock = [1], threading.Lock()

    def state_dict(self):
        return {"items": self.items, "lock": self.lock}

    def load_state_dict(self, state):
        self.items = list(state["items"])


def test_a_commit_that_cannot_be_deep_copied_whole_is_copied_item_by_item():
    locked = _Locked()
    state = hvd.elastic.ObjectState(locked=locked)
    locked.items.append(2)
    state.restore()
    assert locked.items == [1]


def test_object_state_commit_is_a_copy():
    state = hvd.elastic.ObjectState(history=[1, 2])
    state.history.append(3)
    state.commit()
    state.history.append(4)
    state.restore()
    assert state.history == [1, 2, 3]
    state.history.append(5)
    state.restore()
    assert state.history == [1, 2, 3]


def test_run_syncs_then_calls_once_and_raises_errors_as_they_are():
    calls = []
    resets = []

    @hvd.elastic.run
    def train(state, extra):
        calls.append(state.epoch)
        state.check_host_updates()  # never finds a change
        return state.epoch + extra

    state = hvd.elastic.ObjectState(epoch=5 + RANK)
    state.register_reset_callbacks([lambda: resets.append(1)])
    assert train(state, 10) == 15 and calls == [5]

    @hvd.elastic.run
    def broken(state):
        calls.append("broken")
        raise ValueError("a bug in the training function")

    with pytest.raises(ValueError, match="a bug"):
        broken(state)
    assert calls == [5, "broken"] and resets == []  # not retried, no reset
    with pytest.raises(TypeError, match="first argument must be a hvddp elastic State"):
        train(object(), 1)
    assert issubclass(hvd.HostsUpdatedInterrupt, RuntimeError) and hvd.elastic.HostsUpdatedInterrupt is \
        hvd.HostsUpdatedInterrupt


class _Counter:
    """A kind of object TorchState knows nothing about."""

    def __init__(self, value):
        self.value = value


def test_horovods_module_paths_and_a_handler_added_to_the_registry():
    """Horovod's ``horovod.torch.elastic.state``/``.sampler`` import paths, and its registry: a
    handler registered for a new type commits, restores and syncs values of that type."""
    from hvddp.torch.elastic.sampler import ElasticSampler
    from hvddp.torch.elastic.state import StateHandler, TorchState, get_handler_registry, set_handler_registry

    assert TorchState is hvd.elastic.TorchState and ElasticSampler is hvd.elastic.ElasticSampler

    class CounterHandler(StateHandler):
        def __init__(self, counter):
            super().__init__(counter)
            self.saved = counter.value

        def save(self):
            self.saved = self.value.value

        def restore(self):
            self.value.value = self.saved

        def sync(self):
            self.value.value = hvd.broadcast_object(self.value.value, root_rank=0)

    before = get_handler_registry()
    set_handler_registry(before + [(_Counter, CounterHandler)])
    try:
        counter = _Counter(10 + RANK)
        state = TorchState(counter=counter, epoch=0)
        assert state._handlers["counter"].value is counter  # handled, not a plain attribute
        state.sync()
        assert counter.value == 10  # rank 0's, everywhere
        counter.value = 11
        state.commit()
        counter.value = 99
        state.restore()
        assert counter.value == 11
    finally:
        set_handler_registry(before)
    assert "counter" not in TorchState(counter=_Counter(1))._handlers  # registry back as it was
    with pytest.raises(TypeError, match=r"\(type, StateHandler subclass\) pairs; received \(<class 'int'>, 3\)"):
        set_handler_registry([(int, 3)])
    with pytest.raises(NotImplementedError, match="Bare must define save"):
        type("Bare", (StateHandler,), {})(1).save()


def test_sync_of_a_value_that_cannot_be_pickled_names_it_on_every_rank():
    state = hvd.elastic.ObjectState(epoch=RANK, guard=threading.Lock(), best=[1.0])
    with pytest.raises(TypeError, match=r"ObjectState.sync: rank 0's attribute 'guard' cannot be pickled"):
        state.sync()
    del state.guard, state._saved_state["guard"]  # without it the state syncs
    state.sync()
    assert state.epoch == 0 and state.best == [1.0]


def test_states_built_with_other_attributes_on_some_rank_fail_the_sync_on_every_rank():
    """A model, sampler or optimizer on some ranks only (or under another name) made the handlers'
    collectives differ, and the ranks waited on each other for ever; a plain attribute that rank 0
    lacked kept each rank's own value silently; an ObjectState with no attributes returned at once
    while the others waited."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    model, optimizer = _model_and_optimizer(seed=0)
    cases = [
        (dict(epoch=0, **({"ema": torch.nn.Linear(3, 2)} if RANK == 1 else {})),
         r"rank 1 has 'ema', which rank 0 lacks"),
        (dict(sampler=hvd.elastic.ElasticSampler(list(range(4))) if RANK == 0 else None),
         r"rank 1 'sampler' is a plain value there, handled by SamplerStateHandler on rank 0"),
        (dict(extra=3) if RANK == 1 else {}, r"rank 1 has 'extra', which rank 0 lacks"),
        (dict(zip(("ema", "best") if RANK == 0 else ("best", "ema"), (torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)))),
         r"rank 1 has them in another order: \['best', 'ema', 'model', 'optimizer'\]"),
    ]
    for kwargs, message in cases:
        state = hvd.elastic.TorchState(model, optimizer, **kwargs)
        with pytest.raises(hvd.MismatchError, match=r"TorchState.sync: the ranks' states differ from rank 0's: "
                                                     + message):
            state.sync()
    state = hvd.elastic.ObjectState(**({"epoch": 1} if RANK == 0 else {"epochs": 1}))
    with pytest.raises(hvd.MismatchError, match=r"ObjectState.sync: .*rank 1 lacks 'epoch' and has 'epochs'"):
        state.sync()
    hvd.elastic.ObjectState(**({"epoch": 1, "batch": 2} if RANK == 0 else {"batch": 2, "epoch": 1})).sync()  # any order
    state = hvd.elastic.ObjectState(**({"epoch": 1} if RANK == 0 else {}))
    with pytest.raises(hvd.MismatchError, match=r"rank 1 lacks 'epoch'"):
        state.sync()
    assert hvd.allreduce(torch.ones(1), name="elastic.after_mismatch").item() == 1.0  # nothing left pending
