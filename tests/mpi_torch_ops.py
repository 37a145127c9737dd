"""Rank-side tests of hvddp.torch's tensor collectives; run on every rank by tests/test_torch.py.

Inputs depend on the rank, so every rank checks the exact result of each collective.
"""

import contextlib
import inspect
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hvddp.torch as hvd

hvd.init()
torch.set_num_threads(1)
R, N = hvd.rank(), hvd.size()

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def base(dtype, shape=(2, 3), rank=R):
    """Small rank-dependent values that every dtype holds exactly (sums included)."""
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.int64).reshape(shape) % 7 + 3 * rank).to(dtype)


def all_bases(dtype, shape=(2, 3)):
    return [base(dtype, shape, r).to(torch.float64) for r in range(N)]


def assert_equal(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}"


# allreduce -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max"])
def test_allreduce_dtypes(dtype, op):
    x = base(dtype)
    stack = torch.stack(all_bases(dtype))
    expected = {"Sum": stack.sum(0), "Min": stack.min(0).values, "Max": stack.max(0).values,
                "Average": stack.sum(0) / N}[op]
    if op == "Average" and not dtype.is_floating_point:
        expected = torch.trunc(expected)
    out = hvd.allreduce(x, op=getattr(hvd, op), name=f"ar.{dtype}.{op}")
    assert_equal(out, expected.to(dtype))
    assert_equal(x, base(dtype))  # the input is left alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_inplace_async_and_product(dtype):
    x = base(dtype)
    ptr = x.data_ptr()
    handle = hvd.allreduce_async_(x, op=hvd.Sum, name=f"ar_.{dtype}")
    out = hvd.synchronize(handle)
    assert out is x and x.data_ptr() == ptr
    assert_equal(x, torch.stack(all_bases(dtype)).sum(0).to(dtype))
    y = (torch.arange(4) % 2 + 1).to(dtype)
    assert_equal(hvd.allreduce(y, op=hvd.Product, name=f"prod.{dtype}"), (y.to(torch.float64) ** N).to(dtype))


def test_allreduce_scale_factors_legacy_average_and_noncontiguous():
    x = base(torch.float64, (3, 4)).t()  # non-contiguous
    assert not x.is_contiguous()
    total = torch.stack(all_bases(torch.float64, (3, 4))).sum(0).t()
    out = hvd.allreduce(x, average=False, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    assert_equal(out, total)
    assert_equal(hvd.allreduce(x, average=True, name="legacy_avg"), total / N)
    hvd.allreduce_(x, op=hvd.Sum, name="noncontig_inplace")
    assert_equal(x, total)
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_allreduce_compression_fp16_bf16():
    x = torch.tensor([1.0, 1.0 / 3.0, 1000.1]) * (R + 1)
    exact = torch.tensor([1.0, 1.0 / 3.0, 1000.1]) * (N * (N + 1) / 2)
    for comp, dtype in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        out = hvd.allreduce(x, op=hvd.Sum, compression=comp, name=f"comp.{dtype}")
        assert out.dtype == torch.float32
        # every rank sent a 16-bit value; the sum is rounded once to 16 bits
        sent = sum(x.to(dtype).to(torch.float32) / (R + 1) * (r + 1) for r in range(N))
        assert_equal(out, sent.to(dtype).to(torch.float32))
        assert torch.allclose(out, exact, rtol=1e-2)
    ints = torch.arange(3) + R
    assert_equal(hvd.allreduce(ints, op=hvd.Sum, compression=hvd.Compression.fp16, name="comp.int"),
                 torch.arange(3) * N + sum(range(N)))
    # the core's compressors are the same casts (the error message names them): they failed on a
    # torch tensor with numpy's "Cannot interpret 'torch.float32' as a data type"
    import hvddp

    for core, ours in ((hvddp.Compression.fp16, hvd.Compression.fp16), (hvddp.Compression.bf16, hvd.Compression.bf16)):
        assert_equal(hvd.allreduce(x, op=hvd.Sum, compression=core, name="comp.core"),
                     hvd.allreduce(x, op=hvd.Sum, compression=ours, name="comp.ours"))
        for got, want in zip(hvd.grouped_allreduce([x, x[:2]], compression=core, name="comp.core.g"),
                             hvd.grouped_allreduce([x, x[:2]], compression=ours, name="comp.ours.g")):
            assert_equal(got, want)
        rows = torch.ones(2 * N, 2) * (R + 1) / 3
        assert_equal(hvd.reducescatter(rows, compression=core, name="comp.core.rs"),
                     hvd.reducescatter(rows, compression=ours, name="comp.ours.rs"))


def test_grouped_allreduce_all_forms():
    xs = [base(torch.float32, (2,)), base(torch.int32, (3, 2)), base(torch.bfloat16, (4,))]
    expected = [torch.stack(all_bases(t.dtype, t.shape)).sum(0).to(t.dtype) for t in xs]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="g1")
    for o, e in zip(outs, expected):
        assert_equal(o, e)
    outs = hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum, name="g2"))
    for o, e in zip(outs, expected):
        assert_equal(o, e)
    ys = [x.clone() for x in xs]
    assert hvd.grouped_allreduce_(ys, op=hvd.Sum, name="g3")[1] is ys[1]
    for o, e in zip(ys, expected):
        assert_equal(o, e)
    zs = [x.clone() for x in xs]
    handle = hvd.grouped_allreduce_async_(zs, op=hvd.Sum, name="g4")
    hvd.synchronize(handle)
    for o, e in zip(zs, expected):
        assert_equal(o, e)
    # members named as asked: they meet the calls of other ranks under those names
    for fn in (hvd.grouped_allreduce_async, hvd.grouped_allreduce_async_):
        if N > 1:
            handle = (fn([x.clone() for x in xs], op=hvd.Sum, names=["g5.a", "g5.b", "g5.c"]) if R == 0
                      else hvd.allreduce_async(xs[1].clone(), op=hvd.Sum, name="g5.b"))
            with pytest.raises(hvd.MismatchError, match=r"'g5.b': group differs across ranks: rank 0 a group of 3"):
                hvd.synchronize(handle)
        for o, e in zip(hvd.synchronize(fn([x.clone() for x in xs], op=hvd.Sum, names=["g5.a", "g5.b", "g5.c"])),
                        expected):
            assert_equal(o, e)
    for o, e in zip(hvd.grouped_allreduce_([x.clone() for x in xs], op=hvd.Sum, names=["g6.a", "g6.b", "g6.c"]),
                    expected):
        assert_equal(o, e)


