"""The package logger, with a per-rank prefix on every line."""

from __future__ import annotations

import logging
from typing import Any, MutableMapping

from .parallel import ParallelConfig

log = logging.getLogger("wna16_loader")


class RankLogger(logging.LoggerAdapter):
    """Prefixes every message with the rank, e.g. `[rank 3 tp 1/2 ep 1/2]`."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.extra['rank']}] {msg}", kwargs


def rank_logger(parallel: ParallelConfig) -> RankLogger:
    """The package logger, prefixed with `parallel`'s rank."""
    tag = (f"rank {parallel.rank} tp {parallel.tp_rank}/{parallel.tp_size} "
           f"ep {parallel.ep_rank}/{parallel.ep_size}")
    return RankLogger(log, {"rank": tag})
