"""Save and resume Keras 3 training: rank 0 writes atomically, every rank resumes identically.

(Rank 0 below: ``root_rank``, by default the first member of the process set.)

    from hvddp.keras.checkpoint import CheckpointCallback, load_checkpoint

    state = load_checkpoint("ckpt/last.pkl", model)          # None on a fresh start
    model.fit(x, y, epochs=10, initial_epoch=0 if state is None else state["epoch"],
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         CheckpointCallback("ckpt/last.pkl")])

A checkpoint holds rank 0's model variables and optimizer variables (built first if needed:
iteration count, learning rate, moments; gradient accumulators between the passes of an update
averaged over the ranks first, see ``optimizer.average_accumulators``), the epoch and step, any
picklable ``extra``, and per rank the states that differ between replicas: the layers'
``SeedGenerator`` states, Keras' global seed generator, Python's and NumPy's global RNGs, on the
torch backend torch's generators (unseeded ``Dropout`` draws from them there), and, when the optimizer has local
variables (``register_local_var``, ``PartialDistributedOptimizer``), those variables and the
rank's optimizer variables. A resumed job continues as the uninterrupted one would.

Both functions are collective: every rank calls them (callbacks run on every rank). The file is
pickled NumPy data written through ``hvddp.checkpoint`` (temporary file, fsync, rename; a crash
mid-write leaves the previous checkpoint intact); rank 0 reads it and broadcasts it, so only
rank 0 needs to see it. It is unpickled on load: load only checkpoints you wrote.
"""

from __future__ import annotations

import os
import pickle
import random
from typing import Any, Dict, List, Optional, Union

import keras
import numpy as np

import hvddp
from hvddp import checkpoint as _core
from hvddp import global_process_set, ProcessSet

from . import _keras2
from .optimizer import average_accumulators

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointCallback"]

FORMAT = "hvddp.keras.checkpoint/1"


def _sync(model) -> None:
    sync = getattr(model, "jax_state_sync", None)  # the JAX trainer keeps state outside variables
    if sync is not None and keras.backend.backend() == "jax":
        sync()


def _split(model) -> tuple:
    """(shared variables, per-rank seed-generator variables) of ``model``."""
    seeds = {id(g.state) for layer in model._flatten_layers()
             for g in getattr(layer, "_seed_generators", ())}
    shared = [v for v in model.variables if id(v) not in seeds]
    own = [v for v in model.variables if id(v) in seeds]
    return shared, own


def _values(variables) -> List[tuple]:
    return [(v.path, tuple(v.shape), keras.ops.convert_to_numpy(v.value)) for v in variables]


def _check_fit(variables, saved: List[tuple], what: str, path: str) -> None:
    """Refuse saved values that do not fit ``variables``, before any is assigned."""
    if len(variables) != len(saved):
        raise _core.CheckpointError(f"checkpoint {path!r} has {len(saved)} {what} variables, this "
                                    f"model has {len(variables)}: build the same model as the one saved.")
    for v, (name, shape, _) in zip(variables, saved):
        if tuple(v.shape) != tuple(shape):
            raise _core.CheckpointError(f"checkpoint {path!r}: {what} variable {v.path!r} has shape "
                                        f"{tuple(v.shape)}, the saved {name!r} {tuple(shape)}.")


def _assign(variables, saved: List[tuple]) -> None:
    for v, (_, _, value) in zip(variables, saved):
        v.assign(value)


def _backend_rng() -> Dict[str, Any]:
    """States Keras draws from outside the layers' seed generators, per backend."""
    state: Dict[str, Any] = {}
    if keras.backend.backend() == "torch":  # unseeded dropout uses torch's global generator
        import torch

        state["torch"] = torch.get_rng_state().numpy().copy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
    generator = _global_seed_generator(create=False)
    if generator is not None:  # keras.random.* calls without a seed
        state["global_seed"] = keras.ops.convert_to_numpy(generator.state.value)
    return state


def _set_backend_rng(state: Dict[str, Any]) -> None:
    if "torch" in state and keras.backend.backend() == "torch":
        import torch

        torch.set_rng_state(torch.from_numpy(state["torch"]))
        if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in state["cuda"]])
    if "global_seed" in state:
        generator = _global_seed_generator(create=True)
        if generator is not None:
            generator.state.assign(state["global_seed"])


