"""Engine layouts as data: one `MethodLayout` row per engine MoE method (see spec.py, vllm.py)."""

from .spec import (Half, MethodLayout, Need, Order, Packing, ParamDecl, Sizes, Source, allocated_groups, evaluate,
                   shape_of)
from .vllm import AUTO_AWQ, AUTO_GPTQ, CT_WNA16, MOE_WNA16, UNQUANTIZED, VLLM_LAYOUTS

__all__ = ["AUTO_AWQ", "AUTO_GPTQ", "CT_WNA16", "Half", "MOE_WNA16", "MethodLayout", "Need", "Order", "Packing",
           "ParamDecl", "Sizes", "Source", "UNQUANTIZED", "VLLM_LAYOUTS", "evaluate", "shape_of"]
