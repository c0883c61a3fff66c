"""wna16_loader: load WNA16-quantized MoE checkpoints into fused, TP/EP-sharded expert parameters."""

from .errors import (CheckpointError, CompletenessError, ConfigError, FormatError, LayoutMismatchError,
                     ShardingError, WNA16Error)
from .formats import QuantSpec
from .fused import FUSED_NAMES, DequantizedExperts, FusedExperts, FusedSpec
from .hook import TensorStore
from .hub import resolve_checkpoint
from .mapping import ExpertParamMapping, ParamTarget, ShardId, expert_param_mapping
from .loader import load_experts, read_moe_config
from .results import LoadedExperts, LoadReport
from .modelconfig import MoEConfig
from .model_load import check_model_complete, install_load_hook, load_model_experts
from .module import FusedMoEExperts
from .parallel import ExpertPlacement, ParallelConfig
from .reference import Activation, reference_forward

from .version import __version__

__all__ = [
    "CheckpointError", "CompletenessError", "ConfigError", "DequantizedExperts", "ExpertPlacement", "FUSED_NAMES",
    "FormatError", "FusedExperts", "FusedSpec", "LayoutMismatchError", "LoadReport", "LoadedExperts", "MoEConfig",
    "ParallelConfig", "QuantSpec", "ShardingError", "WNA16Error", "__version__", "load_experts", "read_moe_config",
]
__all__ += [
    "Activation", "ExpertParamMapping", "FusedMoEExperts", "ParamTarget", "ShardId", "TensorStore",
    "check_model_complete", "expert_param_mapping", "install_load_hook", "load_model_experts", "reference_forward", "resolve_checkpoint",
]
