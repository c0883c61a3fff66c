"""The generated tables of docs/models.md: checkpoint formats (from `formats.FORMATS`, here) and supported model
families (`family_docs.render_table`), so that the documentation cannot drift from the code.

`python -m wna16_loader.tables docs/models.md` rewrites every generated section of the file in place;
tests/test_tables.py and tests/models/test_families.py fail when its tables differ from the renderings.
A generated section is the text between `<!-- generated: NAME -->` and `<!-- end: NAME -->`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

from .formats import FORMATS, Dim, FormatDecl, Need
from .models.family_docs import render_table

DIM_TEXT = {Dim.N: "N", Dim.K: "K", Dim.GROUP: "K/G", Dim.PAIR: "2"}
NEED_TEXT = {Need.ALWAYS: "", Need.ASYMMETRIC: " (asymmetric)", Need.ACT_ORDER: " (act-order)"}


def format_tensors(decl: FormatDecl) -> str:
    """e.g. `qweight [K/P, N]`, `scales [K/G, N]`: every tensor a projection W[N, K] stores."""
    spec = decl.parse(decl.to_config(4, 128, False, False))
    cells = []
    for layout in spec.layouts:
        dims = [DIM_TEXT[d] + ("/P" if d is layout.packed else "") for d in layout.dims]
        cells.append(f"`{layout.suffix} [{', '.join(dims)}]`{NEED_TEXT[layout.need]}")
    return ", ".join(cells)


def formats_table() -> str:
    """One row per registered format: its name, the `quant_method` values it answers to, its tensors."""
    rows = ["| format | `quant_method` | tensors per projection W[N, K] (P = 32 / bits values per int32) |",
            "|---|---|---|"]
    rows += [f"| {decl.name} | {', '.join(f'`{m}`' for m in decl.quant_methods)} | {format_tensors(decl)} |"
             for decl in FORMATS]
    return "\n".join(rows)


SECTIONS: dict[str, Callable[[], str]] = {"formats": formats_table}

FAMILIES_START = "<!-- families-table: rendered by wna16_loader.models.family_docs.render_table -->"
FAMILIES_END = "<!-- /families-table -->"


def render(text: str) -> str:
    """`text` with every generated section replaced by its rendering (unknown names are an error), and the
    families table (between FAMILIES_START and FAMILIES_END, checked by tests/models/test_families.py) re-rendered."""
    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in SECTIONS:
            raise KeyError(f"unknown generated section {name!r}; known: {sorted(SECTIONS)}")
        return f"<!-- generated: {name} -->\n{SECTIONS[name]()}\n<!-- end: {name} -->"

    text = re.sub(r"<!-- generated: (\w+) -->\n.*?<!-- end: \1 -->", fill, text, flags=re.S)
    families = f"{FAMILIES_START}\n{render_table()}\n{FAMILIES_END}"
    return re.sub(re.escape(FAMILIES_START) + ".*?" + re.escape(FAMILIES_END), lambda _: families, text, flags=re.S)


def main(argv: list[str]) -> int:
    """Rewrite the generated sections of each file named in `argv`."""
    for name in argv:
        path = Path(name)
        path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