def test_poll_and_async():
    x = torch.ones(1000) * R
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="poll")
    assert isinstance(hvd.poll(handle), bool)
    out = hvd.synchronize(handle)
    assert hvd.poll(handle)
    assert_equal(out, torch.ones(1000) * sum(range(N)))


def test_threads_waiting_on_one_handle_together():
    """Several threads may synchronize one handle, as with the core's: each gets the result (the
    second waiter used to call the finisher the first had cleared: TypeError, ~9 runs in 10)."""
    for i in range(20):
        handle = hvd.allreduce_async(torch.ones(1000) * R, op=hvd.Sum, name=f"two_waiters.{i}")
        start, outs = threading.Barrier(3), []

        def waiter():
            start.wait()
            try:
                outs.append(hvd.synchronize(handle, timeout=60))
            except Exception as exc:  # (reported below, on the test's thread)
                outs.append(exc)

        threads = [threading.Thread(target=waiter) for _ in range(2)]
        for t in threads:
            t.start()
        start.wait()
        for t in threads:
            t.join(60)
        assert len(outs) == 2 and outs[0] is outs[1], outs
        assert_equal(outs[0], torch.ones(1000) * sum(range(N)))


# allgather, broadcast, alltoall, reducescatter --------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool], ids=str)
def test_allgather_uneven_dtypes(dtype):
    x = torch.full((R + 1, 2), R % 2 if dtype == torch.bool else R + 1).to(dtype)
    out = hvd.allgather(x, name=f"ag.{dtype}")
    expected = torch.cat([torch.full((r + 1, 2), r % 2 if dtype == torch.bool else r + 1).to(dtype)
                          for r in range(N)])
    assert_equal(out, expected)
    out = hvd.synchronize(hvd.allgather_async(x, name=f"ag_async.{dtype}"))
    assert_equal(out, expected)


