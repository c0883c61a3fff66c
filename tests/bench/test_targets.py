"""scripts/bench/targets.py: the target table and its verdicts."""

from __future__ import annotations

from bench.contenders import BY_KEY
from bench.targets import NAME_TARGETS, SCALE_TARGETS, SMALL_TP1_FLOOR, Target, evaluate, targets_table

SHARD_VALUES = ("shard", "shard2", "copy", "shard rss peak_anon_gib")


def test_every_scale_target_names_values_the_suite_measures() -> None:
    for target in SCALE_TARGETS:
        for name in filter(None, (target.num, target.den)):
            key, _, condition = name.rpartition(" ")
            assert name in SHARD_VALUES or (condition in ("warm", "cold") and (key in BY_KEY or key == "best peer")), name


def test_the_revised_targets() -> None:
    assert NAME_TARGETS["ep8"] == (("floor", 0.30),)
    assert SMALL_TP1_FLOOR["awq"] == 2.1
    cold = {t.label: t.limit for t in SCALE_TARGETS if t.label.startswith("cold")}
    assert cold == {"cold: EP 8 rank ÷ the best peer reading the checkpoint": 0.20,
                    "cold: pre-sharded TP 8 rank ÷ the best peer": 0.20,
                    "cold: pre-sharded TP 8 rank ÷ reading its own files": 1.2,
                    "cold: TP 8 rank from the checkpoint ÷ the best peer": 0.8}


def test_verdicts_and_what_was_not_measured() -> None:
    targets = (Target("a ÷ b", "a", "b", 0.5), Target("c ÷ b", "c", "b", 2.0, ">="), Target("a alone", "a", None, 1.0),
               Target("missing ÷ b", "x", "b", 1.0), Target("a ÷ zero", "a", "z", 1.0))
    verdicts = evaluate(targets, {"a": 1.0, "b": 4.0, "c": 6.0, "z": 0.0})
    assert [(v.value, v.verdict) for v in verdicts] == [(0.25, "PASS"), (1.5, "FAIL"), (1.0, "PASS"),
                                                        (None, "not measured"), (None, "not measured")]
    table = targets_table(verdicts).splitlines()
    assert table[2] == "| a ÷ b | 0.25 | ≤ 0.5 | PASS |"
    assert table[3] == "| c ÷ b | 1.50 | ≥ 2 | FAIL |"
    assert table[5] == "| missing ÷ b |  | ≤ 1 | not measured |"
