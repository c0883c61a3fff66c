"""Float32 weights of fused expert tensors: (q - z) * s, for users, tests and the reference forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.packing import unpack_bytes


@dataclass(frozen=True)
class DequantizedExperts:
    """Float32 weights of the local experts: w13 [E_l, 2*I_p, H] (non-gated: [E_l, I_p, H]), w2 [E_l, H, I_p]
    (padding included: its rows of w13 and columns of w2 are exactly 0)."""

    w13: torch.Tensor
    w2: torch.Tensor
    gated: bool = True  # False: w13 holds the up rows only


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, g_idx: torch.Tensor | None,
               *, bits: int, group_size: int) -> torch.Tensor:
    """(q - z) * s in float32 for fused tensors.

    | qweight | [E, N, K/P8] uint8 | scales | [E, N, nG] |
    | qzeros  | [E, N/P8, nG]      | g_idx  | [E, K]     |
    | out     | [E, N, K] float32  |        |            |
    """
    q = unpack_bytes(qweight, bits=bits, dim=2).to(torch.float32)
    e, n, k = q.shape
    if g_idx is not None:
        groups = g_idx.to(torch.long)
    else:
        cols = torch.arange(k, device=q.device)
        groups = (cols * 0 if group_size == -1 else cols // group_size).expand(e, k)
    index = groups.unsqueeze(1).expand(e, n, k)
    s = torch.gather(scales.to(torch.float32), 2, index)
    if qzeros is None:
        return (q - float(1 << (bits - 1))) * s
    z = torch.gather(unpack_bytes(qzeros, bits=bits, dim=1).to(torch.float32), 2, index)
    return (q - z) * s
