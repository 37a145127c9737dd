"""The property-based bad-input test of mpi_faults_bad_input.py, through hvddp.torch.

Same drawn calls, same oracle; inputs are torch tensors (non-contiguous ones through numpy
strides and Fortran order), and anything that is not a dense tensor of a supported dtype
(numpy arrays, lists, Python numbers, complex and uint32 tensors) must be a TypeError naming it.
"""

from __future__ import annotations

from typing import List

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import hvddp.torch as hvd  # noqa: E402
import mpi_faults_bad_input as core

torch.set_num_threads(1)


class TorchBackend(core.NumpyBackend):
    lib = hvd

    def adjust(self, case: core.Case) -> core.Case:
        if case.layout in ("readonly", "scalar"):  # torch has neither; a 0-d tensor is just "C"
            case = case._replace(layout="C")
        if case.layout == "list" and case.shape == ():
            case = case._replace(layout="python")  # a Python number: not a tensor
        return case

    def problems(self, case: core.Case) -> List[tuple]:
        found = core.problems(case)
        if case.layout == "python" or case.dtype in ("object", "<U3"):
            found.append(((TypeError,), ["tensor"]))
        return found

    def make(self, array: np.ndarray, how: str):
        if how in ("list", "python"):
            return array.tolist()
        if array.dtype.kind in "OU":
            return array  # no torch dtype: the numpy array itself is the wrong argument
        array = core.layout(array, how)
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def to_numpy(self, value) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.dtype == torch.bfloat16:
                return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            return value.numpy()
        return np.asarray(value)


@pytest.mark.parametrize("group", list(core.KIND_GROUPS))
def test_torch_collectives_with_any_arguments(group):
    core.run_cases(core.KIND_GROUPS[group], TorchBackend())


def test_torch_non_contiguous_inplace_is_written_back():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + core.RANK
    view = base.t()  # non-contiguous
    out = hvd.allreduce_(view, name="torch.noncontig", op=hvd.Sum)
    want = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * core.SIZE + sum(range(core.SIZE))).t()
    assert out is view and torch.equal(view, want) and torch.equal(base.t(), want)
