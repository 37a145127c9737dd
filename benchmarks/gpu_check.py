"""One-GPU check of hvddp's GPU path: correctness first, then the fused-copy bandwidth.

Run on a machine with one CUDA GPU, from the repository root, after `pip install -e .` and a
CuPy matching the driver with its NCCL wheel (`pip install cupy-cuda12x nvidia-nccl-cu12`, or the
cu13 pair); a CUDA build of torch for the optimizer section; an MPI for mpi4py (`pip install
mpich`):

    python benchmarks/gpu_check.py            # about 1-3 minutes; prints one table, exit 1 on FAIL

On this workplace's H200 image (Python 3.12 with cupy-cuda13x, nvidia-nccl-cu13, torch+cu130 and
mpi4py, but no MPI library), bring the mpich wheel: here, `python3 -m pip download --no-deps
--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
-d .whl mpich==5.0.2` (13 MB), carry `.whl`, and run there
`python3 -m pip install -q --no-index --no-deps .whl/mpich-*.whl && python3 -m pip install -q
--no-index --no-deps --no-build-isolation -e . && python3 benchmarks/gpu_check.py`.

Without a GPU, HVDDP_GPU_CHECK_FAKE_CUPY=<kernels.so from tests/fake_cupy.compile_kernels> runs
every section against the host-memory stand-in (tests/test_gpu.py does), which checks the logic
of the script and of the GPU executor but no CUDA behaviour.

Sections (each guarded: one failure does not hide the rest):
  env        CuPy, CUDA, device, NCCL version (ncclAvg / bf16), torch
  kernels    pack/unpack kernels for every dtype pair vs the CPU path's numpy copy, bit for bit,
             on poisoned buffers (padding and untouched bytes must stay poisoned)
  nccl np=1  GpuExecutor on NCCL, one rank: fused and single-tensor allreduce for every dtype
             incl. bfloat16 (Average/Sum/Min/Max, prescale/postscale), a joined (zeros) member,
             in-place; broadcast, allgather, alltoall, reducescatter
  nccl np=2  needs two GPUs: one GPU cannot host two NCCL ranks (NCCL refuses duplicate
             devices); reported as not possible here
  staging    `mpiexec -n 2` sharing the GPU, HVDDP_GPU_OPERATIONS=MPI path: allreduce of every
             dtype with rank-dependent inputs (exact), broadcast/allgather/alltoall/reducescatter
  public API tests/mpi_gpu_wired.py at np=1 and np=2: hvddp's collectives on CuPy arrays through
             the engine (every dtype, in place on strided views, aliased inputs, 0-d broadcast,
             uneven allgather, alltoall, reducescatter, Adasum, a device mismatch across ranks),
             under a timeline whose spans must all close
  torch ops  hvddp.torch collectives on CUDA tensors at np=1 and np=2 (staged on one GPU): 8 dtypes,
             Sum/Max/Average, in place with prescale, allgather with uneven rows, broadcast from the
             last rank, async, grouped, alltoall, reducescatter, backward, SyncBatchNorm,
             broadcast_optimizer_state of Adam state made on the root's device
  optimizer  hvddp.torch.DistributedOptimizer on CUDA tensors, np=1 and np=2: parity with one
             process on the full batch, replicas identical
  bandwidth  fused pack + unpack of many tensors vs one device-to-device copy of the same bytes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# For CI on machines without a GPU: run every section against tests/fake_cupy.py (host memory,
# kernels compiled by g++, NCCL over MPI). Set to the kernel library fake_cupy.compile_kernels made.
FAKE_CUPY = os.environ.get("HVDDP_GPU_CHECK_FAKE_CUPY", "")
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64")
ROWS = []  # (section, check, status, detail)


def row(section, check, ok, detail=""):
    status = {True: "ok", False: "FAIL", None: "skipped"}[ok]
    ROWS.append((section, check, status, str(detail)))
    print(f"  [{status}] {section}: {check} {detail}", flush=True)


def guarded(section):
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                tb = traceback.format_exc(limit=4).strip().splitlines()
                row(section, "section raised", False, f"{type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}")
        return run
    return wrap


# Shared helpers -----------------------------------------------------------------------------
def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def sample(name, n, seed):
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if name.startswith(("int", "uint")):
        info = np.iinfo(name)
        return rng.integers(max(info.min, -100), min(info.max, 100), n).astype(name)
    return (rng.standard_normal(n) * 10).astype(np_dtype(name))


def to_device(a):
    import cupy

    return cupy.asarray(a.view(np.uint16) if a.dtype.name == "bfloat16" else a)


def to_host(d, dtype):
    h = d.get()
    return h.view(np_dtype(dtype)) if dtype == "bfloat16" else h


def ops_for(dtype):
    from hvddp.engine.messages import ReduceOp

    if dtype == "bool":
        return [ReduceOp.MIN, ReduceOp.MAX]
    return [ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX]


def reference(xs_by_rank, dtype, wire, op, pre, post_total):
    """The CPU path's math: scaled copy into the wire dtype, reduce, scaled copy out."""
    from hvddp.engine.executor import _scaled_copy

    wires = []
    for x in xs_by_rank:
        w = np.empty(x.size, dtype=np_dtype(wire))
        _scaled_copy(w, x.reshape(-1), pre)
        wires.append(w)
    stack = np.stack(wires)
    with np.errstate(all="ignore"):  # integer sums wrap, as they do in MPI and NCCL
        red = _reduce(stack, op)
    out = np.empty(red.size, dtype=np_dtype(dtype))
    _scaled_copy(out, red, post_total)
    return out


