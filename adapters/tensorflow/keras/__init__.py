"""hvddp.tensorflow.keras: ``hvddp.keras`` under the name Horovod's TensorFlow 2 Keras scripts import.

``import horovod.tensorflow.keras as hvd`` ports as ``import hvddp.tensorflow.keras as hvd``. Every
name here is ``hvddp.keras``'s, the same objects (``DistributedOptimizer``, ``callbacks``,
``load_model``, the collectives and the runtime), so the two imports can be mixed in one program;
``hvddp.tensorflow.keras.callbacks`` and ``.elastic`` are ``hvddp.keras``'s modules of those names.
Keras 3 runs it on whichever backend ``KERAS_BACKEND`` names; Horovod's module meant TensorFlow.
"""

from __future__ import annotations

import sys as _sys

from hvddp.keras import *  # noqa: F401,F403 - the whole of hvddp.keras, by design
from hvddp.keras import __all__, callbacks, checkpoint, elastic  # noqa: F401

# ``import hvddp.tensorflow.keras.callbacks`` (and .elastic, .checkpoint) finds hvddp.keras's modules
for _name in ("callbacks", "checkpoint", "elastic"):
    _sys.modules[f"{__name__}.{_name}"] = _sys.modules[f"hvddp.keras.{_name}"]
del _name
