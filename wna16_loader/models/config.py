"""One resolver for the model config keys of every MoE family.

Families differ only in key names, where the decoder config lives, MoE-layer rules
and tensor names; all of it is data in families.py and layer_rules.py. The
resolver is one function over that table, and records for every value the key or
rule it came from (`MoEConfig.resolution`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..formats import ModuleRules, QuantSpec, accepted_formats, format_of, resolve_module_rules, resolve_quant_spec
from .families import GENERIC, Family, Refusal, family_of, lookup
from .layer_rules import compact, layer_count_from_lists, select_moe_layers
from .layer_specs import LayerSpec, expert_modules, resolve_layer_spec
from .mtp import MTPLayers, resolve_mtp
from .names import layer_of_prefix

EXPERT_COUNT_KEYS = GENERIC.keys.experts
TOP_K_KEYS = GENERIC.keys.top_k
INTERMEDIATE_KEYS = GENERIC.keys.intermediate
HIDDEN_KEYS = GENERIC.keys.hidden
LAYER_COUNT_KEYS = GENERIC.keys.layers
NESTED_KEYS = GENERIC.nested
QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}  # file: implied quant_method
TABLE = "wna16_loader/models/families.py"
MOE_LAYERS = "MoE layers"
MTP_LAYERS = "MTP layers"


@dataclass(frozen=True)
class Resolved:
    """How one value was found: `key` is the config key read (None for a derived value)."""

    what: str
    value: Any
    source: str
    key: str | None = None


@dataclass(frozen=True)
class Resolution:
    """The record of a resolution: the table row used, where the decoder config was, and every value."""

    family: str
    decoder: str
    values: tuple[Resolved, ...]

    def __getitem__(self, what: str) -> Resolved:
        return next(v for v in self.values if v.what == what)

    def describe(self) -> str:
        """One line per value: `what = value  <- source`."""
        lines = [f"family row: {self.family} ({TABLE}); decoder config: {self.decoder}"]
        width = max(len(v.what) for v in self.values)
        lines += [f"  {v.what:<{width}} = {compact(v.value) if v.what == MOE_LAYERS else v.value}  <- {v.source}"
                  for v in self.values]
        return "\n".join(lines)


@dataclass(frozen=True)
class LayerValues:
    """The values of one MoE layer (per-layer config lists give each layer its own)."""

    num_experts: int
    top_k: int
    intermediate_size: int


@dataclass(frozen=True)
class MoEConfig:
    """The resolved description of a checkpoint's routed experts.

    `num_experts`, `top_k` and `intermediate_size` are those of the first MoE layer;
    `layer(L)` gives each layer's own when the config lists them per layer.
    `zero_experts`: routed-to identity experts without tensors (not placed on ranks).
    `mtp`: the MTP layers the config declares (their experts take the first MoE layer's values);
    `mtp_prefixes`: the experts prefixes of the checkpoint's MTP layers (filled by read_moe_config).
    `shared_experts`: how many shared experts each MoE layer's shared-expert module holds (the row's
    `SharedExperts` count key; 0 where the row declares none, or the config counts none).
    `quant` is the top-level quantization spec; `spec_of(prefix)` each layer's own (from the format's
    per-module `rules`, or from `layer_specs`, recorded by `read_moe_config` with the tensors checked).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    moe_layers: tuple[int, ...]
    quant: QuantSpec
    model_type: str | None = None
    experts_prefixes: tuple[str, ...] = ()  # filled by read_moe_config from the checkpoint
    per_layer: tuple[tuple[int, LayerValues], ...] = ()
    zero_experts: int = 0
    gated: bool = True
    activation: str | None = None
    family: str = GENERIC.name
    resolution: Resolution | None = field(default=None, compare=False)
    mtp: MTPLayers = MTPLayers()
    mtp_prefixes: tuple[str, ...] = ()
    shared_experts: int = 0
    rules: ModuleRules | None = field(default=None, compare=False, repr=False)
    layer_specs: tuple[tuple[str, LayerSpec], ...] = field(default=(), compare=False, repr=False)

    def spec_of(self, prefix: str) -> LayerSpec:
        """The quantization spec of the MoE layer at experts prefix `prefix` (and the rule it came from)."""
        for recorded, spec in self.layer_specs:
            if recorded == prefix:
                return spec
        if self.rules is None:
            return LayerSpec(self.quant, "the top-level quantization_config")
        layer = layer_of_prefix(prefix)
        count = self.layer(layer).num_experts if layer is not None else self.num_experts
        return resolve_layer_spec(self.rules, prefix, expert_modules(prefix, count, family_of(self.family),
                                                                     self.gated))

    def at_layer(self, prefix: str) -> "MoEConfig":
        """This config as the layer at `prefix` sees it: `quant` is that layer's spec."""
        spec = self.spec_of(prefix).spec
        return self if spec == self.quant else replace(self, quant=spec)

    def layer(self, layer: int) -> LayerValues:
        """The values of MoE layer `layer`."""
        for index, values in self.per_layer:
            if index == layer:
                return values
        return LayerValues(self.num_experts, self.top_k, self.intermediate_size)


