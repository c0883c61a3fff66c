"""The model families table: how each MoE `model_type` names its config keys and expert tensors.

One row per family (with its aliases). Adding a family is one row here plus one
test; the resolver (modelconfig.py) and the name parser (names.py) read only this
table. Unknown model types use the GENERIC row, which tries every alias.

A routed-expert tensor is `{root}.{L}[.{module}].experts.[{e}.]{proj}.{suffix}`, the root being everything
before the layer number (`model.layers`; DeepSeek-V4 publishes `layers`). A family's MTP
(multi-token-prediction, "NextN") layers are named in one of two ways (`MTP`): decoder layers appended
after the last one, `{root}.{L + i}` (DeepSeek-V3, GLM-4.x), or a tree of their own, `{mtp root}.{i}`
(`mtp.layers.{i}`: Qwen3-Next, Qwen3.5; `mtp.{i}`: DeepSeek-V4).
A family's shared experts (`SharedExperts`), computed for every token beside the routed ones,
are one MLP next to the routed experts, `{root}.{L}.{module}.{shared}.{proj}.{suffix}` (DeepSeek-V3:
`model.layers.3.mlp.shared_experts.gate_proj.qweight`): non-expert tensors, unless an engine fuses them into its
MoE layer as extra experts after the routed ones (SGLang on DeepSeek-V3/R1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GATED = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"), ("gate_up_proj", "gate_up"))
W123 = (("w1", "gate"), ("w3", "up"), ("w2", "down"))
NON_GATED = (("up_proj", "up"), ("down_proj", "down"))
DBRX = (("w1", "gate"), ("v1", "up"), ("w2", "down"))  # GPTQModel's per-expert DBRX modules


@dataclass(frozen=True)
class Keys:
    """Config keys tried in order for each value (a value may also be a per-layer list). A dotted key names a
    key inside a nested dict (`ffn_config.moe_num_experts`).

    `hidden`: the experts' input size (K of gate and up), the hidden size unless the family projects the
    hidden states down before its experts (`moe_hidden_size`, `moe_latent_size`);
    `per_modality`: keys whose list holds one value per modality, the text decoder's first
    (`moe_intermediate_size = [text, vision]`), never one per layer;
    `activation_limit`: the clamp of a clamped SwiGLU (recorded; the engine applies it).
    """

    experts: tuple[str, ...]
    top_k: tuple[str, ...]
    intermediate: tuple[str, ...]
    hidden: tuple[str, ...] = ("hidden_size",)
    layers: tuple[str, ...] = ("num_hidden_layers",)
    activation: tuple[str, ...] = ("hidden_act",)
    zero_experts: tuple[str, ...] = ()
    per_modality: tuple[str, ...] = ()
    activation_limit: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """Why a family's experts cannot be loaded into the fused WNA16 layout, and the config keys that show it."""

    keys: tuple[str, ...]
    why: str


