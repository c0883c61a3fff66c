"""The reference MoE forward over dequantised fused experts: a correctness check, not a kernel."""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from ..errors import FormatError
from ..load.fused import DequantizedExperts


class Activation(enum.Enum):
    """The experts' activation: act(gate) * up for gated experts, act(up) for non-gated ones."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # Gemma 4
    RELU2 = "relu2"  # relu(x)^2, Nemotron-H's non-gated experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _FUNCTIONS[self](x)

    @classmethod
    def from_config(cls, name: str | None) -> "Activation":
        """The activation a config names (`hidden_act`, `mlp_hidden_act`, ...); None: SiLU."""
        if name is None:
            return cls.SILU
        if name not in CONFIG_NAMES:
            raise FormatError(f"config activation {name!r} has no reference implementation here; known: "
                              f"{sorted(CONFIG_NAMES)}. Add it to wna16_loader/reference.py.")
        return CONFIG_NAMES[name]


_FUNCTIONS = {Activation.SILU: F.silu, Activation.GELU_TANH: lambda x: F.gelu(x, approximate="tanh"),
              Activation.RELU2: lambda x: torch.relu(x).square()}
CONFIG_NAMES = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH,
                "gelu_tanh": Activation.GELU_TANH, "relu2": Activation.RELU2}


def reference_forward(weights: DequantizedExperts, experts: tuple[int, ...], hidden_states: torch.Tensor,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Dequantise-then-matmul MoE over the local experts and the local slice of I.

    A correctness reference, not a kernel: float32 math, one matmul per expert.
    Summing the outputs of every TP x EP rank (all_reduce sum) gives the
    unsharded layer, since gate/up are column- and down row-parallel along I.

    | hidden_states | [T, H]          | topk_ids | [T, k] global expert ids |
    | w13           | [E_l, 2*I_p, H] | w2       | [E_l, H, I_p]            |
    | topk_weights  | [T, k]          | out      | [T, H] hidden dtype      |

    Non-gated experts (`weights.gated` False: w13 [E_l, I_p, H], up only) compute act(up) instead of
    act(gate) * up.
    """
    _check_inputs(weights, hidden_states, topk_ids, topk_weights)
    x = hidden_states.to(torch.float32)
    out = torch.zeros_like(x)
    part = weights.w2.shape[2]
    for slot, expert in enumerate(experts):
        token, which = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ weights.w13[slot].T  # [t, 2*I_p] (non-gated: [t, I_p])
        inner = activation(h[:, :part]) * h[:, part:] if weights.gated else activation(h)
        y = inner @ weights.w2[slot].T  # [t, H]
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
