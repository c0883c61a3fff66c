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

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tier import result, run_group

from wna16_loader import FusedExperts, ParallelConfig, load_experts
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TP_SIZES = (1, 2, 3, 4)
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class Case:
    """One checkpoint as vLLM is asked to load it."""

    name: str
    method: str  # vLLM's quantization method name for get_quantization_config
    prefix: str = "model.layers.0.mlp.experts"
    sizes: tuple[int, int, int] = (4, 128, 128)  # E, H, I
    ckpt_names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")  # vLLM's order: gate, down, up
    synthetic: dict = field(default_factory=dict)  # write_checkpoint arguments; empty: a real fixture

    def job(self, folder: Path) -> dict:
        e, h, i = self.sizes
        return {"kind": "layer", "name": self.name, "folder": str(folder), "method": self.method,
                "prefix": self.prefix, "experts": e, "hidden": h, "intermediate": i, "top_k": 2,
                "ckpt_names": list(self.ckpt_names)}


SYNTH = {"num_experts": 4, "hidden": 128, "intermediate": 384, "seed": 11}  # I 384: TP 3 and 4 hold whole groups
CASES = [
    Case("gptq_w4_g32_zero_edge", "moe_wna16"),
    Case("awq_w4_g32", "moe_wna16"),
    Case("ct_w4_g32_asym", "compressed-tensors"),
    Case("ct_w8_channel_sym", "compressed-tensors"),
    Case("gptq_w4_g32_actorder_asym", "moe_wna16"),
    Case("autoround_w8_g64_asym", "inc"),  # vLLM maps quant_method auto-round to inc
    Case("synthetic_gptq_w4_sym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=32, symmetric=True)}),
    Case("synthetic_gptq_w4_asym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=64, symmetric=False)}),
    Case("synthetic_gptq_w8_sym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=8, group_size=32, symmetric=True)}),
    Case("synthetic_gptq_w8_asym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=8, group_size=32, symmetric=False)}),
    Case("synthetic_gptq_v2_w4_asym", "moe_wna16", sizes=(4, 128, 384),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=32, symmetric=False,
                                          checkpoint_format="gptq_v2")}),
    Case("synthetic_awq_mixtral", "moe_wna16", prefix="model.layers.0.block_sparse_moe.experts", sizes=(4, 128, 384),
         ckpt_names=("w1", "w2", "w3"),
         synthetic={"quant": quant_config("awq", bits=4, group_size=32), "family": "mixtral"}),
    Case("synthetic_ct_w4_sym_gemma4", "compressed-tensors", prefix="model.language_model.layers.0.experts",
         sizes=(4, 128, 384), synthetic={"quant": quant_config("compressed-tensors", bits=4, group_size=32,
                                                              symmetric=True), "family": "gemma4"}),
    Case("synthetic_gptq_w4_sym_i704", "moe_wna16", sizes=(4, 128, 704),
         synthetic={"quant": quant_config("gptq", bits=4, group_size=128, symmetric=True), "intermediate": 704}),
]
BY_NAME = {case.name: case for case in CASES}


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


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    references: dict[tuple[int, str], torch.Tensor]  # (expert, "gate"|"up"|"down") -> the quantizer's W [N, K]


def fixture_references(case: Case) -> dict[tuple[int, str], torch.Tensor]:
    ref = load_file(str(FIXTURES / case.name / "reference.safetensors"))
    return {(x, p): ref[f"{case.prefix}.{x}.{n}.weight"] for x in range(case.sizes[0]) for p, n in PROJ_NAMES.items()}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    """Every case's checkpoint and its float32 references (synthetic ones written once, with the writer's own)."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for case in CASES:
        if not case.synthetic:
            out[case.name] = Checkpoint(FIXTURES / case.name / "checkpoint", fixture_references(case))
            continue
        args = {**SYNTH, **{k: v for k, v in case.synthetic.items() if k != "quant"}}
        written = write_checkpoint(root / case.name, case.synthetic["quant"], **args)
        out[case.name] = Checkpoint(written.folder, {(x, p): w for (_, x, p), w in written.references.items()})
    return out


@pytest.fixture(scope="session")
def vllm_out(checkpoints, tmp_path_factory) -> Path:
    """What vLLM loaded: every case at every TP size, one gloo group per TP size."""
    out = tmp_path_factory.mktemp("vllm")
    for tp in TP_SIZES:
        run_group(tp, [case.job(checkpoints[case.name].folder) for case in CASES], out / f"tp{tp}")
    return out


def rank_reference(refs: dict, case: Case, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's w13 [E, 2·I_p, H] and w2 [E, H, I_p] of one TP rank."""
    e, _, i = case.sizes
    cols = slice(rank * i // tp, (rank + 1) * i // tp)
    w13 = torch.stack([torch.cat([refs[(x, "gate")][cols], refs[(x, "up")][cols]]) for x in range(e)])
    return w13, torch.stack([refs[(x, "down")][:, cols] for x in range(e)])


def dequantized(like: FusedExperts, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    deq = FusedExperts(like.prefix, like.spec, {**tensors, "expert_ids": like.expert_ids}).dequantize()
    return deq.w13, deq.w2


def compare(case: Case, checkpoint: Checkpoint, out: Path, tp: int, rank: int) -> set[str]:
    """The fused tensors in which vLLM differs from us at one rank (asserting we are the ones who are right)."""
    got = result(out / f"tp{tp}", case.name, rank)
    ours = load_experts(checkpoint.folder, ParallelConfig(tp_size=tp, tp_rank=rank))[case.prefix]
    assert set(got) == set(ours.tensors) - {"expert_ids"}, f"{case.name} tp{tp} rank{rank}: {sorted(got)}"
    differ = {name for name, t in got.items() if not torch.equal(t, ours.tensors[name])}
    w13, w2 = rank_reference(checkpoint.references, case, tp, rank)
    mine = ours.dequantize()
    assert torch.equal(mine.w13, w13) and torch.equal(mine.w2, w2), f"{case.name} tp{tp} rank{rank}: ours is off"
    if differ:
        v13, v2 = dequantized(ours, got)
        assert not (torch.equal(v13, w13) and torch.equal(v2, w2)), (
            f"{case.name} tp{tp} rank{rank}: vLLM differs from us in {sorted(differ)} and vLLM is right")
    return differ


ACCEPTED = [(c.name, tp) for c in CASES for tp in TP_SIZES if refusal(c.name, tp) is None]


@pytest.mark.parametrize("name, tp", ACCEPTED, ids=[f"{n}-tp{t}" for n, t in ACCEPTED])
def test_vllm_loads_what_we_load(name, tp, checkpoints, vllm_out):
    """Every rank: vLLM's parameters equal ours, or differ only by the pinned, named vLLM mistake."""
    case = BY_NAME[name]
    for rank in range(tp):
        differ = compare(case, checkpoints[name], vllm_out, tp, rank)
        pin = DIFFERENCES.get(name)
        assert not differ or (pin is not None and differ <= pin.tensors), (
            f"{name} tp{tp} rank{rank}: vLLM differs in {sorted(differ)}, which no pinned difference explains")


@pytest.mark.parametrize("name", sorted(DIFFERENCES))
def test_pinned_difference_still_shows(name, checkpoints, vllm_out):
    """Each pinned vLLM mistake still happens somewhere (when vLLM fixes it, this fails: drop the pin)."""
    case = BY_NAME[name]
    seen = set().union(*(compare(case, checkpoints[name], vllm_out, tp, rank)
                         for tp in TP_SIZES if refusal(name, tp) is None for rank in range(tp)))
    assert seen, f"{name}: vLLM no longer shows {DIFFERENCES[name].name}; remove the pin"


REFUSED_AT = [(c.name, tp) for c in CASES for tp in TP_SIZES if refusal(c.name, tp) is not None]


@pytest.mark.parametrize("name, tp", REFUSED_AT, ids=[f"{n}-tp{t}" for n, t in REFUSED_AT])
def test_vllm_refuses_where_we_load(name, tp, checkpoints, vllm_out):
    """vLLM raises for these checkpoint kinds and TP sizes; this package loads every one of them exactly
    (tests/load/test_fixtures.py, tests/load/test_experts.py)."""
    kind, words = refusal(name, tp)
    for rank in range(tp):
        got = result(vllm_out / f"tp{tp}", name, rank)
        assert "type" in got, f"{name} tp{tp}: vLLM now loads it; compare it instead of pinning the refusal"
        assert got["type"] == kind and words in got["trace"], f"{name} tp{tp} rank{rank}: {got['trace']}"
        ours = load_experts(checkpoints[name].folder, ParallelConfig(tp_size=tp, tp_rank=rank))
        assert list(ours) == [BY_NAME[name].prefix]
