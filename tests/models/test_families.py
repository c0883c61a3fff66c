"""Every MoE family of the table, from config.json files as transformers writes them (tests/fixtures/configs,
see provenance.json there): resolved values, MoE layers, and exact loads at TP 1, TP 2, EP 2 and TP 2 x EP 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import assert_exact, assert_owners, reassemble

from wna16_loader import ParallelConfig, load_experts, read_moe_config
from wna16_loader.errors import ConfigError
from wna16_loader.models.config import MoEConfig, resolve_moe_config
from wna16_loader.models.families import BY_MODEL_TYPE, FAMILIES, GENERIC, family_of, lookup
from wna16_loader.models.family_docs import render_table
from wna16_loader.models.layer_rules import EXPLICIT_KEYS, RULES_BY_NAME
from wna16_loader.models.names import layer_of_prefix
from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_family_checkpoint

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
QUANT = quant_config("gptq", bits=4, group_size=32, symmetric=False)
NEMOTRON_NANO = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

# fixture: (experts, top-k, expert intermediate size, layer count, MoE layers, rule), from each family's modeling code
EXPECTED: dict[str, tuple[int, int, int, int, tuple[int, ...], str | None]] = {
    "afmoe": (64, 6, 1408, 32, tuple(range(1, 32)), "num_dense_layers"),
    "cohere2_moe": (8, 2, 22528, 40, tuple(range(40)), "mlp_layer_types"),
    "deepseek_v3": (256, 8, 2048, 61, tuple(range(3, 61)), "first_k_dense_replace"),
    "deepseek_v32": (256, 8, 2048, 61, tuple(range(3, 61)), "mlp_layer_types"),
    "deepseek_v4": (256, 6, 2048, 43, tuple(range(43)), "mlp_layer_types"),
    "deepseek_v4-published": (256, 6, 2048, 43, tuple(range(43)), "num_hash_layers"),
    "deepseek_v4-flash-base": (256, 6, 2048, 43, tuple(range(43)), "num_hash_layers"),
    "kimi_k3": (896, 16, 3072, 93, tuple(range(1, 93)), "first_k_dense_replace"),
    "deepseek_ocr2": (64, 6, 896, 12, tuple(range(1, 12)), "mlp_layer_types"),
    "axk1": (192, 8, 2048, 61, tuple(range(1, 61)), "mlp_layer_types"),
    "axk2": (128, 8, 512, 48, tuple(range(1, 48)), "mlp_layer_types"),
    "bailing_hybrid": (512, 8, 768, 42, tuple(range(2, 42)), "mlp_layer_types"),
    "beam": (256, 8, 2560, 52, tuple(range(3, 52)), "mlp_layer_types"),
    "dbrx": (4, 1, 3584, 24, tuple(range(24)), None),
    "dots3_note": (256, 8, 1536, 46, tuple(range(1, 46)), "mlp_layer_types"),
    "flint": (256, 6, 512, 49, tuple(range(2, 49)), "decoder_sparse_step"),
    "hy_v3": (192, 8, 1536, 80, tuple(range(1, 80)), "mlp_layer_types"),
    "hy_v4": (256, 8, 768, 34, tuple(range(1, 34)), "mlp_layer_types"),
    "kolibri1": (384, 6, 512, 50, tuple(range(50)), None),
    "laguna": (256, 8, 512, 40, tuple(range(1, 40)), "mlp_layer_types"),
    "mellum": (64, 8, 896, 28, tuple(range(28)), "mlp_layer_types"),
    "mimo_v2_flash": (256, 8, 2048, 48, tuple(range(1, 48)), "mlp_layer_types"),
    "minimax": (8, 2, 14336, 32, tuple(range(32)), None),
    "minimax_m3_vl": (128, 4, 3072, 60, tuple(range(60)), "mlp_layer_types"),
    "solar_open": (128, 8, 1280, 48, tuple(range(48)), None),
    "unlimited_ocr": (64, 6, 896, 12, tuple(range(1, 12)), "mlp_layer_types"),
    "zaya": (16, 1, 2048, 40, tuple(range(40)), None),
    "dots1": (128, 6, 1408, 62, tuple(range(1, 62)), "first_k_dense_replace"),
    "ernie4_5_vl_moe": (64, 6, 1536, 28, tuple(range(1, 28)), "mlp_layer_types"),
    "glm4v_moe": (128, 8, 1408, 46, tuple(range(1, 46)), "first_k_dense_replace"),
    "glm5_next": (288, 8, 2048, 45, tuple(range(3, 45)), "mlp_layer_types"),
    "mistral4": (128, 4, 2048, 36, tuple(range(36)), "first_k_dense_replace"),
    "mistral_large4": (128, 4, 6144, 72, tuple(range(1, 72)), "mlp_layer_types"),
    "muse_spark": (256, 8, 4096, 62, tuple(range(62)), "mlp_layer_types"),
    "qwen3_omni_moe": (128, 8, 768, 28, tuple(range(28)), "decoder_sparse_step"),
    "qwen3_vl_moe": (60, 4, 1408, 24, tuple(range(24)), "decoder_sparse_step"),
    "qwen4_exp": (512, 10, 512, 40, tuple(range(40)), None),
    "ernie4_5_moe": (64, 6, 1536, 28, tuple(range(1, 28)), "moe_layer_start_index"),
    "exaone_moe": (64, 8, 1024, 32, tuple(range(1, 32)), "mlp_layer_types"),
    "flex_olmo": (7, 5, 11008, 32, tuple(range(32)), None),
    "gemma4": (128, 8, 704, 30, tuple(range(30)), "enable_moe_block"),
    "glm4_moe": (128, 8, 1408, 46, tuple(range(1, 46)), "first_k_dense_replace"),
    "glm4_moe_lite": (64, 4, 1536, 47, tuple(range(1, 47)), "mlp_layer_types"),
    "glm4_moe_lite-flash": (64, 4, 1536, 47, tuple(range(1, 47)), "mlp_layer_types"),
    "glm_moe_dsa": (256, 8, 2048, 78, tuple(range(3, 78)), "mlp_layer_types"),
    "hunyuan_v1_moe": (1, 1, 11008, 32, tuple(range(32)), None),
    "hunyuan_v1_moe-a13b": (64, 8, 3072, 32, tuple(range(32)), None),
    "jamba": (16, 2, 14336, 32, tuple(range(1, 32, 2)), "expert_layer_period"),
    "kimi_k25": (256, 8, 2048, 61, tuple(range(3, 61)), "first_k_dense_replace"),
    "kimi_linear": (256, 8, 1024, 27, tuple(range(1, 27)), "mlp_layer_types"),
    "lfm2_moe": (32, 4, 1792, 32, tuple(range(2, 32)), "num_dense_layers"),
    "llama4": (16, 1, 8192, 48, tuple(range(48)), "moe_layers"),
    "longcat_flash": (512, 12, 2048, 28, tuple(range(28)), None),
    "minimax_m2": (256, 8, 1536, 62, tuple(range(62)), None),
    "mixtral": (8, 2, 14336, 32, tuple(range(32)), None),
    "nemotron_h": (8, 2, 7688, 4, (1,), "layers_block_type"),
    "nemotron_h-nano-30b-a3b": (128, 6, 1856, 52, tuple(i for i, c in enumerate(NEMOTRON_NANO) if c == "E"),
                                "hybrid_override_pattern"),
    "olmoe": (64, 8, 2048, 16, tuple(range(16)), None),
    "phimoe": (16, 2, 6400, 32, tuple(range(32)), None),
    "qwen2_moe": (60, 4, 1408, 24, tuple(range(24)), "decoder_sparse_step"),
    "qwen3_5_moe": (256, 8, 512, 40, tuple(range(40)), None),
    "qwen3_5_moe-mtp": (256, 8, 512, 40, tuple(range(40)), None),
    "qwen3_moe": (128, 8, 768, 24, tuple(range(24)), "decoder_sparse_step"),
    "qwen3_next": (512, 10, 512, 48, tuple(range(48)), "decoder_sparse_step"),
}
# every row's model type (each has a fixture written by transformers' own class)
# refused fixtures -> (the decoder's model_type, the keys their error quotes)
REFUSED = {"gpt_oss": ("gpt_oss", "swiglu_limit=7.0, swiglu_alpha=1.702"),
           "openai_privacy_filter": ("openai_privacy_filter", "swiglu_limit=7.0, swiglu_alpha=1.702"),
           "granitemoe": ("granitemoe", "num_local_experts=8"),
           "granitemoeshared": ("granitemoeshared", "num_local_experts=8"),
           "granitemoehybrid": ("granitemoehybrid", "num_local_experts=8"), "jetmoe": ("jetmoe", "num_local_experts=8"),
           "aria": ("aria_text", "moe_num_experts=8"), "doge": ("doge", "is_moe=False, num_experts=16384"),
           "nllb-moe": ("nllb-moe", "num_experts=128"),
           "switch_transformers": ("switch_transformers",
                                   "num_experts=8, num_sparse_encoder_layers=3, num_sparse_decoder_layers=3"),
           "step3p7": ("step3p5", "n_routed_experts=288"), "step3p5": ("step3p5", "n_routed_experts=288"),
           "inkling_mm_model": ("inkling_text", "n_routed_experts=256"),
           "inkling2": ("inkling2_text", "n_routed_experts=384"),
           "diffusion_gemma": ("diffusion_gemma_text", "num_experts=128")}
ROW_TYPES = {"deepseek_v4", "dbrx", "ernie4_5_vl_moe", "glm4v_moe", "glm5_next", "mistral4", "mistral_large4",
             "muse_spark", "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "gpt_oss", "granitemoe", "jetmoe",
             "aria", "axk1", "axk2", "bailing_hybrid", "beam", "doge", "dots3_note", "flint", "hy_v3", "hy_v4",
             "kolibri1", "laguna", "mellum", "mimo_v2_flash", "minimax", "minimax_m3_vl", "nllb-moe",
             "openai_privacy_filter", "solar_open", "step3p7", "unlimited_ocr", "zaya", "inkling_mm_model", "inkling2",
             "afmoe", "lfm2_moe", "glm4_moe_lite", "kimi_linear", "jamba", "llama4", "hunyuan_v1_moe", "longcat_flash",
             "nemotron_h", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral", "minimax_m2", "phimoe",
             "olmoe", "flex_olmo", "glm4_moe", "glm_moe_dsa", "deepseek_v3", "deepseek_v32", "kimi_k25", "dots1",
             "ernie4_5_moe", "exaone_moe", "cohere2_moe", "gemma4", "kimi_k3", "deepseek_ocr2",
             "diffusion_gemma"}
NAMES = sorted(EXPECTED)


def fixture(name: str) -> dict:
    """A fixture as a WNA16 requantization of its checkpoint writes it: a decoder config's own quantization_config
    (Kimi K3 publishes MXFP4 experts in text_config.quantization_config) is the requantizer's, set by each test."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    return config


