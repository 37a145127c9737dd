"""Save and resume PyTorch training: rank 0 writes atomically, every rank resumes identically.

(Rank 0 below: ``root_rank``, by default the first member of the process set.)

    from hvddp.torch.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint("ckpt/last.pt", model, optimizer)   # None on a fresh start
    if state is None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    start = 0 if state is None else state["step"]
    for step in range(start, steps):
        ...
        if (step + 1) % 100 == 0:
            save_checkpoint("ckpt/last.pt", model, optimizer, step=step + 1)

A checkpoint holds the model's and optimizer's (and an LR scheduler's) state dicts, the epoch
and step, any ``extra`` you pass, and the RNG state of every rank (Python ``random``, NumPy's
global generator, torch's CPU generator and the CUDA generators), so that a job restarted from it
continues exactly as the uninterrupted job would have: same dropout masks, same shuffles, as long
as it makes the same random draws after the load. (Each iterator over a ``DataLoader`` draws a seed
from torch's global generator when it starts; a job resumed mid-epoch starts one more than the
uninterrupted job did, which shifts every later draw. Give the loader a generator of its own,
``DataLoader(..., generator=torch.Generator())``, and the global draws stay the same.) The
model's state dict is rank 0's: buffers that replicas keep apart (plain ``BatchNorm`` running
statistics, each rank's from its own shard) come back as rank 0's on every rank; ``SyncBatchNorm``
keeps them equal everywhere, so its runs resume bit-identically. The optimizer's state is rank
0's too, except with ``DistributedOptimizer(op=hvd.Adasum)``, whose momentum and moments are each
rank's own: then every rank's is kept, and each rank gets its own back when the job has as many
ranks (rank 0's otherwise, and rank 0 logs a warning).

Both functions are collective: every rank calls them. ``save_checkpoint`` gathers the RNG
states, rank 0 serializes with ``torch.save`` and writes through
``hvddp.checkpoint.atomic_write`` (temporary file, fsync, rename: a crash mid-write leaves the
previous checkpoint intact); it returns on every rank once the file is on disk. ``load_checkpoint``
reads the file on rank 0 only (no shared filesystem needed) and broadcasts its bytes; every rank
loads the same state. Files load with ``torch.load(weights_only=True)`` by default.
"""

from __future__ import annotations

import io
import logging
import os
import random
import zipfile
from typing import Any, Dict, Optional, Union

import numpy as np
import torch
from torch.nn.parameter import is_lazy

import hvddp
from hvddp import checkpoint as _core
from hvddp import global_process_set, ProcessSet

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state"]

log = logging.getLogger("hvddp")
FORMAT = "hvddp.torch.checkpoint/1"


def rng_state() -> Dict[str, Any]:
    """This process's RNG states, in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state()`` returned (its tensors may also be lists, or on any device)."""
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(_cpu(n["keys"], torch.int64)).astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(_cpu(state["torch"], torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_cpu(s, torch.uint8) for s in state["cuda"]])
        else:
            log.warning("checkpoint has CUDA RNG states of %d devices, this process sees %d; "
                        "CUDA RNG not restored.", len(state["cuda"]), torch.cuda.device_count())


