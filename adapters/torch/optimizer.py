"""``DistributedOptimizer``: average gradients across ranks while backward is still running.

A post-accumulate-grad hook on every parameter submits its gradient (in place, zero-copy) the
moment autograd has finished accumulating it, so the engine reduces the last layers' gradients
while the first layers' are still being computed. ``step()`` waits for the reductions and then
runs the wrapped optimizer's own update on the averaged gradients.

Overlap needs somewhere to run: when the process may use one CPU core only (a rank bound to a
core by its launcher or by ``os.sched_setaffinity``), every rank is on this node and the
gradients are on the CPU, the engine's work
would interleave with backward on that one core, where it hides behind nothing and adds
negotiation rounds and cache misses to both. Then the hooks only count, and ``synchronize()``
submits every gradient at once (``HVDDP_OVERLAP=1``/``0`` decides instead of the core count).

The wrapper is an instance of a class built as ``(mixin, type(optimizer))``: it is still an
``isinstance`` of the wrapped optimizer's class, keeps the same ``state`` and ``param_groups``
(the very same objects), ``state_dict()``/``load_state_dict()`` are the wrapped class's, and the
class can be subclassed with zero-argument ``super()``.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import os
import warnings
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

import hvddp
from hvddp import _grouping
from hvddp import Adasum, Average, HvddpError, MismatchError, ProcessSet, ReduceOp, Sum, global_process_set
from hvddp.exceptions import KIND_MISMATCH
from hvddp.ops import _op as _check_op

from ._convert import as_numpy
from ._sparse import sparse_rows_async
from ._wrapper import (WrapperCommon, check_passes, check_real, frozen_on_some_ranks, remove_hooks, split_parameters,
                       too_many_passes, weak_hook)
from .adasum import _DistributedAdasumOptimizer, check_adasum_set
from .compression import Compression, Compressor, native
from .mpi_ops import allreduce, allreduce_async_, grouped_allreduce_async_

# GradScaler warns custom optimizers that take its grad_scaler argument (this one does) of a
# future change; the warning is for the optimizer's author, and would reach every user's log.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)

__all__ = ["DistributedOptimizer"]

_instances = {}  # process set -> counter of the optimizers made on it (they prefix the names)


def _defer_cpu_gradients() -> bool:
    """Whether CPU gradients wait for ``synchronize()`` instead of going out during backward.

    Auto: on one node the reduction is memory copies made by this rank's CPU, which a one-core
    rank cannot overlap with anything; across nodes the network moves the bytes while backward
    runs, so overlap pays even there.
    """
    setting = hvddp.runtime._state().config.overlap
    if setting is not None:
        return not setting
    if hvddp.local_size() != hvddp.size():  # the job spans nodes
        return False
    try:
        return len(os.sched_getaffinity(0)) == 1  # no core for the engine to overlap on
    except (AttributeError, OSError):  # not Linux
        return False


def parameter_names(param_groups: list, named_parameters) -> Dict[torch.Tensor, str]:
    """Each parameter's name: from ``named_parameters`` (checked: pairs, unique, covering every
    parameter of ``param_groups``), else ``noname.<group>.<index>``."""
    params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named_parameters = list(named_parameters)
    bad = [item for item in named_parameters
           if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str))]
    if bad:
        raise TypeError(f"`named_parameters` must be (name, parameter) pairs such as "
                        f"model.named_parameters(), got {bad[0]!r}.")
    names = [n for n, _ in named_parameters]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"`named_parameters` has duplicate names {dups}; parameter names must "
                         f"be unique (they name the reductions across ranks).")
    by_id = {id(p): n for n, p in named_parameters}
    unnamed = [p for p in params if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"`named_parameters` was given but {len(unnamed)} of the optimizer's "
                         f"parameters are not in it (shapes {[tuple(p.shape) for p in unnamed[:5]]}); "
                         f"pass model.named_parameters() of the model the optimizer was built on.")
    return {p: by_id[id(p)] for p in params}


def _split_list(items: list, n: int) -> List[list]:
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


_MODIFIED_IN_FLIGHT = (
    "the gradient of {name!r} was modified in place or replaced (e.g. by clip_grad_norm_), on this "
    "rank or another, after backward() and before it was averaged across ranks: the update would "
    "use the local gradient, or a mix of it and the average that differs between ranks. Call "
    "optimizer.synchronize() first, then modify the gradients, then call optimizer.step() inside "
    "`with optimizer.skip_synchronize():` "
    "(Horovod's recipe); a torch.amp.GradScaler does this itself in scaler.step(optimizer), "
    "also after scaler.unscale_(optimizer) if optimizer.synchronize() came first.")


def _version(grad: torch.Tensor) -> Optional[int]:
    """The gradient's version counter, or None when it shares its memory's counter with others.

    Autograd can hand out the pieces of one buffer as gradients (torch.cat's backward over
    parameters), and a user can make gradients views of one flat buffer: adding into a sibling
    then bumps this gradient's version too, which is not a change of it. Such a gradient is
    checked for being replaced only.
    """
    if grad.layout == torch.strided and grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
        return None
    return grad._version


class _Flight:
    """One submitted reduction (a parameter, or a group of them) and how to finish it."""

    __slots__ = ("handle", "items", "grouped", "watch")

    def __init__(self, handle, items: Optional[List[Tuple[torch.Tensor, torch.Tensor, Any, bool]]],
                 grouped: bool = False, watch: Sequence[Tuple[str, torch.Tensor, torch.Tensor]] = ()) -> None:
        self.handle = handle
        self.items = items  # (param, tensor sent, compression ctx, sparse); None: in place on p.grad
        self.grouped = grouped
        # (name, parameter, gradient) reduced in the gradient's memory, with its version then
        self.watch = [(name, p, t, _version(t)) for name, p, t in watch]

    def modified(self) -> List[torch.Tensor]:
        """The parameters whose gradient was changed or replaced since it was submitted (looked
        at before the wait: an in-place op of the adapter counts a version at its end)."""
        return [p for name, p, t, version in self.watch
                if p.grad is not t or (version is not None and t._version != version)]

    def finish(self, compression: Compressor) -> None:
        result = self.handle.wait()
        if self.items is None:
            return
        for (p, sent, ctx, sparse), out in zip(self.items, result if self.grouped else [result]):
            if sparse:
                p.grad = out
                continue
            if type(ctx) is _Rounded:  # reduced in float32: rounded once, as the core would
                out.copy_(out.to(ctx.target))
            value = out if type(ctx) is _Rounded else compression.decompress(out, ctx)
            if value is p.grad:  # reduced (and decompressed, if at all) in place, zero-copy
                continue
            if p.grad is not None and p.grad.layout == torch.sparse_coo and p.grad.shape == value.shape:
                # reduced dense (sparse_as_dense, or in a group): sparse again for the update, as in
                # Horovod, so that optimizers that take only sparse gradients (SparseAdam) still work
                p.grad = value.to(p.dtype).to_sparse(p.grad.sparse_dim())
            elif p.grad is None or p.grad.layout != torch.strided or p.grad.shape != value.shape:
                p.grad = value.to(p.dtype)
            else:
                p.grad.copy_(value)


class _Rounded:
    """The context of a float32 CPU gradient sent under ``Compression.fp16``/``.bf16`` as float32
    holding values of ``target`` (see ``_hvddp_submit``): the sum is rounded to it at finish."""

    __slots__ = ("target",)

    def __init__(self, target: torch.dtype) -> None:
        self.target = target


_ROUNDING = (Compression.fp16, Compression.bf16)


_COMPRESSION_CODES = {Compression.none: 0, Compression.fp16: 1, Compression.bf16: 2}  # 3: another compressor


def _describe_settings(code: int) -> str:
    names = ["Compression.none", "Compression.fp16", "Compression.bf16", "another compressor"]
    return f"op={'Sum' if code & 8 else 'Average'}, compression={names[code % 4]}, sparse_as_dense={bool(code & 4)}"


def _settings_differ(high: int, low: int) -> str:
    """The error for ranks that wrapped their optimizers with different settings."""
    return (f"DistributedOptimizer: the ranks wrapped their optimizers with different settings (some rank "
            f"with {_describe_settings(high)}, another with {_describe_settings(low)}): their gradients would "
            f"be averaged differently and the replicas would part. No update was applied. Pass the same "
            f"op, compression and sparse_as_dense on every rank.")


def _had_code(grad: Optional[torch.Tensor]) -> int:
    """A gradient's byte in the step's presence reduction: 1 dense, 1 + sparse dimensions if sparse."""
    return 1 + grad.sparse_dim() if grad is not None and grad.layout == torch.sparse_coo else 1


class _DistributedOptimizer(WrapperCommon):
    """Mixin put first in the wrapper's bases; see ``DistributedOptimizer``."""

    def __init__(self, params, *args, named_parameters=None, compression: Compressor = Compression.none,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0, groups=None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        self._hvddp_setup(named_parameters, compression, backward_passes_per_step, op,
                          gradient_predivide_factor, groups, sparse_as_dense, process_set)

    # set-up ------------------------------------------------------------------------------
    def _hvddp_setup(self, named_parameters, compression, backward_passes_per_step, op,
                     gradient_predivide_factor, groups, sparse_as_dense, process_set) -> None:
        check_passes(backward_passes_per_step)
        op = _check_op(op, None, "DistributedOptimizer")  # the core's check: unknown ops, Adasum
        if op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer: op must be hvddp.Average or hvddp.Sum, got {op!r}.")
        if not isinstance(gradient_predivide_factor, numbers.Real) or gradient_predivide_factor <= 0:
            raise ValueError(f"`gradient_predivide_factor` must be a positive number, got "
                             f"{gradient_predivide_factor!r}.")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError(f"`gradient_predivide_factor` applies only to op=Average, got op={op!r} "
                             f"with gradient_predivide_factor={gradient_predivide_factor}.")
        compression = native(_grouping.check_compression(compression, "DistributedOptimizer"))
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"`process_set` must be an hvddp.ProcessSet, got {type(process_set).__name__}.")

        params = [p for group in self.param_groups for p in group["params"]]
        self._hvddp_count = len(params)  # (see _hvddp_follow_wrapped)
        self._hvddp_names = parameter_names(self.param_groups, named_parameters)
        check_real(params, self._hvddp_names)
        index = next(_instances.setdefault(process_set, itertools.count()))
        self._hvddp_prefix = "grad." if index == 0 else f"grad{index}."
        self._hvddp_compression = compression
        self._hvddp_plain = compression is Compression.none
        self._hvddp_full_names = {p: self._hvddp_prefix + n for p, n in self._hvddp_names.items()}
        self._hvddp_bpps = int(backward_passes_per_step)
        self._hvddp_op = op
        self._hvddp_pre = 1.0 / gradient_predivide_factor if op is Average else 1.0
        self._hvddp_post = float(gradient_predivide_factor) if op is Average else 1.0
        self._hvddp_sparse_as_dense = bool(sparse_as_dense)
        # what every rank must share and no reduction compares, as one byte (see _hvddp_synchronize)
        self._hvddp_settings = (_COMPRESSION_CODES.get(compression, len(_COMPRESSION_CODES))
                                + 4 * bool(sparse_as_dense) + 8 * (op == Sum))
        self._hvddp_sparse_params = set()  # known to get sparse gradients (here or on a peer)
        self._hvddp_filled = set()  # without a gradient here this step (zeros, or no sparse rows)
        self._hvddp_process_set = process_set
        seen = set()
        self._hvddp_params = []  # parameters that get reduced, in a fixed order
        for p in params:
            if p.requires_grad and p not in seen:
                seen.add(p)
                self._hvddp_params.append(p)
        # frozen now: reduced once unfrozen (adopted at the next zero_grad() or synchronize())
        self._hvddp_frozen = [p for p in self._hvddp_names if not p.requires_grad]
        # Groups are made of the optimizer's parameters whether they train now or not, so that
        # every rank has the same groups whatever each froze; each reduces its members that train
        # (``_hvddp_live``), and one frozen now joins its group's reduction once unfrozen.
        self._hvddp_groups = self._hvddp_make_groups(groups)
        self._hvddp_group_of = {p: gi for gi, members in enumerate(self._hvddp_groups) for p in members}
        tracked = set(self._hvddp_params)
        self._hvddp_live = [[p for p in members if p in tracked] for members in self._hvddp_groups]
        self._hvddp_delay: Dict[torch.Tensor, int] = {p: self._hvddp_bpps for p in self._hvddp_params}
        self._hvddp_touched: set = set()
        self._hvddp_submitted: set = set()
        self._hvddp_group_ready: Dict[int, set] = {}
        self._hvddp_flights: List[_Flight] = []
        self._hvddp_versions: Dict[torch.Tensor, tuple] = {}  # deferred gradients (and versions) at their hook
        self._hvddp_sent: Any = None  # this step's reductions sent by join(), or its error (see _hvddp_before_join)
        self._hvddp_synchronized = False
        self._hvddp_should_synchronize = True
        self._hvddp_overrun: Optional[str] = None  # a gradient accumulated once too often this step
        self._hvddp_hooks = []
        self._hvddp_active = process_set.size() > 1 and process_set.included()
        self._hvddp_defer_cpu = self._hvddp_active and _defer_cpu_gradients()
        if self._hvddp_active:
            # The hooks hold the optimizer weakly and go away with it, so an optimizer that is
            # replaced (or dropped) stops reducing the model's gradients.
            self._hvddp_hook_fn = weak_hook(self)
            for p in self._hvddp_params:
                self._hvddp_hooks.append(p.register_post_accumulate_grad_hook(self._hvddp_hook_fn))
            weakref.finalize(self, remove_hooks, self._hvddp_hooks)
            hvddp.ops._before_join.add(self)

    def _hvddp_make_groups(self, groups) -> List[List[torch.Tensor]]:
        if groups is None:
            return []
        if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
            if groups < 1:
                raise ValueError(f"`groups` must be >= 1 (or a list of parameter lists), got {groups}.")
            return [g for g in _split_list(list(self._hvddp_names), int(groups)) if g]
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
            raise TypeError(f"`groups` must be an int or a list of lists of parameters, got {groups!r}.")
        # As Horovod: a tensor that is no parameter of this optimizer is left out of its group.
        valid = self._hvddp_names
        out, seen = [], set()
        for gi, group in enumerate(groups):
            kept = []
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"`groups[{gi}]` holds a {type(p).__name__}; groups are lists of "
                                    f"parameters (torch tensors).")
                if p in seen:
                    name = self._hvddp_names.get(p, f"a tensor of shape {tuple(p.shape)}")
                    raise ValueError(f"parameter {name!r} is in more than one group.")
                seen.add(p)
                if p in valid:
                    kept.append(p)
            if kept:
                out.append(kept)
        return out

    def _hvddp_added(self, p: torch.Tensor) -> None:
        """A parameter of a group added after set-up: named in full, and tracked unless frozen."""
        self._hvddp_full_names[p] = self._hvddp_prefix + self._hvddp_names[p]
        super()._hvddp_added(p)

    def _hvddp_track(self, p: torch.Tensor) -> None:
        """Also reduce ``p`` with its group (if any) from now on."""
        super()._hvddp_track(p)
        gi = self._hvddp_group_of.get(p)
        if gi is not None:  # (in the group's order; a set: `in` on a list of tensors compares values)
            live = {*self._hvddp_live[gi], p}
            self._hvddp_live[gi] = [m for m in self._hvddp_groups[gi] if m in live]

    # backward side -----------------------------------------------------------------------
    def _hvddp_hook(self, p: torch.Tensor) -> None:
        delay = self._hvddp_delay[p]
        if delay <= 0:
            self._hvddp_overrun = self._hvddp_names[p]  # (step() then says why it refuses)
            raise too_many_passes(self, p)
        delay -= 1
        self._hvddp_delay[p] = delay
        self._hvddp_touched.add(p)
        if delay or (self._hvddp_defer_cpu and p.device.type == "cpu"):
            if not delay and p.grad is not None:  # deferred: synchronize() submits it with the rest,
                self._hvddp_versions[p] = (p.grad, _version(p.grad))  # and checks nothing changed it
            return
        gi = self._hvddp_group_of.get(p)
        if gi is None:
            self._hvddp_submit_one(p)
            return
        ready = self._hvddp_group_ready.setdefault(gi, set())
        ready.add(p)
        if len(ready) == len(self._hvddp_live[gi]):
            self._hvddp_submit(self._hvddp_live[gi], gi)

    def _hvddp_submit_one(self, p: torch.Tensor) -> None:
        grad = p.grad
        if (self._hvddp_plain and grad is not None and grad.layout == torch.strided
                and grad.device.type == "cpu"):
            # The common case, kept short: the core reduces p.grad's own memory in place.
            self._hvddp_submitted.add(p)
            handle = hvddp.allreduce_async_(as_numpy(grad), None, self._hvddp_full_names[p],
                                            self._hvddp_op, self._hvddp_pre, self._hvddp_post,
                                            self._hvddp_process_set)
            self._hvddp_flights.append(_Flight(handle, None, watch=((self._hvddp_names[p], p, grad),)))
        else:
            self._hvddp_submit([p], None)

    def _hvddp_submit(self, params: Sequence[torch.Tensor], gi: Optional[int]) -> None:
        compression = self._hvddp_compression
        dense: List[Tuple[torch.Tensor, torch.Tensor, Any, bool]] = []
        for p in params:
            self._hvddp_submitted.add(p)
            grad = p.grad
            # Within a group a sparse gradient goes dense, as a rank without it sends zeros there:
            # apart, the group would hold it on some ranks and not on others.
            sparse = gi is None and not self._hvddp_sparse_as_dense and (
                grad.layout != torch.strided if grad is not None else p in self._hvddp_sparse_params)
            if grad is None:
                self._hvddp_filled.add(p)
            if sparse:  # by allgather, one per parameter, under its own name
                self._hvddp_sparse_params.add(p)
                self._hvddp_flights.append(self._hvddp_sparse_flight(p, grad))
                continue
            if grad is None:
                # Other ranks may have a gradient for it (a branch not taken here): submit zeros
                # so that every rank submits the same names.
                grad = p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            if grad.layout != torch.strided:
                grad = grad.to_dense()
            if compression in _ROUNDING and grad.dtype == torch.float32 and grad.device.type == "cpu":
                # The same numbers for less work on the CPU: MPI reduces no 16-bit floats, so the
                # core would widen them to float32, sum and round once; torch rounds here (and
                # after the sum, at finish) much faster than the core's numpy casts, and the
                # gradient is reduced in its own memory when contiguous. (Decided from what every
                # rank shares, the parameter's dtype and device: the wire dtype must agree.)
                sent = grad.contiguous()
                sent.copy_(sent.to(compression.target))
                ctx = _Rounded(compression.target)
            else:
                sent, ctx = compression.compress(grad)
            dense.append((p, sent, ctx, False))
        if not dense:
            return
        ps = self._hvddp_process_set
        if gi is None:
            p, sent, _, _ = dense[0]
            handle = allreduce_async_(sent, None, self._hvddp_prefix + self._hvddp_names[p],
                                      self._hvddp_op, self._hvddp_pre, self._hvddp_post, ps)
        else:
            # members under their parameters' names, as when ungrouped: ranks that group
            # differently then meet on a name and raise, rather than wait on different names
            handle = grouped_allreduce_async_([item[1] for item in dense], None,
                                              f"{self._hvddp_prefix}group.{gi}", self._hvddp_op,
                                              self._hvddp_pre, self._hvddp_post, ps,
                                              [self._hvddp_full_names[p] for p, _, _, _ in dense])
        # the gradients reduced in place, and those whose copy was sent: finish writes the average
        # over them, so a change made meanwhile (clipping) must not be lost silently either
        watch = [(self._hvddp_names[p], p, p.grad) for p, _, _, _ in dense if p.grad is not None]
        self._hvddp_flights.append(_Flight(handle, dense, gi is not None, watch))

    def _hvddp_sparse_flight(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> _Flight:
        handle = sparse_rows_async(grad, p, self._hvddp_full_names[p], self._hvddp_op,
                                   self._hvddp_process_set)
        return _Flight(handle, [(p, grad, None, True)])

    def _hvddp_sparse_retry(self, flight: _Flight, error: MismatchError, dense: set) -> Optional[_Flight]:
        """The sparse resubmission of a parameter that some ranks sent dense zeros for (no
        gradient there this step) and others a sparse gradient: every rank got the same
        MismatchError for its name, and now every rank knows the parameter is sparse. None (the
        error stands, on every rank) where some rank had a dense gradient of its own (``dense``)."""
        if KIND_MISMATCH not in str(error) or flight.grouped or not flight.items or len(flight.items) != 1:
            return None
        if "(in a group)" in str(error):  # grouped on some rank: the ranks group differently, and
            return None                   # that rank does not retry (a retry here would wait for ever)
        p, sent, _, sparse = flight.items[0]
        if p in dense:  # (that rank does not retry either)
            return None
        if not sparse and p not in self._hvddp_filled:  # (a flight of its own: dense zeros here)
            return None
        self._hvddp_sparse_params.add(p)
        if not sparse:
            p.grad = None  # the zeros were a stand-in
        return self._hvddp_sparse_flight(p, sent if sparse else None)

    def _hvddp_stand_in(self, params: List[torch.Tensor]) -> None:
        """Submit zeros for ``params``, left alone here (frozen) and reduced on another rank, under
        the names that rank used, so that its reductions end (in an error where the ranks' calls
        differ). A parameter in a group some of whose members were submitted needs
        none: that group's size differs from the other rank's, which fails it on every rank."""
        wanted = set(params)
        for gi in sorted({self._hvddp_group_of[p] for p in params if p in self._hvddp_group_of}):
            members = self._hvddp_groups[gi]
            if not any(p in self._hvddp_submitted for p in members):  # (what the others sent of it)
                self._hvddp_submit([p for p in members if p in wanted], gi)
        for p in params:
            if p not in self._hvddp_group_of:
                self._hvddp_submit([p], None)

    # public API ---------------------------------------------------------------------------
    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before each reduction from now on (as
        Horovod's). Call it between ``step()`` and the next backward pass, on every rank.

        Raises:
            HvddpError: a backward pass ran since the last step: its gradients are accumulating
                or already being reduced under the old count (on every rank alike).
        """
        check_passes(passes)
        if self._hvddp_pending():
            raise HvddpError(f"set_backward_passes_per_step({passes}): a backward pass ran since the last "
                             f"step(), so gradients are accumulating or being reduced under "
                             f"backward_passes_per_step={self._hvddp_bpps}. Call it right after step() (or "
                             f"synchronize()), before the next backward pass.")
        self._hvddp_bpps = int(passes)
        for p in self._hvddp_delay:
            self._hvddp_delay[p] = self._hvddp_bpps

    def synchronize(self) -> None:
        """Finish reducing every gradient; afterwards ``p.grad`` holds the average on every rank.

        Submits what the hooks have not (parameters without a gradient this step are reduced as
        zeros so that every rank submits the same names), then waits. Call it before clipping
        gradients, then run ``step()`` inside ``skip_synchronize()``.

        Raises:
            hvddp.HvddpError: a reduction failed (on every rank alike), e.g. shapes differ.
        """
        self._hvddp_follow_wrapped()
        self._hvddp_synchronize()

    def _hvddp_before_join(self) -> None:
        """Send what this step still owes the other ranks (``hvddp.join()`` calls it first).

        A rank out of data may call ``join()`` between its last ``backward()`` and ``step()``
        (Horovod's step then only applies reductions that finished): the other ranks make this
        step's calls now, so the deferred gradients, the zeros for parameters without one and the
        presence reduction go out before this rank joins; sent from ``step()``, after ``join()``,
        they met the others' next step's (another step's presence and settings, silently), or
        nothing once the others had finished. ``step()`` then only waits, and raises what
        sending raised (this rank still joins: the others' calls get its zeros, not a hang).
        """
        if self._hvddp_active and self._hvddp_sent is None and self._hvddp_pending():
            try:
                self._hvddp_follow_wrapped()
                self._hvddp_sent = self._hvddp_send()
            except Exception as exc:
                self._hvddp_sent = exc

    def _hvddp_synchronize(self) -> None:
        """``synchronize()`` once caught up with the wrapped optimizer (``step()`` did that)."""
        if not self._hvddp_active:
            self._hvddp_synchronized = True
            return
        sent, self._hvddp_sent = self._hvddp_sent or self._hvddp_send(), None
        if isinstance(sent, Exception):  # (sending failed in join(); see _hvddp_before_join)
            raise sent
        self._hvddp_finish(*sent)

    def _hvddp_send(self) -> tuple:
        """Submit every gradient not yet submitted, then the step's presence reduction; returns
        what ``_hvddp_finish`` takes: its handle, the bytes sent, the gradients changed here, the
        parameters the bytes are about and those left alone here (frozen)."""
        self._hvddp_filled = set()  # (filled below; none left from a step an error cut short)
        adopted: Any = ()
        if self._hvddp_frozen:  # (unfrozen since zero_grad(), or zero_grad() was not called)
            count = len(self._hvddp_params)
            self._hvddp_adopt_unfrozen()
            adopted = set(self._hvddp_params[count:])
        modified = {p for p, (g, v) in self._hvddp_versions.items()
                    if p.grad is not g or (v is not None and g._version != v)}
        self._hvddp_versions.clear()
        # a parameter frozen since it was wrapped, without a gradient, is left alone as in one
        # process (zeros would still move it through momentum or weight decay); every rank froze it
        idle = [p for p in self._hvddp_params if p.grad is None and not p.requires_grad]
        idle = set(idle) if idle else ()
        # Unfrozen since this backward pass began (no zero_grad() between): on its own this step,
        # with its group from the next, whether or not the group went during backward here (which
        # depends on this rank's gradients: another rank may still be waiting for a branch's).
        skip = idle if not adopted else adopted.union(idle)
        for gi, members in enumerate(self._hvddp_live):
            live = [p for p in members if p not in skip] if skip else members
            if live and live[0] not in self._hvddp_submitted:
                self._hvddp_submit(live, gi)
        for p in self._hvddp_params:
            if p not in self._hvddp_submitted and p not in idle and (p not in self._hvddp_group_of or p in adopted):
                self._hvddp_submit_one(p)
        # which parameters some rank had a gradient for (a byte each: 0 none, 1 dense, 1 + its
        # sparse dimensions if sparse): one that no rank had goes back to None after its zeros are
        # reduced, so the update skips it as in one process (zeros would still move it through
        # momentum or weight decay, and SparseAdam refuses them); one that some rank had sparse
        # and this rank filled with dense zeros (in a group, or with sparse_as_dense) is made
        # sparse here too, as that rank's is, so that every rank's update takes it alike
        # The same reduction carries the wrapper's settings that no reduction compares (a float32
        # gradient goes as float32 under every compression; a sparse_as_dense rank sends dense
        # what another allgathers, and only the latter would retry; a sparse gradient's op is
        # applied after its allgather): the byte and its complement,
        # so that the maximum shows whether every rank has the same. It is awaited first: with
        # different settings no rank retries, and every rank raises.
        # The bytes cover every parameter of the optimizer in its own order, frozen since wrapping
        # or not, so that their count is the same on every rank whatever each froze.
        params, filled = list(self._hvddp_names), self._hvddp_filled
        if len(params) != len(self._hvddp_params):  # some are frozen since wrapping (or added)
            tracked = set(self._hvddp_params)
            idle = {p for p in params if p not in tracked or p in idle}
        n = len(params)
        for flight in self._hvddp_flights:  # (before any wait: see _Flight.modified)
            modified.update(flight.modified())
        # then a byte each: 1 where this rank had a dense gradient of its own (a sparse rank must
        # not retry the allgather that such a rank never joins: it waited for ever); then 1 where
        # this rank changed the gradient before it was averaged, so that every rank refuses the
        # update (a change on one rank only, raised there alone, left the others updating); then 1
        # where this rank reduces the parameter, and its complement, so that one frozen on some
        # ranks only (left alone there, reduced elsewhere: those ranks waited for ever) raises on
        # every rank; the settings' two bytes close the array
        had = np.empty(5 * n + 2, dtype=np.uint8)
        had[:n] = np.fromiter((0 if p in filled else _had_code(p.grad) for p in params), dtype=np.uint8, count=n)
        had[n:2 * n] = had[:n] == 1
        had[2 * n:3 * n] = np.fromiter((p in modified for p in params), dtype=np.uint8, count=n)
        had[3 * n:4 * n] = np.fromiter((p not in idle for p in params), dtype=np.uint8, count=n)
        had[4 * n:5 * n] = 1 - had[3 * n:4 * n]
        had[5 * n], had[5 * n + 1] = self._hvddp_settings, 255 - self._hvddp_settings
        had_handle = hvddp.allreduce_async_(had, None, self._hvddp_prefix[:-1] + ":had", hvddp.Max,
                                            process_set=self._hvddp_process_set)
        return had_handle, had, modified, params, idle

    def _hvddp_finish(self, had_handle, had: np.ndarray, modified: set, params: list, idle) -> None:
        """Wait for the step's reductions (see ``_hvddp_send``), apply what the presence
        reduction says, and raise what failed, on every rank alike."""
        filled = self._hvddp_filled
        n = len(params)  # (the parameters when the bytes were sent: some may have been added since)
        errors, retries, had_error, stand_ins = [], [], None, []
        try:
            hvddp.synchronize(had_handle)
        except Exception as exc:  # raised after the flights' errors, which say more (a wrapper of
            had_error, had = exc, None  # another kind on some rank sends another length here)
        else:
            if int(had[5 * n]) + int(had[5 * n + 1]) != 255:  # some rank's settings differ from another's
                errors.append(MismatchError(_settings_differ(int(had[5 * n]), 255 - int(had[5 * n + 1]))))
            modified = {p for p, m in zip(params, had[2 * n:3 * n].tolist()) if m}
            split = split_parameters(params, had[3 * n:5 * n])
            if split:  # frozen on some ranks only: zeros here for what the others wait on, then raise
                errors.append(MismatchError(frozen_on_some_ranks([self._hvddp_names[p] for p in split], "averaged")))
                stand_ins = [p for p in split if p in idle]
                self._hvddp_stand_in(stand_ins)
        dense = set() if had is None else {p for p, d in zip(params, had[n:2 * n].tolist()) if d}
        flights, self._hvddp_flights = self._hvddp_flights, []
        for flight in flights:
            try:
                flight.finish(self._hvddp_compression)
            except MismatchError as exc:
                retry = None if errors or had_error else self._hvddp_sparse_retry(flight, exc, dense)
                if retry is None:
                    errors.append(exc)
                else:
                    retries.append(retry)
            except Exception as exc:  # wait for all before raising, so names are free again
                errors.append(exc)
        for flight in retries:
            try:
                flight.finish(self._hvddp_compression)
            except Exception as exc:
                errors.append(exc)
        for p in stand_ins:  # (the zeros were a stand-in: left alone, the parameter stays put)
            if p in filled:
                p.grad = None
        if had_error is not None:
            errors.append(had_error)
        elif filled and not errors:
            for p, code in zip(params, had.tolist()):
                if p not in filled:
                    continue
                if code == 0:
                    p.grad = None
                elif code > 1 and p.grad is not None and p.grad.layout == torch.strided:
                    p.grad = p.grad.to_sparse(code - 1)
        self._hvddp_filled = set()
        for p in self._hvddp_touched:
            self._hvddp_delay[p] = self._hvddp_bpps
        for p in self._hvddp_submitted:
            self._hvddp_delay[p] = self._hvddp_bpps
        self._hvddp_touched.clear()
        self._hvddp_submitted.clear()
        self._hvddp_group_ready.clear()
        self._hvddp_synchronized = True
        overrun, self._hvddp_overrun = self._hvddp_overrun, None
        if overrun is not None:  # (the extra pass also shows as a gradient changed in flight)
            raise HvddpError(
                f"this step's gradients are not averages of {self._hvddp_bpps} backward pass(es): the "
                f"gradient of {overrun!r} was accumulated once more (backward() raised then), and that "
                f"pass added into gradients already being averaged. No update was applied; call "
                f"zero_grad() and run the step again.")
        if errors:
            raise errors[0]
        if modified:
            raise HvddpError(_MODIFIED_IN_FLIGHT.format(
                name=next(self._hvddp_names[p] for p in params if p in modified)))

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (you called ``synchronize()``).

        Example:
            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._hvddp_should_synchronize = False
        try:
            yield
        finally:
            self._hvddp_should_synchronize = True

    # torch.amp.GradScaler.step(optimizer) hands itself to step() (below) instead of unscaling
    # and checking for inf/NaN before the gradients are averaged
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """Wait for the gradient reductions, then run the wrapped optimizer's update.

        With a ``closure``, the gradients it computes are averaged before the update uses them, and
        so is the loss it returns (the update reads it: LBFGS), which ``step()`` gives back.
        After an explicit ``synchronize()`` with no backward since, nothing is reduced twice.
        Called by ``scaler.step(optimizer)`` (a ``torch.amp.GradScaler``), it averages the
        gradients, unscales them unless ``scaler.unscale_(optimizer)`` already did, and skips the
        update if they hold inf or NaN: on every rank alike, since they are the average.

        Raises:
            hvddp.HvddpError: called inside ``skip_synchronize()`` with this step's gradients
                still being averaged (no ``synchronize()`` since ``backward()``); the averaging is
                finished first and no update is applied.
        """
        self._hvddp_follow_wrapped()
        if self._hvddp_active and not self._hvddp_should_synchronize and self._hvddp_pending():
            # the update would read local or half-averaged gradients (the replicas would part
            # silently); finish the reductions, so every rank's names are free, and refuse
            self._hvddp_synchronize()
            raise HvddpError(
                "step() ran inside `with optimizer.skip_synchronize():` while this step's gradients "
                "were still being averaged (no optimizer.synchronize() since backward()), so it "
                "would have updated from this rank's own or half-averaged gradients. The update was "
                "not applied; the gradients are averaged now. Call optimizer.synchronize() after "
                "backward() and before the skip_synchronize() block (then clip, then step()).")
        if grad_scaler is not None:
            return self._hvddp_scaled_step(closure, grad_scaler)
        if self._hvddp_active and not self._hvddp_should_synchronize and closure is not None:
            unchecked = closure

            def closure():  # its backward() makes gradients that this block keeps from averaging
                loss = unchecked()
                if self._hvddp_pending():
                    self._hvddp_synchronize()  # (the names are free again on every rank)
                    raise HvddpError(
                        "step(closure) ran inside `with optimizer.skip_synchronize():`, and the closure's "
                        "backward() made new gradients, which the block keeps from being averaged: the "
                        "update would have used this rank's own. It was not applied. Call step(closure) "
                        "outside the block: it averages what the closure computes.")
                return loss
        if self._hvddp_active and self._hvddp_should_synchronize:
            if closure is not None:
                inner = closure

                def closure():
                    loss = inner()
                    self._hvddp_synchronize()
                    return self._hvddp_reduce_loss(loss)
            elif self._hvddp_unsynchronized():
                self._hvddp_synchronize()
        self._hvddp_synchronized = False
        loss = super().step(closure)
        self._hvddp_mark_stepped()
        return loss

    def _hvddp_reduce_loss(self, loss):
        """A closure's loss over the ranks: averaged (summed under ``op=Sum``, as the gradients are).

        Optimizers that read it (LBFGS's line search and its stopping test) then decide alike on
        every rank; with each rank's own loss they took different steps, or a different number of
        closure calls, and the replicas parted or the ranks stalled. A one-element float tensor comes
        back detached, a number (or 0-d array) as a float; anything else (None, a tuple, a
        per-sample vector) as it was.
        """
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
            value = loss.detach()
        elif isinstance(loss, (numbers.Real, np.ndarray, np.generic)) and not isinstance(loss, (bool, np.bool_)) \
                and np.ndim(loss) == 0 and np.asarray(loss).dtype.kind in "fiu":
            value = torch.tensor(float(loss), dtype=torch.float64)
        else:  # None, or what only the caller reads (a tuple, a per-sample vector): as returned
            return loss
        op = Sum if self._hvddp_op == Sum else Average
        total = allreduce(value, name=self._hvddp_prefix[:-1] + ":loss", op=op, process_set=self._hvddp_process_set)
        return total if isinstance(loss, torch.Tensor) else float(total)

    def _hvddp_pending(self) -> bool:
        """Gradients of this step are accumulated, submitted or in flight, not yet synchronized."""
        return bool(self._hvddp_touched or self._hvddp_submitted or self._hvddp_flights)

    def _hvddp_unsynchronized(self) -> bool:
        """A backward ran since the last synchronize() (or none was called since the last step)."""
        return not (self._hvddp_synchronized and not self._hvddp_touched)

    def _hvddp_scaled_step(self, closure, scaler):
        try:
            from torch.amp.grad_scaler import OptState  # torch >= 2.3 (device-generic GradScaler)
        except ImportError:  # torch 2.1-2.2: only torch.cuda.amp.GradScaler exists
            from torch.cuda.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(self)]
        if self._hvddp_active and self._hvddp_should_synchronize and self._hvddp_unsynchronized():
            early = state["stage"] is OptState.UNSCALED  # it read gradients not yet averaged
            self._hvddp_synchronize()
            if early:
                raise HvddpError(
                    "scaler.unscale_(optimizer) ran before the gradients were averaged across "
                    "ranks, so its inf/NaN check and the unscaling saw local (or half-reduced) "
                    "gradients. Call optimizer.synchronize() before scaler.unscale_(optimizer), "
                    "then scaler.step(optimizer) inside `with optimizer.skip_synchronize():`.")
        if state["stage"] is OptState.READY:
            scaler.unscale_(self)
        if sum(v.item() for v in state["found_inf_per_device"].values()):
            return None  # inf/NaN in the average: every rank skips this update
        should, self._hvddp_should_synchronize = self._hvddp_should_synchronize, False
        try:
            return self.step(closure)
        finally:
            self._hvddp_should_synchronize = should

    def zero_grad(self, *args, **kwargs) -> None:
        """Reset gradients as the wrapped optimizer does: its own ``zero_grad`` gets the arguments
        (``set_to_none`` in torch's, with its default; an optimizer whose ``zero_grad`` takes none
        gets none).

        Raises:
            hvddp.HvddpError: gradients of this step are still being reduced (called after
                ``backward()`` and before ``step()``/``synchronize()``).
        """
        if getattr(self, "_hvddp_touched", None):
            some = sorted(self._hvddp_names[p] for p in self._hvddp_touched)[:3]
            if any(self._hvddp_delay[p] for p in self._hvddp_touched):  # (as the Adasum optimizer)
                raise HvddpError(
                    f"zero_grad() was called after backward() and before step(): the gradients of "
                    f"fewer than backward_passes_per_step={self._hvddp_bpps} passes (e.g. {some}) are "
                    f"being accumulated, and zeroing them would drop those passes. Call step() first "
                    f"(it averages the passes so far; with uneven data, call it before join()).")
            raise HvddpError(
                f"zero_grad() was called after backward() and before step() or synchronize(): "
                f"{len(self._hvddp_touched)} gradient(s) of this DistributedOptimizer's parameters "
                f"(e.g. {some}) are being reduced into p.grad. Call step() or synchronize() first; "
                f"or, if that backward pass was meant for another optimizer's parameters (a GAN's "
                f"generator step runs through the discriminator), turn off requires_grad on these "
                f"parameters for that pass (each wrapped parameter reduces every gradient it gets).")
        if getattr(self, "_hvddp_frozen", None):  # unfrozen ones are reduced in this backward's hooks
            self._hvddp_adopt_unfrozen()
        return super().zero_grad(*args, **kwargs)  # (its own signature and defaults, as in Horovod)


# torch's Optimizer wraps ``type(self).step`` with its step-hook runner (in __init__ and again in
# __setstate__, i.e. load_state_dict) unless it is marked; the wrapped class's own step is
# already wrapped, so hooks would run twice.
_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]

_classes: Dict[tuple, type] = {}  # (mixin, wrapped class) -> wrapper class


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups=None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Each parameter's gradient is reduced as soon as backward has accumulated it (its name is
    ``grad.<parameter name>``, so every rank must build the same model and pass the same
    ``named_parameters``). ``step()`` waits and then runs the wrapped update. The returned
    object shares ``state`` and ``param_groups`` with ``optimizer`` and is an instance of its
    class. In a size-1 run (or a size-1 ``process_set``) no hooks are installed and ``step()`` is
    the wrapped one.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; names the reductions (and errors).
            Without it, parameters are named by position (``noname.<group>.<index>``).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``: the gradient is cast
            for the reduction and back.
        backward_passes_per_step: backward passes accumulated locally (summed, as in Horovod;
            scale the loss to average) before the gradients are reduced.
        op: ``Average`` (default) or ``Sum``; or ``Adasum``, which (as in Horovod) combines each
            rank's update instead of the gradients: see ``hvddp.torch.adasum``. The process set's
            size must then be a power of two, and ``groups``/``gradient_predivide_factor`` do
            not apply.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        num_groups: Horovod's older spelling of an int ``groups`` (kept at its position, so
            positional calls port); used when ``groups`` is None, with a DeprecationWarning.
        groups: an int (split the parameters into that many groups) or a list of parameter
            lists; each group is reduced as one atomic grouped allreduce once all its
            gradients are ready.
        sparse_as_dense: reduce sparse gradients as dense tensors (otherwise by allgather).
        process_set: the ranks that train together.

    Returns:
        The distributed optimizer.

    Raises:
        TypeError, ValueError: a bad argument (named in the message).

    Example:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}.")
    if isinstance(optimizer, (_DistributedOptimizer, _DistributedAdasumOptimizer)):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed; wrap the "
                         "original optimizer once.")
    if num_groups:
        warnings.warn("DistributedOptimizer: `num_groups` is deprecated (as in Horovod); pass "
                      "`groups=` instead.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    compression = native(compression)  # (the core's Compression.fp16 is this module's)
    adasum = op is Adasum or (isinstance(op, numbers.Integral) and not isinstance(op, bool) and op == Adasum)
    if adasum:
        _check_adasum_arguments(compression, backward_passes_per_step, gradient_predivide_factor,
                                groups, process_set)
    mixin = _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    base = type(optimizer)
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = type(base.__name__, (mixin, base), {"__module__": __name__, "__qualname__": base.__qualname__})
        _classes[(mixin, base)] = cls
    wrapper = cls.__new__(cls)
    # Share state, param_groups, defaults and hooks; drop instance-level method patches (an LR
    # scheduler's step wrapper is bound to the original object).
    wrapper.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in ("step", "zero_grad")})
    if adasum:
        names = parameter_names(wrapper.param_groups, named_parameters)
        check_real(names, names)
        check_adasum_set(names, process_set)
        wrapper._hvddp_adasum_setup(names, compression, backward_passes_per_step, process_set,
                                    next(_instances.setdefault(process_set, itertools.count())))
    else:
        wrapper._hvddp_setup(named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, groups, sparse_as_dense, process_set)
    wrapper._hvddp_wrapped = weakref.ref(optimizer)
    if hasattr(optimizer, "register_load_state_dict_post_hook"):  # torch >= 2.1
        # the wrapped optimizer's own load_state_dict makes new param_groups and state: share
        # them at once (the hooks' dict is shared too, so the hook skips the wrapper's own loads)
        optimizer.register_load_state_dict_post_hook(_follow_hook(wrapper))
    return wrapper


def _follow_hook(wrapper):
    ref = weakref.ref(wrapper)

    def hook(loaded) -> None:
        follower = ref()
        if follower is not None and loaded is not follower and not loaded.__dict__.get("_hvddp_loading"):
            follower._hvddp_follow_wrapped()

    return hook


def _check_adasum_arguments(compression, backward_passes_per_step, gradient_predivide_factor, groups,
                            process_set) -> None:
    """The arguments that mean something with op=Adasum, checked; the others refused by name."""
    check_passes(backward_passes_per_step)
    if gradient_predivide_factor != 1.0:
        raise ValueError(f"DistributedOptimizer: gradient_predivide_factor applies only to op=Average, "
                         f"got op=Adasum with gradient_predivide_factor={gradient_predivide_factor!r}.")
    if groups is not None:
        raise ValueError("DistributedOptimizer: `groups` (and num_groups) do not apply with op=Adasum: "
                         "each parameter's update is combined on its own, with its own coefficients.")
    _grouping.check_compression(compression, "DistributedOptimizer")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"`process_set` must be an hvddp.ProcessSet, got {type(process_set).__name__}.")
