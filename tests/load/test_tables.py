"""Layer tables: one per MoE layer, shared by the plans of every rank (wna16-shard); a layer's refs made and
checked in bulk, column by column, wherever its tensors lie."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_exact, reassemble, rewrite
from safetensors.torch import load_file, save_file

from wna16_loader import FormatError, ParallelConfig
from wna16_loader.load.ledger import Ledger
from wna16_loader.load.plan import plan_layers
from wna16_loader.load.scan import CheckpointScan
from wna16_loader.load.tables import LayerTables
from wna16_loader.models.config import read_config_files
from wna16_loader.storage.index import INDEX_FILE, CheckpointIndex
from wna16_loader.testing.synthetic import quant_config, write_checkpoint

P = "model.layers.0.mlp.experts"
H = I = 128


def good(folder: Path, *, act_order: bool = False, **kwargs) -> None:
    write_checkpoint(folder, quant_config("gptq", bits=4, group_size=32, act_order=act_order), num_experts=4,
                     hidden=H, intermediate=I, **kwargs)


def model(folder: Path) -> Path:
    return folder / "model.safetensors"


def plan_every_rank(folder: Path, tp: int, ep: int, *, shared: bool) -> list:
    """Each rank's plans and ledger (or its error text), planned with one shared LayerTables or fresh ones."""
    moe, out = read_config_files(folder), []
    with CheckpointIndex(folder) as index:
        scan, tables = CheckpointScan.of(index), LayerTables(index, moe)
        for parallel in ParallelConfig.all_ranks(tp_size=tp, ep_size=ep) * 2:  # twice: a table's second use
            ledger = Ledger()
            try:
                plans = plan_layers(index, moe, parallel, ledger, scan, tables if shared else None)
            except FormatError as exc:
                out.append(str(exc))
                continue
            out.append(([(p.prefix, p.fused, p.sources) for p in plans], ledger.expected, ledger.written,
                        ledger.repeats, ledger.offenders()))
    return out


@pytest.mark.parametrize("tp,ep,stacked", [(2, 1, False), (1, 4, False), (2, 2, True)])
def test_shared_tables_plan_every_rank_as_fresh_plans_do(tmp_path, tp, ep, stacked):
    good(tmp_path, act_order=True, stacked=stacked, num_layers=2)
    extra = {f"{P}.3.down_proj.bias": torch.zeros(H, dtype=torch.float16),  # unexpected, on one rank's expert
             f"{P}.5.up_proj.g_idx": torch.zeros(H, dtype=torch.int32)}  # expert id out of range
    rewrite(model(tmp_path), lambda t: [t.update(extra), t.pop(f"{P}.1.up_proj.scales", None)])
    assert plan_every_rank(tmp_path, tp, ep, shared=True) == plan_every_rank(tmp_path, tp, ep, shared=False)


def test_shared_tables_raise_a_header_error_on_the_rank_that_reads_it(tmp_path):
    good(tmp_path)
    name = f"{P}.3.gate_proj.qweight"
    rewrite(model(tmp_path), lambda t: t.update({name: t[name].to(torch.int64)}))
    shared = plan_every_rank(tmp_path, 1, 2, shared=True)
    assert shared == plan_every_rank(tmp_path, 1, 2, shared=False)
    assert isinstance(shared[0], tuple) and shared[1] == shared[3]
    assert shared[1].startswith(f"{name}: dtype torch.int64 but gptq qweight must be one of")


def split_over_two_files(folder: Path, moved: set[int]) -> None:
    """Move the tensors of experts `moved` of every layer into a second file, with an index file naming both."""
    import json
    tensors = load_file(model(folder))
    second = {n: t for n, t in tensors.items() if any(f".experts.{e}." in n for e in moved)}
    save_file({n: t for n, t in tensors.items() if n not in second}, str(folder / "a.safetensors"))
    save_file(second, str(folder / "b.safetensors"))
    model(folder).unlink()
    weight_map = {n: "b.safetensors" if n in second else "a.safetensors" for n in tensors}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_a_layer_split_over_two_files_loads_as_one(tmp_path, tp, ep):
    """Experts 1 and 2 of every layer in a second file: every column's refs are still made in bulk (file by
    file), and every rank loads what the one-file checkpoint gives."""
    good(tmp_path / "one", act_order=True, num_layers=2)
    good(tmp_path / "two", act_order=True, num_layers=2)
    split_over_two_files(tmp_path / "two", {1, 2})
    with CheckpointIndex(tmp_path / "two") as index:
        names = [f"{P}.{e}.down_proj.qweight" for e in range(4)]
        refs = index.refs.uniform(names, index.refs[names[0]].shape, (torch.int32,))
        assert refs == [index.refs[name] for name in names] and {ref.file for ref in refs} == {"a.safetensors",
                                                                                              "b.safetensors"}
    one, two = reassemble(tmp_path / "one", tp, ep), reassemble(tmp_path / "two", tp, ep)
    assert one[0].keys() == two[0].keys() and all(torch.equal(one[0][k], two[0][k]) for k in one[0])


def fuse_gate_up(folder: Path, experts: set[int]) -> None:
    """Store gate and up of `experts` as one per-expert gate_up_proj (N = 2I, gate first) instead of two."""
    def mutate(tensors: dict) -> None:
        for e in experts:
            for suffix in ("qweight", "qzeros", "scales"):
                gate, up = tensors.pop(f"{P}.{e}.gate_proj.{suffix}"), tensors.pop(f"{P}.{e}.up_proj.{suffix}")
                tensors[f"{P}.{e}.gate_up_proj.{suffix}"] = torch.cat([gate, up], -1)
    rewrite(model(folder), mutate)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (1, 1)])
def test_a_layer_whose_experts_store_gate_and_up_two_ways(tmp_path, tp, ep):
    """Experts 0 and 1 store gate_proj and up_proj, experts 2 and 3 one gate_up_proj: an EP rank whose experts
    are all in the second column, a rank with both, and one table shared by every rank all load the exact weights."""
    written = write_checkpoint(tmp_path, quant_config("gptq", bits=4, group_size=32), num_experts=4, hidden=H,
                               intermediate=I)
    fuse_gate_up(tmp_path, {2, 3})
    assert_exact(reassemble(tmp_path, tp, ep)[0], written.references)
    assert plan_every_rank(tmp_path, tp, ep, shared=True) == plan_every_rank(tmp_path, tp, ep, shared=False)
