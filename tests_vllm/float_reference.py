"""The quantizer's float forward of a tiny Qwen3-MoE checkpoint: transformers' own `Qwen3MoeForCausalLM` in
float32 with every quantized module's weight taken from a reference.safetensors (a fixture's: the quantizer's
float32 dequantisation; model_checkpoint's: the writer's W = (q - z)·s) and every other tensor from the
checkpoint. No vLLM and no code of this package is involved,
so it is the yardstick for a load vLLM's default loader cannot do.

| tensor                                       | from                                                     |
|----------------------------------------------|----------------------------------------------------------|
| `mlp.experts.gate_up_proj [E, 2·I, H]`        | reference `experts.{e}.gate_proj.weight` ‖ `up_proj.weight` |
| `mlp.experts.down_proj [E, H, I]`             | reference `experts.{e}.down_proj.weight`                 |
| attention projections `[N, K]`                | reference `<module>.weight`                              |
| embeddings, norms, router, lm_head           | the checkpoint, as float32                               |
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # transformers -> per expert


def float_model(checkpoint: Path, reference_file: Path) -> torch.nn.Module:
    """transformers' Qwen3-MoE in float32 holding `reference_file`'s weights and `checkpoint`'s other tensors."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("quantization_config")
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**config, "dtype": "float32"})).float().eval()
    reference = load_file(str(reference_file))
    stored = load_file(str(checkpoint / "model.safetensors"))
    state = {}
    for name in model.state_dict():
        module, _, leaf = name.rpartition(".")
        if leaf in FUSED and module.endswith(".experts"):
            state[name] = torch.stack([torch.cat([reference[f"{module}.{e}.{proj}.weight"] for proj in FUSED[leaf]])
                                       for e in range(model.config.num_experts)])
        else:
            state[name] = (reference if name in reference else stored)[name].float()
    model.load_state_dict(state, strict=True)
    return model


def float_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """log-softmax [T, V] float32 of the next token after each prefix of `token_ids` (teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
