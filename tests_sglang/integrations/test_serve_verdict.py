"""`wna16-shard`'s SGLang verdict (layouts.serving_sglang) against what SGLang 0.5.23 does: every real fixture's
`wna16-shard` output at TP 1, TP 2 and EP 2, built by SGLang as a whole model with `--load-format wna16`, with no
--quantization flag and with `--quantization moe_wna16` (tests_sglang/serve_rank.py). Where the verdict says yes,
SGLang loads it with the declared MoE methods on every rank; where it says no, SGLang (or the plugin, for a layer
the row of the method SGLang built does not hold) refuses, with the words the verdict gave where it names SGLang's.
The table of SGLang's model classes (layouts.architectures) equals the installed SGLang's registry."""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import version
from pathlib import Path

import pytest
from sglang_cases import GROUPS
from tier import REAL, fixture_outputs, result, run_group

from wna16_loader.layouts.serving import Serve, Split, Verdict, verdict
from wna16_loader.layouts.serving_sglang import TESTED_SGLANG

HERE = Path(__file__).resolve().parents[1]
FLAGS = (None, "moe_wna16")
SIZES = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}  # the tier's gloo groups as wna16-shard's TP x EP


def installed() -> str:
    return version("sglang")


def test_the_installed_sglang_is_a_tested_version():
    assert installed() in {v.version for v in TESTED_SGLANG}, (
        f"SGLang {installed()} is not in layouts.serving_sglang.TESTED_SGLANG: declare it there once the tier passes")


def registry_classes() -> set[str]:
    """Every `EntryClass` of sglang/srt/models/*.py, as SGLang's ModelRegistry registers them (read from the
    sources: importing every model module needs CUDA kernels some of them load)."""
    models = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "models"
    names = set()
    for source in sorted(models.glob("*.py")):
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                entries = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                names |= {entry.id for entry in entries}
    return names


def test_the_model_class_table_is_sglangs_registry():
    declared = next(v for v in TESTED_SGLANG if v.version == installed()).architectures
    found = registry_classes()
    assert declared == found, f"missing: {sorted(found - declared)}; not in SGLang: {sorted(declared - found)}"


@pytest.fixture(scope="session")
def outputs(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Split]]:
    """(fixture, group) -> its `wna16-shard` output at the group's TP x EP and the verdict's question."""
    return fixture_outputs(tmp_path_factory.mktemp("serve-verdict"), SIZES)


@pytest.fixture(scope="session")
def built(outputs, tmp_path_factory) -> Path:
    """Every output built by SGLang in its group, with each flag (one gloo group per TP x EP)."""
    out = tmp_path_factory.mktemp("serve-verdict-jobs")
    for group in SIZES:
        ranks, ep = GROUPS[group]
        jobs = [{"kind": "serve", "name": f"{name}-{flag}", "folder": str(outputs[(name, group)][0]),
                 "quantization": flag} for name in REAL for flag in FLAGS]
        run_group(ranks, jobs, out / group, ep=ep, script=HERE / "serve_rank.py")
    return out


def declared(split: Split) -> Verdict:
    return verdict(next(v for v in TESTED_SGLANG if v.version == installed()), split)


@pytest.mark.parametrize("group", SIZES)
@pytest.mark.parametrize("name", REAL)
def test_the_verdict_says_what_sglang_does(name, group, outputs, built):
    """The declared verdict, with each flag: SGLang loads it with the declared MoE methods on every rank, or
    refuses it (SGLang, or the plugin for the method SGLang built) with the declared words."""
    v = declared(outputs[(name, group)][1])
    for flag in FLAGS:
        loads = v.serve is Serve.NO_FLAG and flag is None or v.serve is Serve.FLAG and flag == v.flag
        for rank in range(GROUPS[group][0]):
            got = result(built / group, f"{name}-{flag}", rank)
            if loads:
                assert "type" not in got, f"{name} {group} --quantization {flag}: SGLang refused: {got.get('trace')}"
                assert sorted(set(got["methods"].values())) == sorted(v.methods), (got["methods"], v)
            elif v.serve is Serve.NO_FLAG:  # with a flag it need not load: not asked
                continue
            else:
                assert "type" in got, f"{name} {group} --quantization {flag}: SGLang loads it; the verdict says {v}"
                words = said(v, flag)
                assert words is None or words in got["trace"], f"{name} {flag}: {words!r} not in {got['trace']}"


def said(v: Verdict, flag: str | None) -> str | None:
    """SGLang's words the verdict gives for the try with `flag` (None where it names none for that try): one per
    try when every try has them; a FLAG verdict's only words are its no-flag try's."""
    if len(v.words) == len(FLAGS):
        return v.words[FLAGS.index(flag)]
    return v.words[0] if v.serve is Serve.FLAG and flag is None and v.words else None
