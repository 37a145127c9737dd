"""The single-copy path's failure handling, under real mpiexec (2 ranks).

1. Rank 1 cannot use cross-memory attach (its libc lookup fails): the collective probe must make
   every rank fall back to MPI, and results stay exact.
2. With the path in use on a new process set, one transfer fails on rank 1 only: the allreduce
   must raise on both ranks, and the next one must work.
3. The same for a fusion group of small arrays (the staged path), failing in its second chunk,
   so that the ranks are mid-way through: both raise, none waits, the next group is exact.
"""
import numpy as np

import hvddp
from hvddp.backends import cma
from hvddp.runtime import _state

hvddp.init()
R, N = hvddp.rank(), hvddp.size()
big = np.full(1 << 20, R + 1.0, dtype=np.float32)  # 4 MiB, past the threshold

real_libc = cma._libc
if R == 1:
    cma._libc = lambda: None
out = hvddp.allreduce(big, op=hvddp.Sum, name="fallback")
assert (out == N * (N + 1) / 2).all()
executor = _state().engine.executor
assert executor._cma.get(0) is None, "one rank without CMA must turn it off on every rank"
cma._libc = real_libc
print(f"rank {R}: fallback ok", flush=True)

both = hvddp.add_process_set(list(range(N)))
out = hvddp.allreduce(big, op=hvddp.Average, name="cma.works", process_set=both)
assert (out == (N + 1) / 2).all()
assert executor._cma.get(both.process_set_id) is not None

real_call = cma.CrossMemory._call
if R == 1:
    def failing_call(self, fn, peer, n_local, n_remote, expected):
        cma.CrossMemory._call = real_call  # fail once
        raise OSError(14, "simulated: bad address")
    cma.CrossMemory._call = failing_call
try:
    hvddp.allreduce(big, op=hvddp.Sum, name="cma.fails", process_set=both)
except hvddp.HvddpError as exc:
    message = str(exc)
    assert "cma.fails" in message and "single-copy allreduce failed" in message, message
    assert ("simulated: bad address" in message) == (R == 1), message
    print(f"rank {R}: failure raised: {message}", flush=True)
else:
    raise AssertionError("a failed transfer on one rank must raise on every rank")
out = hvddp.allreduce(big, op=hvddp.Sum, name="cma.after", process_set=both)
assert (out == N * (N + 1) / 2).all()
print(f"rank {R}: recovered ok", flush=True)

small = [np.full(10_000, R + 1.0, dtype=np.float32) for _ in range(240)]  # 9.6 MB: three chunks
calls = [0]
if R == 1:
    def failing_later(self, *args):
        calls[0] += 1
        if calls[0] == 25:  # past the first 4 MiB chunk (packed, then 8 reads and 8 writes of
            cma.CrossMemory._call = real_call  # 256 KiB) and the second's packing
            raise OSError(14, "simulated: bad address in a later chunk")
        real_call(self, *args)
    cma.CrossMemory._call = failing_later
try:  # one group: submitted together, so reduced in one cycle
    hvddp.grouped_allreduce(small, op=hvddp.Sum, name="staged.fails", process_set=both)
except hvddp.HvddpError as exc:
    message = str(exc)
    assert "single-copy allreduce failed" in message, message
    assert ("in a later chunk" in message) == (R == 1), message
    print(f"rank {R}: staged failure raised: {message}", flush=True)
else:
    raise AssertionError("a failed transfer in a later chunk on one rank must raise on every rank")
assert R == 0 or calls[0] == 25, calls
out = hvddp.grouped_allreduce(small, op=hvddp.Average, name="staged.after", process_set=both)
assert all((a == (N + 1) / 2).all() for a in out)
print(f"rank {R}: staged recovered ok", flush=True)
