"""hvddp.tensorflow.keras.elastic: ``hvddp.keras.elastic``, under Horovod's module name."""

from hvddp.keras.elastic import *  # noqa: F401,F403 - the whole module, by design
from hvddp.keras.elastic import __all__  # noqa: F401
