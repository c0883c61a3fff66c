"""resolve_moe_config for every family's key spelling, MoE-layer rules, and config-file errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wna16_loader.errors import ConfigError, WNA16Error
from wna16_loader.formats import FORMATS
from wna16_loader.models.config import (
    EXPERT_COUNT_KEYS,
    MoEConfig,
    Resolved,
    load_json,
    read_config_files,
    resolve_moe_config,
    text_config,
)

GPTQ_Q = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ_Q = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _resolve(config: dict) -> MoEConfig:
    return resolve_moe_config({**config, "quantization_config": GPTQ_Q})


# ---------------------------------------------------------------- families


def test_mixtral() -> None:
    moe = _resolve({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (8, 2, 4096, 14336)
    assert moe.num_layers == 32
    assert moe.moe_layers == tuple(range(32))
    assert moe.model_type == "mixtral"
    assert moe.quant.format_name == "gptq"


def test_qwen2_moe_moe_intermediate_size_wins() -> None:
    moe = _resolve({"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                    "num_hidden_layers": 24, "num_experts": 60, "num_experts_per_tok": 4,
                    "decoder_sparse_step": 1, "mlp_only_layers": []})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (60, 4, 2048, 1408)
    assert moe.moe_layers == tuple(range(24))


def test_qwen3_moe() -> None:
    moe = _resolve({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_experts": 128,
                    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": []})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (128, 8, 2048, 768)
    assert moe.moe_layers == tuple(range(48))


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_qwen_decoder_sparse_step_and_mlp_only_layers(model_type: str) -> None:
    # HF: MoE iff layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
    moe = _resolve({"model_type": model_type, "hidden_size": 64, "intermediate_size": 256,
                    "moe_intermediate_size": 32, "num_hidden_layers": 8, "num_experts": 4,
                    "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert moe.moe_layers == (1, 5, 7)


def test_qwen_mlp_only_layers_alone() -> None:
    moe = _resolve({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32,
                    "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                    "mlp_only_layers": [0, 2]})
    assert moe.moe_layers == (1, 3)


@pytest.mark.parametrize("model_type,sizes,first_dense,layers,expected", [
    ("deepseek_v2", dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
                         n_shared_experts=2, num_experts_per_tok=6), 1, 60, (160, 6, 5120, 1536)),
    ("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                         n_shared_experts=1, num_experts_per_tok=8), 3, 61, (256, 8, 7168, 2048)),
])
def test_deepseek(model_type: str, sizes: dict, first_dense: int, layers: int, expected: tuple) -> None:
    moe = _resolve({"model_type": model_type, "num_hidden_layers": layers, "first_k_dense_replace": first_dense,
                    "moe_layer_freq": 1, **sizes})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == expected
    assert moe.moe_layers == tuple(range(first_dense, layers))


def test_deepseek_moe_layer_freq() -> None:
    # HF DeepSeek-V2: MoE iff layer >= first_k_dense_replace and layer % moe_layer_freq == 0
    moe = _resolve({"model_type": "deepseek_v2", "hidden_size": 64, "moe_intermediate_size": 32,
                    "num_hidden_layers": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert moe.moe_layers == (2, 4, 6)


def gemma4_26b_a4b_config(quant: dict | None = None) -> dict:
    """The shape of google/gemma-4-26B-A4B's config.json: the decoder under text_config."""
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 2816,
            "intermediate_size": 2112,  # the dense MLP that runs next to the experts
            "moe_intermediate_size": 704,
            "num_experts": 128,
            "top_k_experts": 8,
            "enable_moe_block": True,
            "num_hidden_layers": 30,
            "num_attention_heads": 16,
            "vocab_size": 262144,
        },
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 1152, "num_hidden_layers": 27},
        "quantization_config": quant or GPTQ_Q,
    }


