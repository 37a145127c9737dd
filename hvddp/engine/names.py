"""Automatic names of unnamed collectives, kept in step across ranks through ``join``.

An unnamed call takes ``<prefix><n>`` (``allreduce.noname.3``, ``tf.barrier.ps2.noname.0``):
the n-th unnamed call of that kind on that set, counted by each rank. The names match across
ranks as long as every rank makes the same unnamed calls. A rank that has joined takes part in
its peers' allreduces and barriers without calling them (and sees their calls that fail because
it joined), so its count would fall behind and its next unnamed call after ``join`` would never
meet the others'. The engine reports each such call here, and the count moves past it.
"""

from __future__ import annotations

import re
import threading
from typing import Dict

# <prefix ending in .noname.><n>, optionally .<i> for a member of a group, or the suffix of one
# of the collectives an object or sparse call is made of (.size/.data/.ok, .values/.indices)
_AUTOMATIC = re.compile(r"^(.+\.noname\.)(\d+)(?:\.(?:\d+|size|data|ok|values|indices))?$")


class AutoNames:
    """The per-prefix counts of one ``init()``; thread-safe."""

    def __init__(self) -> None:
        self._next: Dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, prefix: str) -> str:
        """The next name under ``prefix``."""
        with self._lock:
            n = self._next.get(prefix, 0)
            self._next[prefix] = n + 1
        return f"{prefix}{n}"

    def seen(self, name: str) -> None:
        """A peer's call named ``name`` ran here without a local call: count past it."""
        match = _AUTOMATIC.match(name)
        if match is None:
            return
        prefix, n = match.group(1), int(match.group(2))
        with self._lock:
            if self._next.get(prefix, 0) <= n:
                self._next[prefix] = n + 1
