"""Name Keras 2 objects (the ``tf_keras`` package) where hvddp.keras is handed one.

With TensorFlow >= 2.16, ``pip install tf-keras`` and ``TF_USE_LEGACY_KERAS=1`` make ``tf.keras``
Keras 2 (``tf_keras``) while ``import keras`` stays Keras 3. hvddp.keras hooks Keras 3's
optimizer, callbacks and saving, which Keras 2 objects do not have; what it refuses then says so
and points to what works: Keras 3 objects, or ``hvddp.tensorflow``'s tape for Keras 2 ones.
"""

from __future__ import annotations

import json
import zipfile
from typing import Any, Optional

FIX = ("hvddp.keras works with Keras 3 objects: build the model and optimizer from `import keras` "
       "(not tf.keras, which TF_USE_LEGACY_KERAS=1 makes Keras 2), or keep tf_keras in a custom "
       "training loop with hvddp.tensorflow's DistributedGradientTape and broadcast_variables.")


def is_keras2(obj: Any) -> bool:
    """Whether ``obj`` (an instance, or a class) comes from the ``tf_keras`` package (Keras 2)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return str(getattr(cls, "__module__", "")).split(".")[0] == "tf_keras"


def describe(obj: Any) -> str:
    """``obj``'s class with its module, and for a Keras 2 object, that it is one."""
    cls = type(obj)
    text = f"{cls.__module__}.{cls.__qualname__}"
    return text + " (Keras 2, from the tf_keras package)" if is_keras2(obj) else text


def fix(obj: Any) -> str:
    """What to do instead, for a Keras 2 ``obj`` (with a leading space); else ''."""
    return f" {FIX}" if is_keras2(obj) else ""


def refuse(obj: Any, who: str) -> None:
    """Raise ``TypeError`` if ``obj`` is a Keras 2 object: ``who`` needs a Keras 3 one."""
    if is_keras2(obj):
        raise TypeError(f"{who} needs Keras 3 objects; Received: {describe(obj)}.{fix(obj)}")


def saved_version(path: Any) -> Optional[str]:
    """The Keras version that wrote the ``.keras`` or ``.h5`` file at ``path``; None if unknown."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                return str(json.loads(archive.read("metadata.json"))["keras_version"])
        import h5py

        with h5py.File(path, "r") as h5:
            version = h5.attrs.get("keras_version")
        return version.decode() if isinstance(version, bytes) else (None if version is None else str(version))
    except Exception:  # noqa: BLE001 - not a file we can read: say nothing about it
        return None


class Keras3Callback:
    """Mixin for hvddp's Keras callbacks: a Keras 2 model's ``fit`` (tf_keras, which calls
    ``set_model`` first) gets a ``TypeError`` saying so, not an ``AttributeError`` on a hook
    Keras 2 expects and Keras 3's callbacks lack."""

    def set_model(self, model: Any) -> None:
        refuse(model, f"hvddp.keras' {type(self).__name__}")
        super().set_model(model)  # type: ignore[misc]