def test_grouped_allgather():
    xs = [torch.full((R + 1,), R, dtype=torch.int64), torch.full((1, 3), R + 0.5, dtype=torch.float64)]
    outs = hvd.grouped_allgather(xs, name="gag")
    assert_equal(outs[0], torch.cat([torch.full((r + 1,), r) for r in range(N)]))
    assert_equal(outs[1], torch.cat([torch.full((1, 3), r + 0.5, dtype=torch.float64) for r in range(N)]))
    outs = hvd.synchronize(hvd.grouped_allgather_async(xs, name="gag_async"))
    assert_equal(outs[0], torch.cat([torch.full((r + 1,), r) for r in range(N)]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_dtypes(dtype):
    root = N - 1
    x = base(dtype)
    assert_equal(hvd.broadcast(x, root, name=f"bc.{dtype}"), base(dtype, rank=root))
    assert_equal(x, base(dtype))
    y = base(dtype)
    assert hvd.broadcast_(y, root, name=f"bc_.{dtype}") is y
    assert_equal(y, base(dtype, rank=root))
    z = base(dtype)
    hvd.synchronize(hvd.broadcast_async_(z, 0, name=f"bc_async_.{dtype}"))
    assert_equal(z, base(dtype, rank=0))
    assert_equal(hvd.synchronize(hvd.broadcast_async(x, 0, name=f"bc_async.{dtype}")), base(dtype, rank=0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoall_dtypes(dtype):
    # rank r sends (d + 1) rows to rank d, each row holding 10 * r + d
    splits = [d + 1 for d in range(N)]
    x = torch.cat([torch.full((d + 1, 2), 10 * R + d) for d in range(N)]).to(dtype)
    out, received = hvd.alltoall(x, splits=splits, name=f"a2a.{dtype}")
    assert_equal(out, torch.cat([torch.full((R + 1, 2), 10 * r + R) for r in range(N)]).to(dtype))
    assert received.tolist() == [R + 1] * N
    even = torch.arange(N, dtype=torch.int64).to(dtype) + R
    assert_equal(hvd.alltoall(even, name=f"a2a_even.{dtype}"), (torch.arange(N) + R).to(dtype))
    out, received = hvd.synchronize(hvd.alltoall_async(x, torch.tensor(splits), name=f"a2a_async.{dtype}"))
    assert received.tolist() == [R + 1] * N


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reducescatter_dtypes(dtype):
    rows = 2 * N + 1  # uneven: the first rank gets one more row
    x = base(dtype, (rows, 2))
    total = torch.stack(all_bases(dtype, (rows, 2))).sum(0)
    counts = [rows // N + (1 if r < rows % N else 0) for r in range(N)]
    start = sum(counts[:R])
    out = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{dtype}")
    assert_equal(out, total[start:start + counts[R]].to(dtype))
    if dtype.is_floating_point:
        out = hvd.synchronize(hvd.reducescatter_async(x, name=f"rs_avg.{dtype}"))
        assert_equal(out, (total[start:start + counts[R]] / N).to(dtype))
    outs = hvd.grouped_reducescatter([x, x], op=hvd.Sum, name=f"grs.{dtype}")
    assert_equal(outs[1], total[start:start + counts[R]].to(dtype))


def test_sparse_allreduce():
    dense = torch.zeros(5, 3)
    dense[R % 5] = R + 1.0
    dense[4] = 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Average)
    out = hvd.synchronize(handle)
    assert out.is_sparse
    expected = torch.zeros(5, 3)
    for r in range(N):
        expected[r % 5] += (r + 1.0) / N
    expected[4] += 1.0
    assert torch.allclose(out.to_dense(), expected)
    # Horovod's form: the handle is a function that returns the result
    call = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.called", op=hvd.Average)
    assert torch.allclose(call().to_dense(), expected)
    # name=None: automatic names, so two at once do not collide (they were both "None.values")
    first, second = (hvd.sparse_allreduce_async(dense.to_sparse(), None, hvd.Average) for _ in range(2))
    assert first.name != second.name
    for h in (first, second):
        assert torch.allclose(hvd.synchronize(h).to_dense(), expected)
    # no sparse dimensions (all dense ones): nothing to check an index against
    flat = torch.sparse_coo_tensor(torch.empty((0, 1), dtype=torch.int64), torch.tensor([[1.0, 2.0, 3.0]]), (3,))
    assert torch.equal(hvd.synchronize(hvd.sparse_allreduce_async(flat, "sparse.dim0", hvd.Sum)).to_dense(),
                       torch.tensor([1.0, 2.0, 3.0]) * N)


def test_sparse_allreduce_of_other_shapes_raises_on_every_rank():
    """Rank 0's tensor is (3,), the others' (11,) with an entry at 10: every rank raises (rank 0
    got a (3,) tensor holding index 10, built without checks)."""
    if N == 1:
        pytest.skip("needs two ranks")
    length = 3 if R == 0 else 11
    t = torch.sparse_coo_tensor(torch.tensor([[min(R * 10, length - 1)]]), torch.ones(1), (length,))
    with pytest.raises(hvd.MismatchError, match=r"sparse_allreduce_async 'sparse.shapes'.*different shapes \("
                       f"this rank's is \\({length},\\), and not every rank's is\\)"):
        hvd.synchronize(hvd.sparse_allreduce_async(t, name="sparse.shapes", op=hvd.Sum))
    # the others' entry at index 3 sits where rank 0's shape row (3,) is: the message counted it as
    # a rank of rank 0's shape ("2 of 2 ranks have this rank's (3,)")
    length = 3 if R == 0 else 4
    t = torch.sparse_coo_tensor(torch.tensor([[min(3, length - 1)]]), torch.ones(1), (length,))
    with pytest.raises(hvd.MismatchError, match=r"this rank's is \(" f"{length}" r",\), and not every"):
        hvd.synchronize(hvd.sparse_allreduce_async(t, name="sparse.shapes.row", op=hvd.Sum))
    assert hvd.allgather_object("after") == ["after"] * N


def test_sparse_allreduce_with_other_ops_raises_on_every_rank():
    """Rank 0 Sum, the others Average: each rank applied its own op to what it gathered and the
    results differed by rank, silently (a dense allreduce raises). Also with a hybrid tensor and
    an integer one."""
    if N == 1:
        pytest.skip("needs two ranks")
    op = hvd.Sum if R == 0 else hvd.Average
    for name, t in (("sparse.ops", torch.eye(3).to_sparse()),
                    ("sparse.ops.hybrid", torch.ones(4, 2).to_sparse(1)),
                    ("sparse.ops.int", torch.eye(3, dtype=torch.int32).to_sparse())):
        with pytest.raises(hvd.MismatchError, match=f"sparse_allreduce_async {name!r}: op differs across "
                           r"ranks: rank 0 Sum, rank 1 Average"):
            hvd.synchronize(hvd.sparse_allreduce_async(t, name=name, op=op))
    assert hvd.allgather_object("after") == ["after"] * N


def test_objects_barrier_join():
    assert hvd.broadcast_object({"r": R, "t": torch.arange(3) + R}, root_rank=N - 1)["r"] == N - 1
    gathered = hvd.allgather_object(("rank", R))
    assert gathered == [("rank", r) for r in range(N)]
    hvd.barrier()
    # Uneven data: rank r has r + 1 batches; joined ranks contribute zeros.
    for step in range(R + 1):
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"join.{step}")
        assert_equal(out, torch.ones(2) * sum(1 for r in range(N) if r >= step))
    assert hvd.join() == N - 1


def test_process_set():
    if N < 3:
        pytest.skip("needs 3 ranks")
    ps = hvd.add_process_set([0, 2])
    try:
        if ps.included():
            out = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=ps, name="ps")
            assert_equal(out, torch.tensor([2.0]))
            # root_rank is a global rank, as in Horovod: 2 is the set's second member
            assert_equal(hvd.broadcast(torch.tensor([float(R)]), 2, name="ps.bc", process_set=ps),
                         torch.tensor([2.0]))
            model = torch.nn.Linear(2, 2)
            torch.nn.init.constant_(model.weight, float(R))
            hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=ps)
            assert_equal(model.weight.detach(), torch.full((2, 2), 2.0))
            opt = torch.optim.SGD(model.parameters(), lr=0.1 * (R + 1))
            hvd.broadcast_optimizer_state(opt, root_rank=2, process_set=ps)
            assert opt.param_groups[0]["lr"] == 0.1 * 3
            opt.param_groups[0]["lr"] = 0.5 * (R + 1)
            hvd.broadcast_optimizer_state(opt, 2, ps)  # hvddp's earlier positional order still works
            assert opt.param_groups[0]["lr"] == 0.5 * 3
            # a root outside the set on one member only raises on both: rank 0 refused it at its first
            # broadcast alone, and rank 2 waited for ever for the others
            with pytest.raises(ValueError if R == 0 else hvd.MismatchError,
                               match=r"^broadcast_parameters: (rank 0 refused its root_rank \()?root_rank is "
                                     r"a global rank .* got 1\."):
                hvd.broadcast_parameters(model.state_dict(), root_rank=1 if R == 0 else 2, process_set=ps)
            hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=ps)  # the next call meets
        else:  # named or not, the call says it is sparse_allreduce_async's (named, it said allgather)
            for name in ("sparse.outside", None):
                with pytest.raises(ValueError, match=r"^sparse_allreduce_async: this rank \(1\) is not a member"):
                    hvd.sparse_allreduce_async(torch.eye(2).to_sparse(), name, hvd.Sum, ps)
            model = torch.nn.Linear(2, 2)  # (they said allgather_object and broadcast_object)
            with pytest.raises(ValueError, match=r"^broadcast_parameters: this rank \(1\) is not a member"):
                hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=ps)
            with pytest.raises(ValueError, match=r"^broadcast_optimizer_state: this rank \(1\) is not a member"):
                hvd.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), 2, process_set=ps)
    finally:
        hvd.remove_process_set(ps)


# autograd --------------------------------------------------------------------------------------
def test_allreduce_grad():
    for op, factor in ((hvd.Sum, N), (hvd.Average, 1.0)):
        x = torch.arange(4.0, requires_grad=True)
        y = hvd.allreduce(x * (R + 1), op=op, name=f"grad.ar.{op}")
        (y * (R + 1)).sum().backward()
        # d/dx_r sum_k (k+1) * y_k = (r+1) * op-backward of (k+1)
        upstream = sum(k + 1 for k in range(N)) / (1 if op == hvd.Sum else N)
        assert_equal(x.grad, torch.full((4,), (R + 1) * upstream))
    x = torch.ones(3, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0, name="grad.scaled")
    y.sum().backward()
    assert_equal(x.grad, torch.full((3,), 6.0 * N))
    with pytest.raises(RuntimeError, match="not differentiable"):
        hvd.allreduce(torch.ones(2, requires_grad=True), op=hvd.Max, name="grad.max").sum().backward()


