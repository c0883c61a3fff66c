"""Per-module rules (wna16_loader/formats/rules.py and each format's `rules`): the spec each module gets, matched as
its quantizer matches (GPTQModel `dynamic`, auto-round `extra_config`, compressed-tensors targets/ignore, AWQ)."""

from __future__ import annotations

import pytest

from wna16_loader.errors import ConfigError
from wna16_loader.formats import resolve_module_rules, resolve_quant_spec
from wna16_loader.formats.rules import Match, Rule, literal_pattern

EXPERT = "model.layers.1.mlp.experts.0.gate_proj"
OTHER = "model.layers.11.mlp.experts.0.gate_proj"


def _gptq(**kw) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, **kw}


def _ar(**kw) -> dict:
    return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
            "sym": True, "data_type": "int", **kw}


def _int(bits: int, group: int, **kw) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group, **kw}


def _ct(groups: dict, ignore: tuple[str, ...] = ()) -> dict:
    """A mixed-precision config, as llm-compressor writes it: every group names its format (default pack-quantized)."""
    return {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": list(ignore),
            "config_groups": {name: {"format": "pack-quantized", **group} for name, group in groups.items()}}


def _describe(qconfig: dict, module: str, modules: frozenset[str] = frozenset()) -> tuple[str, str]:
    found = resolve_module_rules(qconfig).resolve(module, modules)
    return (found.spec.describe() if found.spec is not None else f"refused: {found.refusal}"), found.origin


# ---------------------------------------------------------------- GPTQModel dynamic


@pytest.mark.parametrize("first,expected", [("-", "not quantized (float weights)"), ("+", "gptq 8-bit g64 sym")])
def test_dynamic_first_matching_rule_wins_in_json_order(first: str, expected: str) -> None:
    """GPTQModel (config.py `_resolve_dynamic_override`): rules are tried in the JSON's order, the first match wins,
    whether it is a `-:` or a `+:` rule."""
    rules = {"-:.*\\.layers\\.1\\..*": {}, "+:.*\\.layers\\.1\\..*": {"bits": 8, "group_size": 64}}
    ordered = dict(sorted(rules.items(), key=lambda kv: kv[0][0] != first))
    assert _describe(_gptq(dynamic=ordered), EXPERT)[0] == expected


def test_dynamic_regex_is_anchored_at_the_start_only() -> None:
    qconfig = _gptq(dynamic={"-:layers\\.1\\..*": {}, ".*layers\\.1\\.mlp": {"bits": 8}})
    assert _describe(qconfig, EXPERT) == ("gptq 8-bit g128 sym", "dynamic rule '.*layers\\\\.1\\\\.mlp' {'bits': 8}")
    assert _describe(qconfig, OTHER)[0] == "gptq 4-bit g128 sym"


def test_dynamic_pattern_without_regex_syntax_names_one_module() -> None:
    """A literal pattern is an exact name in GPTQModel (no prefix match): it reaches that module only."""
    qconfig = _gptq(dynamic={"-:model_x": {}, "+:model\\.layers\\.1\\.mlp\\.experts\\.0\\.gate_proj": {"bits": 8}})
    assert _describe(qconfig, EXPERT)[0] == "gptq 8-bit g128 sym"
    assert _describe(qconfig, "model_x")[0] == "not quantized (float weights)"
    assert _describe(qconfig, "model_x.y")[0] == "gptq 4-bit g128 sym"
    assert literal_pattern("a\\.b") == "a.b" and literal_pattern("a.b") is None and literal_pattern("a\\d") is None


def test_dynamic_overrides_every_field() -> None:
    qconfig = _gptq(dynamic={"+:.*": {"bits": 8, "group_size": 32, "sym": False, "desc_act": True}})
    assert _describe(qconfig, EXPERT)[0] == "gptq 8-bit g32 asym act-order"


def test_dynamic_bad_override_names_the_rule() -> None:
    with pytest.raises(ConfigError, match=r"dynamic\['\+:.\*'\]=8 must be an object of overrides"):
        resolve_module_rules(_gptq(dynamic={"+:.*": 8}))
    with pytest.raises(ConfigError, match=r"bits=3 is not supported"):
        resolve_module_rules(_gptq(dynamic={"+:.*": {"bits": 3}}))


