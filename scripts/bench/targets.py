"""The target table: every speed and memory target of the benchmark as a row, a ratio of two measured values
of the same run (or one value against a bound). Suites evaluate their rows on
the values they measured; a row whose values were not measured (a peer not installed, a part skipped) is
reported as not measured, never as passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Target:
    """`num` ÷ `den` (or `num` alone when `den` is None) `op` `limit`; values named as their suite names them."""

    label: str
    num: str
    den: str | None
    limit: float
    op: str = "<="  # or ">="
    least: str | None = None  # a value no load of the run can beat (`below_least`)


class Verdict(NamedTuple):
    label: str
    value: float | None
    limit: float
    op: str
    verdict: str  # PASS, FAIL, or "not measured"
    note: str = ""  # why a FAIL cannot pass on the machine that ran it (`below_least`)


# The real-scale run (suite scale): "KEY CONDITION" of contenders.py, "best peer CONDITION" (the fastest peer
# row that ran), and "shard", "shard2", "copy", "shard rss peak_anon_gib".
SCALE_TARGETS: tuple[Target, ...] = (
    Target("cold: EP 8 rank ÷ the best peer reading the checkpoint", "ep8 cold", "best peer cold", 0.20),
    Target("cold: pre-sharded TP 8 rank ÷ the best peer", "pre cold", "best peer cold", 0.20),
    Target("cold: pre-sharded TP 8 rank ÷ reading its own files", "pre cold", "prefiles cold", 1.2),
    Target("cold: TP 8 rank from the checkpoint ÷ the best peer", "tp8 cold", "best peer cold", 0.8),
    Target("warm: TP 8 rank ÷ the best peer", "tp8 warm", "best peer warm", 0.5),
    Target("warm: EP 8 rank ÷ the best peer", "ep8 warm", "best peer warm", 0.25),
    Target("warm: TP 8 rank ÷ reading every expert byte", "tp8 warm", "floor warm", 0.7),
    Target("warm: EP 8 rank ÷ reading its own bytes", "ep8 warm", "own warm", 1.3),
    Target("warm: pre-sharded rank ÷ reading its files", "pre warm", "prefiles warm", 1.1),
    Target("wna16-shard --tp 8 ÷ a durable copy", "shard", "copy", 2.0),
    Target("warm: the whole-tensor loader ÷ a TP 8 rank", "whole warm", "tp8 warm", 5.0, ">="),
    Target("peak anonymous RSS of wna16-shard --tp 8, GiB", "shard rss peak_anon_gib", None, 1.0),
    Target("2-process wna16-shard ÷ 1 process", "shard2", "shard", 0.6),
    Target("warm: TP 1 ÷ reading every expert byte (8 layers)", "tp1 warm", "floor warm", 1.5),
)

# The node suite (suite node): "KEY cold|warm" node seconds, "best peer COND" (the fastest peer row of N ranks),
# "floor cold" (one reader fetching the checkpoint once), "KEY storage" (bytes from storage ÷ the checkpoint).
NODE_TARGETS: tuple[Target, ...] = (
    Target("cold: TP N node ÷ the best peer node", "tp cold", "best peer cold", 0.5, least="floor cold"),
    Target("cold: TP N node ÷ our EP N node", "tp cold", "ep cold", 1.2),
    Target("cold: EP N node ÷ the best peer node", "ep cold", "best peer cold", 0.4, least="floor cold"),
    Target("cold: TP N node's storage bytes ÷ the checkpoint", "tp storage", None, 1.1),
    Target("cold: EP N node's storage bytes ÷ the checkpoint", "ep storage", None, 1.1),
    Target("cold: TP N node ÷ one reader (goal with a core per rank)", "tp cold", "floor cold", 1.3),
    Target("cold: EP N node ÷ one reader (goal with a core per rank)", "ep cold", "floor cold", 1.3),
    Target("warm ÷ cold: TP N node (no load slower warm)", "tp warm", "tp cold", 1.0),
    Target("warm ÷ cold: EP N node (no load slower warm)", "ep warm", "ep cold", 1.0),
    Target("cold: the hook's TP N node ÷ the best peer node", "hook-tp cold", "best peer cold", 0.5,
           least="floor cold"),
    Target("cold: the hook's TP N node ÷ its EP N node", "hook-tp cold", "hook-ep cold", 1.2),
    Target("cold: the hook's EP N node ÷ the best peer node", "hook-ep cold", "best peer cold", 0.4,
           least="floor cold"),
    Target("warm ÷ cold: the hook's TP N node", "hook-tp warm", "hook-tp cold", 1.0),
)

# The name scale (suite names, and suite bounds on the same loads): contender -> ((base, limit), ...), each a
# "<= limit × base". EP 8 at 0.30: 0.15 would need a native header index (docs/performance.md, the name scale).
NAME_TARGETS: dict[str, tuple[tuple[str, float], ...]] = {
    "tp8": (("floor", 0.5), ("headers", 5.0)),
    "ep8": (("floor", 0.30),),
    "model": (("tp8", 1.2),),
    "hook tp8": (("floor", 2.0),),
    "hook tp1": (("floor", 2.0),),
}

# The 550 MB shape and smaller (suite small), per format.
SMALL_TP1_FLOOR = {"gptq": 1.5, "awq": 2.1, "ct": 1.5}  # TP 1 ÷ its floor (AWQ 2.1: its nibble transpose)
SMALL_TP4_PRESHARDED = 1.5  # a TP 4 rank ÷ the pre-sharded rank of the same split (not ÷ TP 1: CT's
# pre-sharded rank, reading only its own bytes, already takes 0.40× its TP 1)
SMALL_WHOLE_TP4 = 3.0  # the whole-tensor loader ÷ ours at TP 4, at least


# The vLLM suite (suite_vllm): "ROW LAYOUT STATE" is the slowest rank's load_weights seconds (median over
# repetitions) of contender ROW at layout LAYOUT (tp4, ep8, ...), cold or warm; "ROW LAYOUT added" the largest
# rank's anonymous memory added by load_weights over its parameters' bytes.
VLLM_TARGETS: tuple[Target, ...] = (
    Target("cold EP 8: wna16 from the checkpoint ÷ vLLM's default loader with its EP filter",
           "wna16 ep8 cold", "default+filter ep8 cold", 0.3),
    Target("cold TP 8: wna16 from the checkpoint ÷ vLLM's default loader", "wna16 tp8 cold", "default tp8 cold",
           0.7),
    Target("cold TP 4: wna16 from a shard ÷ vLLM's default loader", "wna16 shard tp4 cold", "default tp4 cold", 0.5),
    Target("cold TP 8: wna16 from a shard ÷ vLLM's default loader", "wna16 shard tp8 cold", "default tp8 cold", 0.5),
    Target("TP 8: memory wna16 adds ÷ the parameters (largest rank)", "wna16 tp8 added", None, 1.05),
    Target("EP 8: memory wna16 adds ÷ the parameters (largest rank)", "wna16 ep8 added", None, 1.05),
)

SGLANG_TARGETS: tuple[Target, ...] = (
    Target("cold TP 8: wna16 from the checkpoint ÷ SGLang's default loader", "wna16 tp8 cold", "default tp8 cold",
           0.5),
    Target("cold TP 8: wna16 from a shard ÷ SGLang's default loader", "wna16 shard tp8 cold", "default tp8 cold", 0.2),
    Target("cold EP 8: wna16 from the checkpoint ÷ SGLang's default loader", "wna16 ep8 cold", "default ep8 cold",
           0.8),
    Target("TP 8: memory wna16 adds ÷ the parameters (largest rank)", "wna16 tp8 added", None, 1.05),
    Target("EP 8: memory wna16 adds ÷ the parameters (largest rank)", "wna16 ep8 added", None, 1.05),
)


def evaluate(targets: tuple[Target, ...], values: dict[str, float]) -> list[Verdict]:
    """Each target's value and verdict on `values` (name -> measured number)."""
    out = []
    for t in targets:
        if t.num not in values or (t.den is not None and not values.get(t.den)):
            out.append(Verdict(t.label, None, t.limit, t.op, "not measured"))
            continue
        value = values[t.num] / values[t.den] if t.den is not None else values[t.num]
        ok = value <= t.limit if t.op == "<=" else value >= t.limit
        out.append(Verdict(t.label, value, t.limit, t.op, "PASS" if ok else "FAIL",
                           "" if ok else below_least(t, values)))
    return out


def below_least(target: Target, values: dict[str, float]) -> str:
    """Why `target` fails on the machine whose `values` these are, where no code can help: its bound, in its
    denominator's units, is under `target.least` (e.g. one reader fetching the checkpoint once: the storage's
    time for the bytes every load reads). Else "". (A machine whose peers spend more per byte, or whose ranks
    have a core each, can meet the same ratio.)"""
    least = values.get(target.least) if target.least is not None else None
    if not least or target.den is None or target.op != "<=" or target.limit * values[target.den] >= least:
        return ""
    return (f"the bound, {target.limit:g} × {values[target.den]:.2f} = {target.limit * values[target.den]:.2f}, "
            f"is under {target.least} = {least:.2f}")


def targets_table(rows: list[Verdict]) -> str:
    """A markdown table of verdicts."""
    lines = ["| target | value | bound | verdict |", "|---|---|---|---|"]
    for r in rows:
        value = "" if r.value is None else f"{r.value:.2f}"
        verdict = f"{r.verdict} ({r.note})" if r.note else r.verdict
        lines.append(f"| {r.label} | {value} | {'≤' if r.op == '<=' else '≥'} {r.limit:g} | {verdict} |")
    return "\n".join(lines)