def _reduce(stack, op):
    from hvddp.engine.messages import ReduceOp

    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        red = stack.sum(axis=0, dtype=stack.dtype) if stack.dtype != bool else stack.any(axis=0)
    elif op == ReduceOp.MIN:
        red = stack.min(axis=0)
    elif op == ReduceOp.MAX:
        red = stack.max(axis=0)
    else:
        red = stack.prod(axis=0, dtype=stack.dtype)
    return red


class PsView:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = list(range(self.size))


def make_executor(ops, comm):
    from hvddp.backends.gpu import GpuExecutor
    from hvddp.config import Config
    from hvddp.engine.executor import Executor

    cfg = Config(gpu_operations=ops)
    sets = {0: PsView(comm)}
    return GpuExecutor(cfg, sets, cpu_executor=Executor(cfg, sets)), cfg


def make_entry(kind, name, array, dtype, op=1, pre=1.0, post=1.0, root=-1, inplace=False, shape=None):
    from hvddp.engine.executor import Entry
    from hvddp.engine.messages import Request
    from hvddp.handles import Handle

    shape = tuple(array.shape) if shape is None else shape
    request = Request(kind, 0, name, dtype, shape, int(op), pre, post, root, "cuda")
    return Entry(request, array, array if inplace else None, Handle(name, keep=array), 0, time.monotonic())


def result(entry):
    return entry.handle.wait(timeout=60)


def exact(got, want):
    return got.tobytes() == want.tobytes()


def allreduce_cases(gx, comm, size, rank, tag):
    """Allreduce every dtype and op: fused (3 tensors), alone, and in place.

    Integers must match exactly. Floats must match bit for bit where the summation order cannot
    differ (one rank; two ranks through MPI); otherwise within a tolerance scaled to the largest
    value (half types lose an ulp of the largest addend per addition, in whatever order).
    """
    must_be_exact = size == 1 or (gx.path == "MPI" and size == 2)
    from hvddp.backends.gpu import wire_for
    from hvddp.engine.messages import Kind, ReduceOp

    failures = []
    n_checks = 0
    for dtype in DTYPES:
        wire = wire_for(dtype, gx.path, gx.bf16)
        for op in ops_for(dtype):
            floats = dtype.startswith(("float", "bfloat"))
            pre, post = (2.0, 0.5) if floats and op in (ReduceOp.SUM, ReduceOp.AVERAGE) else (1.0, 1.0)
            for mode in ("fused", "alone", "inplace"):
                counts = [1000, 3, 70000] if mode == "fused" else [4099]
                xs = [[sample(dtype, n, seed=100 * r + i + 7) for i, n in enumerate(counts)]
                      for r in range(size)]
                mine = xs[rank]
                entries = []
                batch = []
                for i, x in enumerate(mine):
                    name = f"{tag}.{dtype}.{op!r}.{mode}.{i}"
                    d = to_device(x)
                    e = make_entry(Kind.ALLREDUCE, name, d, dtype, op, pre, post, inplace=mode == "inplace")
                    entries.append((e, d))
                    batch.append((e.request, e, None))
                gx.allreduce_batch(batch)
                gx.flush()
                averaged = (gx.path == "NCCL" and op == ReduceOp.AVERAGE and wire.startswith(("float", "bfloat"))
                            and gx.nccl.version >= 21000)
                for i, (e, d) in enumerate(entries):
                    n_checks += 1
                    try:
                        out = result(e)
                    except Exception as exc:
                        failures.append(f"{dtype} {op!r} {mode}[{i}]: {exc}")
                        continue
                    if mode == "inplace" and out is not d:
                        failures.append(f"{dtype} {op!r} inplace returned a new array")
                    got = to_host(out, dtype).reshape(-1)
                    post_total = post / size if op == ReduceOp.AVERAGE and not averaged else post
                    want = reference([xs[r][i] for r in range(size)], dtype, wire, op, pre, post_total)
                    if averaged and size > 1:
                        want = reference([xs[r][i] for r in range(size)], dtype, wire, ReduceOp.SUM,
                                         pre, post / size)
                    if exact(got, want):
                        continue
                    if floats and not must_be_exact:
                        tol = 2e-2 if dtype in ("float16", "bfloat16") else 1e-5
                        w64 = want.astype(np.float64)
                        atol = tol * max(1.0, float(np.abs(w64).max(initial=0.0)))
                        if np.allclose(got.astype(np.float64), w64, rtol=tol, atol=atol):
                            continue
                    bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[:3]
                    failures.append(f"{dtype} {op!r} {mode}[{i}]: differs at byte {bad.tolist()} "
                                    f"got {got[:4]} want {want[:4]}")
    # a joined rank (the last; its items carry no entry) contributes each op's identity, so
    # Min, Max and Product are the other ranks' (zeros would make a Min of positives 0)
    # (negative values too, and bfloat16, whose buffer holds bits: a +0.0 for Max, a NaN for Min)
    for dtype in ("float32", "float16", "bfloat16") if size > 1 else ():
        wire = wire_for(dtype, gx.path, gx.bf16)
        for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
            xs = [[((np.abs(sample("float32", n, seed=31 * r + i + 5)) % 3 + 1)
                    * np.where(np.arange(n) % 2, -1.0, 1.0)).astype(np_dtype(dtype))
                   for i, n in enumerate((5, 300))] for r in range(size)]
            batch, entries = [], []
            for i, x in enumerate(xs[rank]):
                e = make_entry(Kind.ALLREDUCE, f"{tag}.joined.{dtype}.{op!r}.{i}", to_device(x), dtype, op, 1.0, 1.0)
                batch.append((e.request, None if rank == size - 1 else e, None))
                entries.append(e)
            gx.allreduce_batch(batch)
            gx.flush()
            if rank == size - 1:
                continue
            for i, e in enumerate(entries):
                n_checks += 1
                got = to_host(result(e), dtype).reshape(-1).astype(np.float64)
                want = reference([xs[r][i] for r in range(size - 1)], dtype, wire, op, 1.0, 1.0).astype(np.float64)
                if not np.allclose(got, want, rtol=2e-2 if dtype != "float32" else 1e-5):
                    failures.append(f"joined rank, {dtype} {op!r}[{i}]: got {got[:4]} want {want[:4]}")
    return n_checks, failures


