"""Rank 1 skips a step: with stall shutdown set, every rank gets a StallError naming it, and
the job then ends with a non-zero exit (the engine is gone, so the ranks abort at exit).

Rank 0 also submits 'warm' again, a name the response cache holds, which rank 1 never does: the
error names it too (a cached name reaches rank 0's table only when demoted, a little later, and
was left out of the message), and 'step.7' on a second process set: the message tells the two
apart."""

import numpy as np

import hvddp

hvddp.init()
both = hvddp.add_process_set([0, 1])
for _ in range(3):
    hvddp.allreduce(np.ones(2), name="warm")
try:
    if hvddp.rank() == 0:
        warm = hvddp.allreduce_async(np.ones(2), name="warm")
        on_set = hvddp.allreduce_async(np.ones(2), name="step.7", process_set=both)  # same name
        hvddp.allreduce(np.ones(2), name="step.7")
    else:
        hvddp.allreduce(np.ones(2), name="step.8")  # skipped step.7 (and warm)
except hvddp.StallError as e:
    print(f"rank {hvddp.rank()} StallError: {e}", flush=True)
