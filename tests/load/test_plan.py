"""Planning and validation errors: completeness, headers, tensor contents, g_idx, parallel sizes.

Bad checkpoints are made from good ones: write with write_checkpoint, then mutate the safetensors
file (load_file / save_file) and/or config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_exact, reassemble, rewrite

from wna16_loader import CheckpointError, CompletenessError, FormatError, ParallelConfig, ShardingError, WNA16Error, load_experts
from wna16_loader.load.experts import planned
from wna16_loader.load.plan import for_rank
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

TP1 = ParallelConfig(tp_size=1, tp_rank=0)
P = "model.layers.0.mlp.experts"
H = I = 128


def good(folder: Path, fmt: str = "gptq", *, bits: int = 4, group: int = 32, symmetric: bool = False,
         act_order: bool = False, **kwargs):
    return write_checkpoint(folder, quant_config(fmt, bits=bits, group_size=group, symmetric=symmetric,
                                                 act_order=act_order),
                            num_experts=kwargs.pop("num_experts", 4), hidden=H, intermediate=I, **kwargs)


def model(folder: Path) -> Path:
    return folder / "model.safetensors"


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# --- completeness ---------------------------------------------------------------------------------------

def _renamed(tensors: dict, old: str, new: str) -> None:
    for name in [n for n in tensors if old in n]:
        tensors[name.replace(old, new)] = tensors.pop(name)


def test_no_expert_tensor_names_the_row_the_patterns_and_the_names_found(tmp_path):
    """Experts under a module no row names: the error quotes the row, what it looked for and what was found."""
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: _renamed(t, ".mlp.experts.", ".block.experts."))
    with pytest.raises(CheckpointError) as exc:
        load_experts(tmp_path, TP1)
    projections = "gate_proj, up_proj, down_proj, gate_up_proj"
    assert str(exc.value) == (
        f"{tmp_path}: no routed-expert tensor found. config.json resolves to the 'qwen3_moe' row of the families "
        f"table (wna16_loader/models/families.py), which looks for "
        f"['model.layers.L.mlp.experts.E.{{{projections}}}.SUFFIX']; its first names that look like experts (37 of "
        f"its 41 tensors): ['model.layers.0.block.experts.0.down_proj.qweight', "
        f"'model.layers.0.block.experts.0.down_proj.qzeros', 'model.layers.0.block.experts.0.down_proj.scales', "
        f"'model.layers.0.block.experts.0.gate_proj.qweight', 'model.layers.0.block.experts.0.gate_proj.qzeros']. If these "
        f"are this model's experts, extend the 'qwen3_moe' row (its roots, modules or projections) to name them; if "
        f"the checkpoint has no routed experts, it is not a MoE checkpoint this package loads.")


def test_no_expert_tensor_and_nothing_like_one(tmp_path):
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: [t.pop(n) for n in [n for n in t if "experts." in n]])
    with pytest.raises(CheckpointError, match=r"looks for \['model\.layers\.L\.mlp\.experts\.E\..*; none of its 4 "
                                                r"tensor names looks like an expert tensor \(first: \['model\.embed_"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("fmt,suffix", [("gptq", "qweight"), ("gptq", "scales"), ("gptq", "qzeros"),
                                        ("awq", "qzeros"), ("compressed-tensors", "weight_packed"),
                                        ("compressed-tensors", "weight_shape")])
def test_missing_role_of_one_expert(tmp_path, fmt, suffix):
    good(tmp_path, fmt)
    rewrite(model(tmp_path), lambda t: t.pop(f"{P}.1.up_proj.{suffix}"))
    with pytest.raises(CompletenessError, match=rf"1 problems\n  - missing: {P}\.1\.up_proj\.{suffix}$"):
        load_experts(tmp_path, TP1)


def test_missing_projection_of_one_expert(tmp_path):
    good(tmp_path, act_order=True)
    rewrite(model(tmp_path), lambda t: [t.pop(n) for n in list(t) if n.startswith(f"{P}.2.down_proj.")])
    with pytest.raises(CompletenessError, match=r"4 problems") as info:
        load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=1))
    for suffix in ("g_idx", "qweight", "scales", "qzeros"):  # the checkpoint's names, not the ledger's
        assert f"missing: {P}.2.down_proj.{suffix}" in str(info.value)
    assert str(info.value).startswith("the load is incomplete or inconsistent: 4 problems\n")


def test_missing_act_order_g_idx(tmp_path):
    good(tmp_path, "compressed-tensors", act_order=True)
    rewrite(model(tmp_path), lambda t: t.pop(f"{P}.3.gate_proj.weight_g_idx"))
    with pytest.raises(CompletenessError, match=rf"missing: {P}\.3\.gate_proj\.weight_g_idx"):
        load_experts(tmp_path, TP1)


def test_config_counts_more_experts_than_the_checkpoint_has(tmp_path):
    """num_experts 16 in config.json, experts 0-7 in the checkpoint: one summary line first, then the missing
    tensors under the checkpoint's own names."""
    good(tmp_path, num_layers=2, num_experts=8)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CompletenessError) as info:
        load_experts(tmp_path, TP1)
    lines = str(info.value).splitlines()
    assert lines[0] == ("config.json says 16 experts (num_experts), the checkpoint has experts 0–7 in all 2 MoE "
                        "layers: fix the expert count in config.json, or restore the missing expert tensors; 144 "
                        "problems")
    assert lines[1:4] == [f"  - missing: {P}.8.down_proj.qweight", f"  - missing: {P}.8.down_proj.scales",
                          f"  - missing: {P}.8.down_proj.qzeros"]
    assert lines[-1] == "  ... and 124 more (144 in all)"


