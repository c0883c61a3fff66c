"""MTP (multi-token-prediction, "NextN") layers: how many a config declares, and which experts prefixes of a
checkpoint are theirs, from the family's row (families.MTP).

| naming            | MTP layer i's experts prefix             | families                        |
|-------------------|------------------------------------------|---------------------------------|
| appended layers   | `{root}.{L + i}[.{module}].experts`        | DeepSeek-V3/V3.2, GLM-4.x, GLM-5 |
| own tree          | `{mtp root}.{i}[.{module}].experts`        | Qwen3-Next, Qwen3.5 (`mtp.layers`), DeepSeek-V4 (`mtp`) |

L is the decoder layer count, i < K (the row's count keys). A prefix under any family's own MTP root is an
MTP prefix whatever the family (its layer number counts in that tree, never in the decoder's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .families import MTP, Family, lookup, mtp_roots
from .names import prefix_parts

MTP_ROOTS = frozenset(mtp_roots())


@dataclass(frozen=True)
class MTPLayers:
    """The MTP layers a config declares (`count` = K) and how to tell their experts prefixes.

    `first`: the layer number MTP layer 0 carries in its names (L for appended layers, 0 for a tree);
    `root`: the tree's root (None: appended to the decoder's roots); `routed`: whether they hold routed
    experts (False: a dense MTP block); `source`: where the count came from.
    """

    count: int = 0
    first: int = 0
    root: str | None = None
    routed: bool = True
    source: str = "the family's row has no MTP layers"

    def index(self, prefix: str) -> int | None:
        """i when experts prefix `prefix` belongs to an MTP layer (declared or not), else None: a prefix
        under an MTP tree root, or an appended layer L <= layer < L + K."""
        parts = prefix_parts(prefix)
        if parts is None:
            return None
        root, layer = parts
        if root in MTP_ROOTS:
            return layer
        appended = self.routed and self.root is None
        return layer - self.first if appended and self.first <= layer < self.first + self.count else None

    def problem(self, prefix: str) -> str | None:
        """Why MTP prefix `prefix` is not one of the declared MTP layers with routed experts (None when it is)."""
        parts, index = prefix_parts(prefix), self.index(prefix)
        if parts is None or index is None:
            return None
        if not self.routed:
            return f"an MTP layer's experts, but {self.source}"
        if (parts[0] in MTP_ROOTS) != (self.root is not None) or parts[0] != (self.root or parts[0]):
            return f"an MTP layer under {parts[0]!r}, but this family's MTP layers are {self.naming()}"
        if index >= self.count:
            return f"MTP layer {index}, but config.json declares {self.count} MTP layer(s) ({self.source})"
        return None

    def naming(self) -> str:
        """How the declared layers are named, e.g. `layers.{61..61}` (appended) or `mtp.layers.{0..0}`."""
        if not self.routed or not self.count:
            return "none"
        span = f"{{{self.first}..{self.first + self.count - 1}}}"
        return f"{self.root}.{span}" if self.root else f"layers.{span} (appended to the decoder)"

    def describe(self) -> str:
        """For the resolution record, e.g. `1: layers.{61..61} (appended to the decoder)`."""
        return f"{self.count}: {self.naming()}" if self.routed else f"{self.count} (dense: no routed experts)"


def resolve_mtp(text: dict[str, Any], family: Family, num_layers: int) -> MTPLayers:
    """The MTP layers `text` (the decoder's config) declares under `family`'s row."""
    rule = family.mtp
    if rule is None:
        return MTPLayers()
    count, source = _count(text, rule, family)
    if not rule.routed:
        source = f"the {family.name} row's MTP block is dense (no routed experts); {source}"
    return MTPLayers(count=count, first=0 if rule.root else num_layers, root=rule.root, routed=rule.routed,
                     source=source)


def _count(text: dict[str, Any], rule: MTP, family: Family) -> tuple[int, str]:
    for key in rule.keys:
        value = lookup(text, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config.json: {key}={value!r} (MTP layer count) must be an integer >= 0.")
        return value, f"{key}={value} (row {family.name})"
    return rule.default, f"{rule.default}: no key of {list(rule.keys)} present (row {family.name}'s default)"
