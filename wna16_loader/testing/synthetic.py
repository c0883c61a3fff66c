"""Synthetic WNA16 MoE checkpoints from known quantized weights, for tests, the demo and benchmarks.

Writes real safetensors files in any declared format through the format's own
layouts (the exact inverse of the reader), a config.json in the naming of a
model family, and returns the float32 reference W = (q - z) * s of every expert
projection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..formats import FORMATS, Dim, QuantSpec, Role, TensorLayout, resolve_quant_spec
from ..formats.packing import pack_words, word_bias
from ..models.names import experts_prefix_for, shared_prefix
from ..parallel.partition import ceil_div


@dataclass(frozen=True)
class WriterModel:
    """The test writer's own spelling of one model's config.json and expert tensor names (for the
    synthetic `write_checkpoint`). The loader never reads it: it resolves what is written here through the
    families table (`models/families.py`), so a checkpoint written from this table tests that table."""

    model_type: str
    keys: dict[str, str]  # concept -> config key
    root: str = "model.layers"
    module: str | None = "mlp"
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    extra: dict[str, Any] = field(default_factory=dict)
    nested: bool = False  # config under text_config


WRITER_MODELS: dict[str, WriterModel] = {  # what write_checkpoint(family=...) can write
    "mixtral": WriterModel("mixtral", {"experts": "num_local_experts", "top_k": "num_experts_per_tok",
                                  "inter": "intermediate_size"}, module="block_sparse_moe",
                      proj_names=("w1", "w3", "w2")),
    "qwen2_moe": WriterModel("qwen2_moe", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                                      "inter": "moe_intermediate_size"},
                        extra={"decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": 5632}),
    "qwen3_moe": WriterModel("qwen3_moe", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                                      "inter": "moe_intermediate_size"},
                        extra={"decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": 6144}),
    "deepseek_v3": WriterModel("deepseek_v3", {"experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                                          "inter": "moe_intermediate_size"},
                          extra={"first_k_dense_replace": 1, "moe_layer_freq": 1, "n_shared_experts": 1,
                                 "intermediate_size": 18432}),
    "gemma4": WriterModel("gemma4_text", {"experts": "num_experts", "top_k": "top_k_experts",
                                     "inter": "moe_intermediate_size"}, root="model.language_model.layers", module=None,
                     extra={"enable_moe_block": True, "intermediate_size": 2112}, nested=True),
    "olmoe": WriterModel("olmoe", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                              "inter": "intermediate_size"}),
    "glm4_moe": WriterModel("glm4_moe", {"experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                                    "inter": "moe_intermediate_size"},
                       extra={"first_k_dense_replace": 1, "intermediate_size": 10944}),
}


@dataclass(frozen=True)
class QuantizedProjection:
    """Canonical quantized weights of one projection W[N, K].

    | q      | [N, K]  uint8  | scales | [N, nG] scale dtype |
    | zeros  | [N, nG] uint8  | g_idx  | [K] int32 or None   |
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None

    def dequantize(self, group_size: int) -> torch.Tensor:
        """W = (q - z) * s in float32."""
        k = self.q.shape[1]
        groups = self.g_idx.long() if self.g_idx is not None else (
            torch.zeros(k, dtype=torch.long) if group_size == -1 else torch.arange(k) // group_size)
        return (self.q.float() - self.zeros.float()[:, groups]) * self.scales.float()[:, groups]


def act_order_g_idx(gen: torch.Generator, k: int, group_size: int) -> torch.Tensor:
    """A random act-order g_idx: groups of G rows scattered over K."""
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


def random_projection(gen: torch.Generator, n: int, k: int, spec: QuantSpec, scale_dtype: torch.dtype,
                      g_idx: torch.Tensor | None = None) -> QuantizedProjection:
    """Random q, exactly representable scales, zeros covering 0 and 2^b - 1."""
    groups = 1 if spec.group_size == -1 else ceil_div(k, spec.group_size)
    top = 1 << spec.bits
    q = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.randint(1, 256, (n, groups), generator=gen).float() / 1024).to(scale_dtype)
    if spec.symmetric:
        zeros = torch.full((n, groups), spec.implicit_zero, dtype=torch.uint8)
    else:
        zeros = torch.randint(0, top, (n, groups), generator=gen, dtype=torch.uint8)
        zeros[::3, ::2] = 0  # zero points of 0 borrow from their neighbour in GPTQ v1 words
        zeros[1::4, 1::2] = top - 1
    return QuantizedProjection(q, scales, zeros, g_idx if spec.act_order else None)


