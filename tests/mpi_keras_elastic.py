"""hvddp.keras.elastic (and hvddp.tensorflow.elastic) at a fixed size, run by every rank at once
by tests/test_keras.py on the backend KERAS_BACKEND names."""

import numpy as np
import pytest

import keras
from keras import layers

import hvddp.elastic
import hvddp.keras as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BACKEND = keras.backend.backend()


def make_model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), layers.Dense(6, activation="tanh"), layers.Dropout(0.1),
                              layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def data(seed, n=32):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def values(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables + model.optimizer.variables]


def same_on_every_rank(arrays):
    gathered = hvd.allgather_object([a.tolist() for a in arrays])
    return all(g == gathered[0] for g in gathered)


def test_keras_state_syncs_from_rank_zero_then_commits_and_restores():
    model = make_model(seed=RANK)  # different weights on every rank
    x, y = data(seed=RANK)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # and different optimizer slots (no broadcast)
    state = hvd.elastic.KerasState(model, epoch=RANK, batch=3 * RANK)
    assert state.optimizer is model.optimizer
    assert not same_on_every_rank(values(model)) or SIZE == 1
    state.sync()
    assert same_on_every_rank(values(model))
    assert (state.epoch, state.batch) == (0, 0)
    state.epoch = 4
    state.commit()
    kept = values(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.epoch = 5
    assert any(not np.array_equal(a, b) for a, b in zip(kept, values(model)))
    state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(kept, values(model)))
    assert state.epoch == 4


def test_fit_callbacks_commit_every_n_batches_and_each_epoch_and_count_batches_and_epochs():
    model = make_model(seed=0)
    x, y = data(seed=RANK, n=40)
    state = hvd.elastic.KerasState(model, epoch=2, batch=0)
    commits = []
    save = state.save
    state.save = lambda: (commits.append((state.epoch, state.batch)), save())[-1]
    batches = []
    watch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(state.batch))
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=np.int64(3)), watch]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, batch_size=8, epochs=4 - state.epoch, callbacks=callbacks, verbose=0)
        return state.epoch

    assert train(state) == 4  # two epochs finished, counted on from 2
    assert state.batch == 0
    assert batches == [0, 1, 2, 3, 4] * 2  # 5 batches an epoch
    # after the 3rd, 6th and 9th batches, and at each epoch's end, as in Horovod
    assert commits == [(2, 2), (3, 0), (3, 0), (3, 3), (4, 0)], commits
    kept = values(model)
    model.train_on_batch(x[:8], y[:8])
    state.epoch = 9
    state.restore()  # back to the last commit: the end of fit
    assert all(np.array_equal(a, b) for a, b in zip(kept, values(model)))
    assert (state.epoch, state.batch) == (4, 0)
    commits.clear()
    state.epoch = 0
    model.fit(x, y, batch_size=8, epochs=1, callbacks=callbacks, verbose=0)
    assert commits == [(0, 2), (1, 0)], commits  # the batch count starts again with each fit
    with pytest.raises(ValueError, match="batches_per_commit must be an int >= 1"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_keras_state_refuses_what_it_could_not_keep():
    unbuilt = keras.Sequential([layers.Dense(2)])
    with pytest.raises(ValueError, match="the model must be built first"):
        hvd.elastic.KerasState(unbuilt)
    uncompiled = keras.Sequential([keras.Input((4,)), layers.Dense(2)])
    with pytest.raises(ValueError, match="no optimizer to keep: compile the model first"):
        hvd.elastic.KerasState(uncompiled)
    hvd.elastic.KerasState(uncompiled, optimizer=keras.optimizers.SGD())


def _fit_unbuilt_with_broadcast_callback(built_on_rank_zero):
    keras.utils.set_random_seed(RANK)  # different initial weights on every rank
    model = keras.Sequential([layers.Dense(6, activation="tanh"), layers.Dense(2)])  # no Input
    if built_on_rank_zero and RANK == 0:
        model.build((None, 4))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = data(seed=RANK)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model


def test_broadcast_callback_on_a_model_that_its_first_step_builds():
    """No Input: on the TensorFlow backend the first step builds the model, after on_train_begin;
    the callback then broadcasts at the end of that step (Horovod's timing), and the replicas agree."""
    assert same_on_every_rank(values(_fit_unbuilt_with_broadcast_callback(built_on_rank_zero=False)))


def test_broadcast_callback_when_only_rank_zero_built_the_model():
    """Rank 0 built its model (say, to load a checkpoint) and the others leave it to fit: the
    ranks agree to broadcast after the first step, instead of some waiting for the others."""
    assert same_on_every_rank(values(_fit_unbuilt_with_broadcast_callback(built_on_rank_zero=True)))


def test_names_are_the_core_ones():
    assert hvd.elastic.run is hvddp.elastic.run and hvd.elastic.ObjectState is hvddp.elastic.ObjectState
    assert hvd.HostsUpdatedInterrupt is hvddp.elastic.HostsUpdatedInterrupt
    assert hvd.elastic.TensorFlowKerasState is hvd.elastic.KerasState  # Horovod's Keras name too
    with pytest.raises(TypeError, match="model must be a keras.Model"):
        hvd.elastic.KerasState(object())


@pytest.mark.skipif(BACKEND != "tensorflow", reason="hvddp.tensorflow.elastic is for the TensorFlow backend")
def test_tensorflow_state_syncs_commits_and_restores_variables():
    import tensorflow as tf

    import hvddp.tensorflow as hvd_tf

    variables = [tf.Variable(np.full(3, RANK, dtype=np.float32)), tf.Variable(RANK + 10),
                 tf.Variable(np.full(2, 60000 + RANK, dtype=np.uint16))]  # (uint16 travels as its bits)
    state = hvd_tf.elastic.TensorFlowState(variables, step=RANK)
    state.sync()
    assert variables[0].numpy().tolist() == [0.0] * 3 and int(variables[1].numpy()) == 10 and state.step == 0
    assert variables[2].numpy().tolist() == [60000, 60000]
    variables[0].assign_add(np.ones(3, np.float32))
    state.step = 1
    state.commit()
    variables[0].assign_add(np.ones(3, np.float32))
    state.step = 2
    state.restore()
    assert variables[0].numpy().tolist() == [1.0] * 3 and state.step == 1
    with pytest.raises(ValueError, match="pass the variables to keep"):
        hvd_tf.elastic.TensorFlowState()
    from hvddp.keras.elastic import KerasState
    assert hvd_tf.elastic.TensorFlowKerasState is KerasState
