"""select_moe_layers: every MoE-layer rule, their order, disagreements, and malformed values."""

from __future__ import annotations

import pytest

from wna16_loader.errors import ConfigError
from wna16_loader.models.layer_rules import RULES, compact, layer_count_from_lists, select_moe_layers


def layers(config: dict, count: int) -> tuple[tuple[int, ...], str | None]:
    found, rule = select_moe_layers(config, count)
    return found, None if rule is None else rule.name


@pytest.mark.parametrize("config,count,expected,rule", [
    ({}, 3, (0, 1, 2), None),
    ({"mlp_layer_types": ["dense", "sparse", "moe", "hash_moe"]}, 4, (1, 2, 3), "mlp_layer_types"),
    ({"layers_block_type": ["mamba", "moe", "attention", "mlp", "moe"]}, 5, (1, 4), "layers_block_type"),
    ({"hybrid_override_pattern": "ME*-E"}, 5, (1, 4), "hybrid_override_pattern"),
    ({"moe_layers": [3, 1]}, 4, (1, 3), "moe_layers"),
    ({"first_k_dense_replace": 2}, 5, (2, 3, 4), "first_k_dense_replace"),
    ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 8, (2, 4, 6), "first_k_dense_replace"),
    ({"num_dense_layers": 2}, 4, (2, 3), "num_dense_layers"),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, 8, (1, 5, 7), "decoder_sparse_step"),
    ({"mlp_only_layers": [0, 2]}, 4, (1, 3), "decoder_sparse_step"),
    ({"interleave_moe_layer_step": 2}, 6, (1, 3, 5), "interleave_moe_layer_step"),
    ({"expert_layer_period": 2, "expert_layer_offset": 1}, 6, (1, 3, 5), "expert_layer_period"),
    ({"moe_layer_start_index": 1, "moe_layer_end_index": 4, "moe_layer_interval": 2}, 8, (1, 3), "moe_layer_start_index"),
    ({"moe_layer_start_index": 1, "moe_layer_end_index": -1}, 4, (1, 2, 3), "moe_layer_start_index"),
    ({"enable_moe_block": False}, 3, (), "enable_moe_block"),
    ({"enable_moe_block": True}, 2, (0, 1), "enable_moe_block"),
    ({"first_k_dense_replace": None, "moe_layers": None}, 2, (0, 1), None),  # null is absent
])
def test_each_rule(config, count, expected, rule):
    assert layers(config, count) == (expected, rule)


def test_explicit_list_wins_and_agreeing_rules_pass():
    config = {"mlp_layer_types": ["dense"] * 3 + ["sparse"] * 5, "first_k_dense_replace": 3}
    assert layers(config, 8) == ((3, 4, 5, 6, 7), "mlp_layer_types")
    llama4 = {"moe_layers": [1, 3, 5], "interleave_moe_layer_step": 2}
    assert layers(llama4, 6) == ((1, 3, 5), "moe_layers")


def test_disagreeing_rules_name_both_keys():
    with pytest.raises(ConfigError, match=r"config\.json: moe_layers=\[1, 3\] makes layers \[1, 3\] MoE layers, but "
                                          r"interleave_moe_layer_step=1 gives \[0-3\] \(4 layers\); the two keys "
                                          r"disagree\. Fix or remove one of them\."):
        select_moe_layers({"moe_layers": [1, 3], "interleave_moe_layer_step": 1}, 4)


def test_rule_order_is_explicit_lists_first():
    explicit = [rule.explicit for rule in RULES]
    assert explicit == sorted(explicit, reverse=True)
    assert [r.name for r in RULES][:4] == ["mlp_layer_types", "layers_block_type", "hybrid_override_pattern",
                                           "moe_layers"]


@pytest.mark.parametrize("config,count,match", [
    ({"mlp_layer_types": ["dense", "sparse"]}, 3, r"mlp_layer_types must list one entry per decoder layer \(3\), "
                                                  r"found 2"),
    ({"mlp_layer_types": ["dense", "expert"]}, 2, r"mlp_layer_types\[1\]='expert' is not a known layer type; "
                                                  r"MoE: \['hash_moe', 'moe', 'sparse'\], other: \['dense'\]"),
    ({"hybrid_override_pattern": "MX"}, 2, r"hybrid_override_pattern\[1\]='X' is not a known layer type"),
    ({"layers_block_type": "moe"}, 2, r"layers_block_type must list one entry per decoder layer \(2\), found 3"),
    ({"moe_layers": [0, 4]}, 4, r"moe_layers names layers \[4\] outside 0\.\.3"),
    ({"moe_layers": "0,1"}, 4, r"moe_layers='0,1' must be a list of layer indices"),
    ({"first_k_dense_replace": -1}, 4, r"first_k_dense_replace=-1 must be an integer >= 0"),
    ({"moe_layer_freq": 0}, 4, r"moe_layer_freq=0 must be an integer >= 1"),
    ({"decoder_sparse_step": 1.5}, 4, r"decoder_sparse_step=1\.5 must be an integer >= 1"),
    ({"mlp_only_layers": "0,1"}, 2, r"mlp_only_layers='0,1' must be a list of layer indices"),
    ({"enable_moe_block": "yes"}, 2, r"enable_moe_block='yes' must be true or false"),
])
def test_malformed_values(config, count, match):
    with pytest.raises(ConfigError, match=match):
        select_moe_layers(config, count)


def test_layer_count_from_lists():
    assert layer_count_from_lists({"layers_block_type": ["moe", "mamba"]}) == (2, "layers_block_type")
    assert layer_count_from_lists({"hybrid_override_pattern": "MEM"}) == (3, "hybrid_override_pattern")
    assert layer_count_from_lists({"moe_layers": [1]}) is None


def test_compact():
    assert compact(()) == "[]"
    assert compact((0,)) == "[0]"
    assert compact((0, 1, 2, 5, 7, 8, 9)) == "[0-2, 5, 7-9]"


def test_hash_routed_layers_are_moe_layers() -> None:
    """DeepSeek-V4's published num_hash_layers: the first layers route by token id, all layers are MoE layers."""
    layers, rule = select_moe_layers({"num_hash_layers": 3}, 5)
    assert (layers, rule.name) == ((0, 1, 2, 3, 4), "num_hash_layers")
    with pytest.raises(ConfigError, match=r"config\.json: num_hash_layers=6 is more than the decoder's 5 layers\."):
        select_moe_layers({"num_hash_layers": 6}, 5)