def decoder_config(config: dict[str, Any], family: Family) -> tuple[dict[str, Any], str]:
    """(the decoder's config, where it was): the first of the row's nested keys (then the generic ones, for a
    wrapper found through its decoder's model_type) holding a decoder, else the top level. A nested dict counts
    when it has a key of the row's expert-count or hidden-size aliases."""
    for key in dict.fromkeys(family.nested + GENERIC.nested):
        nested = lookup(config, key)
        if isinstance(nested, dict) and any(lookup(nested, k) is not None
                                            for k in family.keys.experts + family.keys.hidden):
            return nested, key
    return config, "top level"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config under the row of `config`'s model_type (the generic row's nesting otherwise)."""
    return decoder_config(config, _row(config))[0]


def embedded_qconfig(config: dict[str, Any], text: dict[str, Any]) -> dict[str, Any] | None:
    """The quantization_config that config.json itself holds: the decoder's (`text`, see `text_config`), else the
    top level's; None when neither holds one."""
    return text.get("quantization_config") or config.get("quantization_config")


def _row(config: dict[str, Any]) -> Family:
    nested = [config[k].get("model_type") for k in GENERIC.nested if isinstance(config.get(k), dict)]
    return family_of(config.get("model_type"), *nested)


def _missing(what: str, keys: tuple[str, ...], family: Family, model_type: Any) -> ConfigError:
    return ConfigError(f"config.json: no key gives the {what}; tried {list(keys)}. Add one of them to "
                       f"config.json (model_type={model_type!r}), or add the key to the {family.name!r} row of "
                       f"the families table ({TABLE}).")


def _refused(text: dict[str, Any], family: Family, refusal: Refusal) -> ConfigError:
    """The error for a family whose experts the fused layout cannot hold, naming the type and the keys."""
    shown = ", ".join(f"{k}={lookup(text, k)!r}" for k in refusal.keys if lookup(text, k) is not None)
    return ConfigError(f"config.json: model_type {text.get('model_type')!r} (row {family.name!r} of the families "
                       f"table, {TABLE}) is refused: {refusal.why} (config.json: {shown or 'no such key'}). Load "
                       f"this model with its engine's own loader.")


