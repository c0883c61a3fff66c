"""engine/model.py: load_model_experts over a model's FusedMoEExperts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wna16_loader import CompletenessError, FusedMoEExperts, ParallelConfig, load_model_experts, read_moe_config
from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.testing.synthetic import quant_config, write_checkpoint


def test_a_second_load_says_reset_load(tmp_path: Path) -> None:
    """Loading a model twice: one line naming reset_load(), not every slot written twice; after it, it loads."""
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq"), hidden=64, intermediate=128, num_layers=2)
    preshard_checkpoint(src, tmp_path / "out", tp_size=2, progress=False)
    moe, parallel = read_moe_config(src), ParallelConfig(2, 1)
    for folder in (src, tmp_path / "out"):
        model = torch.nn.ModuleList(FusedMoEExperts(moe, prefix, parallel) for prefix in moe.experts_prefixes)
        load_model_experts(model, folder, parallel)
        with pytest.raises(CompletenessError) as exc:
            load_model_experts(model, folder, parallel)
        assert str(exc.value) == (
            "2 of 2 FusedMoEExperts already hold a load (model.layers.0.mlp.experts and 1 more); loading again would "
            "write every slot twice. Call reset_load() on each module first (for m in model.modules(): if "
            "isinstance(m, FusedMoEExperts): m.reset_load()), then load.")
        for module in model:
            module.reset_load()
        load_model_experts(model, folder, parallel)
