"""MTP layers from the families table (wna16_loader/models/mtp.py): the count each real config declares, where
it came from, and which experts prefixes are MTP layers (declared or not) in both namings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wna16_loader.errors import ConfigError
from wna16_loader.models.config import MoEConfig, resolve_moe_config
from wna16_loader.models.families import FAMILIES
from wna16_loader.models.mtp import MTP_ROOTS, MTPLayers
from wna16_loader.models.names import prefix_at_layer
from wna16_loader.testing.synthetic import quant_config

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
QUANT = quant_config("gptq", bits=4, group_size=32)

# fixture: (MTP count, MTP layer 0's experts prefix or None, where the count came from), per vLLM's MTP models
EXPECTED = {
    "deepseek_v3": (1, "model.layers.61.mlp.experts", "num_nextn_predict_layers=1 (row deepseek_v3)"),
    "glm4_moe": (1, "model.layers.46.mlp.experts", "num_nextn_predict_layers=1 (row glm4_moe)"),
    "glm4_moe_lite": (0, None, "0: no key of ['num_nextn_predict_layers'] present (row glm4_moe_lite's default)"),
    "glm4_moe_lite-flash": (1, "model.layers.47.mlp.experts", "num_nextn_predict_layers=1 (row glm4_moe_lite)"),
    "glm_moe_dsa": (0, None, "0: no key of ['num_nextn_predict_layers'] present (row glm_moe_dsa's default)"),
    "kimi_k25": (1, "language_model.model.layers.61.mlp.experts", "num_nextn_predict_layers=1 (row kimi_k25)"),
    "qwen3_5_moe": (1, "mtp.layers.0.mlp.experts", "1: no key of ['mtp_num_hidden_layers', "
                    "'num_nextn_predict_layers'] present (row qwen3_5_moe's default)"),
    "qwen3_5_moe-mtp": (1, "mtp.layers.0.mlp.experts", "mtp_num_hidden_layers=1 (row qwen3_5_moe)"),
    "qwen3_next": (1, "mtp.layers.0.mlp.experts", "1: no key of ['mtp_num_hidden_layers', "
                   "'num_nextn_predict_layers'] present (row qwen3_next's default)"),
}
DENSE = ("ernie4_5_moe", "exaone_moe", "longcat_flash")  # their MTP block's MLP is dense: no MTP experts


def resolve(name: str, **changes: object) -> MoEConfig:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    text = config.get("text_config", config)
    text.update(changes)
    return resolve_moe_config({**config, "quantization_config": QUANT})


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_declared_mtp_layers(name: str) -> None:
    count, prefix, source = EXPECTED[name]
    moe = resolve(name)
    assert (moe.mtp.count, moe.mtp.source, moe.mtp.routed) == (count, source, True)
    assert moe.resolution["MTP layers"].source == source
    if prefix is not None:
        assert moe.mtp.index(prefix) == 0 and moe.mtp.problem(prefix) is None
        last = prefix_at_layer(prefix, moe.num_layers - 1)
        assert moe.mtp.index(last) is None or moe.mtp.root is not None  # the decoder's last layer is not MTP


def test_main_layers_are_never_mtp_layers() -> None:
    moe = resolve("qwen3_5_moe-mtp")
    assert moe.mtp.index("model.language_model.layers.0.mlp.experts") is None
    assert moe.mtp.index("mtp.layers.0.mlp.experts") == 0
    deepseek = resolve("deepseek_v3")
    assert [deepseek.mtp.index(f"model.layers.{n}.mlp.experts") for n in (0, 60, 61, 62)] == [None, None, 0, None]


def test_undeclared_mtp_layers_say_why() -> None:
    qwen = resolve("qwen3_5_moe-mtp")
    assert qwen.mtp.problem("mtp.layers.1.mlp.experts") == (
        "MTP layer 1, but config.json declares 1 MTP layer(s) (mtp_num_hidden_layers=1 (row qwen3_5_moe))")
    deepseek = resolve("deepseek_v3")
    assert deepseek.mtp.problem("mtp.layers.0.mlp.experts") == (
        "an MTP layer under 'mtp.layers', but this family's MTP layers are layers.{61..61} (appended to the decoder)")
    none = resolve("qwen3_moe")
    assert none.mtp == MTPLayers()
    assert none.mtp.problem("mtp.layers.0.mlp.experts") == (
        "an MTP layer under 'mtp.layers', but this family's MTP layers are none")
    assert none.mtp.index("model.layers.48.mlp.experts") is None  # past the decoder, not MTP: "not a MoE layer"


@pytest.mark.parametrize("name", DENSE)
def test_dense_mtp_blocks_have_no_mtp_experts(name: str) -> None:
    moe = resolve(name, num_nextn_predict_layers=1)
    assert not moe.mtp.routed and moe.mtp.count == 1
    assert moe.resolution["MTP layers"].value == "1 (dense: no routed experts)"
    last = moe.num_layers
    assert moe.mtp.index(f"model.layers.{last}.mlp.experts") is None  # still a decoder layer past the last one
    assert moe.mtp.problem("mtp.layers.0.mlp.experts").startswith(
        f"an MTP layer's experts, but the {moe.family} row's MTP block is dense (no routed experts)")


def test_every_mtp_row_is_one_of_the_two_namings() -> None:
    rows = {f.name: f.mtp for f in FAMILIES if f.mtp is not None}
    assert sorted(rows) == sorted({"deepseek_v3", "deepseek_v32", "deepseek_v4", "glm4_moe", "glm4_moe_lite",
                                   "glm4v_moe", "glm_moe_dsa", "kimi_k25", "qwen3_5_moe", "qwen3_next", "qwen4_exp",
                                   "bailing_hybrid", "hy_v3", "hy_v4", "mimo_v2_flash", *DENSE})
    assert {rows[n].root for n in rows if rows[n].routed} == {None, "mtp.layers", "mtp", "model.mtp_layers"}
    assert MTP_ROOTS == {"mtp.layers", "mtp", "model.mtp_layers"}


def test_hy_v4_mtp_is_its_model_mtp_layers_tree() -> None:
    """HY-V4's MTP layer is model.mtp_layers.0 (a MoE decoder layer), one where the config names no count."""
    moe = resolve("hy_v4")
    assert (moe.mtp.count, moe.mtp.root, moe.mtp.first, moe.mtp.routed) == (1, "model.mtp_layers", 0, True)
    assert moe.mtp.source == "1: no key of ['num_nextn_predict_layers'] present (row hy_v4's default)"
    assert moe.mtp.index("model.mtp_layers.0.mlp.experts") == 0
    assert moe.mtp.index("model.layers.33.mlp.experts") is None
    assert moe.mtp.problem("model.mtp_layers.1.mlp.experts") == (
        "MTP layer 1, but config.json declares 1 MTP layer(s) (1: no key of ['num_nextn_predict_layers'] present "
        "(row hy_v4's default))")


