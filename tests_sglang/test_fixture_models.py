"""The real quantizer fixtures as whole Qwen3-MoE models built by SGLang 0.5.23 on the CPU (no --quantization flag)
at TP 1, TP 2 and EP 2, loaded by SGLang's default loader and by `--load-format wna16` (from the checkpoint and, for
fixture_models.SHARDED, from a wna16-shard output): each does what fixture_models.OUTCOMES pins. Where both load,
every parameter of every rank is equal; where SGLang's expert loader crashes (a pinned mistake), the plugin's experts
are the quantizer's reference; where SGLang cannot build the model, both loaders say so in SGLang's words."""

from __future__ import annotations

import pytest
import torch
from fixture_models import OUTCOMES, SHARDED
from sglang_cases import BY_NAME, GROUPS
from test_plugin_layers import check_against_reference
from tier import result

CASES = [(name, group) for name in OUTCOMES for group in GROUPS]
EXPERTS = "model.layers.0.mlp.experts"


def loads(name: str) -> tuple[str, ...]:
    return ("wna16", "wna16-shard") if name in SHARDED else ("wna16",)


def as_layer_result(got: dict) -> dict:
    """A whole model's MoE layer as the layer tests hold one ("loaded." names, "loaded.method")."""
    layer = {f"loaded.{name.removeprefix(EXPERTS + '.')}": t for name, t in got.items()
             if name.startswith(EXPERTS + ".")}
    return {**layer, "loaded.method": got[f"moe.{EXPERTS}.method"]}


@pytest.mark.parametrize("name, group", CASES, ids=[f"{n}-{g}" for n, g in CASES])
def test_each_loader_does_what_is_pinned(name, group, fixture_models_out, checkpoints):
    outcome = OUTCOMES[name][group]
    for rank in range(GROUPS[group][0]):
        theirs = result(fixture_models_out / group, f"{name}-auto", rank)
        for load in loads(name):
            ours = result(fixture_models_out / group, f"{name}-{load}", rank)
            where = f"{name} {group} rank{rank} {load}"
            if outcome.kind == "NOT_BUILT":
                assert outcome.words in theirs.get("trace", "") and outcome.words in ours.get("trace", ""), where
            elif outcome.kind == "REFUSED":
                assert "type" not in theirs and outcome.words in ours.get("trace", ""), (where, theirs.get("trace"))
            elif outcome.kind == "OURS":
                assert outcome.words in theirs.get("trace", "") and "type" not in ours, (where, ours.get("trace"))
                check_against_reference(BY_NAME[name], checkpoints, group, rank, as_layer_result(ours))
            else:
                assert "type" not in theirs and "type" not in ours, (where, theirs.get("trace"), ours.get("trace"))
                assert bytes(ours["loader"].tolist()) == b"WNA16ModelLoader" and sorted(ours) == sorted(theirs)
                differ = [p for p, t in theirs.items() if p != "loader" and not torch.equal(ours[p], t)]
                assert not differ, f"{where}: {differ} differ"