def test_modules_to_not_convert_is_a_substring_test() -> None:
    """AWQ / GPTQ `modules_to_not_convert` (AutoAWQ's and transformers' `key in name`)."""
    for method in ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, _gptq()):
        qconfig = {**method, "modules_to_not_convert": ["layers.1.mlp", "lm_head"]}
        assert _describe(qconfig, EXPERT) == ("not quantized (float weights)",
                                              "modules_to_not_convert entry 'layers.1.mlp'")
        assert _describe(qconfig, OTHER)[0].endswith("4-bit g128 sym") or "asym" in _describe(qconfig, OTHER)[0]


# ---------------------------------------------------------------- auto-round extra_config


def test_extra_config_exact_key_beats_a_regex_key() -> None:
    qconfig = _ar(extra_config={".*experts.*": {"bits": 8}, EXPERT: {"bits": 16}})
    assert _describe(qconfig, EXPERT) == ("not quantized (float weights)", f"extra_config['{EXPERT}'] = {{'bits': 16}}")
    assert _describe(qconfig, OTHER)[0] == "gptq 8-bit g128 sym"


def test_extra_config_regex_keys_are_searched_in_order() -> None:
    qconfig = _ar(extra_config={"layers\\.1\\.": {"group_size": 32}, "experts": {"bits": 8}})
    assert _describe(qconfig, EXPERT)[0] == "gptq 4-bit g32 sym"  # re.search: found inside the name
    assert _describe(qconfig, OTHER)[0] == "gptq 8-bit g128 sym"


def test_extra_config_key_that_names_a_module_is_not_a_regex() -> None:
    """auto-round expands as regexes only the keys that are not module names of the model."""
    key = "model.layers.1.mlp.experts.0.gate"
    qconfig = _ar(extra_config={key: {"bits": 8}})
    assert _describe(qconfig, EXPERT)[0] == "gptq 8-bit g128 sym"  # no such module: searched as a regex
    assert _describe(qconfig, EXPERT, frozenset({key, EXPERT}))[0] == "gptq 4-bit g128 sym"


def test_extra_config_float_data_type_is_not_wna16() -> None:
    found = _describe(_ar(extra_config={EXPERT: {"bits": 8, "data_type": "fp"}}), EXPERT)
    assert found[0] == "refused: data_type='fp' at 8 bits is a float format, not WNA16 integer weights"


def test_block_name_to_quantize_leaves_other_modules_in_float() -> None:
    qconfig = _ar(block_name_to_quantize="model.layers", extra_config={"mtp.layers.0.mlp.experts.0.gate_proj": {}})
    assert _describe(qconfig, EXPERT)[0] == "gptq 4-bit g128 sym"
    assert _describe(qconfig, "mtp.layers.0.mlp.experts.0.gate_proj") == (
        "gptq 4-bit g128 sym", "extra_config['mtp.layers.0.mlp.experts.0.gate_proj'] = {}")  # an exact key wins
    assert _describe(qconfig, "mtp.layers.0.mlp.experts.1.gate_proj") == (
        "not quantized (float weights)", "block_name_to_quantize ['model.layers'] (modules outside it stay in float)")


def test_autoround_modules_to_not_convert_beats_extra_config() -> None:
    qconfig = _ar(modules_to_not_convert=["experts\\.0\\."], extra_config={EXPERT: {"bits": 8}})
    assert _describe(qconfig, EXPERT)[0] == "not quantized (float weights)"


# ---------------------------------------------------------------- compressed-tensors


