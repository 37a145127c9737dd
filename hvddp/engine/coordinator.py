"""Rank 0's side of negotiation: who is ready for which name, and do their requests agree.

Only requests that missed the response cache reach here (the slow path). A name is ready when
every member of its process set that has not joined has announced it. Ready names are checked
field by field; a disagreement becomes an error response that every member raises, naming the
tensor, the field and each rank's value. A request that its rank refused (it raised there at
once, for an argument bad in itself) carries the reason and fails the name on every rank.
Grouped requests are released together.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Sequence

from ..config import variable_name
from ..exceptions import KIND_MISMATCH, REFUSED
from .messages import GROUP_FAILURE, JOIN_TOLERANT, Kind, Request, Response, ReduceOp

log = logging.getLogger("hvddp")
# the names hvddp.torch's DistributedOptimizer gives its gradients
_GRADIENT_NAME = re.compile(r"grad\d*\.")

JOIN_KEY = (0, "__join__")


class Decision(NamedTuple):
    """What rank 0 broadcasts after a slow-path round."""

    responses: List[Response]
    evict: List[tuple]
    join_mode: bool
    fatal: Optional[str]


class _Attempt:
    """The groups that failed in one round, while some ranks had not sent all their members:
    those members the ranks owe (see ``Coordinator._owed_sends``)."""

    __slots__ = ("senders", "errors", "owed")

    def __init__(self, senders: Dict[tuple, Dict[int, Request]], errors: Dict[tuple, str],
                 owed: Dict[int, tuple]) -> None:
        self.senders = senders  # member key -> the requests that had sent it, by rank
        self.errors = errors  # member key -> what failed its group
        # rank -> (the errors its code had met by the failure, the keys of the members it owes)
        self.owed = owed


def _how(requests: Dict[int, Request]) -> str:
    """``rank 0 in a group of 2; rank 1 on its own``."""
    return "; ".join(f"rank {r} " + ("on its own" if q.group is None else f"in a group of {q.group[1]}")
                     for r, q in sorted(requests.items()))


class _Waiting:
    __slots__ = ("requests", "first_seen", "warned")

    def __init__(self, now: float) -> None:
        self.requests: Dict[int, Request] = {}
        self.first_seen = now
        self.warned = False


def _fields(kind: Kind) -> Sequence[str]:
    common = ("dtype", "device")
    if kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        return common + ("shape", "op", "prescale", "postscale", "group")
    if kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        return common + ("ndim", "trailing shape", "group")
    if kind is Kind.BROADCAST:
        return common + ("shape", "root rank")
    if kind is Kind.ADD_PROCESS_SET:
        return ("ranks",)
    if kind is Kind.REMOVE_PROCESS_SET:
        return ("process set id",)
    return ()


def _value(request: Request, field: str):
    if field == "ndim":
        return len(request.shape)
    if field == "trailing shape":
        return tuple(request.shape[1:])
    if field == "root rank":
        return request.root
    if field in ("ranks", "process set id"):
        return request.extra
    if field == "op":
        return ReduceOp(request.op)
    if field == "group":
        return "not grouped" if request.group is None else f"a group of {request.group[1]}"
    return getattr(request, field)


class Coordinator:
    """Kept on rank 0 only; fed every slow-path round, answers with a ``Decision``."""

    def __init__(self, world_size: int, process_sets, cache, config, timeline=None) -> None:
        self.world_size = world_size
        self.process_sets = process_sets
        self.cache = cache
        self.config = config
        self.timeline = timeline
        self.table: "OrderedDict[tuple, _Waiting]" = OrderedDict()
        self.joined: List[int] = []  # in order of joining
        self._evict: List[tuple] = []
        self._fatal: Optional[str] = None
        # the failed attempts whose members some ranks still owe, and the late members sent since,
        # failed in the next decide()
        self._attempts: List[_Attempt] = []
        self._late: Dict[tuple, tuple] = {}  # key -> (its _Attempt, {late rank: its request})
        self._raised: Dict[int, int] = {}  # rank -> the latest Request.raised it sent

    # ------------------------------------------------------------------------------------
    def ingest(self, rank: int, requests: Sequence[Request], now: float) -> None:
        if requests:
            self._raised[rank] = requests[-1].raised
        if self._attempts:
            self._owed_sends(rank, requests)
        for request in requests:
            if request.kind is Kind.JOIN:
                if rank not in self.joined:
                    self.joined.append(rank)
                continue
            key = request.key()
            if self.cache.has_name(key) and key not in self._evict:
                self._evict.append(key)
            waiting = self.table.get(key)
            since = now - request.waited  # (waited: a cached name demoted after waiting that long)
            if waiting is None:
                waiting = self.table[key] = _Waiting(since)
                if self.timeline:
                    self.timeline.negotiate_start(key, request.kind.value)
            waiting.requests[rank] = request
            if since < waiting.first_seen:
                waiting.first_seen = since
            if self.timeline:
                self.timeline.negotiate_rank_ready(key, rank, request.kind.value)

    def _owed_sends(self, rank: int, requests: Sequence[Request]) -> None:
        """Settle what ``rank`` owes to failed attempts, now that it sends ``requests``.

        A rank that had not sent every member of a group that failed (its first members met
        the others' other grouping) can send the rest later, as its hooks fire: the others will
        not send them again, so such a late member fails in the next ``decide`` (unless another
        rank has sent the name again by then). A call is late only if this rank made it before
        its code met an error since the failure (``Request.raised``); one made after is a new
        call (a retry, or the next step), and the rank owes nothing more."""
        for request in requests:
            key = request.key()
            for attempt in [a for a in self._attempts if rank in a.owed]:
                raised, keys = attempt.owed[rank]
                if request.raised > raised:
                    self._forgive(attempt, rank)
                elif key in keys:
                    keys.discard(key)
                    self._late.setdefault(key, (attempt, {}))[1][rank] = request
                    if not keys:
                        self._forgive(attempt, rank)

    def _forgive(self, attempt: _Attempt, rank: int) -> None:
        del attempt.owed[rank]
        if not attempt.owed:
            self._attempts.remove(attempt)

    def _late_error(self, key: tuple, waiting: _Waiting) -> Optional[str]:
        """The error for the late members of a failed attempt waiting under ``key``, if only late
        ranks sent it (a rank that sent it again since meets them as usual)."""
        attempt, late = self._late.pop(key)
        if any(r not in late for r in waiting.requests):
            return None
        kind = next(iter(waiting.requests.values())).kind.value
        return (f"{kind} {key[1]!r} was sent late ({_how(late)}): {_how(attempt.senders[key])} had sent it "
                f"before, and its group failed, so they will not send it again for that step. The group "
                f"failed with: {attempt.errors[key]} Group the same tensors, in the same order, on every "
                f"rank (or none).")

    def forget_process_set(self, ps_id: int) -> None:
        """Drop the names waiting on a removed set: every rank has failed its own entries for them."""
        for key in [k for k in self.table if k[0] == ps_id]:
            del self.table[key]
            if self.timeline:
                self.timeline.negotiate_end(key)
        for key in [k for k in self._late if k[0] == ps_id]:
            del self._late[key]
        self._attempts = [a for a in self._attempts if all(k[0] != ps_id for k in a.senders)]

    def wants_round(self) -> bool:
        """True when rank 0 has something to announce (a fatal stall) though no rank sent anything."""
        return self._fatal is not None

    def check_stalls(self, now: float) -> None:
        """Log (once per name) which ranks are missing names that others have waited on."""
        cfg = self.config
        if not self.table:
            return
        late = []
        for key, waiting in self.table.items():
            if not waiting.warned and now - waiting.first_seen > cfg.stall_check_time_s:
                waiting.warned = True
                late.append((key, waiting))
        if late and not cfg.stall_check_disable:  # the warning only: a shutdown time still holds
            log.warning("%s", self._stall_text(late, now, "stalled"))
        limit = cfg.stall_shutdown_time_s
        if limit > 0 and self._fatal is None:
            if any(now - w.first_seen > limit for w in self.table.values()):
                # named with it: every name late enough to warn about (a name announced through the
                # cache reaches this table only when demoted, up to seconds after its submission)
                floor = min(limit, cfg.stall_check_time_s) if cfg.stall_check_time_s > 0 else limit
                dead = [(k, w) for k, w in self.table.items() if now - w.first_seen > floor]
                self._fatal = (self._stall_text(dead, now, "stalled") +
                               f" Shutting down after {variable_name('STALL_SHUTDOWN_TIME_SECONDS')}={limit:g}.")

    def _stall_text(self, late, now: float, word: str) -> str:
        parts = []
        for (ps_id, name), waiting in late:
            ps = self.process_sets.get(ps_id)  # None: removed (decide() answers it next)
            members = ps.ranks if ps is not None else []
            missing = [r for r in members if r not in waiting.requests and r not in self.joined]
            kind = next(iter(waiting.requests.values())).kind.value
            refused = sorted(r for r, q in waiting.requests.items() if q.refused is not None)
            where = f" on process set {ps_id}" if ps_id else ""  # (one name may wait on two sets)
            parts.append(f"{kind} {name!r}{where} (waiting {now - waiting.first_seen:.1f} s): "
                         f"submitted by ranks {sorted(waiting.requests)}"
                         + (f" (refused there by ranks {refused}: they raised at once)" if refused else "")
                         + f", missing on ranks {missing}")
        return (f"{word} collectives: one or more ranks have not submitted these: "
                + "; ".join(parts) + ". A rank skipped a step, took another code path, or died.")

    # ------------------------------------------------------------------------------------
    def decide(self, now: float) -> Decision:
        ready: List[tuple] = []
        errors: Dict[tuple, str] = {}
        late_keys = set()  # the late members failed this round
        joined = set(self.joined)
        for key, waiting in self.table.items():
            ps = self.process_sets.get(key[0])
            if ps is None:
                errors[key] = (f"{next(iter(waiting.requests.values())).kind.value} {key[1]!r}: its process "
                               f"set (id {key[0]}) was removed before every member submitted it.")
                ready.append(key)
                continue
            late = self._late_error(key, waiting) if key in self._late else None
            if late is not None:
                errors[key] = late
                late_keys.add(key)
                ready.append(key)
                continue
            members = ps.ranks
            submitted = waiting.requests
            if any(r not in submitted and r not in joined for r in members):
                continue
            ready.append(key)
            first = next(iter(submitted.values()))
            # (a member that made the call before it joined has its data in: the call runs)
            absent = sorted(r for r in joined.intersection(members) if r not in submitted)
            if first.kind not in JOIN_TOLERANT and absent:
                sparse = first.kind is Kind.ALLGATHER and _GRADIENT_NAME.match(key[1])
                hint = (" (hvddp.torch's DistributedOptimizer allgathers sparse gradients: with join(), "
                        "pass sparse_as_dense=True)" if sparse else "")
                errors[key] = (f"{first.kind.value} {key[1]!r} cannot run while rank(s) {absent} have "
                               f"called join() without making it; only allreduce and barrier accept "
                               f"joined ranks. Call it before join(){hint}.")
        ready = self._complete_groups(ready, errors)
        responses: List[Response] = []
        failed_groups: Dict[str, str] = {}  # group id -> the error that failed one of its members
        seen: Dict[tuple, tuple] = {}  # failed member key -> (its requests by rank, its group's error)
        ran: Dict[tuple, dict] = {}  # group member key agreed on -> its requests by rank
        for key in ready:
            waiting = self.table.pop(key)
            if key in errors:
                request = next(iter(waiting.requests.values()))
                responses.append(Response(request.kind, key[0], key[1], errors[key], request))
            else:
                responses.append(self._response(key, waiting))
            if responses[-1].error is not None:
                for request in waiting.requests.values():
                    if request.group is not None:
                        failed_groups.setdefault(request.group[0], responses[-1].error)
                        seen.setdefault(key, (waiting.requests, responses[-1].error))
            elif responses[-1].request.group is not None:
                ran[key] = waiting.requests  # (popped: no longer changes)
            if self.timeline:
                self.timeline.negotiate_end(key)
        if failed_groups:  # a group is atomic: no member runs when one fails
            for i, response in enumerate(responses):
                group = response.request.group if response.request is not None else None
                if response.error is None and group is not None and group[0] in failed_groups:
                    responses[i] = response._replace(error=failed_groups[group[0]])
                    seen[response.key()] = (ran[response.key()], failed_groups[group[0]])
            responses += self._fail_rest_of_groups(failed_groups, seen)
            self._owe(seen, late_keys)
        if seen or late_keys:  # group failures count where they are raised (hvddp.handles.RAISED)
            for i, response in enumerate(responses):
                if response.error is not None and (response.key() in seen or response.key() in late_keys):
                    responses[i] = response._replace(info=GROUP_FAILURE)
        if len(self.joined) == self.world_size:
            responses.append(Response(Kind.JOIN, JOIN_KEY[0], JOIN_KEY[1],
                                      request=Request(Kind.JOIN, 0, JOIN_KEY[1], "", ()),
                                      info=self.joined[-1]))
            self.joined = []
        evict, self._evict = self._evict, []
        return Decision(responses, evict, bool(self.joined), self._fatal)

    def _fail_rest_of_groups(self, failed_groups: Dict[str, str], seen: Dict[tuple, tuple]) -> List[Response]:
        """Error responses for the members of failed groups that some ranks never submitted
        (ranks whose groups differ in size): they would otherwise stay pending there forever,
        holding their names, and show up as stalls."""
        responses = []
        for key, waiting in list(self.table.items()):
            gid = next((q.group[0] for q in waiting.requests.values()
                        if q.group is not None and q.group[0] in failed_groups), None)
            if gid is None:
                continue
            del self.table[key]
            seen[key] = (waiting.requests, failed_groups[gid])
            request = next(iter(waiting.requests.values()))
            responses.append(Response(request.kind, key[0], key[1], failed_groups[gid], request))
            if self.timeline:
                self.timeline.negotiate_end(key)
        return responses

    def _owe(self, seen: Dict[tuple, tuple], late_keys: set) -> None:
        """Record the members of this round's failed groups that ranks have not sent yet: they
        owe them (``_owed_sends``). Not the late members themselves: the other ranks had their
        answer for those, and their next call under such a name is a new one, even if their code
        met no error since (it failed on another rank only). The other members of a group that a
        late member failed are owed as usual: a rank that has not sent one yet (its hooks send it
        later, ungrouped) would otherwise wait for ever for ranks that will not send it again."""
        joined = set(self.joined)
        owed: Dict[int, tuple] = {}
        for key, (senders, _) in seen.items():
            if key in late_keys:
                continue
            ps = self.process_sets.get(key[0])
            for r in ps.ranks if ps is not None else ():
                if r not in senders and r not in joined:
                    owed.setdefault(r, (self._raised.get(r, 0), set()))[1].add(key)
        if owed:
            self._attempts.append(_Attempt({k: senders for k, (senders, _) in seen.items()},
                                           {k: error for k, (_, error) in seen.items()}, owed))

    def _complete_groups(self, ready: List[tuple], errors) -> List[tuple]:
        counts: Dict[str, int] = {}
        for key in ready:
            group = next(iter(self.table[key].requests.values())).group
            if group is not None:
                counts[group[0]] = counts.get(group[0], 0) + 1
        if not counts:
            return ready
        kept = []
        for key in ready:
            requests = self.table[key].requests.values()
            group = next(iter(requests)).group
            # ranks that grouped this name differently never complete one group: answer now, and
            # _response reports the difference (waiting would stall whichever rank has more)
            differs = any(q.group != group for q in requests)
            if group is None or counts[group[0]] >= group[1] or key in errors or differs:
                kept.append(key)
        return kept

    def _response(self, key: tuple, waiting: _Waiting) -> Response:
        ps = self.process_sets[key[0]]
        by_rank = waiting.requests
        requests = [(r, by_rank[r]) for r in ps.ranks if r in by_rank]
        first = requests[0][1]
        refused: Dict[str, List[int]] = {}
        for r, q in requests:
            if q.refused is not None:
                refused.setdefault(q.refused, []).append(r)
        if refused:  # before the fields: a refused request carries none of its arguments
            return Response(first.kind, key[0], key[1],
                            f"{first.kind.value} {key[1]!r} {REFUSED} "
                            + "; on ".join(f"rank(s) {ranks} ({why})" for why, ranks in refused.items())
                            + ", which raised at once; no rank runs it. Fix the call on those ranks.",
                            first)
        kinds = {r: q.kind.value + (" (in a group)" if q.group is not None else "") for r, q in requests}
        if len({q.kind for _, q in requests}) > 1:
            return Response(first.kind, key[0], key[1],
                            f"{key[1]!r} {KIND_MISMATCH}: "
                            + ", ".join(f"rank {r} {k}" for r, k in kinds.items())
                            + ". Every rank must call the same collective under one name.", first)
        for field in _fields(first.kind):
            values = {r: _value(q, field) for r, q in requests}
            hint = ""
            if field == "root rank":  # requests carry the set's index; users pass global ranks
                values = {r: ps.ranks[v] if 0 <= v < len(ps.ranks) else v for r, v in values.items()}
            elif field in ("ranks", "process set id") and len(set(values.values())) > 1:
                # the sets as users know them: by their ranks (an id alone, "(2,)", named none)
                values = {r: (f"{list(v)}" if field == "ranks" else
                              f"the set of {list(self.process_sets[v[0]].ranks)} (id {v[0]})"
                              if v[0] in self.process_sets else f"id {v[0]}") for r, v in values.items()}
                hint = "; every rank must add and remove the same process sets, in the same order"
            elif field == "group" and len(set(values.values())) == 1 and len({q.group for _, q in requests}) > 1:
                # groups of one size with other members (whose names differ): the ids tell them apart
                values = {r: f"{v} (id {q.group[0]})" for (r, q), v in zip(requests, values.values())}
                hint = (" (groups of one size with other members, or the same ones in another order: "
                        "group the same tensors in the same order on every rank)")
            if len(set(values.values())) > 1:
                shown = ", ".join(f"rank {r} {v}" for r, v in values.items())
                return Response(first.kind, key[0], key[1],
                                f"{first.kind.value} {key[1]!r}: {field} differs across ranks: "
                                f"{shown}{hint}.", first)
        info = None
        if first.kind is Kind.ALLGATHER:
            info = [by_rank[r].shape[0] if r in by_rank else 0 for r in ps.ranks]
        elif first.kind is Kind.ALLTOALL:
            info = [list(by_rank[r].splits) for r in ps.ranks]
            bad = [(r, len(s)) for r, s in zip(ps.ranks, info) if len(s) != ps.size]
            if bad:
                return Response(first.kind, key[0], key[1],
                                f"alltoall {key[1]!r}: splits must have one entry per rank "
                                f"({ps.size}), got lengths " + ", ".join(f"rank {r} {n}" for r, n in bad)
                                + ".", first)
        return Response(first.kind, key[0], key[1], None, first, info)
