"""Size-1 semantics of hvddp.torch (plain ``python``, no launcher); run by tests/test_torch.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

import hvddp.torch as hvd


def test_calls_before_init_raise():
    assert not hvd.is_initialized()
    with pytest.raises(hvd.NotInitializedError, match="init"):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(ValueError):  # what Horovod raises there, and ported scripts catch
        hvd.size()
    with pytest.raises(hvd.NotInitializedError):
        hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_compression_round_trips():
    x = torch.tensor([1.0, 1.0 / 3.0, -2.5e-3], dtype=torch.float64)
    for comp, dtype in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        sent, ctx = comp.compress(x)
        assert sent.dtype == dtype
        back = comp.decompress(sent, ctx)
        assert back.dtype == torch.float64
        assert torch.equal(back, x.to(dtype).to(torch.float64))
        ints = torch.arange(3)
        sent, ctx = comp.compress(ints)
        assert sent is ints and comp.decompress(sent, ctx) is ints
    sent, ctx = hvd.Compression.none.compress(x)
    assert sent is x and hvd.Compression.none.decompress(sent, ctx) is x


@pytest.fixture(scope="module")
def initialized():
    hvd.init()
    torch.set_num_threads(1)
    assert hvd.size() == 1 and hvd.rank() == 0 and hvd.local_size() == 1
    yield


def test_collectives_are_copies(initialized):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = hvd.allreduce(x, name="one")
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0), x * 6)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    assert torch.equal(hvd.alltoall(x), x)
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, x)
    assert hvd.grouped_allreduce([x, x])[1].shape == x.shape
    assert hvd.join() == 0
    hvd.barrier()


def test_optimizer_adds_nothing_at_size_one(initialized):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    assert opt._hvddp_hooks == [] and type(opt).step is not torch.optim.Adam.step
    x = torch.randn(8, 4)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            F.mse_loss(m(x), torch.ones(8, 2)).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)  # bit-identical to the plain optimizer
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()


def test_sync_batch_norm_is_batch_norm(initialized):
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4)
    sync, ref = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    assert torch.equal(sync(x), ref(x))
    assert torch.equal(sync.running_var, ref.running_var)
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    assert isinstance(converted[0], hvd.SyncBatchNorm)
    # a lazy layer not yet run has no width: refused by its path (it became SyncBatchNorm(0), whose
    # forward blamed the input's 3 channels); once run, it converts
    lazy = torch.nn.Sequential(torch.nn.Sequential(torch.nn.LazyBatchNorm1d()))
    with pytest.raises(ValueError, match=r"0\.0 is a LazyBatchNorm1d whose num_features is not known yet; "
                                         r"run the model once on a batch \(or build BatchNorm1d\(num_features\)\)"):
        hvd.SyncBatchNorm.convert_sync_batchnorm(lazy)
    lazy(x)
    assert hvd.SyncBatchNorm.convert_sync_batchnorm(lazy)[0][0].num_features == 3
    with pytest.raises(ValueError, match="at least 2"):
        sync(torch.ones(3))


def test_broadcast_helpers_at_size_one(initialized):
    model = torch.nn.Linear(2, 2)
    before = copy.deepcopy(model.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for k in before:
        assert torch.equal(before[k], model.state_dict()[k])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object(3) == [3]
    with pytest.raises(TypeError, match="state_dict"):
        hvd.broadcast_parameters(3, root_rank=0)