def test_gemma4_26b_a4b_nested_text_config_regression() -> None:
    """Regression: Gemma 4 keeps the decoder under `text_config` and spells top-k `top_k_experts`; reading
    the top level (or intermediate_size) gives the wrong sizes or no experts at all."""
    moe = resolve_moe_config(gemma4_26b_a4b_config())
    assert moe.num_experts == 128
    assert moe.top_k == 8
    assert moe.hidden_size == 2816
    assert moe.intermediate_size == 704  # not the dense 2112
    assert moe.num_layers == 30
    assert moe.moe_layers == tuple(range(30))
    assert moe.model_type == "gemma4_text"
    assert moe.quant.format_name == "gptq"


def test_gemma4_quantization_config_inside_text_config() -> None:
    config = gemma4_26b_a4b_config()
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    moe = resolve_moe_config(config)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 704)


def test_gemma4_read_from_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(gemma4_26b_a4b_config(AWQ_Q)))
    moe = read_config_files(tmp_path)
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size, moe.num_layers) == (
        128, 8, 2816, 704, 30)
    assert moe.quant.format_name == "awq"


def test_enable_moe_block_false_means_no_moe_layers() -> None:
    config = gemma4_26b_a4b_config()
    config["text_config"]["enable_moe_block"] = False
    assert resolve_moe_config(config).moe_layers == ()


def test_text_config_ignored_when_it_has_no_decoder_keys() -> None:
    config = {"text_config": {"model_type": "x", "vocab_size": 10}, "hidden_size": 64, "num_experts": 4,
              "num_experts_per_tok": 2, "intermediate_size": 32, "num_hidden_layers": 2}
    assert text_config(config) is config
    assert _resolve(config).num_experts == 4