@pytest.mark.parametrize("names", [None, ["gar.a", "gar.b"]])
def test_grouped_allreduce_grad(names):
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="grad.gar", names=names)
    (ya.sum() * (R + 1) + yb.sum() * 2).backward()
    assert_equal(a.grad, torch.full((2,), float(sum(r + 1 for r in range(N)))))
    assert_equal(b.grad, torch.full((3,), 2.0 * N, dtype=torch.float64))


def test_allgather_grad():
    x = torch.ones(R + 1, 2, requires_grad=True)
    y = hvd.allgather(x, name="grad.ag")
    rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)])
    (y * rows * (R + 1)).sum().backward()
    # Horovod: Average-allreduce of the upstream gradient, sliced to this rank's rows
    mean_factor = sum(r + 1 for r in range(N)) / N
    assert_equal(x.grad, torch.full((R + 1, 2), R * mean_factor))
    a, b = torch.ones(R + 1, requires_grad=True), torch.ones(1, requires_grad=True)
    ya, yb = hvd.grouped_allgather([a, b], name="grad.gag")
    (ya.sum() + 2 * yb.sum()).backward()
    assert_equal(a.grad, torch.ones(R + 1))
    assert_equal(b.grad, torch.full((1,), 2.0))
    # a bool or int member has no gradient: backward reduces the floating ones only (it averaged
    # every member's, and the bool mask's zeros made the Average raise on every rank)
    feat, mask, ids = torch.ones(2, 3, requires_grad=True), torch.tensor([True, False]), torch.arange(2)
    out_feat, out_mask, out_ids = hvd.grouped_allgather([feat, mask, ids], name="grad.gag.mask")
    assert out_mask.tolist() == [True, False] * N and out_ids.tolist() == [0, 1] * N
    (out_feat * (R + 1)).sum().backward()
    assert_equal(feat.grad, torch.full((2, 3), sum(r + 1 for r in range(N)) / N))


def test_broadcast_grad():
    root = N - 1
    x = torch.ones(3, requires_grad=True)
    y = hvd.broadcast(x * (R + 1), root, name="grad.bc")
    assert_equal(y.detach(), torch.full((3,), float(root + 1)))
    (y * (R + 1)).sum().backward()
    mean_up = sum(r + 1 for r in range(N)) / N
    expected = (root + 1) * mean_up if R == root else 0.0
    assert_equal(x.grad, torch.full((3,), float(expected)))


def test_alltoall_splits_tensor_of_floats_is_refused_on_every_rank():
    """int() of each element truncated a float tensor's 1.9 to 1: a row silently unsent."""
    x = torch.ones(2 * N)
    if R == 0:
        with pytest.raises(TypeError, match=r"alltoall: splits must be a 1-D tensor or array of ints"):
            hvd.alltoall(x, splits=torch.full((N,), 1.9))
    elif N > 1:
        with pytest.raises(hvd.MismatchError, match=r"refused on rank\(s\) \[0\]"):
            hvd.alltoall(x, splits=[2] * N)
    out, received = hvd.alltoall(x, splits=torch.full((N,), 2))
    assert received.tolist() == [2] * N
    if R == 0:  # a 0-d array: was a bare "iteration over a 0-d array", unannounced
        with pytest.raises(TypeError, match=r"alltoall: splits must be a 1-D tensor or array of ints"):
            hvd.alltoall(x, splits=np.array(2))
    elif N > 1:
        with pytest.raises(hvd.MismatchError, match=r"refused on rank\(s\) \[0\]"):
            hvd.alltoall(x, splits=np.full(N, 2))
    for empty in ([], torch.tensor([]), np.array([], np.float64)):  # empty: an even split
        out, received = hvd.alltoall(x, splits=empty)
        assert received.tolist() == [2] * N


def test_alltoall_grad():
    splits = [d + 1 for d in range(N)]
    x = torch.ones(sum(splits), requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits, name="grad.a2a")
    # upstream: the rows received from rank r are weighted by 10 * R + r
    weights = torch.cat([torch.full((R + 1,), 10.0 * R + r) for r in range(N)])
    (out * weights).sum().backward()
    assert_equal(x.grad, torch.cat([torch.full((d + 1,), 10.0 * d + R) for d in range(N)]))
    # a buffer padded past sum(splits) (as Horovod allows): the unsent rows' gradient is zero
    x = torch.ones(sum(splits) + 2, requires_grad=True)
    out, received = hvd.alltoall(x * (R + 1), splits=splits, name="grad.a2a.padded")
    assert_equal(out, torch.cat([torch.full((R + 1,), r + 1.0) for r in range(N)]))
    (out * weights).sum().backward()
    assert_equal(x.grad, torch.cat([torch.full((d + 1,), (10.0 * d + R) * (R + 1)) for d in range(N)]
                                   + [torch.zeros(2)]))
    # empty splits are even splits (Horovod's reading); a bare int is refused, naming splits
    out, received = hvd.alltoall(torch.arange(2 * N), splits=[], name="a2a.empty.splits")
    assert received.tolist() == [2] * N and out.tolist() == [2 * R, 2 * R + 1] * N
    with pytest.raises(TypeError, match="splits must be a list"):
        hvd.alltoall(torch.arange(2 * N), splits=2)


def test_reducescatter_grad():
    """Horovod's factors: the allgathered gradient times the size for Sum, as it is for Average,
    times the scale factors."""
    rows = 2 * N
    for op, factor, pre in ((hvd.Sum, N, 1.0), (hvd.Average, 1, 1.0), (hvd.Average, 3, 3.0)):
        x = torch.ones(rows, requires_grad=True)
        y = hvd.reducescatter(x, op=op, name=f"grad.rs.{op}.{pre}", prescale_factor=pre)
        (y * (R + 1)).sum().backward()
        expected = torch.cat([torch.full((2,), (r + 1.0) * factor) for r in range(N)])
        assert_equal(x.grad, expected)
    a = torch.ones(rows, requires_grad=True)
    (ya,) = hvd.grouped_reducescatter([a], op=hvd.Sum, name="grad.grs")
    (ya * (R + 1)).sum().backward()
    assert_equal(a.grad, torch.cat([torch.full((2,), (r + 1.0) * N) for r in range(N)]))


