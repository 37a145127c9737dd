"""The response cache: identical on every rank, so a steady-state step is one bitwise AND."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

from .messages import Request


class ResponseCache:
    """Least-recently-used map from a request signature to a slot number.

    Every rank applies the same puts, touches and evictions in the same order (they all come
    from the broadcast response list or from the agreed fast-path ready set), so slot numbers
    agree across ranks without ever being sent.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_sig: "OrderedDict[tuple, int]" = OrderedDict()
        self._by_name: Dict[tuple, tuple] = {}
        self._requests: Dict[int, Request] = {}
        self._sigs: Dict[int, tuple] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.version = 0  # bumped on every change of the slot map

    def __len__(self) -> int:
        return len(self._by_sig)

    def lookup(self, sig: tuple) -> Optional[int]:
        """The slot of a request signature (``Request.signature()``), or None."""
        return self._by_sig.get(sig)

    def has_name(self, key: tuple) -> bool:
        return key in self._by_name

    def request(self, slot: int) -> Request:
        return self._requests[slot]

    def slots(self):
        return self._requests.items()

    def touch(self, slot: int) -> None:
        self._by_sig.move_to_end(self._sigs[slot])

    def put(self, request: Request) -> None:
        if self.capacity == 0:
            return
        sig = request.signature()
        if sig in self._by_sig:
            self._by_sig.move_to_end(sig)
            return
        self.evict(request.key())
        if not self._free:
            old_sig, slot = self._by_sig.popitem(last=False)
            old = self._requests.pop(slot)
            del self._sigs[slot]
            del self._by_name[old.key()]
            self._free.append(slot)
        slot = self._free.pop()
        self._by_sig[sig] = slot
        self._by_name[request.key()] = sig
        self._requests[slot] = request
        self._sigs[slot] = sig
        self.version += 1

    def evict_process_set(self, ps_id: int) -> None:
        for key in [k for k in self._by_name if k[0] == ps_id]:
            self.evict(key)

    def evict(self, key: tuple) -> None:
        sig = self._by_name.pop(key, None)
        if sig is None:
            return
        slot = self._by_sig.pop(sig)
        del self._requests[slot]
        del self._sigs[slot]
        self._free.append(slot)
        self.version += 1