def _cpu(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A saved RNG state as a CPU tensor: from a list (as checkpoints keep them), or a tensor."""
    return value.cpu() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=dtype)


def _as_lists(state: Dict[str, Any]) -> Dict[str, Any]:
    """``rng_state()`` with its tensors as lists of ints, so that a ``map_location`` given to
    ``load_checkpoint`` (a GPU, say) leaves them alone: torch restores RNG states from CPU tensors
    only (with ``map_location="cuda:0"`` the restore failed after the model had loaded)."""
    plain = dict(state, numpy=dict(state["numpy"], keys=state["numpy"]["keys"].tolist()),
                 torch=state["torch"].tolist())
    if "cuda" in state:
        plain["cuda"] = [s.tolist() for s in state["cuda"]]
    return plain


def _tuples(value):
    """random.setstate needs tuples; a checkpoint round trip may have produced lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def save_checkpoint(path: Union[str, os.PathLike], model: Optional[torch.nn.Module] = None,
                    optimizer: Optional[torch.optim.Optimizer] = None, *, epoch: int = 0, step: int = 0,
                    scheduler: Any = None, extra: Any = None, rng: bool = True, root_rank: Optional[int] = None,
                    process_set: ProcessSet = global_process_set) -> None:
    """Write a checkpoint of the training state from ``root_rank``; every rank calls it.

    Args:
        path: the checkpoint file (replaced atomically; the directory is created).
        model: its ``state_dict()`` is saved (rank 0's; replicas are identical).
        optimizer: a torch optimizer or ``hvddp.torch.DistributedOptimizer``; its state dict.
        epoch: an int (numpy integers are converted); ``load_checkpoint`` returns it.
        step: an int, likewise.
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (an LR scheduler).
        extra: more state to keep (tensors, numbers, strings, lists, dicts; other objects need
            ``load_checkpoint(weights_only=False)``, and the root logs a warning saying so).
        rng: save every rank's RNG states (a small gather).
        root_rank: the rank that writes: a global rank in ``process_set``; by default its first
            member (rank 0 for the global set).
        process_set: the ranks taking part.

    Raises:
        CheckpointError: on every rank, when the root could not write the file.
        MismatchError: on every rank, when the ranks passed different arguments (``rng``,
            ``root_rank``, which objects) or one rank's were invalid (it raises its own error).
    """
    counters = {}

    def describe() -> Dict[str, Any]:  # checked on every rank at once, and this rank's RNG states
        _core.file_path(path, "save_checkpoint")
        _check_objects("save_checkpoint", model, optimizer, scheduler, rng)
        counters.update(epoch=_core.counter(epoch, "save_checkpoint", "epoch"),
                        step=_core.counter(step, "save_checkpoint", "step"))
        own = _per_rank(optimizer)
        return {"root_rank": _core.root_of(root_rank, "save_checkpoint", process_set), "rng": bool(rng),
                **_given(model, optimizer, scheduler), "per-rank optimizer state": own,
                "_rng": rng_state() if rng else None, "_optimizer": optimizer.state_dict() if own else None}

    every = _core.agree("save_checkpoint", describe, process_set)
    root_rank = every[0]["root_rank"]
    rngs = [_as_lists(d["_rng"]) for d in every] if rng else None
    # (Adasum: each rank's own optimizer state, in the set's rank order)
    optimizers = [d["_optimizer"] for d in every] if every[0]["per-rank optimizer state"] else None

    def data(f):  # the root gathers the state in here: a failure is reported on every rank
        state = {
            "format": FORMAT, "size": process_set.size(), **counters,
            "model": model.state_dict() if model is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "optimizer_per_rank": optimizers,
            "optimizer_class": _class_name(optimizer) if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scheduler_class": _class_name(scheduler) if scheduler is not None else None,
            "extra": extra, "rng": rngs,
        }
        if extra is not None:
            _warn_unsafe(path, extra)
        torch.save(state, f)

    # (the arguments are agreed above: written without a second check)
    _core.write_agreed("save_checkpoint", data if hvddp.rank() == root_rank else None,
                       _core.file_path(path, "save_checkpoint"), root_rank, process_set)


def load_checkpoint(path: Union[str, os.PathLike], model: Optional[torch.nn.Module] = None,
                    optimizer: Optional[torch.optim.Optimizer] = None, *, scheduler: Any = None,
                    map_location: Any = "cpu", rng: bool = True, weights_only: bool = True,
                    strict: bool = True, root_rank: Optional[int] = None,
                    process_set: ProcessSet = global_process_set) -> Optional[Dict[str, Any]]:
    """Restore a checkpoint written by ``save_checkpoint`` on every rank; every rank calls it.

    ``root_rank`` (rank 0 by default) reads the file and broadcasts it, so every rank loads exactly the same model and
    optimizer state: no ``broadcast_parameters`` is needed after a successful load. Each rank
    gets back its own RNG state when the job has as many ranks as the one that saved it
    (otherwise the RNGs are left alone and rank 0 logs a warning).

    Args:
        path: the checkpoint file, as seen by ``root_rank``.
        model, optimizer, scheduler: objects whose ``load_state_dict`` receives the saved state.
        map_location: where tensors go (``torch.load``'s argument); CPU by default.
        rng: restore this rank's RNG states.
        weights_only: ``torch.load``'s safe mode; False only for files you trust that hold
            arbitrary ``extra`` objects.
        strict: passed to ``model.load_state_dict``.
        root_rank: the rank that reads the file: a global rank in ``process_set``; by default
            its first member (rank 0 for the global set).
        process_set: the ranks taking part.

    Returns:
        ``{"epoch": ..., "step": ..., "extra": ...}`` on every rank, or None on every rank when
        ``root_rank`` finds no file at ``path`` (a fresh start).

    Raises:
        CheckpointError: on every rank, when the file cannot be read or is not such a checkpoint,
            or does not fit the objects given on some rank (nothing is loaded then).
        MismatchError: on every rank, when the ranks passed different arguments or one rank's
            were invalid (it raises its own error).
    """
    def describe() -> Dict[str, Any]:  # every rank loads into the same kinds of objects
        _core.file_path(path, "load_checkpoint")
        _check_objects("load_checkpoint", model, optimizer, scheduler, rng)
        return {"root_rank": _core.root_of(root_rank, "load_checkpoint", process_set), "rng": bool(rng),
                "weights_only": bool(weights_only), "strict": bool(strict),
                **_given(model, optimizer, scheduler)}

    root_rank = _core.agree("load_checkpoint", describe, process_set)[0]["root_rank"]
    path = _core.file_path(path, "load_checkpoint")
    data, path = _core.read_agreed(path, root_rank, process_set, with_path=True)  # (errors name the file read)
    if data is None:
        return None
    given = [(what, obj) for what, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler))
             if obj is not None]
    error = None
    per_rank = None
    try:  # before anything is loaded, on every rank's own objects: a refused file changes nothing
        state = _read(path, data, map_location, weights_only)
        per_rank = state.get("optimizer_per_rank")
        if per_rank is not None and _per_rank(optimizer) and len(per_rank) == process_set.size():
            # (Adasum: this rank's own; any other optimizer keeps rank 0's, or the replicas would part)
            state["optimizer"] = per_rank[process_set.rank()]
        _check_fits(path, state, given, model, optimizer)
    except Exception as exc:  # (the same bytes everywhere, but each rank its own objects)
        error = exc
    _core.all_succeeded("load_checkpoint", path, error, "nothing was loaded on any rank", process_set)
    for what, obj in given:
        try:
            if what == "model":
                obj.load_state_dict(state[what], strict=strict)
            else:
                obj.load_state_dict(state[what])
        except Exception as exc:  # torch's own, or a scheduler's (every rank must hear of it)
            error = _core.CheckpointError(f"checkpoint {path!r}: its {what} state does not fit the "
                                          f"{what} given ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
            break
    _core.all_succeeded("load_checkpoint", path, error, "this rank loaded it, so the replicas now differ: "
                        "give every rank the same model and optimizer, and load again", process_set)
    if (_per_rank(optimizer) and per_rank is not None and len(per_rank) != process_set.size()
            and process_set.rank() == 0):
        log.warning("checkpoint %r holds the optimizer states of %d ranks (op=Adasum keeps one per rank), "
                    "this job has %d: every rank loaded rank 0's.", path, len(per_rank), process_set.size())
    if rng and state["rng"] is not None:
        if len(state["rng"]) == process_set.size():
            set_rng_state(state["rng"][process_set.rank()])
        elif process_set.rank() == 0:
            log.warning("checkpoint %r was saved by %d ranks, this job has %d: RNG states not "
                        "restored, so random draws will differ from the saving job's.",
                        path, len(state["rng"]), process_set.size())
    return {"epoch": state["epoch"], "step": state["step"], "extra": state["extra"]}


def _check_objects(fn: str, model: Any, optimizer: Any, scheduler: Any, rng: Any) -> None:
    """Refuse objects of the wrong kind by the argument's name (a state dict given as the model
    failed as an AttributeError, or as a write error; an optimizer given as the model was saved
    as one)."""
    wanted = (("model", model, torch.nn.Module, "a torch.nn.Module"),
              ("optimizer", optimizer, torch.optim.Optimizer,
               "a torch.optim.Optimizer (or hvddp.torch's DistributedOptimizer)"))
    for what, obj, kind, described in wanted:
        if obj is not None and not isinstance(obj, kind):
            hint = f"; pass the {what} itself, not its state_dict()" if isinstance(obj, dict) else ""
            raise TypeError(f"{fn}: {what} must be {described}, got {type(obj).__name__}{hint}.")
    if scheduler is not None and not all(callable(getattr(scheduler, m, None))
                                         for m in ("state_dict", "load_state_dict")):
        raise TypeError(f"{fn}: scheduler must have state_dict() and load_state_dict() (an LR "
                        f"scheduler), got {type(scheduler).__name__}.")
    if not isinstance(rng, (bool, np.bool_)):
        raise TypeError(f"{fn}: rng must be True or False, got rng={rng!r}.")


def _class_name(obj: Any) -> str:
    """An optimizer's or scheduler's class, with the classes of the schedulers it chains
    (SequentialLR, ChainedScheduler: its state dict holds theirs), e.g. 'SequentialLR(LinearLR,
    StepLR)'."""
    inner = getattr(obj, "_schedulers", None)
    if isinstance(inner, (list, tuple)) and inner:
        return f"{type(obj).__name__}({', '.join(_class_name(s) for s in inner)})"
    return type(obj).__name__


def _per_rank(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps state that differs between ranks: a ``DistributedOptimizer`` with
    ``op=Adasum`` runs the wrapped update on each rank's own gradients (its momentum and moments
    are that rank's), so rank 0's state alone would resume every rank with rank 0's."""
    from .adasum import _DistributedAdasumOptimizer

    return isinstance(optimizer, _DistributedAdasumOptimizer) and bool(getattr(optimizer, "_hvddp_active", False))


def _given(model: Any, optimizer: Any, scheduler: Any) -> Dict[str, bool]:
    """Which objects a call was given: every rank must give the same ones."""
    return {"model": model is not None, "optimizer": optimizer is not None, "scheduler": scheduler is not None}


def _read(path: str, data: bytes, map_location: Any, weights_only: bool) -> Dict[str, Any]:
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"not written by hvddp.torch.checkpoint.save_checkpoint (format "
                             f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})")
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        if not zipfile.is_zipfile(io.BytesIO(data)):  # (save_checkpoint writes torch.save's zip archive)
            why = (f"it is not a whole torch.save archive ({len(data)} bytes: empty, truncated or corrupt; "
                   f"{why}); move it away to start afresh, or load an earlier checkpoint")
        raise _core.CheckpointError(f"checkpoint {path!r} cannot be loaded: {why}") from exc
    return state


