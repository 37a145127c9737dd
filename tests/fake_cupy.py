"""A host-memory stand-in for the parts of CuPy that hvddp's GPU path uses, for CPU tests.

Not a mock of hvddp's collaborators: "device" arrays are numpy arrays whose ``.data.ptr`` is
their host address, ``cupy.RawKernel`` runs hvddp's own kernel text compiled by g++ (see
``compile_kernels``), and the NCCL stand-in moves bytes with real MPI (mpi4py) between real
processes. What it cannot check is timing: kernels, copies and NCCL calls complete at once,
so stream ordering is not exercised (``Event.done`` is True after ``record``).

Usage: ``install(kernel_library_path)`` before the GPU modules import CuPy.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import types
from typing import List, Optional

import numpy as np

from hvddp.backends import gpu_pack
from hvddp.backends.gpu_pack import mpi_wire_dtype, nccl_wire_dtype

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64")
PAIRS = sorted({(d, d) for d in DTYPES}
               | {(d, nccl_wire_dtype(d)) for d in DTYPES} | {(nccl_wire_dtype(d), d) for d in DTYPES}
               | {(d, mpi_wire_dtype(d)) for d in DTYPES} | {(mpi_wire_dtype(d), d) for d in DTYPES}
               | {("bfloat16", "float32"), ("float32", "bfloat16")})

SHIM = r"""
#include <cmath>
#include <cstring>
struct hv_dim { long long x; };
static hv_dim blockIdx, threadIdx, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
using std::trunc;
using std::llround;
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float hv_h2f(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short hv_f2h(float f) {
    _Float16 x = (_Float16)f; unsigned short h; std::memcpy(&h, &x, 2); return h; }
"""


def compile_kernels(directory: str) -> Optional[str]:
    """Compile every kernel hvddp can launch, with a driver per kernel; return the .so path.

    Returns None when g++ is missing. The only lines not taken from ``gpu_pack`` are the two PTX
    half conversions, replaced by ``_Float16`` (round to nearest even, as ``cvt.rn``).
    """
    cxx = shutil.which("g++")
    if cxx is None:
        return None
    parts = [SHIM, gpu_pack.BF16_PRELUDE]
    for s, d in PAIRS:
        name = gpu_pack.kernel_name(s, d)
        parts.append(gpu_pack.kernel_source(s, d, prelude=False))
        parts.append(f"""
extern "C" void run_{name}(const long long* t, long long n, long long nb, double scale, int scaled) {{
    blockDim.x = {gpu_pack.BLOCK_THREADS};
    for (long long b = 0; b < nb; ++b) {{ blockIdx.x = b;
        for (long long th = 0; th < blockDim.x; ++th) {{ threadIdx.x = th; {name}(t, n, nb, scale, scaled); }} }}
}}""")
    src = os.path.join(directory, "kernels.cpp")
    lib = os.path.join(directory, "kernels.so")
    with open(src, "w") as f:
        f.write("\n".join(parts))
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", lib, src], check=True,
                   capture_output=True, timeout=120)
    return lib


# Arrays -------------------------------------------------------------------------------------
class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Dev:
    __slots__ = ("id",)

    def __init__(self, i: int = 0) -> None:
        self.id = i


class ndarray(np.ndarray):
    """A "device" array: numpy memory, CuPy's ``.data.ptr``/``.device``/``.get``/``.set``."""

    @property
    def data(self):  # type: ignore[override]
        return _Ptr(self.__array_interface__["data"][0])

    @property
    def device(self):
        return _Dev(0)

    @property
    def __cuda_array_interface__(self):  # so that hvddp.ops routes it to the device path
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "version": 3, "strides": None if self.flags.c_contiguous else self.strides}

    def get(self, stream=None, order="C", out=None, blocking=True):
        host = np.asarray(self).view(np.ndarray)
        if out is None:
            return host.copy()
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"out has shape {out.shape} {out.dtype}, array {self.shape} {self.dtype}")
        np.copyto(out, host)
        return out

    def set(self, arr, stream=None):
        arr = np.asarray(arr)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: shape/dtype {arr.shape} {arr.dtype} != {self.shape} {self.dtype}")
        np.copyto(self.view(np.ndarray), arr)


def empty(shape, dtype=np.float32):
    return np.empty(shape, dtype=dtype).view(ndarray)


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype).view(ndarray)


def ones(shape, dtype=np.float32):
    return np.ones(shape, dtype=dtype).view(ndarray)


def ascontiguousarray(a, dtype=None):
    return np.ascontiguousarray(a, dtype=dtype).view(ndarray)