@pytest.mark.parametrize("key", ["llm_config", "language_config"])
def test_other_nested_keys(key: str) -> None:
    config = {key: {"hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "num_hidden_layers": 2}, "quantization_config": GPTQ_Q}
    moe = resolve_moe_config(config)
    assert (moe.num_experts, moe.hidden_size, moe.intermediate_size) == (4, 64, 32)


def test_olmoe() -> None:
    moe = _resolve({"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
                    "num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 8})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (64, 8, 2048, 1024)
    assert moe.moe_layers == tuple(range(16))


def test_glm4_moe_first_k_dense_replace() -> None:
    moe = _resolve({"model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "num_hidden_layers": 46, "n_routed_experts": 128,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (128, 8, 4096, 1408)
    assert moe.moe_layers == tuple(range(1, 46))


def test_dbrx_keys_nested_in_ffn_config() -> None:
    """databricks/dbrx-instruct's layout: the experts' keys live in ffn_config."""
    moe = _resolve({"model_type": "dbrx", "d_model": 6144, "n_layers": 40, "ffn_config": {
        "moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752, "ffn_act_fn": {"name": "silu"}}})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size, moe.num_layers) == (
        16, 4, 6144, 10752, 40)
    assert moe.moe_layers == tuple(range(40)) and moe.activation == "silu"


def test_dbrx_keys_at_the_top_level_are_not_read() -> None:
    with pytest.raises(ConfigError, match=r"no key gives the routed expert count; tried "
                                          r"\['ffn_config\.moe_num_experts'\].*model_type='dbrx'"):
        _resolve({"model_type": "dbrx", "d_model": 6144, "n_layers": 40, "moe_num_experts": 16, "moe_top_k": 4,
                  "intermediate_size": 10752})


def test_ernie_style_moe_k() -> None:
    moe = _resolve({"model_type": "ernie4_5_moe", "hidden_size": 2560, "intermediate_size": 12288,
                    "moe_intermediate_size": 1536, "num_hidden_layers": 28, "moe_num_experts": 64,
                    "moe_k": 6, "moe_num_shared_experts": 2})
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size) == (64, 6, 2560, 1536)


def test_ernie_moe_layer_start_index() -> None:
    """ERNIE 4.5 (baidu/ERNIE-4.5-21B-A3B-PT): layer 0 is dense. HF Ernie4_5_MoeDecoderLayer makes layer L MoE iff
    (L + 1) % moe_layer_interval == 0 and moe_layer_start_index <= L <= moe_layer_end_index."""
    moe = _resolve({"model_type": "ernie4_5_moe", "hidden_size": 2560, "intermediate_size": 12288,
                    "moe_intermediate_size": 1536, "num_hidden_layers": 28, "moe_num_experts": 64,
                    "moe_k": 6, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                    "moe_layer_interval": 1})
    assert moe.moe_layers == tuple(range(1, 28))


def test_alias_order_first_key_wins() -> None:
    # num_experts is tried before num_local_experts (the fixtures carry only num_local_experts).
    moe = _resolve({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1, "num_experts": 8,
                    "num_local_experts": 4, "num_experts_per_tok": 2})
    assert moe.num_experts == 8


def test_two_layer_rules_that_disagree_name_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"first_k_dense_replace=2, moe_layer_freq=2 makes layers \[2, 4, 6, 8\] "
                                          r"MoE layers, but mlp_only_layers=\[4\] gives \[0-3, 5-9\] \(10 layers\); "
                                          r"the two keys disagree"):
        _resolve({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 10, "num_experts": 4,
                  "num_experts_per_tok": 2, "first_k_dense_replace": 2, "moe_layer_freq": 2, "mlp_only_layers": [4]})


@pytest.mark.parametrize("folder", sorted(
    p.parent for p in [*Path("/work/shared/fixtures").glob("*/config.json"),
                       *(Path(__file__).parents[1] / "fixtures").glob("*/checkpoint/config.json")]), ids=str)
def test_real_fixture_configs(folder: Path) -> None:
    moe = read_config_files(folder)
    mixed = folder.parent.name.endswith("_mixed")  # 3 layers, hidden 64 (tests/fixtures/README.md)
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size, moe.num_layers) == \
        ((4, 2, 64, 128, 3) if mixed else (4, 2, 128, 128, 1))
    assert moe.moe_layers == ((0, 1, 2) if mixed else (0,))
    assert moe.model_type == "qwen3_moe"


# ---------------------------------------------------------------- errors


def test_no_expert_count_key_names_every_key_tried() -> None:
    with pytest.raises(ConfigError, match=r"no key gives the routed expert count; tried \['num_experts', "
                                          r"'n_routed_experts', 'num_local_experts', 'moe_num_experts'\].*"
                                          r"model_type='llama'"):
        _resolve({"model_type": "llama", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                  "num_experts_per_tok": 2})
    assert EXPERT_COUNT_KEYS == ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def test_no_top_k_key() -> None:
    with pytest.raises(ConfigError, match=r"experts per token \(top-k\); tried \['num_experts_per_tok', "
                                          r"'top_k_experts', 'moe_top_k', 'moe_k', 'moe_topk', 'num_experts_per_token'\]\. Add "
                                          r"one of them to config\.json \(model_type=None\), or add the key to the "
                                          r"'generic' row of the families table \(wna16_loader/models/families\.py\)"):
        _resolve({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_experts": 4})


def test_no_hidden_or_layer_or_intermediate_key() -> None:
    base = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_experts": 4,
            "num_experts_per_tok": 2}
    for key, match in [("hidden_size", r"hidden size; tried \['hidden_size', 'd_model'\]"),
                       ("num_hidden_layers", r"decoder layer count; tried \['num_hidden_layers', 'n_layers', "
                                             r"'num_layers'\]"),
                       ("intermediate_size", r"expert intermediate size; tried \['moe_intermediate_size', "
                                             r"'expert_intermediate_size', 'intermediate_size'\]")]:
        config = {k: v for k, v in base.items() if k != key}
        with pytest.raises(ConfigError, match=match):
            _resolve(config)


@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True])
def test_expert_count_must_be_positive_int(value) -> None:
    with pytest.raises(ConfigError, match=r"num_experts=.* \(routed expert count\) must be a positive integer"):
        _resolve({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_experts": value,
                  "num_experts_per_tok": 1})


def test_top_k_larger_than_expert_count() -> None:
    with pytest.raises(ConfigError, match=r"top-k = 8 is larger than the expert count 4"):
        _resolve({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_experts": 4,
                  "num_experts_per_tok": 8})


def test_no_quantization_config() -> None:
    with pytest.raises(ConfigError, match=r"config.json has no quantization_config, and no quantize_config.json "
                                          r"or quant_config.json was found"):
        resolve_moe_config({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_experts": 4,
                            "num_experts_per_tok": 2})


def test_bad_mlp_only_layers() -> None:
    with pytest.raises(ConfigError, match=r"mlp_only_layers='0,1' must be a list of layer indices"):
        _resolve({"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_experts": 4,
                  "num_experts_per_tok": 2, "mlp_only_layers": "0,1"})


FLAT = {"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_experts": 4, "num_experts_per_tok": 2}


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        read_config_files(tmp_path)


def test_json_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json: expected a JSON object, found list"):
        read_config_files(tmp_path)


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json: file not found; a checkpoint folder needs a config\.json"):
        read_config_files(tmp_path)
    with pytest.raises(WNA16Error):
        load_json(tmp_path / "nope.json")


def test_fallback_quantize_config_json_implies_gptq(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64, "sym": False,
                                                               "desc_act": True}))
    moe = read_config_files(tmp_path)
    assert moe.quant.format_name == "gptq"
    assert (moe.quant.bits, moe.quant.group_size, moe.quant.symmetric, moe.quant.act_order) == (4, 64, False, True)
    assert moe.quant.zero_word_bias is True


def test_fallback_quant_config_json_implies_awq(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 128, "zero_point": True,
                                                            "version": "GEMM"}))
    moe = read_config_files(tmp_path)
    assert moe.quant.format_name == "awq"
    assert (moe.quant.bits, moe.quant.group_size, moe.quant.symmetric) == (4, 128, False)


