"""load.inplace: an engine's parameters filled in place, layer by layer, from a checkpoint folder and from a
`wna16-shard` output, in each row's layout: equal to the row made from `load_experts`' fused layer (whose
maths tests/layouts/test_relayout.py checks against the checkpoint's own tensors); refusals name the layer."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from processes import evicted
from safetensors.torch import load_file, save_file

from wna16_loader import ConfigError, LayoutMismatchError, ParallelConfig, load_experts
from wna16_loader.formats import Role, resolve_quant_spec
from wna16_loader.layouts import (AUTO_AWQ, AUTO_GPTQ, CT_WNA16, GPTQ_MARLIN, MOE_WNA16, UNQUANTIZED,
                                  allocated_shape, shape_of)
from wna16_loader.layouts.relayout import fill_param
from wna16_loader.load.inplace import LayerTarget, fill_layers, fused_name, layer_sizes
from wna16_loader.parallel import Node
from wna16_loader.preshard.run import preshard_checkpoint
from wna16_loader.storage.index import CheckpointIndex
from wna16_loader.storage.readahead import ReadOptions
from wna16_loader.testing.synthetic import QuantizedProjection, encode_role, quant_config, write_checkpoint

PREFIXES = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("inplace")
    folder = write_checkpoint(root / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=False),
                              num_experts=4, hidden=64, intermediate=128, num_layers=2, seed=3).folder
    shard = root / "shard"
    preshard_checkpoint(folder, shard, tp_size=2, progress=False)
    return folder, shard


def targets(fused: dict, row, group_size: int = 32) -> dict[str, LayerTarget]:
    """Sentinel-filled parameters of `row` for every layer of a `load_experts` result."""
    out = {}
    for prefix, layer in fused.items():
        sizes = layer_sizes(layer.spec, group_size)
        params = {d.name: torch.full(allocated_shape(d, sizes), 7, dtype=d.dtype or torch.float16)
                  for d in row.filled(layer.has_zero_point)}
        out[prefix] = LayerTarget(row, params, layer.spec.experts)
    return out


@pytest.mark.parametrize("row", [MOE_WNA16, AUTO_GPTQ])
@pytest.mark.parametrize("from_shard", [False, True])
def test_every_layer_is_filled_as_the_row_makes_it(source, row, from_shard):
    folder, shard = source
    config = ParallelConfig(tp_size=2, tp_rank=1)
    fused = load_experts(folder, config)
    want, got = targets(fused, row), targets(fused, row)
    for prefix, layer in fused.items():
        for decl in row.filled(layer.has_zero_point):
            fill_param(want[prefix].params[decl.name], decl, layer.tensors.get(fused_name(decl)), bits=4)
    report = fill_layers(shard if from_shard else folder, config, got)
    assert report.layers == {prefix: row.name for prefix in PREFIXES}
    copied = not (from_shard or row.fused_as_is)  # GPTQ v1 words in auto_gptq's row: copied as they are
    assert report.copied == (PREFIXES if copied else ())
    assert (report.scratch_bytes == 0) == (row.fused_as_is or copied)
    for prefix in PREFIXES:
        for name, param in want[prefix].params.items():
            assert torch.equal(got[prefix].params[name], param), f"{prefix}.{name}"
    assert bool(report.ignored) != from_shard  # a checkpoint's non-expert tensors go back to the engine


@pytest.mark.parametrize("from_shard", [False, True])
def test_a_param_allocated_for_the_whole_intermediate_size_holds_the_ranks_groups_first(tmp_path, from_shard):
    """SGLang's gptq_marlin w2 scales [E, I // G, H] at TP 2: the rank's I_p // G groups (auto_gptq's values),
    then zeros, as SGLang's loader leaves them, on either route; its other parameters are auto_gptq's."""
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=True),
                              num_experts=4, hidden=64, intermediate=128, num_layers=1, seed=5).folder
    config = ParallelConfig(tp_size=2, tp_rank=1)
    if from_shard:
        preshard_checkpoint(folder, tmp_path / "shard", tp_size=2, progress=False)
    fused = load_experts(folder, config)
    gptq, marlin = targets(fused, AUTO_GPTQ), targets(fused, GPTQ_MARLIN)
    fill_layers(folder, config, gptq)
    report = fill_layers(tmp_path / "shard" if from_shard else folder, config, marlin)
    got, want = marlin[PREFIXES[0]].params, gptq[PREFIXES[0]].params
    assert got["w2_scales"].shape == (4, 4, 64) and want["w2_scales"].shape == (4, 2, 64)
    assert torch.equal(got["w2_scales"][:, :2], want["w2_scales"]) and bool((got["w2_scales"][:, 2:] == 0).all())
    for name in ("w13_qweight", "w2_qweight", "w13_scales"):
        assert torch.equal(got[name], want[name]), name
    # from the checkpoint its words are copied (into the head), from a fused output the layer is re-laid
    assert report.copied == (() if from_shard else PREFIXES[:1]) and (report.scratch_bytes > 0) == from_shard


@pytest.mark.parametrize("row", [MOE_WNA16, AUTO_GPTQ, CT_WNA16], ids=lambda row: row.name)
def test_a_checkpoint_and_its_output_take_the_same_steps_per_layer(source, row):
    """The checkpoint's fused route (copy_words=False) and the output's fill one layer alike (`_through_fused`):
    the same parameters, layers and scratch (none where the method holds the fused tensors as they are)."""
    folder, shard = source
    config = ParallelConfig(tp_size=2, tp_rank=0)
    fused = load_experts(folder, config)
    from_folder, from_shard = targets(fused, row), targets(fused, row)
    folder_report = fill_layers(folder, config, from_folder, copy_words=False)
    shard_report = fill_layers(shard, config, from_shard)
    assert folder_report.layers == shard_report.layers == {prefix: row.name for prefix in PREFIXES}
    assert folder_report.copied == shard_report.copied == ()
    scratch = 0 if row.fused_as_is else max(layer.spec.nbytes for layer in fused.values())
    assert folder_report.scratch_bytes == shard_report.scratch_bytes == scratch
    for prefix in PREFIXES:
        for name, param in from_folder[prefix].params.items():
            assert torch.equal(from_shard[prefix].params[name], param), f"{prefix}.{name}"
            assert not torch.equal(param, torch.full_like(param, 7)), f"{prefix}.{name} left as the sentinel"


def test_a_layer_without_a_target_is_left_alone(source):
    folder, _ = source
    config = ParallelConfig(tp_size=1, tp_rank=0)
    only = {PREFIXES[1]: targets(load_experts(folder, config), MOE_WNA16)[PREFIXES[1]]}
    assert fill_layers(folder, config, only).layers == {PREFIXES[1]: "moe_wna16"}


def test_a_target_the_source_has_not_is_refused(source):
    folder, _ = source
    config = ParallelConfig(tp_size=1, tp_rank=0)
    some = targets(load_experts(folder, config), MOE_WNA16)
    with pytest.raises(ConfigError, match=r"the engine's MoE layers \['model\.layers\.7\.mlp\.experts'\] are not "
                       r"among its experts prefixes"):
        fill_layers(folder, config, {"model.layers.7.mlp.experts": some[PREFIXES[0]]})


def test_other_experts_or_shapes_are_refused_by_name(source):
    folder, _ = source
    config = ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1)
    good = targets(load_experts(folder, config), AUTO_GPTQ)
    placed = {p: LayerTarget(t.layout, t.params, (0, 1)) for p, t in good.items()}
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.mlp\.experts: the engine holds experts \[0, 1\] "
                       r"on this rank, the load places \[2, 3\]"):
        fill_layers(folder, config, placed)
    wrong = {p: LayerTarget(t.layout, {**t.params, "w2_scales": torch.zeros(2, 2, 64)}, t.experts)
             for p, t in good.items()}
    with pytest.raises(LayoutMismatchError, match=r"the engine's auto_gptq parameters do not fit this rank's layer "
                       r".*w2_scales \[2, 2, 64\] \(declared \['E', 'GI', 'H'\] = \[2, 4, 64\]\)"):
        fill_layers(folder, config, wrong)
    floats = {p: LayerTarget(UNQUANTIZED, t.params, t.experts) for p, t in good.items()}
    with pytest.raises(LayoutMismatchError, match=r"the engine's MoE method is unquantized but the checkpoint's "
                       r"experts here are quantized; load it with the engine's own loader"):
        fill_layers(folder, config, floats)


@pytest.mark.parametrize(("hidden", "stored", "allocated"), [(80, 3, 2), (48, 2, 1)])
def test_a_hidden_size_the_group_size_does_not_divide_is_short_in_an_engine_row(tmp_path, hidden, stored, allocated):
    """G = 32 not dividing H: the checkpoint stores ceil(H / 32) groups along H, auto_gptq's row allocates
    H // 32, as vLLM does (`allocated_groups`), so its fill is refused naming both counts, also where the counts
    divide each other (H 48: 2 and 1, which a regrouping took for a halved group size and kept every other
    group's scale); moe_wna16 takes the fused layer's groups."""
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=False),
                              num_experts=2, hidden=hidden, intermediate=64, num_layers=1, seed=1).folder
    config = ParallelConfig(tp_size=1, tp_rank=0)
    fused = load_experts(folder, config)
    layer = fused["model.layers.0.mlp.experts"]
    scales = load_file(str(next(folder.glob("*.safetensors"))))["model.layers.0.mlp.experts.0.gate_proj.scales"]
    assert scales.shape[0] == stored == layer.spec.w13_groups and layer_sizes(layer.spec, 32).GH == allocated
    with pytest.raises(LayoutMismatchError) as exc:
        fill_layers(folder, config, targets(fused, AUTO_GPTQ))
    assert str(exc.value) == (
        f"model.layers.0.mlp.experts: the engine's auto_gptq parameters w13_scales, w13_qzeros hold {allocated} "
        f"groups along H (H {hidden} // G 32) and 2 along I (64 // 32), but the checkpoint stores {stored} and 2 "
        f"(G 32 does not divide H {hidden}: its last group is partial), so its last columns' scales have no place; "
        f"serve it with moe_wna16 (--quantization moe_wna16), which holds every group")
    assert fill_layers(folder, config, targets(fused, MOE_WNA16)).layers == {"model.layers.0.mlp.experts": "moe_wna16"}


# --- the checkpoint's own words copied (load.direct) against the fused route (copy_words=False) ---

ROWS = {"gptq": AUTO_GPTQ, "awq": AUTO_AWQ, "compressed-tensors": CT_WNA16}
PARALLEL = [ParallelConfig(tp_size=1, tp_rank=0), ParallelConfig(tp_size=2, tp_rank=1),
            ParallelConfig(tp_size=4, tp_rank=2), ParallelConfig(tp_size=1, tp_rank=0, ep_size=2, ep_rank=1)]


def with_midpoint_qzeros(folder: Path) -> None:
    """Add the qzeros a symmetric GPTQ quantizer writes (every z = 2^(b-1), in the checkpoint's own words)."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    spec = resolve_quant_spec(json.loads((folder / "config.json").read_text())["quantization_config"])
    layout, qweights = spec.layout(Role.ZEROS), [name for name in tensors if name.endswith(".qweight")]
    for name in qweights:
        words = tensors[name]  # [K/P, N]
        k, n = words.shape[0] * spec.pack_factor, words.shape[1]
        groups = k // spec.group_size
        mid = QuantizedProjection(torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, groups),
                                  torch.full((n, groups), spec.implicit_zero, dtype=torch.uint8), None)
        tensors[name.removesuffix("qweight") + "qzeros"] = encode_role(spec, layout, mid)
    save_file(tensors, file, metadata={"format": "pt"})


def both_routes(folder: Path, config: ParallelConfig, row, group_size: int):
    """The row's parameters filled by the fused route and by the default (copies where they apply)."""
    fused = load_experts(folder, config)
    want, got = targets(fused, row, group_size), targets(fused, row, group_size)
    fill_layers(folder, config, want, copy_words=False)
    return want, got, fill_layers(folder, config, got)


def assert_same(want: dict, got: dict) -> None:
    for prefix, target in want.items():
        for name, param in target.params.items():
            assert torch.equal(got[prefix].params[name], param), f"{prefix}.{name}"


CASES = [  # (format, bits, symmetric, extra config, stored midpoint qzeros, copied)
    ("gptq", 4, True, {}, False, True),
    ("gptq", 4, True, {}, True, True),
    ("gptq", 8, True, {}, True, True),
    ("gptq", 8, False, {}, False, True),
    ("gptq", 4, True, {"checkpoint_format": "gptq_v2"}, True, True),  # the midpoint: made, not copied
    ("gptq", 4, False, {"checkpoint_format": "gptq_v2"}, False, False),  # z words without the row's offset 1
    ("gptq", 8, False, {"checkpoint_format": "gptq_v2"}, False, False),
    ("awq", 4, False, {}, False, True),
    ("awq", 4, True, {}, False, True),
    ("compressed-tensors", 4, True, {}, False, True),
    ("compressed-tensors", 8, False, {}, False, True),
]


@pytest.mark.parametrize("config", PARALLEL, ids=lambda c: f"tp{c.tp_size}r{c.tp_rank}ep{c.ep_size}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}bit-{'sym' if c[2] else 'asym'}"
                         f"{'-v2' if c[3] else ''}{'-qzeros' if c[4] else ''}")
def test_copied_words_equal_the_fused_route(tmp_path, case, config):
    fmt, bits, symmetric, extra, qzeros, copied = case
    folder = write_checkpoint(tmp_path / "ckpt", quant_config(fmt, bits=bits, group_size=32, symmetric=symmetric,
                                                              **extra),
                              num_experts=4, hidden=64, intermediate=128, num_layers=2, seed=5).folder
    if qzeros:
        with_midpoint_qzeros(folder)
    want, got, report = both_routes(folder, config, ROWS[fmt], 32)
    assert report.copied == (PREFIXES if copied else ())
    assert (report.scratch_bytes == 0) == copied
    assert_same(want, got)


@pytest.mark.parametrize("why, intermediate, group_size, act_order, rank, copied", [
    ("padded I: rank 1 holds 16 padding columns", 112, 64, False, 1, False),
    ("padded I: rank 0 holds none", 112, 64, False, 0, True),
    ("act-order g_idx", 128, 32, True, 1, False),
])
def test_what_the_checkpoint_does_not_hold_takes_the_fused_route(tmp_path, why, intermediate, group_size,
                                                                  act_order, rank, copied):
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=group_size, symmetric=True,
                                                              act_order=act_order),
                              num_experts=4, hidden=128, intermediate=intermediate, num_layers=2, seed=9).folder
    want, got, report = both_routes(folder, ParallelConfig(tp_size=2, tp_rank=rank), AUTO_GPTQ, group_size)
    assert report.copied == (PREFIXES if copied else ()), why
    assert (report.scratch_bytes > 0) == (not copied)
    assert_same(want, got)


