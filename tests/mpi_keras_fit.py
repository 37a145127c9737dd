"""Rank-side tests of hvddp.keras, run on every rank at once by tests/test_keras.py (at 3 ranks,
only those marked np3).

The backend comes from KERAS_BACKEND. Inputs depend on the rank, so every rank can assert the
exact result; each test ends with a cross-rank check that the replicas are identical.
"""

import os
import shutil
import tempfile

import numpy as np
import pytest

import keras
from keras import layers, ops

import hvddp.keras as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BACKEND = keras.backend.backend()
HAS_MULTI_OPTIMIZER = hasattr(keras.optimizers, "MultiOptimizer")  # Keras >= 3.15
# The parity tests compare shards with one process on the whole batch. On a GPU, JAX and
# TensorFlow multiply float32 matrices in TF32 by default (10-bit mantissas), which puts the two
# ~1e-3 apart whatever hvddp does (seen on an H200): ask for full float32 products.
if BACKEND == "jax":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
elif BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.experimental.enable_tensor_float_32_execution(False)
GLOBAL_BATCH = 12  # divides by 2 and 3
STEPS = 3


class Unused(layers.Layer):
    """Identity with a trainable weight the loss never touches (a None gradient on TF/torch)."""

    def build(self, shape):
        self.unused = self.add_weight(shape=(3,), initializer="ones", name="unused")

    def call(self, x):
        return x


_SCRATCH = []  # rank 0's scratch directory for the files the ranks share, removed at the end


def shared_directory(name):
    """A fresh directory every rank knows (rank 0 makes it)."""
    if RANK == 0 and not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="hvddp_keras_fit_"))
    return hvd.broadcast_object(tempfile.mkdtemp(dir=_SCRATCH[0]) if RANK == 0 else None, 0, name=f"test.dir.{name}")


@pytest.fixture(scope="module", autouse=True)
def remove_the_scratch_directory():
    yield
    hvd.barrier()  # every rank is done with the files
    if _SCRATCH:
        shutil.rmtree(_SCRATCH[0], ignore_errors=True)


def saved_by_rank_0(model, filename):
    """Save ``model`` from rank 0 into a fresh directory every rank knows; return the path once
    the file is there."""
    directory = shared_directory(filename)
    path = os.path.join(directory, filename)
    if RANK == 0:
        model.save(path)
    hvd.barrier()
    return path


def make_model(seed=0, units=8, unused=True):
    keras.utils.set_random_seed(seed)
    middle = [Unused()] if unused else []
    return keras.Sequential([keras.Input((5,)), layers.Dense(units, activation="tanh"), *middle,
                             layers.Dense(3)])


def global_data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 5)).astype("float32")
    y = rng.integers(0, 3, size=(STEPS * GLOBAL_BATCH,)).astype("int32")
    return x, y


def shard(a):
    """This rank's rows of every global batch, in batch order."""
    per = GLOBAL_BATCH // SIZE
    rows = [a[b * GLOBAL_BATCH + RANK * per: b * GLOBAL_BATCH + (RANK + 1) * per] for b in range(STEPS)]
    return np.concatenate(rows)


def assert_replicas_identical(weights, name):
    flat = np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in weights])
    every = hvd.allgather(flat[None, :], name=f"test.replicas.{name}")
    for r in range(SIZE):
        np.testing.assert_array_equal(every[r], every[0], err_msg=f"rank {r} differs from rank 0")


@pytest.mark.parametrize("opt", ["adam", pytest.param("sgd", marks=pytest.mark.np3)])
def test_fit_parity(opt):
    """K steps of fit on shards == one process fitting the whole batches; replicas identical."""
    make_opt = {"adam": lambda: keras.optimizers.Adam(0.01),
                "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9)}[opt]
    x, y = global_data()
    model = make_model()
    initial = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="sparse_categorical_crossentropy")
    assert type(model.optimizer).__name__ == type(make_opt()).__name__
    assert hvd.is_distributed(model.optimizer)
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, shuffle=False, verbose=0)

    reference = make_model()
    reference.set_weights(initial)
    reference.compile(optimizer=make_opt(), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == STEPS
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The weights moved, and the unused weight got zero updates (its gradient is None or 0).
    assert not np.allclose(model.get_weights()[0], initial[0])
    np.testing.assert_array_equal(model.layers[1].unused.numpy() if BACKEND != "torch"
                                  else ops.convert_to_numpy(model.layers[1].unused), np.ones(3))
    assert_replicas_identical(model.get_weights(), f"parity.{opt}")


def count_reductions(monkeypatch):
    """A list that gets the name of every grouped allreduce the optimizer starts (the calls still
    go through to hvddp)."""
    import hvddp

    names, real = [], hvddp.grouped_allreduce_async

    def counted(*args, **kwargs):
        names.append(kwargs.get("name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hvddp, "grouped_allreduce_async", counted)
    return names


def test_backward_passes_per_step(monkeypatch):
    """Two batches per update, gradients summed over the passes (Horovod's default), reduced once
    per update (not once per batch), the unused weight's None gradient skipped as in one process."""
    x, y = global_data()
    model = make_model()
    initial = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     backward_passes_per_step=2),
                  loss="sparse_categorical_crossentropy")
    reductions = count_reductions(monkeypatch)
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=2, shuffle=False, verbose=0)
    assert reductions == ["keras.grads"] * STEPS, reductions  # 2 epochs of STEPS batches, 2 per update
    reference = make_model()
    reference.set_weights(initial)
    # Keras averages the accumulated passes; twice the rate gives the sum.
    reference.compile(optimizer=keras.optimizers.SGD(0.2, gradient_accumulation_steps=2),
                      loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    # (float32 over 8 updates, summed passes against Keras' averaged accumulators: on an AMD EPYC
    # one weight of 0.027 came out 2e-6 apart, as machine-dependent as TensorFlow's kernels; a
    # wrong reduction is off by the weight's own size)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(model.get_weights()[0], initial[0])
    np.testing.assert_array_equal(ops.convert_to_numpy(model.layers[1].unused), np.ones(3))
    assert_replicas_identical(model.get_weights(), "passes")


def clipped(grads, kind, limit):
    """Keras' clipping of ``grads`` (numpy), for the expected results."""
    if kind == "clipvalue":
        return [np.clip(g, -limit, limit) for g in grads]
    if kind == "clipnorm":
        return [g * limit / max(np.linalg.norm(g), limit) for g in grads]
    norm = np.sqrt(sum(np.sum(g * g) for g in grads))
    return [g * limit / max(norm, limit) for g in grads]


@pytest.mark.parametrize("kind", ["clipnorm", "clipvalue", "global_clipnorm"])
def test_clipping_applies_to_the_averaged_gradient(kind):
    """As one process clips the whole batch's gradient: clipped after the average, not each
    rank's before it (which moves the weights elsewhere), in apply and apply_gradients, with one
    pass per update and with two (the average waits for the update pass)."""
    def rank_grads(r):  # ranks' gradients point different ways, so the order of the two matters
        return [np.array([1.0, -2.0, 3.0], "float32") * (1 + 2 * r) - r * np.array([4.0, 0.0, 10.0], "float32"),
                np.array([0.5, -1.5], "float32") * (1 - 3 * r)]

    limit = {"clipnorm": 1.0, "clipvalue": 0.5, "global_clipnorm": 1.0}[kind]
    average = [np.mean([rank_grads(r)[i] for r in range(SIZE)], axis=0) for i in range(2)]
    want = [-g for g in clipped(average, kind, limit)]
    if SIZE > 1:  # (the check tells the two orders apart)
        each_first = [-np.mean([clipped(rank_grads(r), kind, limit)[i] for r in range(SIZE)], axis=0)
                      for i in range(2)]
        assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(want, each_first))
    mine = [ops.convert_to_tensor(g) for g in rank_grads(RANK)]
    for passes, apply in ((1, "apply"), (2, "apply_gradients")):
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0, **{kind: limit}), backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)
        variables = [keras.Variable(np.zeros(3, "float32")), keras.Variable(np.zeros(2, "float32"))]
        for _ in range(passes):
            opt.apply(mine, variables) if apply == "apply" else opt.apply_gradients(zip(mine, variables))
        for got, expected in zip(variables, want):
            np.testing.assert_allclose(ops.convert_to_numpy(got), expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{kind}, {passes} passes")


def test_fit_with_the_optimizers_own_passes_averages_only_when_told_and_clips_the_average():
    """Keras' own gradient_accumulation_steps: Keras averages the passes, Horovod's
    backward_passes_per_step sums them. Wrapped without saying which, the sum was taken silently
    (updates twice one process's, clipped at twice the norm): refused, on every rank. With
    average_aggregated_gradients=True, fit matches one process on the whole batches, its
    global_clipnorm applied to the average of the ranks' accumulated passes."""
    def sgd():
        return keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, global_clipnorm=0.05)

    with pytest.raises(ValueError, match=r"own gradient_accumulation_steps=2.*average_aggregated_gradients=True "
                                         r"\(Keras' average.*backward_passes_per_step=2 \(Horovod's sum\)"):
        hvd.DistributedOptimizer(sgd())
    with pytest.raises(ValueError, match="own gradient_accumulation_steps=2"):  # (under loss scaling too)
        hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(sgd()))
    x, y = global_data()
    model = make_model(unused=False)
    initial = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(), average_aggregated_gradients=True),
                  loss="sparse_categorical_crossentropy")
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=2, shuffle=False, verbose=0)
    reference = make_model(unused=False)
    reference.set_weights(initial)
    reference.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(model.get_weights()[0], initial[0])
    assert_replicas_identical(model.get_weights(), "own.passes.clipped")


def model_with_passes():
    model = make_model(unused=False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2),
                  loss="sparse_categorical_crossentropy")
    return model


def test_passes_survive_a_broadcast_a_checkpoint_and_an_elastic_sync_between_updates():
    """Between the passes of an update each rank's accumulators hold its own passes' sum, so what
    copies rank 0's state to every rank (the broadcast callback, a checkpoint, an elastic sync)
    first averages them: training that stops there (STEPS=3 batches per epoch, 2 passes per
    update) and goes on ends where uninterrupted training does (rank 0's sums alone moved the
    weights ~1e-1 away)."""
    from hvddp.keras.checkpoint import load_checkpoint, save_checkpoint

    x, y = global_data()
    fit = dict(batch_size=GLOBAL_BATCH // SIZE, shuffle=False, verbose=0)
    compiled = model_with_passes
    want = compiled()
    want.fit(shard(x), shard(y), epochs=2, **fit)
    directory = shared_directory("passes")
    path = os.path.join(directory, "passes.ckpt")
    for how in ("broadcast", "checkpoint", "elastic"):
        model = compiled()
        model.fit(shard(x), shard(y), epochs=1, **fit)  # stops after the first pass of an update
        callbacks = []
        if how == "broadcast":
            callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
        elif how == "checkpoint":
            save_checkpoint(path, model, epoch=1)
            model = compiled()
            load_checkpoint(path, model)
        else:
            state = hvd.elastic.KerasState(model, epoch=1)
            state.commit()
            state.sync()
        model.fit(shard(x), shard(y), epochs=2, initial_epoch=1, callbacks=callbacks, **fit)
        for got, expected in zip(model.get_weights(), want.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=how)
        assert_replicas_identical(model.get_weights(), f"passes.{how}")


def test_a_state_restored_on_rank_0_alone_gives_every_rank_its_accumulators():
    """Rank 0 reloads a model saved between the passes of an update (its optimizer a step ahead
    of the others' fresh ones): the broadcast callback copies its accumulators as they are,
    rather than averaging them with the others' zeros."""
    x, y = global_data()
    model = model_with_passes()
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, shuffle=False, verbose=0)
    path = saved_by_rank_0(model, "passes.keras")
    restored = hvd.load_model(path) if RANK == 0 else model_with_passes()
    restored.optimizer.build(restored.trainable_variables)
    saved = hvd.broadcast_object([ops.convert_to_numpy(a) for a in restored.optimizer._accumulated_gradients]
                                 if RANK == 0 else None, 0, name="test.passes.saved")
    assert any(a.any() for a in saved)  # (between passes: rank 0's partial sums)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    callback.set_model(restored)
    callback.on_train_begin()
    for got, want in zip(restored.optimizer._accumulated_gradients, saved):
        np.testing.assert_array_equal(ops.convert_to_numpy(got), want)


