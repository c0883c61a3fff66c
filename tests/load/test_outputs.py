"""outputs: a wna16-shard output's manifest, one rank's record read from its lines alone and checked against the
ParallelConfig it is loaded with (the output and its damageable copy are conftest.py's fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wna16_loader.errors import CheckpointError, LayoutMismatchError
from wna16_loader.load import outputs
from wna16_loader.load.outputs import MANIFEST_NAME, OutputLayout, output_layout, rank_record, read_rank_manifest
from wna16_loader.parallel.config import ParallelConfig


def head_and_records(out: Path) -> tuple[dict, list[dict]]:
    """The manifest's members before `ranks`, and every rank record, from a whole parse."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    keys = list(manifest)
    return {k: manifest[k] for k in keys[:keys.index("ranks")]}, manifest["ranks"]


def test_every_rank_record_is_read_from_its_lines_alone(output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wna16-shard's manifest is laid out as the reader slices it: no rank needs the whole parse."""
    head, records = head_and_records(output)
    assert len(records) == 4 and [len(r["files"]) for r in records] >= [2] * 4
    monkeypatch.setattr(outputs, "read_manifest", lambda out: pytest.fail("parsed the whole manifest"))
    for rank, record in enumerate(records):
        assert read_rank_manifest(output, rank) == (head, record)


@pytest.mark.parametrize("indent", [None, 4, "\t"])
def test_other_layouts_of_the_text_are_parsed_whole(copy: Path, indent: int | str | None) -> None:
    head, records = head_and_records(copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=indent) + "\n")
    for rank, record in enumerate(records):
        assert read_rank_manifest(copy, rank) == (head, record)


def test_truncated_manifest_is_not_valid_json(copy: Path) -> None:
    text = (copy / MANIFEST_NAME).read_text()
    (copy / MANIFEST_NAME).write_text(text[:len(text) // 2])
    with pytest.raises(CheckpointError, match=r"wna16_manifest\.json: not valid JSON \(.*\); re-run wna16-shard "
                                              r"with --resume"):
        read_rank_manifest(copy, 1)
    (copy / MANIFEST_NAME).write_text("")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_rank_manifest(copy, 1)


def test_schema_version_checked_on_the_sliced_head(copy: Path) -> None:
    text = (copy / MANIFEST_NAME).read_text()
    assert text.startswith('{\n  "schema_version": 1,\n')
    (copy / MANIFEST_NAME).write_text(text.replace('"schema_version": 1,', '"schema_version": 2,', 1))
    with pytest.raises(CheckpointError, match=r"schema version 2, this package reads 1; re-shard"):
        read_rank_manifest(copy, 0)


def test_a_record_of_another_rank_in_its_place_falls_back_to_the_whole_parse(copy: Path) -> None:
    """The slice is trusted only when the record it finds says it is the rank asked for."""
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["ranks"][2]["rank"] = 7
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    assert read_rank_manifest(copy, 2)[1]["rank"] == 7
    assert read_rank_manifest(copy, 3)[1] == manifest["ranks"][3]


def test_rank_beyond_the_written_ranks(copy: Path) -> None:
    """Another layout is refused as such even when its rank has no record; a record missing from a
    manifest of the right layout is named."""
    with pytest.raises(LayoutMismatchError, match=r"written for layout \{'tp': 2, 'ep': 2, 'placement': 'linear'\}, "
                                                  r"but loaded with \{'tp': 8, 'ep': 1"):
        rank_record(copy, ParallelConfig(8, 7))
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    del manifest["ranks"][3]
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    assert read_rank_manifest(copy, 3)[1] is None
    with pytest.raises(CheckpointError, match=r"wna16_manifest\.json: no record of rank 3 in its ranks list; run "
                                              r"`wna16-shard verify .*` and re-shard\."):
        rank_record(copy, ParallelConfig(2, 1, ep_size=2, ep_rank=1))


def test_the_recorded_layout_is_an_output_layout(copy: Path) -> None:
    """params.layout is read as an OutputLayout ("fused" when not recorded, as before it was); a checkpoint-layout
    output is refused by a load; a value that is none of the layouts is named."""
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    assert output_layout(copy, manifest) is OutputLayout.FUSED and manifest["params"]["layout"] == "fused"
    del manifest["params"]["layout"]
    assert output_layout(copy, manifest) is OutputLayout.FUSED
    refusals = {"checkpoint": (LayoutMismatchError, "written with --layout checkpoint (per-expert source tensors "
                                                    "sliced per rank"),
                "sliced": (CheckpointError, "params.layout is 'sliced', none of ['fused', 'checkpoint'] (a newer "
                                            "wna16-shard's, or an edit); re-shard the source with this version's "
                                            "wna16-shard.")}
    for value, (error, text) in refusals.items():
        manifest["params"]["layout"] = value
        (copy / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        with pytest.raises(error) as exc:
            rank_record(copy, ParallelConfig(2, 0, ep_size=2, ep_rank=0))
        assert str(exc.value).startswith(f"{copy / MANIFEST_NAME}: {text}")


def test_the_rerun_command_is_the_one_that_wrote_the_output() -> None:
    """`rerun_command`: the source path and every parameter not at its default, quoted for a shell; `SRC` for a
    manifest written before the source path was recorded."""
    params = {"layout": "fused", "tp": 2, "ep": 1, "placement": "linear", "max_file_size": 4 * 2**30,
              "schema_version": 1}
    manifest = {"params": params, "source": {"path": "/models/Qwen3 MoE", "files": []}}
    assert outputs.rerun_command("/out/tp2", manifest) == "wna16-shard '/models/Qwen3 MoE' /out/tp2 --tp 2"
    params.update(layout="checkpoint", ep=4, placement="round_robin", max_file_size=20_000, mtp=False)
    assert outputs.rerun_command("out", manifest) == (
        "wna16-shard '/models/Qwen3 MoE' out --tp 2 --ep 4 --placement round_robin --max-file-size 20000 "
        "--layout checkpoint --no-mtp")
    del manifest["source"]["path"]
    assert outputs.rerun_command("out", manifest).startswith("wna16-shard SRC out --tp 2 ")