def test_an_act_order_layer_is_refused_by_a_row_without_g_idx(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=32, symmetric=True,
                                                              act_order=True),
                              num_experts=4, hidden=128, intermediate=128, num_layers=1, seed=9).folder
    config = ParallelConfig(tp_size=2, tp_rank=0)
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.mlp\.experts: the checkpoint's experts here "
                       r"are act-order \(g_idx orders their groups\) but the engine's gptq_marlin parameters have no "
                       r"place for g_idx; load it with the engine's own loader"):
        fill_layers(folder, config, targets(load_experts(folder, config), GPTQ_MARLIN))


@pytest.mark.parametrize("copy_words", [True, False])
def test_reduced_groups_are_refused_on_either_route(tmp_path, copy_words):
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=64, symmetric=True),
                              num_experts=4, hidden=128, intermediate=128, num_layers=2, seed=9).folder
    config = ParallelConfig(tp_size=4, tp_rank=1)  # I/tp = 32 columns: G_eff 32 < G 64, no w2 group at G
    params = targets(load_experts(folder, config), AUTO_GPTQ, 64)
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.mlp\.experts: the engine's auto_gptq "
                       r"parameters hold groups of the checkpoint's group size 64, but this rank's 32 columns of I "
                       r"128 are not whole groups of 64 \(the layer is written at G_eff 32\), so some columns would "
                       r"take another group's scale; serve it with moe_wna16 \(SGLang and vLLM: --quantization "
                       r"moe_wna16\), which holds G_eff, or at a TP size that keeps group size 64: \[1, 2\]"):
        fill_layers(folder, config, params, copy_words=copy_words)


