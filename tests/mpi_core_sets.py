"""Process sets under 3 ranks, the ways a job can trip over them: removing a set while a collective
on it is in flight or left pending, unnamed calls that only a set's members make, lists given to
init(process_sets=...) that differ across ranks, and copies/pickles of a set. Prints `sets ok`."""
import copy
import os
import pickle
import sys
import time

import numpy as np

import hvddp

hvddp.init()
rank = hvddp.rank()
out_dir = sys.argv[1]
assert hvddp.size() == 3

# 1. removed in the same round as a collective on it: the collective still completes
s = hvddp.add_process_set([0, 1])
h = hvddp.allreduce_async(np.ones(3), name="in.flight", op=hvddp.Sum, process_set=s) if s.included() else None
hvddp.remove_process_set(s)
if h is not None:
    assert hvddp.synchronize(h).tolist() == [2.0, 2.0, 2.0]

# 2. removed while only some members submitted: those fail, naming the removal (no hang), and
# rank 0's coordinator forgets the name (steps that are all cached must not see it as a stall)
for _ in range(3):
    hvddp.allreduce(np.ones(1), name="cached", op=hvddp.Sum)
s = hvddp.add_process_set([0, 1])
h = hvddp.allreduce_async(np.ones(3), name="orphan", process_set=s) if rank == 0 else None
hvddp.barrier()
hvddp.remove_process_set(s)
if h is not None:
    try:
        h.wait(timeout=30)
    except hvddp.MismatchError as exc:
        assert "was removed" in str(exc) and "'orphan'" in str(exc), exc
    else:
        raise AssertionError("a collective on a removed set completed")
for _ in range(30):  # > 1.5 s, past HVDDP_STALL_CHECK_TIME_SECONDS=1, cached steps only
    assert hvddp.allreduce(np.ones(1), name="cached", op=hvddp.Sum).tolist() == [3.0]
    time.sleep(0.05)

# 3. unnamed calls only a set's members make (or a refused one) leave the global names alone
s = hvddp.add_process_set([0, 1])
if s.included():
    hvddp.barrier(process_set=s)
    assert hvddp.broadcast_object({"a": rank}, 0, process_set=s) == {"a": 0}
    assert hvddp.allgather_object(rank, process_set=s) == [0, 1]
    hvddp.allreduce(np.ones(2), process_set=s)
else:
    try:
        hvddp.barrier(process_set=s)
    except ValueError as exc:
        assert "not a member" in str(exc), exc
    else:
        raise AssertionError("a non-member's barrier was accepted")
hvddp.barrier()
assert hvddp.broadcast_object({"b": rank}, 0) == {"b": 0}
assert hvddp.allgather_object(rank) == [0, 1, 2]
assert hvddp.allreduce(np.ones(2), op=hvddp.Sum).tolist() == [3.0, 3.0]

# 4. root_rank is a global rank, as in Horovod: the set [1, 2] broadcasts from global rank 2
tail = hvddp.add_process_set([1, 2])
if tail.included():
    assert hvddp.broadcast(np.full(2, float(rank)), 2, name="tail.bc", process_set=tail).tolist() == [2.0, 2.0]
    assert hvddp.broadcast_object(rank, 2, process_set=tail) == 2
    try:
        hvddp.broadcast(np.ones(1), 0, process_set=tail)  # rank 0 is not a member
    except ValueError as exc:
        assert "global rank" in str(exc) and "[1, 2]" in str(exc), exc
    else:
        raise AssertionError("a root outside the set was accepted")
    try:  # ranks that disagree on the root: the message shows the global ranks they passed
        hvddp.broadcast(np.ones(1), rank, name="tail.disagree", process_set=tail)
    except hvddp.MismatchError as exc:
        assert "rank 1 1, rank 2 2" in str(exc), exc
    else:
        raise AssertionError("ranks that disagree on the root were not told")
    # checkpoints default to the set's first member (rank 0 is not in this set)
    from hvddp import checkpoint

    path = os.path.join(out_dir, "tail.pkl")
    checkpoint.save({"from": rank}, path, process_set=tail)
    assert checkpoint.load(path, process_set=tail) == {"from": 1}
hvddp.remove_process_set(tail)