def test_whole_layer_missing(tmp_path):
    good(tmp_path, num_layers=2)
    layer1 = "model.layers.1.mlp.experts."
    rewrite(model(tmp_path), lambda t: [t.pop(n) for n in list(t) if n.startswith(layer1)])
    with pytest.raises(CompletenessError) as info:
        load_experts(tmp_path, TP1)
    assert ("missing: model.layers.1.mlp.experts (all experts of layer 1) (the config makes layer 1 a MoE layer "
            "(rule decoder_sparse_step: decoder_sparse_step=1, mlp_only_layers=[] (L not in mlp_only_layers and "
            "(L + 1) % decoder_sparse_step == 0)) but the checkpoint has no expert tensors for it)") in str(info.value)
    assert "unexpected" not in str(info.value)


def test_expert_layer_that_config_calls_dense(tmp_path):
    good(tmp_path, num_layers=2)
    edit_config(tmp_path, lambda c: c.update(mlp_only_layers=[1]))
    with pytest.raises(CompletenessError, match=r"unexpected tensor: model\.layers\.1\.mlp\.experts\.0\.\w+\.\w+ "
                                                r"\(layer 1 is not a MoE layer per config\.json\)"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("ep_rank", (0, 1))
def test_expert_id_out_of_range(tmp_path, ep_rank):
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: t.update({n.replace(f"{P}.0.", f"{P}.4."): v.clone()
                                                 for n, v in list(t.items()) if n.startswith(f"{P}.0.")}))
    with pytest.raises(CompletenessError, match=rf"unexpected tensor: {P}\.4\.\w+\.\w+ \(expert id 4 >= expert "
                                                r"count 4\)"):
        load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=ep_rank))


def test_unexpected_suffix(tmp_path):
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: t.update({f"{P}.0.gate_proj.bias": torch.zeros(I, dtype=torch.float16)}))
    with pytest.raises(CompletenessError, match=rf"unexpected tensor: {P}\.0\.gate_proj\.bias \(suffix 'bias' is "
                                                r"not a gptq expert tensor\)"):
        load_experts(tmp_path, TP1)


def test_unexpected_suffix_on_non_local_expert_still_reported(tmp_path):
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: t.update({f"{P}.3.down_proj.weight": torch.zeros(H, I, dtype=torch.float16)}))
    with pytest.raises(CompletenessError, match=rf"unexpected tensor: {P}\.3\.down_proj\.weight"):
        load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=0))


def test_stacked_and_per_expert_both_present(tmp_path):
    good(tmp_path / "a", stacked=True)
    good(tmp_path / "b")
    from safetensors.torch import load_file
    stacked = {n: v for n, v in load_file(str(model(tmp_path / "a"))).items() if ".down_proj." in n}
    rewrite(model(tmp_path / "b"), lambda t: t.update(stacked))
    with pytest.raises(CompletenessError, match=rf"written 2 times: {P}\.0\.down\.qweight from "):
        load_experts(tmp_path / "b", TP1)