@pytest.mark.parametrize("row", [AUTO_GPTQ, GPTQ_MARLIN])
def test_a_rank_whose_columns_span_two_groups_is_refused_not_regrouped(tmp_path, row):
    """I 384 at TP 2, G 128: each rank's 192 columns are a group and a half (G_eff 64: three fused groups, rank 1's
    [g1, g2, g2]). A row at G holds one group a rank; taking every third fused group would give rank 1's last 128
    columns group 1's scale (as an engine's own loader does: its narrow of the checkpoint's groups): refused."""
    folder = write_checkpoint(tmp_path / "ckpt", quant_config("gptq", bits=4, group_size=128, symmetric=True),
                              num_experts=2, hidden=128, intermediate=384, num_layers=1, seed=3).folder
    config = ParallelConfig(tp_size=2, tp_rank=1)
    fused = load_experts(folder, config)
    assert next(iter(fused.values())).spec.group_size == 64
    with pytest.raises(LayoutMismatchError, match=rf"the engine's {row.name} parameters hold groups of the "
                       r"checkpoint's group size 128, but this rank's 192 columns of I 384 are not whole groups"):
        fill_layers(folder, config, targets(fused, row, 128))
    fill_layers(folder, config, targets(fused, MOE_WNA16, 128))  # (moe_wna16 holds G_eff)


