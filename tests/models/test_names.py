"""parse_expert_name: every root, module, projection alias, stacked tensors and non-expert names; the
ExpertNameParser (one regex match per name shape) returns what it returns for every name."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wna16_loader.models.names import (
    EXPERTS,
    MODULES,
    PROJ_ALIASES,
    ROOTS,
    ExpertNameParser,
    ExpertTensorKey,
    Proj,
    Source,
    experts_prefix_for,
    layer_of_prefix,
    name_shape,
    parse_expert_name,
    prefix_at_layer,
    shared_expert_key,
    shared_prefix,
)

ALL_ROOTS = ("model.layers", "model.language_model.layers", "language_model.model.layers", "backbone.layers",
             "mtp.layers", "layers", "mtp", "transformer.blocks", "thinker.model.layers", "model.mtp_layers")
# mtp.layers: Qwen's MTP tree; layers, mtp: DeepSeek-V4 as published; transformer.blocks: DBRX; thinker: Qwen3-Omni;
# model.mtp_layers: HY-V4's MTP tree
ALL_MODULES = ("mlp", "block_sparse_moe", "moe", "feed_forward", "mixer", "ffn", None)
ALIASES = {
    "gate_proj": Source.GATE, "w1": Source.GATE,
    "up_proj": Source.UP, "w3": Source.UP, "v1": Source.UP,
    "down_proj": Source.DOWN, "w2": Source.DOWN,
    "gate_up_proj": Source.GATE_UP,
}


def test_declared_tables_match_the_spelling_this_file_tests() -> None:
    assert set(ROOTS) == set(ALL_ROOTS)
    assert set(MODULES) == {m for m in ALL_MODULES if m}
    assert PROJ_ALIASES == ALIASES
    assert EXPERTS == ("experts", "experts.mlp")


def test_dbrx_experts_sit_under_experts_mlp() -> None:
    """GPTQModel's per-expert DBRX modules: `transformer.blocks.L.ffn.experts.mlp.E.{w1, v1, w2}`."""
    key = parse_expert_name("transformer.blocks.3.ffn.experts.mlp.15.v1.qweight")
    assert key == ExpertTensorKey(name="transformer.blocks.3.ffn.experts.mlp.15.v1.qweight",
                                  experts_prefix="transformer.blocks.3.ffn.experts.mlp", layer=3, expert=15,
                                  source=Source.UP, suffix="qweight")
    assert experts_prefix_for("transformer.blocks", 3, "ffn", "experts.mlp") == key.experts_prefix


@pytest.mark.parametrize("root", ALL_ROOTS)
@pytest.mark.parametrize("module", ALL_MODULES)
@pytest.mark.parametrize("proj", sorted(ALIASES))
def test_per_expert_name_every_root_module_and_alias(root: str, module: str | None, proj: str) -> None:
    middle = f".{module}" if module else ""
    prefix = f"{root}.17{middle}.experts"
    name = f"{prefix}.42.{proj}.qweight"
    key = parse_expert_name(name)
    assert key == ExpertTensorKey(name=name, experts_prefix=prefix, layer=17, expert=42,
                                  source=ALIASES[proj], suffix="qweight")
    assert key.module_name == f"{prefix}.42.{proj}"
    assert experts_prefix_for(root, 17, module) == prefix


@pytest.mark.parametrize("root", ALL_ROOTS)
@pytest.mark.parametrize("module", ALL_MODULES)
@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj", "gate_proj"])
def test_stacked_name_without_expert_index(root: str, module: str | None, proj: str) -> None:
    middle = f".{module}" if module else ""
    prefix = f"{root}.0{middle}.experts"
    name = f"{prefix}.{proj}.qweight"
    key = parse_expert_name(name)
    assert key is not None
    assert key.expert is None
    assert key.layer == 0
    assert key.experts_prefix == prefix
    assert key.source is ALIASES[proj]
    assert key.suffix == "qweight"
    assert key.module_name == f"{prefix}.{proj}"


def test_stacked_gate_up_exact_fields() -> None:
    name = "model.layers.0.mlp.experts.gate_up_proj.qweight"
    key = parse_expert_name(name)
    assert key == ExpertTensorKey(name=name, experts_prefix="model.layers.0.mlp.experts", layer=0, expert=None,
                                  source=Source.GATE_UP, suffix="qweight")
    assert key.module_name == "model.layers.0.mlp.experts.gate_up_proj"
    assert key.source.projs == (Proj.GATE, Proj.UP)


