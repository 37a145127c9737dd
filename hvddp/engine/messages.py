"""What ranks tell the coordinator (requests) and what it tells them back (responses)."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple


class Kind(str, enum.Enum):
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"
    ADD_PROCESS_SET = "add_process_set"
    REMOVE_PROCESS_SET = "remove_process_set"


class ReduceOp(enum.IntEnum):
    """Reduction operators; ``hvddp.Average`` and friends are members of this enum. Their values
    are Horovod's, so a script (or a saved config) passing ``op=`` as a number means the same op."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5

    def __repr__(self) -> str:
        return self.name.capitalize()

    __str__ = __repr__


# Kinds that joined ranks take part in (with zeros) rather than make fail.
JOIN_TOLERANT = (Kind.ALLREDUCE, Kind.BARRIER, Kind.JOIN)


class Request(NamedTuple):
    """One rank's announcement of a collective; compared field by field across ranks."""

    kind: Kind
    ps_id: int
    name: str
    dtype: str
    shape: Tuple[int, ...]
    op: int = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    device: str = "cpu"
    splits: Optional[Tuple[int, ...]] = None
    group: Optional[Tuple[str, int]] = None  # (group id, number of members)
    extra: Optional[tuple] = None  # process-set ranks for ADD_PROCESS_SET
    # why this rank refused the call (it raised at once): the others must fail, not wait for it
    refused: Optional[str] = None
    # seconds since its submission, when sent late (a cached name demoted): rank 0's stall clock
    # starts that much earlier
    waited: float = 0.0
    # how many group failures this rank's code had met (hvddp.handles.RAISED) when it made the call
    raised: int = 0

    def key(self) -> tuple:
        return (self.ps_id, self.name)

    def signature(self) -> tuple:
        """What must be identical for a cached response to be reused."""
        return (self.kind, self.ps_id, self.name, self.dtype, self.shape, self.op,
                self.prescale, self.postscale, self.root, self.device, self.group)


# Response.info of an error that failed a group (or a member sent late to one): the rank that
# raises it counts it (hvddp.handles.RAISED), which tells its later calls from late members
GROUP_FAILURE = "group failure"


class Response(NamedTuple):
    """The coordinator's decision for one name: execute (``error is None``) or fail everywhere."""

    kind: Kind
    ps_id: int
    name: str
    error: Optional[str] = None
    # The agreed request (rank 0's copy for fields that must match), used by ranks that joined
    # and have no request of their own, and as the cache entry.
    request: Optional[Request] = None
    # allgather: first dimension per process-set rank; alltoall: the splits matrix [src][dst];
    # join: the last rank to join.
    info: object = None

    def key(self) -> tuple:
        return (self.ps_id, self.name)
