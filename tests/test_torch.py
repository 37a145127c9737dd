"""hvddp.torch: collectives, autograd, DistributedOptimizer parity, Horovod-style script, example.

Multi-rank tests run the rank-side modules ``tests/mpi_torch_*.py`` under real ``mpiexec`` at 2
and 3 ranks. Single-process tests run in a subprocess so that this pytest process imports
neither torch nor MPI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mpirun import ROOT, hvddp_lines, run, run_pytest

pytest.importorskip("torch")


def _python(args, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable] + list(args), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_optimizer_and_elastic(np_):
    """Collectives, dtypes, autograd and errors (mpi_torch_ops.py); DistributedOptimizer parity and
    behaviour (mpi_torch_optimizer.py); at 3 ranks, where the sampler pads the shares, the elastic
    API at a fixed size (mpi_torch_elastic.py). One launch per size: each rank starts torch once."""
    files = ["tests/mpi_torch_optimizer.py"] + (["tests/mpi_torch_elastic.py"] if np_ == 3 else [])
    run_pytest(np_, "tests/mpi_torch_ops.py", timeout=360, extra=files)


def test_distributed_optimizer_with_every_gradient_deferred_to_step():
    """HVDDP_OVERLAP=0: what a rank bound to one core does by default; the same parity tests."""
    run_pytest(2, "tests/mpi_torch_optimizer.py", env={"HVDDP_OVERLAP": "0"})


def test_size_one_without_launcher():
    _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests/mpi_torch_single.py"])


def test_import_hvddp_does_not_import_torch():
    code = ("import sys, hvddp; assert 'torch' not in sys.modules, 'hvddp imported torch'; "
            "import hvddp.torch as hvd; assert 'torch' in sys.modules; "
            "assert hvd.allreduce.__module__ == 'hvddp.torch.mpi_ops'; "
            "missing = [n for n in hvd.__all__ if not hasattr(hvd, n)]; assert not missing, missing; "
            # what Horovod scripts import from its submodules
            "from hvddp.torch.mpi_ops import init, rank, size, Adasum, Compression, HorovodInternalError; "
            "from hvddp.torch.elastic import init, shutdown, TorchState, ElasticSampler; "
            "import hvddp.torch.mpi_ops as m; missing = [n for n in m.__all__ if not hasattr(m, n)]; "
            "assert not missing, missing; assert HorovodInternalError is hvd.HorovodInternalError")
    _python(["-c", code])


def _accuracies(output: str):
    return [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", output)]


@pytest.mark.parametrize("flags", [[], ["--use-adasum"]], ids=["average", "adasum"])
def test_horovod_style_script_runs_with_only_the_import_changed(flags):
    assert hvddp_lines("tests/horovod_style_torch.py") == ["import hvddp.torch as hvd"]
    result = run(2, ["tests/horovod_style_torch.py"] + flags, timeout=180)
    accuracies = _accuracies(result.stdout)
    assert len(accuracies) == 8, result.stdout  # rank 0 alone prints, once per epoch
    assert accuracies[-1] >= 90.0, result.stdout


def test_horovod_style_elastic_script_runs_with_only_the_import_changed():
    assert hvddp_lines("tests/horovod_style_torch_elastic.py") == ["import hvddp.torch as hvd"]
    result = run(2, ["tests/horovod_style_torch_elastic.py"], timeout=180)
    accuracies = [float(a) for a in re.findall(r"Epoch \d+: test accuracy: ([0-9.]+)%", result.stdout)]
    assert len(accuracies) == 6, result.stdout  # rank 0 alone prints, once per epoch
    assert accuracies[-1] >= 90.0, result.stdout


def test_example_pytorch_digits(tmp_path):
    checkpoint = tmp_path / "digits.ckpt"
    result = run(2, ["examples/pytorch_digits.py", "--checkpoint", str(checkpoint)], timeout=180)
    final = re.findall(r"ranks 2 +test accuracy ([0-9.]+)%", result.stdout)
    assert final and float(final[-1]) >= 95.0, result.stdout
    assert checkpoint.exists()
    assert "[rank 1] epoch" not in result.stdout  # logging on rank 0 only
    resumed = run(2, ["examples/pytorch_digits.py", "--checkpoint", str(checkpoint), "--resume",
                      "--epochs", "13", "--lr", "0.002"], timeout=180)
    assert "resumed from" in resumed.stdout and "epoch 13 " in resumed.stdout, resumed.stdout
    assert "learning rate 0.004 (--lr times 2 ranks)" in resumed.stdout, resumed.stdout  # (the checkpoint's was kept)
    assert "epoch  1 " not in resumed.stdout
    # resumed after its last epoch: no training, and the accuracy reported is the model's (was 0%)
    done = run(2, ["examples/pytorch_digits.py", "--checkpoint", str(checkpoint), "--resume",
                   "--epochs", "13"], timeout=180)
    final = re.findall(r"ranks 2 +test accuracy ([0-9.]+)%", done.stdout)
    assert "epoch 13 " not in done.stdout and final and float(final[-1]) >= 95.0, done.stdout


@pytest.mark.parametrize("flags", [[], ["--use-adasum", "--fp16-allreduce"]], ids=["average", "adasum"])
def test_synthetic_benchmark_example_runs(flags):
    """Horovod's pytorch_synthetic_benchmark.py flags, --use-adasum included (it was refused)."""
    result = run(2, ["examples/pytorch_synthetic_benchmark.py", "--model", "convnet", "--num-iters", "2",
                     "--num-batches-per-iter", "2", "--num-warmup-batches", "1", "--batch-size", "8", "--no-cuda"]
                 + flags, timeout=180)
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", result.stdout), result.stdout


def test_gpu_training_benchmark_script_runs_on_the_cpu():
    """benchmarks/train_gpu.py (measured on a GPU) keeps working: on the CPU it checks the script,
    and at one rank hvddp and DDP must land on plain PyTorch's parameters exactly."""
    out = _python([os.path.join(ROOT, "benchmarks", "train_gpu.py"), "--models", "convnet", "--steps", "2",
                   "--rounds", "2", "--warmup", "1", "--batch-size", "8", "--cpu"]).stdout
    rows = re.findall(r"\| convnet \([^|]*\) \| (torch|DDP|hvddp) \| ([0-9.]+) \|[^\n]*\| ([^|]*) \|\n", out)
    assert [r[0] for r in rows] == ["torch", "DDP", "hvddp"], out
    assert all(float(r[1]) > 0 for r in rows), out
    assert [r[2].strip() for r in rows[1:]] == ["0.0e+00", "0.0e+00"], out


@pytest.mark.parametrize("flags, message", [(["--steps", "0"], "--steps must be >= 1, got 0."),
                                            (["--warmup", "-1"], "--warmup must be >= 0, got -1."),
                                            (["--repeats", "0"], "--repeats must be >= 1, got 0."),
                                            (["--np", "0"], "--np must be >= 1, got 0.")])
def test_training_benchmark_refuses_bad_counts(flags, message):
    """benchmarks/train_torch.py names a bad count before it launches anything (it raised
    UnboundLocalError or KeyError after the runs, or ran --np 0 as one rank)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_torch.py")] + flags,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
