"""Checkpoints: atomic on disk, collective in memory, and a killed job resumes bit-identically."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mpirun import ROOT, run

CRASH_MID_WRITE = """
import os, sys
from hvddp.checkpoint import atomic_write
def half(f):
    f.write(b"NEW" * 1000)
    f.flush()
    os.fsync(f.fileno())
    os._exit(3)  # the process dies here, in the middle of writing the checkpoint
atomic_write(sys.argv[1], half)
"""


def test_crash_mid_write_leaves_previous_checkpoint_intact(tmp_path):
    from hvddp.checkpoint import atomic_write

    path = tmp_path / "model.ckpt"
    atomic_write(path, b"OLD checkpoint")
    result = subprocess.run([sys.executable, "-c", CRASH_MID_WRITE, str(path)], cwd=ROOT, timeout=60)
    assert result.returncode == 3
    assert path.read_bytes() == b"OLD checkpoint"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.ckpt"]
    assert leftovers and all(".tmp." in n for n in leftovers), leftovers  # the torn temp file
    atomic_write(path, lambda f: f.write(b"NEWER"))
    assert path.read_bytes() == b"NEWER"
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # the next save cleaned up
    with pytest.raises(TypeError, match="data must be bytes"):
        atomic_write(path, "text")


def test_a_save_leaves_another_hosts_temporary_file_alone_until_it_is_old(tmp_path):
    """On a shared filesystem another node's writer may be mid-write: its process id means nothing
    here (a save deleted that file as a crashed writer's, and the other node's rename failed).
    A crashed writer's file from this host, or another host's from days ago, is removed."""
    import os
    import time

    from hvddp.checkpoint import _tmp_prefix, atomic_write

    path = str(tmp_path / "last.pt")
    prefix = _tmp_prefix(path)
    busy = f"{prefix}4194000.0123456789ab.ffffffff"  # another host's writer, still writing
    old = f"{prefix}4194001.0123456789ab.fffffffe"  # another host's, left two days ago
    dead = f"{prefix}4194002.0123456789ab"  # this host's crashed writer (no such process here)
    for name in (busy, old, dead):
        with open(name, "wb") as f:
            f.write(b"half")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    atomic_write(path, b"this node's checkpoint")
    assert os.path.exists(busy) and not os.path.exists(old) and not os.path.exists(dead)
    os.replace(busy, path)  # the other node's save completes
    assert open(path, "rb").read() == b"half"


def test_concurrent_writers_never_tear_or_fail(tmp_path):
    """Two threads save to one path while a third reads it: every read is one writer's whole
    file, no save fails, and no temporary file is left (each writer has its own)."""
    import threading

    from hvddp.checkpoint import atomic_write

    path = tmp_path / "shared.ckpt"
    size, errors, torn, stop = 100_000, [], [], threading.Event()

    def writer(tag: int) -> None:
        for _ in range(12):  # each save fsyncs: keep it short
            try:
                atomic_write(path, lambda f: [f.write(bytes([tag]) * 1000) for _ in range(size // 1000)])
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(exc))

    def reader() -> None:
        while not stop.is_set():
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            if len(data) != size or len(set(data)) != 1:
                torn.append((len(data), sorted(set(data))))

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in (1, 2)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert not errors and not torn, (errors[:3], torn[:3])
    assert [p.name for p in tmp_path.iterdir()] == ["shared.ckpt"]


def test_collective_save_load_errors_alike_on_every_rank(tmp_path):
    result = run(2, ["tests/mpi_faults_checkpoint.py", str(tmp_path)], timeout=120)
    assert result.stdout.count("CHECKPOINT OK") == 2, result.stdout


def _resume(args, check=True):
    return run(2, ["tests/fault_scripts/resume_torch.py", *args], timeout=120, check=check)


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """An uninterrupted reference run, and a run whose rank 1 is SIGKILLed at step 13."""
    torch = pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("resume")
    ref_ckpt, ref_out, ckpt = tmp / "ref.pt", tmp / "ref_final.pt", tmp / "job.pt"
    _resume([str(ref_ckpt), str(ref_out)])
    start = time.monotonic()
    killed = _resume([str(ckpt), str(tmp / "never.pt"), "--die-at", "13"], check=False)
    elapsed = time.monotonic() - start
    assert killed.returncode != 0 and "SIGKILL at step 13" in killed.stdout, killed.stdout
    assert elapsed < 30 and not (tmp / "never.pt").exists(), killed.stdout
    assert torch.load(ckpt, weights_only=True)["step"] == 10  # the last checkpoint before the kill
    return torch.load(ref_out, weights_only=True), ckpt.read_bytes(), tmp


def _resumed_weights(killed_job, name, *flags):
    torch = pytest.importorskip("torch")
    _, ckpt_bytes, tmp = killed_job
    ckpt, out = tmp / f"{name}.pt", tmp / f"{name}_final.pt"
    ckpt.write_bytes(ckpt_bytes)
    resumed = _resume([str(ckpt), str(out), *flags])
    assert "rank 0: starting at step 10" in resumed.stdout and "rank 1: starting at step 10" in resumed.stdout
    return torch.load(out, weights_only=True)


def test_killed_job_resumes_from_checkpoint_with_identical_weights(killed_job):
    torch = pytest.importorskip("torch")
    ref, got = killed_job[0], _resumed_weights(killed_job, "resumed")
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def test_resume_without_rng_state_diverges(killed_job):
    """The control: RNG restore is what makes the resumed run exact (the test above can fail)."""
    torch = pytest.importorskip("torch")
    ref, got = killed_job[0], _resumed_weights(killed_job, "no_rng", "--no-rng")
    assert not all(torch.equal(ref[k], got[k]) for k in ref)
