"""One spec per MoE layer (wna16_loader/models/layer_specs.py): every expert module resolved, disagreements and
non-WNA16 schemes named; a config-only layer resolved from the family's module names."""

from __future__ import annotations

import re

import pytest

from wna16_loader.errors import ConfigError
from wna16_loader.formats import resolve_module_rules
from wna16_loader.models.config import resolve_moe_config
from wna16_loader.models.families import family_of
from wna16_loader.models.layer_specs import expert_modules, resolve_layer_spec

P = "model.layers.1.mlp.experts"
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
MODULES = [f"{P}.{e}.{proj}" for e in range(2) for proj in ("gate_proj", "up_proj", "down_proj")]


def test_one_spec_and_its_rule() -> None:
    rules = resolve_module_rules({**GPTQ, "dynamic": {"+:.*layers\\.1\\..*": {"bits": 8}}})
    layer = resolve_layer_spec(rules, P, MODULES)
    assert layer.describe() == "gptq 8-bit g128 sym  <- dynamic rule '+:.*layers\\\\.1\\\\..*' {'bits': 8}"


def test_modules_of_one_layer_that_disagree_are_named() -> None:
    """Down at 8 bits, gate and up at 4: one fused layer cannot hold both (vLLM's kernels take one bit width)."""
    rules = resolve_module_rules({**GPTQ, "dynamic": {"+:.*down_proj": {"bits": 8}}})
    with pytest.raises(ConfigError, match=re.escape(
            f"{P}: the expert modules of this MoE layer resolve to 2 different quantization specs, but one fused "
            f"layer holds one spec:\n  - gptq 4-bit g128 sym (4 modules, by the top-level quantization_config): "
            f"{P}.0.gate_proj, {P}.0.up_proj, {P}.1.gate_proj, {P}.1.up_proj\n  - gptq 8-bit g128 sym (2 modules, "
            f"by dynamic rule '+:.*down_proj' {{'bits': 8}}): {P}.0.down_proj, {P}.1.down_proj\nFix the config's "
            f"rules so that every expert and projection of the layer gets the same spec")):
        resolve_layer_spec(rules, P, MODULES)


def test_an_expert_covered_by_a_non_wna16_scheme_is_refused() -> None:
    rules = resolve_module_rules({**GPTQ, "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq",
                                  "extra_config": {f"{P}.1.down_proj": {"bits": 8, "data_type": "fp"}}})
    with pytest.raises(ConfigError, match=re.escape(
            f"{P}: routed expert {P}.1.down_proj is covered by extra_config['{P}.1.down_proj'] = {{'bits': 8, "
            f"'data_type': 'fp'}}: data_type='fp' at 8 bits is a float format, not WNA16 integer weights. 1 of the "
            f"layer's 6 expert modules are, so its experts are not WNA16")):
        resolve_layer_spec(rules, P, MODULES)


def test_expert_modules_follow_the_family_naming() -> None:
    assert expert_modules(P, 2, family_of("qwen3_moe"), True) == MODULES
    assert expert_modules("model.layers.0.block_sparse_moe.experts", 1, family_of("mixtral"), True) == [
        f"model.layers.0.block_sparse_moe.experts.0.{p}" for p in ("w1", "w3", "w2")]
    assert expert_modules("backbone.layers.1.mixer.experts", 1, family_of("nemotron_h"), False) == [
        "backbone.layers.1.mixer.experts.0.up_proj", "backbone.layers.1.mixer.experts.0.down_proj"]


def test_config_only_spec_of_each_layer() -> None:
    """Without the checkpoint (no recorded specs), `spec_of` resolves the layer's modules by the family's names."""
    moe = resolve_moe_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3, "num_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 64},
                             {**GPTQ, "dynamic": {"-:model\\.layers\\.2\\..*": {}}})
    assert moe.spec_of("model.layers.0.mlp.experts").spec == moe.quant
    assert not moe.spec_of("model.layers.2.mlp.experts").spec.quantized
    assert moe.at_layer("model.layers.2.mlp.experts").quant.bits == 16 and moe.at_layer(
        "model.layers.0.mlp.experts") is moe
