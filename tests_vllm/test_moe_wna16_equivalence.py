"""vLLM 0.32's own MoE weight loading against `load_experts`, tensor for tensor, at TP 1, 2, 3 and 4.

vLLM builds each `FusedMoE` layer from the checkpoint's `quantization_config` (`MoeWNA16Config` for GPTQ/AWQ,
its compressed-tensors method for CT, which its Triton conversion turns into the same layout), loads the
checkpoint through `runner.load_weights` (its `moe_wna16_weight_loader` / `weight_loader`) in gloo process
groups, and runs `process_weights_after_loading`. Where the two differ, the quantizer's own dequantisation
(the fixture's reference.safetensors, or the synthetic writer's float references) decides: a difference where
vLLM is right fails, and every difference where vLLM is wrong is pinned by name in DIFFERENCES. A checkpoint
kind vLLM refuses is pinned in REFUSED with vLLM's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from layer_cases import BY_NAME, CASES, TP_SIZES, Case, Checkpoint, dequantized, rank_reference
from tier import result

from wna16_loader import ParallelConfig, load_experts

@dataclass(frozen=True)
class Difference:
    """A way vLLM loads a checkpoint wrongly (its dequantisation misses the quantizer's reference)."""

    name: str
    tensors: frozenset[str]  # the fused tensors it shows in
    why: str


V1_FIELDS = Difference("gptq_v1_zero_points_decoded_field_by_field", frozenset({"w13_qzeros", "w2_qzeros"}),
                       "GPTQ v1 stores z - 1 by subtracting 0x11..1 from the whole word, so a zero point of 0 "
                       "borrows from the next field; vLLM adds 1 to each field (convert_gptq_int4_qzeros, and "
                       "`+ 1` on bytes for 8-bit) and is off by one scale next to every zero point of 0")
V2_PLUS_ONE = Difference("gptq_v2_zero_points_get_plus_one", frozenset({"w13_qzeros", "w2_qzeros"}),
                         "GPTQ v2 (checkpoint_format gptq_v2) stores z as it is; moe_wna16 ignores "
                         "checkpoint_format and adds 1 to every zero point")
DIFFERENCES = {"gptq_w4_g32_zero_edge": V1_FIELDS, "synthetic_gptq_w4_asym": V1_FIELDS,
               "synthetic_gptq_w8_asym": V1_FIELDS, "synthetic_gptq_v2_w4_asym": V2_PLUS_ONE}

# Refusals, as (vLLM's exception type, words of its traceback: the message, or the failing assert).
# Raised by the quantization config (from_config), at every TP:
CONFIG_REFUSED = {
    "gptq_w4_g32_actorder_asym": ("ValueError", "GPTQ group activation ordering (desc_act=True) is no longer"),
    "autoround_w8_g64_asym": ("ValueError", "Unsupported packing_format: auto_round"),
}
# Raised while building the layer, (case, tp or None for every TP):
NOT_DIVISIBLE = ("AssertionError", "assert self.intermediate_size % tp_size == 0")  # FusedMoEConfig: tp | I
LAYER_REFUSED = {
    ("ct_w8_channel_sym", None): ("AssertionError", 'assert weight_quant.strategy == "group"'),  # its Triton path
    # I 704, G 128: a partial last group; vLLM halves G to 64 and sizes w2_scales 704 // 64 = 11 groups, then
    # repeats the checkpoint's 6 groups to 12 (#51645); at TP 4 (I_p 176) it would need G 16 and asserts G >= 32
    ("synthetic_gptq_w4_sym_i704", None): ("RuntimeError", "The size of tensor a (11) must match the size of tensor b"),
    ("synthetic_gptq_w4_sym_i704", 4): ("AssertionError", "assert group_size >= 32"),
}
LAYER_REFUSED.update({(case.name, 3): NOT_DIVISIBLE for case in CASES if case.sizes[2] % 3})


def refusal(name: str, tp: int) -> tuple[str, str] | None:
    return CONFIG_REFUSED.get(name) or LAYER_REFUSED.get((name, tp), LAYER_REFUSED.get((name, None)))


def compare(case: Case, checkpoint: Checkpoint, out: Path, tp: int, rank: int) -> set[str]:
    """The fused tensors in which vLLM differs from us at one rank (asserting we are the ones who are right)."""
    got = {k: v for k, v in result(out / f"tp{tp}", case.name, rank).items() if not k.startswith("loaded.")}
    ours = load_experts(checkpoint.folder, ParallelConfig(tp_size=tp, tp_rank=rank))[case.prefix]
    assert set(got) == set(ours.tensors) - {"expert_ids"}, f"{case.name} tp{tp} rank{rank}: {sorted(got)}"
    differ = {name for name, t in got.items() if not torch.equal(t, ours.tensors[name])}
    w13, w2 = rank_reference(checkpoint.references, case, f"tp{tp}", rank)
    mine = ours.dequantize()
    assert torch.equal(mine.w13, w13) and torch.equal(mine.w2, w2), f"{case.name} tp{tp} rank{rank}: ours is off"
    if differ:
        v13, v2 = dequantized(ours, got)
        assert not (torch.equal(v13, w13) and torch.equal(v2, w2)), (
            f"{case.name} tp{tp} rank{rank}: vLLM differs from us in {sorted(differ)} and vLLM is right")
    return differ


COMPARED = [c for c in CASES if not c.ckpt]  # the variants of a checkpoint (other methods, layers): test_plugin_layers
ACCEPTED = [(c.name, tp) for c in COMPARED for tp in TP_SIZES if refusal(c.name, tp) is None]


@pytest.mark.parametrize("name, tp", ACCEPTED, ids=[f"{n}-tp{t}" for n, t in ACCEPTED])
def test_vllm_loads_what_we_load(name, tp, checkpoints, vllm_out):
    """Every rank: vLLM's parameters equal ours, or differ only by the pinned, named vLLM mistake."""
    case = BY_NAME[name]
    for rank in range(tp):
        differ = compare(case, checkpoints[case.checkpoint], vllm_out, tp, rank)
        pin = DIFFERENCES.get(name)
        assert not differ or (pin is not None and differ <= pin.tensors), (
            f"{name} tp{tp} rank{rank}: vLLM differs in {sorted(differ)}, which no pinned difference explains")


@pytest.mark.parametrize("name", sorted(DIFFERENCES))
def test_pinned_difference_still_shows(name, checkpoints, vllm_out):
    """Each pinned vLLM mistake still happens somewhere (when vLLM fixes it, this fails: drop the pin)."""
    case = BY_NAME[name]
    seen = set().union(*(compare(case, checkpoints[case.checkpoint], vllm_out, tp, rank)
                         for tp in TP_SIZES if refusal(name, tp) is None for rank in range(tp)))
    assert seen, f"{name}: vLLM no longer shows {DIFFERENCES[name].name}; remove the pin"


REFUSED_AT = [(c.name, tp) for c in COMPARED for tp in TP_SIZES if refusal(c.name, tp) is not None]


@pytest.mark.parametrize("name, tp", REFUSED_AT, ids=[f"{n}-tp{t}" for n, t in REFUSED_AT])
def test_vllm_refuses_where_we_load(name, tp, checkpoints, vllm_out):
    """vLLM raises for these checkpoint kinds and TP sizes; this package loads every one of them exactly
    (tests/load/test_fixtures.py, tests/load/test_experts.py)."""
    kind, words = refusal(name, tp)
    for rank in range(tp):
        got = result(vllm_out / f"tp{tp}", name, rank)
        assert "type" in got, f"{name} tp{tp}: vLLM now loads it; compare it instead of pinning the refusal"
        assert got["type"] == kind and words in got["trace"], f"{name} tp{tp} rank{rank}: {got['trace']}"
        ours = load_experts(checkpoints[BY_NAME[name].checkpoint].folder, ParallelConfig(tp_size=tp, tp_rank=rank))
        assert list(ours) == [BY_NAME[name].prefix]
