"""hvddp.tensorflow under real mpiexec: TF ops eagerly and in tf.function, gradients,
DistributedGradientTape parity with a single process, Adasum (on a set of two at np=3, refused on
all three), broadcast_variables, and the example."""

import importlib.util
import re

import pytest

from mpirun import run, run_pytest

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not installed", allow_module_level=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_tf_ops_and_tape(np_):
    out = run_pytest(np_, "tests/mpi_tf_ops.py", timeout=300,
                     extra=["-W", "ignore::UserWarning", "-W", "ignore::DeprecationWarning"])
    assert "37 passed" in out.stdout, out.stdout


def test_tensorflow_digits_example(tmp_path):
    checkpoint = tmp_path / "digits.weights.h5"
    out = run(2, ["examples/tensorflow_digits.py", "--epochs", "15", "--checkpoint", str(checkpoint)],
              timeout=300).stdout
    match = re.search(r"ranks: 2  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert float(match.group(1)) >= 0.95, out
    assert match.group(2) == "True", out
    assert checkpoint.exists()
