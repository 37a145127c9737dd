"""Reuse of result arrays: freshly allocated memory costs page faults on every step.

Out-of-place collectives return new arrays. Allocating them anew each step makes the kernel
zero and map fresh pages (glibc hands large freed blocks back to the system). The pool keeps the
arrays it handed out and gives one back again once nothing but the pool refers to it, which
``sys.getrefcount`` tells exactly: any view a caller kept (numpy's, or a framework tensor made
with ``from_numpy``) holds a reference.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Deque, Dict, Tuple

import numpy as np

_PER_KEY = 4096  # a model may have hundreds of tensors of one shape
_SCAN = 8  # candidates looked at before allocating: in steady state the first one is free
MAX_POOLED_BYTES = 1 << 30


def _references(arrays: Deque[np.ndarray]) -> int:
    """``sys.getrefcount`` of the first array of ``arrays``, always taken by this one function:
    what counts as a reference can differ between Python versions (an interpreter may borrow a
    local's reference for a call, as 3.14 is said to), so a free array's count is measured, not
    assumed."""
    candidate = arrays[0]
    return sys.getrefcount(candidate)


_FREE = _references(deque([np.empty(0)]))  # an array only its deque holds (3 up to Python 3.13)


class OutputPool:
    """``empty(shape, dtype)`` that recycles arrays no one else references any more."""

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES) -> None:
        self._free: Dict[Tuple[tuple, np.dtype], Deque[np.ndarray]] = {}
        self._bytes = 0
        self.max_bytes = max_bytes

    def empty(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        key = (shape, dtype)
        arrays = self._free.get(key)
        if arrays is None:
            arrays = self._free[key] = deque()
        for _ in range(min(len(arrays), _SCAN)):
            free = _references(arrays) == _FREE  # nothing but the deque refers to it
            arrays.rotate(-1)
            if free:
                return arrays[-1]
        out = np.empty(shape, dtype=dtype)
        if len(arrays) < _PER_KEY and self._bytes + out.nbytes <= self.max_bytes:
            arrays.append(out)
            self._bytes += out.nbytes
        return out

    def clear(self) -> None:
        self._free.clear()
        self._bytes = 0