def test_second_order_gradients_through_collectives():
    """create_graph=True (a gradient penalty) goes through the collectives a second time, as in
    Horovod: the backward passes used the non-differentiable forms, so the penalty's gradient
    lost the other ranks' part silently (320 where one process has 968) or had no graph at all.
    Allreduce, grouped allreduce and alltoall backpropagate their exact adjoints: every rank's
    result equals one process differentiating the sum of the ranks' losses (loss r = sum(w_r *
    y_r ** 3), penalty = the squared gradient). Allgather and broadcast average their gradient
    over the ranks (Horovod's convention): for them the one process takes the mean of the losses,
    then of the penalties."""
    xs = [torch.linspace(-1.0, 1.0, 2 * N, dtype=torch.float64) * (r + 1) + r for r in range(N)]

    def weights(n):
        return [torch.linspace(0.5, 2.0, n, dtype=torch.float64) + r for r in range(N)]

    def one_process(outputs, mean=False):  # outputs(X) -> [rank r's output]
        X = [x.clone().requires_grad_() for x in xs]
        ys = outputs(X)
        scale = 1.0 / N if mean else 1.0
        loss = scale * sum((w * y ** 3).sum() for w, y in zip(weights(ys[0].numel()), ys))
        grads = torch.autograd.grad(loss, X, create_graph=True, materialize_grads=True)
        (scale * sum((g * g).sum() for g in grads)).backward()
        return grads[R].detach(), torch.zeros_like(X[R]) if X[R].grad is None else X[R].grad

    def distributed(output):
        x = xs[R].clone().requires_grad_()
        y = output(x)
        g, = torch.autograd.grad((weights(y.numel())[R] * y ** 3).sum(), x, create_graph=True)
        (g * g).sum().backward()
        return g.detach(), x.grad

    root = N - 1
    cases = {
        "allreduce.sum": (lambda x: hvd.allreduce(x, op=hvd.Sum, name="g2.sum") + x,
                          lambda X: [sum(X) + x for x in X], False),
        "allreduce.average": (lambda x: hvd.allreduce(x * x, name="g2.avg") * x,
                              lambda X: [sum(x * x for x in X) / N * x for x in X], False),
        "grouped_allreduce": (lambda x: torch.cat(hvd.grouped_allreduce([x[:N], x[N:] * x[N:]], op=hvd.Sum,
                                                                        name="g2.grouped")) * x,
                              lambda X: [torch.cat([sum(v[:N] for v in X), sum(v[N:] * v[N:] for v in X)]) * x
                                         for x in X], False),
        "alltoall": (lambda x: hvd.alltoall(x * x, name="g2.a2a") + x,
                     lambda X: [torch.cat([X[s][2 * r:2 * r + 2] ** 2 for s in range(N)]) + X[r] for r in range(N)],
                     False),
        "allgather": (lambda x: hvd.allgather(x, name="g2.ag"), lambda X: [torch.cat(X)] * N, True),
        # the other ranks' gradients are zeros, yet in the graph: the second backward meets the
        # root's allreduce on every rank (it waited on the root alone)
        "broadcast": (lambda x: hvd.broadcast(x, root, name="g2.bc"),
                      lambda X: [X[root]] * N, True),
    }
    for case, (output, outputs, mean) in cases.items():
        want_g, want = one_process(outputs, mean)
        g, got = distributed(output)
        torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-12, msg=f"{case}: first order")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{case}: second order")
    # SyncBatchNorm (two Sum allreduces): the penalty's gradient equals BatchNorm's on the whole
    # batch (it differed by up to 0.005 from it)
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(2).double()
    sync = hvd.SyncBatchNorm(2).double()
    sync.load_state_dict(bn.state_dict())
    parts = [torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(N)]
    whole = torch.cat(parts).requires_grad_()
    g_whole, = torch.autograd.grad((bn(whole) ** 3).sum(), whole, create_graph=True)
    (g_whole * g_whole).sum().backward()
    x = parts[R].clone().requires_grad_()
    g, = torch.autograd.grad((sync(x) ** 3).sum(), x, create_graph=True)
    (g * g).sum().backward()
    torch.testing.assert_close(g.detach(), g_whole.detach()[3 * R:3 * R + 3], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, whole.grad[3 * R:3 * R + 3], rtol=1e-10, atol=1e-10)
    # reducescatter: Horovod's backward (an allgather, times the size) is differentiable in turn
    x = xs[R].clone().requires_grad_()
    g, = torch.autograd.grad((hvd.reducescatter(x * x, op=hvd.Sum, name="g2.rs") ** 2).sum(), x,
                             create_graph=True)
    assert g.grad_fn is not None
    (g * g).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


# SyncBatchNorm ---------------------------------------------------------------------------------
def test_sync_batch_norm_names_do_not_depend_on_the_layers_a_rank_built():
    """Rank 0 builds one more layer than the others (never run): the layers all ranks run
    must still meet (names come from the channel count, not from a construction counter)."""
    if R == 0:
        hvd.SyncBatchNorm(4)
    norm = hvd.SyncBatchNorm(4)
    out = norm(torch.full((2, 4), float(R)))
    centered = float(R) - (N - 1) / 2
    variance = sum((r - (N - 1) / 2) ** 2 for r in range(N)) / N
    torch.testing.assert_close(out, torch.full((2, 4), centered / (variance + norm.eps) ** 0.5))


def test_sync_batch_norm_input_of_the_wrong_width_on_one_rank_fails_every_rank():
    """The rank with the bad input raised at once; the others waited in the layer's allreduce
    (for good, if that rank caught the error and went on)."""
    if N == 1:
        pytest.skip("needs two ranks")
    bn = hvd.SyncBatchNorm(4)
    x = torch.randn(5, 3 if R == 0 else 4)
    with pytest.raises(ValueError if R == 0 else RuntimeError,  # (a MismatchError on the others)
                       match=r"SyncBatchNorm\(4\) got an input with 3 channels" if R == 0
                       else r"'sync_batch_norm.4.sum' was refused on rank\(s\) \[0\]"):
        bn(x)
    assert bn(torch.randn(5, 4)).shape == (5, 4)  # and the next call meets
    # the failed call counted nowhere (it counted on the peers: momentum=None's averages differed)
    assert hvd.allgather_object(int(bn.num_batches_tracked)) == [1] * N


