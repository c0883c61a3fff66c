"""resolve_quant_spec for AWQ, GPTQ, compressed-tensors and AutoRound configs, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wna16_loader.errors import ConfigError
from wna16_loader.formats import (
    FORMATS,
    Dim,
    QuantSpec,
    Role,
    awq,
    compressed_tensors,
    gptq,
    resolve_module_rules,
    resolve_quant_spec,
)

FIXTURE_CONFIGS = sorted({p.parent.name if p.parent.name != "checkpoint" else p.parent.parent.name: p
                          for p in [*(Path(__file__).parents[1] / "fixtures").glob("*/checkpoint/config.json"),
                                    *Path("/work/shared/fixtures").glob("*/config.json")]}.items())


def _awq(**kw) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", **kw}


def _gptq(**kw) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, **kw}


def _ct(weights: dict | None = None, *, fmt="pack-quantized", targets=("Linear",), ignore=("lm_head",),
        groups: dict | None = None) -> dict:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
         "actorder": None, **(weights or {})}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": groups if groups is not None else {"group_0": {"targets": list(targets), "weights": w}},
            "ignore": list(ignore)}


def _ar(**kw) -> dict:
    return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
            "sym": True, "data_type": "int", **kw}


def _suffixes(spec: QuantSpec) -> dict[Role, str]:
    return {lay.role: lay.suffix for lay in spec.layouts}


# ---------------------------------------------------------------- AWQ


def test_awq_basic() -> None:
    spec = resolve_quant_spec(_awq())
    assert spec.format_name == "awq"
    assert (spec.bits, spec.group_size, spec.symmetric, spec.act_order) == (4, 128, False, False)
    assert spec.zero_word_bias is False
    assert spec.checkpoint_format == "gemm"
    assert spec.layouts == awq.LAYOUTS
    assert _suffixes(spec) == {Role.QWEIGHT: "qweight", Role.ZEROS: "qzeros", Role.SCALES: "scales"}
    qweight = spec.layout(Role.QWEIGHT)
    assert qweight.dims == (Dim.K, Dim.N) and qweight.packed is Dim.N
    assert qweight.slot_order == (0, 2, 4, 6, 1, 3, 5, 7)
    assert spec.layout(Role.ZEROS).slot_order == (0, 2, 4, 6, 1, 3, 5, 7)
    assert spec.pack_factor == 8


def test_awq_autoawq_key_spelling() -> None:
    spec = resolve_quant_spec({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                               "version": "GEMM"})
    assert (spec.bits, spec.group_size) == (4, 64)


def test_awq_zero_point_false_is_symmetric() -> None:
    spec = resolve_quant_spec(_awq(zero_point=False))
    assert spec.symmetric is True
    assert spec.required(spec.layout(Role.ZEROS)) is False


def test_awq_zero_point_default_true() -> None:
    cfg = _awq()
    del cfg["zero_point"]
    assert resolve_quant_spec(cfg).symmetric is False


def test_awq_version_default_gemm() -> None:
    cfg = _awq()
    del cfg["version"]
    assert resolve_quant_spec(cfg).checkpoint_format == "gemm"


@pytest.mark.parametrize("version", ["gemv", "GEMV_fast", "exllama", "ipex"])
def test_awq_version_not_gemm(version: str) -> None:
    with pytest.raises(ConfigError, match=rf"AWQ version={version.lower()!r} is not supported; only \['gemm'\]"):
        resolve_quant_spec(_awq(version=version))


@pytest.mark.parametrize("key", ["bits", "w_bit"])
def test_awq_8_bit(key: str) -> None:
    cfg = _awq()
    del cfg["bits"]
    cfg[key] = 8
    with pytest.raises(ConfigError, match=r"AWQ packing with bits=8 is not supported"):
        resolve_quant_spec(cfg)


def test_awq_missing_bits_names_keys() -> None:
    cfg = _awq()
    del cfg["bits"]
    with pytest.raises(ConfigError, match=r"none of the keys \['bits', 'w_bit'\] is present"):
        resolve_quant_spec(cfg)


def test_awq_missing_group_size_names_keys() -> None:
    cfg = _awq()
    del cfg["group_size"]
    with pytest.raises(ConfigError, match=r"none of the keys \['group_size', 'q_group_size'\] is present"):
        resolve_quant_spec(cfg)


def test_awq_non_bool_zero_point() -> None:
    with pytest.raises(ConfigError, match=r"zero_point='yes' must be true or false"):
        resolve_quant_spec(_awq(zero_point="yes"))


# ---------------------------------------------------------------- GPTQ


def test_gptq_v1_default() -> None:
    spec = resolve_quant_spec(_gptq())
    assert spec.format_name == "gptq"
    assert spec.checkpoint_format == "gptq"
    assert spec.zero_word_bias is True
    assert spec.layouts == gptq.LAYOUTS
    assert _suffixes(spec) == {Role.QWEIGHT: "qweight", Role.ZEROS: "qzeros", Role.SCALES: "scales",
                               Role.G_IDX: "g_idx"}
    assert spec.layout(Role.QWEIGHT).packed is Dim.K and spec.layout(Role.QWEIGHT).slot_order is None


def test_gptq_explicit_v1() -> None:
    assert resolve_quant_spec(_gptq(checkpoint_format="gptq")).zero_word_bias is True


def test_gptq_v2_has_no_word_bias() -> None:
    spec = resolve_quant_spec(_gptq(checkpoint_format="gptq_v2"))
    assert spec.zero_word_bias is False
    assert spec.checkpoint_format == "gptq_v2"


@pytest.mark.parametrize("fmt", ["marlin", "bitblas", "gptq_v3"])
def test_gptq_unknown_checkpoint_format(fmt: str) -> None:
    with pytest.raises(ConfigError, match=rf"GPTQ checkpoint_format={fmt!r} is not supported; expected one of "
                                          r"\['gptq', 'gptq_v2'\]"):
        resolve_quant_spec(_gptq(checkpoint_format=fmt))


def test_gptq_desc_act_with_groups_is_act_order() -> None:
    spec = resolve_quant_spec(_gptq(desc_act=True))
    assert spec.act_order is True
    assert spec.required(spec.layout(Role.G_IDX)) is True


def test_gptq_desc_act_channelwise_is_not_act_order() -> None:
    spec = resolve_quant_spec(_gptq(desc_act=True, group_size=-1))
    assert spec.group_size == -1
    assert spec.act_order is False
    assert spec.required(spec.layout(Role.G_IDX)) is False


def test_gptq_group_size_defaults_to_channelwise() -> None:
    cfg = _gptq()
    del cfg["group_size"]
    assert resolve_quant_spec(cfg).group_size == -1


def test_gptq_asymmetric_and_8_bit() -> None:
    spec = resolve_quant_spec(_gptq(sym=False, bits=8))
    assert (spec.bits, spec.symmetric, spec.pack_factor, spec.implicit_zero) == (8, False, 4, 128)
    assert spec.required(spec.layout(Role.ZEROS)) is True


def test_gptq_bits_not_int() -> None:
    with pytest.raises(ConfigError, match=r"bits='4' must be an integer"):
        resolve_quant_spec(_gptq(bits="4"))


# ---------------------------------------------------------------- compressed-tensors


def test_ct_group() -> None:
    spec = resolve_quant_spec(_ct())
    assert spec.format_name == "compressed-tensors"
    assert (spec.bits, spec.group_size, spec.symmetric, spec.act_order) == (4, 128, True, False)
    assert spec.checkpoint_format == "pack-quantized"
    assert spec.zero_word_bias is False
    assert spec.layouts == compressed_tensors.LAYOUTS
    assert _suffixes(spec) == {Role.QWEIGHT: "weight_packed", Role.SCALES: "weight_scale",
                               Role.ZEROS: "weight_zero_point", Role.G_IDX: "weight_g_idx",
                               Role.SHAPE: "weight_shape"}
    assert spec.layout(Role.QWEIGHT).dims == (Dim.N, Dim.K) and spec.layout(Role.QWEIGHT).packed is Dim.K


def test_ct_channel_strategy() -> None:
    spec = resolve_quant_spec(_ct({"strategy": "channel", "group_size": None, "num_bits": 8}))
    assert (spec.bits, spec.group_size) == (8, -1)


def test_ct_channel_with_actorder_group_is_not_act_order() -> None:
    spec = resolve_quant_spec(_ct({"strategy": "channel", "group_size": None, "actorder": "group"}))
    assert spec.act_order is False


@pytest.mark.parametrize("actorder,expected", [("group", True), ("weight", False), ("static", False),
                                               (None, False)])
def test_ct_actorder(actorder, expected: bool) -> None:
    assert resolve_quant_spec(_ct({"actorder": actorder})).act_order is expected


def test_ct_unknown_actorder() -> None:
    with pytest.raises(ConfigError, match=r"group 'group_0' actorder='dynamic' is unknown"):
        resolve_quant_spec(_ct({"actorder": "dynamic"}))


@pytest.mark.parametrize("symmetric", [True, False])
def test_ct_symmetric(symmetric: bool) -> None:
    assert resolve_quant_spec(_ct({"symmetric": symmetric})).symmetric is symmetric


def test_ct_multiple_groups_same_scheme_merge_targets() -> None:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    spec = resolve_quant_spec(_ct(groups={"a": {"targets": ["re:.*gate_proj"], "weights": w},
                                          "b": {"targets": ["re:.*down_proj"], "weights": dict(w)}}))
    assert spec.group_size == 64


@pytest.mark.parametrize("fmt", ["float-quantized", "naive-quantized", "int-quantized", "marlin-24", None])
def test_ct_not_pack_quantized(fmt) -> None:
    with pytest.raises(ConfigError, match=rf"group 'group_0' has format={fmt!r}; only 'pack-quantized'"):
        resolve_quant_spec(_ct(fmt=fmt))


def test_ct_group_format_overrides_top_level() -> None:
    cfg = _ct(fmt="float-quantized")
    cfg["config_groups"]["group_0"]["format"] = "pack-quantized"
    assert resolve_quant_spec(cfg).bits == 4


def test_ct_float_weights() -> None:
    with pytest.raises(ConfigError, match=r"weights type='float'; expected 'int'"):
        resolve_quant_spec(_ct({"type": "float"}))


def test_ct_unsupported_strategy() -> None:
    with pytest.raises(ConfigError, match=r"strategy='tensor' is not supported; expected one of "
                                          r"\['channel', 'group'\]"):
        resolve_quant_spec(_ct({"strategy": "tensor"}))


def test_ct_no_config_groups() -> None:
    with pytest.raises(ConfigError, match=r"compressed-tensors config has no config_groups"):
        resolve_quant_spec(_ct(groups={}))


def test_ct_group_strategy_without_group_size() -> None:
    with pytest.raises(ConfigError, match=r"needs integer num_bits and group_size, found num_bits=4, group_size=None"):
        resolve_quant_spec(_ct({"group_size": None}))


# ---------------------------------------------------------------- AutoRound


@pytest.mark.parametrize("method", ["auto-round", "intel/auto-round"])
@pytest.mark.parametrize("packing", ["auto_round:auto_gptq", "auto_gptq", "auto_round:gptqmodel"])
def test_autoround_gptq_packing(method: str, packing: str) -> None:
    spec = resolve_quant_spec(_ar(quant_method=method, packing_format=packing))
    assert spec.format_name == "gptq"
    assert spec.layouts == gptq.LAYOUTS
    assert spec.zero_word_bias is True
    assert spec.act_order is False
    assert spec.checkpoint_format == packing
    assert (spec.bits, spec.group_size, spec.symmetric) == (4, 128, True)


@pytest.mark.parametrize("method", ["auto-round", "intel/auto-round"])
@pytest.mark.parametrize("packing", ["auto_awq", "auto_round:auto_awq"])
def test_autoround_awq_packing(method: str, packing: str) -> None:
    spec = resolve_quant_spec(_ar(quant_method=method, packing_format=packing, sym=False))
    assert spec.format_name == "awq"
    assert spec.layouts == awq.LAYOUTS
    assert spec.zero_word_bias is False
    assert spec.symmetric is False


@pytest.mark.parametrize("bits", [4, 8])
def test_autoround_own_packing_is_gptq_layout_with_true_zero_points(bits: int) -> None:
    """auto-round 0.15 `packing_format: "auto_round"`: qweight packed along K as GPTQ, qzeros hold z (no z - 1)."""
    spec = resolve_quant_spec(_ar(packing_format="auto_round", bits=bits, group_size=64, sym=False))
    assert spec.format_name == "gptq"
    assert spec.layouts == gptq.LAYOUTS
    assert spec.zero_word_bias is False
    assert spec.checkpoint_format == "auto_round"
    assert (spec.bits, spec.group_size, spec.symmetric, spec.act_order) == (bits, 64, False, False)


def test_autoround_awq_packing_8_bit() -> None:
    with pytest.raises(ConfigError, match=r"AWQ packing with bits=8 is not supported"):
        resolve_quant_spec(_ar(packing_format="auto_awq", bits=8))


@pytest.mark.parametrize("packing", ["auto_round:fp8", "auto_round:marlin", "awq", None])
def test_autoround_unknown_packing(packing) -> None:
    with pytest.raises(ConfigError, match=rf"AutoRound packing_format={packing!r} is not supported; expected one of "
                                          r"\['auto_gptq', 'auto_round:auto_gptq', 'auto_round:gptqmodel', "
                                          r"'auto_awq', 'auto_round:auto_awq', 'auto_round'\]"):
        resolve_quant_spec(_ar(packing_format=packing))


# ---------------------------------------------------------------- shared errors


@pytest.mark.parametrize("method", ["bitsandbytes", "fp8", "hqq", None, "GPTQ"])
def test_unknown_quant_method(method) -> None:
    hint = r"did you mean 'gptq'\? " if method == "GPTQ" else ""  # a close spelling is suggested
    with pytest.raises(ConfigError, match=rf"quant_method={method!r} is not a WNA16 format this package loads; "
                                          rf"{hint}expected one of \['awq', 'gptq', 'compressed-tensors', 'auto-round', "
                                          r"'intel/auto-round'\]"):
        resolve_quant_spec({"quant_method": method, "bits": 4, "group_size": 128})


def test_quantization_config_not_a_dict() -> None:
    with pytest.raises(ConfigError, match=r"quantization_config must be a JSON object, found list"):
        resolve_quant_spec([])  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [_gptq, lambda **kw: _ct({"num_bits": kw["bits"]}),
                                  lambda **kw: _ar(**kw)], ids=["gptq", "ct", "autoround"])
@pytest.mark.parametrize("bits", [2, 3, 5, 16])
def test_bits_not_4_or_8(make, bits: int) -> None:
    with pytest.raises(ConfigError, match=rf"bits={bits} is not supported; WNA16 experts must be 4- or 8-bit"):
        resolve_quant_spec(make(bits=bits))


@pytest.mark.parametrize("group_size", [24, 8, 0, 100, -2, 1])
def test_group_size_not_power_of_two_at_least_16(group_size: int) -> None:
    with pytest.raises(ConfigError, match=rf"group_size={group_size} is not supported; use a power of two >= 16 "
                                          r"or -1"):
        resolve_quant_spec(_gptq(group_size=group_size))
    with pytest.raises(ConfigError, match=rf"group_size={group_size} is not supported"):
        resolve_quant_spec(_awq(group_size=group_size))
    with pytest.raises(ConfigError, match=rf"group_size={group_size} is not supported"):
        resolve_quant_spec(_ct({"group_size": group_size}))


@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256, -1])
def test_supported_group_sizes(group_size: int) -> None:
    assert resolve_quant_spec(_gptq(group_size=group_size)).group_size == group_size


def test_every_format_round_trips_through_to_config() -> None:
    for decl in FORMATS:
        for bits, group_size, sym, act in [(4, 128, True, False), (4, 32, False, False), (8, -1, True, False),
                                           (8, 64, False, True)]:
            if decl.name in ("awq", "auto-round") and (act or (decl.name == "awq" and bits == 8)):
                continue
            spec = resolve_quant_spec(decl.to_config(bits, group_size, sym, act))
            assert (spec.bits, spec.group_size, spec.symmetric, spec.act_order) == (
                bits, group_size, sym, act and group_size != -1), (decl.name, bits, group_size, sym, act)


# ---------------------------------------------------------------- real fixture configs

EXPECTED_FIXTURES = {
    "awq_w4_g32": dict(format_name="awq", bits=4, group_size=32, symmetric=False, act_order=False,
                       zero_word_bias=False),
    "gptq_w4_g32_actorder_asym": dict(format_name="gptq", bits=4, group_size=32, symmetric=False, act_order=True,
                                      zero_word_bias=True),
    "gptq_w4_g32_zero_edge": dict(format_name="gptq", bits=4, group_size=32, symmetric=False, act_order=False,
                                  zero_word_bias=True),
    "ct_w4_g32_asym": dict(format_name="compressed-tensors", bits=4, group_size=32, symmetric=False,
                           act_order=False, zero_word_bias=False),
    "ct_w8_channel_sym": dict(format_name="compressed-tensors", bits=8, group_size=-1, symmetric=True,
                              act_order=False, zero_word_bias=False),
    "autoround_w8_g64_asym": dict(format_name="gptq", bits=8, group_size=64, symmetric=False, act_order=False,
                                  zero_word_bias=False),
    # the mixed fixtures: their top-level spec (each layer's own: tests/formats/test_rules.py)
    "gptq_dynamic_mixed": dict(format_name="gptq", bits=4, group_size=32, symmetric=False, act_order=False,
                               zero_word_bias=True),
    "ct_multigroup_mixed": dict(format_name="compressed-tensors", bits=4, group_size=32, symmetric=False,
                                act_order=False, zero_word_bias=False),
    "autoround_layer_config_mixed": dict(format_name="gptq", bits=4, group_size=32, symmetric=True, act_order=False,
                                         zero_word_bias=True),
}


def test_fixture_configs_found() -> None:
    if not FIXTURE_CONFIGS:
        pytest.skip("no fixture checkpoints on this machine")
    assert {name for name, _ in FIXTURE_CONFIGS} == set(EXPECTED_FIXTURES)


@pytest.mark.parametrize("name,path", FIXTURE_CONFIGS, ids=[n for n, _ in FIXTURE_CONFIGS])
def test_real_fixture_quantization_config(name: str, path: Path) -> None:
    qconfig = json.loads(path.read_text())["quantization_config"]
    spec = resolve_quant_spec(qconfig)
    for attr, value in EXPECTED_FIXTURES[name].items():
        assert getattr(spec, attr) == value, (name, attr)
    if spec.format_name == "compressed-tensors":
        rules = resolve_module_rules(qconfig)
        assert rules.resolve("model.layers.0.mlp.experts.3.down_proj").spec == spec
        assert not rules.resolve("model.layers.0.mlp.gate").spec.quantized
        assert not rules.resolve("lm_head").spec.quantized
