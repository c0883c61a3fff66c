"""scripts/bench --suite sglang: its contender rows and its targets' value names (SGLang itself runs only in the
SGLang tier's venv: `./scripts/test_sglang --python scripts/bench --suite sglang`, docs/sglang.md)."""

from __future__ import annotations

from bench.contenders import SGLANG_CONTENDERS
from bench.suite_sglang import parse
from bench.targets import SGLANG_TARGETS, evaluate

LAYOUTS = ("tp4", "ep4", "tp8", "ep8")


def test_the_default_layouts_and_rows() -> None:
    assert tuple(parse([]).layouts) == LAYOUTS
    assert [(row.key, row.load_format, row.folder) for row in SGLANG_CONTENDERS] == [
        ("default", "auto", "checkpoint"), ("wna16", "wna16", "checkpoint"), ("wna16 shard", "wna16", "shard")]


def test_every_target_names_values_the_suite_measures() -> None:
    keys = {row.key for row in SGLANG_CONTENDERS}
    for target in SGLANG_TARGETS:
        for name in filter(None, (target.num, target.den)):
            row, place, state = name.rsplit(" ", 2)
            assert row in keys and place in LAYOUTS and state in ("cold", "warm", "added"), name


def test_the_targets_of_a_run() -> None:
    """TP 8 from the checkpoint ≤ 0.5× SGLang's default loader, from a shard ≤ 0.2×, EP 8 ≤ 0.8×."""
    got = {v.label: (v.verdict, v.value) for v in evaluate(SGLANG_TARGETS, {
        "default tp8 cold": 10.0, "wna16 tp8 cold": 4.0, "wna16 shard tp8 cold": 3.0, "default ep8 cold": 10.0,
        "wna16 ep8 cold": 7.0, "wna16 tp8 added": 1.01})}
    assert got == {
        "cold TP 8: wna16 from the checkpoint ÷ SGLang's default loader": ("PASS", 0.4),
        "cold TP 8: wna16 from a shard ÷ SGLang's default loader": ("FAIL", 0.3),
        "cold EP 8: wna16 from the checkpoint ÷ SGLang's default loader": ("PASS", 0.7),
        "TP 8: memory wna16 adds ÷ the parameters (largest rank)": ("PASS", 1.01),
        "EP 8: memory wna16 adds ÷ the parameters (largest rank)": ("not measured", None)}