# 5. groups with the same member names on two sets at once (two data-parallel groups' optimizers
# use one fixed group name) are separate groups: a mismatch in one fails only that one, and
# neither waits for the other (both were keyed by the names alone: the global group failed with
# the set's error, and same-named groups took ~2 s per step instead of under 1 ms)
pair = hvddp.add_process_set([0, 1])
late = None
if rank < 2:
    late = hvddp.grouped_allreduce_async([np.ones(2), np.ones(2)], name="g", op=hvddp.Sum)
    try:  # shapes differ between ranks 0 and 1 on the pair
        hvddp.grouped_allreduce([np.ones(2 + rank), np.ones(2)], name="g", op=hvddp.Sum, process_set=pair)
    except hvddp.HvddpError as exc:
        assert "'g.0': shape differs" in str(exc), exc
    else:
        raise AssertionError("a shape mismatch passed")
else:
    time.sleep(0.5)  # rank 2 comes late to the global group
    late = hvddp.grouped_allreduce_async([np.ones(2), np.ones(2)], name="g", op=hvddp.Sum)
assert [x.tolist() for x in late.wait(timeout=20)] == [[3.0, 3.0]] * 2
start = time.monotonic()
for step in range(10):
    both = [hvddp.grouped_allreduce_async([np.ones(4), np.ones(3)], name="same", op=hvddp.Sum)]
    if rank < 2:
        both.append(hvddp.grouped_allreduce_async([np.ones(4), np.ones(3)], name="same", op=hvddp.Sum,
                                                  process_set=pair))
    assert [h.wait(timeout=20)[1][0] for h in both] == [3.0, 2.0][:len(both)]
assert time.monotonic() - start < 5.0, f"10 steps took {time.monotonic() - start:.1f} s"
hvddp.remove_process_set(pair)

# 6. an add/remove refused on one rank only (a rank out of range, a set not registered): the others
# raise naming it, and later adds/removes still pair across ranks (the refusing rank used to
# raise before taking the call's name: the others waited and paired it with its next call)
extra = hvddp.add_process_set([1, 2])
for bad_rank, call in ((2, lambda: hvddp.add_process_set([0, 9] if rank == 2 else [0, 1])),
                       (1, lambda: hvddp.remove_process_set(pair if rank == 1 else extra))):  # pair: removed
    try:
        call()
    except (ValueError, hvddp.MismatchError) as exc:
        assert type(exc) is (ValueError if rank == bad_rank else hvddp.MismatchError), repr(exc)
        assert rank == bad_rank or f"refused on rank(s) [{bad_rank}]" in str(exc), exc
    else:
        raise AssertionError(f"a call refused on rank {bad_rank} passed on rank {rank}")
hvddp.remove_process_set(extra)
after = hvddp.add_process_set([0, 2])  # the next add pairs across ranks: the set works
if after.included():
    assert hvddp.allreduce(np.full(1, float(rank)), name="after.refusal", op=hvddp.Sum, process_set=after).tolist() == [2.0]
hvddp.remove_process_set(after)

# 6a. an add on one rank while the others remove: MismatchError on every rank (adds and removes
# took their names from separate counters, so the two never met and every rank waited for ever),
# and the next calls still pair
gone = hvddp.add_process_set([1, 2])
try:
    hvddp.add_process_set([0, 1]) if rank == 0 else hvddp.remove_process_set(gone)
except hvddp.MismatchError as exc:
    assert "add_process_set" in str(exc) and "remove_process_set" in str(exc), exc
else:
    raise AssertionError("an add on rank 0 paired with a remove on the others")
hvddp.remove_process_set(gone)
# removals (or adds) that name different sets: named by their ranks (it said "process set id differs
# across ranks: rank 0 (2,), rank 1 (3,), rank 2 (3,)", ids a script never sees)
one, two = hvddp.add_process_set([0, 2]), hvddp.add_process_set([1, 2])
for call, shown in ((lambda: hvddp.remove_process_set(one if rank == 0 else two),
                     f"rank 0 the set of [0, 2] (id {one.process_set_id}), rank 1 the set of [1, 2] (id "),
                    (lambda: hvddp.add_process_set([0, 1] if rank == 0 else [0, 2]), "rank 0 [0, 1], rank 1 [0, 2]")):
    try:
        call()
    except hvddp.MismatchError as exc:
        assert shown in str(exc) and "the same process sets, in the same order" in str(exc), exc
    else:
        raise AssertionError("calls naming different sets passed")
hvddp.remove_process_set(one)
hvddp.remove_process_set(two)

# 6b. a set's collectives do not wait on a rank outside it that calls nothing: every cycle is
# world-wide, and the idle outsider slept 50 ms between its cycles (54 ms per allreduce on [1, 2])
busy = hvddp.add_process_set([1, 2])
if busy.included():
    x = np.ones(4)
    for _ in range(3):
        hvddp.allreduce(x, name="busy.w", process_set=busy)
    start = time.monotonic()
    for _ in range(40):
        hvddp.allreduce(x, name="busy.w", process_set=busy)
    took = time.monotonic() - start
    assert took < 1.0, f"40 allreduces on the set [1, 2] took {took:.2f} s while rank 0 called nothing"
