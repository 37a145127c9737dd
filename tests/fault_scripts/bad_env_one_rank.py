"""Rank-side script of tests/test_faults.py: only rank 1 has a bad HVDDP_CYCLE_TIME.

    mpiexec -n 2 python tests/fault_scripts/bad_env_one_rank.py

Every rank must get the ValueError from init() (plain python: nothing would abort the job).
"""

import os
import sys

from mpi4py import MPI

if MPI.COMM_WORLD.Get_rank() == 1:
    os.environ["HVDDP_CYCLE_TIME"] = "fast"

import hvddp  # noqa: E402

try:
    hvddp.init()
    sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()}: init returned\n")
except ValueError as exc:
    sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()}: ValueError: {exc}\n")
sys.stdout.flush()