def test_passes_with_a_gradient_only_some_ranks_have_fail_on_every_rank(monkeypatch):
    """With deferred passes Keras drops a None gradient before hvddp sees it, so ranks whose None
    gradients differ reduce different lists: a MismatchError naming the variable, on every rank,
    at the update pass (the first pass reduces nothing)."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    a, b = keras.Variable(np.zeros(2, "float32"), name="a"), keras.Variable(np.zeros(3, "float32"), name="b")
    opt.build([a, b])
    reductions = count_reductions(monkeypatch)

    def grads():
        return [ops.ones(2), ops.ones(3) if RANK == 0 else None]

    opt.apply(grads(), [a, b])
    assert reductions == []
    # (JAX re-raises what its callbacks raise as its own error, with the message)
    with pytest.raises(Exception if BACKEND == "jax" else hvd.MismatchError, match="only rank 0 has 'b'"):
        opt.apply(grads(), [a, b])
    assert reductions == ["keras.grads"]
    assert hvd.allgather_object("after") == ["after"] * SIZE  # and the engine goes on


def test_wrapping_a_built_optimizer_with_passes_keeps_its_state():
    """Wrapping an optimizer that has trained, with backward_passes_per_step=2: each state
    variable lands in the one of the same name (the added accumulators start at zero)."""
    model = make_model(unused=False)
    adam = keras.optimizers.Adam(0.01)
    grads = [ops.convert_to_tensor(np.full(v.shape, i + 1.0, dtype="float32"))
             for i, v in enumerate(model.trainable_variables)]
    adam.apply(grads, model.trainable_variables)
    wrapped = hvd.DistributedOptimizer(adam, backward_passes_per_step=2)
    old = {v.name: ops.convert_to_numpy(v) for v in adam.variables}
    accumulators = 0
    for v in wrapped.variables:
        value = ops.convert_to_numpy(v)
        if v.name.endswith("_gradient_accumulator"):
            accumulators += 1
            assert not value.any(), v.name
        else:
            np.testing.assert_array_equal(value, old[v.name], err_msg=v.name)
    assert accumulators == len(model.trainable_variables) > 1


def test_broadcast_callback_equalises_replicas():
    model = make_model(seed=100 + RANK)  # different initial weights on every rank
    root_initial = hvd.broadcast_object(model.get_weights(), root_rank=0, name="test.root_initial")
    if SIZE > 1:
        assert not np.allclose(hvd.allgather(model.get_weights()[0][None], name="test.init0")[0],
                               hvd.allgather(model.get_weights()[0][None], name="test.init1")[1])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    x, y = global_data()
    model.fit(shard(x), keras.utils.to_categorical(shard(y), 3), batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    for got, want in zip(model.get_weights(), root_initial):  # learning rate 0: still rank 0's
        np.testing.assert_array_equal(got, want)
    assert_replicas_identical(model.get_weights(), "bcast")
    # Keras 2's opt.variables(), which Horovod's wrapper keeps working, as well as the property
    opt = model.optimizer
    assert [id(v) for v in opt.variables()] == [id(v) for v in opt.variables] != []
    hvd.broadcast_variables(opt.variables(), root_rank=0)


def test_broadcast_variables_leaves_dropout_rng_states_per_rank():
    """model.variables holds each Dropout's SeedGenerator state: broadcast, every rank drew the
    same dropout masks (the callback already left them out)."""
    keras.utils.set_random_seed(60 + RANK)
    model = keras.Sequential([keras.Input((4,)), layers.Dense(8), layers.Dropout(0.5)])
    seeds = [v for v in model.variables if "seed_generator" in v.path]
    assert seeds, [v.path for v in model.variables]
    mine = [np.array(v.numpy()) for v in seeds]
    hvd.broadcast_variables(model.variables, root_rank=0)
    for v, was in zip(seeds, mine):
        np.testing.assert_array_equal(np.array(v.numpy()), was)
    assert_replicas_identical([np.array(v.numpy()) for v in model.trainable_variables], "dropout.bcast")


def test_callback_arguments_are_checked_where_they_are_given():
    """A list as process_set failed after a whole epoch (MetricAverageCallback) and a str
    steps_per_epoch at the first batch, as errors naming neither the callback nor the argument."""
    for make in (lambda: hvd.callbacks.MetricAverageCallback(process_set=[0]),
                 lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0, process_set=0),
                 lambda: hvd.broadcast_variables([], 0, process_set=[0]),
                 lambda: hvd.allreduce(np.ones(2), process_set=[0])):
        with pytest.raises(TypeError, match=r"process_set must be an hvddp ProcessSet.*Received: process_set="):
            make()
    for bad in ("4", 0, 2.5, True):
        with pytest.raises(TypeError, match=r"LearningRateWarmupCallback: steps_per_epoch must be a positive "
                                            rf"int.*Received: steps_per_epoch={bad!r}"):
            hvd.callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch=bad)
    assert hvd.callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch=np.int64(4)).steps_per_epoch == 4
    # a str root_rank or epoch was taken, and failed later (or never)
    with pytest.raises(TypeError, match=r"BroadcastGlobalVariablesCallback: root_rank must be an int.*root_rank='0'"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank="0")
    for arg in ("start_epoch", "end_epoch"):
        with pytest.raises(TypeError, match=rf"LearningRateScheduleCallback: {arg} must be a number.*{arg}='2'"):
            hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, **{arg: "2"})
    # the optimizer's: a numpy integer of passes is one (Horovod takes it); a str switch is no bool
    assert hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=np.int64(2)
                                    ).gradient_accumulation_steps == 2
    for arg in ("average_aggregated_gradients", "sparse_as_dense", "scale_local_gradients"):
        with pytest.raises(TypeError, match=rf"DistributedOptimizer: {arg} must be True or False.*{arg}='no'"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **{arg: "no"})
    # a MultiOptimizer has no gradient_accumulation_steps of its own: the passes were dropped and
    # every batch updated, silently; a LossScaleOptimizer's inner one accumulates
    if HAS_MULTI_OPTIMIZER:
        with pytest.raises(ValueError, match=r"backward_passes_per_step=2 needs an optimizer that accumulates.*"
                                             r"Received: MultiOptimizer"):
            hvd.DistributedOptimizer(keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
                keras.optimizers.SGD(0.1))), backward_passes_per_step=2)
    assert hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                                    backward_passes_per_step=2).inner_optimizer.gradient_accumulation_steps == 2


def test_accumulators_are_averaged_after_the_first_pass_of_an_update_too():
    """Keras' ``iterations`` counts updates, not passes: after pass 1 (or 5, 9...) of 2-pass
    updates the check took the accumulators for empty, and a sync copied rank 0's partial sums
    to every rank (a model built by its first step is broadcast right there)."""
    model = model_with_passes()
    x, y = global_data()
    per = GLOBAL_BATCH // SIZE
    model.fit(shard(x)[:per], shard(y)[:per], batch_size=per, epochs=1, shuffle=False, verbose=0)  # one pass
    optimizer = model.optimizer
    assert int(ops.convert_to_numpy(optimizer._iterations)) == 1
    before = [ops.convert_to_numpy(a).copy() for a in optimizer._accumulated_gradients]
    hvd.elastic.KerasState(model).sync()
    mean = [np.asarray(hvd.allreduce(a, name=f"test.accumulator.{i}")) for i, a in enumerate(before)]
    assert any(np.abs(m - b).max() > 1e-6 for m, b in zip(mean, before))  # (the ranks' sums differ)
    for got, want in zip(optimizer._accumulated_gradients, mean):
        np.testing.assert_allclose(ops.convert_to_numpy(got), want, rtol=1e-6, atol=1e-7)


def test_a_gradient_no_rank_has_is_skipped_in_an_eager_apply():
    """A custom loop's apply([g, None]): on JAX the None went to Keras as zeros, so AdamW's decay
    and SGD's momentum moved the variable no rank had a gradient for (plain Keras skips it)."""
    for make in (lambda: keras.optimizers.AdamW(0.1, weight_decay=0.5),
                 lambda: keras.optimizers.SGD(0.1, momentum=0.9)):
        after = []
        for optimizer in (make(), hvd.DistributedOptimizer(make())):
            a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(2, "float32"))
            optimizer.build([a, b])
            optimizer.apply([ops.ones(2), ops.ones(2)], [a, b])
            optimizer.apply([ops.ones(2), None], [a, b])
            after.append(ops.convert_to_numpy(b).copy())
        np.testing.assert_allclose(after[1], after[0], rtol=1e-6)


def test_from_config_sums_the_passes_as_the_wrapper_does():
    """A copy made with from_config averaged the accumulated passes (its update was half the
    wrapper's with two passes) where DistributedOptimizer and load_model sum them."""
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    twin = type(optimizer).from_config(optimizer.get_config())
    for each in (optimizer, twin):
        v = keras.Variable(np.zeros(1, "float32"))
        each.build([v])
        for _ in range(2):
            each.apply([ops.ones(1)], [v])
        np.testing.assert_allclose(ops.convert_to_numpy(v), [-2.0])


def test_jit_compile_on_a_set_of_one_rank_with_passes_or_compression():
    """At one rank nothing is reduced, and XLA compiles the step: also with passes (their sum's
    scale, in the backend's ops) and Compression.fp16 (nothing to compress for, as in Horovod); on
    TensorFlow both reached the numpy reduction, which XLA refuses. Every rank trains on the same
    batches: rank 0 alone in the set, the others outside it (their own gradients, the passes summed
    alike). (Both settings in one optimizer: each compiled step costs 25-30 s on the torch backend.)"""
    alone = hvd.add_process_set([0])
    x, y = global_data()
    try:
        for kwargs in (dict(backward_passes_per_step=2, compression=hvd.Compression.fp16),):
            weights = []
            for jit in (True, False):
                model = make_model(unused=False)
                model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=alone,
                                                                 **kwargs),
                              loss="sparse_categorical_crossentropy", jit_compile=jit)
                model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
                weights.append(model.get_weights())
            for got, want in zip(*weights):  # (XLA computes tanh and its gradient its own way)
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5, err_msg=str(kwargs))
            # the set of one trains as the ranks outside it do
            theirs = hvd.broadcast_object(weights[1], root_rank=SIZE - 1, name=f"test.alone.{list(kwargs)[0]}")
            for got, want in zip(weights[1], theirs):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    finally:
        hvd.remove_process_set(alone)


@pytest.mark.np3
def test_metric_average_callback():
    local = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            local[epoch] = dict(logs)

    class PerClass(keras.callbacks.Callback):  # a value per class, as F1Score(average=None) logs
        def on_epoch_end(self, epoch, logs=None):
            logs["per_class"] = ops.convert_to_tensor(np.array([RANK, 10.0 * RANK + epoch], "float32"))

    averaged = {}

    class After(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            averaged[epoch] = dict(logs)

    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", metrics=["mae"])
    x = np.full((8, 5), 0.1 * (RANK + 1), "float32")
    y = np.full((8, 3), float(RANK), "float32")  # the loss differs per rank
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                        callbacks=[PerClass(), Record(), hvd.callbacks.MetricAverageCallback(device=""), After()])
    for epoch in range(2):
        every = hvd.allgather_object(local[epoch], name=f"test.metrics.{epoch}")
        for key in ("loss", "mae"):
            want = np.mean([logs[key] for logs in every])
            assert history.history[key][epoch] == pytest.approx(want, rel=1e-6)
            if SIZE > 1:
                assert every[0][key] != pytest.approx(every[1][key])
        # arrays too (they were left as each rank's own), keeping their shape and dtype
        per_class = averaged[epoch]["per_class"]
        assert isinstance(per_class, np.ndarray) and per_class.dtype == np.float32, repr(per_class)
        np.testing.assert_allclose(per_class, [(SIZE - 1) / 2, 10.0 * (SIZE - 1) / 2 + epoch])


