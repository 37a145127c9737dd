"""Rank 1 skips a step: with stall shutdown set, every rank gets a StallError naming it."""
import time

import numpy as np

import hvddp

hvddp.init()
try:
    if hvddp.rank() == 0:
        hvddp.allreduce(np.ones(2), name="step.7")
    else:
        time.sleep(10)  # never submits step.7
        hvddp.allreduce(np.ones(2), name="other")
except hvddp.StallError as e:
    print(f"rank {hvddp.rank()} StallError: {e}", flush=True)