def resolve(config: dict) -> MoEConfig:
    return resolve_moe_config({**config, "quantization_config": QUANT})


def test_every_fixture_is_tested_and_every_row_has_a_fixture():
    on_disk = {p.stem for p in CONFIGS.glob("*.json")} - {"provenance"}
    assert on_disk == set(EXPECTED) | set(REFUSED)
    provenance = json.loads((CONFIGS / "provenance.json").read_text())
    assert set(provenance["fixtures"]) == on_disk and provenance["transformers"].startswith("5.")
    assert {fixture(n)["model_type"] for n in NAMES} | set(REFUSED) == \
        ROW_TYPES | {"granitemoeshared", "granitemoehybrid", "switch_transformers", "step3p5"}
    assert {f.name for f in FAMILIES} == ROW_TYPES


@pytest.mark.parametrize("name", NAMES)
def test_resolved_values(name):
    experts, top_k, inter, layers, moe_layers, rule = EXPECTED[name]
    moe = resolve(fixture(name))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.num_layers) == (experts, top_k, inter, layers)
    assert moe.moe_layers == moe_layers
    row = family_of(fixture(name)["model_type"])
    assert moe.family == row.name != GENERIC.name
    assert moe.gated is row.gated
    source = moe.resolution["MoE layers"].source
    assert source.startswith(f"rule {rule}:" if rule else "every layer")
    assert rule is None or rule in row.layer_rules


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_rows_name_the_type_and_the_keys(name):
    row, (model_type, keys) = family_of(name), REFUSED[name]
    with pytest.raises(ConfigError) as exc:
        resolve(fixture(name))
    assert str(exc.value) == (
        f"config.json: model_type {model_type!r} (row {row.name!r} of the families table, "
        f"wna16_loader/models/families.py) is refused: {row.refusal.why} (config.json: {keys}). Load this model "
        f"with its engine's own loader.")