def _global_seed_generator(create: bool):
    try:  # Keras keeps it in its global state; there is no public accessor
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
    except ImportError:  # pragma: no cover - a Keras layout we do not know
        return None
    # (Keras 3.5 has the key but not its constant)
    key = getattr(seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator")
    if not create and global_state.get_global_attribute(key) is None:
        return None
    return seed_generator.global_seed_generator()


def _set_global_rng(mine: Dict[str, Any]) -> None:
    random.setstate(mine["python"])
    np.random.set_state(mine["numpy"])
    _set_backend_rng(mine["backend"])


def _optimizer(model, optimizer):
    optimizer = getattr(model, "optimizer", None) if optimizer is None else optimizer
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    return optimizer


def _local_ids(optimizer) -> set:
    """Ids of the variables ``optimizer`` keeps per rank (``register_local_var``)."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        settings = getattr(opt, "__dict__", {}).get("_hvddp")
        if settings and settings.get("local"):
            return set(settings["local"])
    return set()


def _kind(optimizer) -> Optional[str]:
    """The optimizer's class, and its inner one's for a LossScaleOptimizer: a checkpoint's slots
    fit only the same kind (SGD's momentum would load into RMSprop's velocity)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "inner_optimizer", None)
    return type(optimizer).__name__ + (f"({type(inner).__name__})" if inner is not None else "")


def _check_arguments(fn: str, path: Any, model: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{fn}: path must be a file path (str or os.PathLike); Received: path={path!r}.")
    if not isinstance(model, keras.Model):
        raise TypeError(f"{fn}: model must be a Keras 3 model; Received: model={_keras2.describe(model)}."
                        f"{_keras2.fix(model)}")


def _settle_pending_rng(model) -> None:
    """Set again the RNG states ``load_checkpoint`` restored, at the start of the first ``fit``
    after it (Keras' first ``fit`` on a model draws random numbers while it builds the train
    function: on torch it consumes torch's generator); only if no step ran since the load, or a
    later ``fit`` would rewind the streams. Called by ``CheckpointCallback`` and
    ``BroadcastGlobalVariablesCallback`` at ``on_train_begin``, whichever comes first."""
    pending = model.__dict__.pop("_hvddp_pending_rng", None)
    # (loaded without an optimizer: fit has built one since, at iteration 0)
    if pending is not None and _iterations(getattr(model, "optimizer", None)) in (pending[1], pending[1] or 0):
        _set_global_rng(pending[0])


def _iterations(optimizer) -> Optional[int]:
    if optimizer is None or not optimizer.built:
        return None
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _restored_per_rank(model) -> bool:
    """Whether ``load_checkpoint`` restored per-rank local state and no step ran since (then the
    ranks are already consistent, and a broadcast would undo the local state)."""
    restored = model.__dict__.get("_hvddp_restored_per_rank", False)
    return restored is not False and _iterations(getattr(model, "optimizer", None)) == restored


def save_checkpoint(path: Union[str, os.PathLike], model: keras.Model, optimizer: Any = None, *,
                    epoch: int = 0, step: int = 0, extra: Any = None, rng: bool = True,
                    root_rank: Optional[int] = None, process_set: ProcessSet = global_process_set) -> None:
    """Write a checkpoint of ``model`` (and its optimizer) from ``root_rank``; every rank calls it.

    Args:
        path: the checkpoint file (replaced atomically; the directory is created).
        model: a built Keras model.
        optimizer: the optimizer whose variables to save; ``model.optimizer`` when None.
        epoch: an int (numpy integers are converted; use it as ``fit(initial_epoch=...)``).
        step: an int, likewise.
        extra: more picklable state.
        rng: save every rank's seed-generator and global RNG states (a small gather).
        root_rank: the rank that writes: a global rank in ``process_set``; by default its first
            member (rank 0 for the global set).
        process_set: the ranks taking part.

    Raises:
        CheckpointError: on every rank, when the root could not write the file.
        MismatchError: on every rank, when the ranks passed different arguments (``rng``,
            ``root_rank``, which objects) or one rank's were invalid (it raises its own error).
    """
    counters = {}

    def describe() -> Dict[str, Any]:  # checked on every rank at once: the gathers below need the same
        _check_arguments("save_checkpoint", path, model)
        counters.update(epoch=_core.counter(epoch, "save_checkpoint", "epoch"),
                        step=_core.counter(step, "save_checkpoint", "step"))
        return {"root_rank": _core.root_of(root_rank, "save_checkpoint", process_set), "rng": bool(rng),
                **_given(model, optimizer), "_built": bool(model.built)}

    every = _core.agree("save_checkpoint", describe, process_set)
    root_rank = every[0]["root_rank"]
    if not all(d["_built"] for d in every):
        raise _core.CheckpointError("save_checkpoint: the model is not built on every rank, so it has no "
                                    "variables to save: build it first (call it on a batch, give it an "
                                    "Input, or save after fit()).")
    _sync(model)
    shared, own = _split(model)
    optimizer = _optimizer(model, optimizer)
    average_accumulators(optimizer, process_set, "__hvddp.keras.checkpoint.accumulators")  # (between passes)
    local = _local_ids(optimizer)
    per_rank = None
    if rng or local:
        mine = {"seeds": _values(own), "python": random.getstate(), "numpy": np.random.get_state(),
                "backend": _backend_rng()} if rng else {}
        if local:  # this rank's own: its local variables, and its optimizer's variables (their slots)
            mine["local"] = _values([v for v in shared if id(v) in local])
            mine["optimizer"] = _values(optimizer.variables)
        per_rank = hvddp.allgather_object(mine, name="__hvddp.keras.checkpoint.rng", process_set=process_set)

    def data(f):  # the root gathers the state in here: a failure is reported on every rank
        state = {"format": FORMAT, "size": process_set.size(), **counters,
                 "variables": _values(shared),
                 "optimizer": _values(optimizer.variables) if optimizer is not None else None,
                 "optimizer_kind": _kind(optimizer), "extra": extra, "rng": per_rank}
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)

    # (the arguments are agreed above: written without a second check)
    _core.write_agreed("save_checkpoint", data if hvddp.rank() == root_rank else None,
                       _core.file_path(path, "save_checkpoint"), root_rank, process_set)


