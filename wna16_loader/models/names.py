"""Checkpoint tensor names: parsed once into typed keys.

This is the only module that matches tensor names. A routed-expert tensor name is
`{root}.{L}[.{module}].experts.[{e}.]{proj}.{suffix}`, with the roots (e.g. `model.layers`), modules
and projection names of the families table (families.py) matched in full; without
`{e}` the tensor is stacked over experts (`[E, ...]`). A family's shared-expert tensor (families.SharedExperts) is
`{root}.{L}[.{module}].{shared}.{proj}.{suffix}`, beside the routed experts: a non-expert tensor, unless
read as one more expert of its layer (`shared_expert_key`).
"""

from __future__ import annotations

import enum
import re
from functools import partial
from typing import Iterable, NamedTuple, Sequence

from .families import all_rows, mtp_roots


class Proj(enum.Enum):
    """A logical expert projection (what a fused slot holds)."""

    GATE = "gate"
    UP = "up"
    DOWN = "down"

    # Members are singletons compared by identity: hash them by identity too (in C), not by
    # Enum's Python-level hash of the member name; planning uses them in keys of hot dicts.
    __hash__ = object.__hash__


class Source(enum.Enum):
    """What one checkpoint projection tensor carries."""

    GATE = "gate"
    UP = "up"
    DOWN = "down"
    GATE_UP = "gate_up"  # gate and up as the two halves of N

    __hash__ = object.__hash__  # as Proj: identity, in C

    @property
    def projs(self) -> tuple[Proj, ...]:
        """The logical projections this source holds, in N order."""
        return _SOURCE_PROJS[self]


_SOURCE_PROJS = {
    Source.GATE: (Proj.GATE,),
    Source.UP: (Proj.UP,),
    Source.DOWN: (Proj.DOWN,),
    Source.GATE_UP: (Proj.GATE, Proj.UP),
}


def _union(values: list) -> tuple:
    return tuple(dict.fromkeys(values))


def _aliases() -> dict[str, Source]:
    """Projection tensor name -> what it carries, over every row; a name must mean one thing everywhere."""
    out: dict[str, Source] = {}
    for family in all_rows():
        for name, kind in family.projections:
            if out.setdefault(name, Source(kind)) is not Source(kind):
                raise AssertionError(f"families table: {name!r} is {out[name]} in one row, {kind!r} in {family.name}")
    return out


PROJ_ALIASES: dict[str, Source] = _aliases()
ROOTS: tuple[str, ...] = _union([root for family in all_rows() for root in family.roots] + list(mtp_roots()))
MODULES: tuple[str, ...] = _union([m for family in all_rows() for m in family.modules if m is not None])
EXPERTS: tuple[str, ...] = _union([name for family in all_rows() for name in family.experts])

_PREFIX = r"(?P<prefix>(?P<root>{roots})\.(?P<layer>\d+)(?:\.(?:{modules}))?\.(?:{experts}))".format(
    roots="|".join(re.escape(r) for r in ROOTS), modules="|".join(re.escape(m) for m in MODULES),
    experts="|".join(re.escape(e) for e in EXPERTS))
_PREFIX_RE = re.compile(f"^{_PREFIX}$")
_EXPERT_RE = re.compile(r"^{prefix}\.(?:(?P<expert>\d+)\.)?(?P<proj>{projs})(?:\.(?P<suffix>[A-Za-z0-9_]+))?$".format(
    prefix=_PREFIX, projs="|".join(re.escape(p) for p in PROJ_ALIASES)))


class ExpertTensorKey(NamedTuple):
    """One routed-expert tensor of a checkpoint (a named tuple: a scan makes one per expert tensor).

    `expert` is None for a tensor stacked over all experts (leading dim E); `suffix` is "" for a
    stacked float parameter named by its projection alone (transformers' `experts.gate_up_proj`).
    """

    name: str
    experts_prefix: str
    layer: int
    expert: int | None
    source: Source
    suffix: str

    @property
    def module_name(self) -> str:
        """The Linear module this tensor belongs to (name without the suffix)."""
        return self.name[: -len(self.suffix) - 1] if self.suffix else self.name


def parse_expert_name(name: str) -> ExpertTensorKey | None:
    """Parse a routed-expert tensor name; None for every other tensor."""
    match = _EXPERT_RE.match(name)
    if match is None:
        return None
    expert, suffix = match.group("expert"), match.group("suffix") or ""
    if expert is not None and not suffix:
        return None  # only a stacked parameter goes without a suffix
    source = PROJ_ALIASES[match.group("proj")]
    return ExpertTensorKey(
        name=name,
        experts_prefix=match.group("prefix"),
        layer=int(match.group("layer")),
        expert=None if expert is None else int(expert),
        source=source,
        suffix=suffix,
    )


