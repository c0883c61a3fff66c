"""The package logger, with a per-rank prefix on every line."""

from __future__ import annotations

import logging
from typing import Any, MutableMapping, Protocol

log = logging.getLogger("wna16_loader")


class Ranked(Protocol):
    """What the prefix reads of a rank (a `ParallelConfig`; a Protocol, so that this module, which every
    layer may use, imports nothing of the package)."""

    @property
    def rank(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def ep_rank(self) -> int: ...
    @property
    def ep_size(self) -> int: ...


class RankLogger(logging.LoggerAdapter):
    """Prefixes every message with the rank, e.g. `[rank 3 tp 1/2 ep 1/2]`."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.extra['rank']}] {msg}", kwargs


def rank_logger(parallel: Ranked) -> RankLogger:
    """The package logger, prefixed with `parallel`'s rank."""
    tag = (f"rank {parallel.rank} tp {parallel.tp_rank}/{parallel.tp_size} "
           f"ep {parallel.ep_rank}/{parallel.ep_size}")
    return RankLogger(log, {"rank": tag})


def warn_reduced_groups(logger: logging.Logger | logging.LoggerAdapter, *, group_size: int,
                        effective: dict[str, int], tp_size: int, intermediate: int) -> None:
    """Log one warning when some layers' effective group size G_eff (prefix -> G_eff) is below the
    checkpoint's G: each checkpoint scale is then repeated G / G_eff times, and kernels that accept
    only some group sizes may refuse the result. Names the layers and the TP sizes that keep G (TP 1 always:
    one rank holds every column)."""
    reduced = {prefix: g for prefix, g in effective.items() if 0 < g < group_size}
    if not reduced:
        return
    keep = [1] + [t for t in range(2, 65) if intermediate % t == 0 and (intermediate // t) % group_size == 0]
    names = ", ".join(list(reduced)[:3]) + (f" and {len(reduced) - 3} more" if len(reduced) > 3 else "")
    logger.warning("tp=%d: group size %d becomes G_eff %s in %d layer(s) (%s): I/tp = %d/%d is not a multiple of "
                   "%d, so each scale and zero point is repeated; kernels that accept only some group sizes may "
                   "refuse it. TP sizes that keep group size %d: %s.", tp_size, group_size,
                   ",".join(str(g) for g in sorted(set(reduced.values()))), len(reduced), names, intermediate,
                   tp_size, group_size, group_size, keep)
