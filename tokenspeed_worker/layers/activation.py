"""Gated activations of the MLP.

On CUDA, silu(gate) * up (and Gemma's gelu_tanh(gate) * up) runs as one Triton kernel (kernels/activation.py) with the same
roundings as the torch code below, which stays the reference path (CPU, no triton, or switched
off in layers/fused_kernels.py: TOKENSPEED_FUSED_KERNELS).
"""

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_worker.layers.fused_kernels import FUSED_DTYPES, use_fused


class _GatedActivation(nn.Module):
    """act(gate) * up over [gate | up] along the last dimension (the fused gate_up_proj): the
    activation kernel `KERNEL` of kernels/activation.py where the fused kernels run, else `reference`."""

    KERNEL = ""

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = use_fused(x, "activation")
        if kernels is not None and x.dtype in FUSED_DTYPES and x.dim() > 0 and x.shape[-1] % 2 == 0:
            return getattr(kernels, self.KERNEL)(x)
        gate, up = x.chunk(2, dim=-1)
        return self.reference(gate) * up


class SiluAndMul(_GatedActivation):
    """silu(gate) * up (Llama's MLP)."""

    KERNEL = "silu_and_mul"
    reference = staticmethod(F.silu)


class GeluTanhAndMul(_GatedActivation):
    """gelu(gate, approximate="tanh") * up (Gemma's gated MLP)."""

    KERNEL = "gelu_tanh_and_mul"

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")