def test_metric_average_callback_refuses_metrics_some_ranks_lack():
    """Validation data on rank 0 only: its val_ metrics have no partner reduction on the others,
    which waited forever (Horovod's too); every rank raises, naming what each logged."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((4, 5), "float32"), np.zeros((4, 3), "float32")
    with pytest.raises(hvd.MismatchError, match=r"epoch 0 the ranks log different metrics .* rank 0: "
                                                  r"\[\('loss', \(\)\), \('val_loss', \(\)\)\]; rank 1: \[\('loss'"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x, y) if RANK == 0 else None,
                  callbacks=[hvd.callbacks.MetricAverageCallback()])
    hvd.allreduce(np.ones(1), name="after.metric.mismatch")  # the engine goes on


def test_metric_average_callback_with_no_logs_on_one_rank_raises_on_every_rank():
    """A rank whose logs were empty (or None) returned at once, and the others waited forever for
    its part of the comparison; now every rank compares and raises."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    callback = hvd.callbacks.MetricAverageCallback()
    with pytest.raises(hvd.MismatchError, match=r"rank 0: \[\('loss', \(\)\)\]; rank 1: \[\]"):
        callback.on_epoch_end(0, {"loss": 1.0} if RANK == 0 else ({} if RANK == 1 else None))
    callback.on_epoch_end(1, None)  # empty everywhere: nothing to average
    logs = {}
    callback.on_epoch_end(2, logs)
    assert logs == {}


def test_best_model_checkpoint_saves_improvements_on_rank_0():
    """Horovod's BestModelCheckpoint (monitor first; filepath a keyword here, since Horovod's
    None is refused by Keras 3): the model whose averaged monitored value was best, on rank 0."""
    with pytest.raises(ValueError, match="filepath"):
        hvd.callbacks.BestModelCheckpoint(monitor="loss")
    directory = shared_directory("best")
    path = os.path.join(directory, f"best{RANK}.keras")  # a path per rank: only rank 0's is written
    losses = iter([3.0, 1.0, 2.0])

    class Loss(keras.callbacks.Callback):  # a monitored value that improves once, then worsens
        def on_epoch_end(self, epoch, logs=None):
            logs["made_up"] = next(losses) + RANK  # averaged first: its order is the same everywhere

    kept = {}

    class Keep(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            kept[epoch] = [w.copy() for w in self.model.get_weights()]

    model = make_model(unused=False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = np.ones((8, 5), "float32"), np.zeros((8, 3), "float32")
    model.fit(x, y, batch_size=4, epochs=3, verbose=0,
              callbacks=[Loss(), hvd.callbacks.MetricAverageCallback(), Keep(),
                         hvd.callbacks.BestModelCheckpoint("made_up", mode="min", filepath=path)])
    hvd.barrier()
    assert sorted(os.listdir(directory)) == ["best0.keras"]
    if RANK == 0:
        saved = keras.models.load_model(path, compile=False).get_weights()
        for mine, best in zip(saved, kept[1]):  # epoch 1's, not the last one's
            np.testing.assert_array_equal(mine, best)
        assert not np.array_equal(saved[0], kept[2][0])
    # Horovod's positional order (monitor, verbose, save_weights_only, mode): the weights alone
    weights = os.path.join(directory, f"best{RANK}.weights.h5")
    losses = iter([3.0, 1.0, 2.0])
    model.fit(x, y, batch_size=4, epochs=3, verbose=0,
              callbacks=[Loss(), hvd.callbacks.MetricAverageCallback(), Keep(),
                         hvd.callbacks.BestModelCheckpoint("made_up", 0, True, "min", filepath=weights)])
    hvd.barrier()
    assert sorted(os.listdir(directory)) == ["best0.keras", "best0.weights.h5"]
    if RANK == 0:
        model.load_weights(weights)
        for mine, best in zip(model.get_weights(), kept[1]):
            np.testing.assert_array_equal(mine, best)
    # horovod.keras's order (monitor, verbose, mode, save_freq): a string third is the mode
    other = hvd.callbacks.BestModelCheckpoint("acc", 0, "max", "epoch", filepath=path)
    mode = getattr(other, "mode", "max")  # (Keras' ModelCheckpoint keeps it from 3.15 on)
    assert (other.save_weights_only, mode, other.save_freq) == (False, "max", "epoch")
    with pytest.raises(TypeError, match="save_weights_only must be True or False; Received: int 1"):
        hvd.callbacks.BestModelCheckpoint("acc", 0, 1, filepath=path)


def _linear_model():
    model = keras.Sequential([keras.Input((1,)), layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    # d(loss)/d(w) = mean(x) = 1 on every rank, so each step moves w by exactly -lr.
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)),
                  loss=lambda y_true, y_pred: ops.mean(y_pred))
    return model


class _RecordWeight(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []
        self.logged_lr = []

    def on_train_batch_end(self, batch, logs=None):
        if hasattr(self.model, "jax_state_sync"):
            self.model.jax_state_sync()
        self.values.append(float(self.model.get_weights()[0][0, 0]))

    def on_epoch_end(self, epoch, logs=None):
        self.logged_lr.append(logs["learning_rate"])


def test_warmup_ends_at_initial_lr_with_several_steps_per_execution():
    """Keras calls on_train_batch_begin once per execution (batches 0, 2 with two steps each),
    so the warm-up's last rate was batch 2's, and training went on below initial_lr."""
    if BACKEND == "torch":
        pytest.skip("Keras refuses steps_per_execution > 1 on the torch backend")
    steps, initial_lr = 4, 0.4
    model = _linear_model()
    model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=2)
    record = _RecordWeight()
    x, y = np.ones((steps * 2, 1), "float32"), np.zeros((steps * 2, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=3, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=2), record])
    assert record.logged_lr[2] == pytest.approx(initial_lr)
    moved = record.values[-2] - record.values[-1]  # the last execution: two steps
    np.testing.assert_allclose(moved / 2, initial_lr, rtol=1e-5)


def test_a_fractional_warmup_stops_at_initial_lr():
    """warmup_epochs=1.5: the ramp went on through epoch 2 and past initial_lr (1.17x at 2 ranks)."""
    steps, initial_lr = 4, 0.4
    model = _linear_model()
    record = _RecordWeight()
    x, y = np.ones((steps * 2, 1), "float32"), np.zeros((steps * 2, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=3, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=1.5), record])
    used = -np.diff([0.0] + record.values)  # the learning rate of every step
    assert used.max() <= initial_lr * (1 + 1e-5), used
    np.testing.assert_allclose(used[-steps:], initial_lr, rtol=1e-5)  # the last epoch: initial_lr
    np.testing.assert_allclose(record.logged_lr[1:], initial_lr, rtol=1e-6)


def test_warmup_callback_learning_rates(capsys):
    steps, epochs, warmup, initial_lr = 3, 3, 2, 0.3
    model = _linear_model()
    record = _RecordWeight()
    x, y = np.ones((steps * 2, 1), "float32"), np.zeros((steps * 2, 1), "float32")
    capsys.readouterr()
    model.fit(x, y, batch_size=2, epochs=epochs, verbose=0, shuffle=False, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=warmup, verbose=1), record])
    # verbose: printed on rank 0 (as Horovod's), not logged as a warning
    done = [line for line in capsys.readouterr().out.splitlines() if "warm-up" in line]
    assert done == (["Epoch 2: finished gradual learning rate warm-up to 0.3."] if RANK == 0 else []), done
    used = -np.diff([0.0] + record.values)  # the learning rate of every step
    want = []
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch < warmup:
                e = epoch + batch / steps + 1 / steps
                want.append(initial_lr / SIZE * (e * (SIZE - 1) / warmup + 1))
            else:
                want.append(want[-1])  # after the warm-up the rate stays where it ended
    np.testing.assert_allclose(used, want, rtol=1e-5, atol=1e-6)  # float32 weights near 1
    assert want[warmup * steps - 1] == pytest.approx(initial_lr)
    np.testing.assert_allclose(record.logged_lr, [want[2], want[5], want[8]], rtol=1e-6)

    def batches():  # data of unknown length: fit() knows no steps per epoch
        for _ in range(2):
            yield x[:2], y[:2]

    # warmup_epochs=0 sets no rate, so it needs no steps per epoch (it raised "pass
    # steps_per_epoch=" for a generator) nor a rate it could set (a schedule); the optimizer's rate trains
    model = keras.Sequential([keras.Input((1,)), layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(  # (a constant 1)
        keras.optimizers.schedules.ExponentialDecay(1.0, 10, 1.0))), loss=lambda y_true, y_pred: ops.mean(y_pred))
    for model in (_linear_model(), model):
        model.fit(batches(), epochs=1, verbose=0, shuffle=False,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(None, 0)])
        np.testing.assert_allclose(model.get_weights()[0], [[-2.0]], rtol=1e-6)  # two steps at rate 1
    with pytest.raises(ValueError, match=r"LearningRateWarmupCallback: could not tell the number of batches per "
                                         r"epoch \(fit\(\) got data of unknown length.*pass steps_per_epoch="):
        _linear_model().fit(batches(), epochs=1, verbose=0, shuffle=False,
                            callbacks=[hvd.callbacks.LearningRateWarmupCallback(None, warmup_epochs=1)])


def test_schedule_callback_staircase(capsys):
    steps = 2
    model = _linear_model()
    record = _RecordWeight()
    x, y = np.ones((steps * 2, 1), "float32"), np.zeros((steps * 2, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=4, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.LearningRateScheduleCallback(0.5, lambda e: 0.1 ** e, start_epoch=1,
                                                                    end_epoch=3), record])
    used = -np.diff([0.0] + record.values)
    want = [1.0] * steps + [0.05] * steps + [0.005] * steps + [0.005] * steps
    np.testing.assert_allclose(used, want, rtol=1e-5, atol=1e-6)  # float32 weights near 1
    # verbose: the rate set at each epoch's start is printed on rank 0, as Keras' verbose callbacks
    # print (it went to INFO, which hvddp's logger hides, then to a WARNING line)
    capsys.readouterr()
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False, callbacks=[
        hvd.callbacks.LearningRateScheduleCallback(0.5, lambda e: 0.1 ** e, verbose=1)])
    seen = capsys.readouterr().out
    rates = [line for line in seen.splitlines() if "learning rate set to" in line]
    assert rates == (["Epoch 1: learning rate set to 0.5.", "Epoch 2: learning rate set to 0.05."] if RANK == 0
                     else []), seen


