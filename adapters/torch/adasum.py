"""``DistributedOptimizer(op=hvd.Adasum)``: combine each rank's update with Adasum, as Horovod does.

Adasum is applied to what the optimizer would change, not to the gradients: as soon as backward
has accumulated a parameter's gradient (every ``backward_passes_per_step`` passes), this rank
runs the wrapped optimizer's update on that parameter alone, from a saved copy of it, and sends
the change (``delta = updated - saved``) to be combined in place by an Adasum allreduce. ``step()``
waits and sets every parameter to ``saved + combined delta``. So the optimizer's state (momentum,
Adam's moments) stays each rank's own, and the learning rate is the one that suits a single
process (Horovod's guidance: Adasum needs no learning-rate scaling by the number of ranks).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator

import numpy as np
import torch

import hvddp
from hvddp import Adasum, HvddpError, MismatchError, ProcessSet

from ._wrapper import (WrapperCommon, check_passes, frozen_on_some_ranks, remove_hooks, split_parameters,
                       too_many_passes, weak_hook)
from .compression import Compressor
from .mpi_ops import allreduce_async_, synchronize


def check_adasum_set(names: Dict[torch.Tensor, str], process_set: ProcessSet) -> None:
    """What op=Adasum needs, checked before anything is registered: CPU parameters, and a
    process set whose size is a power of two (the same on every rank, so every rank raises)."""
    on_device = [n for p, n in names.items() if p.device.type != "cpu"]
    if on_device:
        raise ValueError(f"DistributedOptimizer: op=Adasum combines CPU tensors only in hvddp; parameters "
                         f"{on_device[:3]} are on {next(p for p in names if p.device.type != 'cpu').device}. "
                         f"Use op=hvd.Average on the GPU.")
    from hvddp.ops import _check_adasum_size

    _check_adasum_size(process_set.size(), process_set, "DistributedOptimizer")


class _DistributedAdasumOptimizer(WrapperCommon):
    """Mixin put first in the wrapper's bases; see ``DistributedOptimizer(op=Adasum)``."""

    def _hvddp_adasum_setup(self, names: Dict[torch.Tensor, str], compression: Compressor,
                            backward_passes_per_step: int, process_set: ProcessSet, index: int) -> None:
        self._hvddp_names = names
        # a process's optimizers on one set count together (Average ones too): distinct names,
        # and the ones an Average optimizer gives, so ranks that chose different ops meet and fail
        self._hvddp_prefix = "grad." if index == 0 else f"grad{index}."
        self._hvddp_compression = compression
        self._hvddp_bpps = int(backward_passes_per_step)
        self._hvddp_process_set = process_set
        self._hvddp_count = sum(len(group["params"]) for group in self.param_groups)
        self._hvddp_params = [p for p in names if p.requires_grad]  # (a dict's keys: no repeats)
        self._hvddp_frozen = [p for p in names if not p.requires_grad]  # adopted once unfrozen
        self._hvddp_delay = {p: self._hvddp_bpps for p in self._hvddp_params}
        self._hvddp_saved: Dict[torch.Tensor, torch.Tensor] = {}
        self._hvddp_flights: Dict[torch.Tensor, tuple] = {}
        self._hvddp_mirror = None  # this step's last reductions, sent by join() (see _hvddp_before_join)
        self._hvddp_active = process_set.size() > 1 and process_set.included()
        self._hvddp_hooks = []
        self._hvddp_hook_fn = weak_hook(self)
        if self._hvddp_active:
            self._hvddp_hooks = [p.register_post_accumulate_grad_hook(self._hvddp_hook_fn)
                                 for p in self._hvddp_params]
            weakref.finalize(self, remove_hooks, self._hvddp_hooks)
            hvddp.ops._before_join.add(self)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes before each update from now on (as Horovod's);
        call it between ``step()`` and the next backward pass."""
        check_passes(passes)
        if self._hvddp_flights or any(d != self._hvddp_bpps for d in self._hvddp_delay.values()):
            raise HvddpError(f"set_backward_passes_per_step({passes}): a backward pass ran since the last "
                             f"step(). Call it right after step(), before the next backward pass.")
        self._hvddp_bpps = int(passes)
        for p in self._hvddp_delay:
            self._hvddp_delay[p] = self._hvddp_bpps

    def _hvddp_hook(self, p: torch.Tensor) -> None:
        if self._hvddp_delay[p] <= 0:
            raise too_many_passes(self, p)
        self._hvddp_delay[p] -= 1
        if self._hvddp_delay[p] == 0:
            self._hvddp_send_delta(p)

    def _hvddp_send_delta(self, p: torch.Tensor) -> None:
        """Update ``p`` alone with the wrapped optimizer, turn it into the change, send that."""
        saved = self._hvddp_saved.get(p)
        if saved is None:
            saved = self._hvddp_saved[p] = torch.empty_like(p, requires_grad=False)
        with torch.no_grad():
            saved.copy_(p)
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(q is p for q in group["params"]) else []
            super().step()  # the wrapped class's update, on this parameter only
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(saved)  # p holds this rank's change until step() puts the result there
        try:
            sent, ctx = self._hvddp_compression.compress(p.detach())
            handle = allreduce_async_(sent, name=self._hvddp_prefix + self._hvddp_names[p], op=Adasum,
                                      process_set=self._hvddp_process_set)
        except Exception:
            with torch.no_grad():
                p.copy_(saved)  # refused (say, an integer parameter): leave it as it was
            raise
        self._hvddp_flights[p] = (handle, ctx)

    def _hvddp_send_rest(self) -> tuple:
        """Send the updates not yet sent and the step's presence reduction; returns what ``step()``
        waits on: the latter's handle and bytes, and the parameters these are about."""
        if self._hvddp_frozen:
            self._hvddp_adopt_unfrozen()
        for p in self._hvddp_params:
            if p not in self._hvddp_flights:  # no gradient yet, or fewer passes than set: sent now
                self._hvddp_send_delta(p)
        # under the name of an op=Average optimizer's (ranks that chose different ops then all fail
        # on the updates' names, none waits for it), a byte for every parameter of the optimizer
        # (the same count on every rank, whatever each froze): 1 where this rank trains it (tracked,
        # and not frozen since without a gradient), then its complement, so that one frozen on some
        # ranks only (the others waited for ever on a change never sent, or the frozen rank took
        # theirs) raises on every rank
        params, tracked = list(self._hvddp_names), set(self._hvddp_params)
        n = len(params)
        had = np.empty(2 * n, dtype=np.uint8)
        had[:n] = np.fromiter((p in tracked and (p.requires_grad or p.grad is not None) for p in params),
                              dtype=np.uint8, count=n)
        had[n:] = 1 - had[:n]
        handle = hvddp.allreduce_async_(had, None, self._hvddp_prefix[:-1] + ":had", hvddp.Max,
                                        process_set=self._hvddp_process_set)
        return handle, had, params

    def _hvddp_split(self, sent: tuple) -> list:
        """Wait for the step's presence reduction (see ``_hvddp_send_rest``); when some parameters
        train on some ranks only, send zeros here for those the other ranks wait on (under their
        names, so that every rank's calls end) and return the error to raise, else nothing."""
        handle, had, params = sent
        hvddp.synchronize(handle)
        split = split_parameters(params, had)
        if not split:
            return []
        errors = [MismatchError(frozen_on_some_ranks([self._hvddp_names[p] for p in split], "combined by Adasum"))]
        handles = []
        for p in split:
            if p not in self._hvddp_flights:  # (frozen here since wrapping: nothing sent)
                zeros, _ = self._hvddp_compression.compress(torch.zeros_like(p, requires_grad=False))
                handles.append(allreduce_async_(zeros, name=self._hvddp_prefix + self._hvddp_names[p], op=Adasum,
                                                process_set=self._hvddp_process_set))
        for handle in handles:
            try:
                synchronize(handle)
            except Exception as exc:  # (the error above says more)
                errors.append(exc)
        return errors

    def _hvddp_before_join(self) -> None:
        """Send the rest of this step (``hvddp.join()`` calls it first) when a backward pass ran
        since ``step()``: sent from a ``step()`` after ``join()``, it met the other ranks' next
        step's (as the Average optimizer's; see its ``_hvddp_before_join``). What sending raises,
        ``step()`` raises."""
        if self._hvddp_active and self._hvddp_mirror is None and (
                self._hvddp_flights or any(d != self._hvddp_bpps for d in self._hvddp_delay.values())):
            try:
                self._hvddp_follow_wrapped()
                self._hvddp_mirror = self._hvddp_send_rest()
            except Exception as exc:
                self._hvddp_mirror = exc

    def synchronize(self) -> None:
        """Nothing to do ahead of ``step()`` with Adasum (as in Horovod): the gradients are not
        reduced; the updates are, inside ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise HvddpError("skip_synchronize() does not apply with op=Adasum (as in Horovod): each "
                         "parameter's update is computed and sent as soon as backward accumulates its "
                         "gradient, so gradients clipped between backward() and step() would change "
                         "nothing. Clip inside backward (a p.register_hook on each parameter), or use "
                         "op=hvd.Average.")
        yield  # pragma: no cover

    # torch.amp.GradScaler.step(optimizer) hands itself to step(), which refuses it: the updates
    # are computed during backward from the still-scaled gradients (Horovod's silently were)
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """Send every update not yet sent, wait, and set each parameter to ``saved + combined``."""
        if grad_scaler is not None:
            raise TypeError("DistributedOptimizer(op=Adasum) cannot step through a GradScaler: each "
                            "parameter's update is computed during backward, from its gradient as "
                            "it is then (still scaled), before the scaler could unscale it or check "
                            "it for inf/NaN. Use op=Average with the GradScaler, or train without "
                            "loss scaling (bfloat16 autocast needs none).")
        self._hvddp_follow_wrapped()
        if not self._hvddp_active:
            loss = super().step(closure)
            self._hvddp_mark_stepped()
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mirror = self._hvddp_mirror if self._hvddp_mirror is not None else self._hvddp_send_rest()
        self._hvddp_mirror = None
        # (sending failed in join(), see _hvddp_before_join: what was sent is applied first)
        errors, refused, had_error = [mirror] if isinstance(mirror, Exception) else [], [], None
        if not isinstance(mirror, Exception):
            try:  # awaited first: a parameter trained on some ranks only applies nowhere
                refused = self._hvddp_split(mirror)
            except Exception as exc:  # raised after the updates' errors, which say more (a wrapper
                had_error = exc  # of another kind on some rank sends another length there)
            errors += refused
        flights, self._hvddp_flights = self._hvddp_flights, {}
        for p, (handle, ctx) in flights.items():
            try:
                delta = self._hvddp_compression.decompress(synchronize(handle), ctx)
            except Exception as exc:  # wait for all before raising, so names are free again
                errors.append(exc)
                delta = None
            with torch.no_grad():
                if delta is None or refused:
                    p.copy_(self._hvddp_saved[p])  # leave the parameter as it was
                else:
                    p.copy_(self._hvddp_saved[p].add_(delta))
        if had_error is not None:
            errors.append(had_error)
        for p in self._hvddp_params:
            self._hvddp_delay[p] = self._hvddp_bpps
        self._hvddp_mark_stepped()
        if errors:
            raise errors[0]
        return loss

    def zero_grad(self, *args, **kwargs) -> None:
        """Reset gradients as the wrapped optimizer does.

        Raises:
            hvddp.HvddpError: updates of this step are still being combined, or passes are
                being accumulated (called after ``backward()`` and before ``step()``).
        """
        if getattr(self, "_hvddp_flights", None):
            raise HvddpError(f"zero_grad() was called after backward() and before step(): "
                             f"{len(self._hvddp_flights)} parameter update(s) are being combined. Call "
                             f"step() first.")
        delay = getattr(self, "_hvddp_delay", None) or {}
        if any(d != self._hvddp_bpps for d in delay.values()):  # (as the Average optimizer, Horovod)
            raise HvddpError(f"zero_grad() was called after backward() and before step(): the gradients "
                             f"of fewer than backward_passes_per_step={self._hvddp_bpps} passes are "
                             f"being accumulated, and zeroing them would drop those passes. Call step() "
                             f"first.")
        return super().zero_grad(*args, **kwargs)  # (its own signature and defaults, as in Horovod)


_DistributedAdasumOptimizer.step.hooked = True  # type: ignore[attr-defined]  (see optimizer.py)