def arange(*args, dtype=None):
    return np.arange(*args, dtype=dtype).view(ndarray)


def asarray(a, dtype=None):
    if isinstance(a, ndarray):
        return a
    return np.array(a, dtype=dtype).view(ndarray)


# Streams, events, devices -------------------------------------------------------------------
class Stream:
    null: "Stream"

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else id(self)

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False

    def synchronize(self):
        pass

    def wait_event(self, event):
        if not event.recorded:
            raise AssertionError("wait_event on an event that was never recorded")


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    def __init__(self, ptr, device_id=-1):
        super().__init__()
        self.ptr = ptr


class Event:
    created = 0

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        Event.created += 1
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    @property
    def done(self):
        return self.recorded

    def synchronize(self):
        if not self.recorded:
            raise AssertionError("synchronize on an event that was never recorded")


class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False

    def use(self):
        pass


def get_current_stream():
    return Stream.null


# Kernels ------------------------------------------------------------------------------------
class RawKernel:
    library: Optional[ctypes.CDLL] = None
    launches = 0

    def __init__(self, code, name):
        if RawKernel.library is None:
            raise RuntimeError("fake_cupy.install(kernel_library) was not called")
        self.fn = getattr(RawKernel.library, "run_" + name)
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_double,
                            ctypes.c_int]

    def __call__(self, grid, block, args):
        table, n, nblocks, scale, scaled = args
        assert isinstance(table, ndarray) and table.dtype == np.int64, table
        assert tuple(grid) == (int(nblocks),) and tuple(block) == (gpu_pack.BLOCK_THREADS,)
        for a, t in zip(args[1:], (np.int64, np.int64, np.float64, np.int32)):
            assert isinstance(a, t), (a, t)
        RawKernel.launches += 1
        self.fn(table.data.ptr, int(n), int(nblocks), float(scale), int(scaled))