def test_ct_targets_exact_then_regex_then_linear_ignore_first() -> None:
    """compressed-tensors (utils/match.py `match_targets`): exact names, then `re:` (re.match), then the class
    `Linear`; `ignore` is checked before any target."""
    qconfig = _ct({"a": {"targets": ["Linear"], "weights": _int(4, 128)},
                   "b": {"targets": ["re:.*layers\\.1\\."], "weights": _int(8, 64)},
                   "c": {"targets": [EXPERT], "weights": _int(8, 32)}},
                  ignore=("re:.*layers\\.1\\.mlp\\.experts\\.3\\.",))
    assert _describe(qconfig, EXPERT) == ("compressed-tensors 8-bit g32 sym", f"config_groups['c'] target '{EXPERT}'")
    assert _describe(qconfig, EXPERT.replace("gate", "up"))[0] == "compressed-tensors 8-bit g64 sym"
    assert _describe(qconfig, OTHER)[0] == "compressed-tensors 4-bit g128 sym"
    assert _describe(qconfig, EXPERT.replace(".0.", ".3."))[0] == "not quantized (float weights)"
    assert resolve_quant_spec(qconfig).group_size == 128  # the top-level spec: the group that targets Linear


def test_ct_module_no_target_matches_stays_float() -> None:
    qconfig = _ct({"a": {"targets": ["re:.*self_attn.*"], "weights": _int(4, 128)}})
    assert _describe(qconfig, EXPERT) == ("not quantized (float weights)", "no config_groups target matches it")


def test_ct_regex_target_is_anchored_at_the_start() -> None:
    qconfig = _ct({"a": {"targets": ["re:experts"], "weights": _int(4, 128)}})
    assert _describe(qconfig, EXPERT)[0] == "not quantized (float weights)"


@pytest.mark.parametrize("group,why", [
    ({"format": "float-quantized", "weights": {"num_bits": 8, "type": "float"}},
     "compressed-tensors group 'g' has format='float-quantized'; only 'pack-quantized' integer weights are WNA16"),
    ({"format": "int-quantized", "weights": _int(8, 128)},
     "compressed-tensors group 'g' has format='int-quantized'; only 'pack-quantized' integer weights are WNA16"),
    ({"format": "pack-quantized", "weights": _int(4, 128), "input_activations": {"num_bits": 8, "type": "int"}},
     "compressed-tensors group 'g' quantizes input activations (8-bit int); WNA16 keeps activations in 16 bits"),
])
def test_ct_other_schemes_are_refused_only_where_they_cover_a_module(group: dict, why: str) -> None:
    qconfig = _ct({"g": {**group, "targets": ["re:.*experts.*"]},
                   "w": {"format": "pack-quantized", "targets": ["Linear"], "weights": _int(4, 128)}})
    assert _describe(qconfig, EXPERT)[0] == f"refused: {why}"
    assert _describe(qconfig, "model.layers.1.self_attn.q_proj")[0] == "compressed-tensors 4-bit g128 sym"


def test_ct_without_a_wna16_group_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"group 'g' has format='float-quantized'; only 'pack-quantized'"):
        resolve_quant_spec(_ct({"g": {"format": "float-quantized", "targets": ["Linear"], "weights": {}}}))


def test_ct_a_target_listed_twice_belongs_to_the_later_group() -> None:
    qconfig = _ct({"a": {"format": "pack-quantized", "targets": ["Linear"], "weights": _int(4, 128)},
                   "b": {"format": "pack-quantized", "targets": ["Linear"], "weights": _int(8, 128)}})
    assert _describe(qconfig, EXPERT)[0] == "compressed-tensors 8-bit g128 sym"


def test_rule_kinds() -> None:
    spec = resolve_quant_spec(_gptq())
    assert Rule(Match.OUTSIDE, "model.layers,mtp", spec, "x").matches("lm_head")
    assert not Rule(Match.OUTSIDE, "model.layers,mtp", spec, "x").matches("mtp.layers.0.x")
    assert Rule(Match.CONTAINS, "mlp.gate", spec, "x").matches("model.layers.0.mlp.gate_up_proj")
    assert Rule(Match.ANY, "Linear", spec, "x").matches("anything")


@pytest.mark.parametrize("qconfig,message", [
    (_gptq(dynamic=["-:.*"]), r"dynamic=\['-:\.\*'\] must be an object mapping module-name patterns to overrides"),
    (_ar(extra_config=[EXPERT]), r"extra_config=\[.*\] must be an object mapping module names \(or regexes\)"),
    (_ar(extra_config={EXPERT: 16}), rf"extra_config\['{EXPERT}'\]=16 must be an object"),
])
def test_malformed_rules_are_config_errors(qconfig: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_module_rules(qconfig)
