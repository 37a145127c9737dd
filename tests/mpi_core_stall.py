"""Rank 1 skips a step: with stall shutdown set, every rank gets a StallError naming it, and
the job then ends with a non-zero exit (the engine is gone, so the ranks abort at exit)."""

import numpy as np

import hvddp

hvddp.init()
try:
    if hvddp.rank() == 0:
        hvddp.allreduce(np.ones(2), name="step.7")
    else:
        hvddp.allreduce(np.ones(2), name="step.8")  # skipped step.7
except hvddp.StallError as e:
    print(f"rank {hvddp.rank()} StallError: {e}", flush=True)
