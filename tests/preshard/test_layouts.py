"""wna16-shard streaming (one layer at a time), --workers and --layout checkpoint."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from sources import make_source, tree_bytes

import wna16_loader.preshard.verify as verify
import wna16_loader.preshard.writing as writing
from wna16_loader import LayoutMismatchError, ParallelConfig, load_experts
from wna16_loader.errors import PreshardError
from wna16_loader.formats import Dim, resolve_quant_spec
from wna16_loader.models.config import read_config_files
from wna16_loader.preshard import MANIFEST_NAME, OutputLayout, make_plan, preshard_checkpoint, shard, verify_output
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

HIDDEN, INTER, EXPERTS = 64, 128, 4


def test_streaming_materialises_one_layer_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq"), hidden=64, intermediate=64, num_layers=6, files=2)
    live, peak, loads = set(), [0], []
    real = writing.load_layer

    def counted(index, moe, plan, device, allow, **options):
        layer, count, nbytes = real(index, moe, plan, device, allow, **options)
        live.add(id(layer))
        peak[0] = max(peak[0], len(live))
        weakref.finalize(layer, live.discard, id(layer))
        loads.append(plan.prefix)
        return layer, count, nbytes

    def no_whole_rank_load(*args, **kwargs):
        raise AssertionError("load_experts would hold a whole rank in memory")

    monkeypatch.setattr(writing, "load_layer", counted)
    monkeypatch.setattr(verify, "load_experts", no_whole_rank_load)
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, max_file_size=6_000, progress=False)
    assert peak[0] == 1  # one fused layer alive at a time, whatever the layer count
    assert len(loads) == 4 * 6  # every layer of every rank loaded exactly once
    monkeypatch.undo()
    for pc in ParallelConfig.all_ranks(tp_size=2, ep_size=2):
        fast, direct = load_experts(out, pc), load_experts(src, pc)
        for prefix, layer in direct.items():
            assert all(torch.equal(fast[prefix].tensors[n], t) for n, t in layer.tensors.items())


@pytest.mark.parametrize("layout", ["fused", "checkpoint"])
def test_workers_output_identical(tmp_path: Path, layout: str) -> None:
    src = make_source(tmp_path / "src", "awq")
    one, many = tmp_path / "one", tmp_path / "many"
    preshard_checkpoint(src, one, tp_size=2, ep_size=2, max_file_size=20_000, progress=False, layout=layout)
    summary = preshard_checkpoint(src, many, tp_size=2, ep_size=2, max_file_size=20_000, progress=False,
                                  layout=layout, workers=2)
    assert [r.name for r in summary.ranks][0] == "common" and len(summary.ranks) == 5
    assert tree_bytes(one) == tree_bytes(many)


@pytest.mark.parametrize("layout", list(OutputLayout), ids=str)
def test_a_layout_member_and_its_value_write_the_same_bytes(tmp_path: Path, layout: OutputLayout) -> None:
    """`layout=` takes an OutputLayout or its plain string; the manifest and the rank files' metadata record the
    plain string either way."""
    src = make_source(tmp_path / "src", "awq")
    preshard_checkpoint(src, tmp_path / "member", tp_size=2, progress=False, layout=layout)
    preshard_checkpoint(src, tmp_path / "value", tp_size=2, progress=False, layout=layout.value)
    assert tree_bytes(tmp_path / "member") == tree_bytes(tmp_path / "value")
    assert f'"layout": "{layout.value}",' in (tmp_path / "member" / MANIFEST_NAME).read_text()
    assert layout == layout.value and str(layout) == f"{layout}" == layout.value


def test_an_unknown_layout_is_refused_naming_the_accepted_ones(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", "awq")
    want = "layout='sliced': unknown; use one of ['fused', 'checkpoint']."
    for call in (lambda: make_plan(src, tp_size=2, layout="sliced"),
                 lambda: preshard_checkpoint(src, tmp_path / "out", tp_size=2, progress=False, layout="sliced"),
                 lambda: shard(src, tmp_path / "out", tp=2, progress=False, layout="sliced")):
        with pytest.raises(PreshardError) as exc:
            call()
        assert str(exc.value) == want
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- --layout checkpoint

def _expected_slice(source: torch.Tensor, name: str, layout, quant, tp: int, tp_rank: int,
                    experts: list[int] | None) -> torch.Tensor:
    """The rank's slice of one source tensor, computed from the spec: gate/up keep rows
    [r*I_p, (r+1)*I_p) of N, down keeps the same range of K (and its groups unless act-order)."""
    part, per_word, g = INTER // tp, quant.pack_factor, quant.group_size
    down = ".down_proj." in name
    own = (tp_rank * part, (tp_rank + 1) * part)
    if Dim.PAIR in layout.dims:
        value = torch.tensor([HIDDEN, part] if down else [2 * part if "gate_up" in name else part, HIDDEN],
                             dtype=source.dtype)
        return value if experts is None else value.expand(len(experts), 2).contiguous()
    def cut(t: torch.Tensor, n_half: int) -> torch.Tensor:
        index = []
        for dim in layout.dims:
            lo, hi = {Dim.N: (0, HIDDEN) if down else (n_half * INTER + own[0], n_half * INTER + own[1]),
                      Dim.K: own if down else (0, HIDDEN),
                      Dim.GROUP: (own[0] // g, own[1] // g) if down and not quant.act_order else (0, t.shape[len(index)] * (per_word if dim is layout.packed else 1))}[dim]
            step = per_word if dim is layout.packed else 1
            index.append(slice(lo // step, hi // step))
        return t[tuple(index)]
    rows = [source] if experts is None else [source[e] for e in experts]
    out = []
    for row in rows:
        if "gate_up" in name and Dim.N in layout.dims:
            out.append(torch.cat([cut(row, 0), cut(row, 1)], dim=layout.dims.index(Dim.N)))
        else:
            out.append(cut(row, 0))
    return out[0] if experts is None else torch.stack(out)


def _expert_of(name: str) -> int | None:
    parts = name.split(".")
    i = parts.index("experts")
    return int(parts[i + 1]) if parts[i + 1].isdigit() else None


CKPT_CASES = [(fmt, tp, ep) for fmt in ("gptq_actorder", "awq", "ct") for tp in (1, 2, 4) for ep in (1, 2)]


@pytest.mark.parametrize("fmt,tp,ep", CKPT_CASES)
def test_checkpoint_layout_is_exact_source_slices(tmp_path: Path, fmt: str, tp: int, ep: int) -> None:
    src = make_source(tmp_path / "src", fmt)
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=tp, ep_size=ep, max_file_size=30_000, progress=False, layout="checkpoint")
    _check_slices(src, out, tp, ep)
    if (tp, ep) == (2, 2):
        assert verify_output(out, source=src) == []


def test_checkpoint_layout_stacked_tensors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("compressed-tensors", symmetric=False), hidden=HIDDEN, intermediate=INTER,
                     num_layers=2, stacked=True)
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, ep_size=2, progress=False, layout="checkpoint")
    _check_slices(src, out, 2, 2)
    assert verify_output(out, source=src) == []


def _check_slices(src: Path, out: Path, tp: int, ep: int) -> None:
    quant = read_config_files(src).quant
    source = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            source.update({n: handle.get_tensor(n) for n in handle.keys() if ".experts." in n})
    for pc in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep):
        local = list(pc_experts(pc))
        found = {}
        for path in sorted((out / f"rank-{pc.rank:05d}-of-{tp * ep:05d}").glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                assert handle.metadata()["layout"] == "checkpoint"
                found.update({n: handle.get_tensor(n) for n in handle.keys()})
        want_names = {n for n in source if _expert_of(n) is None or _expert_of(n) in local}
        assert set(found) == want_names
        for name, tensor in found.items():
            layout = quant.layout_for_suffix(name.rsplit(".", 1)[1])
            stacked = _expert_of(name) is None
            want = _expected_slice(source[name], name, layout, quant, tp, pc.tp_rank, local if stacked else None)
            assert tensor.dtype == source[name].dtype and torch.equal(tensor, want), name


def pc_experts(pc: ParallelConfig) -> range:
    per = EXPERTS // pc.ep_size
    return range(pc.ep_rank * per, (pc.ep_rank + 1) * per)


def test_checkpoint_layout_refused_by_load_experts(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", "awq")
    out = tmp_path / "out"
    preshard_checkpoint(src, out, tp_size=2, progress=False, layout="checkpoint")
    with pytest.raises(LayoutMismatchError, match=r"--layout checkpoint.*--layout fused"):
        load_experts(out, ParallelConfig(2, 0))
    assert verify_output(out) == []


def test_misaligned_checkpoint_layout_refused_before_writing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=64), hidden=64, intermediate=128, num_layers=1)
    out = tmp_path / "out"
    with pytest.raises(PreshardError, match=r"cannot slice at tp=4 .*I/tp = 128/4 = 32.*G=64.*down_proj.qweight: the rank's K range \[0, 32\) does not fall "
                                            r"on group boundaries.*--layout fused.*\[1, 2\]") as exc:
        preshard_checkpoint(src, out, tp_size=4, progress=False, layout="checkpoint")
    assert "nothing was written" in str(exc.value)
    assert not out.exists()
    preshard_checkpoint(src, out, tp_size=4, progress=False)  # the fused layout handles G_eff < G
    assert (out / MANIFEST_NAME).is_file()


def test_checkpoint_layout_off_word_boundary_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=-1), hidden=64, intermediate=72, num_layers=1)
    with pytest.raises(PreshardError, match=r"tp=2 .*I/tp = 72/2 = 36.*qzeros: the rank's N range \[0, 36\) does not fall on "
                                            r"8-value int32 word boundaries.*aligned: \[1, 3, 9\]"):
        preshard_checkpoint(src, tmp_path / "out", tp_size=2, progress=False, layout="checkpoint")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tp", [3, 6])
def test_padded_tp_refused_for_checkpoint_layout_even_on_aligned_cuts(tmp_path: Path, tp: int) -> None:
    """I = 128, G = 16 at tp 3 / 6: I' = 144 / 192, I_p' = 48 / 32 fall on word and group boundaries, but the ranks
    would hold different column counts: only the fused layout can carry padding."""
    src = tmp_path / "src"
    write_checkpoint(src, quant_config("gptq", group_size=16), hidden=64, intermediate=128, num_layers=1)
    with pytest.raises(PreshardError, match=rf"cannot slice at tp={tp} \(I=128, I/tp = 128/{tp} is not whole, 4-bit, "
                                            rf"G=16\): tp={tp} needs I padded to I'={ {3: 144, 6: 192}[tp]} "
                                            rf"\(I_p'={ {3: 48, 6: 32}[tp]}\), and a checkpoint-layout output cannot "
                                            rf"carry padding; nothing was written\. Use --layout fused \(it pads I "
                                            rf"where a cut would break groups and loads at every TP size\), or a TP "
                                            rf"size that keeps the cuts aligned: \[1, 2, 4, 8\]\."):
        preshard_checkpoint(src, tmp_path / "out", tp_size=tp, progress=False, layout="checkpoint")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tp,ep", [(3, 2), (8, 1), (4, 1), (1, 1)])
def test_layout_cost_matches_what_loads(tmp_path: Path, tp: int, ep: int) -> None:
    """--plan's numbers are those of the tensors load_experts returns: the largest rank's bytes, each TP rank's
    padding, I' and G_eff (I = 176, G = 64: tp 3 pads to 192 (I_p' = 64 = G_eff), tp 4 to 192 (I_p 44 has no
    group >= 16; I_p' = 48, G_eff = 16), tp 8 to 256 (I_p' = 32 = G_eff); tp 1 is unpadded)."""
    from wna16_loader import read_moe_config
    from wna16_loader.preshard import layout_cost

    src = tmp_path / "src"
    write_checkpoint(src, quant_config("awq", group_size=64), hidden=64, intermediate=176, num_experts=3)
    moe = read_moe_config(src)
    loads = [next(iter(load_experts(src, pc).values())) for pc in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep)]
    cost = layout_cost(moe, loads[0].spec.scale_dtype, tp, ep, "linear")
    assert cost.rank_bytes == max(sum(t.numel() * t.element_size() for t in layer.tensors.values())
                                  for layer in loads)
    assert cost.padding == tuple(layer.padding for layer in loads[:tp])
    assert (cost.padded_intermediate, cost.part, cost.group_eff) == {3: (192, 64, 64), 4: (192, 48, 16),
                                                                     8: (256, 32, 32), 1: (176, 176, 64)}[tp]
    assert cost.group_eff == loads[0].group_size
    assert (cost.padding_bytes == 0) == (tp == 1)


AWQ = Path(__file__).resolve().parents[1] / "fixtures" / "awq_w4_g32" / "checkpoint"  # 2 heads, 4 experts, I 128


def test_serve_for_refuses_before_the_output_folder_exists(tmp_path: Path) -> None:
    """`shard(..., serve_for=...)` (the CLI's --for): a split the engine refuses raises before anything is written,
    naming the split that would serve; one it serves is written."""
    out = tmp_path / "out"
    with pytest.raises(PreshardError) as caught:
        shard(AWQ, out, tp=2, ep=2, serve_for="vllm==0.34.0", progress=False)
    assert str(caught.value) == (
        f"vLLM 0.34.0 will not serve --tp 2 --ep 2 with --load-format wna16: vLLM runs MoE layers at TP or at EP, not "
        f"both (TP 2 x EP 2; with --enable-expert-parallel its MoE TP is 1): --ep 2 would serve (vllm serve {out} "
        f"--load-format wna16 -tp 2 --enable-expert-parallel); nothing was written.")
    assert not out.exists()
    assert shard(AWQ, out, ep=2, serve_for="sglang", progress=False).plan.params["ep"] == 2


def test_the_split_that_would_serve_is_sought_ep_first_where_ep_was_asked(tmp_path: Path) -> None:
    """serving_split: the sizes given, alone as EP then TP, then every candidate size, largest first (EP first when
    --ep was given), one rank last; None where no split serves."""
    from wna16_loader.layouts.serving_sglang import TESTED_SGLANG
    from wna16_loader.layouts.serving_vllm import TESTED_VLLM
    from wna16_loader.preshard.layouts import serving_split

    (sglang,), vllm = TESTED_SGLANG, TESTED_VLLM[0]
    both = make_plan(AWQ, tp_size=2, ep_size=2, warn=False)
    assert (serving_split(both, vllm).tp, serving_split(both, vllm).ep) == (1, 2)
    wide = make_plan(AWQ, tp_size=4, warn=False)  # 2 heads: 2 ranks at most; TP 2's attention needs moe_wna16
    assert (serving_split(wide, sglang).tp, serving_split(wide, sglang).ep) == (2, 1)
    edge = make_plan(AWQ.parent.parent / "gptq_w4_g32_zero_edge" / "checkpoint", tp_size=2, warn=False)
    assert serving_split(edge, vllm) is None  # asymmetric GPTQ: no split