def test_stacked_gate_or_up_rejected(tmp_path):
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: t.update({f"{P}.gate_proj.qweight": torch.zeros(4, 16, I, dtype=torch.int32)}))
    with pytest.raises(CompletenessError, match=r"a stacked gate tensor; only gate_up_proj and down_proj stack"):
        load_experts(tmp_path, TP1)


def test_every_offender_listed_once(tmp_path):
    good(tmp_path)
    rewrite(model(tmp_path), lambda t: [t.pop(f"{P}.{e}.gate_proj.scales") for e in range(4)])
    with pytest.raises(CompletenessError, match=r"4 problems") as info:
        load_experts(tmp_path, TP1)
    assert [line for line in str(info.value).splitlines()[1:]] == [
        f"  - missing: {P}.{e}.gate_proj.scales" for e in range(4)]


# --- headers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", (torch.int64, torch.float32, torch.uint8))
def test_qweight_wrong_dtype(tmp_path, dtype):
    good(tmp_path)
    name = f"{P}.0.gate_proj.qweight"
    rewrite(model(tmp_path), lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(FormatError, match=rf"{name}: dtype {dtype} but gptq qweight must be one of "
                                          r"\['torch\.int32'\]"):
        load_experts(tmp_path, TP1)


def test_scales_wrong_dtype(tmp_path):
    good(tmp_path, "compressed-tensors")
    rewrite(model(tmp_path), lambda t: t.update({n: v.to(torch.int32) for n, v in t.items()
                                                 if n.endswith(".weight_scale")}))
    with pytest.raises(FormatError, match=rf"{P}\.0\.gate_proj\.weight_scale: dtype torch\.int32 but "
                                          r"compressed-tensors weight_scale must be one of \['torch\.float16', "
                                          r"'torch\.bfloat16', 'torch\.float32'\]"):
        load_experts(tmp_path, TP1)


def test_one_scale_tensor_of_wrong_dtype(tmp_path):
    good(tmp_path, "compressed-tensors")
    name = f"{P}.1.down_proj.weight_scale"
    rewrite(model(tmp_path), lambda t: t.update({name: t[name].to(torch.int32)}))
    with pytest.raises(FormatError, match=rf"{name}"):
        load_experts(tmp_path, TP1)


def test_scales_in_several_dtypes(tmp_path):
    good(tmp_path)
    name = f"{P}.2.up_proj.scales"
    rewrite(model(tmp_path), lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(FormatError, match=rf"{P}: scales use several dtypes"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("key,value", [("moe_intermediate_size", 64), ("hidden_size", 256)])
def test_shape_disagrees_with_config(tmp_path, key, value):
    good(tmp_path)
    edit_config(tmp_path, lambda c: c.update({key: value}))
    with pytest.raises(FormatError, match=rf"{P}\.0\.gate_proj\.qweight: shape \[16, 128\] but the config "
                                          r"\(N=\d+, K=\d+, E=4, G=32, 4-bit\) implies \[\d+, \d+\]"):
        load_experts(tmp_path, TP1)


def test_shape_disagrees_with_expert_count_when_stacked(tmp_path):
    good(tmp_path, stacked=True)
    edit_config(tmp_path, lambda c: c.update(num_experts=8))
    with pytest.raises(FormatError, match=rf"{P}\.gate_up_proj\.\w+: shape \[4, .*E=8"):
        load_experts(tmp_path, TP1)


def test_shape_tensor_disagrees(tmp_path):
    good(tmp_path, "compressed-tensors")
    name = f"{P}.0.up_proj.weight_shape"
    rewrite(model(tmp_path), lambda t: t.update({name: torch.tensor([I, 2 * H], dtype=torch.int64)}))
    with pytest.raises(FormatError, match=rf"{name}: records shape \[128, 256\] but the config implies \[128, 128\]"):
        load_experts(tmp_path, TP1)


# --- contents --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", (float("nan"), float("inf"), -float("inf")))
def test_nonfinite_scales(tmp_path, bad):
    ckpt = good(tmp_path)
    name = f"{P}.2.gate_proj.scales"

    def poison(t):
        t[name][0, 5] = bad

    rewrite(model(tmp_path), poison)
    with pytest.raises(FormatError, match=rf"{name}: 1 NaN/Inf scale values in this rank's slice; the checkpoint "
                                          r"is corrupt \(pass allow_nonfinite_scales=True"):
        load_experts(tmp_path, TP1)
    loaded = load_experts(tmp_path, TP1, allow_nonfinite_scales=True)[P]
    assert not torch.isfinite(loaded.w13_scales[2, 5, 0])
    deq = loaded.dequantize()
    assert torch.equal(deq.w13[0], torch.cat([ckpt.references[(P, 0, "gate")], ckpt.references[(P, 0, "up")]]))


def test_nonfinite_scales_on_other_rank_not_read(tmp_path):
    """EP: the rank that does not own the expert never reads its scales, so it loads."""
    good(tmp_path)
    name = f"{P}.3.down_proj.scales"

    def poison(t):
        t[name][1, 0] = float("nan")

    rewrite(model(tmp_path), poison)
    load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=0))
    with pytest.raises(FormatError, match=r"NaN/Inf"):
        load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1))


