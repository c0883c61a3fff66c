"""Tiny checkpoints that tests in several folders build: the pre-sharding source and Nemotron-H."""

from __future__ import annotations

import json
from pathlib import Path

from wna16_loader.testing.synthetic import SyntheticCheckpoint, quant_config, write_checkpoint, write_family_checkpoint

FORMATS = {
    "gptq_actorder": dict(format_name="gptq", act_order=True),
    "awq": dict(format_name="awq"),
    "ct": dict(format_name="compressed-tensors"),
}


def make_source(folder: Path, fmt: str = "gptq_actorder", *, seed: int = 0, files: int = 2) -> Path:
    """A 2-layer, 4-expert checkpoint (hidden 64, intermediate 128) in `fmt`."""
    kwargs = dict(FORMATS[fmt])
    write_checkpoint(folder, quant_config(kwargs.pop("format_name"), **kwargs), hidden=64, intermediate=128,
                     num_layers=2, files=files, seed=seed)
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    return folder


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """relative path -> content of every file below `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def nemotron_checkpoint(folder: Path) -> SyntheticCheckpoint:
    """Nemotron-3-Nano's published config.json at test sizes: pattern "MEM*E" (MoE layers 1 and 4), 4 experts
    of up_proj / down_proj only (relu2), H = I = 64."""
    config = json.loads((Path(__file__).parent / "fixtures/configs/nemotron_h-nano-30b-a3b.json").read_text())
    config.update(hybrid_override_pattern="MEM*E", num_hidden_layers=5, hidden_size=64, moe_intermediate_size=64,
                  n_routed_experts=4, num_experts_per_tok=2)
    return write_family_checkpoint(folder, config, quant_config("gptq", bits=4, group_size=32, symmetric=False))


# real configs with MTP layers at test sizes (H = I = 64, 4 experts, top-2): decoder keys changed, the rest as
# published / written by transformers; name -> (decoder config key or None for the top level, changes)
MTP_CONFIGS: dict[str, tuple[str | None, dict]] = {
    # MoE layers 1, 2; the MTP layer appended as model.layers.3 (num_nextn_predict_layers: 1)
    "deepseek_v3": (None, dict(num_hidden_layers=3, first_k_dense_replace=1)),
    # MoE layers 1, 2; MTP layer model.layers.3 (num_nextn_predict_layers: 1, as zai-org/GLM-4.7-Flash)
    "glm4_moe_lite-flash": (None, dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"])),
    # MoE layers 0, 1 under model.language_model; the MTP layer is mtp.layers.0 (text_config.mtp_num_hidden_layers)
    "qwen3_5_moe-mtp": ("text_config", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])),
    # MoE layers 0, 1; mtp.layers.0 by the row's default count (the published config names none)
    "qwen3_next": (None, dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])),
}
SIZES = dict(hidden_size=64, moe_intermediate_size=64, num_experts_per_tok=2)


def mtp_config(name: str, **changes: object) -> dict:
    """The real config `name` of MTP_CONFIGS at test sizes (`changes`: more decoder keys, e.g. the MTP count)."""
    config = json.loads((Path(__file__).parent / f"fixtures/configs/{name}.json").read_text())
    where, updates = MTP_CONFIGS[name]
    decoder = config if where is None else config[where]
    experts_key = "n_routed_experts" if "n_routed_experts" in decoder else "num_experts"
    decoder.update(SIZES, **{experts_key: 4}, **updates, **changes)
    return config


def mtp_checkpoint(folder: Path, name: str, *, mtp: bool = True, mtp_dtype=None, fmt: str = "gptq_actorder",
                   **changes: object) -> SyntheticCheckpoint:
    """A checkpoint of `mtp_config(name)` in `fmt`, with its MTP layers' tensors (`mtp`), their experts
    quantized like the rest or 16-bit `.weight` of `mtp_dtype`."""
    kwargs = dict(FORMATS[fmt])
    quant = quant_config(kwargs.pop("format_name"), **kwargs)
    return write_family_checkpoint(folder, mtp_config(name, **changes), quant, mtp=mtp, mtp_dtype=mtp_dtype)
