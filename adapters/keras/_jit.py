"""Make ``jit_compile="auto"`` choose no XLA for models whose optimizer uses hvddp (TensorFlow).

Keras resolves ``"auto"`` to XLA on TensorFlow when a GPU is present, and XLA cannot compile
the ``tf.numpy_function`` that reaches hvddp. The guard wraps ``Trainer._resolve_auto_jit_compile``
so that, on the TensorFlow backend only and only for a model compiled with an hvddp optimizer,
"auto" means no XLA. Every other model, and every other backend (JAX runs hvddp under
``jax.jit`` through ``io_callback``), keeps Keras' choice. ``jit_compile=True`` is left alone and
fails at trace time with an error that says what to do.
"""

from __future__ import annotations

import logging

import keras


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

        if keras.backend.backend() == "tensorflow" and is_distributed(getattr(self, "optimizer", None)):
            return False
        return original(self)

    _resolve_auto_jit_compile._hvddp_guard = True
    _resolve_auto_jit_compile.__wrapped__ = original
    _trainer.Trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
