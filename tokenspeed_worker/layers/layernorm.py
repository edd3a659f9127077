"""RMSNorm, numerically identical to Hugging Face's (statistics in float32, weight applied in the model dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given a residual, the fused pre-norm step: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
