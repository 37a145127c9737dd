"""What both ``DistributedOptimizer`` mixins (Average/Sum in ``optimizer.py``, Adasum in
``adasum.py``) share: their hooks, the backward-pass count, loading in place, and marking the
wrapped optimizer as stepped."""

from __future__ import annotations

import numbers
import weakref
from typing import Any, Callable

import torch

from hvddp import HvddpError


def load_in_place(optimizer: torch.optim.Optimizer, state_dict: dict, load: Callable[[dict], None]) -> None:
    """``load(state_dict)``, then move what it loaded into the optimizer's previous
    ``param_groups`` list, group dicts and ``state`` mapping: torch's ``load_state_dict`` makes
    new ones, which would cut off whatever shares the old (a DistributedOptimizer and the
    optimizer it wraps, an LR scheduler holding either)."""
    groups, state = optimizer.param_groups, optimizer.state
    optimizer.__dict__["_hvddp_loading"] = True  # (a follower's load hook waits for the end)
    try:
        load(state_dict)
    finally:
        optimizer.__dict__.pop("_hvddp_loading", None)
    if optimizer.param_groups is not groups:
        for old, new in zip(groups, optimizer.param_groups):
            old.clear()
            old.update(new)
        optimizer.param_groups = groups
    if optimizer.state is not state:
        state.clear()
        state.update(optimizer.state)
        optimizer.state = state


def check_passes(passes: Any) -> None:
    if isinstance(passes, bool) or not isinstance(passes, numbers.Integral):
        raise TypeError(f"`backward_passes_per_step` must be an int >= 1, got {type(passes).__name__} {passes!r}.")
    if passes < 1:
        raise ValueError(f"`backward_passes_per_step` must be >= 1, got {passes}.")


def check_real(params, names, where: str = "") -> None:
    """Refuse a complex parameter by name (TypeError): the core reduces real tensors only, and
    without this check its refusal came from inside backward(), naming no parameter."""
    bad = next((p for p in params if p.is_complex()), None)
    if bad is not None:
        raise TypeError(f"DistributedOptimizer: parameter {names[bad]!r}{where} is {bad.dtype}; hvddp reduces "
                        f"real tensors only. Keep the parameter real (torch.view_as_real(p) as the "
                        f"parameter, torch.view_as_complex(p) where the model uses it).")


def weak_hook(optimizer) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(optimizer)

    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._hvddp_hook(p)

    hook.hvddp_owner = ref
    return hook


def too_many_passes(optimizer, p: torch.Tensor) -> HvddpError:
    """The error for a gradient accumulated more than ``backward_passes_per_step`` times, naming
    the likeliest cause: another DistributedOptimizer still alive on the same parameter (each
    counts the passes, and only the one stepped starts again), else too few step() calls."""
    name, passes = optimizer._hvddp_names[p], optimizer._hvddp_bpps
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    owners = [getattr(fn, "hvddp_owner", lambda: None)() for fn in list(hooks.values())]
    if any(owner is not None and owner is not optimizer for owner in owners):
        return HvddpError(
            f"the gradient of {name!r} was accumulated more than backward_passes_per_step={passes} "
            f"times before this DistributedOptimizer's step(), and another DistributedOptimizer, "
            f"still alive, also wraps this parameter: each counts its backward passes, and the one "
            f"not stepped never starts again. Free the old wrapper before wrapping again (delete "
            f"what still holds it: a variable, an LR scheduler made on it), or keep stepping the "
            f"old one.")
    return HvddpError(
        f"the gradient of {name!r} was accumulated more than backward_passes_per_step={passes} "
        f"times before step() (or synchronize()). Increase backward_passes_per_step to accumulate "
        f"gradients locally, or call step() after each {passes} backward pass(es). (Within a "
        f"single backward pass: a parameter used inside and outside a reentrant "
        f"torch.utils.checkpoint gets two gradient accumulations; pass use_reentrant=False to "
        f"checkpoint.)")


def split_parameters(params: list, trains: Any) -> list:
    """The parameters trained on some ranks only, from the step's presence bytes after their Max
    reduction: ``trains`` holds a byte per parameter (1 where a rank trains it) then its
    complement (1 where a rank leaves it alone); both are 1 for such a parameter."""
    n = len(params)
    return [p for p, a, b in zip(params, trains[:n].tolist(), trains[n:2 * n].tolist()) if a and b]


def frozen_on_some_ranks(names: list, combined: str) -> str:
    """The error when the step's presence bytes show parameters reduced on some ranks only."""
    return (f"DistributedOptimizer: parameter {names[0]!r} is frozen on some ranks and trains on others "
            f"({len(names)} parameter(s): {names[:5]}): left alone where it is frozen (requires_grad=False, "
            f"no gradient) and {combined} where it trains, the replicas would part. No update was applied. "
            f"Freeze and unfreeze parameters (requires_grad_()) at the same step on every rank.")


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _wrapped_class(wrapper) -> type:
    """The torch optimizer class a DistributedOptimizer's class was made around."""
    return next(c for c in type(wrapper).__mro__ if issubclass(c, torch.optim.Optimizer)
                and not issubclass(c, WrapperCommon))