def test_fallback_file_prefers_quantize_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 32}))
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 128}))
    assert read_config_files(tmp_path).quant.format_name == "gptq"


def test_fallback_file_with_explicit_quant_method(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"quant_method": "awq", "bits": 4,
                                                               "group_size": 128}))
    assert read_config_files(tmp_path).quant.format_name == "awq"


def test_embedded_quantization_config_beats_fallback_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**FLAT, "quantization_config": AWQ_Q}))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64}))
    assert read_config_files(tmp_path).quant.format_name == "awq"


def test_no_quantization_anywhere_in_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    with pytest.raises(ConfigError) as exc:
        read_config_files(tmp_path)
    accepted = "; ".join(f"{d.name} (quant_method {' or '.join(repr(m) for m in d.quant_methods)})" for d in FORMATS)
    assert str(exc.value) == (f"{tmp_path}: config.json has no quantization_config, and the folder has no "
                              f"quantize_config.json or quant_config.json; this is not a WNA16-quantized "
                              f"checkpoint. Accepted formats: {accepted}.")


def test_bad_json_in_fallback_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    (tmp_path / "quant_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"quant_config\.json: not valid JSON"):
        read_config_files(tmp_path)


# ---------------------------------------------------------------- per-layer values, counts, the record


def test_per_layer_list_needs_one_value_per_layer() -> None:
    with pytest.raises(ConfigError) as exc:
        _resolve({"model_type": "hunyuan_v1_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_experts": 8,
                  "moe_topk": [2, 2, 2], "moe_intermediate_size": 32})
    assert str(exc.value) == ("config.json: moe_topk lists 3 values (experts per token (top-k)) but the decoder has 4 "
                              "layers (row 'hunyuan_v1_moe', model_type 'hunyuan_v1_moe'); a per-layer list needs one "
                              "value per layer, or one for every layer. Fix the list, or declare what moe_topk lists "
                              "in the 'hunyuan_v1_moe' row of the families table (wna16_loader/models/families.py).")


def test_a_list_of_one_value_applies_to_every_layer() -> None:
    moe = _resolve({"model_type": "hunyuan_v1_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_experts": 8,
                    "moe_topk": [3], "moe_intermediate_size": [32]})
    assert [moe.layer(i).top_k for i in range(4)] == [3] * 4 and moe.intermediate_size == 32


def test_per_layer_list_entries_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"moe_intermediate_size\[1\]=0 \(expert intermediate size\) must be a "
                                          r"positive integer"):
        _resolve({"model_type": "hunyuan_v1_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8,
                  "moe_topk": 2, "moe_intermediate_size": [32, 0]})


