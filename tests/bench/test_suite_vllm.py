"""scripts/bench --suite vllm: its contender rows, its targets' value names, and the table and values it
derives from rank measurements (vLLM itself runs only in a vLLM venv: the smoke in docs/performance.md)."""

from __future__ import annotations

import pytest
from bench.contenders import VLLM_CONTENDERS
from bench.suite_vllm import layout, table, values
from bench.targets import VLLM_TARGETS, evaluate

LAYOUTS = ("tp4", "tp8", "ep4", "ep8")


def rank(seconds: float, added: float = 1.0) -> dict:
    return {"load_weights_s": seconds, "read_bytes": 1 << 30, "anon_added": int(added * 1000), "param_bytes": 1000}


def test_layouts_and_rows() -> None:
    assert [layout(name) for name in LAYOUTS] == [(4, False), (8, False), (4, True), (8, True)]
    with pytest.raises(SystemExit, match="'pp2' is not tpN or epN"):
        layout("pp2")
    assert len({row.key for row in VLLM_CONTENDERS}) == len(VLLM_CONTENDERS)
    assert [row.key for row in VLLM_CONTENDERS if row.ep_only] == ["default+filter"]


def test_every_target_names_values_the_suite_measures() -> None:
    keys = {row.key for row in VLLM_CONTENDERS}
    for target in VLLM_TARGETS:
        for name in filter(None, (target.num, target.den)):
            row, place, state = name.rsplit(" ", 2)
            assert row in keys and place in LAYOUTS and state in ("cold", "warm", "added"), name


def test_values_take_the_slowest_rank_and_the_median_over_repetitions() -> None:
    runs = [{"row": "wna16", "layout": "tp8", "state": "cold", "rep": rep, "ranks": [rank(1.0 + rep), rank(3.0 + rep,
                                                                                                         1.2)]}
            for rep in range(3)] + [{"row": "default", "layout": "tp8", "state": "cold", "rep": 0,
                                     "ranks": [rank(8.0), rank(10.0)]}]
    got = values(runs)
    assert got["wna16 tp8 cold"] == 4.0 and got["default tp8 cold"] == 10.0 and got["wna16 tp8 added"] == 1.2
    verdicts = {v.label: v.verdict for v in evaluate(VLLM_TARGETS, got)}
    assert verdicts["cold TP 8: wna16 from the checkpoint ÷ vLLM's default loader"] == "PASS"  # 0.4 <= 0.7
    assert verdicts["TP 8: memory wna16 adds ÷ the parameters (largest rank)"] == "FAIL"  # 1.2 > 1.05
    assert verdicts["cold EP 8: wna16 from the checkpoint ÷ vLLM's default loader with its EP filter"] == "not measured"
    assert table(runs).splitlines()[2] == "| wna16 | tp8 | cold | 4.0 | 2.0 / 4.0 | 1.00 / 1.00 | 1.20 | - |"
