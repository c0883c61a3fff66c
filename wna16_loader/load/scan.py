"""The name scan of a checkpoint: every tensor name parsed once, split into routed-expert layers and the rest."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.mtp import MTPLayers
from ..models.names import ExpertNameParser, LayerNames
from ..storage.bulk import gc_paused
from ..storage.index import CheckpointIndex


@dataclass(frozen=True)
class CheckpointScan:
    """A checkpoint's tensor names split into routed-expert layers (each its `LayerNames`, in layer order) and
    the rest (sorted)."""

    layers: dict[str, LayerNames]
    others: tuple[str, ...]

    @property
    def module_names(self) -> frozenset[str]:
        """Every module name of the checkpoint (its tensor names without the last component)."""
        return frozenset([name.rpartition(".")[0] for name in self.others] +
                         [key.module_name for keys in self.layers.values() for key in keys])

    @classmethod
    def of(cls, index: CheckpointIndex) -> "CheckpointScan":
        """Parse every name once (the name regex once per name shape: `ExpertNameParser.split`)."""
        with gc_paused():  # an entry per name: see bulk.py
            layers, others = ExpertNameParser().split(index.refs)
        return cls(dict(sorted(layers.items(), key=lambda kv: kv[1].layer)), tuple(sorted(others)))

    def mtp_prefixes(self, mtp: MTPLayers) -> tuple[str, ...]:
        """The experts prefixes of the scan that belong to MTP layers (declared by the config or not)."""
        return tuple(prefix for prefix in self.layers if mtp.index(prefix) is not None)

    def without(self, prefixes: tuple[str, ...]) -> "CheckpointScan":
        """This scan with the expert tensors of `prefixes` counted as non-expert tensors (`others`)."""
        if not prefixes:
            return self
        moved = [name for prefix in prefixes for name in self.layers[prefix].names]
        return CheckpointScan({p: keys for p, keys in self.layers.items() if p not in prefixes},
                              tuple(sorted((*self.others, *moved))))