else:
    time.sleep(1.5)  # in its own code
hvddp.remove_process_set(busy)

# 7. copies and pickles: one registered set per process
assert copy.deepcopy(s) is s and copy.copy(s) is s
assert pickle.loads(pickle.dumps(s)) is s
assert pickle.loads(pickle.dumps(hvddp.global_process_set)) is hvddp.global_process_set
from hvddp.runtime import _restore_process_set, _state

assert _restore_process_set(None) is hvddp.global_process_set  # how the first pickles named it
hvddp.remove_process_set(s)
unregistered = pickle.loads(pickle.dumps(s))
assert unregistered is not s and unregistered.ranks == [0, 1] and unregistered.process_set_id is None
hvddp.shutdown()

# 8. init(process_sets=...) that differs across ranks: ValueError on every rank, not a hang
mine = [hvddp.ProcessSet([0, 1] if rank == 0 else [0, 2])]
try:
    hvddp.init(process_sets=mine)
except ValueError as exc:
    assert "differs across ranks" in str(exc) and "rank 0 passed [[0, 1]]" in str(exc), exc
else:
    raise AssertionError("init() accepted process sets that differ across ranks")
assert not hvddp.is_initialized()
twice = hvddp.ProcessSet([1, 2])
hvddp.init(process_sets=[twice, twice])  # the same object twice: registered once
assert twice.process_set_id == 1 and sorted(_state().process_sets) == [0, 1], sorted(_state().process_sets)
assert hvddp.allreduce(np.ones(1), name="clean", op=hvddp.Sum).tolist() == [3.0]
hvddp.remove_process_set(twice)
assert sorted(_state().process_sets) == [0]
hvddp.shutdown()
hvddp.init(process_sets="dynamic")  # Horovod's switch for sets added later: accepted, not needed
evens = hvddp.add_process_set([0, 2])
assert evens.size() == 2
# 9. a second init() registers nothing: a new set it lists raises (it used to be ignored, and the
# set's first use said to pass it to init(process_sets=...), which had been done); a registered
# one is fine
late = hvddp.ProcessSet([0, 1])
try:
    hvddp.init(process_sets=[evens, late])
except ValueError as exc:
    assert "already initialized" in str(exc) and "add_process_set(ps)" in str(exc), exc
else:
    raise AssertionError("a second init() ignored an unregistered process set")
hvddp.init(process_sets=[evens])
assert late.process_set_id is None and hvddp.add_process_set(late).size() == 2

# 10. the list check of hvddp.keras' and hvddp.tensorflow's broadcast_variables and gradient
# reductions names global ranks on a set: on the set [1, 2] it said "rank 0 has ..., rank 1 has ..."
from hvddp import _grouping

tail = hvddp.add_process_set([1, 2])
if tail.included():
    for counts in ((1, 1), (1, 2)):  # a shape that differs; a variable more on rank 2
        n = counts[rank - 1]
        try:
            _grouping.check_same_lists("check.lists", ["v", "w"][:n], [(rank, 2)] * n, ["float32"] * n, tail,
                                       broadcast="broadcast_variables")
        except hvddp.MismatchError as exc:
            assert ("rank 1 has 'v' (1, 2) float32, rank 2 has 'v' (2, 2) float32" if counts == (1, 1)
                    else "rank 1 has 1, rank 2 has 2 (only rank 2 has 'w')") in str(exc), exc
        else:
            raise AssertionError("lists that differ passed")
    # and a root_rank outside the set on one rank only raises on both (rank 1 refused it at its first
    # broadcast alone, and rank 2 waited for ever for the rest)
    try:
        _grouping.check_same_lists("check.root", ["v"], [(2,)], ["float32"], tail, broadcast="broadcast_variables",
                                   root_rank=0 if rank == 1 else 2)
    except (ValueError, hvddp.MismatchError) as exc:
        assert type(exc) is (ValueError if rank == 1 else hvddp.MismatchError), repr(exc)
        assert "root_rank is a global rank" in str(exc) and "got 0." in str(exc), exc
        assert str(exc).startswith("broadcast_variables: " + ("root_rank" if rank == 1 else "rank 1 refused")), exc
    else:
        raise AssertionError("a root_rank outside the set passed")
hvddp.remove_process_set(tail)
print("sets ok", flush=True)
