"""Which decoder layers hold routed experts: every MoE-layer rule of the model families, as data.

A rule applies wherever one of its keys is present in the decoder config. Explicit
per-layer lists come first, then the derived rules; the first present rule names
the layers, and every other present rule must give the same layers (else a
ConfigError naming both). With no rule present, every layer is a MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError

Config = dict[str, Any]


@dataclass(frozen=True)
class LayerRule:
    """One way a config says which layers are MoE layers.

    `select(config, count)` returns the MoE layer indices (ascending) of a decoder
    with `count` layers; it is called only when one of `keys` is present.
    """

    name: str
    keys: tuple[str, ...]
    explicit: bool
    select: Callable[[Config, int], tuple[int, ...]]
    doc: str

    def present(self, config: Config) -> bool:
        """Whether the config sets any key of this rule (null counts as absent)."""
        return any(config.get(key) is not None for key in self.keys)

    def describe(self, config: Config) -> str:
        """The rule's present keys and values, e.g. `first_k_dense_replace=3`."""
        return ", ".join(f"{key}={_short(config[key])}" for key in self.keys if config.get(key) is not None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(value)} entries)"


def _int(config: Config, key: str, default: int, minimum: int = 0) -> int:
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.json: {key}={value!r} must be an integer >= {minimum}.")
    return value


def _per_layer(config: Config, key: str, count: int, moe: frozenset, other: frozenset) -> tuple[int, ...]:
    """Layers whose entry of the per-layer sequence `key` is one of `moe` (every entry must be known)."""
    entries = config[key]
    if not isinstance(entries, (list, str)) or len(entries) != count:
        size = len(entries) if isinstance(entries, (list, str)) else type(entries).__name__
        raise ConfigError(f"config.json: {key} must list one entry per decoder layer ({count}), found {size}.")
    for layer, entry in enumerate(entries):
        if entry not in moe | other:
            raise ConfigError(f"config.json: {key}[{layer}]={entry!r} is not a known layer type; MoE: "
                              f"{sorted(moe)}, other: {sorted(other)}. Add it to wna16_loader/layer_rules.py.")
    return tuple(layer for layer, entry in enumerate(entries) if entry in moe)


def _listed(config: Config, count: int) -> tuple[int, ...]:
    layers = config["moe_layers"]
    if not isinstance(layers, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers):
        raise ConfigError(f"config.json: moe_layers={_short(layers)} must be a list of layer indices.")
    outside = [v for v in layers if not 0 <= v < count]
    if outside:
        raise ConfigError(f"config.json: moe_layers names layers {outside} outside 0..{count - 1}.")
    return tuple(sorted(set(layers)))


def _first_k_dense(config: Config, count: int) -> tuple[int, ...]:
    """DeepSeek / GLM / dots: layer L is MoE iff L >= first_k_dense_replace and L % moe_layer_freq == 0."""
    first, freq = _int(config, "first_k_dense_replace", 0), _int(config, "moe_layer_freq", 1, 1)
    return tuple(layer for layer in range(first, count) if layer % freq == 0)


def _num_dense(config: Config, count: int) -> tuple[int, ...]:
    return tuple(range(_int(config, "num_dense_layers", 0), count))


def _sparse_step(config: Config, count: int) -> tuple[int, ...]:
    """Qwen MoE: L is MoE iff L is not in mlp_only_layers and (L + 1) % decoder_sparse_step == 0."""
    step = _int(config, "decoder_sparse_step", 1, 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(v, int) for v in dense):
        raise ConfigError(f"config.json: mlp_only_layers={dense!r} must be a list of layer indices.")
    return tuple(layer for layer in range(count) if layer not in dense and (layer + 1) % step == 0)


def _interleave(config: Config, count: int) -> tuple[int, ...]:
    step = _int(config, "interleave_moe_layer_step", 1, 1)
    return tuple(range(step - 1, count, step))


def _period(config: Config, count: int) -> tuple[int, ...]:
    """Jamba: L is MoE iff L % expert_layer_period == expert_layer_offset."""
    period, offset = _int(config, "expert_layer_period", 1, 1), _int(config, "expert_layer_offset", 0)
    return tuple(layer for layer in range(count) if layer % period == offset)


def _index_range(config: Config, count: int) -> tuple[int, ...]:
    """ERNIE 4.5: (L + 1) % moe_layer_interval == 0 and start_index <= L <= end_index (end < 0: the last)."""
    start, interval = _int(config, "moe_layer_start_index", 0), _int(config, "moe_layer_interval", 1, 1)
    end = config.get("moe_layer_end_index")
    end = count - 1 if end is None or (isinstance(end, int) and end < 0) else _int(config, "moe_layer_end_index", 0)
    return tuple(layer for layer in range(count) if start <= layer <= end and (layer + 1) % interval == 0)