def other_collectives(gx, size, rank, tag):
    """broadcast (in place and not), allgather (uneven rows), alltoall (splits), reducescatter."""
    from hvddp.engine.messages import Kind, ReduceOp

    failures = []
    checks = 0
    for dtype in ("float32", "bfloat16", "int64", "uint8"):
        # broadcast from the last rank
        root = size - 1
        x = sample(dtype, 37, seed=rank)
        for inplace in (False, True):
            d = to_device(x.reshape(37, 1))
            e = make_entry(Kind.BROADCAST, f"{tag}.bc.{dtype}.{inplace}", d, dtype, root=root, inplace=inplace)
            gx.run_one(e.request, e, None)
            gx.flush()
            checks += 1
            want = sample(dtype, 37, seed=root)
            got = to_host(result(e), dtype).reshape(-1)
            if not exact(got, want):
                failures.append(f"broadcast {dtype} inplace={inplace}")
        # allgather, rank r contributes r + 2 rows
        rows = [r + 2 for r in range(size)]
        parts = [sample(dtype, rows[r] * 3, seed=50 + r).reshape(rows[r], 3) for r in range(size)]
        d = to_device(parts[rank])
        e = make_entry(Kind.ALLGATHER, f"{tag}.ag.{dtype}", d, dtype)
        gx.run_one(e.request, e, rows)
        gx.flush()
        checks += 1
        if not exact(to_host(result(e), dtype), np.concatenate(parts)):
            failures.append(f"allgather {dtype}")
        # alltoall: rank s sends (s + d + 1) rows to rank d
        matrix = [[s + t + 1 for t in range(size)] for s in range(size)]
        blocks = [sample(dtype, sum(matrix[s]) * 2, seed=70 + s).reshape(-1, 2) for s in range(size)]
        d = to_device(blocks[rank])
        e = make_entry(Kind.ALLTOALL, f"{tag}.a2a.{dtype}", d, dtype)
        gx.run_one(e.request, e, matrix)
        gx.flush()
        checks += 1
        out, splits = result(e)
        want = []
        for s in range(size):
            start = sum(matrix[s][:rank])
            want.append(blocks[s][start:start + matrix[s][rank]])
        if not exact(to_host(out, dtype), np.concatenate(want)) or list(splits) != [m[rank] for m in matrix]:
            failures.append(f"alltoall {dtype}")
    # reducescatter, Sum with prescale, uneven rows (7 rows over size ranks)
    for dtype in ("float32", "float16", "int32"):
        xs = [sample(dtype, 7 * 4, seed=90 + r).reshape(7, 4) for r in range(size)]
        pre = 2.0 if dtype != "int32" else 1.0
        d = to_device(xs[rank])
        e = make_entry(Kind.REDUCESCATTER, f"{tag}.rs.{dtype}", d, dtype, op=ReduceOp.SUM, pre=pre)
        gx.run_one(e.request, e, None)
        gx.flush()
        checks += 1
        base, extra = divmod(7, size)
        counts = [base + (1 if r < extra else 0) for r in range(size)]
        start = sum(counts[:rank])
        total = sum(x.astype(np.float64) * pre for x in xs)[start:start + counts[rank]]
        got = to_host(result(e), dtype).astype(np.float64)
        if got.shape != total.shape or not np.allclose(got, total, rtol=2e-3, atol=2e-3):
            failures.append(f"reducescatter {dtype}: got {got.ravel()[:4]} want {total.ravel()[:4]}")
    return checks, failures


