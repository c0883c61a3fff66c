"""wna16_loader: load WNA16-quantized MoE checkpoints into fused, TP/EP-sharded expert parameters."""

from .errors import (CheckpointError, CompletenessError, ConfigError, FormatError, LayoutMismatchError,
                     ShardingError, WNA16Error)
from .formats import QuantSpec
from .fused import FUSED_NAMES, DequantizedExperts, FusedExperts, FusedSpec
from .loader import LoadedExperts, LoadReport, load_experts, read_moe_config
from .modelconfig import MoEConfig
from .parallel import ExpertPlacement, ParallelConfig

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CompletenessError", "ConfigError", "DequantizedExperts", "ExpertPlacement", "FUSED_NAMES",
    "FormatError", "FusedExperts", "FusedSpec", "LayoutMismatchError", "LoadReport", "LoadedExperts", "MoEConfig",
    "ParallelConfig", "QuantSpec", "ShardingError", "WNA16Error", "load_experts", "read_moe_config",
]
