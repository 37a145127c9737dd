"""Rank-side tests of hvddp.tensorflow, run on every rank at once by tests/test_keras.py, at 2 and 3
ranks (there without the tf.function forms), in the launches that also run the Keras rank-side
tests on the TensorFlow backend."""

import numpy as np
import pytest
import tensorflow as tf

import hvddp.tensorflow as hvd

pytestmark = pytest.mark.np3  # at 3 ranks too, but for the tf.function forms:
# those trace what the eager forms run, with the same dependence on the number of ranks; marked
# "traced", they run at 2 ranks only, which makes the 3-rank launch (3 ranks on 2 cores) far shorter.
# So do the tests of tracing itself (XLA's refusal, unknown static shapes, unnamed ops traced
# on one rank, Horovod's broadcast in the first batch): 28 s of that launch's 78 s here.
MODES = ["eager", pytest.param("function", marks=pytest.mark.traced)]

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
GLOBAL_BATCH = 12
STEPS = 3


def assert_replicas_identical(arrays, name):
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    every = hvd.allgather(tf.constant(flat[None, :]), name=f"test.replicas.{name}").numpy()
    for r in range(SIZE):
        np.testing.assert_array_equal(every[r], every[0], err_msg=f"rank {r} differs from rank 0")


@pytest.mark.parametrize("mode", MODES)
def test_ops(mode):
    wrap = (lambda f: f) if mode == "eager" else tf.function
    x = tf.constant(np.arange(6, dtype=np.float32).reshape(3, 2) + 100 * RANK)
    mean = np.arange(6).reshape(3, 2) + 100 * (SIZE - 1) / 2

    @wrap
    def run(x):
        return (hvd.allreduce(x, name=f"t.{mode}.avg"), hvd.allreduce(x, op=hvd.Sum, name=f"t.{mode}.sum"),
                hvd.allreduce(x, op=hvd.Max), hvd.grouped_allreduce([x, 2 * x], name=f"t.{mode}.group"),
                hvd.allgather(x[: RANK + 1]), hvd.broadcast(x, SIZE - 1), hvd.reducescatter(x, op=hvd.Sum),
                hvd.allreduce(tf.cast(x, tf.int32), op=hvd.Min, name=f"t.{mode}.int"))

    for _ in range(2):  # a second run of the same traced graph reuses its names
        avg, total, biggest, group, gathered, bcast, scattered, smallest = run(x)
        np.testing.assert_allclose(avg.numpy(), mean)
        np.testing.assert_allclose(total.numpy(), mean * SIZE)
        np.testing.assert_allclose(biggest.numpy(), np.arange(6).reshape(3, 2) + 100 * (SIZE - 1))
        np.testing.assert_allclose(group[1].numpy(), 2 * mean)
        rows = sum(r + 1 for r in range(SIZE))
        assert gathered.shape == (rows, 2)
        np.testing.assert_allclose(gathered.numpy()[:, 0], np.concatenate(
            [np.arange(0, 2 * (r + 1), 2) + 100 * r for r in range(SIZE)]))
        np.testing.assert_allclose(bcast.numpy(), np.arange(6).reshape(3, 2) + 100 * (SIZE - 1))
        lo = sum(3 // SIZE + (1 if r < 3 % SIZE else 0) for r in range(RANK))
        np.testing.assert_allclose(scattered.numpy(), (mean * SIZE)[lo: lo + scattered.shape[0]])
        assert smallest.dtype == tf.int32 and smallest.numpy()[0, 0] == 0


def test_alltoall_with_splits():
    splits = [r + 1 for r in range(SIZE)]
    tensor = tf.range(sum(splits)) + 100 * RANK
    out, received = hvd.alltoall(tensor, splits=splits, name="t.alltoall")
    assert received.dtype == tf.int32  # as Horovod's op
    np.testing.assert_array_equal(received.numpy(), [RANK + 1] * SIZE)
    start = sum(splits[:RANK])
    want = np.concatenate([np.arange(start, start + RANK + 1) + 100 * r for r in range(SIZE)])
    np.testing.assert_array_equal(out.numpy(), want)
    # rows past sum(splits) are not sent (Horovod's capacity buffers); their gradient is zero
    x = tf.ones([sum(splits) + 2])
    with tf.GradientTape() as tape:
        tape.watch(x)
        out, received = hvd.alltoall(x * (RANK + 1), splits=splits, name="t.alltoall.padded")
        y = tf.reduce_sum(out * tf.repeat(tf.range(1.0, SIZE + 1), RANK + 1))
    np.testing.assert_array_equal(out.numpy(), np.repeat(np.arange(1.0, SIZE + 1), RANK + 1))
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), np.concatenate(
        [np.full(d + 1, (RANK + 1.0) * (RANK + 1)) for d in range(SIZE)] + [np.zeros(2)]))


@pytest.mark.parametrize("mode", MODES)
def test_gradients(mode):
    wrap = (lambda f: f) if mode == "eager" else tf.function
    x = tf.constant([1.0, 2.0]) * (RANK + 1)

    @wrap
    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            weight = float(RANK + 1)
            reduced = tf.reduce_sum(hvd.allreduce(x, name=f"g.{mode}.ar") * weight)
            gathered = tf.reduce_sum(hvd.allgather(x, name=f"g.{mode}.ag") * weight)
            bcast = tf.reduce_sum(hvd.broadcast(x, 0, name=f"g.{mode}.bc") * weight)
        return [tape.gradient(t, x) for t in (reduced, gathered, bcast)]

    d_reduce, d_gather, d_bcast = [g.numpy() for g in grads(x)]
    weights = np.arange(1, SIZE + 1, dtype=np.float32)
    np.testing.assert_allclose(d_reduce, [weights.mean()] * 2)  # Average of the upstream gradients
    # allgather and broadcast: Horovod's Average over ranks (own rows; on the root only)
    np.testing.assert_allclose(d_gather, [weights.mean()] * 2)
    np.testing.assert_allclose(d_bcast, [weights.mean() if RANK == 0 else 0.0] * 2)


@pytest.mark.parametrize("mode", MODES)
def test_join_is_an_op(mode):
    """Uneven data over two epochs: join() returns an int32 tensor, and inside a tf.function it
    joins every time the function runs (not once, when it is traced)."""
    wrap = (lambda f: f) if mode == "eager" else tf.function

    @wrap
    def step(x):
        return hvd.allreduce(x, op=hvd.Sum, name=f"join.tf.{mode}")

    @wrap
    def finish():
        return hvd.join()

    for epoch in range(2):
        outs = [step(tf.ones([2])).numpy() for _ in range(RANK + 1)]  # rank r: r + 1 batches
        last = finish()
        assert isinstance(last, tf.Tensor) and last.dtype == tf.int32 and last.shape == ()
        assert int(last.numpy()) == SIZE - 1
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, [sum(1 for r in range(SIZE) if r >= i)] * 2)


@pytest.mark.traced
def test_join_follows_a_training_loop_in_the_same_function():
    """A tf.range loop that updates a variable, then join(), in one tf.function: the join waits
    for the loop (TensorFlow orders the collectives among themselves, but not after a While op
    that captures variables: join ran first, and the job hung or the joined rank gave zeros to
    its own steps)."""
    v = tf.Variable(tf.zeros([2]))

    @tf.function
    def epoch(steps):
        for _ in tf.range(steps):
            v.assign_add(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="join.loop"))
        return hvd.join()

    @tf.function
    def epoch_then_join_in_a_branch(steps):  # the join traced in a cond branch's own graph
        for _ in tf.range(steps):
            v.assign_add(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="join.loop.cond"))
        return tf.cond(steps > 0, hvd.join, lambda: tf.constant(-1))

    for fn in (epoch, epoch, epoch_then_join_in_a_branch):
        v.assign(tf.zeros([2]))
        last = fn(tf.constant(RANK + 1))  # rank r: r + 1 steps
        assert int(last.numpy()) == SIZE - 1
        np.testing.assert_array_equal(v.numpy(), [sum(SIZE - i for i in range(RANK + 1))] * 2)


