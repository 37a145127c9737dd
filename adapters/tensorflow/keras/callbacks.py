"""hvddp.tensorflow.keras.callbacks: ``hvddp.keras.callbacks``, under Horovod's module name."""

from hvddp.keras.callbacks import *  # noqa: F401,F403 - the whole module, by design
from hvddp.keras.callbacks import __all__  # noqa: F401
