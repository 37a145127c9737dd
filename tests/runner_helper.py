"""Run ``hvddprun`` from tests: a process-group-killing timeout and the elapsed time."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

from mpirun import spawn


def hvddprun(args: Sequence[str], timeout: float = 120, env: Optional[Dict[str, str]] = None
             ) -> Tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m hvddp.runner *args``; return the result (output merged) and seconds taken."""
    start = time.monotonic()
    result = spawn([sys.executable, "-m", "hvddp.runner", *args], timeout, env)
    return result, time.monotonic() - start

