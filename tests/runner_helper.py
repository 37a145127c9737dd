"""Run ``hvddprun`` from tests: a process-group-killing timeout and the elapsed time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hvddprun(args: Sequence[str], timeout: float = 120, env: Optional[Dict[str, str]] = None
             ) -> Tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m hvddp.runner *args``; return the result (output merged) and seconds taken."""
    cmd = [sys.executable, "-m", "hvddp.runner", *args]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"TIMEOUT after {timeout} s: {' '.join(cmd)}\n--- output ---\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, ""), time.monotonic() - start