def test_rate_callbacks_refuse_a_schedule_or_function_rate_when_training_begins():
    """An optimizer whose learning_rate is a LearningRateSchedule or a function has no rate to set:
    the callbacks failed at the first batch, with Keras' TypeError naming no callback (a schedule)
    or "AttributeError: 'function' object has no attribute 'assign'" (a function). Now both raise
    when training begins, before any step, naming the callback (also under a LossScaleOptimizer)."""
    x, y = np.ones((4, 1), "float32"), np.zeros((4, 1), "float32")
    for rate, what in ((keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5), "a LearningRateSchedule"),
                       (lambda: 0.1, "a function")):
        for make, callback in ((lambda o: o, hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)),
                               (keras.optimizers.LossScaleOptimizer,
                                hvd.callbacks.LearningRateScheduleCallback(None, lambda e: 0.5, staircase=False))):
            model = keras.Sequential([keras.Input((1,)), layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
            model.compile(optimizer=hvd.DistributedOptimizer(make(keras.optimizers.SGD(rate))),
                          loss=lambda y_true, y_pred: ops.mean(y_pred))
            with pytest.raises(TypeError, match=rf"{type(callback).__name__} sets the optimizer's learning rate, and "
                                                rf"this optimizer's learning_rate is {what}, .*Give the optimizer a float"):
                model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[callback])
            assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 0  # before any step


@keras.saving.register_keras_serializable(package="hvddp_tests")
class RegisteredSGD(keras.optimizers.SGD):
    """A user's optimizer, registered for saving under "hvddp_tests>RegisteredSGD"."""


def test_registered_custom_optimizer_serializes_under_its_registered_name():
    wrapped = hvd.DistributedOptimizer(RegisteredSGD(0.1, name="mine"))
    config = keras.saving.serialize_keras_object(wrapped)
    assert config == keras.saving.serialize_keras_object(RegisteredSGD(0.1, name="mine")), config
    assert config["registered_name"] == "hvddp_tests>RegisteredSGD", config
    assert type(keras.saving.deserialize_keras_object(config)) is RegisteredSGD  # loads without hvddp


def test_load_model_turns_off_the_xla_a_gpu_machine_saved():
    """A model compiled with jit_compile="auto" on a machine with a GPU is saved with True
    (Keras saves the resolved value); hvd.load_model must train it without XLA. The GPU is
    simulated: TensorFlow here is the CPU build."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("jit_compile=True breaks hvddp's step on the TensorFlow backend only")
    import tensorflow as tf

    real = tf.config.list_physical_devices

    def with_a_gpu(device_type=None):
        found = list(real(device_type))
        if device_type in (None, "GPU"):
            found.append(tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU"))
        return found

    tf.config.list_physical_devices = with_a_gpu
    try:
        model = make_model(unused=False)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        assert model.jit_compile is True  # what Keras would save on a GPU machine
        path = saved_by_rank_0(model, "model.keras")
        again = hvd.load_model(path)
        assert again.jit_compile is False and hvd.is_distributed(again.optimizer)
        x, y = global_data()
        again.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
        assert_replicas_identical(again.get_weights(), "jit.reloaded")
    finally:
        tf.config.list_physical_devices = real
    hvd.barrier()


def test_save_and_reload():
    x, y = global_data()
    model = make_model(unused=False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy")
    # The optimizer serializes exactly as a plain Keras Adam.
    assert keras.saving.serialize_keras_object(model.optimizer) == \
        keras.saving.serialize_keras_object(keras.optimizers.Adam.from_config(model.optimizer.get_config()))
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, shuffle=False, verbose=0)
    path = saved_by_rank_0(model, "model.keras")
    plain = keras.models.load_model(path)  # no hvddp class in the file
    assert isinstance(plain.optimizer, keras.optimizers.Adam) and type(plain.optimizer).__name__ == "Adam"
    assert not hvd.is_distributed(plain.optimizer)
    again = hvd.load_model(path, None, None, hvd.Compression.none, False)  # Horovod's order: legacy_opts 5th
    assert hvd.is_distributed(again.optimizer) and type(again.optimizer).__name__ == "Adam"
    assert int(ops.convert_to_numpy(again.optimizer.iterations)) == STEPS
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    before = again.get_weights()
    again.fit(shard(x)[:GLOBAL_BATCH // SIZE] * (RANK + 1), shard(y)[:GLOBAL_BATCH // SIZE],
              batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    assert not np.allclose(again.get_weights()[0], before[0])
    assert_replicas_identical(again.get_weights(), "reload")  # rank-dependent data, averaged
    hvd.barrier()


@pytest.mark.parametrize("wrapping", ["by_compile", "explicit"])
def test_mixed_precision_skips_the_same_steps(wrapping):
    """One rank overflows on step 2; the reduction precedes the finite check, so all ranks skip it.

    by_compile: compile() puts its LossScaleOptimizer around the DistributedOptimizer;
    explicit: DistributedOptimizer(LossScaleOptimizer(SGD)).
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model()
        sgd = keras.optimizers.SGD(0.01)
        optimizer = first = hvd.DistributedOptimizer(sgd if wrapping == "by_compile"
                                                     else keras.optimizers.LossScaleOptimizer(sgd))
        # A small loss keeps the scaled float16 gradients finite, except where we make them overflow.
        loss = lambda y_true, y_pred: 0.01 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)  # noqa: E731
        model.compile(optimizer=optimizer, loss=loss)
        x, y = global_data()
        xs = shard(x)
        per = GLOBAL_BATCH // SIZE
        if RANK == SIZE - 1:
            xs[per:2 * per] *= 1e5  # float16 overflow in step 2 on one rank only
        model.fit(xs, shard(y), batch_size=per, epochs=1, shuffle=False, verbose=0)
        optimizer = model.optimizer
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        assert type(optimizer).__name__ == "LossScaleOptimizer" and hvd.is_distributed(optimizer)
        scale = float(ops.convert_to_numpy(optimizer.dynamic_scale))
        # Exactly one step skipped on every rank (without the fix the other ranks would wait
        # in the reduction of the step the overflowing rank skipped).
        assert scale == optimizer.initial_scale / 2
        assert int(ops.convert_to_numpy(optimizer.inner_optimizer.iterations)) == STEPS - 1
        assert_replicas_identical(model.get_weights() + [np.array([scale])], "mixed")
        # Compiled again with the same optimizer (as after unfreezing layers): a new
        # LossScaleOptimizer around it must average too (it once inherited "pass through").
        model.compile(optimizer=first, loss=loss)
        before = model.get_weights()
        model.fit(shard(x) * (RANK + 1), shard(y), batch_size=per, epochs=1, shuffle=False, verbose=0)
        assert not np.allclose(model.get_weights()[0], before[0])
        assert_replicas_identical(model.get_weights(), f"mixed.recompiled.{wrapping}")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_jit_compile():
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy", jit_compile="auto")
    if BACKEND == "tensorflow":
        assert model.jit_compile is False  # "auto" never picks XLA for an hvddp optimizer on TF
        # Where Keras' "auto" would pick XLA (a GPU is present), it still does for other models
        # but not for one with an hvddp optimizer. Only the device list is faked here.
        from unittest import mock

        import tensorflow as tf

        gpu = [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
        with mock.patch.object(tf.config, "list_physical_devices", lambda *args: gpu):
            plain = make_model(unused=False)
            plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile="auto")
            assert plain.jit_compile is True
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                          jit_compile="auto")
            assert model.jit_compile is False
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="sparse_categorical_crossentropy", jit_compile=True)
        with pytest.raises(ValueError, match="jit_compile=False"):
            model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    else:
        if BACKEND == "jax":
            assert model.jit_compile is True  # the reduction runs inside jax.jit (io_callback)
        model.fit(shard(x) * (RANK + 1), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
        assert_replicas_identical(model.get_weights(), "jit")
    if BACKEND == "torch":  # torch.compile: the step is compiled once, not again at every step
        import logging

        seen = []
        catch = logging.Handler()
        catch.emit = lambda record: seen.append(record.getMessage())
        logging.getLogger("torch._dynamo").addHandler(catch)
        try:
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                          loss="sparse_categorical_crossentropy", jit_compile=True)
            model.fit(shard(x), shard(y), batch_size=1, epochs=4, shuffle=False, verbose=0)  # > 8 steps
        finally:
            logging.getLogger("torch._dynamo").removeHandler(catch)
        assert not [m for m in seen if "recompile_limit" in m], seen
        assert_replicas_identical(model.get_weights(), "jit.compiled")