def _positive(key: str, value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json: {key}={value!r} ({what}) must be a positive integer.")
    return value


def first_key(config: dict[str, Any], keys: tuple[str, ...], what: str,
              family: Family = GENERIC) -> tuple[int, str]:
    """(value, key) of the first alias present, as a positive int (error naming every key tried)."""
    for key in keys:
        if lookup(config, key) is not None:
            return _positive(key, lookup(config, key), what), key
    raise _missing(what, keys, family, config.get("model_type"))


def per_layer_key(config: dict[str, Any], keys: tuple[str, ...], what: str, family: Family,
                  num_layers: int) -> tuple[tuple[int, ...], str]:
    """(one value per decoder layer, key): an int applies to every layer; a list gives each layer's."""
    for key in keys:
        value = lookup(config, key)
        if value is None:
            continue
        if isinstance(value, list) and key in family.keys.per_modality:
            value = value[0]  # the text decoder's entry
        if not isinstance(value, list):
            return (_positive(key, value, what),) * num_layers, key
        if len(value) not in (1, num_layers):
            raise ConfigError(f"config.json: {key} lists {len(value)} values ({what}) but the decoder has "
                              f"{num_layers} layers (row {family.name!r}, model_type "
                              f"{config.get('model_type')!r}); a per-layer list needs one value per layer, or "
                              f"one for every layer. Fix the list, or declare what {key} lists in the "
                              f"{family.name!r} row of the families table ({TABLE}).")
        values = tuple(_positive(f"{key}[{i}]", v, what) for i, v in enumerate(value))
        return (values if len(values) == num_layers else values * num_layers), key
    raise _missing(what, keys, family, config.get("model_type"))


def _layer_count(text: dict[str, Any], family: Family) -> Resolved:
    """The decoder layer count: a count key, else the length of a per-layer list; both must agree."""
    listed = layer_count_from_lists(text)
    for key in family.keys.layers:
        if lookup(text, key) is not None:
            count = _positive(key, lookup(text, key), "decoder layer count")
            if listed and listed[0] != count:
                raise ConfigError(f"config.json: {key}={count} but {listed[1]} lists {listed[0]} layers; the two "
                                  f"keys disagree. Fix or remove one of them.")
            return Resolved("decoder layer count", count, f"{key} (row {family.name})", key)
    if listed:
        return Resolved("decoder layer count", listed[0], f"length of {listed[1]} (no layer-count key)")
    raise _missing("decoder layer count", family.keys.layers, family, text.get("model_type"))


def _moe_layers(text: dict[str, Any], count: int) -> Resolved:
    layers, rule = select_moe_layers(text, count)
    source = "every layer (no MoE-layer key present)" if rule is None else \
        f"rule {rule.name}: {rule.describe(text)} ({rule.doc})"
    return Resolved(MOE_LAYERS, layers, source)


def _per_moe_layer(values: tuple[int, ...], key: str, what: str, family: Family,
                   moe_layers: tuple[int, ...]) -> Resolved:
    mine = tuple(values[layer] for layer in moe_layers)
    uniform = len(set(mine)) <= 1
    shown = (mine[0] if mine else values[0]) if uniform else mine
    kind = ", the text entry of a per-modality list" if key in family.keys.per_modality else \
        "" if len(set(values)) <= 1 else ", one value per layer"
    return Resolved(what, shown, f"{key} (row {family.name}{kind})", key)


def resolve_moe_config(config: dict[str, Any], qconfig: dict[str, Any] | None = None) -> MoEConfig:
    """Resolve a parsed config.json (and optionally a separate quantization config)."""
    family = _row(config)
    text, where = decoder_config(config, family)
    if family.refusal is not None:
        raise _refused(text, family, family.refusal)
    qconfig = qconfig or embedded_qconfig(config, text)
    if qconfig is None:
        raise ConfigError("config.json has no quantization_config, and no quantize_config.json or "
                          "quant_config.json was found; this is not a WNA16-quantized checkpoint.")
    count = _layer_count(text, family)
    moe_layers = _moe_layers(text, count.value)
    lists = {what: per_layer_key(text, keys, what, family, count.value) for what, keys in (
        ("routed expert count", family.keys.experts), ("experts per token (top-k)", family.keys.top_k),
        ("expert intermediate size", family.keys.intermediate))}
    hidden, hidden_key = first_key(text, family.keys.hidden, "hidden size", family)
    zero = _zero_experts(text, family)
    values = _layer_values(lists, moe_layers.value, zero.value)
    mtp, kind, shared = resolve_mtp(text, family, count.value), _kind(text, family), _shared_experts(text, family)
    record = (Resolved("hidden size", hidden, f"{hidden_key} (row {family.name})", hidden_key), count, moe_layers,
              *(_per_moe_layer(v, k, what, family, moe_layers.value) for what, (v, k) in lists.items()), zero,
              *kind, Resolved(MTP_LAYERS, mtp.describe(), mtp.source), shared)
    first = values[0][1] if values else LayerValues(*(v[0] for v, _ in lists.values()))
    return MoEConfig(
        num_experts=first.num_experts, top_k=first.top_k, hidden_size=hidden,
        intermediate_size=first.intermediate_size, num_layers=count.value, moe_layers=moe_layers.value,
        quant=resolve_quant_spec(qconfig), rules=resolve_module_rules(qconfig), model_type=text.get("model_type") or config.get("model_type"),
        per_layer=values if len(set(v for _, v in values)) > 1 else (), zero_experts=zero.value,
        gated=family.gated, activation=kind[1].value, family=family.name,
        resolution=Resolution(family.name, where, record), mtp=mtp, shared_experts=shared.value)


def _layer_values(lists: dict[str, tuple[tuple[int, ...], str]], moe_layers: tuple[int, ...],
                  zero: int) -> tuple[tuple[int, LayerValues], ...]:
    experts, top_k, inter = (v for v, _ in lists.values())
    out = []
    for layer in moe_layers:
        if top_k[layer] > experts[layer] + zero:
            raise ConfigError(f"config.json: top-k = {top_k[layer]} is larger than the expert count "
                              f"{experts[layer] + zero} (layer {layer}).")
        out.append((layer, LayerValues(experts[layer], top_k[layer], inter[layer])))
    return tuple(out)


def _zero_experts(text: dict[str, Any], family: Family) -> Resolved:
    for key in family.keys.zero_experts:
        if lookup(text, key) is not None:
            value = lookup(text, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"config.json: {key}={value!r} (zero experts) must be an integer >= 0.")
            return Resolved("zero (identity) experts", value, f"{key} (row {family.name})", key)
    return Resolved("zero (identity) experts", 0, f"none (row {family.name} names no zero-expert key)")


def _shared_experts(text: dict[str, Any], family: Family) -> Resolved:
    """The shared experts of each MoE layer: the row's `SharedExperts` count key (0 when absent or null)."""
    what = "shared experts"
    if family.shared is None:
        return Resolved(what, 0, f"none (row {family.name} declares no shared experts)")
    for key in family.shared.count:
        if text.get(key) is not None:
            module = f"{family.modules[0]}.{family.shared.module}" if family.modules[0] else family.shared.module
            value = _positive(key, text[key], what) if text[key] else 0
            return Resolved(what, value, f"{key} (row {family.name}; module {module})", key)
    return Resolved(what, 0, f"not given (tried {list(family.shared.count)})")


def _kind(text: dict[str, Any], family: Family) -> tuple[Resolved, ...]:
    """(gated, activation[, activation clamp]) records: gating from the row, activation and clamp from its keys."""
    gated = Resolved("gated", family.gated, f"row {family.name} (projections {[p for p, _ in family.projections]})")
    limit = [Resolved("activation clamp", lookup(text, key), f"{key} (row {family.name}; the engine applies it)", key)
             for key in family.keys.activation_limit if lookup(text, key) is not None][:1]
    for key in family.keys.activation:
        if isinstance(lookup(text, key), str):
            return gated, Resolved("activation", lookup(text, key), f"{key} (row {family.name})", key), *limit
    return gated, Resolved("activation", None, f"not given (tried {list(family.keys.activation)})"), *limit


def load_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, with errors that name the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found; a checkpoint folder needs a config.json.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}.")
    return data


