"""Rank 1 shuts down while rank 0 waits on a collective rank 1 never submits."""
import time

import numpy as np

import hvddp

hvddp.init()
if hvddp.rank() == 0:
    handle = hvddp.allreduce_async(np.ones(2), name="never")
    try:
        handle.wait(timeout=30)
    except hvddp.ShutdownError as e:
        print("pending handle failed: ShutdownError", e, flush=True)
    try:
        hvddp.allreduce(np.ones(2), name="after")
    except hvddp.ShutdownError:
        pass
    hvddp.shutdown()
else:
    handle = hvddp.allreduce_async(np.ones(2), name="other")
    time.sleep(0.3)
    hvddp.shutdown()
    try:
        handle.wait(timeout=30)
    except hvddp.ShutdownError as e:
        print("pending handle failed: ShutdownError", e, flush=True)
