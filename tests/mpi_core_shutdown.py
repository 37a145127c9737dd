"""Rank 1 shuts down while rank 0 waits on a collective rank 1 never submits; then many
init/shutdown cycles, each with a process set and a single-copy allreduce, must not run MPI out
of communicators (shutdown frees them; MPICH ran out after about 450 cycles)."""
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

for cycle in range(1000):
    hvddp.init(comm=[0, 1] if cycle % 2 else None)
    pair = hvddp.add_process_set([0, 1])
    out = hvddp.allreduce(np.ones(100_000), name="cycle", op=hvddp.Sum, process_set=pair)
    assert out[0] == 2.0
    hvddp.shutdown()
print("cycles ok", flush=True)
