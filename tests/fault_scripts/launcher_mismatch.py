"""Rank-side script of tests/test_faults.py: init() under a launcher that is not MPI's own.

Run with plain ``python`` (no mpiexec) and a launcher variable such as OMPI_COMM_WORLD_SIZE=2,
which is what each process sees when Open MPI's mpirun starts an mpi4py built on MPICH.
"""

import hvddp

try:
    hvddp.init()
except hvddp.LauncherMismatchError as exc:
    print(f"LAUNCHERMISMATCH: {exc}", flush=True)
    raise SystemExit(7)
print(f"NO ERROR: size {hvddp.size()}", flush=True)
