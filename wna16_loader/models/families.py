"""The model families table: how each MoE `model_type` names its config keys and expert tensors.

One row per family (with its aliases). Adding a family is one row here plus one
test; the resolver (modelconfig.py) and the name parser (names.py) read only this
table. Unknown model types use the GENERIC row, which tries every alias.

A routed-expert tensor is `{root}.layers.{L}[.{module}].experts.[{e}.]{proj}.{suffix}`. A family's MTP
(multi-token-prediction, "NextN") layers are named in one of two ways (`MTP`): decoder layers appended
after the last one, `{root}.layers.{L + i}` (DeepSeek-V3, GLM-4.x), or a tree of their own,
`{mtp root}.layers.{i}` (Qwen3-Next, Qwen3.5). A family's shared experts (`SharedExperts`), computed for every
token beside the routed ones, are one MLP next to the routed experts, `{root}.layers.{L}.{module}.{shared}.{proj}.{suffix}`
(DeepSeek-V3: `model.layers.3.mlp.shared_experts.gate_proj.qweight`): non-expert tensors, unless an engine fuses
them into its MoE layer as extra experts after the routed ones (SGLang on DeepSeek-V3/R1).
"""

from __future__ import annotations

from dataclasses import dataclass

GATED = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"), ("gate_up_proj", "gate_up"))
W123 = (("w1", "gate"), ("w3", "up"), ("w2", "down"))
NON_GATED = (("up_proj", "up"), ("down_proj", "down"))


@dataclass(frozen=True)
class Keys:
    """Config keys tried in order for each value (a value may also be a per-layer list)."""

    experts: tuple[str, ...]
    top_k: tuple[str, ...]
    intermediate: tuple[str, ...]
    hidden: tuple[str, ...] = ("hidden_size",)
    layers: tuple[str, ...] = ("num_hidden_layers",)
    activation: tuple[str, ...] = ("hidden_act",)
    zero_experts: tuple[str, ...] = ()


@dataclass(frozen=True)
class MTP:
    """A family's MTP layers: how many (the first of `keys` present, else `default`) and where.

    `root`: None for layers appended to the decoder, `{root}.layers.{L + i}` with L the decoder layer count
    and the row's own roots and modules; else the root of their own tree, `{root}.layers.{i}`.
    `routed`: False when the MTP block's MLP is dense (it has no routed experts to load).
    """

    keys: tuple[str, ...]
    default: int = 0
    root: str | None = None
    routed: bool = True

    def describe(self) -> str:
        """How the MTP layers are named, e.g. `appended model.layers.{L+i}` (for the docs/models.md table)."""
        if not self.routed:
            return "dense MTP block (no routed experts)"
        where = f"`{self.root}.layers.i`" if self.root else "appended `layers.{L+i}`"
        default = f" (default {self.default})" if self.default else ""
        return f"{where}, count {' / '.join(f'`{k}`' for k in self.keys)}{default}"


@dataclass(frozen=True)
class SharedExperts:
    """A family's shared experts: the module beside `experts` that holds them (one MLP, gated like the routed
    experts, with the family's projection names), and the config keys counting them. An engine that fuses them
    holds one slot per shared-expert module after a rank's routed experts; the module's I must then be one
    routed expert's (a count of 1)."""

    module: str
    count: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """One row of the table.

    `nested`: keys under which the decoder config may live (e.g. `text_config`);
    `roots` / `modules`: the tensor-name parts before and after `layers.{L}`;
    `projections`: (tensor name, "gate" | "up" | "down" | "gate_up");
    `layer_rules`: the MoE-layer rules (layer_rules.RULES names) this family's configs use;
    `gated`: experts compute act(gate) * up; non-gated experts compute act(up);
    `mtp`: the family's MTP layers (None: it has none);
    `shared`: the family's shared experts beside the routed ones (None: it has none an engine fuses).
    """

    model_types: tuple[str, ...]
    keys: Keys
    roots: tuple[str, ...] = ("model",)
    modules: tuple[str | None, ...] = ("mlp",)
    projections: tuple[tuple[str, str], ...] = GATED
    nested: tuple[str, ...] = ()
    layer_rules: tuple[str, ...] = ()
    gated: bool = True
    mtp: MTP | None = None
    shared: SharedExperts | None = None

    @property
    def name(self) -> str:
        """The row's main model_type."""
        return self.model_types[0]


