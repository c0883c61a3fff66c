"""The plugin's in-place fill of one vLLM MoE layer against vLLM's default loader, parameter for parameter,
for every layer case (layer_cases.CASES: the real fixtures and synthetic checkpoints, each with the method
vLLM picks with no flag or with --quantization moe_wna16) at TP 1, 2, 4 and EP 2 (PLUGIN_GROUPS).

vLLM builds the layer; its default loader (`runner.load_weights`) and the plugin (`fill_layers` over the
method's layout row, from the checkpoint folder and, for SHARD_CASES, from a wna16-shard output) each fill a
copy whose parameters start as a sentinel. Compared as the loader left them ("loaded." names) on every
machine, and after vLLM's process_weights_after_loading where its backend runs here. Where vLLM's loader is
wrong, the difference is pinned by name (LOADED_PINS) and the plugin's parameters are checked against the
quantizer's reference instead; where it crashes, the crash is pinned (LOAD_REFUSED) and the same check runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from layer_cases import (BY_NAME, CASES, GROUPS, PLUGIN_GROUPS, SHARD_CASES, SHARD_GROUPS, Case, dequantized, parallel,
                         rank_reference)
from tier import result

from wna16_loader import load_experts
from wna16_loader.formats.packing import word_bias


@dataclass(frozen=True)
class Pin:
    """A way vLLM's default loader fills a method's parameters wrongly."""

    name: str
    params: frozenset[str]  # as the loader left them ("loaded." names) and after vLLM's processing
    why: str


ZERO_POINTS = frozenset({"w13_qzeros", "w2_qzeros"})
LOADED_ZERO_POINTS = frozenset(f"loaded.{name}" for name in ZERO_POINTS)
V1_FIELDS = Pin("gptq_v1_zero_points_decoded_field_by_field", LOADED_ZERO_POINTS | ZERO_POINTS,
                "moe_wna16's loader adds 1 to each field of GPTQ v1 zero points; a zero point of 0 borrowed from "
                "its neighbour, so the next field is off by one")
V2_PLUS_ONE = Pin("gptq_v2_zero_points_get_plus_one", LOADED_ZERO_POINTS | ZERO_POINTS,
                  "moe_wna16's loader ignores checkpoint_format gptq_v2 and adds 1 to every zero point")
UNSET_QZEROS = Pin("symmetric_gptq_qzeros_left_unset",
                   LOADED_ZERO_POINTS | ZERO_POINTS | {"w13_qweight", "w2_qweight"},
                   "a symmetric GPTQ checkpoint may omit qzeros (this package's writer does); AutoGPTQMoEMethod "
                   "allocates w13_qzeros/w2_qzeros with torch.empty, its CPU kernel reads them as zero points (its "
                   "weight preparation folds them into the packed weights), and the default loader leaves them "
                   "unwritten (the plugin writes the midpoint, z - 1 = 2^(b-1) - 1)")
LOADED_PINS = {"gptq_w4_g32_zero_edge": V1_FIELDS, "synthetic_gptq_w4_asym": V1_FIELDS,
               "synthetic_gptq_w8_asym": V1_FIELDS, "synthetic_gptq_v2_w4_asym": V2_PLUS_ONE,
               "synthetic_gptq_w4_sym.auto": UNSET_QZEROS, "deepseek_v3_mtp.auto": UNSET_QZEROS}

# vLLM's default loader crashes where the plugin loads: (case, group) -> (exception type, words of its trace)
# moe_wna16_weight_loader writes zero points at the global expert id (and the global TP rank): vllm#35498
EP_ZERO_POINTS = ("IndexError", "in moe_wna16_weight_loader")
LOAD_REFUSED = {(name, "ep2"): EP_ZERO_POINTS for name in (
    "gptq_w4_g32_zero_edge", "awq_w4_g32", "synthetic_gptq_w4_asym", "synthetic_gptq_w8_asym",
    "synthetic_gptq_v2_w4_asym", "synthetic_awq_mixtral", "gptq_dynamic_mixed.L0")}
# I 704, G 128 at TP 2 (I_p 352: G 32 in vLLM, 11 scale groups): vLLM sizes w2_scales by the checkpoint's
# partial last group and its loader cannot copy them (#51645); the plugin fills the same parameters
LOAD_REFUSED[("synthetic_gptq_w4_sym_i704", "tp2")] = ("RuntimeError", "must match the size of tensor b")


# vLLM builds these mixed-precision layers with a method that cannot hold their experts, so its default loader
# crashes: (default loader's exception, words of its trace); the plugin refuses them with a LayoutMismatchError
WRONG_METHOD = {
    "gptq_dynamic_mixed.L1": ("RuntimeError", "size of tensor"),  # moe_wna16 ignores GPTQ `dynamic`: 4-bit g32
    "gptq_dynamic_mixed.L2": ("AttributeError", "has no parameter 'w13_weight'"),  # the float layer as moe_wna16
    # INC's per-layer lookup never reaches its MoE branch (it tests for "fusedmoe" in the class name, and the
    # layer is a RoutedExperts): the quantized layers get the unquantized method
    "autoround_layer_config_mixed.L0": ("AttributeError", "has no parameter 'w2_qweight'"),
    "autoround_layer_config_mixed.L1": ("AttributeError", "has no parameter 'w2_qweight'"),
}


def loads(case: Case, group: str) -> list[str]:
    return ["-plugin"] + (["-plugin-shard"] if case.name in SHARD_CASES and group in SHARD_GROUPS else [])


def method(got: dict) -> str:
    return bytes(got["loaded.method"].tolist()).decode()


def check_against_reference(case: Case, checkpoints, group: str, rank: int, got: dict) -> None:
    """The plugin's parameters are the quantizer's: moe_wna16's dequantised, or AutoGPTQ's midpoint qzeros."""
    if method(got) == "AutoGPTQMoEMethod":
        bits = 4 if got["loaded.w13_qweight"].shape[1] * 8 == case.sizes[1] else 8
        midpoint = ((1 << (bits - 1)) - 1) * word_bias(bits)
        for name in ZERO_POINTS:
            assert bool((got[f"loaded.{name}"] == midpoint).all()), f"{case.name} {group} rank{rank}: {name}"
        return
    assert method(got) == "MoeWNA16Method", method(got)
    ours = load_experts(checkpoints[case.checkpoint].folder, parallel(group, rank), include_mtp=True)[case.prefix]
    tensors = {name: got[f"loaded.{name}"] for name in ours.tensors if name != "expert_ids"}
    w13, w2 = dequantized(ours, tensors)
    ref13, ref2 = rank_reference(checkpoints[case.checkpoint].references, case, group, rank)
    assert torch.equal(w13, ref13) and torch.equal(w2, ref2), f"{case.name} {group} rank{rank}: off the reference"


def differences(case: Case, group: str, rank: int, suffix: str, vllm_out) -> tuple[set[str], dict]:
    """The parameters in which the plugin's fill differs from vLLM's default (loaded, and processed where
    both ran), and the plugin's result."""
    theirs, ours = result(vllm_out / group, case.name, rank), result(vllm_out / group, case.name + suffix, rank)
    assert "type" not in ours, f"{case.name}{suffix} {group} rank{rank}: {ours.get('trace')}"
    assert sorted(ours) == sorted(theirs), f"{case.name}{suffix} {group}: {sorted(set(ours) ^ set(theirs))}"
    differ = {name for name, t in theirs.items() if not torch.equal(t, ours[name])}
    return differ, ours


