"""scripts/bench --suite sglang: its contender rows and its targets' value names (SGLang itself runs only in the
SGLang tier's venv: `./scripts/test_sglang --python scripts/bench --suite sglang`, docs/sglang.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.contenders import SGLANG_CONTENDERS
from bench.suite_sglang import flag_of, parse
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


def test_each_layout_runs_with_the_flag_the_verdict_names() -> None:
    """flag_of: the real AWQ fixture (2 attention heads of 64) needs --quantization moe_wna16 at 2 ranks (AWQ
    Marlin's attention check), none at 1, and 4 ranks stop the run with SGLang's words."""
    awq = Path(__file__).resolve().parents[1] / "fixtures" / "awq_w4_g32" / "checkpoint"
    assert [flag_of(awq, name) for name in ("tp1", "tp2", "ep2")] == [None, "moe_wna16", "moe_wna16"]
    with pytest.raises(SystemExit, match=r"--layouts tp4: SGLang 0.5.23 does not serve it: SGLang stops at 4 ranks: "
                                         r"\"assert self.total_num_heads % attn_tp_size == 0\""):
        flag_of(awq, "tp4")