def _keys(experts: str, top_k: str, intermediate: str | tuple[str, ...], **more: tuple[str, ...]) -> Keys:
    inter = (intermediate,) if isinstance(intermediate, str) else intermediate
    return Keys(experts=(experts,), top_k=(top_k,), intermediate=inter, **more)


QWEN = _keys("num_experts", "num_experts_per_tok", "moe_intermediate_size")
DEEPSEEK = _keys("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
LOCAL = _keys("num_local_experts", "num_experts_per_tok", "intermediate_size")
OLMO = _keys("num_experts", "num_experts_per_tok", "intermediate_size")
# DeepSeek-V3 and GLM: `num_nextn_predict_layers` appended layers (vLLM deepseek_mtp.py, glm4_moe_mtp.py)
NEXTN = MTP(("num_nextn_predict_layers",))
# Qwen3-Next / Qwen3.5: their own `mtp.layers.i` tree; vLLM counts 1 when the config names none (qwen3_next_mtp.py,
# qwen3_5_mtp.py), and Qwen3-Next's published config names none
QWEN_MTP = MTP(("mtp_num_hidden_layers", "num_nextn_predict_layers"), default=1, root="mtp")
# ERNIE 4.5, EXAONE-MoE, LongCat-Flash: the MTP block's MLP is dense (vLLM ernie_mtp.py, exaone_moe_mtp.py,
# longcat_flash_mtp.py): its tensors are non-expert tensors
DENSE_MTP = MTP(("num_nextn_predict_layers",), routed=False)
# DeepSeek-V2/V3 and the models built on them (GLM-4.5, GLM-4.7-Flash, GLM-5, Kimi-K2.5): `mlp.shared_experts`,
# `n_shared_experts` of them in one MLP (SGLang's deepseek_v2.py, glm4_moe.py, glm4_moe_lite.py fuse one into the
# routed layer as expert n_routed_experts)
SHARED_EXPERTS = SharedExperts("shared_experts", ("n_shared_experts",))

FAMILIES: tuple[Family, ...] = (
    Family(("afmoe",), QWEN, layer_rules=("num_dense_layers",)),
    Family(("cohere2_moe",), OLMO, layer_rules=("mlp_layer_types",)),
    Family(("deepseek_v3", "deepseek_v2"), DEEPSEEK, layer_rules=("first_k_dense_replace",), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("deepseek_v32",), DEEPSEEK, layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("dots1",), DEEPSEEK, layer_rules=("first_k_dense_replace",)),
    Family(("ernie4_5_moe",), _keys("moe_num_experts", "moe_k", "moe_intermediate_size"),
           layer_rules=("moe_layer_start_index",), mtp=DENSE_MTP),
    Family(("exaone_moe",), QWEN, layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=DENSE_MTP),
    Family(("flex_olmo",), OLMO),
    Family(("gemma4", "gemma4_text"), _keys("num_experts", "top_k_experts", "moe_intermediate_size",
                                            activation=("hidden_activation",)),
           roots=("model.language_model",), modules=(None,), nested=("text_config",),
           layer_rules=("enable_moe_block",)),
    Family(("glm4_moe",), DEEPSEEK, layer_rules=("first_k_dense_replace",), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("glm4_moe_lite",), DEEPSEEK, layer_rules=("mlp_layer_types",), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("glm_moe_dsa",), DEEPSEEK, layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("hunyuan_v1_moe",), _keys("num_experts", "moe_topk", ("moe_intermediate_size", "intermediate_size"))),
    Family(("jamba",), OLMO, modules=("feed_forward",), layer_rules=("expert_layer_period",)),
    Family(("kimi_k25",), DEEPSEEK, roots=("language_model.model",), nested=("text_config",),
           layer_rules=("first_k_dense_replace",), mtp=NEXTN, shared=SHARED_EXPERTS),
    Family(("kimi_linear",), _keys("num_experts", "num_experts_per_token", "moe_intermediate_size"),
           modules=("block_sparse_moe",), projections=W123, layer_rules=("mlp_layer_types",)),
    Family(("lfm2_moe",), QWEN, modules=("feed_forward",), projections=W123, layer_rules=("num_dense_layers",)),
    Family(("llama4", "llama4_text"), LOCAL, roots=("language_model.model",), modules=("feed_forward",),
           nested=("text_config",), layer_rules=("moe_layers", "interleave_moe_layer_step")),
    Family(("longcat_flash",), _keys("n_routed_experts", "moe_topk", "expert_ffn_hidden_size",
                                     layers=("num_layers",), zero_experts=("zero_expert_num",)), mtp=DENSE_MTP),
    Family(("minimax_m2",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("mixtral",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("nemotron_h",), _keys("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                  hidden=("moe_latent_size", "hidden_size"), activation=("mlp_hidden_act",)),
           roots=("backbone",), modules=("mixer",), projections=NON_GATED, gated=False,
           layer_rules=("layers_block_type", "hybrid_override_pattern")),
    Family(("olmoe",), OLMO),
    Family(("phimoe",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("qwen2_moe",), QWEN, layer_rules=("decoder_sparse_step",)),
    Family(("qwen3_5_moe", "qwen3_5_moe_text"), QWEN, roots=("model.language_model",), nested=("text_config",),
           mtp=QWEN_MTP),
    Family(("qwen3_moe",), Keys(("num_experts", "num_local_experts"), ("num_experts_per_tok",), ("moe_intermediate_size",)),
           layer_rules=("decoder_sparse_step",)),
    Family(("qwen3_next",), QWEN, layer_rules=("decoder_sparse_step",), mtp=QWEN_MTP),
)

GENERIC = Family(
    model_types=("generic",),
    keys=Keys(experts=("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"),
              top_k=("num_experts_per_tok", "top_k_experts", "moe_top_k", "moe_k", "moe_topk", "num_experts_per_token"),
              intermediate=("moe_intermediate_size", "expert_intermediate_size", "intermediate_size"),
              hidden=("hidden_size", "d_model"), layers=("num_hidden_layers", "n_layers", "num_layers"),
              activation=("hidden_act", "hidden_activation")),
    roots=("model", "model.language_model", "language_model.model"),
    modules=("mlp", "block_sparse_moe", "moe", "feed_forward", None),
    projections=GATED + W123,
    nested=("text_config", "llm_config", "language_config"),
)

BY_MODEL_TYPE: dict[str, Family] = {t: fam for fam in FAMILIES for t in fam.model_types}


def family_of(*model_types: str | None) -> Family:
    """The row of the first known model_type given (top level, then the nested decoder's), else GENERIC."""
    return next((BY_MODEL_TYPE[t] for t in model_types if t in BY_MODEL_TYPE), GENERIC)


def all_rows() -> tuple[Family, ...]:
    """Every row, the generic fallback last."""
    return (*FAMILIES, GENERIC)


def mtp_roots() -> tuple[str, ...]:
    """The roots of every family's own MTP tree (e.g. `mtp`), for the name parser."""
    return tuple(dict.fromkeys(f.mtp.root for f in all_rows() if f.mtp is not None and f.mtp.root is not None))


def _cell(keys: tuple[str, ...]) -> str:
    return " / ".join(f"`{k}`" for k in keys)


def _names(family: Family) -> str:
    modules = [f".{m}" if m else "" for m in family.modules]
    projections = ", ".join(name for name, kind in family.projections if kind != "gate_up")
    return f"`{family.roots[0]}.layers.L{modules[0]}.experts.E.{{{projections}}}`"


def render_table() -> str:
    """The supported-models table of docs/models.md, rendered from the rows (so the page cannot drift)."""
    lines = ["| model_type | decoder config | experts / top-k / expert I | MoE layers | expert tensors | experts | "
             "MTP layers |", "|---|---|---|---|---|---|---|"]
    for family in FAMILIES:
        keys = family.keys
        values = " ; ".join(_cell(k) for k in (keys.experts, keys.top_k, keys.intermediate))
        values += f" ; zero experts {_cell(keys.zero_experts)}" if keys.zero_experts else ""
        rules = ", ".join(f"`{r}`" for r in family.layer_rules) or "every layer"
        kind = f"{'gated' if family.gated else '**not gated**'}, activation {_cell(keys.activation)}"
        lines.append(f"| {', '.join(family.model_types)} | {_cell(family.nested) or 'top level'} | {values} | "
                     f"{rules} | {_names(family)} | {kind} | {family.mtp.describe() if family.mtp else '—'} |")
    return "\n".join(lines)