def test_gpt_oss_is_refused_for_its_biases_and_clamped_swiglu():
    with pytest.raises(ConfigError, match=r"model_type 'gpt_oss' .* is refused: its experts carry biases "
                                          r"\(gate_up_proj_bias, down_proj_bias\) and a clamped SwiGLU"):
        resolve(fixture("gpt_oss"))


def test_muse_spark_experts_take_moe_hidden_size():
    """MuseSparkMoE projects the hidden states (8192) down to moe_hidden_size (4096) before its experts."""
    moe = resolve(fixture("muse_spark"))
    assert (moe.hidden_size, fixture("muse_spark")["text_config"]["hidden_size"]) == (4096, 8192)
    assert moe.resolution["hidden size"].source == "moe_hidden_size (row muse_spark)"


def test_kimi_k3_experts_take_routed_expert_hidden_size_and_situ():
    """Kimi K3's latent MoE: its experts take routed_expert_hidden_size (3584, the published w1 [3072, 3584]), not
    the hidden size (7168); the SiTU activation is recorded as the config names it."""
    moe = resolve(fixture("kimi_k3"))
    assert (moe.hidden_size, fixture("kimi_k3")["text_config"]["hidden_size"]) == (3584, 7168)
    assert moe.resolution["hidden size"].source == "routed_expert_hidden_size (row kimi_k3)"
    assert (moe.activation, moe.mtp.count) == ("situ", 0)
    assert family_of("kimi_k3").patterns() == \
        ("language_model.model.layers.L.block_sparse_moe.experts.E.{w1, w3, w2}.SUFFIX",)