def test_scalar_weights_and_tensors_keep_their_shape():
    """0-d tensors come back 0-d on every backend, so a model with a scalar weight trains."""
    scalar = hvd.allreduce(ops.convert_to_tensor(np.float32(RANK)), name="test.scalar")
    assert tuple(scalar.shape) == ()
    np.testing.assert_allclose(ops.convert_to_numpy(scalar), (SIZE - 1) / 2)

    class Scale(layers.Layer):
        def build(self, shape):
            self.t = self.add_weight(shape=(), initializer="ones", name="temperature")

        def call(self, x):
            return x * self.t

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), layers.Dense(3), Scale()])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, _ = global_data()
    model.fit(shard(x), shard(x)[:, :3], batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    assert tuple(model.layers[-1].t.shape) == ()
    assert_replicas_identical(model.get_weights(), "scalar")


def test_helpers_on_numpy_and_tensors(monkeypatch):
    value = np.arange(4, dtype="float32") + 100 * RANK
    mean = np.arange(4) + 100 * (SIZE - 1) / 2
    from_numpy = hvd.allreduce(value, name="test.h.np")
    np.testing.assert_allclose(from_numpy, mean)
    if BACKEND == "tensorflow":  # tf.constant(value), as Horovod makes it: .numpy() works
        np.testing.assert_allclose(from_numpy.numpy(), mean)
        assert hvd.allreduce(1.5, name="test.h.float").dtype.name == "float32"
    else:
        assert isinstance(from_numpy, np.ndarray)
    tensor = ops.convert_to_tensor(value)
    out = hvd.allreduce(tensor, name="test.h.tensor", op=hvd.Sum)
    assert type(out) is type(tensor)
    np.testing.assert_allclose(ops.convert_to_numpy(out), np.arange(4) * SIZE + 100 * SIZE * (SIZE - 1) / 2)
    variable = keras.Variable(value)
    np.testing.assert_allclose(ops.convert_to_numpy(hvd.allreduce(variable, name="test.h.var")), mean)
    listed = hvd.allreduce([1.0 + RANK, 2.0], name="test.h.list")  # a backend tensor, as in Horovod
    assert type(listed) is type(tensor)
    np.testing.assert_allclose(ops.convert_to_numpy(listed), [1.0 + (SIZE - 1) / 2, 2.0])
    block = ops.convert_to_tensor(np.arange(6 * SIZE, dtype="float32").reshape(2 * SIZE, 3) + RANK)
    scattered = hvd.reducescatter(block, name="test.h.rs", op=hvd.Sum)  # rows 2R and 2R+1 of the sum
    assert type(scattered) is type(tensor)
    np.testing.assert_allclose(ops.convert_to_numpy(scattered), np.arange(6 * SIZE).reshape(2 * SIZE, 3)[
        2 * RANK:2 * RANK + 2] * SIZE + SIZE * (SIZE - 1) / 2)
    gathered = hvd.allgather(ops.reshape(tensor, (1, 4)), name="test.h.gather")
    np.testing.assert_allclose(ops.convert_to_numpy(gathered)[:, 0], 100 * np.arange(SIZE))
    np.testing.assert_allclose(ops.convert_to_numpy(hvd.broadcast(tensor, 0, name="test.h.bcast")),
                               np.arange(4))
    if BACKEND == "torch":  # differentiable, as on TensorFlow (the result was detached, silently)
        import torch

        for compression in (hvd.Compression.none, hvd.Compression.fp16):
            w = torch.full((3,), 1.0 + RANK, requires_grad=True)
            (hvd.allreduce(w * w, name="test.h.grad", compression=compression) * (RANK + 1)).sum().backward()
            # the upstream gradients (RANK + 1) averaged, times d(w * w)/dw
            np.testing.assert_allclose(w.grad.numpy(), np.full(3, 2.0 * (1 + RANK) * (SIZE + 1) / 2))
        # allgather, broadcast and reducescatter too (they detached it: no gradient, silently)
        upstream = (SIZE + 1) / 2  # the ranks' (RANK + 1) averaged
        w = torch.full((1, 2), 1.0 + RANK, requires_grad=True)
        ((RANK + 1) * hvd.allgather(w, name="test.h.grad.gather")).sum().backward()
        np.testing.assert_allclose(w.grad.numpy(), np.full((1, 2), upstream))
        w = torch.full((2,), 1.0 + RANK, requires_grad=True)
        ((RANK + 1) * hvd.broadcast(w, 0, name="test.h.grad.bcast")).sum().backward()
        np.testing.assert_allclose(w.grad.numpy(), np.full(2, upstream if RANK == 0 else 0.0))
        w = torch.ones((SIZE, 2), requires_grad=True)
        ((RANK + 1) * hvd.reducescatter(w, name="test.h.grad.rs", op=hvd.Sum)).sum().backward()
        # (Horovod's gradient: every rank's upstream rows gathered, times the set's size for Sum)
        np.testing.assert_allclose(w.grad.numpy(), np.repeat(np.arange(1.0, SIZE + 1) * SIZE, 2).reshape(SIZE, 2))
    if BACKEND == "jax":  # a concrete array a jitted function closes over: reduced on every call,
        # not once while tracing (only a tracer input used to send the call through io_callback)
        import hvddp
        import jax

        calls, real = [], hvddp.allreduce
        monkeypatch.setattr(hvddp, "allreduce", lambda *a, **k: calls.append(1) or real(*a, **k))
        closed = jax.numpy.full((2,), float(RANK))
        jitted = jax.jit(lambda t: t + hvd.allreduce(closed, name="test.h.closed", op=hvd.Sum))
        for _ in range(3):
            np.testing.assert_allclose(np.asarray(jitted(tensor[:2])), np.arange(2) + 100 * RANK + SIZE * (SIZE - 1) / 2)
        assert len(calls) == 3, calls
    if BACKEND == "jax":  # not differentiable there: said plainly
        import jax

        with pytest.raises(ValueError, match="not differentiable on the JAX backend"):
            jax.grad(lambda t: hvd.allreduce(t * t, name="test.h.grad").sum())(tensor)
    if BACKEND != "tensorflow" and SIZE > 1:  # hvddp's own error types, eager JAX arrays too (they
        # went through io_callback, which wrapped them in JAX's JaxRuntimeError)
        with pytest.raises(hvd.MismatchError, match="shape differs across ranks"):
            hvd.allreduce(ops.ones((2 + RANK,)), name="test.h.shapes")
        with pytest.raises(ValueError, match="root_rank"):
            hvd.broadcast(tensor, SIZE, name="test.h.root")
    if BACKEND == "jax":
        import jax

        jitted = jax.jit(lambda t: hvd.allreduce(t, name="test.h.jit") * 2)
        np.testing.assert_allclose(np.asarray(jitted(tensor)), mean * 2)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        fn = tf.function(lambda t: hvd.allreduce(t, name="test.h.tf") * 2)
        np.testing.assert_allclose(fn(tensor).numpy(), mean * 2)
    with pytest.raises(RuntimeError, match=r"broadcast_variables\(model.variables, root_rank=0\)"):
        hvd.broadcast_global_variables(0)  # as Horovod under TF 2: no global variables to broadcast


def test_mismatched_models_raise_on_every_rank():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    model = make_model(units=8 if RANK == 0 else 9)  # a different model on the other ranks
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    x, y = global_data()
    with pytest.raises(Exception, match="differ across ranks"):
        model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    # the failure leaves nothing behind: a model built the same everywhere trains right after
    # (on JAX with a GPU, the failed callback's error once stuck to every later step)
    model = make_model(seed=RANK)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_replicas_identical(model.get_weights(), "after a mismatch")


def test_same_model_with_different_layer_numbering_trains_together():
    """Keras numbers layers per process: rank 0 builds one layer more first, so its model's
    paths read dense_1/... where the others read dense/.... The broadcast and the gradient
    groups do not depend on paths: training works and the replicas end identical."""
    if RANK == 0:
        layers.Dense(2)  # takes the name "dense" on rank 0 only
    model = make_model(seed=RANK)  # different initial weights: the broadcast must equalise them
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    x, y = global_data()
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_replicas_identical(model.get_weights(), "numbering")


def test_lists_that_diverge_after_good_steps_raise_on_every_rank():
    """A rank that freezes a layer after training together has fewer gradients: every rank
    raises MismatchError naming the difference (no per-process check that only some repeat),
    as itself on every backend (JAX's compiled step wrapped it in a JaxRuntimeError, and a
    TensorFlow graph in tf.errors.UnknownError, which `except hvd.HorovodInternalError` missed)."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    model = make_model(unused=False)
    x, y = global_data()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    if RANK == SIZE - 1:
        model.layers[0].trainable = False
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    with pytest.raises(hvd.MismatchError, match="different numbers of tensors") as raised:
        model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    assert isinstance(raised.value, hvd.HorovodInternalError)  # what the README says to catch
    assert hvd.allgather_object("after") == ["after"] * SIZE  # and the engine goes on


def test_unfreezing_without_compiling_again_names_the_fix():
    """Keras' fine-tuning guide compiles again after a layer's `trainable` changes. On JAX a fit
    without it hands the optimizer more gradients than the variables it was built with, and the
    error said only "pass one gradient per trainable variable" (one process's Keras says what
    changed); now it names the fix, on every rank. Elsewhere every rank does what one process
    does, alike: TensorFlow reuses its traced step and trains the old variables, torch's Keras
    raises its own "Unknown variable"."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    model = make_model(unused=False)
    model.layers[0].trainable = False
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    x, y = global_data()
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
    model.layers[0].trainable = True
    if BACKEND == "jax":
        with pytest.raises(ValueError, match="got 4 gradients for the 2 variables.*compile the model again "
                                             "with a new DistributedOptimizer"):
            model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
        assert hvd.allgather_object("after") == ["after"] * SIZE
        return
    try:
        model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0)
        outcome = "trained"
    except Exception as exc:  # (the same on every rank, or the ranks part)
        outcome = type(exc).__name__
    assert hvd.allgather_object(outcome) == [outcome] * SIZE
    if outcome == "trained":
        assert_replicas_identical(model.get_weights(), "unfrozen.without.compile")


def test_a_users_own_error_in_fit_is_not_replaced_by_an_hvddp_error_it_caught():
    """fit re-raises an hvddp error the compiled step wrapped (above); one the user's callback
    caught and handled earlier in the same fit must not take the place of the user's own later
    error (it did, on TensorFlow, where even eager calls are noted)."""
    if SIZE == 1:
        pytest.skip("needs two ranks")

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            try:  # rank 0 refuses integer Adasum: every rank raises, and the callback goes on
                hvd.allreduce(ops.ones((2,), dtype="int32" if RANK == 0 else "float32"), op=hvd.Adasum,
                              name="probe")
            except (ValueError, hvd.HvddpError):
                pass

        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("the user's own error")

    model = make_model(unused=False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy")
    x, y = global_data()
    with pytest.raises(RuntimeError, match="the user's own error"):
        model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0, callbacks=[Probe()])
    assert hvd.allgather_object("after") == ["after"] * SIZE


def test_reloaded_model_sums_accumulated_passes_as_before():
    """backward_passes_per_step=2 is saved as Keras' gradient_accumulation_steps; load_model
    must sum the passes again (Horovod's rule), so the reloaded model steps as the original."""
    per = GLOBAL_BATCH // SIZE
    rng = np.random.default_rng(10 + RANK)  # four batches of this rank's own data
    x = rng.normal(size=(4 * per, 5)).astype("float32")
    y = rng.integers(0, 3, size=(4 * per,)).astype("int32")
    model = make_model(unused=False)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2),
                  loss="sparse_categorical_crossentropy")
    model.fit(x[:2 * per], y[:2 * per], batch_size=per, shuffle=False, verbose=0)
    path = saved_by_rank_0(model, "bpps.keras")
    again = hvd.load_model(path)
    before = model.get_weights()
    for m in (model, again):
        m.fit(x[2 * per:], y[2 * per:], batch_size=per, shuffle=False, verbose=0)
    assert not np.allclose(model.get_weights()[0], before[0])  # the two passes made one update
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    hvd.barrier()


@pytest.mark.parametrize("kind", ["adamw", "sgd_decay"])
def test_weight_no_rank_has_a_gradient_for_is_left_alone(kind):
    """The Unused layer's weight has no gradient on any rank: as in one process, weight decay
    (and momentum) must not touch it, while the used weights match one process as usual."""
    make = {"adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
            "sgd_decay": lambda: keras.optimizers.SGD(0.1, momentum=0.5, weight_decay=0.5)}[kind]
    x, y = global_data()
    ref = make_model()
    ref.compile(optimizer=make(), loss="sparse_categorical_crossentropy")
    ref.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(make()), loss="sparse_categorical_crossentropy")
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, shuffle=False, verbose=0)
    unused = ops.convert_to_numpy(model.layers[1].unused)
    np.testing.assert_array_equal(unused, ops.convert_to_numpy(ref.layers[1].unused))
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert_replicas_identical(model.get_weights(), f"decay.{kind}")


def test_gradient_only_some_ranks_have_is_averaged_with_zeros():
    """Eagerly (torch; TensorFlow with run_eagerly) a gradient that exists on some ranks only is
    averaged with zeros from the others and applied on every rank alike."""
    if SIZE == 1 or BACKEND == "jax":
        pytest.skip("needs two ranks and a backend with None gradients")
    model = make_model(unused=False)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.build(model.trainable_variables)
    grads = [ops.ones(v.shape) if RANK == 0 or i > 0 else None
             for i, v in enumerate(model.trainable_variables)]
    before = [ops.convert_to_numpy(v) for v in model.trainable_variables]
    opt.apply(grads, model.trainable_variables)
    after = [ops.convert_to_numpy(v) for v in model.trainable_variables]
    np.testing.assert_allclose(after[0], before[0] - 1.0 / SIZE, rtol=1e-6)  # rank 0's only
    np.testing.assert_allclose(after[1], before[1] - 1.0, rtol=1e-6)
    assert_replicas_identical(after, "partial")


def test_rank_dependent_none_inside_tf_function_raises_on_every_rank():
    """In a tf.function the None gradients are fixed when the step is traced; a gradient that
    only some ranks' graphs have cannot be dropped on some ranks only, so every rank raises."""
    if SIZE == 1 or BACKEND != "tensorflow":
        pytest.skip("needs two ranks and the tensorflow backend")
    import tensorflow as tf

    a, b = keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones(3, "float32"))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    opt.build([a, b])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * 2.0) + (tf.reduce_sum(b) if RANK == 0 else 0.0)
        opt.apply(tape.gradient(loss, [a, b]), [a, b])

    with pytest.raises(tf.errors.InvalidArgumentError, match="every rank must compute the same gradients"):
        step()
    assert hvd.allgather_object("after") == ["after"] * SIZE