def _hash_layers(config: Config, count: int) -> tuple[int, ...]:
    """DeepSeek-V4: the first num_hash_layers layers route by a token-id table, the rest by top-k; all are MoE."""
    hashed = _int(config, "num_hash_layers", 0)
    if hashed > count:
        raise ConfigError(f"config.json: num_hash_layers={hashed} is more than the decoder's {count} layers.")
    return tuple(range(count))


def _flag(config: Config, count: int) -> tuple[int, ...]:
    value = config["enable_moe_block"]
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: enable_moe_block={value!r} must be true or false.")
    return tuple(range(count)) if value else ()


MLP_TYPES = (frozenset({"sparse", "moe", "hash_moe"}), frozenset({"dense"}))
BLOCK_TYPES = (frozenset({"moe"}), frozenset({"mamba", "attention", "mlp", "linear_attention", "full_attention"}))
PATTERN_CHARS = (frozenset({"E"}), frozenset({"M", "*", "-"}))

RULES: tuple[LayerRule, ...] = (
    LayerRule("mlp_layer_types", ("mlp_layer_types",), True,
              lambda c, n: _per_layer(c, "mlp_layer_types", n, *MLP_TYPES), '"sparse" / "moe" / "hash_moe" entries'),
    LayerRule("layers_block_type", ("layers_block_type",), True,
              lambda c, n: _per_layer(c, "layers_block_type", n, *BLOCK_TYPES), '"moe" entries'),
    LayerRule("hybrid_override_pattern", ("hybrid_override_pattern",), True,
              lambda c, n: _per_layer(c, "hybrid_override_pattern", n, *PATTERN_CHARS), '"E" characters'),
    LayerRule("moe_layers", ("moe_layers",), True, _listed, "the listed indices"),
    LayerRule("first_k_dense_replace", ("first_k_dense_replace", "moe_layer_freq"), False, _first_k_dense,
              "L >= first_k_dense_replace and L % moe_layer_freq == 0"),
    LayerRule("num_dense_layers", ("num_dense_layers",), False, _num_dense, "L >= num_dense_layers"),
    LayerRule("decoder_sparse_step", ("decoder_sparse_step", "mlp_only_layers"), False, _sparse_step,
              "L not in mlp_only_layers and (L + 1) % decoder_sparse_step == 0"),
    LayerRule("interleave_moe_layer_step", ("interleave_moe_layer_step",), False, _interleave,
              "(L + 1) % interleave_moe_layer_step == 0"),
    LayerRule("expert_layer_period", ("expert_layer_period", "expert_layer_offset"), False, _period,
              "L % expert_layer_period == expert_layer_offset"),
    LayerRule("moe_layer_start_index", ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"),
              False, _index_range, "start <= L <= end and (L + 1) % moe_layer_interval == 0"),
    LayerRule("enable_moe_block", ("enable_moe_block",), False, _flag, "every layer when true, none when false"),
    LayerRule("num_hash_layers", ("num_hash_layers",), False, _hash_layers,
              "every layer: the first num_hash_layers hash-routed, the rest top-k routed"),
)
RULES_BY_NAME = {rule.name: rule for rule in RULES}
EXPLICIT_KEYS = tuple(rule.keys[0] for rule in RULES if rule.explicit and rule.name != "moe_layers")


def layer_count_from_lists(config: Config) -> tuple[int, str] | None:
    """(count, key) from the first per-layer sequence present, for configs without a layer count."""
    for key in EXPLICIT_KEYS:
        value = config.get(key)
        if isinstance(value, (list, str)):
            return len(value), key
    return None


def select_moe_layers(config: Config, count: int) -> tuple[tuple[int, ...], LayerRule | None]:
    """(MoE layers, the rule that named them or None for every layer); present rules must agree."""
    present = [rule for rule in RULES if rule.present(config)]
    if not present:
        return tuple(range(count)), None
    first = present[0]
    layers = first.select(config, count)
    for other in present[1:]:
        theirs = other.select(config, count)
        if theirs != layers:
            raise ConfigError(f"config.json: {first.describe(config)} makes layers {compact(layers)} MoE layers, "
                              f"but {other.describe(config)} gives {compact(theirs)} ({count} layers); the two "
                              f"keys disagree. Fix or remove one of them.")
    return layers, first


def compact(layers: tuple[int, ...]) -> str:
    """Layer indices as ranges, e.g. `[0-2, 5, 7-9]`."""
    parts: list[str] = []
    start = prev = None
    for layer in (*layers, None):
        if start is not None and layer == prev + 1:
            prev = layer
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = layer
    return "[" + ", ".join(parts) + "]"
