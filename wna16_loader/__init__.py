"""wna16_loader: load WNA16-quantized MoE checkpoints into fused, TP/EP-sharded expert parameters.

Start here: which call

| you are                                   | call                                                           |
|-------------------------------------------|----------------------------------------------------------------|
| an engine's model-load hook (one rank)    | parallel = ParallelConfig.from_environment()                   |
|                                           | layers = load_experts(checkpoint, parallel, device="cuda:0")   |
|                                           | -> {experts_prefix: FusedTensors}: w13_qweight, w2_scales, ... |
| an engine that owns its nn.Modules        | FusedMoEModule(read_moe_config(ckpt), prefix, parallel) per    |
|                                           | layer, then load_model_experts(model, ckpt, parallel)          |
| a script that pre-shards a checkpoint     | shard(src, out, tp=4, ep=1)   (the CLI: wna16-shard SRC OUT   |
|                                           | --tp 4); returns the summary the CLI prints                    |
| a rank with only the output OUT           | parallel = ParallelConfig.from_manifest(OUT, rank=r)           |
|                                           | layers = load_experts(OUT, parallel, device=...)               |

`ParallelConfig(tp_size, tp_rank, ep_size=1, ep_rank=0)` is the only source of sizes and ranks; the three
ways to build one are the constructor, `ParallelConfig.from_environment()` and `ParallelConfig.from_manifest(OUT,
rank=r)` (`parallel_config(OUT, rank=r)` and `from_manifest(read_manifest(OUT), rank=r)` are aliases of the last).
`read_moe_config(folder)` says how a checkpoint resolved (experts, sizes, quantization per layer, MTP layers).
`folder` may be a checkpoint folder, a `wna16-shard` output or a Hugging Face repo id (`org/name`).

Every error is a `WNA16Error` (a `ValueError`) subclass: ConfigError, FormatError, CheckpointError, ShardingError
(LayoutMismatchError), CompletenessError, ExpertsPrefixError, PreshardError, DeviceError; Ctrl-C during a pre-shard
raises ShardInterrupted (a KeyboardInterrupt). The README has the CLI, docs/layout.md the layout and
docs/failures.md the failure catalogue.

Older names kept as aliases: FusedExperts (= FusedTensors), FusedMoEExperts (= FusedMoEModule).
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (CheckpointError, CompletenessError, ConfigError, DeviceError, ExpertsPrefixError, FormatError,
                     LayoutMismatchError, NodeError, PreshardError, ShardingError, SharedMemoryError, ShardInterrupted,
                     WNA16Error)
from .version import __version__

# Every other public name -> the module that defines it, imported on first use (PEP 562): `import wna16_loader` (and so
# the `wna16-shard` entry, `wna16_loader.cli`) costs no torch import, so that the entry can guard Ctrl-C first.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["TensorStore"], "engine.hook"),
    **dict.fromkeys(["ExpertParamMapping", "ParamTarget", "ShardId", "expert_param_mapping"], "engine.mapping"),
    **dict.fromkeys(["check_model_complete", "install_load_hook", "load_model_experts"], "engine.model"),
    **dict.fromkeys(["FusedMoEExperts", "FusedMoEModule"], "engine.module"),
    **dict.fromkeys(["Activation", "reference_forward"], "engine.reference"),
    **dict.fromkeys(["QuantSpec"], "formats"),
    **dict.fromkeys(["load_experts", "read_moe_config"], "load.experts"),
    **dict.fromkeys(["FUSED_NAMES", "DequantizedExperts", "FusedExperts", "FusedSpec", "FusedTensors"], "load.fused"),
    **dict.fromkeys(["parallel_config", "read_manifest"], "load.outputs"),
    **dict.fromkeys(["LoadedExperts", "LoadReport"], "load.results"),
    **dict.fromkeys(["MoEConfig"], "models.config"),
    **dict.fromkeys(["ExpertPlacement", "Node", "ParallelConfig"], "parallel.config"),
    **dict.fromkeys(["OutputLayout", "ShardSummary", "shard"], "preshard"),
    **dict.fromkeys(["resolve_checkpoint"], "storage.hub"),
    **dict.fromkeys(["CacheFill", "ReadOptions"], "storage.readahead"),
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then cached in this module)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wna16_loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "CheckpointError", "CompletenessError", "ConfigError", "DequantizedExperts", "DeviceError", "ExpertPlacement",
    "ExpertsPrefixError", "FUSED_NAMES",
    "FormatError", "FusedExperts", "FusedSpec", "FusedTensors", "LayoutMismatchError", "LoadReport", "LoadedExperts",
    "MoEConfig", "ParallelConfig", "PreshardError", "QuantSpec", "ShardInterrupted", "ShardingError", "WNA16Error",
    "__version__", "load_experts", "read_moe_config",
]
__all__ += [
    "Activation", "ExpertParamMapping", "FusedMoEExperts", "FusedMoEModule", "ParamTarget", "ShardId", "TensorStore",
    "check_model_complete", "expert_param_mapping", "install_load_hook", "load_model_experts", "parallel_config",
    "read_manifest", "reference_forward", "resolve_checkpoint",
]
__all__ += ["OutputLayout", "ShardSummary", "shard"]
__all__ += ["CacheFill", "Node", "NodeError", "ReadOptions", "SharedMemoryError"]