@pytest.mark.parametrize("scale", [True, False])
def test_registered_local_variables_keep_this_ranks_gradients(scale):
    """Horovod's register_local_var: the last layer's gradients are not reduced (divided by the
    size with scale_local_gradients=True); the others are averaged as usual. One SGD step on
    this rank's rows, compared with the same step taken without hvddp."""
    x, y = global_data()
    xs, ys = shard(x)[:GLOBAL_BATCH // SIZE], shard(y)[:GLOBAL_BATCH // SIZE]
    own = make_model(unused=False)
    start = own.get_weights()
    own.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    own.fit(xs, ys, batch_size=len(xs), shuffle=False, verbose=0)
    own_step = [b - a for a, b in zip(own.get_weights(), start)]
    model = make_model(unused=False)
    if scale:  # Horovod's two spellings: a list of layers, or variables one by one
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.5), local_layers=model.layers[-1])
    else:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), scale_local_gradients=False)
        for v in model.layers[-1].trainable_weights:
            opt.register_local_var(v)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(xs, ys, batch_size=len(xs), shuffle=False, verbose=0)
    step = [b - a for a, b in zip(model.get_weights(), start)]
    local = len(model.get_weights()) - len(model.layers[-1].get_weights())
    for i, (got, mine) in enumerate(zip(step, own_step)):
        every = ops.convert_to_numpy(hvd.allgather(mine[None], name=f"test.local.{scale}.{i}"))
        if i >= local:
            want = mine / SIZE if scale else mine
            if SIZE > 1:  # rank-dependent rows: a reduced gradient would not pass
                assert not np.allclose(every[0], every[1])
        else:
            want = every.mean(axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")


def test_a_value_refused_on_one_rank_fails_on_every_rank():
    """hvddp.keras's own checks (Adasum on integers or with reducescatter, a 0-d value to
    allgather or reducescatter) refuse a call on rank 0 alone: it raises at once, and the other
    ranks raise an error naming rank 0 and the reason instead of waiting (a MismatchError;
    TensorFlow re-raises its ops' as its own errors, with the message). Unnamed calls of each
    kind after them still meet."""
    bad = RANK == 0
    calls = [("reducescatter", lambda: hvd.reducescatter(ops.ones(()) if bad else ops.ones((2 * SIZE,)))),
             ("reducescatter", lambda: hvd.reducescatter(ops.ones((2 * SIZE,)), op=hvd.Adasum if bad else None)),
             ("allgather", lambda: hvd.allgather(ops.ones(()) if bad else ops.ones((1,))))]
    if SIZE & (SIZE - 1) == 0:  # (else every rank refuses Adasum for the set's size)
        calls.append(("allreduce", lambda: hvd.allreduce(ops.ones((2,), dtype="int32" if bad else "float32"),
                                                         op=hvd.Adasum)))
    for fn, call in calls:
        if bad:
            with pytest.raises(ValueError, match=rf"^{fn}: "):
                call()
        else:
            with pytest.raises(hvd.MismatchError if BACKEND != "tensorflow" else Exception,
                               match=rf"refused on rank\(s\) \[0\] \(ValueError: {fn}: "):
                call()
    mine = ops.convert_to_tensor(np.full((SIZE,), float(RANK), "float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(hvd.allreduce(mine)), np.full(SIZE, (SIZE - 1) / 2))
    np.testing.assert_allclose(ops.convert_to_numpy(hvd.reducescatter(mine)), [(SIZE - 1) / 2])
    np.testing.assert_allclose(ops.convert_to_numpy(hvd.allgather(mine[:1])), np.arange(SIZE))


def test_a_bad_compression_on_one_rank_fails_on_every_rank():
    """compression="fp16" (a string) on rank 0: on JAX and torch it failed there alone with an
    AttributeError when used, and the others waited in the allreduce."""
    values = [("numpy", lambda: np.ones(2, "float32")), ("tensor", lambda: ops.ones((2,)))]
    for what, value in values:
        if RANK == 0:
            with pytest.raises(TypeError, match=r"allreduce: compression must be hvddp.Compression.none"):
                hvd.allreduce(value(), compression="fp16", name=f"bad.compression.{what}")
        else:
            with pytest.raises(hvd.MismatchError if BACKEND != "tensorflow" or what == "numpy" else Exception,
                               match=r"refused on rank\(s\) \[0\] \(TypeError: allreduce: compression"):
                hvd.allreduce(value(), compression=hvd.Compression.none, name=f"bad.compression.{what}")
    if BACKEND == "torch":  # a tensor autograd records goes through hvddp.torch: its compressions only
        import torch

        x = torch.ones(2, requires_grad=True)
        if RANK == 0:
            with pytest.raises(ValueError, match=r"a torch tensor autograd records takes"):
                hvd.allreduce(x, compression=object(), name="bad.compression.grad")
        else:
            with pytest.raises(hvd.MismatchError, match=r"refused on rank\(s\) \[0\]"):
                hvd.allreduce(x, name="bad.compression.grad")
    np.testing.assert_allclose(hvd.allreduce(np.ones(2, "float32"), name="bad.compression.after"), 1.0)


def test_a_ragged_allgather_inside_jax_jit_names_the_rule():
    """First dimensions that differ by rank inside jax.jit (static shapes) ended in JAX's own
    "Incorrect output shape" error, naming neither the call nor the rule."""
    if BACKEND != "jax" or SIZE == 1:
        pytest.skip("jax.jit, on two ranks or more")
    import jax

    with pytest.raises(Exception, match=r"allgather ragged: inside jax.jit every rank must pass the same first"):
        jax.jit(lambda v: hvd.allgather(v, name="ragged"))(ops.ones((RANK + 1, 2)))  # (at 3 ranks,
        # rank 1's 2 x 3 rows equal the total: it returned while the others raised)
    out = jax.jit(lambda v: hvd.allgather(v, name="even"))(ops.ones((2, 2)) * RANK)
    np.testing.assert_array_equal(np.asarray(out)[:, 0], np.repeat(np.arange(SIZE), 2))
    assert hvd.allgather(np.ones((RANK + 1, 2)), name="ragged.eager").shape == (SIZE * (SIZE + 1) // 2, 2)


def test_rank_outside_the_process_set_sums_accumulated_passes():
    """A rank outside the optimizer's process set applies its own gradients; with
    backward_passes_per_step=2 the passes are summed there too (on torch, scaling a gradient
    once mistook the tensor for a tf.IndexedSlices)."""
    members = hvd.add_process_set([0])
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                       process_set=members)
        u = keras.Variable(np.zeros(2, "float32"))
        for _ in range(2):
            opt.apply_gradients([(ops.convert_to_tensor(np.array([1.0, RANK], "float32")), u)])
        np.testing.assert_allclose(ops.convert_to_numpy(u), [-2.0, -2.0 * RANK])
    finally:
        hvd.remove_process_set(members)


def test_broadcast_callback_leaves_local_variables_alone():
    """Horovod's local_variables: the last layer keeps each rank's own initial values, the rest
    become rank 0's."""
    model = make_model(seed=RANK, unused=False)
    before = [ops.convert_to_numpy(w) for w in model.layers[-1].weights]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                  loss="sparse_categorical_crossentropy")
    x, y = global_data()
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=model.layers[-1].weights)
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, verbose=0, callbacks=[callback])
    assert_replicas_identical(model.layers[0].get_weights(), "bcast.shared")
    for got, mine in zip(model.layers[-1].get_weights(), before):
        np.testing.assert_array_equal(got, mine)  # lr 0: nothing else changed them
    if SIZE > 1:
        every = ops.convert_to_numpy(hvd.allgather(before[0][None], name="test.bcast.local"))
        assert not np.array_equal(every[0], every[1])  # the seeds differ, so a broadcast would show
    with pytest.raises(ValueError, match="local variables must be variables; Received: str"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["kernel"])


def test_local_gradient_overflow_on_one_rank_skips_the_step_everywhere():
    """Under mixed_float16 the loss-scale finite check must agree across ranks, also when only
    one rank's local (unreduced) gradient overflows: every rank skips and halves its scale."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
        out = layers.Add()([layers.Dense(2, name="local")(a), layers.Dense(2, name="shared")(b)])
        model = keras.Model([a, b], layers.Activation("linear", dtype="float32")(out))
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.01), local_layers=model.get_layer("local"))
        # logits: a saturated softmax would give a zero gradient, and nothing would overflow
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        xa = np.full((4, 3), 1000.0 if RANK == SIZE - 1 else 0.1, "float32")  # overflows float16 there
        xb = np.full((4, 3), 0.1, "float32")
        y = np.array([0, 1, 0, 1], "int32")
        start = model.get_layer("shared").get_weights()[0].copy()
        model.fit([xa, xb], y, batch_size=4, shuffle=False, verbose=0)
        shared = model.get_layer("shared").get_weights()[0]
        scale = float(ops.convert_to_numpy(model.optimizer.dynamic_scale))
        assert_replicas_identical([shared, np.array([scale])], "local.overflow")
        if SIZE > 1:  # one rank overflowed: skipped everywhere, the scale halved everywhere
            assert scale == 16384.0 and np.array_equal(shared, start), (scale, shared - start)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.np3
def test_outside_the_set_local_gradients_are_divided_too():
    """Horovod divides the local gradients by the set's size on every rank, members or not."""
    if SIZE < 3:
        pytest.skip("needs a rank outside a set of two")
    members = hvd.add_process_set([0, 1])
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=members)
        v = keras.Variable(np.zeros(2, "float32"))
        opt.register_local_var(v)
        opt.apply_gradients([(ops.convert_to_tensor(np.ones(2, "float32")), v)])
        np.testing.assert_allclose(ops.convert_to_numpy(v), [-0.5, -0.5])
    finally:
        hvd.remove_process_set(members)


def test_local_gradient_none_on_some_ranks_under_loss_scaling():
    """The finite-check member is sent whether or not this rank has local gradients: a local
    variable unused on some ranks (a None gradient there) must not make the group lists differ."""
    if BACKEND == "jax":
        pytest.skip("Keras' LossScaleOptimizer.apply raises UnexpectedTracerError eagerly on JAX, without hvddp too")
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    s = keras.Variable(np.zeros(2, "float32"))
    v = keras.Variable(np.zeros(2, "float32"))
    opt.register_local_var(v)
    opt.build([s, v])
    scale = float(ops.convert_to_numpy(opt.scale_loss(1.0)))
    gv = None if RANK == 0 else ops.convert_to_tensor(np.full(2, scale, "float32"))
    opt.apply([ops.convert_to_tensor(np.full(2, scale * (RANK + 1), "float32")), gv], [s, v])
    np.testing.assert_allclose(ops.convert_to_numpy(s), np.full(2, -0.1 * np.mean(np.arange(SIZE) + 1)),
                               rtol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(v), np.zeros(2) if RANK == 0 else np.full(2, -0.1 / SIZE),
                               rtol=1e-6)


# Adasum ---------------------------------------------------------------------------------------
from adasum_reference import adasum_reference  # noqa: E402

POWER_OF_TWO = SIZE & (SIZE - 1) == 0


def rank_input(rank, shape, seed):
    """A part common to every rank plus one of the rank's own: partly aligned across ranks."""
    common = np.random.default_rng(seed).normal(size=shape)
    return (common + np.random.default_rng(seed + 1 + rank).normal(size=shape)).astype("float32")


@pytest.mark.np3
def test_adasum_allreduce_helper():
    """hvd.allreduce(op=Adasum) on numpy values and backend tensors is the Adasum tree; other
    collectives refuse Adasum; at np=3 every rank refuses it (no power of two), nothing hangs."""
    if not POWER_OF_TWO:
        for value in (np.ones(2, "float32"), ops.ones((2,))):
            with pytest.raises(ValueError, match="op=Adasum needs a process set whose size is a power of two"):
                hvd.allreduce(value, op=hvd.Adasum, name="test.adasum.np3")
        assert hvd.allgather_object(RANK, name="test.adasum.after") == list(range(SIZE))
        return
    want = adasum_reference([rank_input(r, (4, 3), 0) for r in range(SIZE)])
    got_np = hvd.allreduce(rank_input(RANK, (4, 3), 0), op=hvd.Adasum, name="test.adasum.np")
    got_t = hvd.allreduce(ops.convert_to_tensor(rank_input(RANK, (4, 3), 0)), op=hvd.Adasum, name="test.adasum.t")
    np.testing.assert_allclose(np.asarray(got_np), want, rtol=1e-6)
    np.testing.assert_array_equal(ops.convert_to_numpy(got_t), np.asarray(got_np))
    assert np.abs(want - np.mean([rank_input(r, (4, 3), 0) for r in range(SIZE)], axis=0)).max() > 0.1
    with pytest.raises(ValueError, match="op=Adasum applies to allreduce, grouped_allreduce"):
        hvd.reducescatter(np.ones((2 * SIZE,), "float32"), op=hvd.Adasum)
    # accumulated passes: each rank sums its own, and the sums are combined once (Horovod's)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum, backward_passes_per_step=2)
    w = keras.Variable(np.zeros((4, 3), "float32"))
    for seed in (10, 20):
        opt.apply([ops.convert_to_tensor(rank_input(RANK, (4, 3), seed))], [w])
    sums = [rank_input(r, (4, 3), 10) + rank_input(r, (4, 3), 20) for r in range(SIZE)]
    np.testing.assert_allclose(ops.convert_to_numpy(w), -adasum_reference(sums), rtol=1e-5, atol=1e-6)
    if BACKEND == "jax":  # Keras' LossScaleOptimizer.apply fails eagerly on JAX, without hvddp too
        return
    # where every pass is reduced on its own (under loss scaling), Adasum with passes is refused
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)), op=hvd.Adasum, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="op=Adasum with 2 passes per step combines"):
        opt.apply([ops.ones((4, 3))], [w])
    # under loss scaling with a local variable (the finite flag and the presence flags are summed
    # beside the Adasum group): the shared gradient is the Adasum of the unscaled ones
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), op=hvd.Adasum)
    s, v = keras.Variable(np.zeros(5, "float32")), keras.Variable(np.zeros(2, "float32"))
    opt.register_local_var(v)
    opt.build([s, v])
    scale = float(ops.convert_to_numpy(opt.scale_loss(1.0)))
    opt.apply([ops.convert_to_tensor(rank_input(RANK, (5,), 70) * scale),
               ops.convert_to_tensor(np.full(2, scale * (RANK + 1), "float32"))], [s, v])
    want = -0.1 * adasum_reference([rank_input(r, (5,), 70) for r in range(SIZE)])
    np.testing.assert_allclose(ops.convert_to_numpy(s), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ops.convert_to_numpy(v), np.full(2, -0.1 * (RANK + 1) / SIZE), rtol=1e-6)
    assert_replicas_identical([ops.convert_to_numpy(s)], "adasum.loss_scale")