def test_horovod_signatures_and_unsigned_copies():
    """Horovod's TF signatures (broadcast_object/allgather_object with session=None,
    broadcast_object_fn, the tape's use_generic_names fourth, also to get_local_and_global_gradients),
    and uint16/32/64 tensors through
    broadcast, allgather and alltoall, as their bits (values past the signed range included)."""
    assert hvd.broadcast_object(RANK, 0, None, "t.sig.b") == 0
    assert hvd.allgather_object(RANK, None, "t.sig.g") == list(range(SIZE))
    assert hvd.broadcast_object_fn(root_rank=SIZE - 1, name="t.sig.fn")(RANK) == SIZE - 1
    with pytest.raises(TypeError, match="sessions are not supported"):
        hvd.broadcast_object(1, 0, object())
    with pytest.raises(TypeError, match=r"^allreduce: tensor is a RaggedTensor.*to_tensor"):
        hvd.allreduce(tf.ragged.constant([[1.0], [2.0, 3.0]]), name="t.sig.ragged")
    for bad in (tf.constant(["a"]), tf.constant([1 + 2j])):  # named as TensorFlow's (was numpy's "object")
        with pytest.raises(TypeError, match=rf"^broadcast: tensor has dtype {bad.dtype.name}, .*tf\.cast"):
            hvd.broadcast(bad, 0, name="t.sig.str")
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v) * float(RANK + 1)
    (grad,) = hvd.DistributedGradientTape(tape).gradient(loss, [v], None, True)
    np.testing.assert_allclose(grad.numpy(), np.array([2.0, 4.0]) * (SIZE + 1) / 2)
    with tf.GradientTape() as tape:  # the same fourth argument to the partial tape's split
        loss = tf.reduce_sum(v * v) * float(RANK + 1)
    local, shared = hvd.PartialDistributedGradientTape(tape, local_layers=[]).get_local_and_global_gradients(
        loss, [v], None, True)
    assert local == [] and shared[0][0] is v
    np.testing.assert_allclose(shared[0][1].numpy(), np.array([2.0, 4.0]) * (SIZE + 1) / 2)
    for dtype in (np.uint16, np.uint32, np.uint64):
        top = np.iinfo(dtype).max
        x = tf.constant(np.array([top - RANK] * SIZE, dtype=dtype))
        mine = [top - r for r in range(SIZE)]
        out = hvd.broadcast(x, 0, name=f"t.u.b.{dtype.__name__}")
        assert out.dtype == x.dtype and out.numpy().tolist() == [top] * SIZE
        out = hvd.allgather(x, name=f"t.u.g.{dtype.__name__}")
        assert out.dtype == x.dtype and out.numpy().tolist() == [t for t in mine for _ in range(SIZE)]
        out = hvd.alltoall(x, name=f"t.u.a.{dtype.__name__}")
        assert out.dtype == x.dtype and out.numpy().tolist() == mine
        (out,) = hvd.grouped_allgather([x], name=f"t.u.gg.{dtype.__name__}")
        assert out.dtype == x.dtype and out.numpy().tolist() == [t for t in mine for _ in range(SIZE)]


def test_horovods_mpi_ops_module_ports():
    """Scripts import from horovod.tensorflow.mpi_ops too; hvddp.tensorflow.mpi_ops was missing."""
    import hvddp.tensorflow.mpi_ops as mpi_ops
    from hvddp.tensorflow.mpi_ops import allgather, rank_op  # noqa: F401 (as such scripts do)

    differ = [n for n in mpi_ops.__all__ if getattr(mpi_ops, n) is not getattr(hvd, n, None)]
    assert not differ, differ
    assert int(mpi_ops.size_op()) == hvd.size() and mpi_ops.allgather(tf.ones([1])).shape == [hvd.size()]


@pytest.mark.traced
def test_xla_raises_a_clear_error():
    @tf.function(jit_compile=True)
    def step(x):
        return hvd.allreduce(x, name="xla")

    with pytest.raises(ValueError, match="XLA"):
        step(tf.ones([2]))


def test_compression_and_predivide():
    x = tf.constant([1.0, 3.0]) * (RANK + 1)
    mean = np.array([1.0, 3.0]) * (SIZE + 1) / 2
    out = hvd.allreduce(x, compression=hvd.Compression.fp16, name="t.fp16")
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), mean, rtol=1e-3)
    v = tf.Variable([1.0, 1.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * x)
    tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0)
    np.testing.assert_allclose(tape.gradient(loss, [v])[0].numpy(), mean, rtol=1e-6)


class _HalfAndCount:
    """A compressor of one's own, written with TensorFlow ops as Horovod's are; it counts its calls."""

    calls = 0

    @classmethod
    def compress(cls, tensor):
        cls.calls += 1
        assert isinstance(tensor, tf.Tensor), type(tensor)  # (numpy arrays reached it)
        return (tf.cast(tensor, tf.float16), tensor.dtype) if tensor.dtype.is_floating else (tensor, None)

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


@pytest.mark.parametrize("mode", MODES)
def test_compressors_take_tensorflow_tensors(mode):
    """Horovod's compressors work on tf.Tensors: the built-in ones called directly, and one of your
    own given to allreduce, reducescatter and the tape (it was handed numpy arrays, and failed)."""
    half, dtype = hvd.Compression.fp16.compress(tf.ones([2]))
    assert half.dtype == tf.float16 and dtype == tf.float32
    assert hvd.Compression.fp16.decompress(half, dtype).dtype == tf.float32
    assert hvd.compression.Compression is hvd.Compression and issubclass(_HalfAndCount, object)
    x = tf.constant([1.0, 3.0, 5.0, 7.0, 9.0, 11.0]) * (RANK + 1)
    v = tf.Variable(tf.ones(6))
    _HalfAndCount.calls = 0

    def run():
        out = hvd.allreduce(x, compression=_HalfAndCount, name=f"t.own.{mode}", op=hvd.Sum)
        part = hvd.reducescatter(x, compression=_HalfAndCount, name=f"t.own.rs.{mode}", op=hvd.Sum)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * x)
        grad = hvd.DistributedGradientTape(tape, compression=_HalfAndCount).gradient(loss, [v])[0]
        return out, part, grad

    out, part, grad = tf.function(run)() if mode == "function" else run()
    total = np.array([1.0, 3.0, 5.0, 7.0, 9.0, 11.0]) * SIZE * (SIZE + 1) / 2
    np.testing.assert_allclose(out.numpy(), total, rtol=1e-3)
    assert out.dtype == tf.float32
    rows = np.array_split(np.arange(6), SIZE)[RANK]
    np.testing.assert_allclose(part.numpy(), total[rows], rtol=1e-3)
    np.testing.assert_allclose(grad.numpy(), total / SIZE, rtol=1e-3)
    assert _HalfAndCount.calls >= 3


def _mlp(seed):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.normal(size=(5, 8)).astype("float32"), name="w1"),
            tf.Variable(np.zeros(8, "float32"), name="b1"),
            tf.Variable(rng.normal(size=(8, 3)).astype("float32"), name="w2"),
            tf.Variable(np.ones(3, "float32"), name="unused")]  # no rank has a gradient for it


def _loss(variables, x, y):
    w1, b1, w2, _ = variables
    logits = tf.tanh(x @ w1 + b1) @ w2
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


@pytest.mark.parametrize("mode", MODES)
def test_custom_loop_parity(mode):
    """K steps on shards with DistributedGradientTape == one process on the whole batches."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 5)).astype("float32")
    y = rng.integers(0, 3, size=STEPS * GLOBAL_BATCH).astype("int32")
    per = GLOBAL_BATCH // SIZE
    wrap = (lambda f: f) if mode == "eager" else tf.function

    def train(variables, distributed, batches):
        optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)

        @wrap
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = _loss(variables, xb, yb)
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, variables)
            assert grads[3] is None  # no rank has it: None, as in one process, so Adam-like rules skip it
            grads_and_vars = [(g, v) for g, v in zip(grads, variables) if g is not None]
            optimizer.apply_gradients(grads_and_vars)
            return loss

        for xb, yb in batches:
            step(tf.constant(xb), tf.constant(yb))
        return [v.numpy() for v in variables]

    mine = [(x[b * GLOBAL_BATCH + RANK * per: b * GLOBAL_BATCH + (RANK + 1) * per],
             y[b * GLOBAL_BATCH + RANK * per: b * GLOBAL_BATCH + (RANK + 1) * per]) for b in range(STEPS)]
    whole = [(x[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH], y[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH])
             for b in range(STEPS)]
    distributed = train(_mlp(0), True, mine)
    reference = train(_mlp(0), False, whole)
    for got, want in zip(distributed, reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(distributed[0], _mlp(0)[0].numpy())
    assert_replicas_identical(distributed, f"tape.{mode}")


def test_broadcast_variables():
    variables = _mlp(seed=10 + RANK)
    root = hvd.broadcast_object([v.numpy() for v in variables], 0, name="t.root")
    hvd.broadcast_variables(variables, root_rank=0)
    for v, want in zip(variables, root):
        np.testing.assert_array_equal(v.numpy(), want)


def test_broadcast_variables_leaves_dropout_rng_states_per_rank():
    """Horovod's TF2 example broadcasts model.variables, which in Keras 3 hold each Dropout's
    SeedGenerator state: it was copied from the root, and every rank drew the same masks."""
    import keras

    keras.utils.set_random_seed(50 + RANK)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5)])
    seeds = [v for v in model.variables if "seed_generator" in v.path]
    assert seeds, [v.path for v in model.variables]
    mine = [v.numpy().copy() for v in seeds]
    root = hvd.broadcast_object([v.numpy() for v in model.trainable_variables], 0, name="t.dropout.root")

    @tf.function
    def in_function():
        hvd.broadcast_variables(model.variables, root_rank=0)

    for call in (lambda: hvd.broadcast_variables(model.variables, root_rank=0), in_function):
        call()
        for v, want in zip(model.trainable_variables, root):
            np.testing.assert_array_equal(v.numpy(), want)
        for v, was in zip(seeds, mine):
            np.testing.assert_array_equal(v.numpy(), was)
    if SIZE > 1:
        masks = hvd.allgather_object((model(tf.ones((4, 4)), training=True).numpy() != 0).tolist())
        assert masks[0] != masks[1]


def test_process_set_of_the_wrong_type_is_named_where_it_is_given():
    """A list of ranks as process_set failed later, as an AttributeError naming neither."""
    with tf.GradientTape() as tape:
        pass
    for make in (lambda: hvd.DistributedGradientTape(tape, process_set=[0]),
                 lambda: hvd.allreduce(tf.ones([2]), process_set=[0]),
                 lambda: hvd.broadcast_variables([tf.Variable([1.0])], 0, process_set=0),
                 lambda: hvd.SyncBatchNormalization(process_set=0)):
        with pytest.raises(TypeError, match=r"process_set must be an hvddp ProcessSet.*Received: process_set="):
            make()


def test_tape_mismatch_names_the_variable():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    v = tf.Variable(tf.ones([2 + (RANK > 0)]), name="odd_one")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    tape = hvd.DistributedGradientTape(tape)
    with pytest.raises(hvd.MismatchError, match="odd_one"):
        tape.gradient(loss, [v])


@pytest.mark.parametrize("mode", MODES)
def test_tape_wrapped_inside_its_with_block(mode):
    """As some Horovod scripts do: the tape wrapped while it records (the process crashed)."""
    wrap = (lambda f: f) if mode == "eager" else tf.function
    v = tf.Variable([1.0, 2.0])

    @wrap
    def grads():
        with tf.GradientTape() as tape:
            tape = hvd.DistributedGradientTape(tape)
            loss = tf.reduce_sum(v * v) * float(RANK + 1)
        return tape.gradient(loss, [v])[0]

    np.testing.assert_allclose(grads().numpy(), np.array([2.0, 4.0]) * (SIZE + 1) / 2)


@pytest.mark.parametrize("mode", MODES)
def test_tape_gradient_called_inside_its_with_block(mode):
    """TensorFlow lets gradient() be called inside the with block (a non-persistent tape stops
    recording; a persistent one records on); the wrapper made there raised TensorFlow's "cannot be
    invoked within the GradientTape context", since the copy did not stop the original."""
    wrap = (lambda f: f) if mode == "eager" else tf.function
    v = tf.Variable([1.0, 2.0])

    @wrap
    def grads(persistent):
        with tf.GradientTape(persistent=persistent) as tape:
            loss = tf.reduce_sum(v * v) * float(RANK + 1)
            tape = hvd.DistributedGradientTape(tape)
            first = tape.gradient(loss, [v])[0]
            after = tf.reduce_sum(v) * 3.0  # recorded only by the persistent tape
        second = tape.gradient(after, v) if persistent else None
        return first, second

    first, _ = grads(False)
    np.testing.assert_allclose(first.numpy(), np.array([2.0, 4.0]) * (SIZE + 1) / 2)
    first, second = grads(True)
    np.testing.assert_allclose(first.numpy(), np.array([2.0, 4.0]) * (SIZE + 1) / 2)
    np.testing.assert_allclose(second.numpy(), [3.0, 3.0])