def test_kimi_k3_as_published_is_mxfp4_and_refused():
    """The published checkpoint's experts are MXFP4 (text_config.quantization_config, which outranks the top
    level's): not WNA16, refused naming the format."""
    config = json.loads((CONFIGS / "kimi_k3.json").read_text())
    with pytest.raises(ConfigError, match=r"group 'group_0' has format='mxfp4-pack-quantized'; only "
                                          r"'pack-quantized' integer weights are WNA16"):
        resolve(config)


def test_dbrx_reads_its_nested_ffn_config():
    moe = resolve(fixture("dbrx"))
    assert moe.resolution["routed expert count"].source == "ffn_config.moe_num_experts (row dbrx)"
    assert moe.resolution["expert intermediate size"].key == "ffn_config.ffn_hidden_size"
    assert (moe.hidden_size, moe.activation) == (2048, "silu")
    assert family_of("dbrx").patterns() == ("transformer.blocks.L.ffn.experts.mlp.E.{w1, v1, w2}.SUFFIX",)


def test_qwen3_omni_decoder_is_the_thinkers_text_config():
    moe = resolve(fixture("qwen3_omni_moe"))
    assert moe.resolution.decoder == "thinker_config.text_config"
    assert moe.model_type == "qwen3_omni_moe_text"


def test_ernie_vl_reads_the_text_entry_of_its_per_modality_list():
    """moe_intermediate_size = [text, vision]: the text decoder's experts are the first (modeling_ernie4_5_vl_moe.py
    builds text_moe with [0] and vision_moe with [1]), never one value per layer."""
    assert fixture("ernie4_5_vl_moe")["text_config"]["moe_intermediate_size"] == [1536, 512]
    moe = resolve(fixture("ernie4_5_vl_moe"))
    assert moe.intermediate_size == 1536 and moe.per_layer == ()
    assert moe.resolution["expert intermediate size"].source == \
        "moe_intermediate_size (row ernie4_5_vl_moe, the text entry of a per-modality list)"


