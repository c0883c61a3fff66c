"""What a load returns: the fused layers by experts prefix, and the report of what it did."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import ExpertsPrefixError
from .fused import FusedExperts
from .plan import LayerPlan
from .scan import CheckpointScan


@dataclass(frozen=True)
class LoadReport:
    """What a load did, for logs and benchmarks."""

    layers: int
    experts: int
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float
    ignored: int = 0  # tensors that are not routed experts (routers, attention, shared experts, dense MLPs)
    window_bytes: int = 0  # the shared memory a node's read used (0: the rank read alone)
    buffer_bytes: int = 0  # the memory of the rank's own read-ahead buffers (0: none, or read with the node)

    @classmethod
    def of(cls, plans: list[LayerPlan], scan: CheckpointScan, *, tensors: int, bytes_read: int, bytes_written: int,
           start: float, window_bytes: int = 0, buffer_bytes: int = 0) -> "LoadReport":
        """The report of a load of `plans` that began at perf_counter() time `start`."""
        return cls(layers=len(plans), experts=sum(len(p.fused.experts) for p in plans), tensors=tensors,
                   bytes_read=bytes_read, bytes_written=bytes_written, seconds=time.perf_counter() - start,
                   ignored=len(scan.others), window_bytes=window_bytes, buffer_bytes=buffer_bytes)

    def __str__(self) -> str:
        memory = f", read with the node through a {self.window_bytes / 2**20:.0f} MiB window" if self.window_bytes else ""
        memory += f", read ahead into {self.buffer_bytes / 2**20:.0f} MiB of buffers" if self.buffer_bytes else ""
        return (f"{self.layers} layers, {self.experts} local experts, {self.tensors} tensors, "
                f"{self.bytes_read / 2**20:.1f} MiB read, {self.bytes_written / 2**20:.1f} MiB written, "
                f"{self.seconds:.2f} s, {self.ignored} non-expert tensors left alone{memory}")


class LoadedExperts(dict[str, FusedExperts]):
    """experts prefix -> FusedExperts, with the load's `report` and the names of the
    non-expert tensors it left alone (`ignored`)."""

    report: LoadReport
    ignored: tuple[str, ...] = ()

    def __missing__(self, prefix: str) -> FusedExperts:
        """`layers[prefix]` for a prefix this load has not: ExpertsPrefixError listing the ones it has."""
        have = list(self)
        shown = ", ".join(have[:8]) + (f" and {len(have) - 8} more" if len(have) > 8 else "")
        raise ExpertsPrefixError(f"{prefix!r}: no such experts prefix among the {len(have)} layer(s) loaded "
                                 f"({shown or 'none'}); the keys are the checkpoint's experts prefixes: use one "
                                 f"of these, or iterate over the result.")
