"""Start-of-training helpers: make every replica equal to the root's (parameters, optimizer state)."""

from __future__ import annotations

import collections.abc
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

import hvddp
from hvddp import ProcessSet, _grouping, global_process_set

from ._convert import TensorArgumentError, check_tensor
from .mpi_ops import broadcast_async_, synchronize
from ._wrapper import load_in_place

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


class _TensorSpec:
    """What a state tensor looks like on the root, so other ranks can allocate it: its shape,
    dtype, strides, and whether it lives with its parameter (a momentum buffer on the GPU) or on
    the CPU whatever the parameter's device (Adam's ``step``). Torch's fused optimizers pair a
    state tensor with its parameter by memory position, so a contiguous buffer beside a
    channels_last or transposed parameter (the root's follows the parameter) made the other
    ranks' updates wrong, and the replicas parted silently."""

    __slots__ = ("shape", "dtype", "stride", "with_param")

    def __init__(self, tensor: torch.Tensor, param: Optional[torch.Tensor]) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.stride = tuple(tensor.stride())
        self.with_param = param is not None and tensor.device == param.device

    def empty(self, param: Optional[torch.Tensor]) -> torch.Tensor:
        device = param.device if self.with_param and param is not None else torch.device("cpu")
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)

    def __getstate__(self):
        return (self.shape, str(self.dtype).replace("torch.", ""), self.stride, self.with_param)

    def __setstate__(self, state):
        self.shape, dtype, self.stride, self.with_param = state
        self.dtype = getattr(torch, dtype)


def _named(params: Any) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, collections.abc.Mapping):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable) and not isinstance(params, torch.Tensor):
        items = []
        for i, item in enumerate(params):
            if isinstance(item, tuple) and len(item) == 2:
                items.append(item)
            elif isinstance(item, torch.Tensor):
                items.append((f"noname.{i}", item))
            else:
                raise TypeError(f"broadcast_parameters: expected (name, tensor) pairs or tensors, "
                                f"got an item of type {type(item).__name__} at position {i}.")
    else:
        raise TypeError(f"broadcast_parameters: params must be a state_dict, named_parameters() or "
                        f"a list of tensors, got {type(params).__name__}.")
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor.")
    return items


def broadcast_parameters(params: Union[Dict[str, torch.Tensor], Iterable], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters (or buffers) in place with ``root_rank``'s.

    Every member of ``process_set`` calls it with the same names, shapes and dtypes (a
    ``model.state_dict()``, ``model.named_parameters()``, or a list of tensors in the same order).
    Blocks until done.

    Args:
        params: a state_dict, an iterable of ``(name, tensor)`` pairs, or of tensors.
        root_rank: the rank whose values everyone gets.
        process_set: the ranks taking part.

    Raises:
        ValueError: the ranks' names, shapes or dtypes differ from the root's (on every rank,
            naming the first differences).

    Example:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    named = _named(params)
    # compared on every rank first: a rank with other tensors would wait forever for broadcasts
    # the root never makes (one more layer), while the root returned
    mine = [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in named]

    def tensors(root: list, rank: int, theirs: list) -> str:
        return (f"the tensors (name, shape, dtype) differ: only the root has "
                f"{[x for x in root if x not in theirs][:3]}, only rank {rank} has "
                f"{[x for x in theirs if x not in root][:3]}; every rank must pass the same "
                f"model's state_dict() or named_parameters()")

    _check_like_the_root(mine, root_rank, process_set, "broadcast_parameters", tensors,
                         _refusal(named, "broadcast_parameters"))
    counts = collections.Counter(name for name, _ in named)
    repeated = sorted(name for name, n in counts.items() if n > 1)
    if repeated:  # (the same list on every rank, as just checked: every rank raises here)
        raise ValueError(f"broadcast_parameters: the names {repeated[:5]} appear more than once (two "
                         f"models' named_parameters() in one list?); names must be unique: broadcast "
                         f"each model in its own call, or prefix the names.")
    handles = []
    for name, tensor in named:
        handles.append(broadcast_async_(tensor.data, root_rank, f"broadcast_parameters.{name}",
                                        process_set))
    errors = []
    for handle in handles:
        try:
            synchronize(handle)
        except Exception as exc:  # wait for every handle before raising
            errors.append(exc)
    if errors:
        raise errors[0]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    Copies the param groups' hyper-parameters (``lr``, ``momentum``, ``betas``, ...) and the
    per-parameter state (momentum buffers, Adam moments, step counts), also when the root's state
    is still empty, or the others' is (a root that loaded a checkpoint). The root describes its
    state once (``broadcast_object``); the tensors then move with in-place broadcasts. Works on
    a plain optimizer and on a ``DistributedOptimizer`` and does not step it. ``model`` is
    accepted at its Horovod position and not needed: the state is taken as it is, sparse or not.

    Raises:
        ValueError: the optimizers do not have the same parameter groups on every rank.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}.")
    if isinstance(model, ProcessSet):  # hvddp's earlier positional order (optimizer, root, set)
        process_set, model = model, None
    hvddp.ops._process_set(process_set, "broadcast_optimizer_state")  # (outside it: raised naming this call)
    is_root = hvddp.rank() == root_rank  # a global rank, as in Horovod
    local = optimizer.state_dict()
    # state_dict numbers the parameters over the groups in order; a state tensor goes where its
    # parameter lives on each rank (ranks of one node use different GPUs)
    params = dict(enumerate(p for group in optimizer.param_groups for p in group["params"]))
    skeleton = None
    if is_root:
        skeleton = {"param_groups": local["param_groups"],
                    "state": {k: {n: _described(v, params.get(k)) for n, v in s.items()}
                              for k, s in local["state"].items()}}
    skeleton = hvddp.broadcast_object(skeleton, root_rank, "broadcast_optimizer_state.skeleton",
                                      process_set)
    # compared on every rank at once: a rank that raised alone would leave the root's
    # broadcasts below waiting for it (and one whose parameters have other shapes would get state
    # of the root's shapes, and fail alone at its next step)
    # and the optimizer's class (an Adam's groups loaded into an SGD left it without "momentum",
    # and only that rank failed, at its next step); not the groups' keys, which a scheduler or a
    # checkpoint loaded on the root alone may add ("initial_lr")
    shapes = [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups]
    kind = next(f"{c.__module__}.{c.__qualname__}" for c in type(optimizer).__mro__
                if not c.__module__.startswith("hvddp."))

    def groups(root: tuple, rank: int, theirs: tuple) -> str:
        sizes = [len(g) for g in root[0]], [len(g) for g in theirs[0]]
        what = (f"param groups of sizes {sizes[0]}, but rank {rank} has {sizes[1]}" if sizes[0] != sizes[1]
                else f"parameters of shapes {root[0]}, but rank {rank} has {theirs[0]}" if root[0] != theirs[0]
                else f"a {root[1]}, but rank {rank} has a {theirs[1]}")
        return f"the root rank {root_rank} has {what}; every rank must build the same optimizer over the same model"

    state: Dict[Any, Dict[str, Any]] = {}
    moved = []
    for key in sorted(skeleton["state"], key=str):
        entry = {}
        for field, value in skeleton["state"][key].items():
            if isinstance(value, _TensorSpec):
                tensor = (local["state"][key][field].detach() if is_root
                          else value.empty(params.get(key)))
                moved.append((f"{key}.{field}", tensor))
                value = tensor
            elif isinstance(value, torch.Tensor) and key in params:  # a sparse one, sent whole
                value = value.to(params[key].device)
            entry[field] = value
        state[key] = entry
    _check_like_the_root((shapes, kind), root_rank, process_set, "broadcast_optimizer_state",
                         groups, _refusal(moved, "broadcast_optimizer_state"))
    handles = [broadcast_async_(tensor, root_rank, f"broadcast_optimizer_state.{name}", process_set)
               for name, tensor in moved]
    for handle in handles:
        synchronize(handle)
    # in place: a wrapper, its wrapped optimizer and schedulers keep sharing. The root loads its
    # own state too: torch's load casts state to its parameter's dtype (NAdam's float32
    # mu_product on a float64 model), and a root that kept its own dtypes drifted from the rest.
    load_in_place(optimizer, {"state": state, "param_groups": skeleton["param_groups"]},
                  optimizer.load_state_dict)