Cell = tuple[Source, bool, str]  # (source, stacked, suffix): one kind of routed-expert tensor of a layer


class LayerNames(Sequence[ExpertTensorKey]):
    """The routed-expert tensors of one layer as a checkpoint names them: `names` in checkpoint order, and
    `cells`, (source, stacked, suffix) -> {expert (None: stacked) -> name}, by first appearance. As a
    sequence, the `ExpertTensorKey` of each name, made when first asked (planning reads the cells alone)."""

    def __init__(self, prefix: str, layer: int) -> None:
        self.prefix, self.layer = prefix, layer
        self.names: list[str] = []
        self.cells: dict[Cell, dict[int | None, str]] = {}
        self._keys: list[ExpertTensorKey] | None = None

    def add(self, key: ExpertTensorKey) -> None:
        """One more tensor of the layer."""
        self.cells.setdefault((key.source, key.expert is None, key.suffix), {})[key.expert] = key.name
        self.names.append(key.name)
        self._keys = None

    @classmethod
    def of_keys(cls, prefix: str, layer: int, keys: list[ExpertTensorKey]) -> "LayerNames":
        """The layer of `keys` as they are (e.g. `shared_expert_key`'s, which the name parser does not make)."""
        names = cls(prefix, layer)
        for key in keys:
            names.add(key)
        names._keys = list(keys)
        return names

    @property
    def keys(self) -> list[ExpertTensorKey]:
        """The key of each name, in checkpoint order."""
        if self._keys is None:
            parse = ExpertNameParser()
            self._keys = [parse(name) for name in self.names]
        return self._keys

    @property
    def suffixes(self) -> set[str]:
        """The suffixes of the layer's tensors."""
        return {suffix for _, _, suffix in self.cells}

    def __getitem__(self, item: int | slice) -> ExpertTensorKey | list[ExpertTensorKey]:  # type: ignore[override]
        return self.keys[item]

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"LayerNames({self.prefix!r}, {len(self.names)} tensors)"


def _layer_names(layers: dict[str, LayerNames], prefix: str, layer: int) -> LayerNames:
    """The `LayerNames` of `prefix` in `layers`, added when new."""
    names = layers.get(prefix)
    if names is None:
        names = layers[prefix] = LayerNames(prefix, layer)
    return names


class ExpertNameParser:
    """`parse_expert_name` for the many names of one checkpoint: the regex runs once per name *shape*.

    A name `{stem}.{e}.{proj}.{suffix}` whose `e` is decimal (the characters of the regex's `\\d`) can
    only match with `e` as its expert id, since projection aliases and suffixes hold no dot; so every
    name of one (stem, proj, suffix) shape matches or fails alike, and one match of the shape with
    e = 0 decides them all. Other names (stacked tensors, most non-expert tensors) run the regex each.
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[str, str, str], tuple[str, int, Source, str] | None] = {}

    def __call__(self, name: str) -> ExpertTensorKey | None:
        """What `parse_expert_name(name)` returns."""
        stem, expert, proj, suffix = name_shape(name)
        if not SHAPE_RULE or not (stem and expert.isdecimal()):
            return parse_expert_name(name)
        found = self._shape(stem, proj, suffix)
        return None if found is None else _make_key((name, found[0], found[1], int(expert), found[2], found[3]))

    def split(self, names: Iterable[str]) -> tuple[dict[str, LayerNames], list[str]]:
        """(experts prefix -> its `LayerNames`, by first appearance; every other name, in order): what `self(name)`
        says of each of `names`, with no key made (a checkpoint has hundreds of thousands of names: a numbered
        name costs its split at the dots, one lookup of its shape and one store into its cell)."""
        layers: dict[str, LayerNames] = {}
        others: list[str] = []
        cells: dict[tuple[str, str, str], tuple[dict[int | None, str], list[str]] | None] = {}  # by name shape
        for name in names:
            parts = name.rsplit(".", 3)  # `name_shape`, inlined: a numbered name has all four parts
            if SHAPE_RULE and len(parts) == 4 and parts[0] and parts[1].isdecimal():
                stem, expert, proj, suffix = parts
                found = cells.get((stem, proj, suffix), _UNSEEN)
                if found is _UNSEEN:
                    found = cells[(stem, proj, suffix)] = self._cell_of_shape(layers, stem, proj, suffix)
                if found is None:
                    others.append(name)
                else:
                    found[0][int(expert)] = name
                    found[1].append(name)
            elif (key := parse_expert_name(name)) is None:
                others.append(name)
            else:
                _layer_names(layers, key.experts_prefix, key.layer).add(key)
        return layers, others

    def _cell_of_shape(self, layers: dict[str, LayerNames], stem: str, proj: str,
                       suffix: str) -> tuple[dict[int | None, str], list[str]] | None:
        """(the cell, the names list) of its layer that the numbered names of one shape go to; None: not
        expert tensors."""
        found = self._shape(stem, proj, suffix)
        if found is None:
            return None
        prefix, layer, source, key_suffix = found
        names = _layer_names(layers, prefix, layer)
        return names.cells.setdefault((source, False, key_suffix), {}), names.names

    def _shape(self, stem: str, proj: str, suffix: str) -> tuple[str, int, Source, str] | None:
        """(experts prefix, layer, source, suffix) of every name of one shape (None: not expert tensors), from
        one match of the shape with expert 0, made at the shape's first name and kept."""
        found = self._shapes.get((stem, proj, suffix), _UNSEEN)
        if found is _UNSEEN:
            key = parse_expert_name(f"{stem}.0.{proj}.{suffix}")
            found = None if key is None else (key.experts_prefix, key.layer, key.source, key.suffix)
            self._shapes[(stem, proj, suffix)] = found
        return found