def test_sync_batch_norm_input_needing_a_gradient_on_some_ranks_only_fails_every_rank():
    """Rank 0's input needs a gradient, the others' not (or they run under no_grad): rank 0's
    backward waited for ever in the statistics' gradient allreduces the others never recorded."""
    if N == 1:
        pytest.skip("needs two ranks")
    bn = hvd.SyncBatchNorm(3)
    for no_grad in (False, True):
        x = torch.randn(4, 3, 2, requires_grad=R == 0 or no_grad)
        with torch.no_grad() if no_grad and R != 0 else contextlib.nullcontext():
            with pytest.raises(ValueError, match=rf"needs a gradient on 1 of {N} ranks \(on this rank: "
                                                 rf"{'yes' if R == 0 else 'no'}\)"):
                bn(x)
    assert int(bn.num_batches_tracked) == 0
    y = bn(torch.randn(4, 3, 2, requires_grad=True))  # alike everywhere: forward and backward meet
    y.sum().backward()
    assert int(bn.num_batches_tracked) == 1


def test_sync_batch_norm_trains_on_while_a_rank_has_joined():
    """A rank out of data calls join(): its zeros leave its slot out of the statistics and of
    backward's sums, so the others get BatchNorm on their own batches (counted among the ranks
    whose input needs a gradient, the joined one made the others raise that it had none)."""
    sync, ref = hvd.SyncBatchNorm(3).double(), torch.nn.BatchNorm1d(3).double()
    try:
        if R == 0:
            for step in range(2):
                x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
                x_ref = x.detach().clone().requires_grad_()
                (sync(x) ** 2).sum().backward()
                (ref(x_ref) ** 2).sum().backward()
                torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(sync.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-10)
    finally:
        assert hvd.join() == 0