def test_local_and_global_gradients_of_one_source():
    """gradient() takes a single source as TensorFlow's does; the split did too, where it zipped
    the gradient's elements with the variable's."""
    v = tf.Variable([1.0, 2.0])
    for register in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v) * (RANK + 1)
        tape = hvd.DistributedGradientTape(tape)
        if register:
            tape.register_local_source(v)
        local, shared = tape.get_local_and_global_gradients(loss, v)
        pairs, other = (local, shared) if register else (shared, local)
        assert other == [] and len(pairs) == 1 and pairs[0][0] is v, (local, shared)
        expected = (RANK + 1) / SIZE if register else np.mean(np.arange(SIZE) + 1)
        np.testing.assert_allclose(pairs[0][1].numpy(), [expected] * 2)


@pytest.mark.traced
def test_tape_in_a_function_with_unknown_static_shapes():
    """A watched input of unknown length inside tf.function: the reduction runs at run time on
    the concrete shapes (nothing needs the static shape when the function is traced)."""
    w = tf.Variable([1.0, 2.0], name="w_unknown")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(x * w[0]) * (RANK + 1)
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, [w, x])

    mean = (SIZE + 1) / 2  # the average of (rank + 1)
    gw, gx = step(tf.constant([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(gw.numpy(), [6.0 * mean, 0.0])
    np.testing.assert_allclose(gx.numpy(), [mean] * 3)


def test_broadcast_variables_of_models_that_differ_raises_on_every_rank():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    variables = [tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([3 + (RANK == SIZE - 1)]))]
    with pytest.raises(hvd.MismatchError, match="^broadcast_variables: tensor lists differ .* position 1"):
        hvd.broadcast_variables(variables, root_rank=0)
    # one variable more on the last rank: named as a broadcast's, not a reduction's (the message
    # spoke of reducing and of backward_passes_per_step)
    extra = [tf.Variable(tf.zeros([1]), name="extra")] if RANK == SIZE - 1 else []
    with pytest.raises(hvd.MismatchError, match=rf"^broadcast_variables: ranks broadcast different numbers of "
                                                rf"variables: rank 0 has 1, rank {SIZE - 1} has 2 \(only rank "
                                                rf"{SIZE - 1} has 'extra:0'\)\. Every rank must build the same "
                                                rf"model and pass the same variables\.$"):
        hvd.broadcast_variables(variables[:1] + extra, root_rank=0)


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_and_alltoall_gradients(mode):
    """reducescatter's gradient is the allgather of the rows' gradients, with Horovod's factors
    (times the size for Sum, the scale factors); alltoall's sends each received row's gradient
    back to its sender."""
    wrap = (lambda f: f) if mode == "eager" else tf.function
    x = tf.ones([2 * SIZE, 3])

    @wrap
    def grads(x):
        weight = float(RANK + 1)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            summed = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, name=f"rsg.{mode}.sum") * weight)
            averaged = tf.reduce_sum(hvd.reducescatter(x, name=f"rsg.{mode}.avg", prescale_factor=2.0)
                                     * weight)
            exchanged = tf.reduce_sum(hvd.alltoall(x, name=f"a2ag.{mode}") * weight)  # no splits: a tensor
        return [tape.gradient(t, x) for t in (summed, averaged, exchanged)]

    d_sum, d_avg, d_a2a = [g.numpy() for g in grads(x)]
    rows = np.repeat(np.arange(1, SIZE + 1, dtype=np.float32), 2)[:, None] * np.ones((1, 3))
    np.testing.assert_allclose(d_sum, rows * SIZE)  # rank r's rows carry weight r + 1
    np.testing.assert_allclose(d_avg, rows * 2.0)
    np.testing.assert_allclose(d_a2a, rows)  # rows 2r, 2r+1 went to rank r


@pytest.mark.traced
def test_horovod_tf2_example_broadcasts_inside_the_function_on_the_first_batch():
    """Horovod's TF2 examples call broadcast_variables inside the tf.function of the training
    step, on the first batch, for the model's and the optimizer's variables."""
    import keras

    keras.utils.set_random_seed(100 + RANK)  # replicas start apart
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def training_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    rng = np.random.default_rng(RANK)
    for step in range(3):
        x = tf.constant(rng.normal(size=(4, 5)).astype("float32"))
        y = tf.constant(rng.integers(0, 3, size=4).astype("int32"))
        training_step(x, y, step == 0)
    assert_replicas_identical([v.numpy() for v in model.variables + opt.variables], "tf2.example")


