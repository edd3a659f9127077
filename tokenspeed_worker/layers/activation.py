"""Gated activations of the MLP.

On CUDA, silu(gate) * up (and Gemma's gelu_tanh(gate) * up) runs as one Triton kernel (kernels/activation.py) with the same
roundings as the torch code below, which stays the reference path (CPU, no triton, or switched
off in layers/fused_kernels.py: TOKENSPEED_FUSED_KERNELS).
"""

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_worker.layers.fused_kernels import FUSED_DTYPES, use_fused


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [gate | up] along the last dimension (the fused gate_up_proj)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = use_fused(x, "activation")
        if kernels is not None and x.dtype in FUSED_DTYPES and x.dim() > 0 and x.shape[-1] % 2 == 0:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up over [gate | up] (Gemma's gated MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = use_fused(x, "activation")
        if kernels is not None and x.dtype in FUSED_DTYPES and x.dim() > 0 and x.shape[-1] % 2 == 0:
            return kernels.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
