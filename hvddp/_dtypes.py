"""numpy dtypes by hvddp's dtype names; ml_dtypes' bfloat16 is imported on first use.

Importing ml_dtypes took 0.65-0.9 s here (``python -X importtime -c "import ml_dtypes"``), most of
what ``import hvddp`` cost every rank, and a numpy bfloat16 array exists only once something has
imported it.
"""

from __future__ import annotations

import numpy as np


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (imported here, on first use)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an hvddp dtype name (``"bfloat16"`` is ml_dtypes')."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)