def test_tensorflow_distributed_optimizer_is_the_keras_one():
    import keras

    from hvddp.keras import is_distributed

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    assert is_distributed(opt)
    v = keras.Variable(np.zeros(2, "float32"))
    opt.apply_gradients([(tf.constant([float(RANK), 1.0]), v)])
    np.testing.assert_allclose(v.numpy(), [-(SIZE - 1) / 2, -1.0])  # the average gradient
    # plain tf.Variables, as Horovod's TF2 loops have (Keras 3 optimizers take them; hvddp's
    # labels read the Keras path and raised AttributeError), eagerly and in a tf.function
    plain = tf.Variable([0.0, 0.0], name="plain")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.apply_gradients([(tf.constant([float(RANK), 1.0]), plain)])
    tf.function(lambda: opt.apply_gradients([(tf.constant([float(RANK), 1.0]), plain)]))()
    np.testing.assert_allclose(plain.numpy(), [-(SIZE - 1), -2.0])
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(hvd.HvddpError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_tape_gradient_only_some_ranks_have():
    """Eagerly a gradient one rank lacks is reduced as its zeros: every rank gets the average.
    Inside a tf.function that is rank-dependent graph code, and every rank raises."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    v = tf.Variable([1.0, 2.0], name="sometimes")
    w = tf.Variable([3.0], name="always")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * 2.0) + (tf.reduce_sum(v) if RANK == 0 else 0.0)
    gv, gw = hvd.DistributedGradientTape(tape).gradient(loss, [v, w])
    np.testing.assert_allclose(gv.numpy(), [1.0 / SIZE] * 2)
    np.testing.assert_allclose(gw.numpy(), [2.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * 2.0) + (tf.reduce_sum(v) if RANK == 0 else 0.0)
        return hvd.DistributedGradientTape(tape).gradient(loss, [v, w])

    with pytest.raises(tf.errors.InvalidArgumentError, match="None on some ranks") as raised:
        step()
    # (the variable it is, not only a vector of shares)
    assert "sometimes" in str(raised.value) and "always" not in str(raised.value), raised.value


def test_ranks_outside_the_process_set_keep_their_own_gradients():
    """As in Horovod: DistributedGradientTape and the Keras DistributedOptimizer on a rank that is
    not in their process set return the gradients unreduced, instead of refusing."""
    import keras

    members = hvd.add_process_set([0])
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v) * (RANK + 1)
    (g,) = hvd.DistributedGradientTape(tape, process_set=members).gradient(loss, [v])
    np.testing.assert_allclose(g.numpy(), [RANK + 1.0] * 2)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=members)
    w = keras.Variable(np.zeros(2, "float32"))
    opt.apply_gradients([(tf.constant([float(RANK), 1.0]), w)])
    np.testing.assert_allclose(w.numpy(), [-float(RANK), -1.0])
    accumulating = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                            process_set=members)
    u = keras.Variable(np.zeros(1, "float32"))
    for _ in range(2):
        accumulating.apply_gradients([(tf.constant([1.0]), u)])
    np.testing.assert_allclose(u.numpy(), [-2.0])  # the passes summed, on members and the others alike
    hvd.remove_process_set(members)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather_and_reducescatter_with_gradients(mode):
    """Each member as its single op: values, and gradients (allgather: the sum over ranks of this
    rank's rows averaged over ranks; reducescatter: the allgather of the rows' gradients, as it is
    for Average; Horovod's factors)."""
    wrap = (lambda f: f) if mode == "eager" else tf.function
    a = tf.fill([RANK + 1, 2], float(RANK))
    b = tf.ones([2 * SIZE, 3]) * (RANK + 1)

    @wrap
    def run(a, b):
        weight = float(RANK + 1)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([a, b])
            ga, gb = hvd.grouped_allgather([a, b], name=f"gag.{mode}")
            ra, rb = hvd.grouped_reducescatter([b, 2 * b], name=f"grs.{mode}")
            gathered = tf.reduce_sum(ga * weight) + tf.reduce_sum(gb * weight)
            scattered = tf.reduce_sum(ra * weight) + tf.reduce_sum(rb * weight)
        return ga, gb, ra, rb, tape.gradient(gathered, [a, b]), tape.gradient(scattered, b)

    ga, gb, ra, rb, (da, db), ds = run(a, b)
    rows = sum(r + 1 for r in range(SIZE))
    np.testing.assert_array_equal(ga.numpy()[:, 0], np.concatenate([[r] * (r + 1) for r in range(SIZE)]))
    assert ga.shape == (rows, 2) and gb.shape == (2 * SIZE * SIZE, 3)
    mean = (SIZE + 1) / 2  # the Average of (rank + 1)
    np.testing.assert_allclose(ra.numpy(), np.full((2, 3), mean))
    np.testing.assert_allclose(rb.numpy(), np.full((2, 3), 2 * mean))
    mean_weight = (SIZE + 1) / 2  # every rank's loss weights the gathered rows by rank + 1: averaged
    np.testing.assert_allclose(da.numpy(), np.full((RANK + 1, 2), mean_weight))
    np.testing.assert_allclose(db.numpy(), np.full((2 * SIZE, 3), mean_weight))
    # d/db of sum(ra * w) + sum(rb * w): rows of rank r carry w_r (1 + 2) (Horovod's factor for
    # Average is 1)
    owner = np.repeat(np.arange(1, SIZE + 1, dtype=np.float64), 2)[:, None]
    np.testing.assert_allclose(ds.numpy(), owner * 3.0 * np.ones((1, 3)))


def test_alltoall_splits_that_are_not_whole_numbers_are_refused_on_every_rank():
    """Float splits were cast to int64 ([1.9, 2.1] sent 1 and 2 rows: a row silently unsent) and
    nested ones flattened; refused on rank 0, the others fail naming it instead of waiting."""
    x = tf.ones([2 * SIZE])
    for bad, why in (([1.5] * SIZE, TypeError), ([[2]] * SIZE, ValueError)):
        if RANK == 0:
            with pytest.raises(why, match=r"alltoall: splits must be"):
                hvd.alltoall(x, splits=bad)
        elif SIZE > 1:
            with pytest.raises(Exception, match=r"refused on rank\(s\) \[0\] \(\w+Error: alltoall: splits must be"):
                hvd.alltoall(x, splits=[2] * SIZE)
    out, received = hvd.alltoall(x, splits=np.full(SIZE, 2, np.int32))
    np.testing.assert_array_equal(received.numpy(), [2] * SIZE)
    for empty in ([], np.array([], np.float64)):  # empty (float32 to TensorFlow): an even split
        out, received = hvd.alltoall(x, splits=empty)
        np.testing.assert_array_equal(received.numpy(), [2] * SIZE)


def test_broadcast_variables_refusals_are_announced_and_name_the_variable():
    """A bad root_rank on one rank: the others waited for ever in the first exchange. A dtype
    hvddp does not move is named with its variable (was "tensor has dtype object")."""
    v = tf.Variable([float(RANK)])
    if RANK == 0:
        with pytest.raises(ValueError, match="broadcast_variables: root_rank"):
            hvd.broadcast_variables([v], root_rank=SIZE + 3)
    elif SIZE > 1:
        with pytest.raises(hvd.MismatchError, match=r"refused on rank\(s\) \[0\] \(ValueError: broadcast_variables"):
            hvd.broadcast_variables([v], root_rank=0)
    with pytest.raises(TypeError, match=r"broadcast_variables: words:0 has dtype string, which hvddp does not"):
        hvd.broadcast_variables([v, tf.Variable(["a"], name="words")], root_rank=0)
    hvd.broadcast_variables([v], root_rank=SIZE - 1)
    np.testing.assert_array_equal(v.numpy(), [SIZE - 1.0])


def test_broadcast_root_is_a_global_rank():
    """As in Horovod: on a process set, root_rank counts in hvd.rank()'s numbering."""
    last = hvd.add_process_set([SIZE - 1])
    if last.included():
        x = tf.constant([float(RANK)])
        np.testing.assert_array_equal(hvd.broadcast(x, SIZE - 1, name="t.bc.last", process_set=last).numpy(),
                                      [SIZE - 1.0])
        if SIZE > 1:
            with pytest.raises(ValueError, match="global rank"):
                hvd.broadcast(x, 0, process_set=last)
    hvd.remove_process_set(last)


def test_runtime_numbers_as_ops():
    subset = hvd.add_process_set([0])
    assert hvd.size_op().numpy() == SIZE and hvd.size_op().dtype == tf.int32
    assert hvd.rank_op().numpy() == RANK and hvd.local_rank_op().numpy() == hvd.local_rank()
    assert hvd.local_size_op().numpy() == hvd.local_size()
    assert hvd.size_op(subset.process_set_id).numpy() == 1
    assert hvd.process_set_included_op(subset.process_set_id).numpy() == int(RANK == 0)
    with pytest.raises(ValueError, match="process_set_id=99"):
        hvd.size_op(99)
    hvd.remove_process_set(subset)


@pytest.mark.parametrize("mode", MODES)
def test_sync_batch_normalization_is_batch_norm_on_the_whole_batch(mode):
    """Uneven shards: outputs, input gradients (of the sum of every rank's loss) and moving
    statistics equal keras BatchNormalization on all rows in one process."""
    import keras

    rows = [r + 2 for r in range(SIZE)]
    rng = np.random.default_rng(7)
    full = (rng.normal(size=(sum(rows), 4)) * 3 + 1).astype("float32")
    weights = rng.normal(size=full.shape).astype("float32")
    start = sum(rows[:RANK])
    mine, my_weights = full[start:start + rows[RANK]], weights[start:start + rows[RANK]]
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    ref = keras.layers.BatchNormalization(momentum=0.5)
    for layer in (sync, ref):
        layer.build((None, 4))  # variables outside the tf.function
    wrap = (lambda f: f) if mode == "eager" else tf.function

    @wrap
    def forward(layer, x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True)
            loss = tf.reduce_sum(out * w)
        return out, tape.gradient(loss, x)

    for _ in range(2):
        out, grad = forward(sync, tf.constant(mine), tf.constant(my_weights))
        want, want_grad = forward(ref, tf.constant(full), tf.constant(weights))
        np.testing.assert_allclose(out.numpy(), want.numpy()[start:start + rows[RANK]], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(grad.numpy(), want_grad.numpy()[start:start + rows[RANK]], rtol=1e-3,
                                   atol=1e-4)
    np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), ref.moving_variance.numpy(), rtol=1e-4)
    with pytest.raises(ValueError, match="fused"):
        hvd.SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="Received: fused=None"):
        hvd.SyncBatchNormalization(fused=None)
    # jit_compile="auto" on a GPU machine: Keras picks XLA when every layer supports it, and the
    # layer's allreduces cannot be compiled (it claimed support: fit failed with a plain optimizer)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), hvd.SyncBatchNormalization()])
    real = tf.config.list_physical_devices
    tf.config.list_physical_devices = lambda *a: real(*a) + [
        tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")]
    try:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    finally:
        tf.config.list_physical_devices = real
    assert model.jit_compile is False


def test_sync_batch_normalization_outside_its_process_set_normalizes_locally():
    """A rank outside the layer's set raised (an allreduce on a set it is not in); hvddp.torch's
    SyncBatchNorm normalizes such a rank's own batch, and so does this one now."""
    if SIZE < 3:
        pytest.skip("needs three ranks (a set of two that leaves one out)")
    import keras

    pair = hvd.add_process_set([0, 1])
    x = tf.constant(np.arange(12, dtype="float32").reshape(6, 2) * (RANK + 1))
    out = hvd.SyncBatchNormalization(process_set=pair)(x, training=True)
    if RANK == 2:
        want = keras.layers.BatchNormalization()(x, training=True)
        np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    else:  # the pair's statistics: both ranks' rows
        both = np.concatenate([np.arange(12, dtype="float32").reshape(6, 2) * (r + 1) for r in (0, 1)])
        want = (x.numpy() - both.mean(0)) / np.sqrt(both.var(0) + 1e-3)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
    hvd.remove_process_set(pair)


@pytest.mark.traced
def test_unnamed_ops_in_a_function_match_when_one_rank_traced_and_built_more():
    """Rank 0 alone traces one more function and builds one more layer first: the unnamed
    collectives in a loop body, a branch and a SyncBatchNormalization inside a tf.function must
    still carry the same names on every rank (TensorFlow numbers body graphs and Keras layer
    scopes per process; names built from those never met, and the job hung)."""
    if RANK == 0:
        tf.function(lambda x: x + 1)(tf.constant(1.0))
        hvd.SyncBatchNormalization().build((None, 3))
    sync = hvd.SyncBatchNormalization()

    @tf.function
    def step(x, rows):
        total = tf.zeros_like(x)
        for _ in tf.range(2):
            total += hvd.allreduce(x, op=hvd.Sum)
        if tf.reduce_sum(x) > 0:
            total += hvd.allreduce(x, op=hvd.Sum)
        return total, sync(rows, training=True)

    total, out = step(tf.ones([2]), tf.fill([2, 3], float(RANK)))
    np.testing.assert_allclose(total.numpy(), [3.0 * SIZE] * 2)
    variance = sum((r - (SIZE - 1) / 2) ** 2 for r in range(SIZE)) / SIZE
    np.testing.assert_allclose(out.numpy(), np.full((2, 3), (RANK - (SIZE - 1) / 2) / np.sqrt(variance + 1e-3)),
                               rtol=1e-4, atol=1e-5)


def test_unnamed_ops_in_a_nested_function_match_whoever_traced_it_first():
    """A tf.function called on its own and from another one: TensorFlow caches its trace apart
    from the caller. Rank 0 traces it alone first (an export signature, or an eval batch of
    another shape); its unnamed allreduce was named after the outer function on rank 1 and after
    the inner one on rank 0, and the job hung."""

    @tf.function
    def global_sum(x):
        return hvd.allreduce(tf.reduce_sum(x, axis=0), op=hvd.Sum)

    @tf.function
    def train_step(x):
        return global_sum(x * 2.0)

    if RANK == 0:
        global_sum.get_concrete_function(tf.TensorSpec([3, 2], tf.float32))
    for rows in (4, 3):
        np.testing.assert_allclose(train_step(tf.ones([rows, 2])).numpy(), [2.0 * rows * SIZE] * 2)
        np.testing.assert_allclose(global_sum(tf.ones([rows, 2])).numpy(), [1.0 * rows * SIZE] * 2)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_through_the_tapes_reduction(mode):
    """A gradient penalty: the outer tape differentiates the averaged gradient, through the
    reduction's own gradient (Horovod's tape ops have one); it was silently None."""
    wrap = (lambda f: f) if mode == "eager" else tf.function
    x = tf.Variable([1.0, 2.0])

    @wrap
    def penalty_gradient():
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(x ** 3) * (RANK + 1)
            g = hvd.DistributedGradientTape(inner).gradient(loss, [x])[0]  # 3x^2 * mean(r + 1)
            penalty = tf.reduce_sum(g * g)
        return g, outer.gradient(penalty, [x])[0]

    g, gg = penalty_gradient()
    c = (SIZE + 1) / 2  # mean over ranks of (r + 1)
    np.testing.assert_allclose(g.numpy(), 3 * c * np.array([1.0, 4.0]), rtol=1e-6)
    # d/dx of sum(g^2): 2g, averaged back across ranks (still 2g), times d(3x^2 (R+1))/dx
    np.testing.assert_allclose(gg.numpy(), 36 * c * (RANK + 1) * np.array([1.0, 8.0]), rtol=1e-6)


def test_sync_batch_normalization_large_mean_and_config_round_trip():
    """A channel with a large mean and a small spread keeps its variance (two passes), and a
    layer rebuilt from its config syncs over the same process set."""
    import keras

    rng = np.random.default_rng(3)
    full = (300 + 0.05 * rng.normal(size=(3 * SIZE, 2))).astype("float32")
    mine = full[3 * RANK:3 * RANK + 3]
    sync, ref = hvd.SyncBatchNormalization(), keras.layers.BatchNormalization()
    out, want = sync(mine, training=True), ref(full, training=True)
    np.testing.assert_allclose(out.numpy(), want.numpy()[3 * RANK:3 * RANK + 3], rtol=1e-3, atol=2e-3)
    last = hvd.add_process_set([SIZE - 1])
    layer = hvd.SyncBatchNormalization(process_set=last)
    clone = hvd.SyncBatchNormalization.from_config(layer.get_config())
    assert clone._hvddp_process_set is last
    assert hvd.SyncBatchNormalization.from_config(sync.get_config())._hvddp_process_set is hvd.global_process_set
    hvd.remove_process_set(last)


def test_horovod_positional_order_and_reducescatter_compression():
    """Horovod's argument order (device_dense, compression, op, name, ...) and its ignored
    ignore_name_scope; reducescatter's compression casts around the reduction."""
    x = tf.constant(np.arange(2 * SIZE * 3, dtype=np.float32).reshape(2 * SIZE, 3) + RANK)
    out = hvd.reducescatter(x, "", hvd.Compression.fp16, hvd.Sum, "t.rs.fp16")
    want = np.arange(2 * SIZE * 3).reshape(2 * SIZE, 3)[2 * RANK:2 * RANK + 2] * SIZE + SIZE * (SIZE - 1) / 2
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-3)
    (grouped,) = hvd.grouped_reducescatter([x], "", hvd.Compression.fp16, hvd.Sum, name="t.grs.fp16")
    np.testing.assert_allclose(grouped.numpy(), want, rtol=1e-3)
    gathered = hvd.allgather(tf.constant([float(RANK)]), "t.ag.pos", False, hvd.global_process_set)
    np.testing.assert_array_equal(gathered.numpy(), np.arange(SIZE, dtype=np.float32))
    bcast = hvd.broadcast(tf.constant([float(RANK)]), 0, "t.bc.pos", True)
    np.testing.assert_array_equal(bcast.numpy(), [0.0])


