"""GPU path: what the CPU can check (pack plans, dtype maps, kernels run through a C++ emulation,
completion bookkeeping with fake events), and ``gpu``-marked tests that need CuPy and a device.

The copy kernels are compiled twice: by NVRTC on a GPU, and here by g++ with a shim that maps
blockIdx/threadIdx to loops and the two PTX half conversions to ``_Float16``; everything else
in the kernel text (table indexing, block split, scaling, bfloat16 rounding, truncation) is the
same text the GPU compiles.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import pytest

import fake_cupy
import mpirun
from hvddp.backends import device, gpu, gpu_pack, nccl as nccl_backend
from hvddp.backends.gpu_pack import (ALIGN_BYTES, BLOCK_ELEMS, ITEMSIZE, make_plan, mpi_wire_dtype,
                                     nccl_wire_dtype, pointer_table, reference_copy, split_by)
from hvddp.engine.messages import Kind, ReduceOp, Request
from hvddp.exceptions import BackendUnavailableError, HvddpError

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64")


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def sample(name, n, seed):
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if name.startswith(("int", "uint")):
        info = np.iinfo(name)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), n).astype(name)
    return (rng.standard_normal(n) * 100).astype(np_dtype(name))


# Plans --------------------------------------------------------------------------------------
@pytest.mark.parametrize("wire", ["uint8", "float16", "float32", "float64"])
def test_plan_offsets_are_aligned_and_disjoint(wire):
    counts = [0, 1, 7, BLOCK_ELEMS, BLOCK_ELEMS + 1, 33, 0, 5000]
    plan = make_plan(counts, wire)
    isz = ITEMSIZE[wire]
    assert all(off * isz % ALIGN_BYTES == 0 for off in plan.offsets)
    spans = sorted((off, off + n) for off, n in zip(plan.offsets, counts) if n)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert plan.total == plan.offsets[-1] + counts[-1]


def test_plan_blocks_cover_every_element_once():
    counts = [3, 0, BLOCK_ELEMS * 2, BLOCK_ELEMS * 2 + 1, 1]
    plan = make_plan(counts, "float32")
    assert plan.nblocks == gpu_pack.expected_blocks(counts)
    seen = [np.zeros(n, dtype=int) for n in counts]
    for e, start in plan.blocks.T:
        seen[e][start:min(start + BLOCK_ELEMS, counts[e])] += 1
    assert all((s == 1).all() for s in seen)


def test_plan_empty_and_bad_input():
    plan = make_plan([], "float32")
    assert plan.total == 0 and plan.nblocks == 0
    with pytest.raises(ValueError, match="element count"):
        make_plan([-1], "float32")
    with pytest.raises(ValueError, match="unknown wire dtype"):
        make_plan([1], "complex64")


def test_pointer_table_layout():
    plan = make_plan([5, BLOCK_ELEMS + 1], "int32")
    table = pointer_table(plan, [100, 0], [200, 300])
    assert table.tolist() == [100, 0, 200, 300, 5, BLOCK_ELEMS + 1, 0, 1, 1, 0, 0, BLOCK_ELEMS]
    with pytest.raises(ValueError, match="need 2"):
        pointer_table(plan, [1], [2])


def test_wire_dtype_maps():
    assert nccl_wire_dtype("bool") == "uint8"
    assert nccl_wire_dtype("int16") == "int32"
    assert nccl_wire_dtype("bfloat16") == "bfloat16"
    assert nccl_wire_dtype("bfloat16", bf16=False) == "float32"
    assert nccl_wire_dtype("float16") == "float16"
    assert all(nccl_wire_dtype(d) == d for d in ("uint8", "int8", "int32", "int64", "float32", "float64"))
    assert mpi_wire_dtype("float16") == mpi_wire_dtype("bfloat16") == "float32"
    assert all(mpi_wire_dtype(d) == d for d in DTYPES if d not in ("float16", "bfloat16"))
    assert gpu_pack.storage_dtype("bfloat16") == "uint16"
    for d in DTYPES:  # every wire dtype has an NCCL type name
        assert nccl_wire_dtype(d) in nccl_backend._TYPE_NAMES


def test_split_by_keeps_first_appearance_order():
    assert split_by(["f32", "f16", "f32", "bf16", "f16"]) == [[0, 2], [1, 4], [3]]
    assert split_by([]) == []


def test_nccl_op_average_and_fallback():
    assert nccl_backend.nccl_op(ReduceOp.AVERAGE, "float32", 22105) == ("NCCL_AVG", True)
    assert nccl_backend.nccl_op(ReduceOp.AVERAGE, "bfloat16", 21003) == ("NCCL_AVG", True)
    assert nccl_backend.nccl_op(ReduceOp.AVERAGE, "float32", 2804) == ("NCCL_SUM", False)
    assert nccl_backend.nccl_op(ReduceOp.AVERAGE, "int32", 22105) == ("NCCL_SUM", False)
    assert nccl_backend.nccl_op(ReduceOp.PRODUCT, "int64", 22105) == ("NCCL_PROD", False)
    assert nccl_backend.nccl_op(ReduceOp.MIN, "uint8", 22105) == ("NCCL_MIN", False)
    with pytest.raises(HvddpError, match="Adasum"):
        nccl_backend.nccl_op(ReduceOp.ADASUM, "float32", 22105)
    assert "ncclAvg" in nccl_backend.check_version_note(22105)
    assert "no ncclAvg" in nccl_backend.check_version_note(2804)


def test_post_factor():
    avg = Request(Kind.ALLREDUCE, 0, "x", "float32", (2,), ReduceOp.AVERAGE, postscale=3.0)
    assert gpu.post_factor(avg, 4, averaged=True) == 3.0
    assert gpu.post_factor(avg, 4, averaged=False) == 0.75
    total = avg._replace(op=ReduceOp.SUM)
    assert gpu.post_factor(total, 4, averaged=False) == 3.0


def test_choose_path_and_warning_once(caplog):
    assert gpu.choose_path("NCCL", True) == ("NCCL", None)
    path, why = gpu.choose_path("NCCL", False)
    assert path == "MPI" and "NCCL is not available" in why
    path, why = gpu.choose_path("MPI", True)
    assert path == "MPI" and "HVDDP_GPU_OPERATIONS=MPI" in why
    gpu._warned.discard("test-key")
    with caplog.at_level(logging.WARNING, logger="hvddp"):
        logging.getLogger("hvddp").propagate = True
        try:
            gpu.warn_once("test-key", "staged")
            gpu.warn_once("test-key", "staged")
        finally:
            logging.getLogger("hvddp").propagate = False
    assert [r.message for r in caplog.records].count("staged") == 1


# Completion bookkeeping with fake events (no CUDA, no MPI) -------------------------------------
class FakeEvent:
    def __init__(self, fail=None):
        self.passed = False
        self.fail = fail
        self.synced = 0

    @property
    def done(self):  # CuPy's Event.done is a property
        return self.passed

    def synchronize(self):
        self.synced += 1
        if self.fail:
            raise self.fail
        self.passed = True


class FakeEntry:
    def __init__(self):
        self.value = self.error = None
        self.writeback = None

    def complete(self, value):
        self.value = value

    def fail(self, error):
        self.error = error


def test_completions_poll_in_order_and_never_block():
    book = gpu.Completions()
    e1, e2 = FakeEvent(), FakeEvent()
    a, b = FakeEntry(), FakeEntry()
    kept = object()
    book.add(e1, [(a, "A")], keep=[kept])
    book.add(e2, [(b, "B")])
    assert book.poll() == 0 and a.value is None and len(book) == 2
    e2.passed = True  # the later event alone does not complete anything out of order
    assert book.poll() == 0 and b.value is None
    e1.passed = True
    assert book.poll() == 2 and (a.value, b.value) == ("A", "B") and len(book) == 0
    assert e1.synced == e2.synced == 0


def test_completions_flush_waits_and_reports_failures():
    book = gpu.Completions()
    good, bad = FakeEntry(), FakeEntry()
    book.add(FakeEvent(fail=RuntimeError("illegal address")), [(bad, "X")])
    ev = FakeEvent()
    book.add(ev, [(good, "G")])
    assert book.flush() == 1
    assert ev.synced == 1 and good.value == "G"
    assert isinstance(bad.error, HvddpError) and "illegal address" in str(bad.error)


def test_completions_writeback_and_fail_all():
    book = gpu.Completions()
    entry = FakeEntry()
    target = object()
    entry.writeback = target
    book.add(FakeEvent(), [(entry, "contiguous result")])
    book.flush()
    assert entry.value is target and entry.writeback is None
    other = FakeEntry()
    book.add(FakeEvent(), [(other, 1)])
    book.fail_all(HvddpError("shut down"))
    assert str(other.error) == "shut down" and len(book) == 0


# Device detection without CuPy --------------------------------------------------------------
class CudaLike:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}


class DlpackOn:
    def __init__(self, kind):
        self.kind = kind

    def __dlpack__(self, stream=None):
        raise AssertionError("not called by is_device_array")

    def __dlpack_device__(self):
        return (self.kind, 0)


def test_is_device_array_reads_protocols_only():
    assert device.is_device_array(CudaLike())
    assert device.is_device_array(DlpackOn(2))
    assert device.is_device_array(DlpackOn(13))
    assert not device.is_device_array(DlpackOn(1))
    assert not device.is_device_array(np.zeros(3))
    assert not device.is_device_array([1.0])


def test_labeled_bfloat16_bits_are_seen_through():
    names = ("cupy", "cupy.cuda", "cupyx")
    saved = {n: sys.modules[n] for n in names if n in sys.modules}  # a real CuPy, on a GPU machine
    cupy = fake_cupy.install(None, nccl=False)
    try:
        bits = cupy.asarray(np.arange(4, dtype=np.int16))
        label = device.Labeled(bits, "bfloat16")
        assert device.is_device_array(DlpackOn(2)) and device.is_device_array(device.Labeled(DlpackOn(2), "bfloat16"))
        view, dev = device.as_device_array(label)
        assert view.dtype == np.uint16 and view.data.ptr == bits.data.ptr and dev == "cuda:0"
        assert device.describe(label)[1:] == ("cuda:0", "bfloat16")
        assert device.describe(cupy.asarray(np.zeros(2, np.int64)))[2] == "int64"
        assert device.dtype_name(view, "bfloat16") == "bfloat16"
        same, _ = device.as_device_array(cupy.asarray(np.zeros(3, np.float32)))
        assert device.dtype_name(same) == "float32"
        with pytest.raises(TypeError, match="2-byte integer view"):
            device.as_device_array(cupy.asarray(np.zeros(3, np.float32)), dtype="bfloat16")
        with pytest.raises(TypeError, match="does not support"):
            device.dtype_name(cupy.asarray(np.zeros(3, np.complex64)))
        with pytest.raises(ValueError, match="only carries"):
            device.Labeled(bits, "float8")

        class TorchLikeStream:
            cuda_stream = 1234

        for stream in (None, 1234, TorchLikeStream(), cupy.cuda.Stream(non_blocking=True)):
            event = device.ready_event(bits, stream)
            assert event.done
        with pytest.raises(TypeError, match="stream must be"):
            device.ready_event(bits, "default")
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def test_device_index():
    assert device.device_index("cuda:3") == 3
    assert device.device_index("cuda") == 0
    with pytest.raises(ValueError, match="not a CUDA device"):
        device.device_index("cpu")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_the_truth_and_a_clear_error():
    assert device.cuda_built() is False and device.nccl_built() is False
    assert device.nccl_version() == 0
    with pytest.raises(BackendUnavailableError, match="pip install cupy-cuda12x"):
        device.as_device_array(CudaLike())


def test_import_hvddp_does_not_import_cupy():
    code = ("import sys, hvddp, hvddp.backends.gpu, hvddp.backends.nccl, hvddp.backends.gpu_pack; "
            "from hvddp.backends import device; device.is_device_array(object()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=mpirun.ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_backends_import_without_cupy():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", None)  # any `import cupy` now raises ImportError
        for module in (device, gpu_pack, nccl_backend, gpu):
            importlib.reload(module)
        device.cuda_built.cache_clear()
        device.nccl_version.cache_clear()
        assert device.cuda_built() is False and device.nccl_built() is False
        with pytest.raises(BackendUnavailableError, match="pip install cupy-cuda12x"):
            device.import_cupy()
    device.cuda_built.cache_clear()  # the truth again, for the tests that follow
    device.nccl_version.cache_clear()


# Kernels through a C++ emulation ------------------------------------------------------------
PAIRS = fake_cupy.PAIRS


@pytest.fixture(scope="module")
def kernel_library():
    tmp = tempfile.mkdtemp(prefix="hvddp_kernels_")
    try:
        lib = fake_cupy.compile_kernels(tmp)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the kernel text does not compile with g++: {exc.stderr.decode()[-2000:]}")
    if lib is None:
        pytest.skip("g++ is not installed: cannot emulate the CUDA kernels on the CPU")
    yield lib
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def emulated(kernel_library):
    return ctypes.CDLL(kernel_library)


def launch_emulated(so, plan, sdt, ddt, src_ptrs, dst_ptrs, scale):
    table = pointer_table(plan, src_ptrs, dst_ptrs)
    fn = getattr(so, "run_" + gpu_pack.kernel_name(sdt, ddt))
    fn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_double, ctypes.c_int]
    fn(table.ctypes.data, len(plan.counts), plan.nblocks, scale, int(scale != 1.0))


def poisoned(n, dtype):
    buf = np.empty(n, dtype=np_dtype(dtype))
    buf.view(np.uint8)[:] = 0xAB
    return buf


def same_bits(a, b):
    return a.tobytes() == b.tobytes()


COUNTS = [5, 0, BLOCK_ELEMS + 3, 1, 64]


@pytest.mark.parametrize("src,dst", PAIRS)
@pytest.mark.parametrize("scale", [1.0, 0.3, 1 / 49])  # 1/49: an Average whose float product errs
def test_emulated_pack_then_unpack_matches_cpu_path(emulated, src, dst, scale):
    if src == dst == "bool" and scale != 1.0:
        pytest.skip("bool is never scaled (only Min/Max reduce it)")
    # pack: tensors of dtype ``src`` into a fusion buffer of dtype ``dst``, one joined (zeros)
    sources = [sample(src, n, seed=i) for i, n in enumerate(COUNTS)]
    sources[3] = None
    plan = make_plan(COUNTS, dst)
    got = poisoned(plan.total, dst)
    want = poisoned(plan.total, dst)
    isz = ITEMSIZE[dst]
    base = got.ctypes.data
    launch_emulated(emulated, plan, src, dst, [0 if a is None else a.ctypes.data for a in sources],
                    [base + off * isz for off in plan.offsets], scale)
    reference_copy(plan, sources, scale, True, want, None)
    assert same_bits(got, want), f"pack {src}->{dst} scale {scale}"
    # unpack the same way back out (dst -> src), outputs poisoned
    outs = [poisoned(n, src) for n in COUNTS]
    refs = [poisoned(n, src) for n in COUNTS]
    launch_emulated(emulated, plan, dst, src, [base + off * isz for off in plan.offsets],
                    [o.ctypes.data for o in outs], scale)
    reference_copy(plan, None, scale, False, want, refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert same_bits(o, r), f"unpack {dst}->{src} scale {scale}, tensor {i}"


def test_emulated_bfloat16_rounding_edges(emulated):
    x = np.array([1.0, 1.00390625, 1.01171875, -3.0e38, 3.4e38, np.inf, -np.inf, np.nan, 1e-40, 0.0],
                 dtype=np.float32)
    plan = make_plan([x.size], "float32")
    out = poisoned(x.size, "bfloat16")
    launch_emulated(emulated, plan, "float32", "bfloat16", [x.ctypes.data], [out.ctypes.data], 1.0)
    want = x.astype(ml_dtypes.bfloat16)
    assert same_bits(out[~np.isnan(x)], want[~np.isnan(x)])
    assert np.isnan(out[np.isnan(x)].astype(np.float32)).all()


def test_kernel_source_refuses_float_int_mix():
    with pytest.raises(ValueError, match="within floats"):
        gpu_pack.kernel_source("float32", "int32")
    with pytest.raises(ValueError, match="no kernel for dtype"):
        gpu_pack.kernel_source("complex64", "complex64")


# On a GPU -----------------------------------------------------------------------------------
def _cuda_reason():
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install cupy-cuda12x)"
    if not device.cuda_built():
        return "CuPy sees no CUDA device"
    return None


needs_cuda = pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("src,dst", PAIRS)
def test_device_kernels_match_cpu_path(src, dst):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    sources = [sample(src, n, seed=i) for i, n in enumerate(COUNTS)]
    sources[3] = None
    plan = make_plan(COUNTS, dst)
    dev_src = [None if a is None else cupy.asarray(a.view(np.uint16) if src == "bfloat16" else a)
               for a in sources]
    buf = cupy.asarray(poisoned(plan.total, dst).view(np.uint8)).view(gpu_pack.storage_dtype(dst))
    isz = ITEMSIZE[dst]
    for scale in (1.0, 0.3):
        if src == dst == "bool" and scale != 1.0:
            continue
        gpu_pack.launch_copy(plan, src, dst, [0 if a is None else a.data.ptr for a in dev_src],
                             [buf.data.ptr + off * isz for off in plan.offsets], scale, stream)
        stream.synchronize()
        want = poisoned(plan.total, dst)
        reference_copy(plan, sources, scale, True, want, None)
        assert buf.get().tobytes() == want.tobytes()


@pytest.mark.gpu
@needs_cuda
def test_device_as_device_array_zero_copy():
    import cupy

    a = cupy.arange(6, dtype=cupy.float32)
    view, dev = device.as_device_array(a)
    assert view is a and dev == f"cuda:{a.device.id}"
    bits = cupy.zeros(4, dtype=cupy.int16)
    view, _ = device.as_device_array(bits, dtype="bfloat16")
    assert view.dtype == cupy.uint16 and view.data.ptr == bits.data.ptr
    event = device.ready_event(a)
    event.synchronize()


# The executor end to end on the CPU stand-in for CuPy ------------------------------------------
@pytest.mark.parametrize("np_", [3])
def test_gpu_executor_on_the_cupy_stand_in(kernel_library, np_):
    """gpu_check.py's own checks through GpuExecutor, NCCL and staging, at an odd size (np=1 and
    np=2 run in the gpu_check test below)."""
    result = mpirun.run(np_, [os.path.join(mpirun.ROOT, "tests", "mpi_gpu_fake.py")], timeout=120,
                        env={"HVDDP_FAKE_KERNELS": kernel_library})
    assert "TOTAL FAILURES 0" in result.stdout, result.stdout
    for path in ("NCCL", "MPI"):  # 190 cases; the ranks that did not join check 18 more (a joined rank)
        assert result.stdout.count(f"{path} np={np_}: 208 allreduce tensors") == np_ - 1, result.stdout
        assert result.stdout.count(f"{path} np={np_}: 190 allreduce tensors") == 1, result.stdout


def test_a_joined_rank_reduces_on_its_own_device(kernel_library):
    result = mpirun.run(2, [os.path.join(mpirun.ROOT, "tests", "mpi_gpu_fake.py"), "join-own-device"],
                        timeout=60, env={"HVDDP_FAKE_KERNELS": kernel_library})
    assert result.stdout.count("joined on its own device") == 2, result.stdout


def test_out_of_device_memory_on_one_rank_ends_the_job(kernel_library):
    started = time.monotonic()
    result = mpirun.run(2, [os.path.join(mpirun.ROOT, "tests", "mpi_gpu_fake.py"), "out-of-memory"],
                        timeout=60, env={"HVDDP_FAKE_KERNELS": kernel_library}, check=False)
    assert result.returncode != 0 and "hvddp engine failed on rank 1: MemoryError" in result.stdout, result.stdout
    assert "the allreduce returned" not in result.stdout and time.monotonic() - started < 45, result.stdout


@pytest.mark.parametrize("path", ["NCCL", "MPI"])
def test_device_outputs_are_ordered_after_the_default_stream(kernel_library, path):
    result = mpirun.run(2, [os.path.join(mpirun.ROOT, "tests", "mpi_gpu_fake.py"), "output-order"],
                        timeout=60, env={"HVDDP_FAKE_KERNELS": kernel_library, "HVDDP_GPU_OPERATIONS": path})
    assert result.stdout.count("outputs ordered") == 2, result.stdout


def test_staging_reuses_its_pinned_buffers(kernel_library):
    result = mpirun.run(2, [os.path.join(mpirun.ROOT, "tests", "mpi_gpu_fake.py"), "pinned-growth"],
                        timeout=60, env={"HVDDP_FAKE_KERNELS": kernel_library, "HVDDP_GPU_OPERATIONS": "MPI"})
    assert result.stdout.count("pinned allocations") == 2, result.stdout


def test_gpu_check_script_runs_every_section_on_the_stand_in(kernel_library):
    """benchmarks/gpu_check.py end to end (two stand-in GPUs, so its NCCL np=2 part runs too)."""
    env = dict(os.environ, HVDDP_GPU_CHECK_FAKE_CUPY=kernel_library, FAKE_CUPY_DEVICES="2",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(mpirun.ROOT, "benchmarks", "gpu_check.py")],
                          cwd=mpirun.ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert " 0 failed" in out, out
    for section in ("kernels", "staging", "public API", "nccl np=1", "nccl np=2", "bandwidth"):
        assert f"| {section} " in out, out


@pytest.mark.gpu
@needs_cuda
def test_device_executor_single_rank_nccl_and_staging():
    """gpu_check.py's allreduce and collective checks at np=1 on the real device, both paths."""
    import importlib.util as iu

    from mpi4py import MPI

    spec = iu.spec_from_file_location("gpu_check", os.path.join(mpirun.ROOT, "benchmarks", "gpu_check.py"))
    gpu_check = iu.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for ops in ("NCCL", "MPI") if device.nccl_built() else ("MPI",):
        gx, _ = gpu_check.make_executor(ops, MPI.COMM_SELF)
        _, failures = gpu_check.allreduce_cases(gx, MPI.COMM_SELF, 1, 0, f"pytest.{ops}")
        _, more = gpu_check.other_collectives(gx, 1, 0, f"pytest.{ops}")
        assert not failures + more, (ops, failures[:5], more[:5])


@pytest.mark.parametrize("path", ["NCCL", "MPI"])
def test_public_collectives_on_device_arrays(kernel_library, path, tmp_path):
    """hvddp.allreduce & co. on device arrays through the real engine, on either GPU path, with a
    timeline whose spans all close (device collectives' spans stayed open until shutdown)."""
    result = mpirun.run(2, [os.path.join(mpirun.ROOT, "tests", "mpi_gpu_wired.py")], timeout=120,
                        env={"HVDDP_FAKE_KERNELS": kernel_library, "HVDDP_GPU_OPERATIONS": path,
                             "HVDDP_TIMELINE": str(tmp_path / "timeline.json")})
    assert result.stdout.count("WIRED OK") == 2, result.stdout
    assert "timeline spans ok" in result.stdout, result.stdout
