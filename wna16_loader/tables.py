"""The README's generated tables: supported model families and checkpoint formats, rendered from the
declarations (`formats.FORMATS`, `synthetic.FAMILIES`) so that the documentation cannot drift from the code.

`python -m wna16_loader.tables README.md` rewrites every generated section of README.md in place;
tests/test_tables.py fails when the README's sections differ from what this module renders.
A generated section is the text between `<!-- generated: NAME -->` and `<!-- end: NAME -->`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

from .formats import FORMATS, Dim, FormatDecl, Need
from .names import experts_prefix_for
from .synthetic import FAMILIES, Family

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


def family_tensors(family: Family) -> str:
    """e.g. `model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}`."""
    prefix = experts_prefix_for(family.root, 0, family.module).replace(".layers.0", ".layers.L", 1)
    return f"`{prefix}.E.{{{','.join(family.proj_names)}}}`"


def models_table() -> str:
    """One row per tested model family: model_type, the config keys read, the expert tensor names."""
    rows = ["| model_type | expert count | top-k | expert intermediate | expert tensors (layer L, expert E) |",
            "|---|---|---|---|---|"]
    for family in FAMILIES.values():
        nested = " (in `text_config`)" if family.nested else ""
        keys = [f"`{family.keys[k]}`" for k in ("experts", "top_k", "inter")]
        rows.append(f"| `{family.model_type}`{nested} | {' | '.join(keys)} | {family_tensors(family)} |")
    return "\n".join(rows)


SECTIONS: dict[str, Callable[[], str]] = {"formats": formats_table, "models": models_table}


def render(text: str) -> str:
    """`text` with every generated section replaced by its rendering (unknown names are an error)."""
    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in SECTIONS:
            raise KeyError(f"unknown generated section {name!r}; known: {sorted(SECTIONS)}")
        return f"<!-- generated: {name} -->\n{SECTIONS[name]()}\n<!-- end: {name} -->"

    return re.sub(r"<!-- generated: (\w+) -->\n.*?<!-- end: \1 -->", fill, text, flags=re.S)


def main(argv: list[str]) -> int:
    """Rewrite the generated sections of each file named in `argv`."""
    for name in argv:
        path = Path(name)
        path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
