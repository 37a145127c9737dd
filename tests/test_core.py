"""The numpy core under real mpiexec (2 and 3 ranks), and its single-process behaviour."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, run, run_pytest


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_core_collectives(np_):
    run_pytest(np_, "tests/mpi_core.py", timeout=300)


@pytest.mark.parametrize("np_", [2, 4])
def test_core_collectives_through_cross_memory_for_every_size(np_):
    """Threshold 0: every allreduce group takes the single-copy path (ops, dtypes, join, sets).

    Four ranks: three peers share the scratch array, in regions of an odd size. (At 3 ranks the
    default threshold's run, test_core_collectives[3], takes that path for its large arrays.)"""
    run_pytest(np_, "tests/mpi_core.py", timeout=300, env={"HVDDP_CMA_THRESHOLD": "0"})


def test_core_collectives_with_cross_memory_off():
    run_pytest(2, "tests/mpi_core.py", timeout=300, env={"HVDDP_CMA": "0"},
               extra=["-k", "large or cross_memory or join or process_set"])


def test_cross_memory_falls_back_together_and_fails_on_every_rank():
    out = run(2, [os.path.join(ROOT, "tests", "mpi_core_cma.py")], timeout=60).stdout
    assert out.count("fallback ok") == 2 and out.count(": recovered ok") == 2, out
    assert "failed on this rank: [Errno 14] simulated" in out, out
    assert "failed on rank 1 of the process set" in out, out
    assert out.count("staged failure raised") == 2 and out.count("staged recovered ok") == 2, out
    assert "failed on this rank: [Errno 14] simulated: bad address in a later chunk" in out, out


def _python(code, env=None, timeout=60):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


def test_import_hvddp_pulls_no_framework():
    code = ("import sys, hvddp; bad = [m for m in ('torch', 'tensorflow', 'keras', 'jax', 'cupy') "
            "if m in sys.modules]; assert not bad, bad; print('clean')")
    result = _python(code)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr


# Names Horovod 0.28.1's packages export that a ported script may use, per hvddp package
HOROVOD_NAMES = {
    "hvddp": "init shutdown is_initialized rank size local_rank local_size cross_rank cross_size "
             "is_homogeneous mpi_threads_supported mpi_built mpi_enabled nccl_built cuda_built gloo_built "
             "gloo_enabled ccl_built ddl_built rocm_built start_timeline stop_timeline",
    "hvddp.torch": "HorovodInternalError Compression DistributedOptimizer SyncBatchNorm allreduce_async_ "
                   "grouped_allreduce_async_ sparse_allreduce_async broadcast_async_ grouped_reducescatter_async "
                   "broadcast_parameters broadcast_optimizer_state gloo_built rocm_built start_timeline elastic "
                   "HostsUpdatedInterrupt",
    "hvddp.keras": "DistributedOptimizer callbacks elastic load_model broadcast_global_variables allreduce allgather "
                   "reducescatter broadcast gloo_built gloo_enabled ccl_built ddl_built rocm_built start_timeline "
                   "stop_timeline HorovodInternalError",
    "hvddp.tensorflow.keras": "DistributedOptimizer callbacks elastic load_model broadcast_global_variables allreduce "
                              "allgather reducescatter broadcast gloo_built ccl_built rocm_built HorovodInternalError",
    "hvddp.tensorflow": "DistributedGradientTape SyncBatchNormalization broadcast_variables allreduce grouped_allreduce allgather "
                        "broadcast alltoall reducescatter gloo_built ccl_built rocm_built start_timeline "
                        "stop_timeline grouped_allgather grouped_reducescatter DistributedOptimizer "
                        "broadcast_global_variables elastic HorovodInternalError",
}


# modules checked in one process each; the three that load TensorFlow share one (as three
# processes they took 10.7-16.1 s each under `pytest --durations`, as one 12.7 s)
EXPORT_GROUPS = [["hvddp"], ["hvddp.torch"], ["hvddp.keras", "hvddp.tensorflow", "hvddp.tensorflow.keras"]]
# run first in the Keras group's process (KERAS_BACKEND=torch), which then needs no Keras start-up
# of its own: hvddp.keras imports only the active backend's framework (here torch, never TensorFlow)
BEFORE = {"hvddp.keras": (
    "import sys, keras\nbefore = {m for m in ('tensorflow', 'jax', 'torch') if m in sys.modules}\n"
    "import hvddp.keras\n"
    "after = {m for m in ('tensorflow', 'jax', 'torch') if m in sys.modules}\n"
    "assert after == before and 'tensorflow' not in after, (before, after)\n"
    "import hvddp.keras._backend, hvddp.keras.callbacks\n"
    "assert 'hvddp.tensorflow' not in sys.modules\n"
    "print('hvddp.keras imports no other framework')\n")}


@pytest.mark.parametrize("modules", EXPORT_GROUPS, ids=lambda g: g[0])
def test_every_exported_name_resolves_and_horovods_names_are_there(modules):
    assert sorted(m for g in EXPORT_GROUPS for m in g) == sorted(HOROVOD_NAMES)
    framework = {"hvddp.torch": "torch", "hvddp.keras": "tensorflow"}.get(modules[0])
    if framework and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    code = BEFORE.get(modules[0], "") + "import importlib\nimport hvddp.exceptions as e\n"
    for module in modules:
        code += (f"m = importlib.import_module({module!r})\n"
                 f"missing = [n for n in m.__all__ + {HOROVOD_NAMES[module].split()!r} if not hasattr(m, n)]\n"
                 f"assert not missing, ({module!r}, missing)\n"
                 f"assert set(e.__all__) <= set(m.__all__), ({module!r}, set(e.__all__) - set(m.__all__))\n"
                 "assert not any(getattr(m, q)() for q in ('gloo_built', 'gloo_enabled', 'ccl_built', 'rocm_built'))\n"
                 f"print({module!r}, 'names ok')\n")
    result = _python(code, env={"KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for module in modules:
        assert f"{module} names ok" in result.stdout, result.stdout
    if modules[0] in BEFORE:
        assert "imports no other framework" in result.stdout, result.stdout


def test_output_pool_reuses_an_array_only_once_nothing_else_refers_to_it():
    """The pool's free test is a reference count, measured rather than assumed to be 3 (Python
    3.14 counts a call's borrowed argument differently: a held result could have been reused)."""
    import numpy as np

    from hvddp.engine.pool import OutputPool

    pool = OutputPool()
    first = pool.empty((4,), np.float32)
    address = first.ctypes.data
    assert pool.empty((4,), np.float32).ctypes.data != address  # held: a new array
    view = first[1:]
    del first
    assert all(pool.empty((4,), np.float32).ctypes.data != address for _ in range(3))  # a view holds it
    del view
    assert pool.empty((4,), np.float32).ctypes.data == address  # free: reused


def test_integer_scaling_divides_exactly_toward_zero():
    """An integer Average over k ranks is sum / k truncated toward zero, exactly: in float64,
    (49 * m) * (1 / 49) falls just below m for many m, and integers above 2**53 round."""
    import numpy as np

    from hvddp.engine.executor import _scaled_copy

    for k in range(2, 200):
        sums = np.arange(-60, 61, dtype=np.int64) * k + np.array([0, 1, -1] * 40 + [k - 1])
        out = np.empty_like(sums)
        _scaled_copy(out, sums, 1.0 / k)
        np.testing.assert_array_equal(out, [int(s / k) for s in sums.tolist()],
                                      err_msg=f"k={k}")
    big = np.array([2**62 + 2**61 + 3, -(2**62) - 1], dtype=np.int64)
    out = np.empty_like(big)
    _scaled_copy(out, big, 0.5)
    assert out.tolist() == [(2**62 + 2**61 + 3) // 2, -(2**61)]
    tiny = np.array([-128, -7, 7, 127], dtype=np.int8)  # 200 ranks: the divisor fits no int8
    out = np.ones_like(tiny)
    _scaled_copy(out, tiny, 1.0 / 200)
    assert out.tolist() == [0, 0, 0, 0]
    small = np.array([7, -7], dtype=np.int32)
    _scaled_copy(small, small, 0.3)  # not 1/k: float64 math, truncated
    assert small.tolist() == [2, -2]


def test_calls_before_init_raise_clearly():
    code = ("import hvddp, numpy as np\n"
            "for f in (hvddp.rank, hvddp.size, lambda: hvddp.allreduce(np.ones(2))):\n"
            "    try:\n        f()\n    except hvddp.NotInitializedError as e:\n        print('ERR', e)\n")
    result = _python(code)
    assert result.stdout.count("ERR hvddp is not initialized: call hvddp.init() first") == 3, result


def test_a_child_process_is_told_to_take_the_rank_from_its_parent():
    """A process started by multiprocessing with 'spawn' (a DataLoader worker so started) imports
    hvddp afresh: hvddp.init() there, which the message advised, would start another MPI job."""
    code = ("import multiprocessing, hvddp\n"
            "if __name__ == '__main__':\n"
            "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
            "        try:\n            pool.apply(hvddp.rank)\n"
            "        except hvddp.NotInitializedError as e:\n            print('CHILD', e)\n"
            "    try:\n        hvddp.rank()\n"
            "    except hvddp.NotInitializedError as e:\n        print('PARENT', e)\n")
    result = _python(code)
    child = [line for line in result.stdout.splitlines() if line.startswith("CHILD ")]
    assert len(child) == 1, result
    assert "child process" in child[0] and "DataLoader worker" in child[0], child
    assert "in the parent and pass it on" in child[0] and "worker_init_fn" in child[0], child
    assert "call hvddp.init() first" not in child[0], child  # (the wrong advice there)
    parent = [line for line in result.stdout.splitlines() if line.startswith("PARENT ")]
    assert parent == ["PARENT hvddp is not initialized: call hvddp.init() first (after hvddp.shutdown(), "
                      "init() again)."], result


@pytest.mark.parametrize("var,value", [("HVDDP_FUSION_THRESHOLD", "lots"), ("HOROVOD_CYCLE_TIME", "-1"),
                                       ("HVDDP_STALL_CHECK_DISABLE", "maybe"), ("HVDDP_LOG_LEVEL", "LOUD")])
def test_bad_config_value_names_the_variable(var, value):
    result = _python("import hvddp; hvddp.init()", env={var: value})
    assert result.returncode != 0
    assert f"{var}={value!r}" in result.stderr, result.stderr


def test_horovod_names_are_aliases():
    code = "from hvddp import config; c = config.from_env(); print(c.cycle_time_ms, c.fusion_threshold_bytes)"
    result = _python(code, env={"HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_FUSION_THRESHOLD": "1000",
                                "HVDDP_FUSION_THRESHOLD": "2000"})
    assert result.stdout.split() == ["2.5", "2000"], result


def test_variables_that_set_nothing_are_named_once_by_rank_0():
    """A Horovod user's HOROVOD_HIERARCHICAL_ALLREDUCE or a misspelt HVDDP_ name was ignored
    without a word; the known names under either prefix, and hvddp's own channels, are quiet."""
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HVDDP_FUSION_THRESHOLDS": "5", "HOROVOD_CYCLE_TIME": "2",
           "HVDDP_CACHE_CAPACITY": "64", "HVDDP_RUNNER_STATUS_DIR": ""}
    out = run(2, ["-c", "import hvddp; hvddp.init(); hvddp.barrier()"], timeout=60, env=env,
              python_module_mpi4py=False).stdout
    warning = ("WARNING: these environment variables set nothing in hvddp and are ignored: "
               "HOROVOD_HIERARCHICAL_ALLREDUCE, HVDDP_FUSION_THRESHOLDS (its settings: README.md, "
               "'Environment variables')")
    assert out.count(warning) == 1 and "[hvddp rank 0] " + warning in out, out
    from hvddp import config

    assert config.ignored({"HOROVOD_FUSION_THRESHOLD": "1", "HVDDP_OVERLAP": "0", "PATH": "/bin"}) == []


def test_launcher_mismatch_is_refused():
    result = _python("import hvddp; hvddp.init()", env={"OMPI_COMM_WORLD_SIZE": "2"})
    assert result.returncode != 0
    assert "LauncherMismatchError" in result.stderr and "OMPI_COMM_WORLD_SIZE=2" in result.stderr, result.stderr


def test_numpy_example_matches_one_process():
    out = run(2, [os.path.join(ROOT, "examples", "numpy_least_squares.py"), "--steps", "500"], timeout=60).stdout
    match = re.search(r"ranks: 2  distributed MSE: ([0-9.]+)  closed form: ([0-9.]+)  max \|w - one process\|: "
                      r"(\S+)  replicas identical: (\w+)", out)
    assert match and float(match.group(3)) < 1e-9 and match.group(4) == "True", out


def test_log_levels_say_what_the_engine_does():
    """HVDDP_LOG_LEVEL=TRACE: rank 0's one INFO line with the job and settings, every rank's
    DEBUG line per negotiation round naming the tensors, and a TRACE line per cycle that ran
    collectives, counting those that came through the response cache; the default level
    (WARNING) prints none of them."""
    script = os.path.join(ROOT, "examples", "numpy_least_squares.py")
    out = run(2, [script], timeout=60, env={"HVDDP_LOG_LEVEL": "TRACE", "HVDDP_STALL_CHECK_DISABLE": "1"}).stdout
    info = [l for l in out.splitlines() if " INFO: initialized:" in l]
    assert len(info) == 1 and "[hvddp rank 0] INFO" in info[0] and "2 rank(s)" in info[0], out
    assert "fusion 1048576 bytes" in info[0] and "thread level" in info[0], info
    assert "stall check off," in info[0], info  # (it said "stall check 60 s")
    for r in (0, 1):
        assert f"[hvddp rank {r}] DEBUG: negotiation: sent 1 request(s) ('grad'); agreed 1 ('allreduce grad')" in out, out
        assert f"[hvddp rank {r}] TRACE: cycle: running 1 collective(s), 1 of them announced through the " \
               f"response cache: 'allreduce grad'" in out, out
    quiet = run(2, [script], timeout=60).stdout
    assert "[hvddp rank" not in quiet, quiet


def test_shutdown_fails_pending_handles_on_every_rank():
    script = os.path.join(ROOT, "tests", "mpi_core_shutdown.py")
    out = run(2, [script], timeout=60).stdout
    assert out.count("pending handle failed: ShutdownError") == 2, out
    assert out.count("submission after shutdown: ShutdownError") == 1, out
    assert out.count("bad timeout: ValueError") == 2, out
    assert out.count("numpy timeout: TimeoutError") == 1, out
    assert out.count("refusal before shutdown: MismatchError") == 2, out
    assert out.count("cycles ok") == 2, out


def test_stall_warning_then_error_on_every_rank():
    script = os.path.join(ROOT, "tests", "mpi_core_stall.py")
    started = time.monotonic()
    # (a 4 s check: the cached name is demoted 1 s after its submission, long enough to show if the
    # stall clock started only then)
    result = run(2, [script], timeout=60, check=False,
                 env={"HVDDP_STALL_CHECK_TIME_SECONDS": "4", "HVDDP_STALL_SHUTDOWN_TIME_SECONDS": "4.5"})
    out = result.stdout
    assert result.returncode != 0 and time.monotonic() - started < 20, out
    assert "stalled collectives" in out and "'step.7'" in out and "missing on ranks [1]" in out, out
    assert "'step.8'" in out and "missing on ranks [0]" in out, out
    assert "rank 0 StallError: " in out and "rank 1 StallError: " in out, out
    fatal = next(line for line in out.splitlines() if "rank 1 StallError: " in line)
    assert "allreduce 'warm' (waiting" in fatal and "'step.7'" in fatal, fatal  # the cached name too
    assert "allreduce 'step.7' on process set 1 (waiting" in fatal, fatal
    assert "allreduce 'step.7' (waiting" in fatal, fatal  # and the global set's, unqualified
    # submitted together, they have waited as long (the cached one's clock started at its demotion)
    waited = {n: float(re.search(rf"allreduce '{n}' \(waiting ([0-9.]+) s\)", fatal).group(1)) for n in ("warm", "step.7")}
    assert abs(waited["warm"] - waited["step.7"]) <= 0.3, fatal


def test_timeline_is_valid_chrome_trace(tmp_path):
    path = tmp_path / "timeline.json"
    run(2, [os.path.join(ROOT, "examples", "numpy_least_squares.py")], timeout=60,
        env={"HVDDP_TIMELINE": str(path), "HVDDP_TIMELINE_MARK_CYCLES": "1"})
    events = json.loads(path.read_text())
    names = {e["name"] for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", "CYCLE_START",
            "start_time_since_epoch_in_micros"} <= names, names
    rows = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert "allreduce.grad" in rows and "broadcast.w0" in rows, rows
    marks = [e for e in events if e["ph"] == "i" and e["name"] in ("0", "1")]
    assert {m["name"] for m in marks} == {"0", "1"}  # a ready mark per rank
    begins = sum(1 for e in events if e["ph"] == "B")
    ends = sum(1 for e in events if e["ph"] == "E")
    assert begins == ends > 0


def test_timeline_reaches_the_file_at_each_flush_and_a_write_error_only_stops_it(tmp_path, caplog):
    """Events are on disk once flushed (the engine flushes every cycle: a killed job keeps its
    trace up to its last cycle); a write that fails (a full disk) stops the timeline with one
    logged error, not the engine. A row per kind of operation on a name, a join's row named
    as a join, and nothing kept per name once its spans have ended."""
    from hvddp.timeline import Timeline

    path = tmp_path / "live.json"
    timeline = Timeline(0)
    timeline.start(str(path))
    timeline.negotiate_start((0, "grad"), "allreduce")
    timeline.negotiate_rank_ready((0, "grad"), 0, "allreduce")
    timeline.negotiate_rank_ready((0, "grad"), 0, "allreduce")  # announced cached, then sent: one mark
    timeline.flush()
    on_disk = path.read_text()  # not closed: what a killed job would leave
    assert "NEGOTIATE_ALLREDUCE" in on_disk and "allreduce.grad" in on_disk, on_disk
    assert on_disk.count('"args": {"rank": 0}') == 1, on_disk
    timeline.activities([(0, "grad")], "MPI_ALLREDUCE")
    timeline.end([(0, "grad")])
    timeline.negotiate_start((0, "grad"), "broadcast")  # the same name, another kind: its own row
    timeline.activity((0, "grad"), "MPI_BROADCAST")
    timeline.end([(0, "grad")])
    timeline.activity((0, "__join__"), "MPI_JOIN")  # not negotiated
    timeline.end([(0, "__join__")])
    assert not timeline._open_spans and not timeline._ready
    timeline.flush()
    rows = [json.loads(line.rstrip(",\n"))["args"]["name"] for line in path.read_text().splitlines()
            if '"process_name"' in line]
    assert rows == ["hvddp engine", "allreduce.grad", "broadcast.grad", "join.__join__"], rows

    real, before = timeline._file, path.read_text()

    class Full:  # the disk fills in the middle of a cycle's text: half of it reaches the file
        def write(self, text):
            real.write(text[:len(text) // 2])
            real.flush()
            raise OSError(28, "No space left on device")

        def close(self):
            real.close()
            raise OSError(28, "No space left on device")

    timeline._file = Full()
    with caplog.at_level("ERROR", logger="hvddp"):
        timeline.negotiate_rank_ready((0, "grad"), 0, "allreduce")  # fails: gives up, raises nothing
        timeline.negotiate_end((0, "grad"))
        timeline.close()
    assert not timeline
    assert [r.getMessage() for r in caplog.records].count(
        f"writing the timeline {path} failed ([Errno 28] No space left on device); no more timeline "
        f"events are written") == 1, caplog.text
    # cut back to the last whole cycle (it ended inside an event, and no recipe made it load)
    assert path.read_text() == before
    assert json.loads(before.rstrip().rstrip(",") + "]")


def test_process_sets_removed_in_flight_unnamed_calls_and_init_lists(tmp_path):
    env = {"HVDDP_STALL_CHECK_TIME_SECONDS": "1", "HVDDP_STALL_SHUTDOWN_TIME_SECONDS": "20"}
    out = run(3, [os.path.join(ROOT, "tests", "mpi_core_sets.py"), str(tmp_path)], timeout=120, env=env).stdout
    assert out.count("sets ok") == 3, out
    assert "'orphan'" not in out.replace("allreduce 'orphan': its process set", ""), out  # no stall warning


def test_init_variants_and_dynamic_timeline(tmp_path):
    out = run(3, [os.path.join(ROOT, "tests", "mpi_core_init.py"), str(tmp_path)], timeout=90,
              env={"HVDDP_TIMELINE": "DYNAMIC"}).stdout
    assert out.count("init variants ok") == 3, out


def test_allreduce_benchmark_runs_and_checks_its_results():
    """benchmarks/allreduce.py (its figures are in the README) keeps working: one round of each
    workload, and its own check that hvddp's sums equal raw MPI's."""
    out = run(2, [os.path.join(ROOT, "benchmarks", "allreduce.py"), "--rounds", "1", "--warmup", "0"],
              timeout=120).stdout
    out = re.sub(r"\[\d+\] ", "", out)  # mpiexec's rank prefixes (per chunk of output, not per line)
    out = re.sub(r"^\[\d+,\d+\]<std(?:out|err)>: ?", "", out, flags=re.M)  # Open MPI's --tag-output, per line
    for label in ("200 x 100 KiB", "800 x 25 KiB", "ResNet-50 mix"):
        assert f"{label}: " in out and "checked against raw MPI" in out, out
    rows = re.findall(r"^\s+(raw per-array|raw hand-fused|contiguous|hvddp in place|hvddp|raw out of place)"
                      r"\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x$", out, flags=re.M)
    assert len(rows) == 18, out


@pytest.mark.parametrize("script, flags, message", [
    ("allreduce.py", ["--rounds", "0"], "--rounds must be >= 1, got 0."),
    ("allreduce.py", ["--warmup", "-1"], "--warmup must be >= 0, got -1."),
    ("cma_sizes.py", ["--rounds", "0"], "--rounds must be >= 1, got 0.")])
def test_benchmarks_refuse_bad_counts(script, flags, message):
    """A count that leaves nothing to time is named at once (the table came out as nan, with
    numpy's RuntimeWarnings, after the whole run)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script)] + flags, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
