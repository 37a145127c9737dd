"""hvddp.keras under real mpiexec, on the tensorflow, torch and jax backends.

The rank-side tests are in tests/mpi_keras_fit.py (run by every rank at once); this module
launches them, and the keras_digits example, once per backend and number of ranks.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from mpirun import ROOT, hvddp_lines, run, run_pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed", allow_module_level=True)

# A rank that skips a reduction its peers make is a stall; make it an error well before the timeout.
STALL = {"HVDDP_STALL_CHECK_TIME_SECONDS": "20", "HVDDP_STALL_SHUTDOWN_TIME_SECONDS": "60"}

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(importlib.util.find_spec(m) is None,
                                                     reason=f"{m} is not installed"))
            for b, m in (("tensorflow", "tensorflow"), ("torch", "torch"), ("jax", "jax"))]


# what the np=2 run must report per backend: one test needs 3 ranks, the TF-graph-only case skips
# elsewhere, JAX never gives a None gradient for the partial-gradient case to test, and Keras'
# own LossScaleOptimizer.apply fails eagerly on JAX; the saved-XLA case is TensorFlow's only
NP2_SUMMARY = {"tensorflow": "43 passed, 1 skipped", "torch": "41 passed, 3 skipped", "jax": "39 passed, 5 skipped"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_np2(backend):
    """Parity (Adam), callbacks, save/reload, mixed precision, jit_compile, helpers, mismatch."""
    out = run_pytest(2, "tests/mpi_keras_fit.py", env={"KERAS_BACKEND": backend, **STALL}, timeout=300,
                     extra=["-k", "not parity[sgd]", "-W", "ignore::UserWarning",
                            "-W", "ignore::DeprecationWarning"])
    assert re.search(r"\b" + NP2_SUMMARY[backend], out.stdout), out.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_np3(backend):
    """An odd number of ranks: parity of model.fit (SGD with momentum), the metric average, local
    gradients on a rank outside a set of two, and op=Adasum refused on every rank (no power of two)."""
    out = run_pytest(3, "tests/mpi_keras_fit.py", env={"KERAS_BACKEND": backend, **STALL}, timeout=300,
                     extra=["-k", "parity[sgd] or metric or outside_the_set_local or adasum",
                            "-W", "ignore::UserWarning", "-W", "ignore::DeprecationWarning"])
    assert re.search(r"\b6 passed", out.stdout), out.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_digits_example(backend, tmp_path):
    checkpoint = tmp_path / "digits.keras"
    out = run(2, ["examples/keras_digits.py", "--epochs", "15", "--checkpoint", str(checkpoint)],
              env={"KERAS_BACKEND": backend}, timeout=300).stdout
    match = re.search(r"backend: (\w+)  ranks: 2  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert match.group(1) == backend
    assert float(match.group(2)) >= 0.95, out
    assert match.group(3) == "True", out
    assert checkpoint.exists()
    assert out.count("Epoch 1/15") == 1, "the progress bar must show on rank 0 only"


def test_import_adds_no_framework():
    """hvddp.keras imports only the active backend's framework (here torch: never TensorFlow)."""
    code = ("import sys, keras; before = {m for m in ('tensorflow', 'jax', 'torch') if m in sys.modules}\n"
            "import hvddp.keras\n"
            "after = {m for m in ('tensorflow', 'jax', 'torch') if m in sys.modules}\n"
            "assert after == before and 'tensorflow' not in after, (before, after)\n"
            "import hvddp.keras._backend, hvddp.keras.callbacks\n"
            "assert 'hvddp.tensorflow' not in sys.modules\n")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed")
def test_horovod_tf_keras_style_script_runs_with_only_the_import_changed(tmp_path):
    """tests/horovod_style_keras.py is written as Horovod's TensorFlow 2 Keras example is, with
    ``import hvddp.tensorflow.keras as hvd`` as its only hvddp line."""
    assert hvddp_lines("tests/horovod_style_keras.py") == ["import hvddp.tensorflow.keras as hvd"]
    out = run(2, ["tests/horovod_style_keras.py", "--epochs", "5", "--checkpoint-dir", str(tmp_path)],
              env={"KERAS_BACKEND": "tensorflow"}, timeout=300).stdout
    match = re.search(r"ranks: 2  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert float(match.group(1)) >= 0.95 and match.group(2) == "True", out
    assert out.count("Epoch 1/5") == 1, out  # verbose on rank 0 only
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{e}.keras" for e in range(1, 6)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_elastic_api_at_a_fixed_size(backend):
    """hvddp.keras.elastic: KerasState sync/commit/restore and refusals, the fit callbacks, run, the
    broadcast callback on a model its first step builds; on TensorFlow also TensorFlowState."""
    out = run_pytest(2, "tests/mpi_keras_elastic.py", env={"KERAS_BACKEND": backend, **STALL}, timeout=300,
                     extra=["-W", "ignore::UserWarning", "-W", "ignore::DeprecationWarning"])
    expected = "7 passed" if backend == "tensorflow" else "6 passed, 1 skipped"
    assert re.search(r"\b" + expected, out.stdout), out.stdout


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed")
def test_horovod_style_elastic_keras_script_runs_with_only_the_import_changed(tmp_path):
    assert hvddp_lines("tests/horovod_style_keras_elastic.py") == ["import hvddp.tensorflow.keras as hvd"]
    out = run(2, ["tests/horovod_style_keras_elastic.py", "--epochs", "4", "--checkpoint-dir", str(tmp_path)],
              env={"KERAS_BACKEND": "tensorflow"}, timeout=300).stdout
    match = re.search(r"ranks: 2  epochs: (\d+)  test accuracy: ([0-9.]+)  replicas identical: (\w+)", out)
    assert match, out
    assert match.group(1) == "4" and float(match.group(2)) >= 0.95 and match.group(3) == "True", out
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{e}.keras" for e in range(1, 5)]
