"""One resolver for the model config keys of every MoE family.

Families differ only in key names and MoE-layer rules, so both are data: alias
tuples tried in order, and layer rules that apply wherever their key is present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .formats import QuantSpec, accepted_formats, resolve_quant_spec

EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k", "moe_k")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
HIDDEN_KEYS = ("hidden_size", "d_model")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers", "num_layers")
NESTED_KEYS = ("text_config", "llm_config", "language_config")
QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}  # file: implied quant_method


@dataclass(frozen=True)
class MoEConfig:
    """The resolved description of a checkpoint's routed experts."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    moe_layers: tuple[int, ...]
    quant: QuantSpec
    model_type: str | None = None
    experts_prefixes: tuple[str, ...] = ()  # filled by read_moe_config from the checkpoint


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: nested `text_config` (Gemma 4, multimodal wrappers) or the top level."""
    for key in NESTED_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and any(k in nested for k in EXPERT_COUNT_KEYS + HIDDEN_KEYS):
            return nested
    return config


def first_key(config: dict[str, Any], keys: tuple[str, ...], what: str) -> int:
    """The value of the first alias present, as a positive int (error naming every key tried)."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config.json: {key}={value!r} ({what}) must be a positive integer.")
        return value
    raise ConfigError(f"config.json: no key gives the {what}; tried {list(keys)}. Add one of them to "
                      f"config.json (model_type={config.get('model_type')!r}).")


def _int_list(config: dict[str, Any], key: str) -> tuple[int, ...]:
    value = config.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ConfigError(f"config.json: {key}={value!r} must be a list of layer indices.")
    return tuple(value)


def is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """Whether decoder `layer` has routed experts; every rule whose key is present must agree."""
    first_dense = config.get("first_k_dense_replace")
    if isinstance(first_dense, int) and layer < first_dense:
        return False
    freq = config.get("moe_layer_freq")
    if isinstance(freq, int) and freq > 1 and layer % freq:
        return False
    step = config.get("decoder_sparse_step")
    if isinstance(step, int) and step > 1 and (layer + 1) % step:
        return False
    if layer in _int_list(config, "mlp_only_layers"):
        return False
    if not _in_moe_range(config, layer):
        return False
    enabled = config.get("enable_moe_block", config.get("use_second_mlp_block"))
    return enabled is not False


def _in_moe_range(config: dict[str, Any], layer: int) -> bool:
    """ERNIE 4.5: MoE layers from moe_layer_start_index to moe_layer_end_index, every moe_layer_interval."""
    start, end = config.get("moe_layer_start_index"), config.get("moe_layer_end_index")
    interval = config.get("moe_layer_interval")
    if isinstance(start, int) and layer < start:
        return False
    if isinstance(end, int) and end >= 0 and layer > end:
        return False
    return not (isinstance(interval, int) and interval > 1 and (layer + 1) % interval)


def resolve_moe_config(config: dict[str, Any], qconfig: dict[str, Any] | None = None) -> MoEConfig:
    """Resolve a parsed config.json (and optionally a separate quantization config)."""
    text = text_config(config)
    qconfig = qconfig or text.get("quantization_config") or config.get("quantization_config")
    if qconfig is None:
        raise ConfigError("config.json has no quantization_config, and no quantize_config.json or "
                          "quant_config.json was found; this is not a WNA16-quantized checkpoint.")
    num_experts = first_key(text, EXPERT_COUNT_KEYS, "routed expert count")
    top_k = first_key(text, TOP_K_KEYS, "experts per token (top-k)")
    if top_k > num_experts:
        raise ConfigError(f"config.json: top-k = {top_k} is larger than the expert count {num_experts}.")
    num_layers = first_key(text, LAYER_COUNT_KEYS, "decoder layer count")
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=first_key(text, HIDDEN_KEYS, "hidden size"),
        intermediate_size=first_key(text, INTERMEDIATE_KEYS, "expert intermediate size"),
        num_layers=num_layers,
        moe_layers=tuple(layer for layer in range(num_layers) if is_moe_layer(text, layer)),
        quant=resolve_quant_spec(qconfig),
        model_type=text.get("model_type") or config.get("model_type"),
    )


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
    config = load_json(folder / "config.json")
    qconfig = None
    if "quantization_config" not in text_config(config) and "quantization_config" not in config:
        for name, method in QUANT_FILES.items():
            if (folder / name).is_file():
                qconfig = {"quant_method": method, **load_json(folder / name)}
                break
        else:
            raise ConfigError(f"{folder}: config.json has no quantization_config, and the folder has no "
                              f"{' or '.join(QUANT_FILES)}; this is not a WNA16-quantized checkpoint. Accepted "
                              f"formats: {accepted_formats()}.")
    return resolve_moe_config(config, qconfig)
