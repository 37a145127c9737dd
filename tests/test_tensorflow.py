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