# Sections -----------------------------------------------------------------------------------
@guarded("env")
def section_env():
    import cupy

    from hvddp.backends import device
    from hvddp.backends.nccl import check_version_note

    props = cupy.cuda.runtime.getDeviceProperties(0)
    row("env", "cupy", True, f"{cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
                             f"driver {cupy.cuda.runtime.driverGetVersion()}")
    row("env", "device", True, f"{props['name'].decode()} x{cupy.cuda.runtime.getDeviceCount()}")
    row("env", "cuda_built / nccl_built", device.cuda_built(), f"{device.cuda_built()} / {device.nccl_built()}")
    row("env", "nccl", device.nccl_built(), check_version_note(device.nccl_version()))
    try:
        import torch

        row("env", "torch", True if torch.cuda.is_available() else None, f"{torch.__version__}, cuda={torch.version.cuda}, "
                                                        f"is_available={torch.cuda.is_available()}")
    except ImportError:
        row("env", "torch", None, "not installed")


@guarded("kernels")
def section_kernels():
    import cupy

    from hvddp.backends import gpu_pack
    from hvddp.backends.gpu_pack import (ITEMSIZE, make_plan, mpi_wire_dtype, nccl_wire_dtype,
                                         reference_copy)

    pairs = sorted({(d, d) for d in DTYPES} | {(d, nccl_wire_dtype(d)) for d in DTYPES}
                   | {(nccl_wire_dtype(d), d) for d in DTYPES} | {(d, mpi_wire_dtype(d)) for d in DTYPES}
                   | {(mpi_wire_dtype(d), d) for d in DTYPES})
    counts = [5, 0, gpu_pack.BLOCK_ELEMS + 3, 1, 64, 100000]
    stream = cupy.cuda.Stream(non_blocking=True)
    bad = []
    for src, dst in pairs:
        for scale in (1.0, 0.3):
            if src == dst == "bool" and scale != 1.0:
                continue
            sources = [sample(src, n, seed=i) for i, n in enumerate(counts)]
            sources[3] = None  # a joined member: zeros
            plan = make_plan(counts, dst)
            poison = np.full(plan.total * ITEMSIZE[dst], 0xAB, dtype=np.uint8)
            buf = cupy.asarray(poison)
            dsrc = [None if a is None else to_device(a) for a in sources]
            isz = ITEMSIZE[dst]
            fused = [buf.data.ptr + off * isz for off in plan.offsets]
            gpu_pack.launch_copy(plan, src, dst, [0 if a is None else a.data.ptr for a in dsrc], fused,
                                 scale, stream)
            stream.synchronize()
            want = poison.copy().view(np_dtype(dst))
            reference_copy(plan, sources, scale, True, want, None)
            if buf.get().tobytes() != want.tobytes():
                bad.append(f"pack {src}->{dst} x{scale}")
            outs = [cupy.asarray(np.full(n * np_dtype(src).itemsize, 0xCD, dtype=np.uint8)) for n in counts]
            gpu_pack.launch_copy(plan, dst, src, fused, [o.data.ptr for o in outs], scale, stream)
            stream.synchronize()
            refs = [np.full(n * np_dtype(src).itemsize, 0xCD, dtype=np.uint8).view(np_dtype(src)) for n in counts]
            reference_copy(plan, None, scale, False, want, refs)
            for i, (o, r) in enumerate(zip(outs, refs)):
                if o.get().tobytes() != r.tobytes():
                    bad.append(f"unpack {dst}->{src} x{scale} [{i}]")
    row("kernels", f"pack/unpack, {len(pairs)} dtype pairs x 2 scales, poisoned", not bad,
        "; ".join(bad[:6]) or "bit-identical to the CPU path")


