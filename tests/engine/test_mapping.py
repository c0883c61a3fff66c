"""engine/mapping.py: checkpoint name -> the fused parameters it feeds, as docs/api.md documents it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from wna16_loader import FusedMoEExperts, ParallelConfig, ParamTarget, ShardId, read_moe_config
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_map_checkpoint_name_returns_what_the_docs_say(tmp_path: Path) -> None:
    documented = re.search(r"`ParamTarget\(([a-z_, ]+)\)`", API_DOC.read_text(encoding="utf-8"))
    assert documented is not None, "docs/api.md names map_checkpoint_name's return type"
    assert documented.group(1).split(", ") == [f.name for f in dataclasses.fields(ParamTarget)]
    write_checkpoint(tmp_path, quant_config("gptq"), hidden=64, intermediate=128, num_layers=1)
    prefix = "model.layers.0.mlp.experts"
    module = FusedMoEExperts(read_moe_config(tmp_path), prefix, ParallelConfig(2, 1))
    assert module.map_checkpoint_name(f"{prefix}.3.gate_proj.qweight") == (
        ParamTarget(f"{prefix}.w13_qweight", "w13_qweight", ShardId.W1, 3),)
    assert module.map_checkpoint_name(f"{prefix}.1.down_proj.qzeros") == (
        ParamTarget(f"{prefix}.w2_qzeros", "w2_qzeros", ShardId.W2, 1),)
    assert module.map_checkpoint_name("model.layers.0.self_attn.q_proj.qweight") == ()
