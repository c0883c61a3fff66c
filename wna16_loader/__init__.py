"""wna16_loader: load WNA16-quantized MoE checkpoints into fused, TP/EP-sharded expert parameters."""

from .engine.hook import TensorStore
from .engine.mapping import ExpertParamMapping, ParamTarget, ShardId, expert_param_mapping
from .engine.model import check_model_complete, install_load_hook, load_model_experts
from .engine.module import FusedMoEExperts
from .engine.reference import Activation, reference_forward
from .errors import (
                     CheckpointError,
                     CompletenessError,
                     ConfigError,
                     ExpertsPrefixError,
                     FormatError,
                     LayoutMismatchError,
                     ShardingError,
                     WNA16Error,
)
from .formats import QuantSpec
from .load.experts import load_experts, read_moe_config
from .load.fused import FUSED_NAMES, DequantizedExperts, FusedExperts, FusedSpec
from .load.presharded import parallel_config, read_manifest
from .load.results import LoadedExperts, LoadReport
from .models.config import MoEConfig
from .parallel.config import ExpertPlacement, ParallelConfig
from .storage.hub import resolve_checkpoint
from .storage.readahead import CacheFill, ReadOptions
from .version import __version__

__all__ = [
    "CheckpointError", "CompletenessError", "ConfigError", "DequantizedExperts", "ExpertPlacement",
    "ExpertsPrefixError", "FUSED_NAMES",
    "FormatError", "FusedExperts", "FusedSpec", "LayoutMismatchError", "LoadReport", "LoadedExperts", "MoEConfig",
    "ParallelConfig", "QuantSpec", "ShardingError", "WNA16Error", "__version__", "load_experts", "read_moe_config",
]
__all__ += [
    "Activation", "ExpertParamMapping", "FusedMoEExperts", "ParamTarget", "ShardId", "TensorStore",
    "check_model_complete", "expert_param_mapping", "install_load_hook", "load_model_experts", "parallel_config",
    "read_manifest", "reference_forward", "resolve_checkpoint",
]
__all__ += ["CacheFill", "ReadOptions"]