@pytest.mark.parametrize("mode", MODES)
def test_partial_tape_keeps_the_local_layers_gradients(mode):
    """Horovod's PartialDistributedGradientTape: the local layer's gradients stay this rank's own
    (divided by the size unless scale_local_gradients=False); the others are averaged."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="shared"),
                              keras.layers.Dense(2, name="local")])
    x = tf.constant(np.arange(6, dtype="float32").reshape(2, 3) * (RANK + 1))

    def grads(wrap, **kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        if wrap is not None:
            tape = wrap(tape, **kwargs)
        return tape.gradient(loss, model.trainable_variables)

    def run(*args, **kwargs):
        return [g.numpy() for g in (tf.function(grads)(*args, **kwargs) if mode == "function"
                                    else grads(*args, **kwargs))]

    own = run(None)
    every = [hvd.allgather(tf.constant(g[None]), name=f"test.partial.{mode}.{i}").numpy()
             for i, g in enumerate(own)]
    mean = [e.mean(axis=0) for e in every]
    partial = run(hvd.PartialDistributedGradientTape, local_layers=model.get_layer("local"))
    unscaled = run(hvd.PartialDistributedGradientTape, local_layers=[model.get_layer("local")],
                   scale_local_gradients=False)
    local = {id(w) for w in model.get_layer("local").trainable_weights}
    for i, v in enumerate(model.trainable_variables):
        path = v.path
        if id(v) in local:
            np.testing.assert_allclose(partial[i], own[i] / SIZE, rtol=1e-6, err_msg=path)
            np.testing.assert_allclose(unscaled[i], own[i], rtol=1e-6, err_msg=path)
        else:
            np.testing.assert_allclose(partial[i], mean[i], rtol=1e-5, err_msg=path)
            np.testing.assert_allclose(unscaled[i], mean[i], rtol=1e-5, err_msg=path)
    if SIZE > 1:  # the inputs differ by rank, so a reduced local gradient would be caught
        assert not np.allclose(every[-1][0], every[-1][1])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    tape = hvd.DistributedGradientTape(tape, scale_local_gradients=False)
    tape.register_local_source(model.trainable_variables[0])
    g = tape.gradient(loss, model.trainable_variables)
    np.testing.assert_allclose(g[0].numpy(), own[0], rtol=1e-6)
    np.testing.assert_allclose(g[1].numpy(), mean[1], rtol=1e-5)
    # a Keras 2 (tf_keras) layer, as TF_USE_LEGACY_KERAS=1 makes tf.keras.layers.Dense: Horovod's
    # tape reads only its trainable_weights (it was refused as "not a Keras layer")
    keras2_layer = keras2_standin("Dense", "tf_keras.src.layers.core.dense", built=True,
                                  trainable_weights=model.get_layer("local").trainable_weights)
    np.testing.assert_equal(run(hvd.PartialDistributedGradientTape, local_layers=[keras2_layer]), partial)
    with pytest.raises(ValueError, match="local_layers must be Keras layers.*Received: str 'local'"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=["local"])


def keras2_standin(name, module, **attrs):
    """An object of a class named as the tf_keras package's (Keras 2, which TF_USE_LEGACY_KERAS=1
    makes tf.keras) are: what hvddp tells them by, as tf_keras is not installed here."""
    return type(name, (), {"__module__": module, **attrs})()


def test_keras2_objects_are_refused_naming_them_and_the_fix(tmp_path):
    """tf_keras objects handed to what needs Keras 3 raise TypeError at once, naming the object and
    the fix (Keras 3, or the tape), not an AttributeError deep in Keras (the callbacks, in
    tf_keras' fit) or a SyncBatchNormalization recorded as bare ops (a tf_keras functional model)."""
    import json
    import zipfile

    import hvddp.keras as hk
    from hvddp.keras import callbacks, checkpoint, elastic

    fix = r"\(Keras 2, from the tf_keras package\).*`import keras`.*DistributedGradientTape"
    sgd = keras2_standin("SGD", "tf_keras.src.optimizers.sgd")
    model = keras2_standin("Sequential", "tf_keras.src.engine.sequential")
    with pytest.raises(TypeError, match=r"optimizer=tf_keras\.src\.optimizers\.sgd\.SGD " + fix):
        hk.DistributedOptimizer(sgd)
    with pytest.raises(TypeError, match=r"optimizer=tf_keras\.src\.optimizers\.sgd\.SGD \(Keras 2.*"
                                        r"DistributedGradientTape.*`import keras`"):
        hvd.DistributedOptimizer(sgd)
    # tf_keras' CallbackList calls set_model before the Keras 2 hooks these callbacks lack
    for callback in (callbacks.BroadcastGlobalVariablesCallback(0), callbacks.MetricAverageCallback(),
                     callbacks.LearningRateWarmupCallback(initial_lr=0.1), hk.CheckpointCallback(str(tmp_path)),
                     callbacks.BestModelCheckpoint(filepath=str(tmp_path / "m.keras")),
                     elastic.UpdateEpochStateCallback(None)):
        with pytest.raises(TypeError, match=f"{type(callback).__name__} needs Keras 3 objects; Received: "
                                            r"tf_keras\.src\.engine\.sequential\.Sequential " + fix):
            callback.set_model(model)
    with pytest.raises(TypeError, match=r"KerasState: model must be a keras.Model \(Keras 3\); Received: "
                                        r"tf_keras\.src\.engine\.sequential\.Sequential " + fix):
        elastic.KerasState(model)
    with pytest.raises(TypeError, match=r"save_checkpoint: model must be a Keras 3 model.*Sequential " + fix):
        checkpoint.save_checkpoint(str(tmp_path / "c"), model)
    with pytest.raises(TypeError, match=r"SyncBatchNormalization is a Keras 3 layer; Received: an input of type "
                                        r"tf_keras\.src\.engine\.keras_tensor\.KerasTensor \(Keras 2.*"
                                        r"`import keras`"):
        hvd.SyncBatchNormalization()(keras2_standin("KerasTensor", "tf_keras.src.engine.keras_tensor"))
    # a file tf_keras saved, which Keras 3 cannot load, says so (Keras 3's own error was about
    # an optimizer argument or a metric it could not deserialize)
    path = str(tmp_path / f"keras2_{RANK}.keras")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "2.21.0"}))
        archive.writestr("config.json", json.dumps({"class_name": "Sequential", "module": "keras",
                                                    "config": {"layers": [{"bad": 1}]}}))
    with pytest.raises(ValueError, match=r"(?s)saved by Keras 2\.21\.0 \(Keras 2.*could not load it.*"
                                         r"DistributedGradientTape.*save the model again from Keras 3"):
        hk.load_model(path)