COMPARED = [(c.name, g) for c in CASES for g in PLUGIN_GROUPS]


@pytest.mark.parametrize("name, group", COMPARED, ids=[f"{n}-{g}" for n, g in COMPARED])
def test_plugin_fills_what_vllm_fills(name, group, checkpoints, vllm_out):
    """Every rank: the plugin's parameters equal the default loader's, or differ only by a pinned vLLM
    mistake and are the quantizer's; where vLLM's loader crashes (pinned), the plugin's are the quantizer's;
    where vLLM cannot build the layer, neither loader gets one."""
    case = BY_NAME[name]
    for rank in range(GROUPS[group][0]):
        theirs = result(vllm_out / group, name, rank)
        for suffix in loads(case, group):
            ours = result(vllm_out / group, name + suffix, rank)
            if "type" in theirs and (name, group) not in LOAD_REFUSED:  # vLLM refuses the layer or its sizes
                assert ours.get("type") in (theirs["type"], "LayoutMismatchError"), f"{name}{suffix} {group}: {ours}"
                if name in WRONG_METHOD:  # under EP, a rank may crash on zero points first (vllm#35498)
                    crashes = [WRONG_METHOD[name]] + ([EP_ZERO_POINTS] if GROUPS[group][1] else [])
                    assert any(theirs["type"] == kind and words in theirs["trace"] for kind, words in crashes), \
                        theirs["trace"]
                    assert ours["type"] == "LayoutMismatchError", ours["trace"]
                continue
            if "type" in theirs:
                assert "type" not in ours, f"{name}{suffix} {group} rank{rank}: {ours.get('trace')}"
                check_against_reference(case, checkpoints, group, rank, ours)
                continue
            differ, ours = differences(case, group, rank, suffix, vllm_out)
            pin = LOADED_PINS.get(name)
            assert not differ or (pin is not None and differ <= pin.params), (
                f"{name}{suffix} {group} rank{rank}: differs from vLLM in {sorted(differ)}, no pin explains it")
            if differ:
                check_against_reference(case, checkpoints, group, rank, ours)


