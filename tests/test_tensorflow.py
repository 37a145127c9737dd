"""hvddp.tensorflow's example and a script written as Horovod's TensorFlow 2 example is, under real
mpiexec. Its rank-side tests (tests/mpi_tf_ops.py: TF ops eagerly and in tf.function, gradients,
DistributedGradientTape parity with a single process, Adasum on a set of two at np=3 and refused on
all three, broadcast_variables) run in tests/test_keras.py's TensorFlow-backend launches, which
start TensorFlow once for both."""

import importlib.util
import os
import re

import pytest

from mpirun import hvddp_lines, run

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not installed", allow_module_level=True)


def test_tensorflow_digits_example(tmp_path):
    checkpoint = tmp_path / "digits.weights.h5"
    out = run(2, ["examples/tensorflow_digits.py", "--epochs", "15", "--checkpoint", str(checkpoint)],
              timeout=300).stdout
    match = re.search(r"ranks: 2  test accuracy: ([0-9.]+)  training time: [0-9.]+ s  replicas identical: (\w+)",
                      out)
    assert match, out
    assert float(match.group(1)) >= 0.95, out
    assert match.group(2) == "True", out
    assert checkpoint.exists()


def test_horovod_style_training_loop_runs_with_only_the_import_changed(tmp_path):
    """tests/horovod_style_tensorflow.py is written as Horovod's TensorFlow 2 example is
    (DistributedGradientTape, broadcast after the first step), with ``import hvddp.tensorflow as
    hvd`` as its only hvddp line."""
    assert hvddp_lines("tests/horovod_style_tensorflow.py") == ["import hvddp.tensorflow as hvd"]
    out = run(2, ["tests/horovod_style_tensorflow.py", "--checkpoint-dir", str(tmp_path)], timeout=300).stdout
    match = re.search(r"ranks: 2  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert float(match.group(1)) >= 0.95 and match.group(2) == "True", out
    assert out.count("Step #0\t") == 1, out  # printed by local rank 0 only
    assert os.path.exists(tmp_path / "ckpt-1.index"), sorted(os.listdir(tmp_path))


# A Horovod TensorFlow 2 port: Keras' fit with a train_step of its own reducing through the tape,
# and only hvddp.tensorflow imported. Keras 3's jit_compile="auto" (the default) picks XLA where a
# GPU is present, which cannot compile hvddp's tf.numpy_function: the first batch raised
# ValueError there (Keras 2, Horovod's, never picked XLA by itself). Only the device list is faked.
OWN_TRAIN_STEP = """
from unittest import mock
import numpy as np
import tensorflow as tf
import keras
import hvddp.tensorflow as hvd

hvd.init()

class Model(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}

keras.utils.set_random_seed(0)
inputs = keras.Input((4,))
model = Model(inputs, keras.layers.Dense(1)(inputs))
plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
gpu = [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
with mock.patch.object(tf.config, "list_physical_devices", lambda *args: gpu):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
assert plain.jit_compile is True, plain.jit_compile  # Keras' choice, kept for other models
assert model.jit_compile is False, model.jit_compile
x = np.ones((8, 4), "float32") * (hvd.rank() + 1)
model.fit(x, np.ones((8, 1), "float32"), batch_size=4, epochs=1, shuffle=False, verbose=0)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
every = hvd.allgather_object(weights)
assert all(np.array_equal(w, every[0]) for w in every), every
if hvd.rank() == 0:
    print(f"own train_step fit on {hvd.size()} ranks, replicas identical")
"""


def test_own_train_step_with_the_tape_is_not_xla_compiled_by_auto():
    out = run(2, ["-c", OWN_TRAIN_STEP], timeout=300, env={"KERAS_BACKEND": "tensorflow"}).stdout
    assert "own train_step fit on 2 ranks, replicas identical" in out, out