def encode_role(spec: QuantSpec, layout: TensorLayout, proj: QuantizedProjection) -> torch.Tensor:
    """The checkpoint tensor of `layout` for `proj` (the inverse of the reader)."""
    n, k = proj.q.shape
    canonical = {Role.QWEIGHT: (proj.q, (Dim.N, Dim.K)), Role.ZEROS: (proj.zeros, (Dim.N, Dim.GROUP)),
                 Role.SCALES: (proj.scales, (Dim.N, Dim.GROUP)), Role.G_IDX: (proj.g_idx, (Dim.K,)),
                 Role.SHAPE: (torch.tensor([n, k], dtype=torch.int64), (Dim.PAIR,))}
    tensor, dims = canonical[layout.role]
    tensor = tensor.permute([dims.index(d) for d in layout.dims]) if len(dims) > 1 else tensor
    if layout.packed is None:
        return tensor.contiguous().clone()
    words = pack_words(tensor, bits=spec.bits, dim=layout.dims.index(layout.packed), slot_order=layout.slot_order)
    if spec.zero_word_bias and layout.role is Role.ZEROS:
        wide = (words.to(torch.int64) - word_bias(spec.bits)) % (1 << 32)
        words = torch.where(wide >= 1 << 31, wide - (1 << 32), wide).to(torch.int32)
    return words.contiguous()


def encode_projection(spec: QuantSpec, proj: QuantizedProjection) -> dict[str, torch.Tensor]:
    """suffix -> tensor for every role this projection carries."""
    out = {}
    for layout in spec.layouts:
        if layout.role is Role.G_IDX and proj.g_idx is None:
            continue
        if layout.role is Role.ZEROS and spec.symmetric:
            continue
        out[layout.suffix] = encode_role(spec, layout, proj)
    return out


def stack_projections(projs: list[QuantizedProjection]) -> QuantizedProjection:
    """Concatenate projections along N (gate then up)."""
    return QuantizedProjection(torch.cat([p.q for p in projs]), torch.cat([p.scales for p in projs]),
                               torch.cat([p.zeros for p in projs]), projs[0].g_idx)


@dataclass(frozen=True)
class SyntheticCheckpoint:
    """A written checkpoint and its float32 references, keyed (experts prefix, expert, "gate"|"up"|"down")."""

    folder: Path
    spec: QuantSpec
    references: dict[tuple[str, int, str], torch.Tensor]
    prefixes: tuple[str, ...]


def model_config(family: WriterModel, quant_config: dict[str, Any], *, num_experts: int, hidden: int,
                 intermediate: int, num_layers: int, top_k: int) -> dict[str, Any]:
    """A config.json for `family` with the given sizes."""
    text = {"model_type": family.model_type, "hidden_size": hidden, "num_hidden_layers": num_layers,
            family.keys["experts"]: num_experts, family.keys["top_k"]: top_k, **family.extra,
            family.keys["inter"]: intermediate}
    if family.nested:
        return {"model_type": family.model_type.removesuffix("_text"), "text_config": text,
                "quantization_config": quant_config}
    return {**text, "quantization_config": quant_config}