def read_config_files(folder: str | Path) -> MoEConfig:
    """Resolve `folder`/config.json, falling back to quantize_config.json / quant_config.json."""
    folder = Path(folder)
    check_config_present(folder)
    config = load_json(folder / "config.json")
    found, where, qconfig = read_qconfig(folder, config)
    if found is not None:  # the format checked first, so that its errors name the file
        format_of(found, where=where)
    return resolve_moe_config(config, qconfig)


def read_qconfig(folder: Path, config: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str,
                                                                               dict[str, Any] | None]:
    """The quantization_config `folder` holds (config.json's, else quantize_config.json's or quant_config.json's
    with its implied quant_method), where it was found, and the file's one when it came from a file (None: from
    config.json); a ConfigError when there is none."""
    config = load_json(folder / "config.json") if config is None else config
    text, where = text_config(config), f"{folder / 'config.json'}: quantization_config"
    if "quantization_config" in text or "quantization_config" in config:
        return embedded_qconfig(config, text), where, None
    for name, method in QUANT_FILES.items():
        if (folder / name).is_file():
            qconfig = {"quant_method": method, **load_json(folder / name)}
            return qconfig, str(folder / name), qconfig
    raise ConfigError(f"{folder}: config.json has no quantization_config, and the folder has no "
                      f"{' or '.join(QUANT_FILES)}; this is not a WNA16-quantized checkpoint. Accepted "
                      f"formats: {accepted_formats()}.")


def check_config_present(folder: Path) -> None:
    """A folder without config.json: a ConfigError, with "did you mean FOLDER/NAME?" when exactly one of its
    sub-folders holds a config.json (the parent of the checkpoint folder was passed)."""
    if (folder / "config.json").is_file() or not folder.is_dir():
        return  # (not a folder: load_json names what is wrong)
    inside = sorted(sub for sub in folder.iterdir() if (sub / "config.json").is_file())
    hint = f" Did you mean {inside[0]}? (it holds a config.json)" if len(inside) == 1 else (
        f" Its sub-folders {[sub.name for sub in inside[:5]]} hold one: pass one of them." if inside else "")
    raise ConfigError(f"{folder / 'config.json'}: file not found; a checkpoint folder needs a config.json.{hint}")
