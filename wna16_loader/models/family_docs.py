"""The families table as docs/models.md shows it: one line per row of `families.FAMILIES`, rendered from the rows
so that the page cannot drift (`wna16_loader.tables` writes it into the page; the tests compare)."""

from __future__ import annotations

from .families import FAMILIES, Family, Keys


def _cell(keys: tuple[str, ...]) -> str:
    return " / ".join(f"`{k}`" for k in keys)


def _names(family: Family) -> str:
    modules = [f".{m}" if m else "" for m in family.modules]
    projections = ", ".join(name for name, kind in family.projections if kind != "gate_up")
    return f"`{family.roots[0]}.L{modules[0]}.{family.experts[0]}.E.{{{projections}}}`"


def _values(keys: Keys) -> str:
    """The experts / top-k / expert I / expert input cell of a row."""
    values = " ; ".join(_cell(k) for k in (keys.experts, keys.top_k, keys.intermediate))
    values += f" ; zero experts {_cell(keys.zero_experts)}" if keys.zero_experts else ""
    values += f" ; expert input {_cell(keys.hidden)}" if keys.hidden != ("hidden_size",) else ""
    return values + (f" ; text entry of {_cell(keys.per_modality)}" if keys.per_modality else "")


def _kind(family: Family) -> str:
    """The experts cell of a row: refused (why), or gated or not, the activation and its clamp."""
    if family.refusal is not None:
        return f"**refused**: {family.refusal.why}"
    kind = f"{'gated' if family.gated else '**not gated**'}, activation {_cell(family.keys.activation)}"
    return kind + (f", clamped at {_cell(family.keys.activation_limit)}" if family.keys.activation_limit else "")


def render_table() -> str:
    """The supported-models table of docs/models.md, rendered from the rows (so the page cannot drift)."""
    lines = ["| model_type | decoder config | experts / top-k / expert I | MoE layers | expert tensors | experts | "
             "MTP layers |", "|---|---|---|---|---|---|---|"]
    for family in sorted(FAMILIES, key=lambda row: row.name):
        rules = ", ".join(f"`{r}`" for r in family.layer_rules) or "every layer"
        lines.append(f"| {', '.join(family.model_types)} | {_cell(family.nested) or 'top level'} | "
                     f"{_values(family.keys)} | {rules} | {_names(family)} | {_kind(family)} | "
                     f"{family.mtp.describe() if family.mtp else '—'} |")
    return "\n".join(lines)
