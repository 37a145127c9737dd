"""hvddp.tensorflow.elastic: Horovod's elastic TensorFlow API, at a fixed size.

``run``, ``ObjectState`` and ``HostsUpdatedInterrupt`` are ``hvddp.elastic``'s (see there: an MPI
job's ranks are fixed, so ``run`` syncs the state from rank 0 and calls once; nothing is
retried). Added here:

- ``TensorFlowKerasState(model, optimizer=None, backend=None, **attrs)``: ``hvddp.keras``'s
  ``KerasState`` (a Keras model, its optimizer, plain attributes), imported when first used so
  that ``import hvddp.tensorflow`` does not load ``hvddp.keras``.
- ``TensorFlowState(variables, **attrs)``: a list of ``tf.Variable``s and plain attributes,
  committed (values copied), restored (assigned back) and synced from rank 0 together.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvddp.elastic import HostsUpdatedInterrupt, ObjectState, State, VariablesState, run

from .functions import broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState", "HostsUpdatedInterrupt"]


class TensorFlowState(VariablesState):
    """``tf.Variable``s and plain attributes (``epoch=0``, ...), committed, restored and synced together.

    Args:
        variables: the variables (TensorFlow 2 keeps no global collection to default to).
        session: accepted for Horovod compatibility (TensorFlow 1 sessions); must be None.
        **kwargs: the plain attributes.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if variables is None:
            raise ValueError("TensorFlowState: pass the variables to keep, e.g. "
                             "TensorFlowState(model.variables + optimizer.variables, epoch=0); TensorFlow 2 "
                             "has no global variable collection to default to. Received: variables=None.")
        if session is not None:
            raise ValueError("TensorFlowState: TensorFlow 1 sessions are not supported (hvddp needs "
                             "TensorFlow 2, eager); Received: a session.")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def _live_variables(self) -> list:
        return self.variables

    def _value(self, variable: Any) -> Any:
        return np.array(variable.numpy())

    def _broadcast(self, variables: list) -> None:
        broadcast_variables(variables, root_rank=0)


def __getattr__(name: str) -> Any:
    if name == "TensorFlowKerasState":
        from hvddp.keras.elastic import KerasState

        return KerasState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
