"""Rank 1 skips a step: with stall shutdown set, every rank gets a StallError naming it, and
the job then ends with a non-zero exit (the engine is gone, so the ranks abort at exit).

Rank 0 also submits 'warm' again, a name the response cache holds, which rank 1 never does: the
error names it too (a cached name reaches rank 0's table only when demoted, a little later, and
was left out of the message)."""

import numpy as np

import hvddp

hvddp.init()
for _ in range(3):
    hvddp.allreduce(np.ones(2), name="warm")
try:
    if hvddp.rank() == 0:
        warm = hvddp.allreduce_async(np.ones(2), name="warm")
        hvddp.allreduce(np.ones(2), name="step.7")
    else:
        hvddp.allreduce(np.ones(2), name="step.8")  # skipped step.7 (and warm)
except hvddp.StallError as e:
    print(f"rank {hvddp.rank()} StallError: {e}", flush=True)
