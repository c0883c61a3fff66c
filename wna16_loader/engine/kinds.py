"""What the engine hook works out once per kind of tensor: the checked classification of a tensor an engine
hands over (`resolve`, every inconsistent argument raising its own error), and the `Kind` every later tensor
of that kind shares (its header, role, and where it is staged), so that those take one lookup.

A kind is one (stem, alias, suffix, projection) of per-expert names (`models.names.name_shape`), or one (alias, suffix,
stacked, projection) of parsed names.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..errors import FormatError
from ..formats import Role
from ..load.keys import STACKED_SOURCES, expert_key_problem
from ..load.params import SourceTensors, rank_spans, storage_index
from ..models.config import MoEConfig
from ..models.names import Proj, Source, parse_expert_name
from ..parallel.partition import LayerGeometry
from .mapping import ShardId, default_alias
from .staging import Index


class Arrival(NamedTuple):
    """What one checked weight_loader call delivers, resolved from its name and arguments."""

    source: Source
    role: Role
    expert: int | None  # None: stacked over experts
    alias: str  # checkpoint module name of the projection, e.g. gate_proj


class Kind(NamedTuple):
    """What every tensor of one kind shares once one of them passed every check: its source and role, the
    header the config implies (allowed dtypes, shape), and where it is staged (the role's value and bit, the
    storage index covering the rank's part, None when held whole; the slots per stage; the (source value,
    stacked) its projection then comes from)."""

    source: Source
    role: Role
    dtypes: tuple[torch.dtype, ...]
    shape: tuple[int, ...]
    value: str
    bit: int
    index: Index | None
    chunk: int
    origin: tuple[str, bool]


def staged_kind(moe: MoEConfig, geometry: LayerGeometry, arrival: Arrival, proj: Proj, src: SourceTensors,
                shape: tuple[int, ...], roles: tuple[Role, ...], stage_bytes: int) -> Kind:
    """The `Kind` of a checked arrival: its stage's chunk of slots (as many as fit `stage_bytes` of the
    staged parts of every role; every local slot for a stacked tensor) and the storage index of its own
    role's staged part. `roles`: the hook's roles (role i has bit 1 << i)."""
    stacked = arrival.expert is None
    spans, _ = rank_spans(src, geometry.slice(proj))
    quant = moe.quant
    staged = {lay.role: storage_index(lay, spans, quant.pack_factor, None) for lay in quant.layouts}
    slot_bytes = sum(math.prod(s.stop - s.start for s in staged[lay.role]) * max(d.itemsize for d in lay.dtypes)
                     for lay in quant.layouts)
    chunk = len(geometry.experts) if stacked else max(1, stage_bytes // max(1, slot_bytes))
    return Kind(arrival.source, arrival.role, quant.layout(arrival.role).dtypes, shape, arrival.role._value_,
                1 << roles.index(arrival.role), None if stacked else staged[arrival.role], chunk,
                (arrival.source._value_, stacked))


def resolve(moe: MoEConfig, geometry: LayerGeometry, weight_name: str, proj: Proj, expert_id: int | None) -> Arrival:
    """Source, role and expert of a tensor, from its checkpoint name (or a bare suffix and expert_id)."""
    key = parse_expert_name(weight_name)
    if key is None:
        suffix, source, expert, alias = weight_name.rsplit(".", 1)[-1], Source(proj.value), expert_id, None
    else:
        suffix, source, expert = key.suffix, key.source, key.expert
        alias = key.module_name.rsplit(".", 1)[-1]
        if expert_id is not None and expert_id != key.expert:
            raise FormatError(f"{weight_name}: expert_id={expert_id} but the name says expert {key.expert} "
                              f"(None: stacked over experts); pass the id the name carries.")
    layout = moe.quant.layout_for_suffix(suffix)
    if layout is None:
        raise FormatError(f"{weight_name}: suffix {suffix!r} is not a {moe.quant.format_name} expert "
                          f"tensor; expected one of {sorted(lay.suffix for lay in moe.quant.layouts)}. "
                          f"Pass the checkpoint tensor's own name as weight_name.")
    check_ids(weight_name, proj, source, expert, geometry.num_experts)
    problem = None if key is None else expert_key_problem(moe, key)
    if problem is not None:
        raise FormatError(f"{weight_name}: {problem}; no fused parameter takes it.")
    return Arrival(source, layout.role, expert, alias or default_alias(proj))


def check_ids(weight_name: str, proj: Proj, source: Source, expert: int | None, count: int) -> None:
    """The shard id must name a projection the source holds; the expert id (None: stacked) one of `count`."""
    if proj not in source.projs:
        raise FormatError(f"{weight_name}: shard_id {ShardId.of_proj(proj).value!r} means {proj.value}, but the "
                          f"tensor holds {[p.value for p in source.projs]}; use shard_id "
                          f"{[ShardId.of_proj(p).value for p in source.projs]}.")
    if expert is None and source not in STACKED_SOURCES:
        raise FormatError(f"{weight_name}: no expert id, and only gate_up_proj and down_proj tensors stack "
                          f"over experts; pass expert_id (0..{count - 1}).")
    if expert is not None and not 0 <= expert < count:
        raise FormatError(f"{weight_name}: expert id {expert} is outside 0..{count - 1} "
                          f"(the config declares {count} experts).")
