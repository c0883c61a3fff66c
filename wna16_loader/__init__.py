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

from .engine.hook import TensorStore
from .engine.mapping import ExpertParamMapping, ParamTarget, ShardId, expert_param_mapping
from .engine.model import check_model_complete, install_load_hook, load_model_experts
from .engine.module import FusedMoEExperts, FusedMoEModule
from .engine.reference import Activation, reference_forward
from .errors import (
                     CheckpointError,
                     CompletenessError,
                     ConfigError,
                     DeviceError,
                     ExpertsPrefixError,
                     FormatError,
                     LayoutMismatchError,
                     NodeError,
                     PreshardError,
                     ShardingError,
                     ShardInterrupted,
                     WNA16Error,
)
from .formats import QuantSpec
from .load.experts import load_experts, read_moe_config
from .load.fused import FUSED_NAMES, DequantizedExperts, FusedExperts, FusedSpec, FusedTensors
from .load.outputs import parallel_config, read_manifest
from .load.results import LoadedExperts, LoadReport
from .models.config import MoEConfig
from .parallel.config import ExpertPlacement, Node, ParallelConfig
from .preshard import OutputLayout, ShardSummary, shard
from .storage.hub import resolve_checkpoint
from .storage.readahead import CacheFill, ReadOptions
from .version import __version__

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
__all__ += ["CacheFill", "Node", "NodeError", "ReadOptions"]
