"""KeyRules: which routed-expert tensors of a layer feed a slot, decided cell by cell (`sort_out`) exactly as the
per-tensor rule (`problem`) decides each, the rejected ones in checkpoint order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wna16_loader.load.keys import KeyRules, expert_key_problem
from wna16_loader.models.config import read_config_files
from wna16_loader.models.names import ExpertNameParser
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

P = "model.layers.0.mlp.experts"
NAME = st.one_of(  # per expert (some ids past the 4 experts), stacked, suffixes of the format and others
    st.builds(lambda e, proj, suffix: f"{P}.{e}.{proj}.{suffix}", st.integers(0, 6),
              st.sampled_from(["gate_proj", "up_proj", "down_proj"]), st.sampled_from(["qweight", "scales", "bias"])),
    st.builds(lambda proj, suffix: f"{P}.{proj}{suffix}", st.sampled_from(["gate_up_proj", "down_proj", "up_proj"]),
              st.sampled_from(["", ".qweight", ".bias"])))


def rules(tmp_path_factory) -> KeyRules:  # noqa: ANN001 (pytest's factory)
    folder = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(folder, quant_config("gptq", bits=4, group_size=32), num_experts=4, hidden=64, intermediate=64)
    return KeyRules(read_config_files(folder))


@settings(max_examples=60, deadline=None)
@given(names=st.lists(NAME, unique=True, max_size=14))
def test_sort_out_equals_the_rule_of_each_key(tmp_path_factory, names: list[str]) -> None:
    """Per cell (its kind once, its expert ids by the largest) as per key: the same kept {expert: name} per
    (source, stacked, suffix), the same rejected names with the same reasons, in checkpoint order."""
    keyrules = rules(tmp_path_factory)
    layers, _ = ExpertNameParser().split(names)
    if not layers:
        return
    layer = layers[P]
    kept, rejects = keyrules.sort_out(layer)
    want_kept: dict = {}
    want_rejects = []
    for key in layer:
        problem = expert_key_problem(keyrules.moe, key)
        kind = (key.source, key.expert is None, key.suffix)
        if expert_key_problem(keyrules.moe, key._replace(expert=key.expert and 0)) is None:
            want_kept.setdefault(kind, {})  # a kind that feeds a slot gets its cell, whatever its expert ids
        if problem is None:
            want_kept[kind][key.expert] = key.name
        else:
            want_rejects.append((key.name, problem))
    assert kept == want_kept and rejects == want_rejects
    assert [problem for _, problem in rejects] == [keyrules.problem(key) for key in layer if keyrules.problem(key)]


def test_an_expert_past_the_count_is_rejected_with_both_numbers(tmp_path_factory) -> None:
    layer = ExpertNameParser().split([f"{P}.{e}.down_proj.qweight" for e in (5, 0, 3)])[0][P]
    kept, rejects = rules(tmp_path_factory).sort_out(layer)
    assert rejects == [(f"{P}.5.down_proj.qweight", "expert id 5 >= expert count 4")]
    assert list(kept.values()) == [{0: f"{P}.0.down_proj.qweight", 3: f"{P}.3.down_proj.qweight"}]
