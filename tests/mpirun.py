"""Launch real multi-rank jobs from pytest: a timeout that kills the whole process group, and
every rank's output (rank-prefixed) in the failure message."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return local
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: pip install mpich")
    return found


def _rank_flag(exe: str) -> List[str]:
    try:
        text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return []
    if "HYDRA" in text.upper():
        return ["-prepend-rank"]
    if "Open MPI" in text or "OpenRTE" in text:
        return ["--tag-output", "--allow-run-as-root", "--oversubscribe"]
    return []


def _clean_shm(since: float) -> None:
    """Remove the /dev/shm segments a killed or aborted job leaves behind (MPICH: 2 MiB each)."""
    try:
        from hvddp.runner import remove_leaked_shm
    except ImportError:
        return
    remove_leaked_shm(since)


def run(np_: int, args: Sequence[str], timeout: float = 180, env: Optional[Dict[str, str]] = None,
        python_module_mpi4py: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python [-m mpi4py] *args`` on ``np_`` ranks; fail with every rank's output.

    Args:
        np_: number of ranks.
        args: what follows ``python`` (a script path, or ``-m module ...``).
        timeout: seconds before the whole process group is killed and the test fails.
        env: extra environment variables.
        python_module_mpi4py: run under ``python -m mpi4py`` so an exception on one rank aborts all.
        check: raise AssertionError on a non-zero exit.
    """
    exe = mpiexec()
    cmd = [exe, "-n", str(np_)] + _rank_flag(exe) + [sys.executable]
    if python_module_mpi4py:
        cmd += ["-m", "mpi4py"]
    cmd += list(args)
    started = time.time()
    try:
        result = spawn(cmd, timeout, env)
    except AssertionError:
        _clean_shm(started)
        raise
    if result.returncode != 0:
        _clean_shm(started)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {' '.join(cmd)}\n--- output of every rank ---\n"
                             f"{result.stdout}")
    return result


def spawn(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None
          ) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group (output merged); kill the group and fail on timeout."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    full_env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    proc = subprocess.Popen(list(cmd), cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"TIMEOUT after {timeout} s (killed the process group): {' '.join(cmd)}\n"
                             f"--- output of every rank ---\n{out}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, "")


def run_pytest(np_: int, test_file: str, timeout: float = 240, env: Optional[Dict[str, str]] = None,
               extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run a pytest module on every rank at once (its tests are collectives)."""
    # (--color=no: Open MPI's mpiexec hands the ranks a terminal, and colour codes would split
    # the summary lines the tests read; no:hypothesispytest: the plugin imports hypothesis, 0.9 s
    # per rank here, which the one rank-side module that uses it imports itself)
    return run(np_, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--no-header", "--color=no",
                     "-o", "addopts=", test_file, *extra], timeout=timeout, env=env)


def timeline_spans(path: str) -> Dict[str, List[str]]:
    """The span names an hvddp timeline file holds, per row (a tensor's name), in order; asserts
    that every span that begins ends, properly nested within its row."""
    import json

    with open(path) as f:
        events = json.load(f)
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    stacks: Dict[int, List[str]] = {}
    spans: Dict[str, List[str]] = {}
    for e in events:
        if e.get("ph") == "B":
            stacks.setdefault(e["pid"], []).append(e["name"])
            spans.setdefault(rows[e["pid"]], []).append(e["name"])
        elif e.get("ph") == "E":
            stack = stacks.get(e["pid"])
            assert stack and stack.pop() == e["name"], (rows[e["pid"]], e, stack)
    assert not any(stacks.values()), {rows[pid]: stack for pid, stack in stacks.items() if stack}
    return spans


def hvddp_lines(script: str) -> List[str]:
    """The lines of the script ``script`` (relative to the repository) that mention hvddp, after
    its module docstring: for a script ported from Horovod, just the import line."""
    with open(os.path.join(ROOT, script)) as f:
        code = f.read().split('"""', 2)[2]
    return [line for line in code.splitlines() if "hvddp" in line]
