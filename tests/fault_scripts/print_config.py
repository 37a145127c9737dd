"""Rank-side script of tests/test_runner.py: report what hvddprun gave this rank, as JSON."""

import dataclasses
import json
import sys

import numpy as np

import hvddp
from hvddp import runtime

hvddp.init()
total = hvddp.allreduce(np.array([hvddp.rank() + 1.0]), name="ranks", op=hvddp.Sum)
sys.stdout.write("CONFIG " + json.dumps({
    "rank": hvddp.rank(), "size": hvddp.size(), "sum": float(total[0]),
    "under_mpi4py_run": "mpi4py.run" in sys.modules,
    "config": dataclasses.asdict(runtime._state().config),
    "argv": sys.argv[1:],
}) + "\n")  # one write: lines of two ranks must not interleave
sys.stdout.flush()
hvddp.shutdown()
