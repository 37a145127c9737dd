"""Keras trainer guards: ``jit_compile="auto"`` chooses no XLA for models whose optimizer uses
hvddp (TensorFlow), and a failed collective in a compiled step raises hvddp's own error.

Keras resolves ``"auto"`` to XLA on TensorFlow when a GPU is present, and XLA cannot compile
the ``tf.numpy_function`` that reaches hvddp. The guard wraps ``Trainer._resolve_auto_jit_compile``
so that, on the TensorFlow backend only, "auto" means no XLA for a model compiled with an hvddp
optimizer, and for one whose class defines its own ``train_step``, ``test_step`` or
``predict_step`` (where a ported Horovod script reduces with ``hvddp.tensorflow``'s
``DistributedGradientTape`` or ``allreduce``: Keras 2, which Horovod ran on, never picked XLA by
itself, so such a step failed on a GPU machine only, at its first batch). Every other model, and
every other backend (JAX runs hvddp under ``jax.jit`` through ``io_callback``), keeps Keras'
choice. ``jit_compile=True`` is left alone and fails at trace time with an error that says what
to do. ``hvddp.keras`` and ``hvddp.tensorflow`` both install the guard when imported.
"""

from __future__ import annotations

import functools
import logging

import keras

from hvddp import _staged
from hvddp.exceptions import HvddpError


def install_auto_jit_guard() -> None:
    try:
        from keras.src.trainers import trainer as _trainer

        original = _trainer.Trainer._resolve_auto_jit_compile
    except (ImportError, AttributeError):  # pragma: no cover - a Keras without this hook
        logging.getLogger("hvddp").debug("keras has no Trainer._resolve_auto_jit_compile; "
                                         "jit_compile='auto' is Keras' own choice")
        return
    if getattr(original, "_hvddp_guard", False):
        return

    def _resolve_auto_jit_compile(self):
        from .optimizer import is_distributed

        if keras.backend.backend() == "tensorflow" and (is_distributed(getattr(self, "optimizer", None))
                                                         or _own_step(self)):
            return False
        return original(self)

    _resolve_auto_jit_compile._hvddp_guard = True
    _resolve_auto_jit_compile.__wrapped__ = original
    _trainer.Trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile


def _own_step(model) -> bool:
    """Whether ``model``'s class defines its own train, test or predict step (TensorFlow backend)."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # pragma: no cover - a Keras laid out otherwise
        return False
    return any(getattr(type(model), step, None) is not getattr(TensorFlowTrainer, step, None)
               for step in ("train_step", "test_step", "predict_step"))


_TRAINER_CALLS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def install_error_unwrapping() -> None:
    """Make a failed collective inside Keras' compiled step raise hvddp's own error from ``fit``.

    On JAX the step's ``io_callback`` error reached the caller as a ``JaxRuntimeError``, on
    TensorFlow (in a ``tf.function``) as ``tf.errors.UnknownError``: ``except
    hvd.HorovodInternalError`` missed a ``MismatchError`` there, and with one rank stalled the
    ranks raised different types. Wraps the active backend's trainer (JAX, TensorFlow) once.
    """
    backend = keras.backend.backend()
    try:
        if backend == "jax":
            from keras.src.backend.jax.trainer import JAXTrainer as trainer
        elif backend == "tensorflow":
            from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as trainer
        else:
            return
    except ImportError:  # pragma: no cover - a Keras laid out otherwise: its own errors then
        return
    for name in _TRAINER_CALLS:
        original = vars(trainer).get(name)
        if original is None or getattr(original, "_hvddp_unwraps", False):
            continue
        setattr(trainer, name, _unwrapping(original))


def _unwrapping(original):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        mark = _staged.mark()
        try:
            return original(self, *args, **kwargs)
        except HvddpError:
            raise
        except Exception as exc:
            staged = _staged.since(mark)
            # the framework's wrapper carries the error's message; anything else (a later error
            # of the user's, after an hvddp error the user caught) is left as it is
            if staged is None or str(staged).split("\n")[0][:200] not in str(exc):
                raise
            raise staged from exc

    call._hvddp_unwraps = True
    return call