@pytest.mark.parametrize("name", sorted(LOADED_PINS))
def test_pinned_loader_difference_still_shows(name, vllm_out):
    """Each pinned mistake of vLLM's default loader still happens somewhere (when fixed: drop the pin)."""
    case = BY_NAME[name]
    seen = set()
    for group in PLUGIN_GROUPS:
        for rank in range(GROUPS[group][0]):
            if "type" not in result(vllm_out / group, name, rank):
                seen |= differences(case, group, rank, "-plugin", vllm_out)[0]
    assert seen, f"{name}: vLLM no longer shows {LOADED_PINS[name].name}; remove the pin"


@pytest.mark.parametrize("name, group", sorted(LOAD_REFUSED), ids=[f"{n}-{g}" for n, g in sorted(LOAD_REFUSED)])
def test_vllm_loader_crashes_where_the_plugin_loads(name, group, vllm_out):
    kind, words = LOAD_REFUSED[(name, group)]
    crashed = [result(vllm_out / group, name, rank) for rank in range(GROUPS[group][0])]
    assert any("type" in got for got in crashed), f"{name} {group}: vLLM loads it now; drop the pin"
    for got in (got for got in crashed if "type" in got):
        assert got["type"] == kind and words in got["trace"], got["trace"]


def test_mixed_layers_get_the_method_vllm_picks_per_layer(vllm_out):
    """compressed-tensors' multi-group checkpoint: its WNA16 method for the quantized layers, the unquantized
    one for the float layer; the plugin fills each (test_plugin_fills_what_vllm_fills compares them)."""
    picked = [method(result(vllm_out / "tp2", f"ct_multigroup_mixed.L{layer}-plugin", 0)) for layer in range(3)]
    assert picked == ["CompressedTensorsWNA16MoEMethod"] * 2 + ["UnquantizedFusedMoEMethod"]
    floats = result(vllm_out / "tp2", "autoround_layer_config_mixed.L2-plugin", 0)
    assert method(floats) == "UnquantizedFusedMoEMethod" and floats["loaded.w13_weight"].dtype == torch.bfloat16


def test_the_mtp_layer_is_filled_as_an_mtp_layer(vllm_out):
    """DeepSeek-V3's MTP layer (model.layers.3, past num_hidden_layers) as vLLM's draft model builds it."""
    got = result(vllm_out / "tp2", "deepseek_v3_mtp.auto-plugin", 0)
    assert method(got) == "AutoGPTQMoEMethod" and got["loaded.w13_qweight"].shape == (4, 128 // 8, 128)


def test_without_a_flag_vllm_picks_the_marlin_methods(vllm_out):
    """The methods vLLM 0.32 picks with no --quantization flag, as the plugin finds them on the layer."""
    picked = {name: method(result(vllm_out / "tp1", name + "-plugin", 0))
              for name in ("synthetic_gptq_w4_sym.auto", "awq_w4_g32.auto", "ct_w4_g32_asym", "synthetic_gptq_w4_sym")}
    assert picked == {"synthetic_gptq_w4_sym.auto": "AutoGPTQMoEMethod", "awq_w4_g32.auto": "AutoAWQMoEMethod",
                      "ct_w4_g32_asym": "CompressedTensorsWNA16MoEMethod", "synthetic_gptq_w4_sym": "MoeWNA16Method"}


@pytest.mark.parametrize("tp", [2, 4])
def test_the_ranks_of_a_host_read_a_cold_checkpoint_together(tmp_path, tp):
    """vLLM's TP group over gloo, its ranks on one host: the plugin builds their node from vLLM's world group
    (no flag) and they read the cold checkpoint together, its bytes from storage about once between them."""
    from tier import run_group

    from wna16_loader.testing.synthetic import quant_config, write_checkpoint

    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=True),
                              num_experts=4, hidden=1024, intermediate=2048, references=False).folder  # (26 MB)
    job = Case("node", "gptq", sizes=(4, 1024, 2048)).job(folder) | {"kind": "node"}
    run_group(tp, [job], tmp_path / "out")
    ranks = [result(tmp_path / "out", "node", rank) for rank in range(tp)]
    assert all("storage" in r for r in ranks), ranks
    if int(ranks[0]["resident"]) or not sum(int(r["storage"]) for r in ranks):
        pytest.skip("no cold read here: this file system keeps pages after POSIX_FADV_DONTNEED, or counts no "
                    "read_bytes (tmpfs)")
    checkpoint = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert all(int(r["window"]) > 0 for r in ranks)
    assert sum(int(r["storage"]) for r in ranks) <= 1.25 * checkpoint  # (as tests/storage/test_node.py's bound)