class WrapperCommon:
    """Base of both mixins; each sets ``_hvddp_bpps`` and defines ``set_backward_passes_per_step``."""

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as the wrapped class does, into the ``param_groups`` and ``state`` objects this
        optimizer shares with the wrapped one (so an LR scheduler made on either still drives
        both)."""
        load_in_place(self, state_dict, super().load_state_dict)

    @property
    def backward_passes_per_step(self) -> int:
        """The backward passes accumulated before each reduction (settable, as in Horovod)."""
        return self._hvddp_bpps

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (as the wrapped optimizer does) and communicate for it too."""
        super().add_param_group(param_group)
        if not hasattr(self, "_hvddp_names"):
            return  # called from the wrapped class's __init__, before set-up
        try:
            self._hvddp_adopt_group(len(self.param_groups) - 1)
        except TypeError:  # (a complex parameter: the group is not added)
            self.param_groups.pop()
            raise

    def _hvddp_adopt_group(self, gi: int) -> None:
        """Name and take on the parameters of ``param_groups[gi]`` not seen before."""
        new = {p: f"noname.{gi}.{j}" for j, p in enumerate(self.param_groups[gi]["params"])
               if p not in self._hvddp_names}
        check_real(new, new, " (of a parameter group added after wrapping)")
        for p, name in new.items():
            self._hvddp_names[p] = name
            self._hvddp_added(p)

    def _hvddp_follow_wrapped(self) -> None:
        """Catch up with calls made on the wrapped optimizer after wrapping: its
        ``load_state_dict`` (torch's makes new ``param_groups`` and ``state``, which this one would
        no longer share) and its ``add_param_group`` (parameters nothing would average)."""
        wrapped = getattr(self, "_hvddp_wrapped", None)
        wrapped = wrapped() if wrapped is not None else None
        if wrapped is not None and (wrapped.param_groups is not self.param_groups
                                    or wrapped.state is not self.state):
            self.param_groups, self.state = wrapped.param_groups, wrapped.state
        count = sum(len(group["params"]) for group in self.param_groups)
        if count != self._hvddp_count:
            for gi in range(len(self.param_groups)):
                self._hvddp_adopt_group(gi)
            self._hvddp_count = count

    def _hvddp_added(self, p) -> None:
        """A parameter of a group added after set-up: tracked if it trains, else kept for later."""
        if p.requires_grad:
            self._hvddp_track(p)
        else:
            self._hvddp_frozen.append(p)

    def _hvddp_adopt_unfrozen(self) -> None:
        """Track the parameters that were frozen (at wrapping, or when added) and train now; every
        rank runs the same script, so every rank adopts them at the same step."""
        unfrozen = [p for p in self._hvddp_frozen if p.requires_grad]
        if unfrozen:  # (not list.remove: it compares tensors by value)
            self._hvddp_frozen = [p for p in self._hvddp_frozen if not p.requires_grad]
            for p in unfrozen:
                self._hvddp_track(p)

    def _hvddp_track(self, p) -> None:
        """Communicate for ``p`` from now on: listed, counted, and hooked when active."""
        self._hvddp_params.append(p)
        self._hvddp_delay[p] = self._hvddp_bpps
        if self._hvddp_active:
            self._hvddp_hooks.append(p.register_post_accumulate_grad_hook(self._hvddp_hook_fn))

    def _hvddp_mark_stepped(self) -> None:
        wrapped = getattr(self, "_hvddp_wrapped", None)
        wrapped = wrapped() if wrapped is not None else None
        if wrapped is not None:  # an LR scheduler made on it checks that it stepped
            wrapped._opt_called = True  # torch >= 2.4
            if "_step_count" in wrapped.__dict__:  # torch < 2.4 counts the steps (set by the scheduler)
                wrapped._step_count += 1

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a distributed {type(self).__name__} cannot be pickled (torch.save of the "
                        f"optimizer object): its class is made at run time around "
                        f"{_wrapped_class(self).__name__} and it holds autograd hooks. Save "
                        f"optimizer.state_dict() instead, and load it into a new DistributedOptimizer.")

    def __deepcopy__(self, memo):
        raise TypeError(f"a distributed {type(self).__name__} cannot be deep-copied: it is tied to its "
                        f"model's parameters by autograd hooks, and a copy would hold copies of the "
                        f"parameters that nothing reduces. Deep-copy the model and the plain optimizer, "
                        f"then wrap the copy with DistributedOptimizer on every rank; or save "
                        f"state_dict() instead.")