@pytest.mark.parametrize("row", [AUTO_GPTQ, MOE_WNA16])
def test_the_read_ahead_leaves_every_value_as_the_mapping_reads_it(source, row):
    folder, _ = source
    config = ParallelConfig(tp_size=2, tp_rank=1)
    fused = load_experts(folder, config)
    want, got = targets(fused, row), targets(fused, row)
    fill_layers(folder, config, want, reads=ReadOptions(enabled=False))
    fill_layers(folder, config, got, reads=ReadOptions(min_bytes=0, min_tensor_bytes=0, request_bytes=4096,
                                                       gap_bytes=0))  # tiny tensors: every range read ahead
    assert_same(want, got)


@pytest.mark.parametrize("node", [None, Node((0, 1), 1, "fill")])
def test_a_rank_alone_fills_through_the_page_cache_and_an_ep_node_reads_direct(source, monkeypatch, node):
    """Alone, every planned range goes to the page cache (the parameters stay the only memory); a rank of a node
    whose ranks hold other experts (EP) reads its own ranges into buffers (direct) instead: the same values."""
    folder, _ = source
    config = ParallelConfig(1, 0, 2, 1)
    fused = load_experts(folder, config)
    want, got = targets(fused, MOE_WNA16), targets(fused, MOE_WNA16)
    fill_layers(folder, config, want, reads=ReadOptions(enabled=False))
    seen, reading_ahead = [], CheckpointIndex.reading_ahead

    def spy(index, groups, reads, **kwargs):
        seen.append((groups, kwargs.get("node_windows")))
        return reading_ahead(index, groups, reads, **kwargs)
    monkeypatch.setattr(CheckpointIndex, "reading_ahead", spy)
    fill_layers(folder, config, got, reads=ReadOptions(min_bytes=0, min_tensor_bytes=0, node=node))
    assert_same(want, got)
    (groups, together), = seen
    ranges = [r for group in groups for r in group]
    assert together is None and ranges and all(r.shared == (node is None) for r in ranges)


