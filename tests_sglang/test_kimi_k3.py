"""Kimi K3's row against SGLang 0.5.23's own reading of its published config (srt/configs/kimi_k3.py, the config
class SGLang defines; srt/models/kimi_k3.py, the model): the expert count, top-k, expert I and expert input size
its KimiK3MoE builds FusedMoE with, its MoE layers (`_is_moe_layer`) and the name its `hf_to_sglang_mapper` gives
the published experts prefix. SGLang cannot build the model itself on a CPU (KimiK3LinearModel.__init__ creates
torch.cuda.Stream objects, kimi_k3.py:2761), so no whole-model load is compared here."""

from __future__ import annotations

import json
from pathlib import Path

import workarounds

workarounds.apply()  # before SGLang is imported in this process

from sglang.srt.configs.kimi_k3 import KimiK3Config  # noqa: E402
from sglang.srt.models import kimi_k3  # noqa: E402

from wna16_loader.models.config import resolve_moe_config  # noqa: E402
from wna16_loader.models.families import family_of  # noqa: E402
from wna16_loader.models.names import experts_prefix_for  # noqa: E402
from wna16_loader.testing.synthetic import quant_config  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "configs" / "kimi_k3.json"
QUANT = quant_config("gptq", bits=4, group_size=32, symmetric=True)  # a WNA16 requantization's own config


def published() -> dict:
    return json.loads(FIXTURE.read_text())


def wna16() -> dict:
    """The published config as a WNA16 requantization writes it (its own quantization_config, no MXFP4 one)."""
    config = published()
    config["text_config"].pop("quantization_config")
    return {**config, "quantization_config": QUANT}


def test_sglang_reads_the_values_the_row_reads():
    text = KimiK3Config(**published()).text_config
    moe = resolve_moe_config(wna16())
    experts_input = text.routed_expert_hidden_size if kimi_k3._uses_latent_moe(text) else text.hidden_size
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.hidden_size, moe.activation) == \
        (text.num_experts, text.num_experts_per_token, text.moe_intermediate_size, experts_input, text.hidden_act)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.hidden_size) == (896, 16, 3072, 3584)


def test_sglangs_moe_layers_are_the_rows():
    text = KimiK3Config(**published()).text_config
    moe = resolve_moe_config(wna16())
    assert moe.moe_layers == tuple(n for n in range(text.num_hidden_layers) if kimi_k3._is_moe_layer(text, n))


def test_sglang_names_the_published_experts_prefix_its_mlp_experts():
    """The published `...block_sparse_moe.experts` is the layer SGLang builds as `...mlp.experts`."""
    row = family_of("kimi_k3")
    prefix = experts_prefix_for(row.roots[0], 1, row.modules[0], row.experts[0])
    mapper = kimi_k3.KimiK3ForConditionalGeneration.hf_to_sglang_mapper
    assert prefix == "language_model.model.layers.1.block_sparse_moe.experts"
    assert mapper.apply_list([prefix]) == ["language_model.model.layers.1.mlp.experts"]
