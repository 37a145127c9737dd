"""hvddp.torch.elastic: Horovod's elastic API for PyTorch scripts, at a fixed size.

``run``, ``ObjectState`` and ``HostsUpdatedInterrupt`` are ``hvddp.elastic``'s (see there: an MPI
job's ranks are fixed, so ``run`` syncs and calls once, and nothing is retried). Added here, under
Horovod's module names too (``hvddp.torch.elastic.state``, ``hvddp.torch.elastic.sampler``):

- ``TorchState``: a model, an optimizer, ``ElasticSampler``s and plain attributes, committed,
  restored and synced from rank 0 together; what handles each kind of value is looked up in
  ``get_handler_registry()`` (``set_handler_registry`` adds kinds, as in Horovod).
- ``ElasticSampler``: shards a dataset over the ranks, reshuffled per epoch, and skips the samples
  recorded as processed this epoch (a count, the same on every rank).
"""

from hvddp import init, shutdown  # (Horovod's module has them)
from hvddp.elastic import HostsUpdatedInterrupt, ObjectState, State, run

from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt", "init", "shutdown"]