@pytest.mark.np3
@pytest.mark.parametrize("local", [False, True], ids=["shared", "local_layer"])
def test_adasum_fit_step_is_the_adasum_of_the_gradients(local):
    """model.fit with DistributedOptimizer(SGD, op=Adasum): one step moves every weight by the
    learning rate times the Adasum tree of the ranks' own gradients (each rank's own SGD step,
    taken without hvddp, gives its gradient); the inputs make the ranks' gradients partly aligned,
    so that differs clearly from the average. With a local last layer (PartialDistributedOptimizer)
    that layer moves by this rank's own gradient / size. At np=3 every rank refuses op=Adasum."""
    make_opt = (lambda m: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum,
                                                          local_layers=m.layers[-1])) if local else \
        (lambda m: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum))
    model = make_model(units=4)  # with the unused weight: its gradient is None on TF/torch
    if not POWER_OF_TWO:
        with pytest.raises(ValueError, match="op=Adasum needs a process set whose size is a power of two"):
            make_opt(model)
        assert hvd.allgather_object(RANK, name=f"test.adasum.fit.{local}") == list(range(SIZE))
        return
    x = rank_input(RANK, (6, 5), 50)
    y = rank_input(RANK, (6, 3), 60) + 2.0
    initial = model.get_weights()
    own = make_model(units=4)
    own.set_weights(initial)
    own.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    own.fit(x, y, batch_size=len(x), shuffle=False, verbose=0)
    own_step = [a - b for a, b in zip(initial, own.get_weights())]
    model.compile(optimizer=make_opt(model), loss="mse")
    model.fit(x, y, batch_size=len(x), shuffle=False, verbose=0)
    got = model.get_weights()
    first_local = len(got) - len(model.layers[-1].get_weights()) if local else len(got)
    for i, (w, start, mine) in enumerate(zip(got, initial, own_step)):
        every = np.asarray(hvd.allgather(mine[None], name=f"test.adasum.fit.{local}.{i}"))
        if i >= first_local:
            np.testing.assert_allclose(w, start - mine / SIZE, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")
            continue
        want = adasum_reference(list(every))
        np.testing.assert_allclose(w, start - want, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")
        if i == 0:  # the first kernel: clearly not the average step
            mean = every.astype(np.float64).mean(axis=0)
            assert np.abs(want - mean).max() > 0.2 * np.abs(mean).max(), (want, mean)
    np.testing.assert_array_equal(got[2], np.ones(3))  # the unused weight: skipped
    assert_replicas_identical(got[:first_local], f"adasum.fit.{local}")


@pytest.mark.parametrize("passes", [1, 2])
def test_float8_scales_are_the_maximum_not_averaged_or_scaled(passes):
    """float8 training's scales and amax histories get their next value as a "gradient"
    (overwrite_with_gradient). They are the maximum over ranks (one process's value on the whole
    batch), not an average; and not multiplied by the passes, which made them drift by 2x per
    update. Forward scales match one process; gradient scales follow each rank's own gradients
    (its loss is its shard's mean, size times one process's), and replicas stay identical."""
    x, y = global_data()

    def build():
        model = make_model(unused=False)
        model.quantize("float8")
        return model

    lr = 0.01 if passes == 1 else 0.0  # (summed passes move the weights apart from Keras' averaged)
    model = build()
    initial = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=passes),
                  loss="sparse_categorical_crossentropy")
    model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, epochs=1, shuffle=False, verbose=0)
    reference = build()
    reference.set_weights(initial)
    extra = {"gradient_accumulation_steps": passes} if passes > 1 else {}
    reference.compile(optimizer=keras.optimizers.SGD(lr, **extra), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    checked = 0
    for got, want in zip(model.variables, reference.variables):
        if "scale" in got.name and "grad" not in got.name:  # inputs_scale, kernel_scale
            np.testing.assert_allclose(ops.convert_to_numpy(got), ops.convert_to_numpy(want), rtol=1e-5,
                                       err_msg=got.path)
            checked += 1
    assert checked >= 4
    assert_replicas_identical(model.get_weights(), f"float8.{passes}")


def test_a_deep_copy_reduces_as_the_original():
    """copy.deepcopy of a wrapped optimizer keeps its hvddp settings and state (Keras copies an
    optimizer through its saved form, which names the wrapped class: the copy was a plain SGD,
    and replicas trained with it parted silently). A pickle is refused, saying what to do."""
    import copy
    import pickle

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0, momentum=0.5), op=hvd.Sum,
                                   compression=hvd.Compression.fp16)
    v = keras.Variable(np.zeros(2, "float32"))
    opt.apply([ops.convert_to_tensor(np.full(2, RANK + 1.0, "float32"))], [v])  # momentum is now -sum
    twin = copy.deepcopy(opt)
    assert hvd.is_distributed(twin) and type(twin) is type(opt)
    assert {k: twin._hvddp[k] for k in ("op", "compression")} == {"op": hvd.Sum, "compression": hvd.Compression.fp16}
    for mine, theirs in zip(twin.variables, opt.variables):
        np.testing.assert_array_equal(ops.convert_to_numpy(mine), ops.convert_to_numpy(theirs))
    total = SIZE * (SIZE + 1) / 2
    twin.apply([ops.convert_to_tensor(np.full(2, RANK + 1.0, "float32"))], [v])  # summed, with momentum
    np.testing.assert_allclose(ops.convert_to_numpy(v), np.full(2, -total - (0.5 * total + total)))
    # the inner optimizer of a LossScaleOptimizer leaves the reduction to the outer one; its copy
    # stands alone, so it reduces itself
    scaled = keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)))
    scaled.build([v])  # (as compile under mixed_float16: the reduction moves to the outer one)
    assert scaled.inner_optimizer._hvddp["passthrough"]
    inner = copy.deepcopy(scaled.inner_optimizer)
    assert hvd.is_distributed(inner) and not inner._hvddp["passthrough"]
    with pytest.raises(TypeError, match="cannot be pickled.*model.save"):
        pickle.dumps(opt)


def test_exclude_from_weight_decay_survives_wrapping():
    """get_config leaves out exclude_from_weight_decay: the wrapper's AdamW decayed the biases."""
    model = make_model(unused=False)
    start = [w if w.ndim > 1 else np.ones_like(w) for w in model.get_weights()]  # biases not 0
    model.set_weights(start)
    plain = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    plain.exclude_from_weight_decay(var_names=["bias"])
    opt = hvd.DistributedOptimizer(plain)
    x, y = global_data()
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)  # the same rows everywhere
    reference = make_model(unused=False)
    reference.set_weights(start)
    ref_opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    ref_opt.exclude_from_weight_decay(var_names=["bias"])
    reference.compile(optimizer=ref_opt, loss="sparse_categorical_crossentropy")
    reference.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _UnsavableSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Neither registered nor with a get_config: plain training never serializes it."""

    def __call__(self, step):
        return 0.1 / (1.0 + ops.cast(step, "float32"))


def _half_lr():
    return 0.05


def test_wrapping_keeps_what_keras_would_not_serialize():
    """The wrapper is made from the optimizer's config: a schedule without get_config, a
    learning-rate function or lambda, a MultiOptimizer's selector function failed to wrap (Keras
    looked them up again); a MultiOptimizer's AdamW lost its exclude_from_weight_decay and
    decayed the biases. Each trains as one process does."""
    def adamw_without_bias_decay():
        opt = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt

    cases = {
        "schedule": lambda: keras.optimizers.SGD(_UnsavableSchedule()),
        "function": lambda: keras.optimizers.SGD(_half_lr, momentum=0.5),
        "lambda": lambda: keras.optimizers.Adam(lambda: 0.01),
    }
    multi = {
        "selector": lambda: keras.optimizers.MultiOptimizer(
            (lambda sgd: lambda variable: sgd)(keras.optimizers.SGD(0.1))),
        "multi_adamw": lambda: keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(default_optimizer=adamw_without_bias_decay())),
        "one_adamw_twice": lambda: (lambda adamw: keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.1), {".*dense.*/kernel": adamw, ".*dense.*/bias": adamw})))(
            adamw_without_bias_decay()),
    }
    if HAS_MULTI_OPTIMIZER:
        cases.update(multi)
    x, y = global_data()
    for case, make_opt in cases.items():
        model = make_model(unused=False)
        start = [w if w.ndim > 1 else np.ones_like(w) for w in model.get_weights()]  # biases not 0
        model.set_weights(start)
        # (eagerly on TensorFlow: what is kept does not depend on the mode, and traced, the twelve
        # fits took 35 s there, eagerly 24 s, on a loaded machine; on JAX eagerly was slower)
        eager = keras.backend.backend() == "tensorflow"
        model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="sparse_categorical_crossentropy",
                      run_eagerly=eager)
        model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, shuffle=False, verbose=0)
        reference = make_model(unused=False)
        reference.set_weights(start)
        reference.compile(optimizer=make_opt(), loss="sparse_categorical_crossentropy", run_eagerly=eager)
        reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=case)
        assert_replicas_identical(model.get_weights(), f"kept.{case}")


def test_local_variables_refuse_global_clipnorm():
    """global_clipnorm would take each rank's own local gradients into the norm, so each rank
    clipped the averaged gradients differently and the shared weights drifted (2e-3 in an epoch)."""
    model = make_model(unused=False)
    with pytest.raises(ValueError, match="global_clipnorm=0.5 with local variables.*Use clipnorm"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1, global_clipnorm=0.5),
                                        local_layers=model.layers[-1])
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=model.layers[-1])
    opt.global_clipnorm = 0.5  # set afterwards: refused at the step
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    x, y = global_data()
    with pytest.raises(ValueError, match="global_clipnorm=0.5 with local variables"):
        model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, verbose=0)
    with pytest.raises(ValueError, match="not their names.*Received: str 'dense'"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers="dense")
    with pytest.raises(ValueError, match=r"local layers \['late'\] are not built"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=layers.Dense(2, name="late"))


def test_callbacks_on_a_set_leave_ranks_outside_it_alone():
    """The optimizer trains a rank outside its process set on its own gradients; the callbacks
    given that set do nothing there (they raised 'not a member' on that rank only)."""
    members = hvd.add_process_set([0])
    try:
        model = make_model(seed=RANK, unused=False)
        start = model.get_weights()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), process_set=members),
                      loss="sparse_categorical_crossentropy")
        x, y = global_data()
        history = model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, verbose=0, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0, process_set=members),
            hvd.callbacks.MetricAverageCallback(process_set=members)])
        for got, mine in zip(model.get_weights(), start):  # a one-rank set: nothing to copy from
            np.testing.assert_array_equal(got, mine)
        assert np.isfinite(history.history["loss"][0])
    finally:
        hvd.remove_process_set(members)
    with pytest.raises(TypeError, match="multiplier must be a number or a function.*None"):
        hvd.callbacks.LearningRateScheduleCallback(0.1, None)
    with pytest.raises(TypeError, match="initial_lr must be a number"):
        hvd.callbacks.LearningRateScheduleCallback("0.1", 1.0)
    with pytest.raises(ValueError, match="warmup_epochs must be a number of epochs >= 0.*-1"):
        hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=-1)
    hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0)  # no warm-up, as in Horovod
    hvd.callbacks.LearningRateScheduleCallback(0.1, np.array(0.5))  # float() takes a 0-d array
    # so does initial_lr (a 0-d array, the optimizer's rate as a variable), as Horovod's does
    for rate in (np.array(0.25), keras.Variable(0.25)):
        assert hvd.callbacks.LearningRateWarmupCallback(rate).initial_lr == pytest.approx(0.25)
    for text in (np.array("0.1"), np.bool_(True)):  # (float() parsed them)
        with pytest.raises(TypeError, match="initial_lr must be a number"):
            hvd.callbacks.LearningRateScheduleCallback(text, 1.0)
    if SIZE > 1:  # a root outside the set is refused on every rank (it was on the members only,
        # and the others went on into fit's reductions and waited)
        members = hvd.add_process_set([0])
        try:
            outside = hvd.callbacks.BroadcastGlobalVariablesCallback(1, process_set=members)
            outside.set_model(make_model(seed=0, unused=False))
            with pytest.raises(ValueError, match="must be one of"):
                outside.on_train_begin()
        finally:
            hvd.remove_process_set(members)
        # a root refused on one rank only raises on every rank (it raised there alone, and the
        # others waited in the callback's broadcasts for ever)
        odd = hvd.callbacks.BroadcastGlobalVariablesCallback(SIZE if RANK == 0 else 0)
        odd.set_model(make_model(seed=0, unused=False))
        with pytest.raises(ValueError if RANK == 0 else hvd.MismatchError,
                           match=rf"^broadcast_variables: (rank 0 refused its root_rank \()?root_rank .* got {SIZE}\."):
            odd.on_train_begin()
        # by default the root is the set's first member (0 was refused for a set without rank 0)
        last = hvd.add_process_set([SIZE - 1])
        try:
            model = make_model(seed=RANK, unused=False)
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), process_set=last),
                          loss="sparse_categorical_crossentropy")
            x, y = global_data()
            model.fit(shard(x), shard(y), batch_size=GLOBAL_BATCH // SIZE, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(process_set=last)])
        finally:
            hvd.remove_process_set(last)


def test_float8_scales_of_a_local_layer_stay_this_ranks():
    """A local layer keeps its own float8 statistics; they were Max-reduced with the shared ones."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), layers.Dense(8), layers.Dense(3)])
    model.quantize("float8")
    last = model.layers[-1]
    model.compile(optimizer=hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.01), local_layers=last),
                  loss="mse")
    x = np.random.RandomState(RANK).randn(16, 4).astype("float32") * (1 + 10 * RANK)
    model.fit(x, np.zeros((16, 3), "float32"), batch_size=16, epochs=1, verbose=0)

    def amax(layer):
        v = next(w for w in layer.variables if "inputs_amax_history" in w.path)
        return float(np.max(ops.convert_to_numpy(v)))

    every = ops.convert_to_numpy(hvd.allgather(np.array([[amax(model.layers[0]), amax(last)]]),
                                               name="test.float8.local"))
    assert np.all(every[:, 0] == every[0, 0])  # the shared layer's: the maximum, everywhere
    if SIZE > 1:
        assert every[0, 1] < every[1, 1]  # the local layer's: each rank's own (rank 1's data is larger)