def _layer_tensors(gen: torch.Generator, spec: QuantSpec, proj_names: dict[str, str], prefix: str,
                   sizes: tuple[int, int, int], scale_dtype: torch.dtype, stacked: bool,
                   refs: dict[tuple[str, int, str], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Every expert tensor of one MoE layer; fills `refs` unless it is None. `proj_names` maps "gate" / "up" /
    "down" to the checkpoint's projection names (no "gate": non-gated experts)."""
    num_experts, hidden, inter = sizes
    out: dict[str, torch.Tensor] = {}
    per_expert: list[tuple[QuantizedProjection, QuantizedProjection]] = []
    for e in range(num_experts):
        shared = act_order_g_idx(gen, hidden, spec.group_size) if spec.act_order else None
        projs = {name: random_projection(gen, inter, hidden, spec, scale_dtype, shared)
                 for name in ("gate", "up") if name in proj_names}
        down_g = act_order_g_idx(gen, inter, spec.group_size) if spec.act_order else None
        projs["down"] = random_projection(gen, hidden, inter, spec, scale_dtype, down_g)
        if refs is not None:
            refs.update({(prefix, e, name): proj.dequantize(spec.group_size) for name, proj in projs.items()})
        per_expert.append((stack_projections([projs["gate"], projs["up"]]) if "gate" in projs else projs["up"],
                           projs["down"]))
        if not stacked:
            for name, proj in projs.items():
                for suffix, tensor in encode_projection(spec, proj).items():
                    out[f"{prefix}.{e}.{proj_names[name]}.{suffix}"] = tensor
    if stacked:
        for proj_name, index in (("gate_up_proj", 0), ("down_proj", 1)):
            encoded = [encode_projection(spec, pair[index]) for pair in per_expert]
            for suffix in encoded[0]:
                out[f"{prefix}.{proj_name}.{suffix}"] = torch.stack([enc[suffix] for enc in encoded])
    return out


def _other_tensors(gen: torch.Generator, root: str, module: str | None, layer: int, moe: bool, num_experts: int,
                   hidden: int) -> dict[str, torch.Tensor]:
    """Router, attention, norms, shared experts and dense MLPs: tensors the loader must leave alone."""
    base = f"{root}.{layer}"
    module = module or "mlp"
    out = {f"{base}.input_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
           f"{base}.self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=gen).to(torch.float16)}
    if moe:
        out[f"{base}.{module}.gate.weight"] = torch.randn(num_experts, hidden, generator=gen).to(torch.float16)
        out[f"{base}.{module}.shared_experts.gate_proj.qweight"] = torch.zeros(hidden // 8, 16, dtype=torch.int32)
    else:
        out[f"{base}.mlp.gate_proj.qweight"] = torch.zeros(hidden // 8, 32, dtype=torch.int32)
    return out


def write_checkpoint(folder: str | Path, quant_config: dict[str, Any], *, family: str = "qwen3_moe",
                     num_experts: int = 4, hidden: int = 64, intermediate: int = 64, num_layers: int = 1,
                     top_k: int = 2, files: int = 1, stacked: bool = False,
                     scale_dtype: torch.dtype = torch.float16, seed: int = 0,
                     references: bool = True) -> SyntheticCheckpoint:
    """Write a synthetic checkpoint to `folder` and return its references.

    Tensors of decoder layer L go to shard L % files; an index file is written
    when files > 1. `references=False` skips the float32 references (4 bytes per
    weight), for benchmark-sized checkpoints.
    """
    from ..models.config import text_config
    from ..models.layer_rules import select_moe_layers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fam = WRITER_MODELS[family]
    spec = resolve_quant_spec(quant_config)
    config = model_config(fam, quant_config, num_experts=num_experts, hidden=hidden, intermediate=intermediate,
                          num_layers=num_layers, top_k=top_k)
    gen = torch.Generator().manual_seed(seed)
    refs: dict[tuple[str, int, str], torch.Tensor] | None = {} if references else None
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    shards[0]["model.embed_tokens.weight"] = torch.randn(32, hidden, generator=gen).to(torch.float16)
    prefixes = []
    moe_layers = select_moe_layers(text_config(config), num_layers)[0]
    for layer in range(num_layers):
        moe = layer in moe_layers
        shard = shards[layer % files]
        shard.update(_other_tensors(gen, fam.root, fam.module, layer, moe, num_experts, hidden))
        if moe:
            prefix = experts_prefix_for(fam.root, layer, fam.module)
            prefixes.append(prefix)
            names = dict(zip(("gate", "up", "down"), fam.proj_names))
            shard.update(_layer_tensors(gen, spec, names, prefix, (num_experts, hidden, intermediate), scale_dtype,
                                        stacked, refs))
    _save(folder, config, shards)
    return SyntheticCheckpoint(folder=folder, spec=spec, references=refs or {}, prefixes=tuple(prefixes))


def write_family_checkpoint(folder: str | Path, config: dict[str, Any], quant_config: dict[str, Any], *,
                            files: int = 1, scale_dtype: torch.dtype = torch.float16, seed: int = 0,
                            mtp: bool = False, mtp_dtype: torch.dtype | None = None,
                            shared: bool = False) -> SyntheticCheckpoint:
    """Write a checkpoint for a real `config` (a config.json of any family of the table) and return its
    references: expert tensors for every MoE layer the config names, at each layer's own sizes, under the
    family's root, module and projection names (up and down only for non-gated families).
    `mtp`: also every MTP layer the config declares (`MoEConfig.mtp`), in the family's MTP naming, with its
    non-expert tensors; its experts quantized like the rest (references and `prefixes` include them), or with
    `mtp_dtype` as unquantized `.weight` tensors of that dtype (as official Qwen3.5 GPTQ releases ship them).
    `shared`: also each MoE layer's shared experts (the row's `SharedExperts` module, quantized like the routed
    ones, I = the count x the expert I), their references under (that module's name, 0, projection)."""
    from ..models.config import resolve_moe_config
    from ..models.families import BY_MODEL_TYPE, GENERIC

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**config, "quantization_config": quant_config}
    moe = resolve_moe_config(config)
    row = BY_MODEL_TYPE.get(moe.family, GENERIC)
    names = {kind: next(n for n, k in row.projections if k == kind) for kind in ("gate", "up", "down")
             if any(k == kind for _, k in row.projections)}
    root, module, experts = row.roots[0], row.modules[0], row.experts[0]
    gen = torch.Generator().manual_seed(seed)
    refs: dict[tuple[str, int, str], torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    prefixes = []
    for layer in range(moe.num_layers):
        values = moe.layer(layer)
        shard = shards[layer % files]
        shard.update(_other_tensors(gen, root, module, layer, layer in moe.moe_layers, values.num_experts,
                                    moe.hidden_size))
        if layer in moe.moe_layers:
            prefixes.append(experts_prefix_for(root, layer, module, experts))
            shard.update(_layer_tensors(gen, moe.quant, names, prefixes[-1], (values.num_experts, moe.hidden_size,
                                        values.intermediate_size), scale_dtype, False, refs))
            if shared:
                module = shared_prefix(prefixes[-1], row.shared.module)
                inter = values.intermediate_size * moe.shared_experts
                for placeholder in [name for name in shard if name.startswith(f"{module}.")]:  # _other_tensors'
                    del shard[placeholder]
                shard.update(_shared_tensors(gen, moe.quant, names, module, (moe.hidden_size, inter), scale_dtype, refs))
    if mtp:
        prefixes += _write_mtp(gen, moe, names, (root, module), shards[-1], scale_dtype, refs, mtp_dtype)
    _save(folder, config, shards)
    return SyntheticCheckpoint(folder=folder, spec=moe.quant, references=refs, prefixes=tuple(prefixes))


def _shared_tensors(gen: torch.Generator, spec: QuantSpec, names: dict[str, str], module: str, sizes: tuple[int, int],
                    scale_dtype: torch.dtype, refs: dict[tuple[str, int, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A shared-expert module's tensors, `{module}.{proj}.{suffix}` (one expert's, without an expert index)."""
    tensors = _layer_tensors(gen, spec, names, module, (1, *sizes), scale_dtype, False, refs)
    return {name.replace(f"{module}.0.", f"{module}.", 1): tensor for name, tensor in tensors.items()}


def _write_mtp(gen: torch.Generator, moe: Any, names: dict[str, str], where: tuple[str, str | None],
               shard: dict[str, torch.Tensor], scale_dtype: torch.dtype, refs: dict[tuple[str, int, str], torch.Tensor],
               dtype: torch.dtype | None) -> list[str]:
    """Every MTP layer `moe` (a MoEConfig) declares into `shard`: its own tensors, router, attention and
    experts (quantized with references, or 16-bit `.weight` of `dtype`); returns their experts prefixes."""
    root, module = where
    sizes, prefixes = (moe.num_experts, moe.hidden_size, moe.intermediate_size), []
    for i in range(moe.mtp.count if moe.mtp.routed else 0):
        mtp_root, layer = moe.mtp.root or root, moe.mtp.first + i
        prefixes.append(experts_prefix_for(mtp_root, layer, module))
        shard.update(_mtp_tensors(gen, mtp_root, layer, moe.hidden_size, moe.mtp.root is not None))
        shard.update(_other_tensors(gen, mtp_root, module, layer, True, moe.num_experts, moe.hidden_size))
        shard.update(_layer_tensors(gen, moe.quant, names, prefixes[-1], sizes, scale_dtype, False, refs)
                     if dtype is None else _unquantized(gen, names, prefixes[-1], sizes, dtype))
    return prefixes


def _mtp_tensors(gen: torch.Generator, root: str, layer: int, hidden: int, tree: bool) -> dict[str, torch.Tensor]:
    """An MTP layer's own non-expert tensors: the tree's fc and norms (`tree`: Qwen3-Next / Qwen3.5, `mtp.*`),
    else the appended layer's enorm, hnorm, eh_proj and shared_head norm (DeepSeek-V3 / GLM). `root`: the
    layers' root (`mtp.layers`, `model.layers`)."""
    base, top = f"{root}.{layer}", root.removesuffix(".layers")
    norms = (f"{top}.norm", f"{top}.pre_fc_norm_embedding", f"{top}.pre_fc_norm_hidden") if tree else \
        (f"{base}.enorm", f"{base}.hnorm", f"{base}.shared_head.norm")
    out = {f"{name}.weight": torch.ones(hidden, dtype=torch.bfloat16) for name in norms}
    out[f"{top}.fc.weight" if tree else f"{base}.eh_proj.weight"] = \
        torch.randn(hidden, 2 * hidden, generator=gen).to(torch.bfloat16)
    return out


def _unquantized(gen: torch.Generator, names: dict[str, str], prefix: str, sizes: tuple[int, int, int],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One layer's expert projections as 16-bit `{prefix}.{e}.{proj}.weight [N, K]` tensors, not quantized."""
    num_experts, hidden, inter = sizes
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return {f"{prefix}.{e}.{proj}.weight": torch.randn(*shapes[kind], generator=gen).to(dtype)
            for e in range(num_experts) for kind, proj in names.items()}


def _save(folder: Path, config: dict[str, Any], shards: list[dict[str, torch.Tensor]]) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                    indent=2))


def quant_config(format_name: str, *, bits: int = 4, group_size: int = 32, symmetric: bool = False,
                 act_order: bool = False, **extra: Any) -> dict[str, Any]:
    """A `quantization_config` for a registered format (see formats.FORMATS)."""
    decl = next((d for d in FORMATS if d.name == format_name), None)
    if decl is None:
        raise KeyError(f"unknown format {format_name!r}; known: {[d.name for d in FORMATS]}")
    return decl.to_config(bits, group_size, symmetric, act_order, **extra)
