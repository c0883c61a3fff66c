"""The reference MoE forward over dequantised fused experts: a correctness check, not a kernel."""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from .errors import FormatError
from .fused import DequantizedExperts


class Activation(enum.Enum):
    """The gate activation of a gated MLP: act(gate) * up."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # Gemma 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x) if self is Activation.SILU else F.gelu(x, approximate="tanh")


def reference_forward(weights: DequantizedExperts, experts: tuple[int, ...], hidden_states: torch.Tensor,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Dequantise-then-matmul MoE over the local experts and the local slice of I.

    A correctness reference, not a kernel: float32 math, one matmul per expert.
    Summing the outputs of every TP x EP rank (all_reduce sum) gives the
    unsharded layer, since gate/up are column- and down row-parallel along I.

    | hidden_states | [T, H]          | topk_ids | [T, k] global expert ids |
    | w13           | [E_l, 2*I_p, H] | w2       | [E_l, H, I_p]            |
    | topk_weights  | [T, k]          | out      | [T, H] hidden dtype      |
    """
    _check_inputs(weights, hidden_states, topk_ids, topk_weights)
    x = hidden_states.to(torch.float32)
    out = torch.zeros_like(x)
    part = weights.w2.shape[2]
    for slot, expert in enumerate(experts):
        token, which = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ weights.w13[slot].T  # [t, 2*I_p]
        y = (activation(h[:, :part]) * h[:, part:]) @ weights.w2[slot].T  # [t, H]
        out.index_add_(0, token, y * topk_weights[token, which].to(torch.float32).unsqueeze(1))
    return out.to(hidden_states.dtype)


def _check_inputs(weights: DequantizedExperts, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> None:
    hidden = weights.w13.shape[2]
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise FormatError(f"hidden_states: shape {list(hidden_states.shape)} but the experts expect [T, {hidden}].")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise FormatError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
                          f"[T, k] with T = {hidden_states.shape[0]} tokens.")