def lookup(config: dict[str, Any], key: str) -> Any:
    """The value of `key` in `config`, a dotted key walking into nested dicts; None when absent."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


@dataclass(frozen=True)
class MTP:
    """A family's MTP layers: how many (the first of `keys` present, else `default`) and where.

    `root`: None for layers appended to the decoder, `{root}.{L + i}` with L the decoder layer count
    and the row's own roots and modules; else the root of their own tree, `{root}.{i}` (e.g. `mtp.layers`).
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
        where = f"`{self.root}.i`" if self.root else "appended `layers.{L+i}`"
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
    `roots` / `modules`: the tensor-name parts before and after the layer number `{L}` (`model.layers`, `mlp`);
    `projections`: (tensor name, "gate" | "up" | "down" | "gate_up");
    `layer_rules`: the MoE-layer rules (layer_rules.RULES names) this family's configs use;
    `gated`: experts compute act(gate) * up; non-gated experts compute act(up);
    `mtp`: the family's MTP layers (None: it has none);
    `experts`: the name of the experts' container after the module (`experts`; DBRX: `experts.mlp`);
    `refusal`: why the family's experts are refused (None: they load).
    `shared`: the family's shared experts beside the routed ones (None: it has none an engine fuses).
    """

    model_types: tuple[str, ...]
    keys: Keys
    roots: tuple[str, ...] = ("model.layers",)
    modules: tuple[str | None, ...] = ("mlp",)
    projections: tuple[tuple[str, str], ...] = GATED
    nested: tuple[str, ...] = ()
    layer_rules: tuple[str, ...] = ()
    gated: bool = True
    mtp: MTP | None = None
    experts: tuple[str, ...] = ("experts",)
    refusal: Refusal | None = None
    shared: SharedExperts | None = None

    @property
    def name(self) -> str:
        """The row's main model_type."""
        return self.model_types[0]

    def patterns(self) -> tuple[str, ...]:
        """The routed-expert tensor names this row looks for, one pattern per root and module, e.g.
        `model.layers.L.mlp.experts.E.{gate_proj, up_proj, down_proj}.SUFFIX`."""
        projections = ", ".join(name for name, _ in self.projections)
        return tuple(f"{root}.L{f'.{module}' if module else ''}.{experts}.E.{{{projections}}}.SUFFIX"
                     for root in self.roots for module in self.modules for experts in self.experts)


def _keys(experts: str, top_k: str, intermediate: str | tuple[str, ...], **more: tuple[str, ...]) -> Keys:
    inter = (intermediate,) if isinstance(intermediate, str) else intermediate
    return Keys(experts=(experts,), top_k=(top_k,), intermediate=inter, **more)


