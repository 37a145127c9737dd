"""Every ``HVDDP_*`` environment variable, parsed once at ``init()`` into a frozen dataclass.

Each variable is also accepted under its Horovod name (``HVDDP_CYCLE_TIME`` ->
``HOROVOD_CYCLE_TIME``); when both are set the ``HVDDP_`` one wins. A value that does not parse
raises ``ValueError`` naming the variable, the value received and what is expected.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, List, Mapping, Optional

__all__ = ["Config", "from_env", "VARIABLES"]

_MIB = 1 << 20
_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


@dataclasses.dataclass(frozen=True)
class Config:
    """Engine settings; see README's table of environment variables."""

    fusion_threshold_bytes: int = 1 * _MIB
    mpi_chunk_bytes: int = 4 * _MIB
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    stall_check_disable: bool = False
    stall_check_time_s: float = 60.0
    stall_shutdown_time_s: float = 0.0
    timeline: str = ""
    timeline_mark_cycles: bool = False
    log_level: str = "WARNING"
    gpu_operations: str = "NCCL"
    cma: bool = True
    cma_threshold_bytes: int = 256 << 10
    overlap: Optional[bool] = None  # None: auto (see adapters/torch/optimizer.py)


def _int(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError("out of range")
        return value

    parse.expected = (f"an integer >= {minimum}" if maximum is None  # type: ignore[attr-defined]
                      else f"an integer from {minimum} to {maximum}")
    return parse


def _float(minimum: float, maximum: float = float("inf")) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        if not minimum <= value <= maximum or value == float("inf"):
            raise ValueError(f"must be >= {minimum}")
        return value

    parse.expected = (f"a finite number >= {minimum}" if maximum == float("inf")  # type: ignore[attr-defined]
                      else f"a number from {minimum} to {maximum}")
    return parse


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):  # (not "": HVDDP_CMA= turned the default on off, while
        return False                                # an empty number raised; unset it instead)
    raise ValueError("not a boolean")


_bool.expected = "one of 1/0/true/false/yes/no/on/off"  # type: ignore[attr-defined]


def _auto_bool(text: str) -> Optional[bool]:
    return None if text.strip().lower() == "auto" else _bool(text)


_auto_bool.expected = "auto, or one of 1/0/true/false/yes/no/on/off"  # type: ignore[attr-defined]


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().upper()
        if value not in choices:
            raise ValueError("not a known choice")
        return value

    parse.expected = "one of " + ", ".join(choices)  # type: ignore[attr-defined]
    return parse


def _text(text: str) -> str:
    value = text.strip()  # ("DYNAMIC " was opened as a file of that name)
    if not value:  # (an empty value was taken as unset, where every other variable raises)
        raise ValueError("empty")
    return value


_text.expected = "a path or DYNAMIC"  # type: ignore[attr-defined]

# variable suffix -> (dataclass field, parser)
VARIABLES: Mapping[str, tuple] = {
    "FUSION_THRESHOLD": ("fusion_threshold_bytes", _int(0)),
    "MPI_CHUNK_BYTES": ("mpi_chunk_bytes", _int(1024, (1 << 31) - 1)),  # (an MPI count is an int)
    # a cycle sleeps this long while idle: beyond 10 s a job only looks hung (1e300 crashed the loop)
    "CYCLE_TIME": ("cycle_time_ms", _float(0.0, 10000.0)),
    # every cycle's negotiation carries a bit per cache slot: a million slots is 128 KiB
    "CACHE_CAPACITY": ("cache_capacity", _int(0, 1 << 20)),
    "STALL_CHECK_DISABLE": ("stall_check_disable", _bool),
    "STALL_CHECK_TIME_SECONDS": ("stall_check_time_s", _float(0.0)),
    "STALL_SHUTDOWN_TIME_SECONDS": ("stall_shutdown_time_s", _float(0.0)),
    "TIMELINE": ("timeline", _text),
    "TIMELINE_MARK_CYCLES": ("timeline_mark_cycles", _bool),
    "LOG_LEVEL": ("log_level", _choice(*_LOG_LEVELS)),
    "GPU_OPERATIONS": ("gpu_operations", _choice("NCCL", "MPI")),
    "CMA": ("cma", _bool),
    "CMA_THRESHOLD": ("cma_threshold_bytes", _int(0)),
    "OVERLAP": ("overlap", _auto_bool),
}


# hvddp's own, not settings: hvddprun's channel to its ranks, and its tests' and benchmarks' switches
_NOT_SETTINGS = ("HVDDP_RUNNER_STATUS_DIR", "HVDDP_TEST_", "HVDDP_FAKE_", "HVDDP_GPU_CHECK_")


def ignored(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The ``HVDDP_*`` and ``HOROVOD_*`` variables set in ``environ`` that set nothing in hvddp.

    A Horovod user's ``HOROVOD_HIERARCHICAL_ALLREDUCE``, ``HOROVOD_AUTOTUNE`` or a misspelt
    ``HVDDP_FUSION_THRESHOLDS`` would otherwise be ignored without a word.
    """
    environ = os.environ if environ is None else environ
    names = []
    for name in environ:
        for prefix in ("HVDDP_", "HOROVOD_"):
            if (name.startswith(prefix) and name[len(prefix):] not in VARIABLES
                    and not name.startswith(_NOT_SETTINGS)):
                names.append(name)
    return sorted(names)


def _lookup(environ: Mapping[str, str], suffix: str) -> Optional[tuple]:
    for prefix in ("HVDDP_", "HOROVOD_"):
        name = prefix + suffix
        if name in environ:
            return name, environ[name]
    return None


def variable_name(suffix: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The name a setting was given under (``HOROVOD_`` or ``HVDDP_``; ``HVDDP_`` if unset)."""
    found = _lookup(os.environ if environ is None else environ, suffix)
    return found[0] if found else "HVDDP_" + suffix


def from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Parse the ``HVDDP_*`` (or ``HOROVOD_*``) variables into a ``Config``.

    Args:
        environ: the mapping to read; ``os.environ`` by default.

    Returns:
        The settings, defaults filled in.

    Raises:
        ValueError: a variable is set to a value that does not parse; the message names it.
    """
    environ = os.environ if environ is None else environ
    values = {}
    for suffix, (field, parse) in VARIABLES.items():
        found = _lookup(environ, suffix)
        if found is None:
            continue
        name, raw = found
        try:
            values[field] = parse(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={raw!r} is not valid: expected {parse.expected}. "
                f"Fix or unset {name}."
            ) from None
    return Config(**values)