@guarded("nccl np=1")
def section_nccl_single():
    from mpi4py import MPI

    from hvddp.backends import device

    if not device.nccl_built():
        row("nccl np=1", "allreduce", None, "NCCL not available")
        return
    gx, _ = make_executor("NCCL", MPI.COMM_SELF)
    t0 = time.perf_counter()
    n, failures = allreduce_cases(gx, MPI.COMM_SELF, 1, 0, "n1")
    row("nccl np=1", f"allreduce, {len(DTYPES)} dtypes (bf16 {'native' if gx.bf16 else 'widened'}), "
                     f"fused/alone/in-place, {n} tensors", not failures,
        "; ".join(failures[:5]) or f"exact, {time.perf_counter() - t0:.1f} s")
    # a joined member in a fused batch contributes zeros and gets no output
    from hvddp.engine.messages import Kind, ReduceOp

    x = sample("float32", 100, 1)
    e = make_entry(Kind.ALLREDUCE, "n1.join.0", to_device(x), "float32", ReduceOp.SUM)
    joined = e.request._replace(name="n1.join.1")
    gx.allreduce_batch([(e.request, e, None), (joined, None, None)])
    gx.flush()
    row("nccl np=1", "fused batch with a joined (zeros) member", exact(to_host(result(e), "float32"), x))
    n, failures = other_collectives(gx, 1, 0, "n1")
    row("nccl np=1", f"broadcast/allgather/alltoall/reducescatter ({n} checks)", not failures,
        "; ".join(failures[:5]))


@guarded("nccl np=2")
def section_nccl_two():
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        row("nccl np=2", "two NCCL ranks", None,
            f"not possible here: {count} GPU; one GPU cannot host two NCCL ranks (NCCL refuses duplicate "
            f"devices). Multi-rank NCCL needs a multi-GPU machine; the staging section covers np=2.")
        return
    run_workers(2, "nccl2", "nccl np=2")


def mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