def load_checkpoint(path: Union[str, os.PathLike], model: keras.Model, optimizer: Any = None, *,
                    rng: bool = True, root_rank: Optional[int] = None,
                    process_set: ProcessSet = global_process_set) -> Optional[Dict[str, Any]]:
    """Restore a checkpoint written by ``save_checkpoint`` on every rank; every rank calls it.

    ``root_rank`` (rank 0 by default) reads the file and broadcasts it, so every rank assigns the same values (no
    broadcast is needed afterwards; ``BroadcastGlobalVariablesCallback`` is harmless). Each
    rank gets its own seed-generator and RNG states back when the job has as many ranks as the
    one that saved it.

    Returns:
        ``{"epoch": ..., "step": ..., "extra": ...}`` on every rank, or None on every rank when
        ``root_rank`` finds no file at ``path``.

    Raises:
        CheckpointError: on every rank, when the file cannot be read or does not fit the model on
            some rank (nothing is assigned then).
        MismatchError: on every rank, when the ranks passed different arguments or one rank's
            were invalid (it raises its own error).
    """
    def describe() -> Dict[str, Any]:  # every rank loads into the same kinds of objects
        _check_arguments("load_checkpoint", path, model)
        return {"root_rank": _core.root_of(root_rank, "load_checkpoint", process_set), "rng": bool(rng),
                **_given(model, optimizer)}

    root_rank = _core.agree("load_checkpoint", describe, process_set)[0]["root_rank"]
    path = _core.file_path(path, "load_checkpoint")
    data, path = _core.read_agreed(path, root_rank, process_set, with_path=True)  # (errors name the file read)
    if data is None:
        return None
    state = _core.unpickled(path, data)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _core.CheckpointError(f"checkpoint {path!r} was not written by "
                                    f"hvddp.keras.checkpoint.save_checkpoint.")
    _sync(model)
    shared, own = _split(model)
    optimizer = _optimizer(model, optimizer)
    local = _local_ids(optimizer)
    per_rank = state["rng"]
    matched = per_rank is not None and len(per_rank) == process_set.size()
    mine = per_rank[process_set.rank()] if matched else {}
    restore_local = "local" in mine and optimizer is not None and bool(local)
    seeds = matched and rng and "seeds" in mine
    error = None
    try:  # on every rank's own model before anything is assigned: a refused file changes nothing
        _check_loadable(path, state, mine, shared, own, optimizer, local, restore_local, seeds)
    except Exception as exc:
        error = exc
    _core.all_succeeded("load_checkpoint", path, error, "nothing was loaded on any rank", process_set)
    _assign(shared, state["variables"])
    if optimizer is not None and state["optimizer"] is not None:
        _assign(list(optimizer.variables), state["optimizer"])
    elif state["optimizer"] is not None and process_set.rank() == 0:
        import logging  # (an evaluation job may want the weights alone: not an error)

        logging.getLogger("hvddp").warning(
            "checkpoint %r holds optimizer state (%d variables, the step count among them), but this "
            "model has no optimizer yet: only the model's variables were loaded. To resume training, "
            "compile the model before load_checkpoint.", path, len(state["optimizer"]))
    if matched:
        if "local" in mine and not restore_local and process_set.rank() == 0:
            import logging  # (an evaluation job without local layers, or a model not compiled yet)

            logging.getLogger("hvddp").warning(
                "checkpoint %r holds each rank's local variables, but this model %s: every rank "
                "gets rank 0's values of them.", path,
                "has no optimizer yet (compile it before load_checkpoint to restore them)"
                if optimizer is None else "registers no local variables")
        if restore_local:  # this rank's local variables and optimizer variables
            _assign([v for v in shared if id(v) in local], mine["local"])
            _assign(list(optimizer.variables), mine["optimizer"])
            # every rank now holds the root's shared values and its own local ones: the broadcast
            # callback of the next fit() would copy the root's optimizer slots of the local
            # variables over this rank's, so it is skipped there (_restored_per_rank)
            object.__setattr__(model, "_hvddp_restored_per_rank", _iterations(optimizer))
        if seeds:
            _assign(own, mine["seeds"])
            _set_global_rng(mine)
            # Keras' first fit() on a model draws random numbers while it builds the train function;
            # the callbacks' on_train_begin sets these states again after that (_settle_pending_rng)
            object.__setattr__(model, "_hvddp_pending_rng", (mine, _iterations(optimizer)))
    elif per_rank is not None and process_set.rank() == 0:
        import logging

        logging.getLogger("hvddp").warning(
            "checkpoint %r was saved by %d ranks, this job has %d: RNG, seed-generator and local "
            "variable states not restored (rank 0's are used).", path, len(per_rank), process_set.size())
    return {"epoch": state["epoch"], "step": state["step"], "extra": state["extra"]}