def test_clamped_swiglu_limit_is_recorded():
    for name, limit in (("deepseek_v4", 10.0), ("glm5_next", 10.0)):
        record = resolve(fixture(name)).resolution["activation clamp"]
        assert (record.value, record.key) == (limit, "swiglu_limit")


def test_longcat_zero_experts_are_counted_apart():
    moe = resolve(fixture("longcat_flash"))
    assert (moe.num_experts, moe.zero_experts, moe.top_k) == (512, 256, 12)
    assert moe.resolution["zero (identity) experts"].key == "zero_expert_num"
    assert moe.resolution["decoder layer count"].key == "num_layers"


def test_nemotron_h_is_not_gated_relu2():
    for name in ("nemotron_h", "nemotron_h-nano-30b-a3b"):
        moe = resolve(fixture(name))
        assert (moe.gated, moe.activation) == (False, "relu2")
    assert resolve(fixture("nemotron_h")).resolution["decoder layer count"].source == \
        "length of layers_block_type (no layer-count key)"


def test_hunyuan_per_layer_lists():
    moe = resolve(fixture("hunyuan_v1_moe-a13b"))
    assert moe.resolution["experts per token (top-k)"].source == "moe_topk (row hunyuan_v1_moe)"
    config = fixture("hunyuan_v1_moe-a13b")
    config["moe_intermediate_size"] = [1024 + 512 * (i % 2) for i in range(32)]
    config["moe_topk"] = [2 + i % 3 for i in range(32)]
    moe = resolve(config)
    assert [moe.layer(i).intermediate_size for i in range(4)] == [1024, 1536, 1024, 1536]
    assert [moe.layer(i).top_k for i in range(4)] == [2, 3, 4, 2]
    assert moe.resolution["expert intermediate size"].value == tuple(config["moe_intermediate_size"])
    assert "one value per layer" in moe.resolution["expert intermediate size"].source


def test_describe_names_row_keys_and_rule():
    text = resolve(fixture("glm4_moe_lite")).resolution.describe()
    assert text.splitlines()[0] == "family row: glm4_moe_lite (wna16_loader/models/families.py); decoder config: top level"
    assert "  routed expert count       = 64  <- n_routed_experts (row glm4_moe_lite)" in text
    assert "  MoE layers                = [1-46]  <- rule mlp_layer_types: mlp_layer_types=" in text
    nested = resolve(fixture("llama4")).resolution.describe()
    assert "decoder config: text_config" in nested
    assert "expert intermediate size  = 8192  <- intermediate_size (row llama4)" in nested


# --------------------------------------------------------------------------------------------- loads

E, H, I_SMALL, LAYERS = 4, 64, 64, 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, ep)


def _decoder(config: dict, where: str) -> dict:
    for part in ([] if where == "top level" else where.split(".")):
        config = config[part]
    return config


def _set(config: dict, key: str, value) -> None:
    """Set a (dotted) key of `config`."""
    *parents, last = key.split(".")
    for part in parents:
        config = config[part]
    config[last] = value


