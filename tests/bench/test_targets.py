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


def test_a_bound_under_the_floor_fails_saying_so() -> None:
    """A node ÷ the best peer whose bound, in seconds, is under one reader's time cannot pass on that machine:
    the verdict says so; a bound above it fails plainly, and a pass has no note."""
    target = Target("ep ÷ best peer", "ep cold", "best peer cold", 0.4, least="floor cold")
    here = {"ep cold": 4.04, "best peer cold": 5.55, "floor cold": 3.35}  # (this VM's run: 0.4 × 5.55 = 2.22)
    (verdict,) = evaluate((target,), here)
    assert (verdict.verdict, verdict.note) == ("FAIL", "the bound, 0.4 × 5.55 = 2.22, is under floor cold = 3.35")
    assert targets_table([verdict]).splitlines()[2] == (
        "| ep ÷ best peer | 0.73 | ≤ 0.4 | FAIL (the bound, 0.4 × 5.55 = 2.22, is under floor cold = 3.35) |")
    set_on = {"ep cold": 8.40, "best peer cold": 18.11, "floor cold": 2.22}  # (the run the target was set on)
    assert evaluate((target,), set_on)[0][4:] == ("FAIL", "")  # (0.4 × 18.11 = 7.24: over the floor)
    assert evaluate((target,), {**set_on, "ep cold": 7.0})[0][4:] == ("PASS", "")
    assert evaluate((target,), {"ep cold": 4.04, "best peer cold": 5.55})[0][4:] == ("FAIL", "")
