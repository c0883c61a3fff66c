"""Engine layouts as data: one `MethodLayout` row per engine MoE method (see spec.py, vllm.py, sglang.py)."""

from .sglang import CT_WNA16_K_MAJOR, GPTQ_MARLIN, SGLANG_LAYOUTS
from .spec import (Half, MethodLayout, Need, Order, Packing, ParamDecl, Sizes, Source, allocated_groups,
                   allocated_shape, evaluate, shape_of)
from .vllm import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, UNQUANTIZED, VLLM_LAYOUTS

__all__ = ["AUTO_AWQ", "AUTO_GPTQ", "CT_WNA16", "CT_WNA16_K_MAJOR", "GPTQ_MARLIN", "Half", "MOE_WNA16",
           "MethodLayout", "Need", "Order", "Packing", "ParamDecl", "SGLANG_LAYOUTS", "Sizes", "Source",
           "UNQUANTIZED", "VLLM_LAYOUTS", "allocated_groups", "allocated_shape", "evaluate", "shape_of"]