def shrink(config: dict) -> dict:
    """A copy with the same keys and rules at test sizes: at most 4 layers (per-layer lists cut to match),
    4 experts, top-k <= 2, H = 64, I = 64 (a per-layer list alternates 64 and 96: two geometries)."""
    moe = resolve(config)
    out = copy.deepcopy(config)
    text, rec, n = _decoder(out, moe.resolution.decoder), moe.resolution, min(moe.num_layers, LAYERS)
    if rec["decoder layer count"].key:
        _set(text, rec["decoder layer count"].key, n)
    for key in EXPLICIT_KEYS:
        if isinstance(text.get(key), (list, str)):
            text[key] = text[key][:n]
    if isinstance(text.get("moe_layers"), list):
        text["moe_layers"] = [layer for layer in text["moe_layers"] if layer < n]
    for what, small in (("routed expert count", lambda i, v: E), ("experts per token (top-k)", lambda i, v: min(v, 2)),
                        ("expert intermediate size", lambda i, v: I_SMALL + 32 * (i % 2))):
        key = rec[what].key
        value = lookup(text, key)
        _set(text, key, [small(i, v) for i, v in enumerate(value[:n])] if isinstance(value, list) else small(0, value))
    _set(text, rec["hidden size"].key, H)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_shrunk_config_keeps_the_rules(name):
    small = resolve(shrink(fixture(name)))
    full = resolve(fixture(name))
    assert small.family == full.family and small.gated == full.gated
    assert small.moe_layers == tuple(layer for layer in full.moe_layers if layer < small.num_layers)
    assert small.moe_layers, f"{name}: no MoE layer left in the first {LAYERS} layers"
    assert small.resolution["MoE layers"].source.split(":")[0] == full.resolution["MoE layers"].source.split(":")[0]


@pytest.mark.parametrize("name", NAMES)
def test_family_loads_exactly(tmp_path, name):
    config = shrink(fixture(name))
    ckpt = write_family_checkpoint(tmp_path, config, QUANT, seed=len(name))
    moe = read_moe_config(tmp_path)
    assert moe.experts_prefixes == ckpt.prefixes
    assert moe.zero_experts == resolve(fixture(name)).zero_experts  # LongCat: 256 identity experts, never placed
    assert tuple(layer_of_prefix(p) for p in ckpt.prefixes) == moe.moe_layers
    row = BY_MODEL_TYPE[moe.family]
    assert all(p.startswith(f"{row.roots[0]}.") for p in ckpt.prefixes)
    for tp, ep in LAYOUTS:
        weights, owners = reassemble(tmp_path, tp, ep)
        assert_owners(owners, ckpt.prefixes, E, tp, ep)
        assert_exact(weights, ckpt.references)


@pytest.mark.parametrize("name", [n for n in NAMES if resolve(fixture(n)).mtp.count and resolve(fixture(n)).mtp.routed])
def test_family_mtp_layers_load_exactly(tmp_path, name):
    """Every fixture that declares MTP layers with routed experts, written with them (in the row's naming):
    the decoder's layers alone by default, every layer exactly with include_mtp=True."""
    ckpt = write_family_checkpoint(tmp_path, shrink(fixture(name)), QUANT, seed=len(name), mtp=True)
    moe = read_moe_config(tmp_path)
    assert moe.mtp_prefixes == ckpt.prefixes[-moe.mtp.count:] and moe.experts_prefixes == ckpt.prefixes[:-1]
    main = {k: v for k, v in ckpt.references.items() if k[0] in moe.experts_prefixes}
    assert_exact(reassemble(tmp_path, 2, 2)[0], main)
    weights, owners = reassemble(tmp_path, 2, 2, include_mtp=True)
    assert_owners(owners, ckpt.prefixes, E, 2, 2)
    assert_exact(weights, ckpt.references)


def test_per_layer_sizes_load_with_their_own_geometry(tmp_path):
    """Hunyuan-A13B's per-layer lists at test sizes: I alternates 64 / 96, so at TP 2 the layers have I_p 32 / 48
    and G_eff 32 / 16."""
    write_family_checkpoint(tmp_path, shrink(fixture("hunyuan_v1_moe-a13b")), QUANT)
    from conftest import load_all_ranks
    loads = load_all_ranks(tmp_path, 2, 1)
    layers = loads[(0, 0)]
    assert [(layer.spec.part, layer.group_size) for layer in layers.values()] == [(32, 32), (48, 16)] * 2


# --------------------------------------------------------------------------------------------- the table

MODELS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
TABLE_START, TABLE_END = "<!-- families-table: rendered by wna16_loader.models.family_docs.render_table -->", \
    "<!-- /families-table -->"


