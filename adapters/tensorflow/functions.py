"""Variable helpers for TensorFlow: broadcast variables from a root rank."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import tensorflow as tf

import hvddp
from hvddp import ProcessSet, _grouping, global_process_set

from .gradient_tape import source_label

__all__ = ["broadcast_variables"]


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set) -> None:
    """Assign ``root_rank``'s values to ``variables`` on every rank.

    Call it eagerly (outside ``tf.function``) after the variables exist, typically once before
    training so that differently initialised replicas start equal. Every rank passes the same
    variables in the same order; one small exchange first compares the lists (count, shapes,
    dtypes), so a different model on some rank raises ``MismatchError`` on every rank.

    Args:
        variables: ``tf.Variable`` or Keras variables.
        root_rank: the rank whose values win.
        process_set: the ranks taking part.
    """
    variables = list(variables)
    values = [np.asarray(v.numpy()) for v in variables]
    _grouping.check_same_lists("tf.bcast.check", [source_label(v, i) for i, v in enumerate(variables)],
                               [a.shape for a in values], [a.dtype.name for a in values], process_set)
    handles = [hvddp.broadcast_async(value, root_rank, name=f"tf.bcast.{i}", process_set=process_set)
               for i, value in enumerate(values)]
    for v, h in zip(variables, handles):
        v.assign(tf.convert_to_tensor(h.wait(), dtype=v.dtype))
