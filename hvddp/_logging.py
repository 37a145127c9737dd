"""The ``hvddp`` logger: rank-prefixed lines, level from ``HVDDP_LOG_LEVEL``."""

from __future__ import annotations

import logging

log = logging.getLogger("hvddp")

_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
_handler = None
logging.addLevelName(_LEVELS["TRACE"], "TRACE")


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.hvddp_rank = self.rank
        return True


def configure(level: str, rank: int) -> None:
    """Set the level and a handler that prefixes every line with ``[hvddp rank N]``."""
    global _handler
    log.setLevel(_LEVELS[level])
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[hvddp rank %(hvddp_rank)s] %(levelname)s: %(message)s"))
        log.addHandler(_handler)
        log.propagate = False
    for f in list(_handler.filters):
        _handler.removeFilter(f)
    _handler.addFilter(_RankFilter(rank))