def test_per_layer_top_k_checked_per_layer() -> None:
    with pytest.raises(ConfigError, match=r"top-k = 9 is larger than the expert count 8 \(layer 1\)"):
        _resolve({"model_type": "hunyuan_v1_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8,
                  "moe_topk": [2, 9], "moe_intermediate_size": 32})


def test_layer_count_and_per_layer_list_disagree() -> None:
    with pytest.raises(ConfigError, match=r"num_hidden_layers=6 but hybrid_override_pattern lists 5 layers; the two "
                                          r"keys disagree"):
        _resolve({"model_type": "nemotron_h", "hidden_size": 64, "num_hidden_layers": 6, "n_routed_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "hybrid_override_pattern": "MEM*E"})


def test_zero_experts_count_toward_top_k_only() -> None:
    moe = _resolve({"model_type": "longcat_flash", "hidden_size": 64, "num_layers": 2, "n_routed_experts": 4,
                    "zero_expert_num": 4, "moe_topk": 6, "expert_ffn_hidden_size": 32})
    assert (moe.num_experts, moe.zero_experts, moe.top_k) == (4, 4, 6)
    with pytest.raises(ConfigError, match=r"zero_expert_num=-1 \(zero experts\) must be an integer >= 0"):
        _resolve({"model_type": "longcat_flash", "hidden_size": 64, "num_layers": 2, "n_routed_experts": 4,
                  "zero_expert_num": -1, "moe_topk": 2, "expert_ffn_hidden_size": 32})


def test_alias_model_type_of_a_nested_decoder() -> None:
    """A text-only Gemma 4 checkpoint (model_type gemma4_text at the top level) uses the gemma4 row."""
    text = dict(gemma4_26b_a4b_config()["text_config"])
    moe = _resolve(text)
    assert (moe.family, moe.top_k, moe.intermediate_size) == ("gemma4", 8, 704)
    assert moe.resolution.decoder == "top level"


def test_resolution_records_every_value() -> None:
    moe = resolve_moe_config(gemma4_26b_a4b_config())
    rec = moe.resolution
    assert (rec.family, rec.decoder) == ("gemma4", "text_config")
    assert [v.what for v in rec.values] == ["hidden size", "decoder layer count", "MoE layers", "routed expert count",
                                            "experts per token (top-k)", "expert intermediate size",
                                            "zero (identity) experts", "gated", "activation", "MTP layers",
                                            "shared experts"]
    assert rec["experts per token (top-k)"] == Resolved("experts per token (top-k)", 8, "top_k_experts (row gemma4)",
                                                        "top_k_experts")
    assert rec["MoE layers"].source == ("rule enable_moe_block: enable_moe_block=True (every layer when true, none "
                                        "when false)")
    assert moe == resolve_moe_config(gemma4_26b_a4b_config())  # the record does not take part in equality


def test_unknown_wrapper_around_a_known_decoder() -> None:
    """A multimodal wrapper the table does not know, around a qwen3_moe decoder: the decoder's row is used."""
    config = {"model_type": "some_vl_wrapper", "vision_config": {"hidden_size": 32},
              "text_config": {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "intermediate_size": 128}}
    moe = _resolve(config)
    assert (moe.family, moe.resolution.decoder, moe.num_experts, moe.intermediate_size) == ("qwen3_moe", "text_config",
                                                                                           4, 32)
