"""CUDA buffers as zero-copy CuPy arrays, and the truth about CUDA and NCCL.

Nothing here imports CuPy at ``import hvddp`` time: ``is_device_array`` looks only at protocol
attributes, and the rest imports CuPy when called. Framework tensors reach the core through
DLPack (or ``__cuda_array_interface__``) without a copy; the array keeps the producer's memory
alive for as long as the core holds it.

bfloat16: CuPy may have no bfloat16 dtype. A producer whose DLPack export CuPy refuses passes a
2-byte integer view of the same memory (torch: ``t.view(torch.int16)``) with
``dtype="bfloat16"``; the core then carries the bits as uint16 and never does arithmetic on
them outside its own kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any, NamedTuple, Optional, Tuple

from ..exceptions import BackendUnavailableError

__all__ = ["DEVICE_KIND", "Labeled", "DeviceInput", "describe", "cuda_built", "nccl_built", "nccl_version", "is_device_array",
           "as_device_array", "dtype_name", "ready_event", "device_index", "import_cupy"]

# What ``Request.device`` says for a device tensor. It must agree across ranks, so it names the
# kind only: rank 0 on cuda:0 and rank 1 on cuda:1 is the normal multi-GPU case.
DEVICE_KIND = "cuda"

_CUDA_DLPACK_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged

_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")


def import_cupy():
    """Return the ``cupy`` module, or raise BackendUnavailableError saying what to install."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            "CUDA tensors need CuPy: `pip install cupy-cuda12x` (or cupy-cuda13x, matching your "
            f"CUDA driver). Original error: {exc}") from exc
    return cupy


@functools.lru_cache(maxsize=1)
def cuda_built() -> bool:
    """Return True if CuPy is importable and sees at least one CUDA device."""
    try:
        if "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None:
            return False
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, a CuPy built for another CUDA
        return False


@functools.lru_cache(maxsize=1)
def nccl_version() -> int:
    """Return NCCL's version code (e.g. 22105 for 2.21.5), or 0 when NCCL is unusable."""
    if not cuda_built():
        return 0
    try:
        from cupy.cuda import nccl

        if not getattr(nccl, "available", False):
            return 0
        return int(nccl.get_version())
    except Exception:
        return 0


def nccl_built() -> bool:
    """Return True if CuPy's NCCL binding loads and a CUDA device is visible."""
    return nccl_version() > 0


def is_device_array(obj: Any) -> bool:
    """Return True if ``obj`` exposes CUDA memory (``__cuda_array_interface__`` or DLPack on CUDA).

    Looks at attributes only: cheap, and imports nothing.
    """
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    probe = getattr(obj, "__dlpack_device__", None)
    if probe is None:
        return False
    try:
        return int(probe()[0]) in _CUDA_DLPACK_DEVICES
    except Exception:
        return False


def dtype_name(array: Any, dtype: Optional[str] = None) -> str:
    """The hvddp dtype name of a CuPy array (``dtype`` overrides, for bfloat16 bit views)."""
    if dtype is not None:
        if dtype != "bfloat16":
            raise ValueError(f"dtype= may only be 'bfloat16' (to label a 2-byte integer view), got {dtype!r}.")
        if array.dtype.itemsize != 2 or array.dtype.kind not in "iu":
            raise TypeError(f"dtype='bfloat16' labels a 2-byte integer view, got an array of {array.dtype}.")
        return "bfloat16"
    name = str(array.dtype)
    if name == "bfloat16":
        return name
    if name not in _NAMES:
        raise TypeError(f"device array has dtype {name}, which hvddp does not support; supported: "
                        f"{', '.join(_NAMES)}, bfloat16. Cast it first.")
    return name


class Labeled:
    """A device tensor with a dtype CuPy cannot express: ``Labeled(t.view(torch.int16), "bfloat16")``.

    Adapters pass this to the core's collectives; ``is_device_array`` and ``as_device_array``
    see through it.
    """

    __slots__ = ("obj", "dtype")

    def __init__(self, obj: Any, dtype: str) -> None:
        if dtype != "bfloat16":
            raise ValueError(f"Labeled only carries 'bfloat16', got {dtype!r}.")
        self.obj = obj
        self.dtype = dtype

    def __dlpack_device__(self):
        probe = getattr(self.obj, "__dlpack_device__", None)
        if probe is not None:
            return probe()
        return (2, 0) if hasattr(self.obj, "__cuda_array_interface__") else (1, 0)