# NCCL over MPI ------------------------------------------------------------------------------
def _nccl_module():
    from mpi4py import MPI

    m = types.ModuleType("cupy.cuda.nccl")
    m.available = True
    types_ = ["NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64",
              "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_BFLOAT16"]
    for i, t in enumerate(types_):
        setattr(m, t, i)
    np_of = {m.NCCL_INT8: np.int8, m.NCCL_UINT8: np.uint8, m.NCCL_INT32: np.int32,
             m.NCCL_UINT32: np.uint32, m.NCCL_INT64: np.int64, m.NCCL_UINT64: np.uint64,
             m.NCCL_FLOAT16: np.float16, m.NCCL_FLOAT32: np.float32, m.NCCL_FLOAT64: np.float64,
             m.NCCL_BFLOAT16: "bfloat16"}
    for i, op in enumerate(["NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG"]):
        setattr(m, op, i)
    m.version = 22105
    m.get_version = lambda: m.version
    m.get_unique_id = lambda: bytes(range(128))  # CuPy returns bytes
    group: List = []
    m._group_depth = 0

    def host(ptr, count, dtype):
        npdt = np_of[dtype]
        if npdt == "bfloat16":
            import ml_dtypes

            npdt = ml_dtypes.bfloat16
        npdt = np.dtype(npdt)
        buf = (ctypes.c_char * (count * npdt.itemsize)).from_address(ptr)
        return np.frombuffer(buf, dtype=npdt, count=count)

    def reduce_arrays(arrays, op):
        with np.errstate(all="ignore"):  # integer sums wrap, as in NCCL
            return _reduce_arrays(arrays, op)

    def _reduce_arrays(arrays, op):
        stack = np.stack([a.astype(np.float32) if a.dtype.name in ("bfloat16",) else a for a in arrays])
        if op in (m.NCCL_SUM, m.NCCL_AVG):
            r = stack.sum(axis=0, dtype=stack.dtype)
            if op == m.NCCL_AVG:
                r = (r / len(arrays)).astype(stack.dtype)
        elif op == m.NCCL_PROD:
            r = stack.prod(axis=0, dtype=stack.dtype)
        elif op == m.NCCL_MAX:
            r = stack.max(axis=0)
        else:
            r = stack.min(axis=0)
        return r.astype(arrays[0].dtype)

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank):
            if not isinstance(commId, bytes) or commId != bytes(range(128)):
                raise RuntimeError(f"bad unique id {commId!r}")
            self.comm = MPI.COMM_WORLD.Split(0, rank)  # the ranks that built it, in rank order
            if self.comm.Get_size() != ndev or self.comm.Get_rank() != rank:
                raise RuntimeError("NCCL stand-in: ranks do not match the world")
            self.calls: List[str] = []

        def _run(self, fn):
            if m._group_depth:
                group.append(fn)
            else:
                fn()

        def allReduce(self, send, recv, count, dtype, op, stream):
            self.calls.append("allReduce")

            def go():
                mine = host(send, count, dtype).copy()
                out = reduce_arrays(self.comm.allgather(mine), op)
                host(recv, count, dtype)[:] = out
            self._run(go)

        def broadcast(self, send, recv, count, dtype, root, stream):
            self.calls.append("broadcast")

            def go():
                data = host(send, count, dtype).copy() if self.comm.Get_rank() == root else None
                host(recv, count, dtype)[:] = self.comm.bcast(data, root=root)
            self._run(go)

        def allGather(self, send, recv, count, dtype, stream):
            self.calls.append("allGather")

            def go():
                parts = self.comm.allgather(host(send, count, dtype).copy())
                host(recv, count * len(parts), dtype)[:] = np.concatenate(parts)
            self._run(go)

        def reduceScatter(self, send, recv, recvcount, dtype, op, stream):
            self.calls.append("reduceScatter")

            def go():
                n = self.comm.Get_size()
                out = reduce_arrays(self.comm.allgather(host(send, recvcount * n, dtype).copy()), op)
                r = self.comm.Get_rank()
                host(recv, recvcount, dtype)[:] = out[r * recvcount:(r + 1) * recvcount]
            self._run(go)

        def reduce(self, send, recv, count, dtype, op, root, stream):
            self.calls.append("reduce")

            def go():
                out = reduce_arrays(self.comm.allgather(host(send, count, dtype).copy()), op)
                if self.comm.Get_rank() == root:
                    host(recv, count, dtype)[:] = out
            self._run(go)

        def send(self, sendbuf, count, dtype, peer, stream):
            self.calls.append("send")
            if not m._group_depth:
                raise AssertionError("send outside a group")
            group.append(("send", self.comm, host(sendbuf, count, dtype).copy(), peer))

        def recv(self, recvbuf, count, dtype, peer, stream):
            self.calls.append("recv")
            if not m._group_depth:
                raise AssertionError("recv outside a group")
            group.append(("recv", self.comm, host(recvbuf, count, dtype), peer))

        def destroy(self):
            self.comm.Free()

    def groupStart():
        m._group_depth += 1

    def groupEnd():
        m._group_depth -= 1
        if m._group_depth:
            return
        items = list(group)
        group.clear()
        requests = []
        for item in items:  # point-to-point first, posted all at once like NCCL does
            if isinstance(item, tuple):
                kind, comm, buf, peer = item
                if kind == "send":
                    requests.append(comm.Isend(buf, dest=peer, tag=7))
                else:
                    requests.append(comm.Irecv(buf, source=peer, tag=7))
        MPI.Request.Waitall(requests)
        for item in items:
            if not isinstance(item, tuple):
                item()

    m.NcclCommunicator = NcclCommunicator
    m.groupStart = groupStart
    m.groupEnd = groupEnd
    return m


def install(kernel_library: Optional[str], nccl: bool = True) -> types.ModuleType:
    """Put ``cupy``, ``cupy.cuda``, ``cupy.cuda.nccl`` and ``cupyx`` stand-ins into sys.modules."""
    if kernel_library:
        RawKernel.library = ctypes.CDLL(kernel_library)
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "fake"
    cuda = types.ModuleType("cupy.cuda")
    for name in ("Stream", "ExternalStream", "Event", "Device", "get_current_stream"):
        setattr(cuda, name, globals()[name])
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: int(os.environ.get("FAKE_CUPY_DEVICES", "1")), runtimeGetVersion=lambda: 0, driverGetVersion=lambda: 0,
        getDeviceProperties=lambda i: {"name": b"host-memory stand-in (fake_cupy)"},
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    cuda.get_elapsed_time = lambda start, stop: 1.0
    cuda.runtime = runtime
    for name in ("ndarray", "empty", "zeros", "ones", "arange", "ascontiguousarray", "asarray", "RawKernel"):
        setattr(cupy, name, globals()[name])
    cupy.uint16 = np.uint16
    cupy.float32 = np.float32
    cupy.int16 = np.int16
    cupy.cuda = cuda
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.float64, order="C": np.empty(shape, dtype=dtype)
    sys.modules["cupy"] = cupy
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupyx"] = cupyx
    if nccl:
        cuda.nccl = sys.modules["cupy.cuda.nccl"] = _nccl_module()
    return cupy
