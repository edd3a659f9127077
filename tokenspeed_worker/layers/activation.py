"""Gated activations of the MLP."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [gate | up] along the last dimension (the fused gate_up_proj)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