_UNSEEN = object()
# A key from a tuple of its fields: the C-level tuple constructor (the named tuple's own __new__ and _make are Python).
_make_key = partial(tuple.__new__, ExpertTensorKey)
_DOTTED_ALIASES = any("." in alias for alias in PROJ_ALIASES)  # the shape rule needs dot-free aliases
# Whether the shape rule of `ExpertNameParser` holds: every name `{stem}.{e}.{proj}.{suffix}` with a decimal `e`
# parses as every other of its (stem, proj, suffix) shape does, with `e` as its expert id.
SHAPE_RULE = not _DOTTED_ALIASES


def name_shape(name: str) -> tuple[str, str, str, str]:
    """(stem, expert digits, alias, suffix) of a name `{stem}.{e}.{alias}.{suffix}` (split at its last three
    dots; the leading parts "" for a name with fewer)."""
    parts = name.rsplit(".", 3)
    return ("", "", "", *parts)[-4:]  # type: ignore[return-value]


def experts_prefix_for(root: str, layer: int, module: str | None, experts: str = "experts") -> str:
    """Build an experts prefix, e.g. `model.layers.3.mlp.experts` (root `model.layers`)."""
    middle = f".{module}" if module else ""
    return f"{root}.{layer}{middle}.{experts}"


def shared_prefix(experts_prefix: str, module: str) -> str:
    """The module of a layer's shared experts beside its routed experts, e.g. `model.layers.3.mlp.shared_experts`
    for `model.layers.3.mlp.experts` and module `shared_experts`."""
    return f"{experts_prefix.rpartition('.')[0]}.{module}"


def shared_expert_key(name: str, experts_prefix: str, module: str, expert: int) -> ExpertTensorKey | None:
    """The tensor `name` of the shared-expert module `module` beside `experts_prefix`, read as expert `expert` of
    that layer (`{shared}.{proj}.{suffix}`, a projection of the families table); None for every other name."""
    stem, dot, rest = name.partition(f"{shared_prefix(experts_prefix, module)}.")
    proj, _, suffix = rest.partition(".")
    if stem or not dot or proj not in PROJ_ALIASES or not suffix or "." in suffix:
        return None
    layer = layer_of_prefix(experts_prefix)
    assert layer is not None, f"{experts_prefix!r} is not an experts prefix"
    return ExpertTensorKey(name, experts_prefix, layer, expert, PROJ_ALIASES[proj], suffix)


def layer_of_prefix(prefix: str) -> int | None:
    """The decoder layer of an experts prefix (e.g. 3 for `model.layers.3.mlp.experts`), None for other names."""
    match = _PREFIX_RE.match(prefix)
    return None if match is None else int(match.group("layer"))


def prefix_parts(prefix: str) -> tuple[str, int] | None:
    """(root, decoder layer) of an experts prefix (e.g. ("mtp.layers", 0) for `mtp.layers.0.mlp.experts`), None for
    other names."""
    match = _PREFIX_RE.match(prefix)
    return None if match is None else (match.group("root"), int(match.group("layer")))


def prefix_at_layer(prefix: str, layer: int) -> str:
    """The experts prefix of decoder layer `layer` in the naming of `prefix` (another layer's experts prefix)."""
    match = _PREFIX_RE.match(prefix)
    if match is None:
        raise ValueError(f"{prefix!r} is not an experts prefix")
    return prefix[:match.start("layer")] + str(layer) + prefix[match.end("layer"):]


_EXPERT_LIKE = re.compile(r"(^|\.)[A-Za-z_]*experts?[A-Za-z_]*\.")


def expert_like(names: Iterable[str], limit: int) -> tuple[list[str], int]:
    """(the first `limit` of `names` that look like expert tensors, how many do): a name with a dotted
    component that holds `expert` or `experts` (for a message about names no row parses, never to decide)."""
    found = [name for name in names if _EXPERT_LIKE.search(name)]
    return found[:limit], len(found)
