"""Whether a routed-expert tensor feeds a fused slot: the one rule shared by the planner, the engine hook
and the name mapping (`expert_key_problem`), and its memoised form for the many keys of a checkpoint
(`KeyRules`: the kind part once per (suffix, source, stacked), the expert count once per layer)."""

from __future__ import annotations

from typing import Any, Callable

from ..models.config import MoEConfig
from ..models.names import Cell, ExpertTensorKey, LayerNames, Proj, Source

STACKED_SOURCES = (Source.GATE_UP, Source.DOWN)


class KeyRules:
    """`expert_key_problem` over the many keys of one checkpoint: its kind part once per (suffix, source,
    stacked), the expert count once per layer."""

    def __init__(self, moe: MoEConfig) -> None:
        self.moe = moe
        self.roles = {layout.suffix: layout.role for layout in reversed(moe.quant.layouts)}  # first wins
        self._kinds = _Memo(lambda kind: _kind_problem(moe, *kind))
        self._counts = _Memo(lambda layer: moe.layer(layer).num_experts)

    def problem(self, key: ExpertTensorKey) -> str | None:
        """`expert_key_problem(self.moe, key)`."""
        return _key_problem(key, self._kinds[key.suffix, key.source, key.expert is None], self._counts[key.layer])

    def sort_out(self, layer: LayerNames) -> tuple[dict[Cell, dict[int | None, str]], list[tuple[str, str]]]:
        """The cells of one layer whose tensors feed a slot ((source, stacked, suffix) -> {expert or None:
        name}), and (name, why) of the tensors that feed none, in checkpoint order: `problem` of each tensor,
        decided cell by cell (its kind once, its expert ids by the largest)."""
        kept: dict[Cell, dict[int | None, str]] = {}
        why: dict[str, str] = {}
        count = self._counts[layer.layer]
        for cell, names in layer.cells.items():
            source, stacked, suffix = cell
            problem = self._kinds[suffix, source, stacked]
            if problem is not None:
                why.update(dict.fromkeys(names.values(), problem))
            elif stacked or max(names) < count:  # type: ignore[type-var] (a per-expert cell's ids are ints)
                kept[cell] = names
            else:
                kept[cell] = {expert: name for expert, name in names.items() if expert < count}
                why.update((name, _expert_problem(expert, count)) for expert, name in names.items() if expert >= count)
        return kept, [(name, why[name]) for name in layer.names if name in why] if why else []


class _Memo(dict):
    """`fn(key)` for each key, worked out at its first lookup and kept (a later lookup is one dict lookup)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, key: Any) -> Any:
        value = self[key] = self.fn(key)
        return value


def expert_key_problem(moe: MoEConfig, key: ExpertTensorKey) -> str | None:
    """Why routed-expert tensor `key` feeds no fused slot under `moe` (None when it does): the one rule
    shared by the planner, the engine hook and the name mapping."""
    return _key_problem(key, _kind_problem(moe, key.suffix, key.source, key.expert is None),
                        moe.layer(key.layer).num_experts)


def _kind_problem(moe: MoEConfig, suffix: str, source: Source, stacked: bool) -> str | None:
    """The part of the rule that depends on the kind of tensor only (suffix, source, stacked or not)."""
    if moe.quant.layout_for_suffix(suffix) is None:
        return f"suffix {suffix!r} is not a {moe.quant.format_name} expert tensor"
    if not moe.gated and Proj.GATE in source.projs:
        return f"a {source.value} tensor, but {moe.family} experts are not gated (up and down projections only)"
    if stacked and source not in STACKED_SOURCES:
        return f"a stacked {source.value} tensor; only gate_up_proj and down_proj stack"
    return None


def _key_problem(key: ExpertTensorKey, kind_problem: str | None, count: int) -> str | None:
    """The rule, given its kind part and the layer's expert `count` (which spec a module has is the layer's:
    `specs.checked_layer_spec`)."""
    if kind_problem is not None:
        return kind_problem
    return _expert_problem(key.expert, count) if key.expert is not None and key.expert >= count else None


def _expert_problem(expert: int, count: int) -> str:
    """Why a tensor of expert `expert` of a layer of `count` experts feeds no slot."""
    return f"expert id {expert} >= expert count {count}"