def test_a_copied_layer_holds_no_scratch(source):
    folder, _ = source
    config = ParallelConfig(tp_size=2, tp_rank=0)
    fused = load_experts(folder, config)
    report = fill_layers(folder, config, targets(fused, AUTO_GPTQ))
    assert report.copied == PREFIXES and report.scratch_bytes == 0
    relaid = fill_layers(folder, config, targets(fused, AUTO_GPTQ), copy_words=False)
    assert relaid.copied == () and relaid.scratch_bytes == fused[PREFIXES[0]].spec.nbytes


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(ROWS)), bits=st.sampled_from([4, 8]), symmetric=st.booleans(),
       hidden=st.sampled_from([64, 128]), intermediate=st.sampled_from([64, 128, 192]),
       tp=st.sampled_from([1, 2, 4]), channelwise=st.booleans(), data=st.data())
def test_copies_equal_the_fused_route_for_any_sizes(tmp_path_factory, fmt, bits, symmetric, hidden, intermediate,
                                                    tp, channelwise, data):
    bits = 4 if fmt == "awq" else bits  # AWQ's GEMM order is 4-bit only
    group_size = -1 if channelwise and fmt != "awq" else 32
    assume(group_size == -1 or intermediate // tp % 32 == 0)  # else G_eff < G: no such row (test above)
    config = ParallelConfig(tp_size=tp, tp_rank=data.draw(st.integers(0, tp - 1)))
    folder = write_checkpoint(tmp_path_factory.mktemp("sizes") / "ckpt",
                              quant_config(fmt, bits=bits, group_size=group_size, symmetric=symmetric),
                              num_experts=2, hidden=hidden, intermediate=intermediate, num_layers=1, seed=1).folder
    want, got, report = both_routes(folder, config, ROWS[fmt], group_size)
    assert report.copied == ("model.layers.0.mlp.experts",) and report.scratch_bytes == 0
    assert_same(want, got)


def test_tp_ranks_filling_together_as_a_node_fill_what_each_fills_alone(source):
    """Two TP ranks of one node (threads here) fill the parameters of one layer together, cold: through the node's
    shared window (reported), every value what the rank fills alone."""
    folder, _ = source
    files = sorted(folder.glob("*.safetensors"))
    key, got, reports = f"fill-{os.getpid()}-{time.monotonic_ns()}", {}, {}
    configs = [ParallelConfig(tp_size=2, tp_rank=r) for r in (0, 1)]
    fused = [load_experts(folder, config) for config in configs]
    wanted, alone = ([{PREFIXES[1]: targets(f, MOE_WNA16)[PREFIXES[1]]} for f in fused] for _ in range(2))
    for config, target in zip(configs, alone):
        fill_layers(folder, config, target, reads=ReadOptions(enabled=False))
    if evicted(files):
        pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED: a node here is always warm")

    def rank(local: int) -> None:
        reads = ReadOptions(min_bytes=0, min_tensor_bytes=0, node=Node((0, 1), local, key, timeout_s=60))
        reports[local] = fill_layers(folder, configs[local], wanted[local], reads=reads)
    threads = [threading.Thread(target=rank, args=(local,)) for local in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(reports) == [0, 1] and all(report.window_bytes > 0 for report in reports.values())
    assert all(report.layers == {PREFIXES[1]: "moe_wna16"} for report in reports.values())
    for mine, theirs in zip(wanted, alone):
        assert_same(theirs, mine)


def test_an_engine_layer_with_shared_slots_holds_its_routed_experts_then_its_shared_ones():
    """SGLang's slots at EP rank 1 of 2 over 8 routed experts with one fused shared expert (global id 8): routed
    4..7 in slots 0..3, the shared expert in slot 4; `routed()` and `shared()` are views of those slots."""
    layer = torch.nn.Module()
    layer.w13_qweight = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.uint8), requires_grad=False)
    slot = {4: 0, 5: 1, 6: 2, 7: 3, 8: 4}
    target = LayerTarget.of(MOE_WNA16, layer, lambda e: slot.get(e, -1), 8, shared_slots=1)
    assert (target.experts, target.shared_slots) == ((4, 5, 6, 7), 1)
    routed, shared = target.routed(), target.shared()
    assert (routed.experts, shared.experts, routed.shared_slots, shared.shared_slots) == ((4, 5, 6, 7), (0,), 0, 0)
    shared.params["w13_qweight"].fill_(9)
    routed.params["w13_qweight"].fill_(1)
    assert layer.w13_qweight[:, 0].tolist() == [1, 1, 1, 1, 9]
    plain = LayerTarget(MOE_WNA16, dict(layer.named_parameters()), (0, 1, 2, 3, 4))
    assert plain.routed() is plain
    with pytest.raises(AssertionError, match=r"are not the first 4: the shared slots' place is unknown"):
        LayerTarget.of(MOE_WNA16, layer, lambda e: {4: 1, 5: 2, 6: 3, 7: 4}.get(e, -1), 8, shared_slots=1)