def test_checkpoint_resume_keeps_each_ranks_local_layer():
    """A resume with local layers (PartialDistributedOptimizer) continues as the uninterrupted run:
    every rank's local variables and their optimizer slots were rank 0's after load_checkpoint,
    and the broadcast callback then copied rank 0's slots over them too. Also: a checkpoint of
    another optimizer kind, and an unbuilt model, are refused on every rank."""
    from hvddp.keras.checkpoint import CheckpointCallback, load_checkpoint, save_checkpoint

    x, y = global_data()
    xs, ys = shard(x), shard(y)

    def build(seed):
        keras.utils.set_random_seed(seed + RANK)  # the local layer starts apart on every rank
        model = keras.Sequential([keras.Input((5,)), layers.Dense(8, activation="tanh"), layers.Dense(3)])
        model.compile(optimizer=hvd.PartialDistributedOptimizer(keras.optimizers.Adam(0.01),
                                                                local_layers=model.layers[-1]),
                      loss="sparse_categorical_crossentropy")
        return model

    def callbacks(model):
        return [hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=model.layers[-1].weights)]

    directory = shared_directory("local.ckpt")
    path = os.path.join(directory, "local.ckpt")
    ref = build(10)
    ref.fit(xs, ys, batch_size=GLOBAL_BATCH // SIZE, epochs=4, shuffle=False, verbose=0, callbacks=callbacks(ref))
    first = build(10)
    first.fit(xs, ys, batch_size=GLOBAL_BATCH // SIZE, epochs=2, shuffle=False, verbose=0,
              callbacks=[*callbacks(first), CheckpointCallback(path, every=2)])
    resumed = build(20)
    state = load_checkpoint(path, resumed)
    resumed.fit(xs, ys, batch_size=GLOBAL_BATCH // SIZE, epochs=4, initial_epoch=state["epoch"], shuffle=False,
                verbose=0, callbacks=callbacks(resumed))
    for got, want in zip(resumed.variables + resumed.optimizer.variables, ref.variables + ref.optimizer.variables):
        np.testing.assert_array_equal(ops.convert_to_numpy(got), ops.convert_to_numpy(want), err_msg=got.path)
    if SIZE > 1:  # the local layer really is per rank
        every = ops.convert_to_numpy(hvd.allgather(ops.convert_to_numpy(resumed.layers[-1].kernel)[None],
                                                   name="test.local.ckpt.kernel"))
        assert not np.array_equal(every[0], every[1])
    if SIZE > 1:  # restored on rank 0 alone, then copied by the callback: the ranks must agree to copy
        alone = hvd.add_process_set([0])
        try:
            again = build(30)
            if RANK == 0:
                load_checkpoint(path, again, process_set=alone)
            again.fit(xs, ys, batch_size=GLOBAL_BATCH // SIZE, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks(again))  # (hung: rank 0 skipped the broadcast, rank 1 did not)
            assert_replicas_identical(again.layers[0].get_weights(), "ckpt.alone")
        finally:
            hvd.remove_process_set(alone)
    other = keras.Sequential([keras.Input((5,)), layers.Dense(8, activation="tanh"), layers.Dense(3)])
    other.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.RMSprop(0.01)), loss="mse")
    with pytest.raises(hvd.HvddpError, match="holds the state of an optimizer of class Adam, this model's is RMSprop"):
        load_checkpoint(path, other)
    unbuilt = keras.Sequential([layers.Dense(3)])
    with pytest.raises(hvd.HvddpError, match="save_checkpoint: the model is not built"):
        save_checkpoint(os.path.join(directory, "unbuilt.ckpt"), unbuilt)


def test_a_resumed_fit_with_dropout_equals_the_uninterrupted_one():
    """A model restored from an epoch-2 checkpoint into a model built with other seeds (other
    weights, other dropout seeds) and trained to epoch 4 equals one trained to epoch 4 without
    interruption, exactly: each rank's dropout stream is restored with the rest. A model not yet
    compiled takes the weights, and rank 0 says the optimizer state was not loaded."""
    import logging

    from hvddp.keras.checkpoint import CheckpointCallback, load_checkpoint

    data = np.random.default_rng(3)
    x = data.normal(size=(32 * SIZE, 8)).astype("float32")
    y = (x[:, :2].sum(1) > 0).astype("float32")[:, None]
    xs, ys = shard(x), shard(y)

    def build(seed, compiled=True):
        keras.utils.set_random_seed(seed + RANK)
        model = keras.Sequential([keras.Input((8,)), layers.Dense(16, activation="relu"), layers.Dropout(0.3),
                                  layers.Dense(1)])
        if compiled:
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                          loss=keras.losses.BinaryCrossentropy(from_logits=True))
        return model

    def fit(model, epochs, initial_epoch=0, callbacks=()):
        model.fit(xs, ys, batch_size=8, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks])

    def values(variables):
        return [ops.convert_to_numpy(v.value) for v in variables]

    path = os.path.join(shared_directory("dropout.ckpt"), "dropout.ckpt")
    reference = build(100)
    fit(reference, 4)
    first = build(100)
    fit(first, 2, callbacks=[CheckpointCallback(path, every=2)])
    resumed = build(200)
    state = load_checkpoint(path, resumed)
    assert state is not None and state["epoch"] == 2, state
    assert int(resumed.optimizer.iterations.numpy()) == int(first.optimizer.iterations.numpy()) > 0
    for a, b, got in zip(values(first.variables), values(resumed.variables), resumed.variables):
        np.testing.assert_array_equal(b, a, err_msg=got.path)  # seed generators included, per rank
    fit(resumed, 4, initial_epoch=state["epoch"])
    for a, b, got in zip(values(reference.weights), values(resumed.weights), resumed.weights):
        np.testing.assert_array_equal(b, a, err_msg=got.path)
    seeds = hvd.allgather_object([v.tolist() for v, var in zip(values(resumed.variables), resumed.variables)
                                  if "seed_generator" in var.path], name="test.dropout.seeds")
    assert SIZE == 1 or seeds[0] != seeds[1], seeds  # per-rank dropout streams survived the round trip
    said = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hvddp").addHandler(catch)
    try:
        bare = build(300, compiled=False)
        assert load_checkpoint(path, bare)["epoch"] == 2
    finally:
        logging.getLogger("hvddp").removeHandler(catch)
    for a, b, got in zip(values(first.weights), values(bare.weights), bare.weights):
        np.testing.assert_array_equal(b, a, err_msg=got.path)
    warned = [m for m in said if "holds optimizer state" in m and "compile the model before load_checkpoint" in m]
    assert len(warned) == (RANK == 0), said


@pytest.mark.skipif(SIZE != 2, reason="two ranks passing different arguments")
def test_checkpoint_calls_that_differ_between_ranks_raise_on_every_rank():
    """A different rng= (only some ranks gathered RNG states: the job hung), a bad path on one rank
    (it raised there alone, the others waited), and a model that does not fit on one rank (it
    raised there alone, the others loaded) all raise on every rank, and nothing was loaded."""
    from hvddp.keras.checkpoint import load_checkpoint, save_checkpoint

    def model(units):
        keras.utils.set_random_seed(RANK)
        built = keras.Sequential([keras.Input((4,)), layers.Dense(units)])
        built.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        return built

    path = os.path.join(shared_directory("differ.ckpt"), "differ.ckpt")
    save_checkpoint(path, model(3))
    with pytest.raises(hvd.MismatchError, match=r"save_checkpoint: the ranks passed different rng \(rank 0: True, "
                                                r"rank 1: False\)"):
        save_checkpoint(path, model(3), rng=RANK == 0)
    with pytest.raises(TypeError if RANK else hvd.MismatchError, match="path must be a file path"):
        save_checkpoint(path if RANK == 0 else 7, model(3))
    mine = model(3 + RANK)
    before = [w.copy() for w in mine.get_weights()]
    with pytest.raises(hvd.HvddpError, match="has shape" if RANK else "failed on rank 1.*nothing was loaded on any"):
        load_checkpoint(path, mine)
    for got, want in zip(mine.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert ops.convert_to_numpy(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.differ"))[0] == 2
