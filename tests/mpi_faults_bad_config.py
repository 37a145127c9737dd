"""Rank-side script of tests/test_bad_input.py: every HVDDP_* variable with bad values.

    mpiexec -n 2 python -m mpi4py tests/mpi_faults_bad_config.py

Each rank sets one bad value, calls hvddp.init(), and checks for a ValueError that names the
variable and the value; then a clean init() must still work. Prints `BADCONFIG OK <n>` per rank.
"""

from __future__ import annotations

import os
import sys
import time

# variable suffix -> values hvddp must reject at init()
BAD_VALUES = {
    "FUSION_THRESHOLD": ["64MB", "-1", ""],
    "MPI_CHUNK_BYTES": ["100", "4M", "99999999999999999999"],
    "CYCLE_TIME": ["fast", "-1", "nan", "inf", "1e300", "10001"],
    "CACHE_CAPACITY": ["-5", "1.5", "1048577"],
    "STALL_CHECK_DISABLE": ["maybe", "2", ""],
    "STALL_CHECK_TIME_SECONDS": ["-1", "60s"],
    "STALL_SHUTDOWN_TIME_SECONDS": ["inf", "abc"],
    "TIMELINE_MARK_CYCLES": ["2"],
    "LOG_LEVEL": ["LOUD", "3"],
    "GPU_OPERATIONS": ["GLOO"],
    "CMA": ["auto", ""],
    "CMA_THRESHOLD": ["1MB", "-2"],
    "OVERLAP": ["sometimes", "2", ""],
    "TIMELINE": ["", "  "],  # (an empty path was taken as unset)
}
# Checked separately (see test_bad_input.py): a value that parses but cannot be used.
USED_AT_INIT = {"TIMELINE": "/proc/nonexistent-hvddp/timeline.json"}


def main() -> None:
    import numpy as np

    import hvddp

    checked = 0
    for suffix, values in BAD_VALUES.items():
        for prefix in ("HVDDP_", "HOROVOD_"):
            name = prefix + suffix
            for value in values if prefix == "HVDDP_" else values[:1]:
                os.environ[name] = value
                try:
                    hvddp.init()
                except ValueError as exc:
                    text = str(exc)
                    assert name in text and repr(value) in text, f"{name}={value!r}: {text}"
                    checked += 1
                else:
                    raise AssertionError(f"{name}={value!r} was accepted by init()")
                finally:
                    del os.environ[name]
                assert not hvddp.is_initialized()
    hvddp.init()  # nothing was left half-initialized
    total = hvddp.allreduce(np.array([1.0 + hvddp.rank()]), name="after", op=hvddp.Sum)
    assert total.tolist() == [sum(range(1, hvddp.size() + 1))], total
    sys.stdout.write(f"BADCONFIG OK {checked}\n")
    sys.stdout.flush()


def timeline_main() -> None:
    import numpy as np

    import hvddp

    for variable in ("HVDDP_TIMELINE", "HOROVOD_TIMELINE"):  # the message names the one set
        os.environ[variable] = USED_AT_INIT["TIMELINE"]
        try:
            hvddp.init()
            outcome = "initialized"
            hvddp.allreduce_async(np.ones(1), name="x").wait(timeout=3)
        except Exception as exc:  # report whatever happened; the test decides
            outcome = f"{type(exc).__name__}: {exc}"
        del os.environ[variable]
        sys.stdout.write(f"TIMELINE OUTCOME {variable} {outcome} <end>\n")  # (ended: see test_bad_input)
        sys.stdout.flush()
        if not outcome.startswith("ValueError"):
            # A one-sided failure: exit handlers could wait for the peer, so leave without them,
            # after the peer (waiting 3 s above) has had time to report.
            time.sleep(4)
            os._exit(1)


def disagree_main() -> None:
    """Ranks set one engine variable differently: init() must refuse on every rank."""
    import hvddp

    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    # rank 1 under Horovod's name: the message must name the variable each rank read
    os.environ["HOROVOD_CMA_THRESHOLD" if rank == 1 else "HVDDP_CMA_THRESHOLD"] = str(1000 + rank)
    timeline = sys.argv[2]  # refused before it is opened: no half-written file is left
    os.environ["HVDDP_TIMELINE"] = timeline
    try:
        hvddp.init()
        outcome = "initialized"
    except ValueError as exc:
        outcome = f"ValueError: {exc}"
        assert not hvddp.is_initialized()
        assert not os.path.exists(timeline), timeline
    sys.stdout.write(f"DISAGREE OUTCOME {outcome} <end>\n")
    sys.stdout.flush()


if __name__ == "__main__":
    mode = sys.argv[1:]
    timeline_main() if mode == ["timeline"] else disagree_main() if mode[:1] == ["disagree"] else main()