@pytest.mark.parametrize("mode", MODES)
def test_inplace_broadcast_of_variables(mode):
    """Horovod's hvd.broadcast_(variables, root_rank): assigned in place, new values returned."""
    v = tf.Variable(np.full(3, float(RANK), "float32"))
    w = tf.Variable(np.full((2, 2), RANK, "int32"))
    fn = hvd.broadcast_ if mode == "eager" else tf.function(lambda vs: hvd.broadcast_(vs, SIZE - 1))
    out = fn([v, w], SIZE - 1) if mode == "eager" else fn([v, w])
    np.testing.assert_array_equal(v.numpy(), np.full(3, SIZE - 1.0))
    np.testing.assert_array_equal(w.numpy(), np.full((2, 2), SIZE - 1))
    np.testing.assert_array_equal(out[0].numpy(), v.numpy())
    np.testing.assert_array_equal(out[1].numpy(), w.numpy())


def test_local_sources_split_and_outside_the_set():
    """Horovod's get_local_and_global_gradients; local gradients divided by the set's size on
    every rank, members or not; scale_local_gradients accepted by the TF DistributedOptimizer."""
    import keras

    v, w = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(v) + tf.reduce_sum(w)) * (RANK + 1)
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(v)
    local, shared = tape.get_local_and_global_gradients(loss, [v, w])
    assert [s is v for s, _ in local] == [True] and [s is w for s, _ in shared] == [True]
    np.testing.assert_allclose(local[0][1].numpy(), [(RANK + 1) / SIZE] * 2)
    np.testing.assert_allclose(shared[0][1].numpy(), [np.mean(np.arange(SIZE) + 1)])
    if SIZE >= 3:  # a rank outside a set of two
        members = hvd.add_process_set([0, 1])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v) * (RANK + 1)
        tape = hvd.DistributedGradientTape(tape, process_set=members)
        tape.register_local_source(v)
        (g,) = tape.gradient(loss, [v])
        np.testing.assert_allclose(g.numpy(), [(RANK + 1) / 2] * 2)
        hvd.remove_process_set(members)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), scale_local_gradients=False)
    assert hvd.is_initialized() and opt is not None


# Adasum ---------------------------------------------------------------------------------------
from adasum_reference import adasum_reference  # noqa: E402

def adasum_set():
    """A process set of a power-of-two size: every rank, or ranks 0 and 1 of 3 (the others
    are outside it)."""
    if SIZE & (SIZE - 1) == 0:
        return hvd.global_process_set, SIZE
    return hvd.add_process_set([0, 1]), 2


def rank_input(rank, shape, seed):
    """Rank ``rank``'s input: a part common to every rank plus a part of its own, so the ranks'
    vectors are partly aligned and Adasum clearly differs from the sum and the average."""
    common = np.random.default_rng(seed).normal(size=shape)
    return (common + np.random.default_rng(seed + 1 + rank).normal(size=shape)).astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_adasum_ops_against_a_float64_tree(mode):
    """allreduce/grouped_allreduce(op=Adasum), eagerly and in a tf.function: each tensor is the
    Adasum tree of the ranks' tensors (per tensor, not over the group), bit-identical on every
    rank; an IndexedSlices is combined as its dense tensor. At np=3 on a set of two."""
    ps, n = adasum_set()
    wrap = (lambda f: f) if mode == "eager" else tf.function
    shapes = [(3, 2), (5,), (2, 2)]
    mine = [rank_input(RANK, s, 10 * i) for i, s in enumerate(shapes)]
    want = [adasum_reference([rank_input(r, s, 10 * i) for r in range(n)]) for i, s in enumerate(shapes)]

    @wrap
    def run(a, b, c):
        one = hvd.allreduce(a, op=hvd.Adasum, name=f"t.adasum.{mode}.one", process_set=ps)
        group = hvd.grouped_allreduce([a, b, tf.cast(c, tf.float64)], op=hvd.Adasum,
                                      name=f"t.adasum.{mode}.group", process_set=ps)
        sparse = hvd.allreduce(tf.IndexedSlices(b[1:4], tf.constant([0, 2, 4]), tf.constant([5])),
                               op=hvd.Adasum, name=f"t.adasum.{mode}.sparse", process_set=ps)
        return [one] + group + [sparse]

    if ps.included():
        for _ in range(2):
            one, ga, gb, gc, sparse = run(*[tf.constant(m) for m in mine])
            assert one.dtype == tf.float32 and gc.dtype == tf.float64
            np.testing.assert_allclose(one.numpy(), want[0], rtol=1e-6)
            np.testing.assert_array_equal(ga.numpy(), one.numpy())
            np.testing.assert_allclose(gb.numpy(), want[1], rtol=1e-6)
            np.testing.assert_allclose(gc.numpy(), want[2], rtol=1e-12)  # float64 throughout
            dense = [np.zeros(5) for _ in range(n)]
            for r in range(n):
                dense[r][[0, 2, 4]] = rank_input(r, (5,), 10)[1:4]
            np.testing.assert_allclose(sparse.numpy(), adasum_reference(dense), rtol=1e-6)
        everyone = [rank_input(r, shapes[0], 0).astype(np.float64) for r in range(n)]
        assert np.abs(want[0] - np.mean(everyone, axis=0)).max() > 0.1  # neither the average ...
        assert np.abs(want[0] - np.sum(everyone, axis=0)).max() > 0.1  # ... nor the sum
        every = ps_allgather(np.concatenate([one.numpy().ravel(), gb.numpy(), gc.numpy().ravel()]), ps,
                             f"t.adasum.{mode}.same")
        for row in every:
            np.testing.assert_array_equal(row, every[0])  # bit-identical on every rank of the set
    if ps is not hvd.global_process_set:
        hvd.remove_process_set(ps)


def ps_allgather(array, ps, name):
    return hvd.allgather(tf.constant(np.asarray(array, dtype=np.float64)[None]), name=name,
                         process_set=ps).numpy()