QWEN = _keys("num_experts", "num_experts_per_tok", "moe_intermediate_size")
DEEPSEEK = _keys("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
LOCAL = _keys("num_local_experts", "num_experts_per_tok", "intermediate_size")
OLMO = _keys("num_experts", "num_experts_per_tok", "intermediate_size")
# DeepSeek-V3 and GLM: `num_nextn_predict_layers` appended layers (vLLM deepseek_mtp.py, glm4_moe_mtp.py); Bailing
# hybrid and HY-V3 too (transformers' modeling ignores their `model.layers.{num_hidden_layers}.*` tensors)
NEXTN = MTP(("num_nextn_predict_layers",))
# Qwen3-Next / Qwen3.5: their own `mtp.layers.i` tree; vLLM counts 1 when the config names none (qwen3_next_mtp.py,
# qwen3_5_mtp.py), and Qwen3-Next's published config names none
QWEN_MTP = MTP(("mtp_num_hidden_layers", "num_nextn_predict_layers"), default=1, root="mtp.layers")
# ERNIE 4.5, EXAONE-MoE, LongCat-Flash: the MTP block's MLP is dense (vLLM ernie_mtp.py, exaone_moe_mtp.py,
# longcat_flash_mtp.py): its tensors are non-expert tensors
DENSE_MTP = MTP(("num_nextn_predict_layers",), routed=False)
# DeepSeek-V4 as published: `layers.L.ffn.experts.E.{w1, w3, w2}`, its MTP layers `mtp.i.ffn.experts...` (SGLang
# 0.5.23 deepseek_v4.py and transformers' conversion mapping rename them); every layer MoE, hash-routed or top-k
# (SGLang builds DeepseekV2MoE in every layer; transformers folds num_hash_layers into mlp_layer_types)
V4_MTP = MTP(("num_nextn_predict_layers",), root="mtp")
# HY-V4: its own `model.mtp_layers.i` tree, a MoE decoder layer each (transformers' modeling_hy_v4 ignores
# model\.mtp_layers\..*; SGLang 0.5.23 hunyuan_v4_nextn.py builds DeepseekV2MoE from it), counted by
# num_nextn_predict_layers, 1 where the config names none (SGLang's HYV4Config default)
HY_V4_MTP = MTP(("num_nextn_predict_layers",), default=1, root="model.mtp_layers")

QWEN3 = Keys(("num_experts", "num_local_experts"), ("num_experts_per_tok",), ("moe_intermediate_size",))
LANGUAGE_MODEL = ("model.language_model.layers",)
# Granite MoE (and -shared, -hybrid), JetMoE: ParallelExperts, one stacked tensor per projection
# (`block_sparse_moe.input_linear.weight`, renamed by transformers' conversion mapping)
STACKED_LINEAR = Refusal(("num_local_experts",), "its experts are one stacked tensor per projection "
                         "(ParallelExperts input_linear and output_linear, [E, N, K] each), not the per-expert "
                         "modules of a WNA16 checkpoint")
# Aria: AriaGroupedExpertsGemm, fc1 [E, H, 2I] and fc2 [E, I, H] (transformers' conversion mapping renames them)
STACKED_FC = Refusal(("moe_num_experts",), "its experts are one stacked tensor per projection (fc1, fc2: "
                     "[E, K, N] each), not the per-expert modules of a WNA16 checkpoint")
# Step-3.5 / 3.7: `model.layers.L.moe.{gate_proj, up_proj, down_proj}.weight`, each stacked [E, N, K], no experts
# container (transformers' conversion mapping), and a clamped SwiGLU per layer (swiglu_limits)
STACKED_MOE = Refusal(("n_routed_experts", "swiglu_limits"), "its experts are stacked tensors "
                      "moe.{gate_proj, up_proj, down_proj} [E, N, K] under no experts container, not the per-expert "
                      "modules of a WNA16 checkpoint")
# Inkling, Inkling-2: `model.llm.layers.L.mlp.experts.{w13_weight, w2_weight}` (transformers' conversion mapping)
STACKED_W13 = Refusal(("n_routed_experts",), "its experts are stacked tensors mlp.experts.w13_weight [E, 2I, H] "
                      "and w2_weight [E, H, I], not the per-expert modules of a WNA16 checkpoint")
# Doge's CDMoE: experts are rows of two embeddings (down_embed, up_embed), not gate/up/down projections
EMBEDDED = Refusal(("is_moe", "num_experts"), "its experts (CDMoE) are rows of two embedding tables, not "
                   "gate/up/down projections")
# Switch Transformers, NLLB-MoE: encoder-decoder models whose experts are `experts.expert_{e}.{wi, wo}`
SEQ2SEQ = Refusal(("num_experts", "num_sparse_encoder_layers", "num_sparse_decoder_layers"), "an encoder-decoder "
                  "model whose experts (experts.expert_{e}.wi / wo) are neither a decoder's nor gated projections")
# DiffusionGemma: a block-diffusion model (an encoder and a denoising decoder over one stack of weights) whose experts
# are stored stacked, `model.decoder.layers.L.experts.gate_up_proj` / `down_proj` (SGLang 0.5.23 gemma4_diffusion.py
# loads only these; transformers' DiffusionGemmaTextExperts holds the same 3-D tensors)
STACKED_DIFFUSION = Refusal(("num_experts",), "a block-diffusion model whose experts are stacked tensors "
                            "experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I] under model.decoder.layers, not "
                            "the per-expert modules of a WNA16 checkpoint")
# gpt-oss: biased experts (gate_up_proj_bias [E, 2I], down_proj_bias [E, H]) and SwiGLU clamped at swiglu_limit with
# sigmoid slope swiglu_alpha (modeling_gpt_oss.py GptOssExperts); the fused WNA16 layout has no bias slot
GPT_OSS = Refusal(("swiglu_limit", "swiglu_alpha"), "its experts carry biases (gate_up_proj_bias, down_proj_bias) "
                  "and a clamped SwiGLU (swiglu_limit, swiglu_alpha); the fused WNA16 layout holds neither biases "
                  "nor that activation")
# DeepSeek-V2/V3 and the models built on them (GLM-4.5, GLM-4.7-Flash, GLM-5, Kimi-K2.5): `mlp.shared_experts`,
# `n_shared_experts` of them in one MLP (SGLang's deepseek_v2.py, glm4_moe.py, glm4_moe_lite.py fuse one into the
# routed layer as expert n_routed_experts)
SHARED_EXPERTS = SharedExperts("shared_experts", ("n_shared_experts",))

FAMILIES: tuple[Family, ...] = (
    Family(("afmoe",), QWEN, layer_rules=("num_dense_layers",)),
    Family(("aria", "aria_text"), _keys("moe_num_experts", "moe_topk", "intermediate_size"), nested=("text_config",),
           refusal=STACKED_FC),
    Family(("axk1",), DEEPSEEK, layer_rules=("mlp_layer_types",)),
    Family(("axk2",), DEEPSEEK, layer_rules=("mlp_layer_types",)),
    Family(("bailing_hybrid",), _keys("num_experts", "num_experts_per_token", "moe_intermediate_size"),
           layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=NEXTN),
    Family(("beam",), QWEN, layer_rules=("mlp_layer_types",)),
    Family(("cohere2_moe",), OLMO, layer_rules=("mlp_layer_types",)),
    Family(("dbrx",), Keys(("ffn_config.moe_num_experts",), ("ffn_config.moe_top_k",), ("ffn_config.ffn_hidden_size",),
                           hidden=("d_model",), layers=("n_layers",), activation=("ffn_config.ffn_act_fn.name",)),
           roots=("transformer.blocks",), modules=("ffn",), experts=("experts.mlp",), projections=DBRX),
    Family(("deepseek_v3", "deepseek_v2"), DEEPSEEK, layer_rules=("first_k_dense_replace",), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("deepseek_v32",), DEEPSEEK, layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("deepseek_v4",), Keys(("n_routed_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",),
                                  activation_limit=("swiglu_limit",)),
           roots=("layers",), modules=("ffn",), projections=W123, layer_rules=("mlp_layer_types", "num_hash_layers"),
           mtp=V4_MTP),
    # DeepSeek-OCR-2: its language model published as `model.layers.L.mlp.experts.E.{gate,up,down}_proj` (transformers'
    # conversion mapping moves it to model.language_model.layers; vLLM deepseek_ocr2.py maps model.layers likewise)
    Family(("deepseek_ocr2", "deepseek_ocr2_text"), DEEPSEEK, nested=("text_config",),
           layer_rules=("mlp_layer_types",)),
    Family(("diffusion_gemma", "diffusion_gemma_text"), _keys("num_experts", "top_k_experts", "moe_intermediate_size",
                                                              activation=("hidden_activation",)),
           nested=("text_config",), refusal=STACKED_DIFFUSION),
    Family(("doge",), QWEN, refusal=EMBEDDED),
    Family(("dots1",), DEEPSEEK, layer_rules=("first_k_dense_replace",)),
    Family(("dots3_note", "dots3_note_text"), DEEPSEEK, roots=LANGUAGE_MODEL, nested=("text_config",),
           layer_rules=("mlp_layer_types",)),
    Family(("ernie4_5_moe",), _keys("moe_num_experts", "moe_k", "moe_intermediate_size"),
           layer_rules=("moe_layer_start_index",), mtp=DENSE_MTP),
    Family(("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"),
           _keys("moe_num_experts", "moe_k", "moe_intermediate_size", per_modality=("moe_intermediate_size",)),
           nested=("text_config",), layer_rules=("mlp_layer_types",)),
    Family(("exaone_moe",), QWEN, layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=DENSE_MTP),
    Family(("flex_olmo",), OLMO),
    Family(("flint",), QWEN, layer_rules=("decoder_sparse_step",)),
    Family(("gemma4", "gemma4_text"), _keys("num_experts", "top_k_experts", "moe_intermediate_size",
                                            activation=("hidden_activation",)),
           roots=("model.language_model.layers",), modules=(None,), nested=("text_config",),
           layer_rules=("enable_moe_block",)),
    Family(("glm4_moe",), DEEPSEEK, layer_rules=("first_k_dense_replace",), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("glm4_moe_lite",), DEEPSEEK, layer_rules=("mlp_layer_types",), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("glm4v_moe", "glm4v_moe_text"), DEEPSEEK, roots=LANGUAGE_MODEL, nested=("text_config",),
           layer_rules=("first_k_dense_replace",), mtp=NEXTN),
    Family(("glm5_next", "glm5_next_text"), Keys(("n_routed_experts",), ("num_experts_per_tok",),
                                                 ("moe_intermediate_size",), activation_limit=("swiglu_limit",)),
           roots=LANGUAGE_MODEL, nested=("text_config",), layer_rules=("mlp_layer_types",)),
    Family(("glm_moe_dsa",), DEEPSEEK, layer_rules=("mlp_layer_types", "first_k_dense_replace"), mtp=NEXTN,
           shared=SHARED_EXPERTS),
    Family(("gpt_oss",), LOCAL, refusal=GPT_OSS),
    Family(("granitemoe", "granitemoeshared", "granitemoehybrid"), LOCAL, modules=("block_sparse_moe",),
           refusal=STACKED_LINEAR),
    Family(("hunyuan_v1_moe",), _keys("num_experts", "moe_topk", ("moe_intermediate_size", "intermediate_size"))),
    Family(("hy_v3",), QWEN, layer_rules=("mlp_layer_types",), mtp=NEXTN),
    Family(("hy_v4",), Keys(("n_routed_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",),
                            activation_limit=("swiglu_limit",)), layer_rules=("mlp_layer_types",), mtp=HY_V4_MTP),
    Family(("inkling2", "inkling2_text"), DEEPSEEK, nested=("text_config",), refusal=STACKED_W13),
    Family(("inkling_mm_model", "inkling_text"), DEEPSEEK, nested=("text_config",), refusal=STACKED_W13),
    Family(("jamba",), OLMO, modules=("feed_forward",), layer_rules=("expert_layer_period",)),
    Family(("jetmoe",), LOCAL, refusal=STACKED_LINEAR),
    Family(("kimi_k25",), DEEPSEEK, roots=("language_model.model.layers",), nested=("text_config",),
           layer_rules=("first_k_dense_replace",), mtp=NEXTN, shared=SHARED_EXPERTS),
    # Kimi K3 (SGLang 0.5.23 kimi_k3.py): latent MoE, the experts take routed_expert_hidden_size
    # (routed_expert_down_proj projects the hidden states down first); their SiTU activation (hidden_act "situ", with
    # activation_situ_beta and activation_situ_linear_beta) is the engine's; MoE layers as its _is_moe_layer; no MTP
    Family(("kimi_k3",), _keys("num_experts", "num_experts_per_token", "moe_intermediate_size",
                               hidden=("routed_expert_hidden_size", "hidden_size")),
           roots=("language_model.model.layers",), modules=("block_sparse_moe",), projections=W123,
           nested=("text_config",), layer_rules=("first_k_dense_replace",)),
    Family(("kimi_linear",), _keys("num_experts", "num_experts_per_token", "moe_intermediate_size"),
           modules=("block_sparse_moe",), projections=W123, layer_rules=("mlp_layer_types",)),
    Family(("kolibri1",), _keys("num_local_experts", "num_experts_per_tok", "moe_intermediate_size")),
    Family(("laguna",), QWEN, layer_rules=("mlp_layer_types",)),
    Family(("lfm2_moe",), QWEN, modules=("feed_forward",), projections=W123, layer_rules=("num_dense_layers",)),
    Family(("llama4", "llama4_text"), LOCAL, roots=("language_model.model.layers",), modules=("feed_forward",),
           nested=("text_config",), layer_rules=("moe_layers", "interleave_moe_layer_step")),
    Family(("longcat_flash",), _keys("n_routed_experts", "moe_topk", "expert_ffn_hidden_size",
                                     layers=("num_layers",), zero_experts=("zero_expert_num",)), mtp=DENSE_MTP),
    Family(("mellum",), _keys("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
           layer_rules=("mlp_layer_types",)),
    Family(("mimo_v2_flash",), DEEPSEEK, layer_rules=("mlp_layer_types",), mtp=DENSE_MTP),
    Family(("minimax",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("minimax_m2",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("minimax_m3_vl", "minimax_m3_vl_text"), Keys(("num_local_experts",), ("num_experts_per_tok",),
                                                         ("intermediate_size",), activation_limit=("swiglu_limit",)),
           roots=("language_model.model.layers",), modules=("block_sparse_moe",), projections=W123,
           nested=("text_config",), layer_rules=("mlp_layer_types",)),
    Family(("mistral4",), DEEPSEEK, layer_rules=("first_k_dense_replace",)),
    Family(("mistral_large4", "mistral_large4_text"), DEEPSEEK, roots=LANGUAGE_MODEL, nested=("text_config",),
           layer_rules=("mlp_layer_types", "first_k_dense_replace")),
    Family(("mixtral",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("muse_spark", "muse_spark_text"), _keys("num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                    hidden=("moe_hidden_size",)),
           roots=LANGUAGE_MODEL, nested=("text_config",), layer_rules=("mlp_layer_types",)),
    Family(("nemotron_h",), _keys("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                  hidden=("moe_latent_size", "hidden_size"), activation=("mlp_hidden_act",)),
           roots=("backbone.layers",), modules=("mixer",), projections=NON_GATED, gated=False,
           layer_rules=("layers_block_type", "hybrid_override_pattern")),
    Family(("nllb-moe", "switch_transformers"), _keys("num_experts", "num_experts_per_tok", "d_ff"),
           refusal=SEQ2SEQ),
    Family(("olmoe",), OLMO),
    Family(("openai_privacy_filter",), LOCAL, refusal=GPT_OSS),
    Family(("phimoe",), LOCAL, modules=("block_sparse_moe",), projections=W123),
    Family(("qwen2_moe",), QWEN, layer_rules=("decoder_sparse_step",)),
    Family(("qwen3_5_moe", "qwen3_5_moe_text"), QWEN, roots=("model.language_model.layers",), nested=("text_config",),
           mtp=QWEN_MTP),
    Family(("qwen3_moe",), QWEN3, layer_rules=("decoder_sparse_step",)),
    Family(("qwen3_next",), QWEN, layer_rules=("decoder_sparse_step",), mtp=QWEN_MTP),
    Family(("qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_text"), QWEN, roots=("thinker.model.layers",),
           nested=("thinker_config.text_config",), layer_rules=("decoder_sparse_step",)),
    Family(("qwen3_vl_moe", "qwen3_vl_moe_text"), QWEN3, roots=LANGUAGE_MODEL, nested=("text_config",),
           layer_rules=("decoder_sparse_step",)),
    Family(("qwen4_exp", "qwen4_exp_text"), QWEN, roots=LANGUAGE_MODEL, nested=("text_config",), mtp=QWEN_MTP),
    Family(("solar_open",), DEEPSEEK),
    Family(("step3p7", "step3p5"), DEEPSEEK, nested=("text_config",), refusal=STACKED_MOE),
    Family(("unlimited_ocr", "unlimited_ocr_text"), DEEPSEEK, roots=LANGUAGE_MODEL, nested=("text_config",),
           layer_rules=("mlp_layer_types",)),
    Family(("zaya",), QWEN),
)

GENERIC = Family(
    model_types=("generic",),
    keys=Keys(experts=("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"),
              top_k=("num_experts_per_tok", "top_k_experts", "moe_top_k", "moe_k", "moe_topk", "num_experts_per_token"),
              intermediate=("moe_intermediate_size", "expert_intermediate_size", "intermediate_size"),
              hidden=("hidden_size", "d_model"), layers=("num_hidden_layers", "n_layers", "num_layers"),
              activation=("hidden_act", "hidden_activation")),
    roots=("model.layers", "model.language_model.layers", "language_model.model.layers"),
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
