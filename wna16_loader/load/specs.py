"""Each layer's quantization spec, as the config's rules give it and as its tensors show it (headers only).

The rules (`MoEConfig.spec_of`, `models.layer_specs`) say what the quantizer meant; the tensors say what
it wrote. Where a layer's expert tensors are float `.weight` but its rule says quantized, or the reverse
(published configs are sometimes wrong: MTP layers, excluded layers, lists naming children), the
tensors decide, and one warning names the rule, the layer and what was found. Quantized tensors under
a float rule take the first of the config's quantized specs their headers fit; shapes that fit none
are an error with every number.
"""

from __future__ import annotations

import logging
from typing import Container, Sequence

from ..errors import FormatError
from ..formats import ModuleRules, QuantSpec, Role, unquantized_spec
from ..logs import log, warn_reduced_groups
from ..models.config import MoEConfig
from ..models.layer_specs import LayerSpec, resolve_layer_spec
from ..models.names import ExpertTensorKey, LayerNames, Source
from ..storage.index import TensorRef
from .params import SourceTensors, expected_shape


def checked_layer_spec(moe: MoEConfig, keys: LayerNames, refs: dict[str, TensorRef],
                       modules: Container[str] = ()) -> LayerSpec:
    """The spec of the layer whose routed-expert tensors are `keys`: the rules' (every module of the
    layer resolved; one spec per layer), unless the tensors show the other kind (see the module doc).
    `modules`: every module name of the checkpoint, for rules that need them."""
    prefix = keys.prefix
    declared = moe.spec_of(prefix) if moe.rules is None else _declared(moe.rules, prefix, keys, modules)
    suffixes = keys.suffixes
    float_suffixes = {suffix for suffix in suffixes if unquantized_spec().layout_for_suffix(suffix) is not None}
    floats = [key for key in keys if key.suffix in float_suffixes] if float_suffixes else []
    if declared.spec.quantized and floats and not suffixes & {lay.suffix for lay in declared.spec.layouts}:
        found = f"float tensors such as {_named(floats[0], refs)}"
        _warn(prefix, declared, found)
        return LayerSpec(unquantized_spec(), declared.rule, refs[floats[0].name].dtype, found)
    if not declared.spec.quantized and keys and not floats:
        spec = _fitting_spec(moe, prefix, keys, refs)
        found = f"quantized tensors such as {_named(keys[0], refs)}, read as {spec.describe()}"
        _warn(prefix, declared, found)
        return LayerSpec(spec, declared.rule, None, found)
    dtype = refs[floats[0].name].dtype if floats and not declared.spec.quantized else None
    return LayerSpec(declared.spec, declared.rule, dtype)


def _declared(rules: ModuleRules, prefix: str, keys: Sequence[ExpertTensorKey], modules: Container[str]) -> LayerSpec:
    """The rules' spec of the layer: without any rule every module gets the default, so the layer does (no
    module is resolved one by one); else `resolve_layer_spec` over the layer's modules."""
    every = rules.uniform()
    if every is not None and every.refusal is None:
        return LayerSpec(every.spec, every.origin)
    return resolve_layer_spec(rules, prefix, sorted({key.module_name for key in keys}), modules)


def _named(key: ExpertTensorKey, refs: dict[str, TensorRef]) -> str:
    ref = refs[key.name]
    return f"{ref.name} {list(ref.shape)} {str(ref.dtype).removeprefix('torch.')}"


def _warn(prefix: str, declared: LayerSpec, found: str) -> None:
    log.warning("%s: %s makes this layer %s, but its expert tensors are %s; loading the layer as its tensors "
                "are stored (the tensors decide).", prefix, declared.rule, declared.spec.describe(), found)


def _fitting_spec(moe: MoEConfig, prefix: str, keys: Sequence[ExpertTensorKey],
                  refs: dict[str, TensorRef]) -> QuantSpec:
    """The first quantized spec of the config whose qweight and scales shapes fit the layer's first expert
    tensors of those roles (FormatError with every number when none fits)."""
    candidates = moe.rules.specs() if moe.rules is not None else (moe.quant,)
    tried = []
    for spec in candidates:
        probe: dict[Role, ExpertTensorKey] = {}
        for key in keys:
            layout = spec.layout_for_suffix(key.suffix)
            if layout is not None:
                probe.setdefault(layout.role, key)
        wanted = {role: _wanted(moe, spec, probe[role]) for role in (Role.QWEIGHT, Role.SCALES) if role in probe}
        if Role.QWEIGHT in wanted and all(refs[probe[r].name].shape == shape for r, shape in wanted.items()):
            return spec
        tried.append(f"{spec.describe()}: " + ", ".join(
            f"{probe[r].name} {list(refs[probe[r].name].shape)} (expected {list(shape)})" for r, shape in wanted.items()))
    found = ", ".join(_named(key, refs) for key in keys[:3])
    raise FormatError(f"{prefix}: the config leaves this layer in float, but its expert tensors are quantized "
                      f"({found}); they fit none of the config's quantized specs (H={moe.hidden_size}, "
                      f"I={moe.layer(keys[0].layer).intermediate_size}): {'; '.join(tried) or 'none declared'}. "
                      f"Fix the layer's rule in the quantization config.")


def _wanted(moe: MoEConfig, spec: QuantSpec, key: ExpertTensorKey) -> tuple[int, ...]:
    """The shape `spec` implies for the tensor of `key` (stacked: a leading E)."""
    hidden, inter = moe.hidden_size, moe.layer(key.layer).intermediate_size
    down = key.source is Source.DOWN
    src = SourceTensors(key.source, {}, None if key.expert is not None else 0,
                        (hidden if down else inter) * len(key.source.projs), inter if down else hidden)
    return expected_shape(spec.layout_for_suffix(key.suffix), spec, src, moe.layer(key.layer).num_experts)


def warn_reduced_groups_by_spec(logger: logging.Logger | logging.LoggerAdapter, effective: dict[str, tuple[int, int]],
                                *, tp_size: int, intermediate: int) -> None:
    """`warn_reduced_groups` for layers of several group sizes: `effective` maps a prefix to (its spec's
    G, its G_eff); one warning per checkpoint group size that some layer reduces."""
    for group_size in dict.fromkeys(g for g, _ in effective.values()):
        warn_reduced_groups(logger, group_size=group_size, tp_size=tp_size, intermediate=intermediate,
                            effective={p: eff for p, (g, eff) in effective.items() if g == group_size})
