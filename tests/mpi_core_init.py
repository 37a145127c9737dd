"""init() variants under 3 ranks: a sub-world from a rank list, process sets at init, DYNAMIC timeline,
re-registering a process set after shutdown and init, process sets from a split communicator."""
import json
import os
import pickle
import sys
import time

import numpy as np
from mpi4py import MPI

import hvddp

world = MPI.COMM_WORLD.Get_rank()
out_dir = sys.argv[1]

# 1. init(comm=[0, 1]): ranks 0 and 1 form a 2-rank world, rank 2 runs alone.
hvddp.init(comm=[0, 1])
assert hvddp.size() == (2 if world < 2 else 1), hvddp.size()
total = hvddp.allreduce(np.array([world + 1.0]), op=hvddp.Sum, name="sub")
assert total[0] == (3.0 if world < 2 else 3.0), total  # ranks 0+1 -> 1+2; rank 2 alone -> 3
hvddp.shutdown()
assert not hvddp.is_initialized()

# 2. re-init on the whole world with process sets given at init
evens = hvddp.ProcessSet([0, 2])
hvddp.init(process_sets=[evens])
assert hvddp.size() == 3 and evens.size() == 2
if evens.included():
    out = hvddp.allreduce(np.array([float(world)]), op=hvddp.Sum, name="evens", process_set=evens)
    assert out[0] == 2.0, out
    assert evens.rank() == world // 2

# 3. a DYNAMIC timeline started and stopped at run time (rank 0 writes)
path = os.path.join(out_dir, "dynamic.json")
hvddp.start_timeline(path, mark_cycles=True)
for _ in range(3):
    if evens.included():  # the same name on another set: a row of its own, not mixed into the first
        hvddp.allreduce(np.ones(8), name="traced", process_set=evens)
    hvddp.allreduce(np.ones(8), name="traced")