@pytest.mark.parametrize("mode", MODES)
def test_adasum_tape_and_optimizer(mode):
    """DistributedGradientTape(op=Adasum): each gradient is the Adasum tree of the ranks' own
    gradients; a registered local source keeps its own (divided by the size); the Keras
    DistributedOptimizer from hvddp.tensorflow applies the Adasum of the gradients. Eagerly, a
    gradient only rank 0 has is rank 0's (Adasum leaves the others' zeros out)."""
    import keras

    ps, n = adasum_set()
    wrap = (lambda f: f) if mode == "eager" else tf.function
    w = tf.Variable(np.linspace(-1.0, 1.0, 6, dtype="float32").reshape(3, 2), name="adasum_w")
    b = tf.Variable(np.zeros(2, "float32"), name="adasum_b")
    u = tf.Variable(np.ones(2, "float32"), name="adasum_local")

    def inputs(rank):
        return rank_input(rank, (4, 3), 30), rank_input(rank, (4, 2), 40) + 2.0

    def loss_of(x, y):
        return tf.reduce_mean((x @ w + b - y) ** 2) + tf.reduce_sum(u * tf.reduce_mean(x[:, :2], axis=0))

    @wrap
    def grads(x, y, distributed):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        if distributed:
            tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, process_set=ps)
            tape.register_local_source(u)
        return tape.gradient(loss, [w, b, u])

    own = [[g.numpy() for g in grads(*[tf.constant(a) for a in inputs(r)], False)] for r in range(n)]
    if ps.included():
        got = [g.numpy() for g in grads(*[tf.constant(a) for a in inputs(RANK)], True)]
        for i in range(2):
            want = adasum_reference([own[r][i] for r in range(n)])
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-7, err_msg=f"gradient {i}")
            assert np.abs(want - np.mean([own[r][i] for r in range(n)], axis=0)).max() > 1e-2
        np.testing.assert_allclose(got[2], own[RANK][2] / n, rtol=1e-6)  # local: not combined
        every = ps_allgather(np.concatenate([got[0].ravel(), got[1]]), ps, f"t.adasum.tape.{mode}")
        for row in every:
            np.testing.assert_array_equal(row, every[0])

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), op=hvd.Adasum, process_set=ps)
        v = keras.Variable(np.zeros((3, 2), "float32"))
        apply = wrap(lambda g: opt.apply_gradients([(g, v)]))
        apply(tf.constant(own[RANK][0]))
        np.testing.assert_allclose(v.numpy(), -0.5 * adasum_reference([own[r][0] for r in range(n)]),
                                   rtol=1e-5, atol=1e-7)
        if mode == "eager":
            only = tf.Variable([1.0, 2.0])
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w) + (tf.reduce_sum(only * 3.0) if RANK == 0 else 0.0)
            g_only, g_w = hvd.DistributedGradientTape(tape, op=hvd.Adasum, process_set=ps).gradient(loss, [only, w])
            np.testing.assert_array_equal(g_only.numpy(), [3.0, 3.0])  # rank 0's, where Average halves it
            np.testing.assert_allclose(g_w.numpy(), np.ones((3, 2)))  # equal gradients: unchanged
    if ps is not hvd.global_process_set:
        hvd.remove_process_set(ps)


def test_adasum_refusals():
    """On a size that is no power of two (np=3) every rank refuses op=Adasum where the op, the
    tape or the optimizer is made, and nothing hangs; at every size, what Adasum does not take is
    refused by name."""
    import keras

    if SIZE & (SIZE - 1):
        for make in (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum, name="t.adasum.np3"),
                     lambda: tf.function(lambda: hvd.grouped_allreduce([tf.ones([2])], op=hvd.Adasum))(),
                     lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum),
                     lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)):
            with pytest.raises(ValueError, match="op=Adasum needs a process set whose size is a power of two"):
                make()
        assert hvd.allgather_object(RANK, name="t.adasum.after") == list(range(SIZE))  # nobody hangs
        return
    with pytest.raises(ValueError, match="op=Adasum applies to allreduce, grouped_allreduce"):
        hvd.reducescatter(tf.ones([2 * SIZE]), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op=Adasum applies to allreduce, grouped_allreduce"):
        hvd.grouped_reducescatter([tf.ones([2 * SIZE])], op=hvd.Adasum)
    with pytest.raises(ValueError, match="int32; op=Adasum combines floating-point"):
        hvd.allreduce(tf.ones([2], tf.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor only applies with op=Average"):
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op=Adasum with 2 passes per step combines"):  # (loss scaling)
        hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), op=hvd.Adasum,
                                 backward_passes_per_step=2).apply([tf.ones([2])], [tf.Variable([0.0, 0.0])])
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:  # no gradient through the op (Horovod's reduces dy with Adasum)
        tape.watch(x)
        y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Adasum, name="t.adasum.nograd"))
    assert tape.gradient(y, x) is None


def test_bad_compression_and_a_rank_outside_the_set_are_named_where_they_are_given():
    """compression="fp16" (a str) failed at the first gradient() with an AttributeError deep in
    the reduction; broadcast_variables on a rank outside its set named an internal call."""
    with tf.GradientTape() as tape:
        pass
    for make in (lambda: hvd.DistributedGradientTape(tape, compression="fp16"),
                 lambda: hvd.allreduce(tf.ones([2]), compression="fp16", name="t.badcomp"),
                 lambda: hvd.grouped_allreduce([tf.ones([2])], compression="fp16", name="t.badcomp.g"),
                 lambda: hvd.reducescatter(tf.ones([2]), compression="fp16", name="t.badcomp.rs")):
        with pytest.raises(TypeError, match=r"compression must be hvddp.Compression.none.*Received: compression='fp16'"):
            make()
    if SIZE < 2:
        return
    first = hvd.add_process_set([0])
    try:
        v = tf.Variable([1.0 * RANK])
        if RANK == 0:
            hvd.broadcast_variables([v], root_rank=0, process_set=first)
        else:
            with pytest.raises(ValueError, match=r"broadcast_variables: this rank \(\d\) is not a member"):
                hvd.broadcast_variables([v], root_rank=0, process_set=first)
    finally:
        hvd.remove_process_set(first)


def test_a_tensor_refused_on_one_rank_fails_on_every_rank():
    """hvddp.tensorflow's own checks (a 0-d tensor where rows are needed, Adasum on integers or
    with a collective that does not take it) refuse a call on rank 0 alone, eagerly: it raises
    that error at once and the ranks that made the call validly raise an error naming rank 0 and
    the reason instead of waiting (MismatchError, or a tf.errors error carrying its message from
    the op's numpy function). Unnamed calls of each kind after them still meet. (Inside a
    tf.function the refusal raises when the function is traced, on rank 0 alone: not announced,
    as that call may never run.)"""
    bad = RANK == 0
    row = tf.ones([2]) if not bad else tf.ones([])
    calls = [
        ("allgather", lambda: hvd.allgather(row)),
        ("reducescatter", lambda: hvd.reducescatter(tf.ones([2 * SIZE]) if not bad else tf.ones([]))),
        ("reducescatter", lambda: hvd.reducescatter(tf.ones([2 * SIZE]), op=hvd.Adasum if bad else None)),
        ("grouped_allgather", lambda: hvd.grouped_allgather([tf.ones([1]), row])),
        ("grouped_reducescatter", lambda: hvd.grouped_reducescatter([tf.ones([SIZE]), row])),
    ]
    if SIZE & (SIZE - 1) == 0:  # (else every rank refuses Adasum for the set's size)
        calls += [
            ("allreduce", lambda: hvd.allreduce(tf.ones([2], tf.int32 if bad else tf.float32), op=hvd.Adasum)),
            ("grouped_allreduce", lambda: hvd.grouped_allreduce(
                [tf.ones([2]), tf.ones([2], tf.int32 if bad else tf.float32)], op=hvd.Adasum)),
        ]
    for fn, call in calls:
        if bad:
            with pytest.raises(ValueError, match=rf"^{fn}: "):
                call()
        else:
            with pytest.raises(Exception, match=rf"refused on rank\(s\) \[0\] \(ValueError: {fn}: ") as info:
                call()
            assert isinstance(info.value, (hvd.MismatchError, tf.errors.OpError)), repr(info.value)
    # one tensor where a grouped op takes a list: a 2-d one was taken as a group of its rows
    rows = tf.ones([2, 2 * SIZE])
    for fn in ("grouped_allreduce", "grouped_allgather", "grouped_reducescatter"):
        call = getattr(hvd, fn)
        if bad:
            with pytest.raises(TypeError, match=rf"^{fn}: tensors must be a list or tuple of tensors, got one "
                                                rf"EagerTensor of shape \[2, {2 * SIZE}\]"):
                call(rows)
        else:
            with pytest.raises(Exception, match=rf"refused on rank\(s\) \[0\] \(TypeError: {fn}: "):
                call([rows[0], rows[1]])
    np.testing.assert_allclose(hvd.allreduce(tf.constant([float(RANK)])).numpy(), [(SIZE - 1) / 2])
    np.testing.assert_allclose(hvd.grouped_allreduce([tf.constant([float(RANK)])])[0].numpy(), [(SIZE - 1) / 2])
    np.testing.assert_array_equal(hvd.allgather(tf.constant([RANK])).numpy(), np.arange(SIZE))
    np.testing.assert_array_equal(hvd.grouped_allgather([tf.constant([RANK])])[0].numpy(), np.arange(SIZE))
    np.testing.assert_allclose(hvd.reducescatter(tf.ones([SIZE]) * RANK).numpy(), [(SIZE - 1) / 2])
    np.testing.assert_allclose(hvd.grouped_reducescatter([tf.ones([SIZE]) * RANK])[0].numpy(), [(SIZE - 1) / 2])


def _embedding_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((4,), dtype="int32"), tf.keras.layers.Embedding(20, 6),
                                tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(3)])


def _token_data():
    rng = np.random.default_rng(3)
    return (rng.integers(0, 20, size=(STEPS * GLOBAL_BATCH, 4)).astype("int32"),
            rng.integers(0, 3, size=STEPS * GLOBAL_BATCH).astype("int32"))


def _my_rows(a):
    per = GLOBAL_BATCH // SIZE
    return np.concatenate([a[b * GLOBAL_BATCH + RANK * per: b * GLOBAL_BATCH + (RANK + 1) * per] for b in range(STEPS)])


