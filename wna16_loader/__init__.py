"""wna16_loader: load WNA16-quantized MoE checkpoints into fused, TP/EP-sharded expert parameters."""

from .errors import (CheckpointError, CompletenessError, ConfigError, FormatError, LayoutMismatchError,
                     ShardingError, WNA16Error)
from .formats import QuantSpec
from .fused import FUSED_NAMES, DequantizedExperts, FusedExperts, FusedSpec
from .hook import ExpertParamMapping, ParamTarget, ShardId, TensorStore, expert_param_mapping
from .loader import LoadedExperts, LoadReport, load_experts, read_moe_config
from .modelconfig import MoEConfig
from .module import (Activation, FusedMoEExperts, check_model_complete, install_load_hook, load_model_experts,
                     reference_forward)
from .parallel import ExpertPlacement, ParallelConfig

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CompletenessError", "ConfigError", "DequantizedExperts", "ExpertPlacement", "FUSED_NAMES",
    "FormatError", "FusedExperts", "FusedSpec", "LayoutMismatchError", "LoadReport", "LoadedExperts", "MoEConfig",
    "ParallelConfig", "QuantSpec", "ShardingError", "WNA16Error", "load_experts", "read_moe_config",
]
__all__ += [
    "Activation", "ExpertParamMapping", "FusedMoEExperts", "ParamTarget", "ShardId", "TensorStore",
    "check_model_complete", "expert_param_mapping", "install_load_hook", "load_model_experts", "reference_forward",
]