def test_rendered_table_has_one_line_per_row():
    lines = render_table().splitlines()
    assert len(lines) == 2 + len(FAMILIES)
    nemotron = next(line for line in lines if line.startswith("| nemotron_h |"))
    assert nemotron == ("| nemotron_h | top level | `n_routed_experts` ; `num_experts_per_tok` ; `moe_intermediate_size` ; "
                        "expert input `moe_latent_size` / `hidden_size` | "
                        "`layers_block_type`, `hybrid_override_pattern` | "
                        "`backbone.layers.L.mixer.experts.E.{up_proj, down_proj}` | **not gated**, activation "
                        "`mlp_hidden_act` | — |")


def test_rendered_table_says_refusals_expert_inputs_and_clamps():
    lines = {line.split(" | ")[0][2:]: line for line in render_table().splitlines()[2:]}
    assert lines["gpt_oss"].endswith(f"| **refused**: {family_of('gpt_oss').refusal.why} | — |")
    assert "; expert input `moe_hidden_size` |" in lines["muse_spark, muse_spark_text"]
    assert "; text entry of `moe_intermediate_size` |" in lines["ernie4_5_vl_moe, ernie4_5_vl_moe_text"]
    assert "| `layers.L.ffn.experts.E.{w1, w3, w2}` | gated, activation `hidden_act`, clamped at `swiglu_limit` | " \
           "`mtp.i`, count `num_nextn_predict_layers` |" in lines["deepseek_v4"]
    assert "| `thinker_config.text_config` |" in lines["qwen3_omni_moe, qwen3_omni_moe_thinker, qwen3_omni_moe_text"]


def test_documented_table_is_the_rendered_one():
    text = MODELS.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text, "docs/models.md lost its families table markers"
    assert text.split(TABLE_START)[1].split(TABLE_END)[0].strip() == render_table()


def test_rows_are_consistent():
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    for family in FAMILIES:
        assert set(family.layer_rules) <= set(RULES_BY_NAME), family.name
        kinds = {kind for _, kind in family.projections}
        assert kinds >= ({"gate", "up", "down"} if family.gated else {"up", "down"}), family.name
        assert family.gated or "gate" not in kinds and "gate_up" not in kinds


def test_a_projection_name_means_one_thing_in_every_row(monkeypatch):
    import wna16_loader.models.names as names
    from wna16_loader.models.families import Family, Keys

    clash = Family(("clash",), Keys(("n",), ("k",), ("i",)), projections=(("w1", "up"),))
    monkeypatch.setattr(names, "all_rows", lambda: (*FAMILIES, clash))
    with pytest.raises(AssertionError, match=r"families table: 'w1' is Source\.GATE in one row, 'up' in clash"):
        names._aliases()


def test_unknown_model_type_uses_the_generic_row():
    moe = resolve({"model_type": "brand_new_moe", "hidden_size": 64, "num_hidden_layers": 2, "moe_num_experts": 4,
                   "moe_k": 2, "expert_intermediate_size": 32})
    assert (moe.family, moe.num_experts, moe.top_k, moe.intermediate_size) == ("generic", 4, 2, 32)
    with pytest.raises(ConfigError, match=r"no key gives the routed expert count; tried \['num_experts', "
                                         r"'n_routed_experts', 'num_local_experts', 'moe_num_experts'\]\. Add one of "
                                         r"them to config\.json \(model_type='brand_new_moe'\), or add the key to "
                                         r"the 'generic' row of the families table \(wna16_loader/models/families\.py\)\."):
        resolve({"model_type": "brand_new_moe", "hidden_size": 64, "num_hidden_layers": 2, "experts": 4})


def test_a_known_row_tries_only_its_own_keys():
    config = fixture("nemotron_h-nano-30b-a3b")
    config["num_experts"] = config.pop("n_routed_experts")
    with pytest.raises(ConfigError, match=r"tried \['n_routed_experts'\]\. .* the 'nemotron_h' row of the families "
                                         r"table"):
        resolve(config)


# --------------------------------------------------------------------------------------------- DeepSeek-V4

V4_QUANT = quant_config("compressed-tensors", bits=4, group_size=16, symmetric=True)  # llm-compressor's W4A16
V4_LAYOUTS = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 8)]  # (tp, ep)


