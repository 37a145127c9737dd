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
    except hvddp.ShutdownError as e:  # named, and not said to have been pending
        assert "allreduce 'after' was submitted after hvddp's engine stopped" in str(e), e
        print("submission after shutdown: ShutdownError", flush=True)
    hvddp.shutdown()
else:
    handle = hvddp.allreduce_async(np.ones(2), name="other")
    try:  # a numpy number is a number of seconds too
        handle.wait(timeout=np.float32(0.01))
    except TimeoutError:
        print("numpy timeout: TimeoutError", flush=True)
    for bad in (float("nan"), "5"):
        try:
            handle.wait(timeout=bad)
        except ValueError as e:
            assert "timeout must be a number of seconds or None" in str(e), e
            print("bad timeout: ValueError", flush=True)
    time.sleep(0.3)
    hvddp.shutdown()
    try:
        handle.wait(timeout=30)
    except hvddp.ShutdownError as e:
        print("pending handle failed: ShutdownError", e, flush=True)

# A rank refuses a call (bool with Average) and shuts down at once: the refusal still reaches
# the rank waiting on that call, as the MismatchError naming it, not as a ShutdownError.
hvddp.init()
hvddp.allreduce(np.ones(3), name="warm")  # (through the response cache from here on)
hvddp.allreduce(np.ones(3), name="warm")
if hvddp.rank() == 0:
    handle = hvddp.allreduce_async(np.ones(3), name="warm")  # announced (cached) before rank 1 refuses
    hvddp.barrier()
    try:
        handle.wait(timeout=30)
    except hvddp.MismatchError as e:
        assert "refused on rank(s) [1]" in str(e), e
        print("refusal before shutdown: MismatchError", flush=True)
    hvddp.shutdown()
else:
    hvddp.barrier()
    try:
        hvddp.allreduce(np.ones(3, dtype=bool), name="warm")
    except ValueError:
        hvddp.shutdown()
        print("refusal before shutdown: MismatchError (the refusing rank)", flush=True)

for cycle in range(1000):
    hvddp.init(comm=[0, 1] if cycle % 2 else None)
    pair = hvddp.add_process_set([0, 1])
    out = hvddp.allreduce(np.ones(100_000), name="cycle", op=hvddp.Sum, process_set=pair)
    assert out[0] == 2.0
    hvddp.shutdown()
print("cycles ok", flush=True)