@pytest.mark.parametrize("affine", [True, False])
def test_sync_batch_norm_matches_batch_norm(affine):
    torch.manual_seed(0)
    per_rank = [2 + r for r in range(N)]  # uneven batches
    full = torch.randn(sum(per_rank), 3, 4, 5, dtype=torch.float64) * 3 + 1
    upstream = torch.randn_like(full)
    start = sum(per_rank[:R])
    mine = slice(start, start + per_rank[R])
    ref = torch.nn.BatchNorm2d(3, affine=affine).double()
    sync = hvd.SyncBatchNorm(3, affine=affine).double()
    if affine:
        with torch.no_grad():
            for m in (ref, sync):
                m.weight.copy_(torch.linspace(0.5, 1.5, 3))
                m.bias.copy_(torch.linspace(-1, 1, 3))
    for _ in range(2):
        x_ref = full.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * upstream).sum().backward()
        x = full[mine].clone().requires_grad_()
        y = sync(x)
        (y * upstream[mine]).sum().backward()
        torch.testing.assert_close(y, y_ref[mine], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(x.grad, x_ref.grad[mine], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sync.running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
    assert int(sync.num_batches_tracked) == 2
    if affine:
        # the parameter gradient is this rank's share; summed over ranks it is the full one
        total_w = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name=f"bn.wgrad.{affine}")
        torch.testing.assert_close(total_w, ref.weight.grad, rtol=1e-10, atol=1e-10)
    sync.eval()
    ref.eval()
    torch.testing.assert_close(sync(full[mine]), ref(full[mine]), rtol=1e-10, atol=1e-10)


def test_sync_batch_norm_half_input_uses_float32_statistics():
    torch.manual_seed(1)
    full = torch.randn(4 * N, 3, 5) * 2 + 1
    ref = torch.nn.BatchNorm1d(3)(full.bfloat16().float())
    sync = hvd.SyncBatchNorm(3)
    out = sync(full[4 * R:4 * R + 4].bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref[4 * R:4 * R + 4], rtol=2e-2, atol=2e-2)


def test_sync_batch_norm_empty_and_single_value_batches_and_eval_alone():
    """A step whose global batch is empty leaves the running statistics (they became NaN); one
    value per channel over all ranks raises on every rank, as BatchNorm; in eval mode without
    running statistics a rank normalizes alone, as torch's SyncBatchNorm (it waited for the
    others and hung a rank-0-only evaluation); a wrong channel count is named."""
    torch.manual_seed(0)
    sync, ref = hvd.SyncBatchNorm(2), torch.nn.BatchNorm1d(2)
    full = torch.randn(4 * N, 2) + 3
    ref(full)
    sync(full[4 * R:4 * R + 4])
    sync(torch.randn(0, 2)).sum().backward()
    ref(torch.randn(0, 2))
    assert torch.equal(sync.weight.grad, torch.zeros(2)) and torch.equal(sync.bias.grad, torch.zeros(2))
    torch.testing.assert_close(sync.running_mean, ref.running_mean)
    torch.testing.assert_close(sync.running_var, ref.running_var)
    assert torch.isfinite(sync.running_var).all()
    one = torch.randn(1 if R == 0 else 0, 2)
    with pytest.raises(ValueError, match="(?i)expected more than 1 value per channel"):
        sync(one)
    free = hvd.SyncBatchNorm(2, track_running_stats=False).eval()
    if R == 0:  # the others never run it
        x = torch.randn(5, 2)
        torch.testing.assert_close(free(x), torch.nn.BatchNorm1d(2, track_running_stats=False)(x))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(2\) got an input with 5 channels"):
        sync(torch.randn(3, 5))
    # an integer input is refused on every rank (it was normalized in training, and a uint8 batch
    # of over 255 rows failed on its rank alone while the others waited)
    with pytest.raises(TypeError, match=r"SyncBatchNorm\(2\) got an input of dtype torch.uint8"):
        sync(torch.full((300 if R == 0 else 8, 2), 10, dtype=torch.uint8))
    raised = None
    try:
        sync(torch.ones(4, 2, dtype=torch.int64) if R == 0 else torch.randn(4, 2))
    except Exception as exc:
        raised = exc
    if R == 0:
        assert isinstance(raised, TypeError) and "dtype torch.int64" in str(raised), raised
    elif N > 1:
        assert raised is not None and "dtype torch.int64" in str(raised), raised
    hvd.barrier()


def test_broadcasts_refuse_other_models_on_every_rank():
    """A rank with one more layer: broadcast_parameters returned on the root and hung the rank;
    broadcast_optimizer_state gave a rank state of the root's shapes (it failed alone at step)."""
    if N < 2:
        pytest.skip("needs two ranks")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2, 2)] + ([torch.nn.Linear(2, 2)] if R == 1 else [])
    model = torch.nn.Sequential(*layers)
    with pytest.raises(ValueError, match=r"broadcast_parameters: ranks \[1\] differ from the root rank 0: the "
                                         r"tensors .* only rank 1 has \[\('1.bias'"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    shaped = torch.nn.Linear(2 if R == 0 else 3, 2)
    opt = torch.optim.Adam(shaped.parameters())
    shaped(torch.ones(1, shaped.in_features)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"broadcast_optimizer_state: .* has parameters of shapes \[\[\(2, 2\), "
                                         r"\(2,\)\]\], but rank 1 has \[\[\(2, 3\), \(2,\)\]\]"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    # a rank that built its model on the meta device (and forgot to_empty): it raised alone and
    # the root waited on the rest of the broadcasts
    with torch.device("meta" if R == 1 else "cpu"):
        lazy = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"(rank 1: )?broadcast_parameters: 'bias' is on the meta device"):
        hvd.broadcast_parameters(lazy.state_dict(), root_rank=0)
    opt = torch.optim.Adam(lazy.parameters())
    if R == 0:
        lazy(torch.ones(1, 2)).sum().backward()
        opt.step()
    with pytest.raises(TypeError, match=r"(rank 1: )?broadcast_optimizer_state: '0.step' is on the meta device"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.barrier()  # (every rank is still in step)


def test_broadcast_optimizer_state_gives_the_root_the_same_dtypes():
    """torch's load casts state to the parameter's dtype (NAdam keeps mu_product in float32 for
    a float64 model until then): the root, which did not load, kept float32 where the others had
    float64, and the replicas drifted (3e-12 in 50 steps)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    opt = torch.optim.NAdam(model.parameters(), lr=0.01)
    if R == 0:
        model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    kinds = sorted((k, str(v.dtype)) for s in opt.state.values() for k, v in s.items()
                   if isinstance(v, torch.Tensor))
    every = hvd.allgather_object(kinds, name="test.bos.dtypes")
    assert all(k == every[0] for k in every), every
    for step in range(3):
        model(torch.full((2, 3), float(step + 1), dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat[None], name="test.bos.params")
    assert all(torch.equal(row, gathered[0]) for row in gathered)


# broadcast_parameters / broadcast_optimizer_state ----------------------------------------------
def test_broadcast_parameters_state_dict_and_named():
    torch.manual_seed(R)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].running_mean.fill_(R)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    for (k, v), (_, e) in zip(model.state_dict().items(), ref.state_dict().items()):
        if k != "1.running_mean":
            assert_equal(v, e)
    assert_equal(model[1].running_mean, torch.zeros(4))
    other = torch.nn.Linear(2, 2)
    with torch.no_grad():
        other.weight.fill_(R)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=N - 1)
    assert_equal(other.weight.detach(), torch.full((2, 2), float(N - 1)))
    plain = [torch.full((2,), float(R))]
    hvd.broadcast_parameters(plain, root_rank=1)
    assert_equal(plain[0], torch.full((2,), 1.0))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state(kind):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    make = (lambda p: torch.optim.SGD(p, lr=0.1 * (R + 1), momentum=0.9)) if kind == "sgd" else \
        (lambda p: torch.optim.Adam(p, lr=0.01 * (R + 1), betas=(0.9, 0.99 - 0.001 * R)))
    opt = make(model.parameters())
    if R == 0:  # only the root has state (e.g. it loaded a checkpoint)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 if kind == "sgd" else 0.01)
    if kind == "adam":
        assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1]
    flat = torch.cat([v.reshape(-1).double() for s in state.values() for v in s.values()
                      if isinstance(v, torch.Tensor)])
    root = hvd.broadcast(flat, 0, name=f"bos.check.{kind}")
    assert_equal(flat, root)
    # empty state everywhere: only the hyper-parameters move
    fresh = make(torch.nn.Linear(3, 2).parameters())
    hvd.broadcast_optimizer_state(fresh, root_rank=N - 1)
    assert fresh.param_groups[0]["lr"] == pytest.approx((0.1 if kind == "sgd" else 0.01) * N)
    assert fresh.state_dict()["state"] == {}


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    "fused" not in inspect.signature(torch.optim.SGD).parameters, reason="fused SGD needs torch >= 2.3"))])
def test_broadcast_optimizer_state_keeps_the_roots_strides(fused):
    """A transposed and a channels_last parameter: the root's momentum buffers follow their
    strides, and other ranks got contiguous ones; torch's fused SGD pairs a buffer with its
    parameter by memory position, so two steps after the broadcast those ranks' parameters were
    0.9 apart from the root's, silently. Now every rank's buffers have the root's strides, and
    the replicas stay identical."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 6).t())
    conv = torch.nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
    params = [("w", w)] + list(conv.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1, momentum=0.9,
                                                   **({"fused": True} if fused else {})),
                                   named_parameters=params)
    hvd.broadcast_parameters(params, root_rank=0)

    def step(s):
        g = torch.Generator().manual_seed(s + 10 * R)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        (F.mse_loss(x @ w, y) + conv(torch.randn(1, 2, 5, 5, generator=g)).square().mean()).backward()
        opt.step()

    step(0)
    step(1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    strides = [(opt.state[p]["momentum_buffer"].stride(), p.stride()) for _, p in params]
    step(2)
    step(3)
    flat = torch.cat([p.detach().reshape(-1) for _, p in params])
    every = hvd.allgather(flat[None], name=f"bos.strides.{fused}")
    assert all(mine == its for mine, its in strides), f"momentum vs parameter strides: {strides}"
    for r in range(N):
        assert torch.equal(every[r], flat), f"rank {r}'s parameters differ from rank {R}'s"


@pytest.mark.parametrize("target", ["wrapper", "wrapped"])
def test_broadcast_and_load_keep_the_wrapper_sharing_with_its_optimizer(target):
    """Wrap first, then broadcast the state (as Horovod's examples may order it) into the
    wrapper or the optimizer it wraps: both keep sharing param_groups and state, so an LR
    scheduler made on the wrapped optimizer drives every rank alike. The same after the
    wrapper's own load_state_dict."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1 * (R + 1), momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt if target == "wrapper" else base, root_rank=0)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" too
        for step in range(3):
            opt.zero_grad()
            model(torch.full((2, 3), float(R + step))).sum().backward()
            opt.step()
            sched.step()
    assert hvd.allgather_object(base.param_groups[0]["lr"]) == [0.1 * 0.5 ** 3] * N
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups is base.param_groups and opt.state is base.state
    assert len(base.state) == 2 and all("momentum_buffer" in v for v in base.state.values())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert_equal(weights, hvd.broadcast(weights, 0, name=f"share.check.{target}"))


# errors ----------------------------------------------------------------------------------------
def test_mismatched_shape_raises_on_every_rank():
    x = torch.ones(2 + (R == 0))
    with pytest.raises(hvd.HorovodInternalError, match="shape differs"):  # what Horovod scripts catch
        hvd.allreduce(x, name="mismatch.shape")
    with pytest.raises(RuntimeError, match="dtype differs"):
        hvd.allreduce(torch.ones(2, dtype=torch.float32 if R == 0 else torch.float64), name="mismatch.dtype")
    with pytest.raises(RuntimeError, match="op differs"):
        hvd.allreduce(torch.ones(2), op=hvd.Sum if R == 0 else hvd.Max, name="mismatch.op")
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.ones(2), root_rank=R, name="mismatch.root")
    # the engine goes on afterwards
    assert_equal(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.mismatch"), torch.full((1,), float(N)))


def test_duplicate_pending_name_is_value_error():
    import time

    for tester in range(N):  # the others submit late, so the tester's first op is still pending
        if R != tester:
            time.sleep(0.3)
        handle = hvd.allreduce_async(torch.ones(2), name=f"dup.{tester}")
        if R == tester:
            with pytest.raises(ValueError, match="already pending"):
                hvd.allreduce_async(torch.ones(2), name=f"dup.{tester}")
        hvd.synchronize(handle)


def test_in_place_on_negated_views_saved_tensors_and_meta():
    """A lazily negated view (x.conj().imag) is written, not silently left as it was; a tensor
    autograd saved for backward and then reduced in place makes backward raise torch's in-place
    error (not a wrong gradient); a meta tensor is refused by name."""
    z = torch.complex(torch.zeros(3), torch.full((3,), float(R + 1)))
    view = z.conj().imag  # -(R + 1), a negative-bit view of z's memory
    assert view.is_neg()
    hvd.allreduce_(view, op=hvd.Sum, name="neg.view")
    torch.testing.assert_close(view, torch.full((3,), -float(sum(range(1, N + 1)))))
    torch.testing.assert_close(z.imag, torch.full((3,), float(sum(range(1, N + 1)))))
    w = torch.ones(1, requires_grad=True)
    saved = w * 2.0
    loss = (saved * saved).sum()  # saves `saved` for backward
    hvd.allreduce_(saved.detach(), op=hvd.Sum, name="saved.inplace")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(TypeError, match="meta device"):
        hvd.allreduce(torch.ones(2, device="meta"), name="meta")


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(TypeError, match="complex64"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="sparse"):
        hvd.allreduce(torch.ones(2).to_sparse())
    with pytest.raises(ValueError, match="int32; op=Adasum combines floating-point tensors only"
                       if N & (N - 1) == 0 else "power of two"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(TypeError, match="list or tuple"):
        hvd.grouped_allreduce(torch.ones(2))
    with pytest.raises(ValueError):
        hvd.broadcast(torch.ones(2), root_rank=N)
    with pytest.raises(TypeError, match="SyncBatchNorm: process_set must be an hvddp ProcessSet.*Received: process_set=0"):
        hvd.SyncBatchNorm(3, process_set=0)


def test_a_tensor_refused_on_one_rank_fails_on_every_rank():
    """hvddp.torch's own checks (dtype, layout, a list that is none, splits) refuse a call
    before the core sees it: rank 0 raises that error at once, and the ranks that made the call
    validly raise MismatchError naming rank 0 and the reason instead of waiting for it; the
    unnamed calls after it still carry the same names on every rank."""
    bad = R == 0
    calls = [
        ("allreduce", lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64) if bad else torch.ones(2))),
        ("allreduce_", lambda: hvd.allreduce_(torch.ones(2).to_sparse() if bad else torch.ones(2))),
        ("grouped_allreduce", lambda: hvd.grouped_allreduce(
            [torch.ones(2), torch.ones(2, dtype=torch.complex64) if bad else torch.ones(2)])),
        ("grouped_allgather", lambda: hvd.grouped_allgather(torch.ones(2, 1) if bad else [torch.ones(2, 1)])),
        ("allgather", lambda: hvd.allgather(torch.ones((), requires_grad=True) if bad
                                            else torch.ones(1, requires_grad=True))),
        ("broadcast_", lambda: hvd.broadcast_(torch.ones(2, dtype=torch.complex64) if bad else torch.ones(2), 0)),
        ("alltoall", lambda: hvd.alltoall(torch.ones(N), splits=object() if bad else None)),
        ("reducescatter", lambda: hvd.reducescatter([1.0] * N if bad else torch.ones(N))),
        # a compression that is not one: a bare AttributeError on rank 0 left the others waiting
        ("allreduce", lambda: hvd.allreduce(torch.ones(2), compression="fp16" if bad else hvd.Compression.fp16)),
        ("grouped_reducescatter", lambda: hvd.grouped_reducescatter(
            [torch.ones(N)], compression=None if bad else hvd.Compression.none)),
        ("sparse_allreduce_async", lambda: hvd.synchronize(hvd.sparse_allreduce_async(
            torch.eye(2) if bad else torch.eye(2).to_sparse(), None, hvd.Sum))),
    ]
    for fn, call in calls:
        if bad:
            with pytest.raises((TypeError, ValueError), match=fn):
                call()
        else:
            with pytest.raises(hvd.HorovodInternalError, match=rf"refused on rank\(s\) \[0\] \(\w+: {fn}"):
                call()
    handles = [hvd.allreduce_async(torch.ones(1)), hvd.grouped_allreduce_async([torch.ones(1)]),
               hvd.allgather_async(torch.ones(1)), hvd.broadcast_async(torch.ones(1), 0),
               hvd.sparse_allreduce_async(torch.eye(2).to_sparse(), None, hvd.Sum)]
    names = [h.name for h in handles]
    assert hvd.allgather_object(names) == [names] * N
    for h in handles:
        hvd.synchronize(h)


def test_unnamed_sparse_calls_after_join_still_meet():
    """A joined rank sees its peer's unnamed sparse allreduce fail (its allgathers cannot run
    while a rank has joined) and counts it, so their next unnamed sparse calls meet."""
    if N == 1:
        pytest.skip("needs two ranks")
    sparse = torch.eye(3).to_sparse()
    if R == N - 1:
        with pytest.raises(hvd.HorovodInternalError, match="join"):
            hvd.synchronize(hvd.sparse_allreduce_async(sparse, None, hvd.Sum))
    hvd.join()
    handle = hvd.sparse_allreduce_async(sparse, None, hvd.Sum)
    assert hvd.allgather_object(handle.name) == [handle.name] * N
    assert torch.equal(hvd.synchronize(handle).to_dense(), torch.eye(3) * N)