def test_symmetric_config_with_other_zero_points(tmp_path):
    good(tmp_path, symmetric=False)
    edit_config(tmp_path, lambda c: c["quantization_config"].update(sym=True))
    with pytest.raises(FormatError, match=rf"{P}\.0\.gate_proj\.qzeros: the config is symmetric \(z = 8\) but "
                                          r"\d+ stored zero points decode to other values \[.*\]; refusing to drop"):
        load_experts(tmp_path, TP1)


def test_symmetric_config_with_implicit_zero_points_loads(tmp_path):
    """GPTQ symmetric checkpoints often store qzeros anyway (z - 1 = 7 in every field): accepted."""
    ckpt = good(tmp_path, symmetric=True)

    def add_zeros(t):
        for e in range(4):
            for proj, n in (("gate_proj", I), ("up_proj", I), ("down_proj", H)):
                t[f"{P}.{e}.{proj}.qzeros"] = torch.full((4, n // 8), 0x77777777, dtype=torch.int32)

    rewrite(model(tmp_path), add_zeros)
    weights, _ = reassemble(tmp_path, 2, 1)
    assert_exact(weights, ckpt.references)


def test_gate_and_up_g_idx_differ(tmp_path):
    good(tmp_path, act_order=True)
    name = f"{P}.1.up_proj.g_idx"
    rewrite(model(tmp_path), lambda t: t.update({name: (torch.arange(H) // 32).to(torch.int32)}))
    with pytest.raises(FormatError, match=rf"{P}\.1\.up: its g_idx differs from that of {P}\.1\.gate; gate and up "
                                          r"of one expert share w13_g_idx"):
        load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=0))


@pytest.mark.parametrize("value,span", [(4, r"\[0, 4\]"), (-1, r"\[-1, 3\]")])
def test_g_idx_out_of_range(tmp_path, value, span):
    good(tmp_path, act_order=True)
    name = f"{P}.0.gate_proj.g_idx"

    def corrupt(t):
        t[name][7] = value

    rewrite(model(tmp_path), corrupt)
    with pytest.raises(FormatError, match=rf"{name}: g_idx values span {span} but K = 128 with group size 32 has "
                                          r"groups 0\.\.3"):
        load_experts(tmp_path, TP1)


def test_g_idx_out_of_range_without_act_order(tmp_path):
    good(tmp_path)
    name = f"{P}.0.down_proj.g_idx"

    def corrupt(t):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            t[f"{P}.0.{proj}.g_idx"] = (torch.arange(128) // 32).to(torch.int32)
        t[name][0] = 99

    rewrite(model(tmp_path), corrupt)
    with pytest.raises(FormatError, match=rf"{name}: g_idx values span \[0, 99\]"):
        load_experts(tmp_path, TP1)


def test_g_idx_wrong_group_sizes(tmp_path):
    good(tmp_path, act_order=True)
    name = f"{P}.2.down_proj.g_idx"
    rewrite(model(tmp_path), lambda t: t.update({name: torch.zeros(I, dtype=torch.int32)}))
    with pytest.raises(FormatError, match=rf"{name}: g_idx groups are not of the declared size 32: group 0: 128 "
                                          r"rows \(expected 32\)"):
        load_experts(tmp_path, TP1)


@pytest.mark.parametrize("fmt,undeclare", [
    ("gptq", lambda q: q.update(desc_act=False)),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(actorder=None)),
])
def test_g_idx_permutes_but_act_order_not_declared(tmp_path, fmt, undeclare):
    good(tmp_path, fmt, act_order=True)
    edit_config(tmp_path, lambda c: undeclare(c["quantization_config"]))
    with pytest.raises(FormatError, match=r"g_idx permutes input rows \(act-order\) but the quantization config "
                                          r"does not declare act-order \(desc_act / actorder=group\); refusing"):
        load_experts(tmp_path, TP1)


def test_plain_g_idx_without_act_order_loads(tmp_path):
    """A g_idx equal to k // G (what GPTQ writes without desc_act) is accepted and dropped."""
    ckpt = good(tmp_path)

    def add_g_idx(t):
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                t[f"{P}.{e}.{proj}.g_idx"] = (torch.arange(128) // 32).to(torch.int32)

    rewrite(model(tmp_path), add_g_idx)
    loads = load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=1))
    assert loads[P].w13_g_idx is None
    weights, _ = reassemble(tmp_path, 2, 1)
    assert_exact(weights, ckpt.references)


# --- parallel sizes -------------------------------------------------------------------------------------------

def test_tp_not_dividing_intermediate_pads(tmp_path):
    ckpt = good(tmp_path, num_experts=2)  # I = 128, tp = 3: I' = 144, I_p' = 48, rank 2 holds 32 real columns
    layer = load_experts(tmp_path, ParallelConfig(tp_size=3, tp_rank=2))[P]
    assert (layer.intermediate_size, layer.intermediate_size_per_partition, layer.padding) == (128, 48, 16)
    weights, _ = reassemble(tmp_path, 3, 1)
    assert_exact(weights, ckpt.references)


def test_layer_no_tp_size_can_byte_pack(tmp_path):
    write_checkpoint(tmp_path, quant_config("compressed-tensors", group_size=32), hidden=64, intermediate=65)
    with pytest.raises(ShardingError, match=r"4-bit bytes hold 2 values, but H = 64 and I = 65 must both be "
                                            r"multiples of 2 at any TP size \(a rank's columns must end on a byte\)\. "
                                            r"No TP size works for this layer\."):
        load_experts(tmp_path, ParallelConfig(tp_size=2, tp_rank=0))


def test_ep_larger_than_expert_count(tmp_path):
    good(tmp_path)
    with pytest.raises(ShardingError, match=r"ep_size=8 is larger than the expert count 4; every EP rank needs at "
                                            r"least one expert\. Use ep_size <= 4\."):
        load_experts(tmp_path, ParallelConfig(tp_size=1, tp_rank=0, ep_size=8, ep_rank=0))


def test_errors_share_a_base():
    for cls in (CompletenessError, FormatError, ShardingError):
        assert issubclass(cls, WNA16Error) and issubclass(cls, ValueError)


@pytest.mark.parametrize("tp, ep", [(4, 1), (2, 2), (3, 1)])  # (tp 3 pads I: rank 2 holds 32 real columns of 48)
def test_a_tp_peers_plans_made_from_this_ranks_are_the_plans_it_makes(tmp_path, tp, ep):
    """A node's local rank 0 makes the plans of its ranks of the same EP rank from its own (`for_rank`: their
    geometry and fused spec, the same sources) instead of planning each again: they equal the peer's own."""
    good(tmp_path, num_experts=4)
    mine = ParallelConfig.from_rank(0, tp_size=tp, ep_size=ep)
    with planned(tmp_path, mine) as (_, _, _, plans):
        own = plans
    for rank in range(1, tp * ep):
        peer = ParallelConfig.from_rank(rank, tp_size=tp, ep_size=ep)
        if peer.ep_rank != mine.ep_rank:
            continue
        with planned(tmp_path, peer) as (_, _, _, plans):
            assert [for_rank(plan, peer) for plan in own] == plans
            assert [plan.fused.padding for plan in plans] == [16 if (tp, peer.tp_rank) == (3, 2) else 0] * len(plans)