def _described(value: Any, param: Optional[torch.Tensor]) -> Any:
    """A state value as the root announces it: a dense tensor by its ``_TensorSpec`` (it then
    moves by broadcast), a sparse one whole, from the CPU (SGD's momentum of a sparse
    embedding), anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return _TensorSpec(value, param) if value.layout is torch.strided else value.detach().cpu()


def _refusal(named: List[Tuple[str, torch.Tensor]], fn: str) -> Optional[str]:
    """Why this rank cannot send or receive one of ``named`` (a tensor on the meta device, of an
    unsupported dtype), or None."""
    for name, tensor in named:
        try:
            check_tensor(tensor, fn, repr(name))
        except TensorArgumentError as exc:
            return str(exc)
    return None


def _check_like_the_root(mine: Any, root_rank: int, process_set: ProcessSet, fn: str, describe,
                         refusal: Optional[str] = None) -> None:
    """Raise on every rank of ``process_set`` if some rank refused one of its tensors
    (``TensorArgumentError``, with that rank's ``refusal``) or if its ``mine`` is not the root's
    (``ValueError``: ``describe(root's, first other rank, its value)`` says how). A rank that
    raised alone left the others waiting on broadcasts it never made. A ``root_rank`` that is
    not a member of the set on some rank raises on every rank too (refused at that rank's first
    broadcast, it left the others waiting for the rest)."""
    bad_root = _grouping.root_refusal(fn, root_rank, process_set)
    every = hvddp.allgather_object((mine, refusal, None if bad_root is None else str(bad_root)),
                                   f"{fn}.check", process_set)
    ranks = process_set.ranks or list(range(hvddp.size()))
    refused = [(r, why) for r, (_, why, _) in zip(ranks, every) if why is not None]
    if refused:
        raise TensorArgumentError(f"rank {refused[0][0]}: {refused[0][1]}" if hvddp.rank() != refused[0][0]
                                  else refused[0][1])
    _grouping.raise_root_refusals(fn, bad_root, [why for _, _, why in every], ranks)
    every = [m for m, _, _ in every]
    root = every[ranks.index(root_rank)]
    differ = [(r, theirs) for r, theirs in zip(ranks, every) if theirs != root]
    if differ:
        raise ValueError(f"{fn}: ranks {[r for r, _ in differ]} differ from the root rank {root_rank}: "
                         f"{describe(root, *differ[0])}.")


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (torch tensors included)."""
    return hvddp.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    return hvddp.allgather_object(obj, name, process_set)
