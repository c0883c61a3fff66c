"""Tiny checkpoints that tests in several folders build: the pre-sharding source and Nemotron-H."""

from __future__ import annotations

import json
from pathlib import Path

from wna16_loader.testing.synthetic import SyntheticCheckpoint, quant_config, write_checkpoint, write_family_checkpoint

FORMATS = {
    "gptq_actorder": dict(format_name="gptq", act_order=True),
    "awq": dict(format_name="awq"),
    "ct": dict(format_name="compressed-tensors"),
}


def make_source(folder: Path, fmt: str = "gptq_actorder", *, seed: int = 0, files: int = 2) -> Path:
    """A 2-layer, 4-expert checkpoint (hidden 64, intermediate 128) in `fmt`."""
    kwargs = dict(FORMATS[fmt])
    write_checkpoint(folder, quant_config(kwargs.pop("format_name"), **kwargs), hidden=64, intermediate=128,
                     num_layers=2, files=files, seed=seed)
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    return folder


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """relative path -> content of every file below `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def nemotron_checkpoint(folder: Path) -> SyntheticCheckpoint:
    """Nemotron-3-Nano's published config.json at test sizes: pattern "MEM*E" (MoE layers 1 and 4), 4 experts
    of up_proj / down_proj only (relu2), H = I = 64."""
    config = json.loads((Path(__file__).parent / "fixtures/configs/nemotron_h-nano-30b-a3b.json").read_text())
    config.update(hybrid_override_pattern="MEM*E", num_hidden_layers=5, hidden_size=64, moe_intermediate_size=64,
                  n_routed_experts=4, num_experts_per_tok=2)
    return write_family_checkpoint(folder, config, quant_config("gptq", bits=4, group_size=32, symmetric=False))