hvddp.stop_timeline()
hvddp.barrier()  # (rank 0 has stopped before anyone submits the next name)
hvddp.allreduce(np.ones(8), name="untraced")
quiet = os.path.join(out_dir, "dynamic_no_marks.json")
hvddp.start_timeline(quiet)  # mark_cycles=False: no CYCLE_START marks
hvddp.allreduce(np.ones(8), name="traced.quiet")
hvddp.stop_timeline()
if world == 0:
    events = json.load(open(path))
    rows = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert "allreduce.traced" in rows and "allreduce.untraced" not in rows, rows
    on_evens = f"allreduce.traced (process set {evens.process_set_id})"
    assert on_evens in rows, rows
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    for row in ("allreduce.traced", on_evens):  # three whole ALLREDUCE spans in each row
        spans = [e["ph"] for e in events if e.get("pid") == pids[row] and e["name"] == "ALLREDUCE"]
        assert spans == ["B", "E"] * 3, (row, spans)
    assert any(e["name"] == "CYCLE_START" for e in events), "start_timeline(mark_cycles=True) marked no cycle"
    events = json.load(open(quiet))
    assert "allreduce.traced.quiet" in {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert not any(e["name"] == "CYCLE_START" for e in events), "cycle marks without mark_cycles"

# 3a. the timeline restarted while an Adasum allreduce negotiates: its events stay on one row, with
# balanced spans (its kind was taken from its second activity, MPI_ADASUM_ALLREDUCE: a second row
# got the ends, the first kept two spans open)
restarted = os.path.join(out_dir, "restarted.json")
if world == 0:
    handle = hvddp.allreduce_async(np.ones(8, np.float32), name="w.adasum", op=hvddp.Adasum, process_set=evens)
    time.sleep(0.3)
    hvddp.start_timeline(restarted)
    hvddp.synchronize(handle)
elif world == 2:
    time.sleep(0.8)
    hvddp.allreduce(np.ones(8, np.float32), name="w.adasum", op=hvddp.Adasum, process_set=evens)
hvddp.barrier()
hvddp.stop_timeline()
if world == 0:
    events = json.load(open(restarted))
    rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    adasum_rows = [pid for pid, name in rows.items() if "w.adasum" in name]
    assert [rows[pid] for pid in adasum_rows] == [f"allreduce.w.adasum (process set {evens.process_set_id})"], rows
    # the barrier rank 1 entered before the restart: marks and spans on its one barrier row
    assert not any(name.startswith("allreduce.barrier") for name in rows.values()), rows
    phases = [e["ph"] for e in events if e.get("pid") == adasum_rows[0] and e["ph"] in "BE"]
    assert phases.count("B") == phases.count("E") > 0, phases
hvddp.shutdown()

# 4. after shutdown, the same ProcessSet object registers again on every rank (members or not)
hvddp.init()
again = hvddp.add_process_set(evens)
if again.included():
    out = hvddp.allreduce(np.array([float(world)]), op=hvddp.Sum, name="evens.again", process_set=again)
    assert out[0] == 2.0, out
hvddp.barrier()
hvddp.shutdown()

# 5. Horovod's ProcessSet(comm): each rank passes its own part of a split, and every part is
# registered; each rank's object becomes the part that holds it
sub = MPI.COMM_WORLD.Split(color=world % 2, key=world)
split = hvddp.ProcessSet(sub)
hvddp.init(process_sets=[split])
assert split.ranks == ([0, 2] if world % 2 == 0 else [1]), split.ranks
out = hvddp.allreduce(np.array([float(world)]), op=hvddp.Sum, name="split", process_set=split)
assert out[0] == sum(split.ranks), out
try:
    hvddp.add_process_set(hvddp.ProcessSet(sub))
except ValueError as exc:
    assert "only be registered by init" in str(exc), exc
else:
    raise AssertionError("add_process_set took a communicator")
# removing it removes every part (each rank's object is a different part, with its own id)
assert hvddp.remove_process_set(split) is True and split.process_set_id is None
left = hvddp.add_process_set([1, 2])
if left.included():
    assert hvddp.allreduce(np.ones(1), op=hvddp.Sum, name="left", process_set=left)[0] == 2.0
# removal requests that name different sets raise on every rank (before: one was applied to all)
a, b = hvddp.add_process_set([0, 1]), hvddp.add_process_set([0, 2])
try:
    hvddp.remove_process_set(a if world == 0 else b)
except hvddp.MismatchError as exc:
    assert "process set id" in str(exc), exc
else:
    raise AssertionError("removals of different sets were accepted")
hvddp.shutdown()
# the same object on a smaller world finds its ranks again: rank 0 runs alone, 1 and 2 as 0 and 1
halves = hvddp.ProcessSet(MPI.COMM_WORLD.Split(color=0 if world == 0 else 1, key=world))
hvddp.init(process_sets=[halves])
assert halves.ranks == ([0] if world == 0 else [1, 2]), halves.ranks
hvddp.shutdown()
hvddp.init(comm=[1, 2], process_sets=[halves])
assert halves.ranks == ([0] if world == 0 else [0, 1]), halves.ranks
hvddp.shutdown()
try:  # before init() its ranks are unknown: refused, as mpi4py refuses the communicator
    pickle.dumps(hvddp.ProcessSet(sub))
except TypeError as exc:
    assert "cannot be pickled before init" in str(exc), exc
else:
    raise AssertionError("pickled a ProcessSet(comm) before init")
# parts that overlap are refused on every rank, before anything is registered
pair = MPI.COMM_WORLD.Split(color=0 if world < 2 else 1, key=world)  # [0, 1] and [2]
overlapping = pair if world < 2 else MPI.COMM_WORLD  # rank 2 passes all three
try:
    hvddp.init(process_sets=[hvddp.ProcessSet(overlapping)])
except ValueError as exc:
    assert "overlap" in str(exc), exc
else:
    raise AssertionError("overlapping communicators were accepted")
# bad rank lists raise on every rank, naming init(comm=...): each one ran alone silently (strings),
# hung its peers (lists that differ, a repeated rank) or raised on one rank only (out of range)
for bad, kind, words in ((["0", "1"], TypeError, "holds ints"),
                         ([0, 1] if world == 0 else [1, 2], ValueError, "must pass that same list"),
                         ([0, 7], ValueError, "[7] are not world ranks"),
                         ([0, 0], ValueError, "repeats a rank"),
                         ([], ValueError, "it is empty"),
                         (MPI.COMM_NULL, ValueError, "COMM_NULL"),
                         (None, TypeError, "takes a list of ProcessSet objects")):
    try:
        if bad is None:
            hvddp.init(process_sets=hvddp.ProcessSet([0]))
        else:
            hvddp.init(comm=bad)
    except kind as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(f"init accepted {bad!r}")
    assert not hvddp.is_initialized()
# ranks that pass different kinds of comm, or no kind at all, raise on every rank (one raised a bare
# TypeError, or the others a message about their lists, while some rank waited in init() for ever)
for make, kind, words in ((lambda: hvddp.init() if world == 0 else hvddp.init(comm=[0, 1, 2]), ValueError,
                           "rank(s) [0] passed no comm (the whole world) and rank 1 passed [0, 1, 2]"),
                          (lambda: hvddp.init(comm=5 if world == 1 else None), TypeError,
                           "init(comm=...) takes an mpi4py communicator or a list of world ranks, got int 5"),
                          (lambda: hvddp.init(process_sets=5), TypeError,
                           'takes a list of ProcessSet objects (or "dynamic"), got int 5')):
    try:
        make()
    except kind as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(f"init accepted {words}")
    assert not hvddp.is_initialized()
hvddp.init(comm=np.arange(3))  # a numpy array of ranks is a list of them
assert hvddp.size() == 3
hvddp.shutdown()
hvddp.init(comm=[np.int64(2), 1])  # numpy ints are ints; the list's order is the new ranks'
assert hvddp.size() == (2 if world else 1) and hvddp.rank() == {0: 0, 1: 1, 2: 0}[world]
hvddp.shutdown()
hvddp.init(comm=[0, 1] if world < 2 else [2])  # disjoint lists: separate worlds, as before the checks
assert hvddp.size() == (2 if world < 2 else 1)
parts = os.path.join(out_dir, "parts.json")  # each world's rank 0 writes: world 2's into parts.world2.json
hvddp.start_timeline(parts)
assert hvddp.allreduce(np.array([1.0]), op=hvddp.Sum, name="disjoint")[0] == hvddp.size()
hvddp.stop_timeline()
hvddp.shutdown()
if world == 2:  # (world 0's file is closed by now too: rank 0 passed stop_timeline before its shutdown)
    MPI.COMM_WORLD.Barrier()
    for name in ("parts.json", "parts.world2.json"):
        with open(os.path.join(out_dir, name)) as f:
            assert any(e.get("args", {}).get("name") == "allreduce.disjoint" for e in json.load(f)), name
else:
    MPI.COMM_WORLD.Barrier()
print(f"rank {world} init variants ok", flush=True)