def as_device_array(obj: Any, dtype: Optional[str] = None) -> Tuple[Any, str]:
    """View a CUDA tensor as a CuPy array without copying; return ``(array, "cuda:N")``.

    Args:
        obj: a CuPy array, or anything exporting DLPack or ``__cuda_array_interface__`` on CUDA
            (torch, JAX, Numba, ...).
        dtype: ``"bfloat16"`` to label a 2-byte integer view of bfloat16 data; the returned
            array is then a uint16 view.

    Raises:
        BackendUnavailableError: CuPy is not installed.
        TypeError: not a CUDA tensor, or a dtype hvddp does not support.
    """
    if isinstance(obj, Labeled):
        obj, dtype = obj.obj, obj.dtype
    cupy = import_cupy()
    if isinstance(obj, cupy.ndarray):
        array = obj
    else:
        array = None
        errors = []
        if hasattr(obj, "__dlpack__"):
            try:
                array = cupy.from_dlpack(obj)
            except Exception as exc:  # e.g. bfloat16 on a CuPy without it
                errors.append(f"DLPack: {exc}")
        if array is None and hasattr(obj, "__cuda_array_interface__"):
            try:
                array = cupy.asarray(obj)  # zero copy through the interface
            except Exception as exc:
                errors.append(f"__cuda_array_interface__: {exc}")
        if array is None:
            hint = (" For bfloat16 pass a 2-byte integer view and dtype='bfloat16' (torch: "
                    "t.view(torch.int16))." if "bfloat16" in " ".join(errors) else "")
            raise TypeError(f"cannot view {type(obj).__name__} as a CUDA array without a copy "
                            f"({'; '.join(errors) or 'it exports neither DLPack nor __cuda_array_interface__'})."
                            + hint)
    name = dtype_name(array, dtype)
    if name == "bfloat16" and array.dtype.kind in "iu":
        array = array.view(cupy.uint16)
    return array, f"{DEVICE_KIND}:{array.device.id}"


class DeviceInput(NamedTuple):
    """A device tensor as the core takes it: the CuPy view, its device and its hvddp dtype name.

    ``ndim``/``shape``/``dtype`` read like an array's, so argument checks written for numpy
    arrays apply unchanged (``dtype`` is the storage dtype: uint16 for bfloat16).
    """

    array: Any
    device: str
    dtype_name: str

    @property
    def ndim(self) -> int:
        return self.array.ndim

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape)

    @property
    def dtype(self):
        return self.array.dtype


def describe(obj: Any) -> DeviceInput:
    """The ``DeviceInput`` of a device tensor or a ``Labeled`` one (what ``ops`` calls).

    The dtype name survives the uint16 view of bfloat16.
    """
    label = obj.dtype if isinstance(obj, Labeled) else None
    array, dev = as_device_array(obj)
    return DeviceInput(array, dev, label or dtype_name(array))


def device_index(device: str) -> int:
    """``"cuda:3"`` -> 3; ``"cuda"`` -> 0."""
    kind, _, index = device.partition(":")
    if kind != DEVICE_KIND or (index and not index.isdigit()):
        raise ValueError(f"not a CUDA device string: {device!r} (expected 'cuda' or 'cuda:N').")
    return int(index) if index else 0


def _as_stream(stream: Any, device_id: int):
    """A CuPy stream for a CuPy stream, a torch/other stream object or a raw pointer."""
    cupy = import_cupy()
    if stream is None:
        with cupy.cuda.Device(device_id):
            return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream, device_id)
    ptr = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if isinstance(ptr, int):
        return cupy.cuda.ExternalStream(ptr, device_id)
    if hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    raise TypeError(f"stream must be a CuPy stream, a torch.cuda.Stream, an object with "
                    f"__cuda_stream__ or a raw pointer, got {type(stream).__name__}.")


def ready_event(array: Any, stream: Any = None):
    """Record, on the producer's stream, the event after which ``array`` holds its values.

    Call it on the submitting thread. ``stream`` is the stream that wrote ``array`` (torch:
    ``torch.cuda.current_stream()``); by default CuPy's current stream on the array's device,
    which is the legacy default stream unless the caller changed it, and so also orders after
    torch's default stream.
    """
    cupy = import_cupy()
    device_id = array.device.id
    with cupy.cuda.Device(device_id):  # an event must belong to its stream's device
        event = cupy.cuda.Event(block=True, disable_timing=True)
        event.record(_as_stream(stream, device_id))
    return event