def test_deepseek_v4_mtp_is_its_own_tree_without_layers() -> None:
    moe = resolve("deepseek_v4")
    assert (moe.mtp.count, moe.mtp.root, moe.mtp.first) == (1, "mtp", 0)
    assert moe.mtp.index("mtp.0.ffn.experts") == 0 and moe.mtp.index("layers.42.ffn.experts") is None
    assert moe.mtp.problem("mtp.0.ffn.experts") is None
    assert moe.mtp.problem("mtp.1.ffn.experts") == (
        "MTP layer 1, but config.json declares 1 MTP layer(s) (num_nextn_predict_layers=1 (row deepseek_v4))")
    assert moe.resolution["MTP layers"].value == "1: mtp.{0..0}"


def test_describe_lists_the_mtp_layers() -> None:
    text = resolve("deepseek_v3").resolution.describe()
    assert "  MTP layers                = 1: layers.{61..61} (appended to the decoder)  <- " \
           "num_nextn_predict_layers=1 (row deepseek_v3)" in text
    assert "MTP layers                = 1: mtp.layers.{0..0}  <- mtp_num_hidden_layers=1" in \
        resolve("qwen3_5_moe-mtp").resolution.describe()


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_bad_mtp_count(value: object) -> None:
    with pytest.raises(ConfigError) as error:
        resolve("deepseek_v3", num_nextn_predict_layers=value)
    assert str(error.value) == (f"config.json: num_nextn_predict_layers={value!r} (MTP layer count) must be an "
                                f"integer >= 0.")
