"""Rank-side script of tests/test_checkpoint.py: Keras fit, checkpoint, resume in a new model.

    KERAS_BACKEND=torch mpiexec -n 2 python -m mpi4py tests/fault_scripts/resume_keras.py DIR

A reference model trains 4 epochs. A second one, built the same way, trains 2 epochs with
CheckpointCallback. A third, built with other seeds (other weights, other dropout seeds), loads
that checkpoint and trains epochs 2..4. Its weights must equal the reference's exactly.
"""

import logging
import os
import sys

import keras
import numpy as np

import hvddp.keras as hvd
from hvddp.keras.checkpoint import CheckpointCallback, load_checkpoint

directory = sys.argv[1]
hvd.init()
rank = hvd.rank()
data = np.random.default_rng(3)
x = data.normal(size=(128, 8)).astype("float32")
y = (x[:, :2].sum(1) > 0).astype("float32")[:, None]
xs, ys = x[rank::hvd.size()], y[rank::hvd.size()]


def build(seed):
    keras.utils.set_random_seed(seed + rank)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def fit(model, epochs, initial_epoch=0, callbacks=()):
    model.fit(xs, ys, batch_size=16, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks])


ckpt = os.path.join(directory, "keras.ckpt")
reference = build(100)
fit(reference, 4)

first = build(100)
fit(first, 2, callbacks=[CheckpointCallback(ckpt, every=2)])

resumed = build(200)
state = load_checkpoint(ckpt, resumed)
assert state is not None and state["epoch"] == 2, state
assert int(resumed.optimizer.iterations.numpy()) == int(first.optimizer.iterations.numpy()) > 0
for a, b in zip(first.variables, resumed.variables):  # seed generators included, per rank
    assert np.array_equal(keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value)), a.path
fit(resumed, 4, initial_epoch=state["epoch"], callbacks=[CheckpointCallback(ckpt + ".next")])

for a, b in zip(reference.weights, resumed.weights):
    assert np.array_equal(keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value)), a.path
seeds = hvd.allgather_object([keras.ops.convert_to_numpy(v.value).tolist() for v in resumed.variables
                              if "seed_generator" in v.path])
assert seeds[0] != seeds[1], seeds  # per-rank dropout streams survived the round trip
# a model not compiled yet takes the weights, and rank 0 says the optimizer state was not loaded
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("hvddp").addHandler(handler)
bare = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                         keras.layers.Dropout(0.3), keras.layers.Dense(1)])
assert load_checkpoint(ckpt, bare)["epoch"] == 2
for a, b in zip(first.weights, bare.weights):
    assert np.array_equal(keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value)), a.path
said = [w for w in warnings if "holds optimizer state" in w and "compile the model before load_checkpoint" in w]
assert len(said) == (rank == 0), warnings
sys.stdout.write(f"rank {rank}: KERAS RESUME OK ({keras.backend.backend()})\n")
sys.stdout.flush()