def run_workers(np_, mode, section, timeout=240, extra_env=None, script=None):
    """Launch this file's worker ``mode`` (or ``script``, which prints ``WIRED OK rank r`` on
    success) on ``np_`` ranks and add a row per result."""
    exe = mpiexec()
    if exe is None:
        row(section, "mpiexec", False, "no mpiexec (pip install mpich)")
        return
    env = {k: v for k, v in os.environ.items()  # nothing of an enclosing MPI job leaks in
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPICH_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    from hvddp.runner import _launcher_family  # (reads `mpiexec --version`; loads no MPI here)

    # Open MPI's launcher refuses root and more ranks than cores unless told
    flags = ["--allow-run-as-root", "--oversubscribe"] if _launcher_family(exe) == "openmpi" else []
    target = [script] if script else [os.path.abspath(__file__), "--worker", mode]
    cmd = [exe, "-n", str(np_), *flags, sys.executable, "-m", "mpi4py", *target]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        row(section, f"{mode} at np={np_}", False, f"timed out after {timeout} s; output: {str(exc.stdout)[-800:]}")
        return
    found = proc.stdout.count("WIRED OK") == np_ if script else False
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            found = True
            r = json.loads(line[7:])
            row(section, r["check"], r["ok"], r["detail"])
    if proc.returncode != 0 or not found:
        row(section, f"{mode} at np={np_} exit {proc.returncode}", False,
            (proc.stdout[-600:] + " | " + proc.stderr[-900:]).replace("\n", " / "))
    else:
        row(section, f"{mode} at np={np_}" + (" passed, wall" if script else " wall"), True,
            f"{time.perf_counter() - t0:.1f} s")


@guarded("staging")
def section_staging():
    run_workers(2, "staging", "staging")


@guarded("public API")
def section_public_api():
    """tests/mpi_gpu_wired.py: hvddp's collectives on device arrays through the engine, at np=1
    (NCCL) and np=2 (staged through MPI when the two ranks share one GPU)."""
    import cupy

    import tempfile

    script = os.path.join(ROOT, "tests", "mpi_gpu_wired.py")
    with tempfile.TemporaryDirectory() as tmp:  # the worker checks its timeline's spans on rank 0
        env = dict({"HVDDP_FAKE_KERNELS": FAKE_CUPY} if FAKE_CUPY else {},
                   HVDDP_TIMELINE=os.path.join(tmp, "timeline.json"))
        run_workers(1, "collectives on device arrays", "public API", extra_env=env, script=script)
        shared = not FAKE_CUPY and cupy.cuda.runtime.getDeviceCount() < 2
        run_workers(2, "collectives on device arrays", "public API", script=script,
                    extra_env=dict(env, HVDDP_GPU_OPERATIONS="MPI") if shared else env)


def run_torch_workers(section, mode, check, on_stand_in):
    """``mode`` at np=1, then at np=2, staged through MPI when the two ranks share one GPU (they
    cannot both join an NCCL communicator there)."""
    try:
        import torch
    except ImportError:
        row(section, check, None, "torch not installed")
        return
    if not torch.cuda.is_available() and not (on_stand_in and FAKE_CUPY):
        row(section, check, None, "torch has no CUDA (install a CUDA build)")
        return
    run_workers(1, mode, section)
    if FAKE_CUPY:  # CPU tensors on the stand-in: at 2 ranks that is tests/test_torch.py's (18 s more)
        row(section, f"{check} at np=2", None, "on the CPU stand-in, np=1 only")
        return
    shared = torch.cuda.device_count() < 2
    run_workers(2, mode, section, extra_env={"HVDDP_GPU_OPERATIONS": "MPI"} if shared else None)


@guarded("optimizer")
def section_optimizer():
    run_torch_workers("optimizer", "optimizer", "DistributedOptimizer on CUDA", on_stand_in=False)


@guarded("torch ops")
def section_torch_ops():
    run_torch_workers("torch ops", "torch_ops", "hvddp.torch on CUDA tensors", on_stand_in=True)


@guarded("bandwidth")
def section_bandwidth():
    import cupy

    from hvddp.backends import gpu_pack
    from hvddp.backends.gpu_pack import make_plan

    stream = cupy.cuda.Stream(non_blocking=True)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    shrink, reps = (256, 1) if FAKE_CUPY else (1, 20)

    def timed(fn, reps=reps):
        fn()
        stream.synchronize()
        start.record(stream)
        for _ in range(reps):
            fn()
        stop.record(stream)
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / reps / 1e3

    for n_tensors, elems in ((256, 64 * 1024 // shrink), (4096, 1024 // shrink), (16, 4 * 1024 * 1024 // shrink)):
        with stream:
            tensors = [cupy.ones(elems, dtype=cupy.float32) for _ in range(n_tensors)]
            outs = [cupy.empty(elems, dtype=cupy.float32) for _ in range(n_tensors)]
        plan = make_plan([elems] * n_tensors, "float32")
        with stream:
            buf = cupy.empty(plan.total, dtype=cupy.float32)
            flat_src = cupy.ones(plan.total, dtype=cupy.float32)
        fused = [buf.data.ptr + off * 4 for off in plan.offsets]
        srcs = [t.data.ptr for t in tensors]
        dsts = [o.data.ptr for o in outs]
        nbytes = n_tensors * elems * 4

        def pack_unpack():
            gpu_pack.launch_copy(plan, "float32", "float32", srcs, fused, 1.0, stream)
            gpu_pack.launch_copy(plan, "float32", "float32", fused, dsts, 0.5, stream)

        def two_copies():
            cupy.cuda.runtime.memcpyAsync(buf.data.ptr, flat_src.data.ptr, nbytes, 3, stream.ptr)
            cupy.cuda.runtime.memcpyAsync(flat_src.data.ptr, buf.data.ptr, nbytes, 3, stream.ptr)

        def per_tensor():
            for s, f in zip(srcs, fused):
                cupy.cuda.runtime.memcpyAsync(f, s, elems * 4, 3, stream.ptr)
            for f, d in zip(fused, dsts):
                cupy.cuda.runtime.memcpyAsync(d, f, elems * 4, 3, stream.ptr)

        t_fused = timed(pack_unpack)
        t_copy = timed(two_copies)
        t_each = timed(per_tensor, reps=min(reps, 5))
        gbps = lambda t: 4 * nbytes / t / 1e9  # each pass reads and writes nbytes; two passes
        row("bandwidth", f"{n_tensors} x {elems * 4 // 1024} KiB fp32 ({nbytes / 2**20:.0f} MiB)", True,
            f"fused pack+unpack {t_fused * 1e3:.3f} ms ({gbps(t_fused):.0f} GB/s); two plain D2D copies "
            f"{t_copy * 1e3:.3f} ms ({gbps(t_copy):.0f} GB/s); copy/fused time ratio {t_copy / t_fused:.2f}; "
            f"per-tensor memcpy {t_each * 1e3:.3f} ms")


# Workers (under mpiexec) --------------------------------------------------------------------
def emit(check, ok, detail=""):
    print("RESULT " + json.dumps({"check": check, "ok": ok, "detail": str(detail)}), flush=True)


def worker(mode):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if mode in ("staging", "nccl2"):
        import cupy

        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        gx, _ = make_executor("MPI" if mode == "staging" else "NCCL", comm)
        n, failures = allreduce_cases(gx, comm, size, rank, mode)
        failures = sum(comm.allgather(failures), [])
        m, more = other_collectives(gx, size, rank, mode)
        more = sum(comm.allgather(more), [])
        if rank == 0:
            detail = "; ".join(failures[:5]) or ("exact" if mode == "staging" else "")
            emit(f"allreduce {gx.path} np={size}, {n} tensors per rank, rank-dependent inputs", not failures,
                 detail)
            emit(f"broadcast/allgather/alltoall/reducescatter {gx.path} np={size} ({m} checks)", not more,
                 "; ".join(more[:5]))
        return
    if mode == "optimizer":
        optimizer_worker(comm, rank, size)
        return
    if mode == "torch_ops":
        torch_ops_worker(comm, rank, size)
        return
    raise SystemExit(f"unknown worker mode {mode!r}")


def optimizer_worker(comm, rank, size):
    import copy

    import torch

    import hvddp.torch as hvd

    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(48, 8, generator=g).to(device)
    Y = torch.randn(48, 1, generator=g).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    xs, ys = X.chunk(size)[rank], Y.chunk(size)[rank]
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(5):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(X), Y).backward()
        ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref_flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    diff = (flat - ref_flat).abs().max().item()
    gathered = hvd.allgather(flat.reshape(1, -1).cpu(), name="gpu_check.params")
    same = bool((gathered == gathered[0]).all())
    if rank == 0:
        path = os.environ.get("HVDDP_GPU_OPERATIONS", "NCCL")
        emit(f"DistributedOptimizer on {device.type} np={size} ({path}): parity with one process on the full batch",
             diff < 1e-5 and same, f"max |diff| {diff:.2e}, replicas identical: {same}")
    hvd.shutdown()


def torch_ops_worker(comm, rank, size):
    """hvddp.torch's collectives on CUDA tensors (CPU tensors with the stand-in) against numpy."""
    import torch

    import hvddp.torch as hvd

    hvd.init()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    failures, checks = [], 0

    def check(what, got, want, exact=True):
        nonlocal checks
        checks += 1
        if got.device != device:
            failures.append(f"{what}: result on {got.device}, not {device}")
            return
        g = got.detach().cpu().float().numpy() if got.dtype == torch.bfloat16 else got.detach().cpu().numpy()
        w = np.asarray(want, dtype=g.dtype)
        if g.shape != w.shape or not (np.array_equal(g, w) if exact else np.allclose(g, w, rtol=1e-2, atol=1e-2)):
            failures.append(f"{what}: got {g.ravel()[:4]} want {w.ravel()[:4]}")

    def make(dtype, fill, shape=(5, 3)):
        return torch.full(shape, fill, dtype=dtype, device=device)

    ranks = np.arange(size)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                  torch.uint8, torch.int8):
        name = str(dtype).split(".")[1]
        x = make(dtype, rank + 1)
        check(f"allreduce Sum {name}", hvd.allreduce(x, op=hvd.Sum, name=f"t.sum.{name}"),
              np.full((5, 3), (ranks + 1).sum()))
        check(f"allreduce Max {name}", hvd.allreduce(x, op=hvd.Max, name=f"t.max.{name}"), np.full((5, 3), size))
        if dtype.is_floating_point:
            check(f"allreduce Average {name}", hvd.allreduce(x, name=f"t.avg.{name}"),
                  np.full((5, 3), (ranks + 1).mean()))
            y = make(dtype, 2 * (rank + 1))
            hvd.allreduce_(y, op=hvd.Sum, prescale_factor=0.5, name=f"t.inplace.{name}")
            check(f"allreduce_ in place, prescale {name}", y, np.full((5, 3), (ranks + 1).sum()))
        if x.dtype != torch.bool:
            rows = rank + 1  # rank-dependent first dimension
            got = hvd.allgather(make(dtype, rank, (rows, 2)), name=f"t.gather.{name}")
            check(f"allgather {name}", got, np.concatenate([np.full((r + 1, 2), r) for r in ranks]))
            got = hvd.broadcast(make(dtype, rank + 7), root_rank=size - 1, name=f"t.bcast.{name}")
            check(f"broadcast {name}", got, np.full((5, 3), size + 6))
    # async, grouped, alltoall, reducescatter on float32
    handles = [hvd.allreduce_async(make(torch.float32, rank + i), op=hvd.Sum, name=f"t.async.{i}")
               for i in range(4)]
    for i, h in enumerate(handles):
        check(f"allreduce_async {i}", hvd.synchronize(h), np.full((5, 3), (ranks + i).sum()))
    outs = hvd.grouped_allreduce([make(torch.float32, rank), make(torch.float16, 1, (7,))], op=hvd.Sum,
                                 name="t.grouped")
    check("grouped_allreduce float32", outs[0], np.full((5, 3), ranks.sum()))
    check("grouped_allreduce float16", outs[1], np.full((7,), size))
    # Adasum, staged through the host on a GPU: the pairwise tree of ranks, against float64
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from adasum_reference import adasum_reference

    def adasum_input(r):
        return np.random.default_rng(5).standard_normal(40) + 0.7 * np.random.default_rng(6 + r).standard_normal(40)

    got = hvd.allreduce(torch.tensor(adasum_input(rank), dtype=torch.float32, device=device), op=hvd.Adasum,
                        name="t.adasum")
    check("allreduce Adasum float32", got, adasum_reference([adasum_input(r) for r in ranks]), exact=False)
    send = torch.arange(2 * size, dtype=torch.float32, device=device) + 100 * rank
    got = hvd.alltoall(send, name="t.alltoall")
    check("alltoall", got, np.concatenate([np.arange(2 * rank, 2 * rank + 2) + 100 * r for r in ranks]))
    got = hvd.reducescatter(make(torch.float32, rank + 1, (2 * size, 3)), op=hvd.Sum, name="t.scatter")
    check("reducescatter", got, np.full((2, 3), (ranks + 1).sum()))
    # gradients flow back through a differentiable allreduce on the device
    w = make(torch.float32, rank + 1).requires_grad_()
    hvd.allreduce(w * 2, op=hvd.Sum, name="t.grad").sum().backward()
    check("allreduce backward", w.grad, np.full((5, 3), 2.0 * size))
    # SyncBatchNorm on the device equals BatchNorm1d over every rank's rows
    torch.manual_seed(0)
    data = torch.randn(4 * size, 6, generator=torch.Generator().manual_seed(3)) * 5 + 2
    sbn = hvd.SyncBatchNorm(6).to(device)
    bn = torch.nn.BatchNorm1d(6).to(device)
    out = sbn(data[4 * rank:4 * rank + 4].to(device))
    want = bn(data.to(device))[4 * rank:4 * rank + 4]
    check("SyncBatchNorm forward", out, want.detach().cpu().numpy(), exact=False)
    check("SyncBatchNorm running mean", sbn.running_mean, bn.running_mean.cpu().numpy(), exact=False)
    # optimizer state made on the root's device reaches the others on theirs (Adam's step stays on the CPU)
    model = torch.nn.Linear(4, 3).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if rank == 0:
        model(torch.ones(2, 4, device=device)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state[model.weight]
    checks += 1
    if set(state) != {"step", "exp_avg", "exp_avg_sq"} or state["exp_avg"].device != device:
        failures.append(f"broadcast_optimizer_state: state {sorted(state)} on "
                        f"{state['exp_avg'].device if 'exp_avg' in state else None}")
    else:
        moments = hvd.allgather(state["exp_avg"].reshape(1, -1), name="t.adam")
        check("broadcast_optimizer_state: Adam moments equal the root's", moments,
              np.repeat(moments[:1].cpu().numpy(), size, axis=0))
    failures = sum(comm.allgather(failures), [])
    if rank == 0:
        path = os.environ.get("HVDDP_GPU_OPERATIONS", "NCCL") if cuda else "CPU stand-in"
        emit(f"hvddp.torch collectives on {device.type} tensors np={size} ({path}): {checks} checks, "
             f"8 dtypes, async, grouped, in place, Adasum, backward, SyncBatchNorm, optimizer state", not failures, "; ".join(failures[:5]))
    hvd.shutdown()


def use_fake_cupy():
    if FAKE_CUPY:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import fake_cupy

        fake_cupy.install(FAKE_CUPY, nccl=True)


def main():
    use_fake_cupy()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all), "
                                                   "e.g. --only kernels,bandwidth")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    t0 = time.perf_counter()
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        row("env", "cupy", False, f"not importable ({exc}): pip install cupy-cuda12x (or cupy-cuda13x, "
                                  f"matching the CUDA driver)")
    else:
        # sections that launch mpiexec run before this process initializes MPI itself
        sections = (section_env, section_kernels, section_staging, section_public_api,
                    section_optimizer, section_torch_ops, section_nccl_two, section_nccl_single,
                    section_bandwidth)
        names = {fn.__name__[len("section_"):] for fn in sections}
        only = set(filter(None, args.only.split(",")))
        if only - names:
            parser.error(f"--only: unknown section(s) {sorted(only - names)}; known: {sorted(names)}")
        for section in sections:
            if not only or section.__name__[len("section_"):] in only:
                section()
    print()
    print(f"hvddp gpu_check ({time.perf_counter() - t0:.0f} s)")
    widths = [max(len(r[i]) for r in ROWS) for i in range(3)]
    print(f"| {'section':<{widths[0]}} | {'check':<{widths[1]}} | {'result':<{widths[2]}} | detail |")
    print(f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 2)}|{'-' * (widths[2] + 2)}|--------|")
    for section, check, status, detail in ROWS:
        detail = detail.replace("|", "/")  # keep the markdown table intact
        print(f"| {section:<{widths[0]}} | {check:<{widths[1]}} | {status:<{widths[2]}} | {detail} |")
    failed = sum(r[2] == "FAIL" for r in ROWS)
    print(f"\n{sum(r[2] == 'ok' for r in ROWS)} passed, {failed} failed, {sum(r[2] == 'skipped' for r in ROWS)} skipped")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
