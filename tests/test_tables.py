"""The generated tables of docs/models.md equal what wna16_loader.tables renders from the declarations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wna16_loader.formats import FORMATS
from wna16_loader.models.family_docs import render_table
from wna16_loader.tables import FAMILIES_END, FAMILIES_START, format_tensors, formats_table, render

MODELS = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def section(text: str, name: str) -> str:
    match = re.search(rf"<!-- generated: {name} -->\n(.*?)\n<!-- end: {name} -->", text, flags=re.S)
    assert match, f"docs/models.md has no generated section {name!r}"
    return match.group(1)


def test_documented_tables_are_the_rendered_ones() -> None:
    text = MODELS.read_text(encoding="utf-8")
    assert text.split(FAMILIES_START)[1].split(FAMILIES_END)[0].strip() == render_table()
    assert section(text, "formats") == formats_table(), "run: python -m wna16_loader.tables docs/models.md"
    assert render(text) == text


def test_one_row_per_format() -> None:
    assert len(formats_table().splitlines()) == 2 + len(FORMATS)


def test_format_tensors_follow_the_layouts() -> None:
    gptq = next(d for d in FORMATS if d.name == "gptq")
    assert format_tensors(gptq) == ("`qweight [K/P, N]`, `qzeros [K/G, N/P]` (asymmetric), `scales [K/G, N]`, "
                                    "`g_idx [K]` (act-order)")


def test_render_replaces_only_known_sections() -> None:
    stale = "a\n<!-- generated: formats -->\nold\n<!-- end: formats -->\nb\n"
    assert render(stale) == f"a\n<!-- generated: formats -->\n{formats_table()}\n<!-- end: formats -->\nb\n"
    stale_families = f"{FAMILIES_START}\nold\n{FAMILIES_END}"
    assert render(stale_families) == f"{FAMILIES_START}\n{render_table()}\n{FAMILIES_END}"
    with pytest.raises(KeyError, match="unknown generated section 'nope'"):
        render("<!-- generated: nope -->\nx\n<!-- end: nope -->")