def _given(model, optimizer) -> Dict[str, bool]:
    """Whether a call has an optimizer to save or load, and with per-rank local variables: every
    rank must have the same (they decide which collectives the call runs)."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    return {"optimizer": optimizer is not None, "local variables": bool(_local_ids(optimizer))}


def _check_loadable(path: str, state: Dict[str, Any], mine: Dict[str, Any], shared, own, optimizer, local,
                    restore_local: bool, seeds: bool) -> None:
    """Refuse a checkpoint this rank's model and optimizer cannot take, before anything is assigned."""
    saved_kind = state.get("optimizer_kind")
    if optimizer is not None and saved_kind is not None and _kind(optimizer) != saved_kind:
        raise _core.CheckpointError(f"checkpoint {path!r} holds the state of an optimizer of class "
                                    f"{saved_kind}, this model's is {_kind(optimizer)}: its slots would load "
                                    f"into the wrong variables. Compile with the optimizer that was saved.")
    if restore_local and len(mine["local"]) != len(local):
        raise _core.CheckpointError(f"checkpoint {path!r} has {len(mine['local'])} local variables, this "
                                    f"model's optimizer has {len(local)}: register the same local layers.")
    _check_fit(shared, state["variables"], "model", path)
    if optimizer is not None and state["optimizer"] is not None:
        _check_fit(list(optimizer.variables), state["optimizer"], "optimizer", path)
    if restore_local:
        _check_fit([v for v in shared if id(v) in local], mine["local"], "local", path)
        _check_fit(list(optimizer.variables), mine["optimizer"], "optimizer", path)
    if seeds:
        _check_fit(own, mine["seeds"], "seed-generator", path)


class CheckpointCallback(_keras2.Keras3Callback, keras.callbacks.Callback):
    """Call ``save_checkpoint(path, model, epoch=epoch + 1)`` at the end of every ``every`` epochs.

    Every rank must use the callback (it is collective). Resume with
    ``fit(initial_epoch=load_checkpoint(path, model)["epoch"], callbacks=[..., CheckpointCallback(path)])``:
    when training begins, the callback restores again the RNG states that ``load_checkpoint``
    restored, because Keras' first ``fit()`` on a model draws random numbers while it builds the
    train function (on the torch backend that shifts unseeded dropout masks).
    """

    def __init__(self, path: Union[str, os.PathLike], every: int = 1, rng: bool = True,
                 process_set: ProcessSet = global_process_set, root_rank: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"CheckpointCallback: path must be a file path (str or os.PathLike); "
                            f"Received: path={path!r}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"CheckpointCallback: every must be an int >= 1, got {every!r}.")
        self.path, self.every, self.rng, self.process_set = path, every, rng, process_set
        self.root_rank = _core.root_of(root_rank, "CheckpointCallback", process_set) \
            if hvddp.is_initialized() else root_rank

    def on_train_begin(self, logs=None):
        _settle_pending_rng(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every == 0:
            save_checkpoint(self.path, self.model, epoch=epoch + 1, rng=self.rng,
                            root_rank=self.root_rank, process_set=self.process_set)