def v4_small(name: str) -> dict:
    """DeepSeek-V4's config (as transformers writes it, or as published) at test sizes: 4 layers (3 hash-routed),
    8 experts, top-k 2, H = 64, I = 128 (TP 8: 16 columns a rank, one group of 16), one MTP layer."""
    config = fixture(name)
    config.update(num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2, hidden_size=64,
                  moe_intermediate_size=128)
    for key in ("mlp_layer_types", "layer_types"):
        if key in config:
            config[key] = config[key][:4]
    return config


@pytest.mark.parametrize("name", ["deepseek_v4-published", "deepseek_v4"])
def test_deepseek_v4_names_hash_layers_and_mtp_as_published(tmp_path, name):
    """`layers.L.ffn.experts.E.{w1, w3, w2}`, every layer MoE (hash-routed ones too), the MTP layer
    `mtp.0.ffn.experts`, the shared experts left to the engine."""
    ckpt = write_family_checkpoint(tmp_path, v4_small(name), V4_QUANT, mtp=True)
    moe = read_moe_config(tmp_path)
    assert moe.family == "deepseek_v4" and moe.moe_layers == (0, 1, 2, 3)
    assert moe.experts_prefixes == tuple(f"layers.{layer}.ffn.experts" for layer in range(4))
    assert moe.mtp_prefixes == ("mtp.0.ffn.experts",) == ckpt.prefixes[4:]
    rule = "num_hash_layers: num_hash_layers=3" if name.endswith("published") else "mlp_layer_types: mlp_layer_types"
    assert moe.resolution["MoE layers"].source.startswith(f"rule {rule}")
    loaded = load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0), include_mtp=True)
    assert sorted(loaded) == sorted(ckpt.prefixes) and loaded["mtp.0.ffn.experts"].mtp
    assert "layers.0.ffn.shared_experts.gate_proj.qweight" in loaded.ignored
    assert all(".ffn.experts." not in name for name in loaded.ignored)


@pytest.mark.parametrize("tp,ep", V4_LAYOUTS)
def test_deepseek_v4_loads_exactly_from_the_checkpoint_and_from_wna16_shard(tmp_path, tp, ep):
    """A compressed-tensors W4A16 V4 checkpoint: every rank's share, stitched back, equals the quantizer's
    reference dequantisation, read from the checkpoint and from a `wna16-shard` output of the layout."""
    ckpt = write_family_checkpoint(tmp_path / "src", v4_small("deepseek_v4-published"), V4_QUANT, mtp=True)
    preshard_checkpoint(tmp_path / "src", tmp_path / "out", tp_size=tp, ep_size=ep, progress=False)
    for folder in (tmp_path / "src", tmp_path / "out"):
        weights, owners = reassemble(folder, tp, ep, include_mtp=True)
        assert_owners(owners, ckpt.prefixes, 8, tp, ep)
        assert_exact(weights, ckpt.references)


# the rows whose published configs hold shared experts in `mlp.shared_experts` counted by n_shared_experts (their
# modeling code: DeepseekV3MoE, Glm4MoeMoE, Glm4MoeLiteMoE, GlmMoeDsaMoE, DeepseekV2MoE in Kimi-K2.5's remote code),
# with the fixture's count
SHARED = {"deepseek_v3": 1, "deepseek_v32": 1, "glm4_moe": 1, "glm4_moe_lite": 1, "glm4_moe_lite-flash": 1,
          "glm_moe_dsa": 1, "kimi_k25": 1}


@pytest.mark.parametrize("name", NAMES)
def test_shared_experts_are_declared_where_the_family_has_them(name):
    moe = resolve(fixture(name))
    row = family_of(fixture(name)["model_type"])
    assert moe.shared_experts == SHARED.get(name, 0)
    assert (row.shared is not None) == (name in SHARED)
    record = moe.resolution["shared experts"]
    assert record.key == ("n_shared_experts" if name in SHARED else None)
    if name in SHARED:
        assert record.source.endswith(f"(row {row.name}; module mlp.shared_experts)")
