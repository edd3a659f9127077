"""Gated activations of the MLP.

On CUDA, silu(gate) * up (and Gemma's gelu_tanh(gate) * up) runs as one Triton kernel (kernels/activation.py) with the same
roundings as the torch code below, which stays the reference path (CPU, no triton, or switched
off in layers/fused_kernels.py: TOKENSPEED_FUSED_KERNELS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_worker.layers.fused_kernels import FUSED_DTYPES, use_fused


class PendingActivation:
    """act(gate) * up of a gate_up projection's output [..., 2 * I], not applied yet: handed to the
    down projection, which either folds it into its input's FP8 quantization (one kernel:
    kernels/activation.act_and_mul_quantized) or applies it (`apply`) before its product."""

    __slots__ = ("gate_up", "act")

    def __init__(self, gate_up: torch.Tensor, act: GatedActivation) -> None:
        self.gate_up, self.act = gate_up, act

    def apply(self) -> torch.Tensor:
        return self.act(self.gate_up)

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, s) of the activated rows quantized per row (FP8), in one kernel, where the fused
        kernels run; else None (apply, then quantize)."""
        kernels = use_fused(self.gate_up, "activation")
        if kernels is None or self.gate_up.dtype not in FUSED_DTYPES:
            return None
        return kernels.act_and_mul_quantized(self.gate_up, gelu_tanh=self.act.GELU_TANH)


class GatedActivation(nn.Module):
    """act(gate) * up over [gate | up] along the last dimension (the fused gate_up_proj): the
    activation kernel `KERNEL` of kernels/activation.py where the fused kernels run, else `reference`."""

    KERNEL = ""
    GELU_TANH = False  # the kernels' choice of act

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = use_fused(x, "activation")
        if kernels is not None and x.dtype in FUSED_DTYPES and x.dim() > 0 and x.shape[-1] % 2 == 0:
            return getattr(kernels, self.KERNEL)(x)
        gate, up = x.chunk(2, dim=-1)
        return self.reference(gate) * up


class SiluAndMul(GatedActivation):
    """silu(gate) * up (Llama's MLP)."""

    KERNEL = "silu_and_mul"
    reference = staticmethod(F.silu)


class GeluTanhAndMul(GatedActivation):
    """gelu(gate, approximate="tanh") * up (Gemma's gated MLP)."""

    KERNEL = "gelu_tanh_and_mul"
    GELU_TANH = True

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")
