"""Bad settings and bad arguments fail clearly on every rank; never a crash, hang or wrong number."""

from __future__ import annotations

import re
import subprocess

from hvddp import config
from mpirun import mpiexec, run, run_pytest
import mpi_faults_bad_config as bad


def test_every_variable_has_bad_values_under_test():
    assert set(bad.BAD_VALUES) | set(bad.USED_AT_INIT) == set(config.VARIABLES)


def test_bad_config_fails_at_init_naming_variable_and_value():
    result = run(2, ["tests/mpi_faults_bad_config.py"], timeout=120)
    expected = sum(len(v) + 1 for v in bad.BAD_VALUES.values())
    assert result.stdout.count(f"BADCONFIG OK {expected}") == 2, result.stdout


def test_bad_timeline_path_fails_on_every_rank():
    """HVDDP_TIMELINE parses as any text; a path rank 0 cannot create must fail every rank,
    naming the variable set (HOROVOD_TIMELINE's error told the user to fix HVDDP_TIMELINE)."""
    result = run(2, ["tests/mpi_faults_bad_config.py", "timeline"], timeout=60, check=False)
    # (each record ends in <end>: mpiexec sometimes writes two ranks' lines as one)
    outcomes = re.findall(r"TIMELINE OUTCOME (\S+) (.*?) <end>", result.stdout)
    assert len(outcomes) == 4, result.stdout
    for variable, outcome in outcomes:
        assert outcome.startswith(f"ValueError: environment variable {variable}="), result.stdout
        assert outcome.endswith(f"Fix or unset {variable}."), result.stdout


def test_engine_variables_that_differ_across_ranks_fail_on_every_rank(tmp_path):
    result = run(2, ["tests/mpi_faults_bad_config.py", "disagree", str(tmp_path / "timeline.json")],
                 timeout=60)
    outcomes = re.findall(r"DISAGREE OUTCOME (.*?) <end>", result.stdout)
    assert len(outcomes) == 2, result.stdout
    for outcome in outcomes:
        assert outcome.startswith("ValueError") and "HOROVOD_CMA_THRESHOLD / HVDDP_CMA_THRESHOLD " \
            "differs" in outcome, outcome
        assert "rank 0: 1000 (HVDDP_CMA_THRESHOLD), rank 1: 1001 (HOROVOD_CMA_THRESHOLD)" in outcome, outcome
        # the fix in the launcher's own terms: hydra's -genv is an unknown option to Open MPI's
        # mpirun, which also forwards no exported variable to ranks on other nodes
        if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
            assert "mpirun -x HVDDP_CMA_THRESHOLD=..." in outcome and "-genv" not in outcome, outcome
        else:
            assert "mpiexec -genv HVDDP_CMA_THRESHOLD=..." in outcome, outcome


def test_hypothesis_bad_input_numpy_core_and_torch_adapter():
    """Every drawn call: the right answer or a clear ValueError/TypeError, alike on both ranks.

    Small MPI chunks make the large shapes take the chunked reduction path too.
    """
    result = run_pytest(2, "tests/mpi_faults_bad_input.py", timeout=300,
                        env={"HVDDP_MPI_CHUNK_BYTES": "262144"},
                        extra=["tests/mpi_faults_bad_input_torch.py"])
    assert result.stdout.count(" passed") >= 2 and " failed" not in result.stdout, result.stdout
