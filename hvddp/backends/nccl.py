"""GPU collectives through ``cupy.cuda.nccl``: one communicator per (process set, device).

A communicator is created on the first GPU collective of a process set on a device, by every
member at the same point of the agreed response order (so creation cannot deadlock): rank 0 of
the set asks NCCL for a unique id, the set's MPI communicator broadcasts it, and every member
joins. Calls are enqueued on hvddp's own stream for the device and return at once; the caller
records an event after them. Only the engine thread calls this module.

One GPU cannot host two ranks of one NCCL communicator (NCCL refuses duplicate devices), so
several ranks sharing a GPU must use the staging path (``HVDDP_GPU_OPERATIONS=MPI``).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from ..engine.messages import ReduceOp
from ..exceptions import BackendUnavailableError, HvddpError

__all__ = ["NCCL_AVG_VERSION", "NCCL_BF16_VERSION", "nccl_op", "NcclBackend"]

NCCL_AVG_VERSION = 21000  # ncclAvg and ncclBfloat16 arrived in NCCL 2.10
NCCL_BF16_VERSION = 21000

_TYPE_NAMES = {"uint8": "NCCL_UINT8", "int8": "NCCL_INT8", "int32": "NCCL_INT32",
               "int64": "NCCL_INT64", "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
               "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}
_OP_NAMES = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.AVERAGE: "NCCL_SUM", ReduceOp.MIN: "NCCL_MIN",
             ReduceOp.MAX: "NCCL_MAX", ReduceOp.PRODUCT: "NCCL_PROD"}


def nccl_op(op: int, wire: str, version: int) -> Tuple[str, bool]:
    """The NCCL op name for ``op`` on ``wire`` data, and whether it already averages.

    Average uses ``ncclAvg`` on floating-point data when NCCL has it (>= 2.10); otherwise it is a
    sum and the caller folds 1/size into its postscale (integers: truncated, as on the CPU).
    """
    op = ReduceOp(op)
    if op is ReduceOp.ADASUM:
        raise HvddpError("NCCL has no Adasum: the GPU executor stages it through the host instead.")
    if op is ReduceOp.AVERAGE and wire.startswith(("float", "bfloat")) and version >= NCCL_AVG_VERSION:
        return "NCCL_AVG", True
    return _OP_NAMES[op], False


class NcclBackend:
    """Communicators and streams per device; thin, pointer-level wrappers over NCCL calls."""

    def __init__(self) -> None:
        try:
            from cupy.cuda import nccl
        except ImportError as exc:
            raise BackendUnavailableError(
                f"NCCL is not available through CuPy (`pip install cupy-cuda12x`; CuPy loads the "
                f"nvidia-nccl-cu12 wheel): {exc}") from exc
        if not getattr(nccl, "available", False):
            raise BackendUnavailableError("CuPy was built without NCCL (cupy.cuda.nccl.available is "
                                          "False); install nvidia-nccl-cu12 or set "
                                          "HVDDP_GPU_OPERATIONS=MPI.")
        import cupy

        self.cupy = cupy
        self.nccl = nccl
        self.version = int(nccl.get_version())
        self._comms: Dict[Tuple[int, int], object] = {}

    # ------------------------------------------------------------------------------------
    def has_bf16(self) -> bool:
        return self.version >= NCCL_BF16_VERSION and hasattr(self.nccl, "NCCL_BFLOAT16")

    def dtype(self, wire: str) -> int:
        name = _TYPE_NAMES.get(wire)
        if name is None or not hasattr(self.nccl, name):
            raise HvddpError(f"NCCL has no type for {wire!r} (NCCL {self.version}).")
        return getattr(self.nccl, name)

    def op(self, op: int, wire: str) -> Tuple[int, bool]:
        name, averages = nccl_op(op, wire, self.version)
        return getattr(self.nccl, name), averages

    def comm(self, ps_id: int, ps, device_id: int):
        """The communicator of process set ``ps`` on ``device_id``, created collectively on first use.

        Every member of the set must reach this call at the same point (the agreed order).
        """
        key = (ps_id, device_id)
        comm = self._comms.get(key)
        if comm is not None:
            return comm
        uid = self.nccl.get_unique_id() if ps.rank == 0 else None
        uid = ps.comm.bcast(uid, root=0)
        with self.cupy.cuda.Device(device_id):
            try:
                comm = self.nccl.NcclCommunicator(ps.size, uid, ps.rank)
            except Exception as exc:
                raise HvddpError(
                    f"creating the NCCL communicator of process set {ps_id} ({ps.size} ranks) on "
                    f"cuda:{device_id} failed: {exc}. Each rank needs its own GPU (NCCL refuses two "
                    f"ranks on one device); with fewer GPUs than ranks set HVDDP_GPU_OPERATIONS=MPI."
                ) from exc
        self._comms[key] = comm
        return comm

    def forget(self, ps_id: int) -> None:
        """Destroy the communicators of a removed process set."""
        for key in [k for k in self._comms if k[0] == ps_id]:
            comm = self._comms.pop(key)
            try:
                comm.destroy()
            except Exception:
                pass

    def close(self) -> None:
        for ps_id in {k[0] for k in self._comms}:
            self.forget(ps_id)

    # Collectives on raw pointers, enqueued on ``stream`` (a CuPy stream) --------------------
    def allreduce(self, comm, send: int, recv: int, count: int, wire: str, op: int, stream) -> bool:
        """Enqueue an allreduce; return True if NCCL averaged (no 1/size left to apply)."""
        nop, averages = self.op(op, wire)
        comm.allReduce(send, recv, count, self.dtype(wire), nop, stream.ptr)
        return averages

    def broadcast(self, comm, send: int, recv: int, nbytes: int, root: int, stream) -> None:
        comm.broadcast(send, recv, nbytes, self.nccl.NCCL_UINT8, root, stream.ptr)

    def allgatherv(self, comm, send: int, recv: int, nbytes: Sequence[int], stream) -> None:
        """Gather ``nbytes[r]`` bytes from each rank r into ``recv``, in rank order."""
        if len(set(nbytes)) == 1:
            comm.allGather(send, recv, nbytes[0], self.nccl.NCCL_UINT8, stream.ptr)
            return
        displ = 0
        self.nccl.groupStart()
        try:
            for root, n in enumerate(nbytes):
                comm.broadcast(send, recv + displ, n, self.nccl.NCCL_UINT8, root, stream.ptr)
                displ += n
        finally:
            self.nccl.groupEnd()

    def alltoallv(self, comm, me: int, send: int, send_bytes: Sequence[int], recv: int,
                  recv_bytes: Sequence[int], stream) -> None:
        """Exchange byte ranges with every peer in one NCCL group of sends and receives."""
        sdispl = rdispl = 0
        self.nccl.groupStart()
        try:
            for peer, (sn, rn) in enumerate(zip(send_bytes, recv_bytes)):
                if sn:
                    comm.send(send + sdispl, sn, self.nccl.NCCL_UINT8, peer, stream.ptr)
                if rn:
                    comm.recv(recv + rdispl, rn, self.nccl.NCCL_UINT8, peer, stream.ptr)
                sdispl += sn
                rdispl += rn
        finally:
            self.nccl.groupEnd()

    def reducescatterv(self, comm, send: int, recv: int, counts: Sequence[int], wire: str,
                       op: int, me: int, itemsize: int, stream) -> bool:
        """Reduce ``send`` and keep this rank's ``counts[me]`` elements; return True if averaged.

        Equal counts use ncclReduceScatter; uneven ones a group of ncclReduce, one per root.
        """
        nop, averages = self.op(op, wire)
        dtype = self.dtype(wire)
        if len(set(counts)) == 1:
            comm.reduceScatter(send, recv, counts[0], dtype, nop, stream.ptr)
            return averages
        displ = 0
        self.nccl.groupStart()
        try:
            for root, n in enumerate(counts):
                if n:
                    comm.reduce(send + displ * itemsize, recv, n, dtype, nop, root, stream.ptr)
                displ += n
        finally:
            self.nccl.groupEnd()
        return averages


def check_version_note(version: Optional[int]) -> str:
    """A one-line description of what this NCCL offers, for logs and gpu_check."""
    if not version:
        return "NCCL unavailable"
    major, minor, patch = version // 10000, (version // 100) % 100, version % 100
    avg = "ncclAvg" if version >= NCCL_AVG_VERSION else "no ncclAvg (sum + postscale)"
    bf16 = "bf16" if version >= NCCL_BF16_VERSION else "no bf16 (widened to float32)"
    return f"NCCL {major}.{minor}.{patch}: {avg}, {bf16}"