def _warn_unsafe(path: Any, extra: Any) -> None:
    """Warn, when saving, that ``extra`` holds objects the default ``load_checkpoint`` refuses
    (``torch.load(weights_only=True)``: numpy scalars and arrays, instances of your classes), so
    that it is not found only at resume time."""
    buf = io.BytesIO()
    torch.save(extra, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as exc:  # what torch's safe unpickler says it refused
        lines = [line.strip() for line in str(exc).splitlines() if "Unpickler error" in line]
        why = lines[0].split(" Please use")[0] if lines else f"{type(exc).__name__}: {exc}"
        log.warning("save_checkpoint %r: extra holds objects that load_checkpoint refuses with its "
                    "default weights_only=True (%s); load it with weights_only=False (files you trust), or "
                    "keep tensors, Python numbers, strings, lists and dicts in extra (e.g. float(x), "
                    "torch.from_numpy(a)).", os.fspath(path), why[:300])


def _check_fits(path: str, state: Dict[str, Any], given: list, model: Any, optimizer: Any) -> None:
    """Refuse a saved state that the objects given cannot take, before any is loaded."""
    for what, obj in given:
        if state[what] is None:
            raise _core.CheckpointError(f"checkpoint {path!r} has no {what} state, but "
                                        f"load_checkpoint was given a {what}.")
    for what, obj in given:  # (files from before a class was saved have none)
        saved_class = state.get(f"{what}_class")
        if what == "model" or saved_class is None:
            continue
        given_class = _class_name(obj)
        older = "(" not in saved_class and saved_class == type(obj).__name__  # (saved the outer class alone)
        if saved_class != given_class and not older:
            raise _core.CheckpointError(f"checkpoint {path!r} holds the state of {what} class {saved_class}"
                                        f"; load_checkpoint was given class {given_class}.")
    if model is not None:
        _check_model_fits(path, model, state["model"])
    if optimizer is not None:
        _check_optimizer_fits(path, optimizer, state["optimizer"])


def _check_model_fits(path: str, model: torch.nn.Module, saved: Any) -> None:
    """Refuse a saved model state whose tensors have other shapes than the model's, before any
    is copied: torch's ``load_state_dict`` finds it only after copying the entries before it.
    Lazy (not yet materialized) entries take any shape, as torch lets them."""
    if not isinstance(saved, dict):
        return  # (load_state_dict says what is wrong with it)
    current = model.state_dict()
    wrong = []
    for key, value in saved.items():
        here = current.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(here, torch.Tensor) or is_lazy(here):
            continue
        if value.shape != here.shape:
            wrong.append(f"{key}: saved {tuple(value.shape)}, model {tuple(here.shape)}")
    if wrong:
        raise _core.CheckpointError(f"checkpoint {path!r}: its model state does not fit the model "
                                    f"given (shapes differ: {'; '.join(wrong[:5])}"
                                    f"{f'; and {len(wrong) - 5} more' if len(wrong) > 5 else ''}); nothing was loaded.")


def _check_optimizer_fits(path: str, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """Refuse a saved optimizer state of other parameter groups before the model is loaded (torch
    checks it too, but only once the model has been)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g.get("params", ())) if isinstance(g, dict) else None for g in groups]
    if mine != theirs:
        raise _core.CheckpointError(f"checkpoint {path!r}: its optimizer state does not fit the "
                                    f"optimizer given (parameters per group: saved {theirs}, optimizer {mine}); "
                                    f"nothing was loaded.")
