"""Torch tensors to core buffers and back, zero-copy on CPU; the adapter's handle type."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

import hvddp
from hvddp._dtypes import bfloat16

log = logging.getLogger("hvddp")

_NUMPY_OF = {
    torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.float16: np.float16, torch.bfloat16: None,  # (ml_dtypes', imported on first use: hvddp._dtypes)
    torch.float32: np.float32, torch.float64: np.float64, torch.bool: np.bool_,
}
SUPPORTED = ", ".join(str(d).replace("torch.", "") for d in _NUMPY_OF)
_warned_staging = False


class TensorArgumentError(TypeError):
    """An argument refused by hvddp.torch's own checks, before the numpy core saw the call. The
    collectives announce it through the core (``mpi_ops._announced``), so that ranks which made
    the call validly fail too instead of waiting for this one."""


def check_tensor(tensor: Any, fn: str, arg: str = "tensor") -> torch.Tensor:
    """Raise TensorArgumentError (a TypeError) unless ``tensor`` is a dense torch tensor of a
    supported dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TensorArgumentError(f"{fn}: {arg} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.layout != torch.strided:
        raise TensorArgumentError(f"{fn}: {arg} has layout {tensor.layout}; only dense tensors are "
                                  f"supported (use sparse_allreduce_async for sparse ones, or .to_dense()).")
    if tensor.dtype not in _NUMPY_OF:
        raise TensorArgumentError(f"{fn}: {arg} has dtype {tensor.dtype}, which hvddp does not support; "
                                  f"supported: {SUPPORTED}. Cast it first (e.g. tensor.float()).")
    if tensor.device.type == "meta":
        raise TensorArgumentError(f"{fn}: {arg} is on the meta device, which holds no values to "
                                  f"communicate; materialize it first (e.g. module.to_empty(device='cpu') "
                                  f"and initialize).")
    return tensor


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``tensor``'s values (itself when already on the CPU)."""
    global _warned_staging
    if tensor.device.type == "cpu":
        return tensor
    if not _warned_staging:
        _warned_staging = True
        log.warning("hvddp.torch: %s tensors are copied through host memory (%s).", tensor.device.type,
                    "install CuPy for the zero-copy CUDA path" if tensor.device.type == "cuda"
                    else "hvddp has no device path for them")
    return tensor.detach().to("cpu")


_cuda_core: Optional[bool] = None


def _on_core_device(tensor: torch.Tensor) -> bool:
    """True for a CUDA tensor when the core's device path (CuPy) is available."""
    global _cuda_core
    if tensor.device.type != "cuda":
        return False
    if _cuda_core is None:
        _cuda_core = bool(hvddp.cuda_built())
    return _cuda_core


def _device_view(tensor: torch.Tensor) -> Any:
    """A CUDA tensor as the core takes it, zero-copy (bfloat16 as labeled int16 bits)."""
    from hvddp.backends.device import Labeled

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return Labeled(tensor.view(torch.int16), "bfloat16")
    return tensor


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy), bfloat16 through an int16 view."""
    tensor = tensor.detach()
    if tensor.is_neg() or tensor.is_conj():
        tensor = tensor.resolve_neg().resolve_conj()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(bfloat16())
    return tensor.numpy()


def as_tensor(array: Any, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Wrap a core result (numpy, or CuPy on a device) as a torch tensor without a copy."""
    if not isinstance(array, np.ndarray):  # a device array from the core's CUDA path
        out = torch.from_dlpack(array)
        if like is not None and like.dtype == torch.bfloat16 and out.dtype != torch.bfloat16:
            out = out.view(torch.int16).view(torch.bfloat16)
        return out
    if not array.flags.writeable:
        array = array.copy()
    if array.dtype.kind == "V" and array.dtype.name == "bfloat16":  # (ml_dtypes'; .name alone costs 3 us)
        out = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(array)
    if like is not None and like.device.type != "cpu":
        out = out.to(like.device)
    return out


def source(tensor: torch.Tensor) -> Any:
    """The buffer an out-of-place collective reads: a view on CPU (and CUDA with CuPy), else a
    host copy."""
    if _on_core_device(tensor):
        return _device_view(tensor)
    return as_numpy(_staged(tensor))


def target(tensor: torch.Tensor) -> Tuple[Any, Optional[Callable[[], None]]]:
    """The buffer an in-place collective writes, and what copies it back to a staged tensor."""
    if _on_core_device(tensor):
        return _device_view(tensor), None
    staged = _staged(tensor)
    if staged is tensor and (tensor.is_neg() or tensor.is_conj()):
        # a lazily negated view (x.conj().imag): its numpy form is a resolved copy, so the result
        # must be copied back (copy_ honours the view), or the tensor would silently stay as it was
        staged = tensor.detach().resolve_neg().resolve_conj()
    if staged is tensor:
        return as_numpy(tensor), None
    return as_numpy(staged), lambda: tensor.data.copy_(staged)


# held while a handle converts its result (short: no waiting on collectives inside)
_FINISHING = threading.Lock()


class Handle:
    """The pending result of a torch collective; pass it to ``synchronize`` or ``poll``.

    It wraps one or more core handles and converts their numpy results to torch tensors on the
    thread that calls ``synchronize``.
    """

    __slots__ = ("name", "_handles", "_finish", "_done", "_result")

    def __init__(self, name: str, handles: Sequence[hvddp.Handle],
                 finish: Callable[[List[Any]], Any]) -> None:
        self.name = name
        self._handles = list(handles)
        self._finish = finish
        self._done = False
        self._result: Any = None

    def __repr__(self) -> str:
        return f"<hvddp.torch.Handle {self.name!r} {'done' if self.done() else 'pending'}>"

    def done(self) -> bool:
        """Return True once every part has completed (or failed); never blocks."""
        return self._done or all(h.done() for h in self._handles)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the torch result; raise the collective's error.

        Threads may wait on one handle together (as on the core's): the first one through
        converts the result, and every waiter returns that same result."""
        if not self._done:
            results = [h.wait(timeout) for h in self._handles]
            with _FINISHING:  # (a second waiter used to call the finisher the first had cleared)
                if not self._done:
                    self._result = self._finish(results)
                    self._done = True
                    self._handles = []
                    self._finish = None
        return self._result

    def __call__(self) -> Any:
        """``wait()``: Horovod's ``sparse_allreduce_async`` returns a function to call for the result."""
        return self.wait()
