"""hvddp.keras under real mpiexec, on the tensorflow, torch and jax backends.

The rank-side tests are in tests/mpi_keras_fit.py and tests/mpi_keras_elastic.py (run by every
rank at once; on the TensorFlow backend with hvddp.tensorflow's, tests/mpi_tf_ops.py); this module
launches them once per backend and number of ranks, and the example scripts once per backend.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from mpirun import hvddp_lines, run, run_pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)

# A rank that skips a reduction its peers make is a stall; make it an error well before the timeout.
STALL = {"HVDDP_STALL_CHECK_TIME_SECONDS": "20", "HVDDP_STALL_SHUTDOWN_TIME_SECONDS": "60"}

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(importlib.util.find_spec(m) is None,
                                                     reason=f"{m} is not installed"))
            for b, m in (("tensorflow", "tensorflow"), ("torch", "torch"), ("jax", "jax"))]


# The rank-side modules each launch runs. A launch costs each rank its framework's start-up
# (TensorFlow: ~9 s here), so one launch per backend and size runs them all: on the TensorFlow
# backend that includes hvddp.tensorflow's (mpi_tf_ops.py, every test also at 3 ranks).
RANK_SIDE = {"tensorflow": ["tests/mpi_tf_ops.py", "tests/mpi_keras_fit.py", "tests/mpi_keras_elastic.py"],
             "torch": ["tests/mpi_keras_fit.py", "tests/mpi_keras_elastic.py"],
             "jax": ["tests/mpi_keras_fit.py", "tests/mpi_keras_elastic.py"]}
# what the np=2 launch must report per backend: the sgd parity case runs at 3 ranks only, the
# TF-graph-only cases skip elsewhere, JAX never gives a None gradient for the partial-gradient case
# to test, Keras' own LossScaleOptimizer.apply fails eagerly on JAX, the saved-XLA case and
# TensorFlowState are TensorFlow's only; SyncBatchNormalization outside its set needs 3 ranks;
# Keras refuses steps_per_execution > 1 on torch; the ragged allgather in jax.jit is JAX's
NP2_SUMMARY = {"tensorflow": "141 passed, 3 skipped", "torch": "69 passed, 6 skipped", "jax": "69 passed, 6 skipped"}
# at 3 ranks, the tests marked np3: Keras' sgd parity, the metric average, local gradients on a
# rank outside a set of two, op=Adasum refused on every rank (no power of two); all of mpi_tf_ops
# but its tf.function forms and tests of tracing (marked traced)
NP3_SUMMARY = {"tensorflow": "52 passed", "torch": "6 passed", "jax": "6 passed"}
QUIET = ["-W", "ignore::UserWarning", "-W", "ignore::DeprecationWarning"]
# JAX compiles every fit's train step with XLA: ~0.8 s each here, over half of the JAX launch. The
# tests check what is computed, not how fast, so they let XLA skip its CPU code optimisations
# (mpi_keras_fit.py's tests at np=2 took 80 s with them, 67 s without, the same tests passing).
FAST_COMPILE = {"jax": {"XLA_FLAGS": "--xla_backend_optimization_level=0"}}


def _rank_side(np_, files, backend, *select):
    """Run the rank-side modules ``files`` in one launch on ``backend``; return the output."""
    env = {"KERAS_BACKEND": backend, **STALL, **FAST_COMPILE.get(backend, {})}
    return run_pytest(np_, files[0], env=env, timeout=600, extra=[*files[1:], *QUIET, *select]).stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_side_np2(backend):
    """Parity (Adam), passes, callbacks, save/reload, mixed precision, jit_compile, helpers,
    mismatches, Adasum, float8, local variables; the elastic API at a fixed size; on TensorFlow also
    hvddp.tensorflow's ops, tape and optimizer."""
    out = _rank_side(2, RANK_SIDE[backend], backend, "--deselect", "tests/mpi_keras_fit.py::test_fit_parity[sgd]")
    assert re.search(r"\b" + NP2_SUMMARY[backend] + r"\b", out), out


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_side_np3(backend):
    """An odd number of ranks: the tests marked np3 (not their tf.function forms)."""
    files = [f for f in RANK_SIDE[backend] if "elastic" not in f]
    out = _rank_side(3, files, backend, "-m", "np3 and not traced")
    assert re.search(r"\b" + NP3_SUMMARY[backend] + r"\b", out), out


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_digits_example(backend, tmp_path):
    checkpoint = tmp_path / "digits.keras"
    out = run(2, ["examples/keras_digits.py", "--epochs", "15", "--checkpoint", str(checkpoint)],
              env={"KERAS_BACKEND": backend}, timeout=300).stdout
    match = re.search(r"backend: (\w+)  ranks: 2  test accuracy: ([0-9.]+)  training time: [0-9.]+ s  "
                      r"replicas identical: (\w+)", out)
    assert match, out
    assert match.group(1) == backend
    assert float(match.group(2)) >= 0.95, out
    assert match.group(3) == "True", out
    assert checkpoint.exists()
    assert out.count("Epoch 1/15") == 1, "the progress bar must show on rank 0 only"


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed")
def test_horovod_tf_keras_style_script_runs_with_only_the_import_changed(tmp_path):
    """tests/horovod_style_keras.py is written as Horovod's TensorFlow 2 Keras example is, with
    ``import hvddp.tensorflow.keras as hvd`` as its only hvddp line."""
    assert hvddp_lines("tests/horovod_style_keras.py") == ["import hvddp.tensorflow.keras as hvd"]
    out = run(2, ["tests/horovod_style_keras.py", "--epochs", "3", "--checkpoint-dir", str(tmp_path)],
              env={"KERAS_BACKEND": "tensorflow"}, timeout=300).stdout
    match = re.search(r"ranks: 2  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert float(match.group(1)) >= 0.95 and match.group(2) == "True", out
    assert out.count("Epoch 1/3") == 1, out  # verbose on rank 0 only
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{e}.keras" for e in range(1, 4)]


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed")
def test_horovod_style_elastic_keras_script_runs_with_only_the_import_changed(tmp_path):
    assert hvddp_lines("tests/horovod_style_keras_elastic.py") == ["import hvddp.tensorflow.keras as hvd"]
    out = run(2, ["tests/horovod_style_keras_elastic.py", "--epochs", "4", "--checkpoint-dir", str(tmp_path)],
              env={"KERAS_BACKEND": "tensorflow"}, timeout=300).stdout
    match = re.search(r"ranks: 2  epochs: (\d+)  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert match.group(1) == "4" and float(match.group(2)) >= 0.95 and match.group(3) == "True", out
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{e}.keras" for e in range(1, 5)]


@pytest.mark.parametrize("version, message", [
    ("3.4.1", "hvddp.keras needs Keras 3.5 or later; found keras 3.4.1 (pip install -U 'keras>=3.5'"),
    ("2.15.0", "hvddp.keras supports Keras 3; found keras 2.15.0."),
])
def test_a_keras_it_does_not_support_is_refused_at_import_naming_the_fix(tmp_path, version, message):
    """Keras 3.0-3.4 failed inside DistributedOptimizer (an AttributeError for a step counter 3.5
    added); the import says which Keras is needed instead. (A stand-in ``keras`` package, only its
    version, shadows the installed one.)"""
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import hvddp.keras"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and f"ImportError: {message}" in result.stderr, result.stderr