def test_gemma4_style_name_without_module() -> None:
    name = "model.layers.3.experts.5.gate_proj.qweight"
    key = parse_expert_name(name)
    assert key is not None
    assert key.experts_prefix == "model.layers.3.experts"
    assert key.layer == 3
    assert key.expert == 5
    assert key.source is Source.GATE
    assert key.suffix == "qweight"
    assert key.module_name == "model.layers.3.experts.5.gate_proj"


def test_gemma4_language_model_root() -> None:
    key = parse_expert_name("model.language_model.layers.29.experts.127.down_proj.scales")
    assert key is not None
    assert (key.experts_prefix, key.layer, key.expert, key.source, key.suffix) == (
        "model.language_model.layers.29.experts", 29, 127, Source.DOWN, "scales")


@pytest.mark.parametrize("suffix", ["qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                                    "weight_zero_point", "weight_g_idx", "weight_shape"])
def test_every_format_suffix(suffix: str) -> None:
    name = f"model.layers.2.block_sparse_moe.experts.7.w2.{suffix}"
    key = parse_expert_name(name)
    assert key is not None
    assert key.suffix == suffix
    assert key.source is Source.DOWN
    assert key.module_name == "model.layers.2.block_sparse_moe.experts.7.w2"


def test_multi_digit_layer_and_expert() -> None:
    key = parse_expert_name("language_model.model.layers.123.moe.experts.255.w3.qzeros")
    assert key is not None
    assert (key.layer, key.expert, key.source) == (123, 255, Source.UP)
    assert key.experts_prefix == "language_model.model.layers.123.moe.experts"


def test_source_projs() -> None:
    assert Source.GATE.projs == (Proj.GATE,)
    assert Source.UP.projs == (Proj.UP,)
    assert Source.DOWN.projs == (Proj.DOWN,)
    assert Source.GATE_UP.projs == (Proj.GATE, Proj.UP)


NON_EXPERT_NAMES = [
    "model.layers.0.mlp.gate.weight",  # router
    "model.layers.0.block_sparse_moe.gate.weight",  # Mixtral router
    "model.layers.0.mlp.gate.e_score_correction_bias",  # DeepSeek-V3 router bias
    "model.layers.0.mlp.shared_experts.gate_proj.qweight",  # DeepSeek shared experts
    "model.layers.0.mlp.shared_expert.up_proj.qweight",  # Qwen2-MoE shared expert
    "model.layers.0.mlp.shared_expert_gate.weight",
    "model.layers.0.self_attn.q_proj.qweight",  # attention
    "model.layers.0.self_attn.o_proj.weight_packed",
    "model.layers.0.mlp.gate_proj.qweight",  # dense MLP
    "model.layers.0.mlp.down_proj.qweight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.mlp.experts.0.gate_proj",  # no suffix
    "model.layers.0.mlp.experts.0.gate_proj.qweight.extra",  # trailing component
    "transformer.layers.0.mlp.experts.0.gate_proj.qweight",  # unknown root
    "prefix.model.layers.0.mlp.experts.0.gate_proj.qweight",  # not anchored at the start
    "model.layers.0.mlp.experts.0.o_proj.qweight",  # not an expert projection
    "model.layers.0.attention.experts.0.gate_proj.qweight",  # unknown module
    "model.layers.x.mlp.experts.0.gate_proj.qweight",  # non-numeric layer
    "model.layers.0.mlp.experts.a.gate_proj.qweight",  # non-numeric expert
    "model.layers.0.mlp.experts.0.gate_proj.q-weight",  # bad suffix character
    "xbackbone.layers.0.mixer.experts.0.up_proj.qweight",  # a root must match in full
    "backbone.layers.0.mixerx.experts.0.up_proj.qweight",  # so must a module
    "backbone.layers.0.mixer.experts.0.up_projx.qweight",  # and a projection
    "backbone.layers.0.mixer.up_proj.qweight",  # Nemotron-H dense MLP
    "backbone.layers.0.mixer.shared_experts.up_proj.qweight",  # Nemotron-H shared expert
    "model.layers.0.mlps.0.gate_proj.qweight",  # LongCat dense MLPs
    "layers.0.ffn.shared_experts.w1.weight",  # DeepSeek-V4 shared expert
    "mtp.0.ffn.shared_experts.w2.weight",  # and its MTP layer's
    "xlayers.0.ffn.experts.0.w1.weight",  # a bare root matches in full too
    "model.mtp.0.ffn.experts.0.w1.weight",  # V4's MTP tree sits at the top
    "",
]


@pytest.mark.parametrize("name", NON_EXPERT_NAMES)
def test_non_expert_names_return_none(name: str) -> None:
    assert parse_expert_name(name) is None


@pytest.mark.parametrize("name,prefix,layer,expert,source", [
    ("backbone.layers.7.mixer.experts.3.up_proj.qweight", "backbone.layers.7.mixer.experts", 7, 3, Source.UP),
    ("model.layers.2.feed_forward.experts.1.w1.qweight", "model.layers.2.feed_forward.experts", 2, 1, Source.GATE),
    ("language_model.model.layers.0.feed_forward.experts.15.down_proj.scales",
     "language_model.model.layers.0.feed_forward.experts", 0, 15, Source.DOWN),
    ("layers.42.ffn.experts.255.w3.weight_packed", "layers.42.ffn.experts", 42, 255, Source.UP),  # DeepSeek-V4
    ("mtp.0.ffn.experts.7.w2.weight_scale", "mtp.0.ffn.experts", 0, 7, Source.DOWN),
    ("model.mtp_layers.0.mlp.experts.5.gate_proj.qweight", "model.mtp_layers.0.mlp.experts", 0, 5, Source.GATE),
])
def test_family_roots_and_modules_from_the_table(name, prefix, layer, expert, source) -> None:
    key = parse_expert_name(name)
    assert key is not None
    assert (key.experts_prefix, key.layer, key.expert, key.source) == (prefix, layer, expert, source)


def test_prefix_helpers() -> None:
    assert layer_of_prefix("backbone.layers.12.mixer.experts") == 12
    assert layer_of_prefix("model.layers.12.mlp") is None
    assert prefix_at_layer("backbone.layers.12.mixer.experts", 3) == "backbone.layers.3.mixer.experts"
    assert prefix_at_layer("model.language_model.layers.0.experts", 29) == "model.language_model.layers.29.experts"
    with pytest.raises(ValueError, match="is not an experts prefix"):
        prefix_at_layer("model.layers.1.mlp", 2)


# --- ExpertNameParser: the regex once per name shape, the same answers ---------------------------------------

def listed_names() -> list[str]:
    """Every name this file spells out, expert ids varied (a shape's later names come from its cache)."""
    names = list(NON_EXPERT_NAMES)
    for root in ALL_ROOTS:
        for module in ALL_MODULES:
            prefix = experts_prefix_for(root, 3, module)
            for proj in ALIASES:
                names += [f"{prefix}.{e}.{proj}.{suffix}" for e in (0, 7, 127) for suffix in ("qweight", "scales")]
                names.append(f"{prefix}.{proj}.qweight")
    return names


def test_parser_equals_parse_expert_name_on_every_listed_name() -> None:
    parse = ExpertNameParser()
    names = listed_names()
    for name in names + names[::-1]:
        assert parse(name) == parse_expert_name(name), name


def test_parser_keeps_what_the_regex_accepts_at_the_edges() -> None:
    parse = ExpertNameParser()
    for name in ("model.layers.0.mlp.experts.007.w1.qweight",  # leading zeros: expert 7
                 "model.layers.0.mlp.experts.\u0663.w1.qweight",  # a non-ASCII decimal digit (\\d matches it)
                 "model.layers.0.mlp.experts.3.w1.qweight\n",  # `$` matches before a final newline
                 "model.layers.0.mlp.experts.3.w1.q-weight", "model.layers.0.mlp.experts.3.w1.",
                 "5.gate_proj.qweight", ".5.gate_proj.qweight", "experts.5.gate_proj.qweight"):
        assert parse(name) == parse_expert_name(name), repr(name)
    assert parse("model.layers.0.mlp.experts.007.w1.qweight").expert == 7


SEGMENTS = st.sampled_from(["model", "language_model", "layers", "mlp", "moe", "experts", "0", "12", "007",
                            "\u0663", "x", "gate_proj", "w2", "gate_up_proj", "up_projx", "qweight", "scales",
                            "weight_packed", "q-weight", "", "qweight\n"])
SHARED = ExpertNameParser()  # one parser across examples: its cache must never answer for another shape


@given(st.lists(SEGMENTS, min_size=1, max_size=9))
def test_parser_equals_the_regex_on_generated_names(segments: list[str]) -> None:
    name = ".".join(segments)
    assert SHARED(name) == parse_expert_name(name)
    numbered = ".".join(["model", "layers", "4", "mlp", "experts", "9", *segments[-2:]])
    assert SHARED(numbered) == parse_expert_name(numbered)


@given(st.lists(st.lists(SEGMENTS, min_size=1, max_size=9).map(".".join), max_size=12))
def test_split_equals_one_name_at_a_time(names: list[str]) -> None:
    """`split` (the scan's loop) puts each name where the key `__call__` gives it says: its layer (by experts
    prefix, in order), and there its cell (source, stacked, suffix) under its expert id."""
    names += [f"model.layers.{layer}.mlp.experts.{e}.w1.qweight" for layer in (2, 0) for e in (1, 0)]
    layers, others = ExpertNameParser().split(names)
    keys = [(name, parse_expert_name(name)) for name in names]
    assert others == [name for name, key in keys if key is None]
    expected: dict[str, list] = {}
    cells: dict[str, dict] = {}
    for name, key in keys:
        if key is not None:
            expected.setdefault(key.experts_prefix, []).append(key)
            cell = cells.setdefault(key.experts_prefix, {}).setdefault((key.source, key.expert is None, key.suffix), {})
            cell[key.expert] = name
    assert {prefix: list(layer) for prefix, layer in layers.items()} == expected
    assert {prefix: layer.cells for prefix, layer in layers.items()} == cells
    assert all(layer.layer == layer[0].layer and layer.prefix == prefix for prefix, layer in layers.items())
    assert all(type(key) is ExpertTensorKey for group in layers.values() for key in group)


def test_enum_members_hash_by_identity() -> None:
    assert {Proj.GATE: 1}[Proj.GATE] == 1 and {Source.GATE_UP: 2}[Source("gate_up")] == 2
    assert len({*Proj, *Proj}) == len(Proj)


def test_name_shape_splits_at_the_last_three_dots() -> None:
    assert name_shape("model.layers.3.mlp.experts.12.gate_proj.qweight") == \
        ("model.layers.3.mlp.experts", "12", "gate_proj", "qweight")
    assert name_shape("model.layers.3.mlp.experts.gate_up_proj.qweight")[1] == "experts"  # stacked: not digits


# --- shared experts: the module beside the routed experts, read as one more expert when asked -----------------

def test_a_shared_expert_tensor_is_read_as_the_expert_it_is_asked_as() -> None:
    prefix = "model.layers.3.mlp.experts"
    assert shared_prefix(prefix, "shared_experts") == "model.layers.3.mlp.shared_experts"
    name = "model.layers.3.mlp.shared_experts.down_proj.qweight"
    assert shared_expert_key(name, prefix, "shared_experts", 0) == ExpertTensorKey(name, prefix, 3, 0, Source.DOWN,
                                                                                   "qweight")
    assert parse_expert_name(name) is None  # left to the engine unless asked


@pytest.mark.parametrize("name", [
    "model.layers.3.mlp.shared_experts.gate_proj",  # no suffix
    "model.layers.3.mlp.shared_experts.0.gate_proj.qweight",  # an expert index
    "model.layers.3.mlp.shared_experts.gate.weight",  # not a projection of the table
    "model.layers.13.mlp.shared_experts.gate_proj.qweight",  # another layer
    "model.layers.3.mlp.experts.0.gate_proj.qweight",  # a routed expert
    "x.model.layers.3.mlp.shared_experts.gate_proj.qweight",
])
def test_other_names_are_not_that_layers_shared_experts(name: str) -> None:
    assert shared_expert_key(name, "model.layers.3.mlp.experts", "shared_experts", 0) is None