@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_are_gathered_as_one_process_has_them(mode):
    """An Embedding's gradient is a tf.IndexedSlices, and Keras' Adam updates only the rows it
    names: reduced as a dense tensor (as hvddp did), the embedding moved 0.05 away from one
    process on the whole batch within 6 steps, replicas identical. Gathered (Horovod's default),
    the tape and the Keras optimizer match one process; sparse_as_dense=True gives dense ones.
    hvd.allreduce of a tf.IndexedSlices gathers too, as Horovod's does."""
    x, y = _token_data()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    wrap = (lambda f: f) if mode == "eager" else tf.function

    def tape_loop(distributed, xs, ys, batch, sparse_as_dense=False):
        model, optimizer = _embedding_model(), tf.keras.optimizers.Adam(0.05)
        kinds = []

        @wrap
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb))
            if distributed:
                tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
            grads = tape.gradient(loss, model.trainable_variables)
            kinds.append(type(grads[0]).__name__)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for b in range(STEPS):
            step(tf.constant(xs[b * batch:(b + 1) * batch]), tf.constant(ys[b * batch:(b + 1) * batch]))
        return model.get_weights(), kinds

    per = GLOBAL_BATCH // SIZE
    reference, _ = tape_loop(False, x, y, GLOBAL_BATCH)
    got, kinds = tape_loop(True, _my_rows(x), _my_rows(y), per)
    assert kinds[0] == "IndexedSlices"
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_replicas_identical(got, f"sparse.tape.{mode}")
    _, kinds = tape_loop(True, _my_rows(x), _my_rows(y), per, sparse_as_dense=True)
    assert kinds[0] != "IndexedSlices"

    @wrap
    def allreduce_slices(values, indices):  # hvd.allreduce of a tf.IndexedSlices: Horovod's gather
        slices = tf.IndexedSlices(values, indices, tf.constant([20, 2], tf.int64))
        return (hvd.allreduce(slices, name=f"t.slices.{mode}.avg"),
                hvd.allreduce(slices, op=hvd.Sum, postscale_factor=2.0, name=f"t.slices.{mode}.sum"))

    mine = np.full((RANK + 1, 2), RANK + 1.0, "float32")
    average, total = allreduce_slices(tf.constant(mine), tf.constant(np.arange(RANK + 1) + 10 * RANK, tf.int64))
    assert isinstance(average, tf.IndexedSlices) and isinstance(total, tf.IndexedSlices)
    rows = np.concatenate([np.full((r + 1, 2), r + 1.0) for r in range(SIZE)])
    np.testing.assert_array_equal(average.indices.numpy(), np.concatenate([np.arange(r + 1) + 10 * r for r in range(SIZE)]))
    np.testing.assert_allclose(average.values.numpy(), rows / SIZE)
    np.testing.assert_allclose(total.values.numpy(), rows * 2.0)
    if mode == "eager":  # (fit traces its own step)
        model = _embedding_model()
        model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.05)), loss=loss_fn)
        model.fit(_my_rows(x), _my_rows(y), batch_size=per, shuffle=False, verbose=0)
        for a, b in zip(model.get_weights(), reference):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert_replicas_identical(model.get_weights(), "sparse.fit")


@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradient_penalty_and_a_rank_without_the_gradient(mode):
    """An outer tape through the gathered sparse gradient gets what it gets through the dense
    reduction (allgather's own gradient averages over ranks: it came out 1/size too small). A
    gradient that is sparse on one rank and None on another raises on every rank, saying what to
    do (one rank waited on a gather the other never made, and the job aborted on the stall)."""
    x, y = _token_data()
    x, y = _my_rows(x)[:GLOBAL_BATCH // SIZE], _my_rows(y)[:GLOBAL_BATCH // SIZE]
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    wrap = (lambda f: f) if mode == "eager" else tf.function

    def penalty_gradient(sparse_as_dense):
        model = _embedding_model()

        @wrap
        def run(xb, yb):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb))
                grads = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(
                    loss, model.trainable_variables)
                embedding = tf.convert_to_tensor(grads[0])
                penalty = tf.reduce_sum(embedding * embedding)
            return outer.gradient(penalty, model.trainable_variables[1])

        return run(tf.constant(x), tf.constant(y)).numpy()

    sparse, dense = penalty_gradient(False), penalty_gradient(True)
    assert np.abs(dense).max() > 1e-4
    np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-7)
    if mode == "eager":
        table = tf.Variable(np.ones((10, 3), "float32"))
        weight = tf.Variable(np.ones(3, "float32"))
        with tf.GradientTape() as tape:
            used = tf.gather(table, [1, 2]) * weight if RANK == 0 else weight * 2.0
            loss = tf.reduce_sum(used)
        # (the message leads with that cause: the count that differs first read as another model)
        with pytest.raises(hvd.MismatchError, match=r"^tf\.grads: the ranks reduce different numbers of dense "
                           r"gradients, which a gradient that is sparse \(tf.IndexedSlices\) on some ranks and "
                           r"dense or None on others does: .*sparse_as_dense=True"):
            hvd.DistributedGradientTape(tape).gradient(loss, [table, weight])
        with tf.GradientTape() as tape:  # dense on the other ranks, not None: the same message
            used = tf.gather(table, [1, 2]) * weight if RANK == 0 else table * weight
            loss = tf.reduce_sum(used)
        with pytest.raises(hvd.MismatchError, match=r"sparse \(tf.IndexedSlices\) on some ranks and dense or None"):
            hvd.DistributedGradientTape(tape).gradient(loss, [table, weight])
        # two tables of one shape, each looked up on one rank only: the groups match in shape, and
        # the gathers of the two tables met under one name (each rank updated its own table with
        # both ranks' rows, silently)
        other = tf.Variable(np.ones((10, 3), "float32"))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table if RANK == 0 else other, [1, 2]))
        with pytest.raises(hvd.MismatchError, match="sparse .tf.IndexedSlices. on some ranks and not on others"):
            hvd.DistributedGradientTape(tape).gradient(loss, [table, other])


def test_scale_factors_are_checked_as_the_core_checks_them_and_announced():
    """A scale factor is checked when the op is made, as the core checks it (a real, finite
    number): a string, None or a bool raises TypeError naming it (float() accepted '2' and True,
    and its ValueError named nothing); refused on rank 0 alone, the others raise naming rank 0
    (reducescatter and the grouped ops checked after their announcing block: the others waited
    for ever). An eager scalar tensor is taken; a symbolic one is named."""
    calls = {
        "allreduce": lambda f: hvd.allreduce(tf.ones([SIZE]), op=hvd.Sum, prescale_factor=f),
        "grouped_allreduce": lambda f: hvd.grouped_allreduce([tf.ones([SIZE])], op=hvd.Sum, postscale_factor=f),
        "reducescatter": lambda f: hvd.reducescatter(tf.ones([SIZE]), op=hvd.Sum, prescale_factor=f),
        "grouped_reducescatter": lambda f: hvd.grouped_reducescatter([tf.ones([SIZE])], op=hvd.Sum,
                                                                     postscale_factor=f),
    }
    for fn, call in calls.items():
        for bad in ("2", None, True, float("nan")):
            with pytest.raises((TypeError, ValueError), match=rf"^{fn}: (pre|post)scale_factor must be"):
                call(bad)
        if RANK == 0:
            with pytest.raises(TypeError, match=rf"^{fn}: (pre|post)scale_factor must be a real number"):
                call("0.5x")
        else:
            with pytest.raises(Exception, match=rf"refused on rank\(s\) \[0\] \(TypeError: {fn}: "):
                call(0.5)
        out = call(tf.constant(0.5))
        out = out[0] if isinstance(out, list) else out
        np.testing.assert_allclose(out.numpy(), 0.5 * SIZE * np.ones(out.shape))

    factor = tf.Variable(0.5)

    @tf.function
    def traced():
        return hvd.allreduce(tf.ones([1]), prescale_factor=factor, name="symbolic.factor")

    with pytest.raises(TypeError, match=r"allreduce: prescale_factor must be a Python number"):
        traced()


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_with_an_op_without_a_derivative_has_no_gradient(mode):
    """As allreduce: Min, Max and Product have no gradient (None); it raised in backward."""
    wrap = (lambda f: f) if mode == "eager" else tf.function
    x = tf.ones([SIZE, 2]) * (RANK + 1)

    @wrap
    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            one = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Min, name=f"rs.nograd.{mode}"))
            group = tf.reduce_sum(hvd.grouped_reducescatter([x], op=hvd.Max, name=f"grs.nograd.{mode}")[0])
        return tape.gradient(one, x), tape.gradient(group, x)

    assert grads(x) == (None, None)


def test_a_sparse_gradient_after_a_rank_joined_points_to_sparse_as_dense():
    """A sparse gradient is gathered, which a joined rank refuses: the error says to pass
    sparse_as_dense=True (it spoke of a gradient sparse on some ranks and dense on others), and
    with it the step runs, the joined rank contributing zeros."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    emb = tf.Variable(tf.ones([4, 2]))

    def step(sparse_as_dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [1, 2]))
        return hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, [emb])[0]

    for sparse_as_dense in (False, True):
        if RANK == 0:
            if sparse_as_dense:
                np.testing.assert_allclose(tf.convert_to_tensor(step(True)).numpy()[1], [1 / SIZE] * 2)
            else:
                with pytest.raises(hvd.MismatchError, match=r"called join\(\).*pass sparse_as_dense=True"):
                    step(False)
        assert int(hvd.join()) >= 0
