"""RMSNorm, numerically identical to Hugging Face's (statistics in float32, weight applied in the model dtype),
and Gemma's form of it (GemmaRMSNorm: times 1 + w in float32, rounded once).

On CUDA the norm (and the residual add fused into it) runs as one Triton kernel
(kernels/norm.py) with the same roundings; the torch code below is the reference path,
used on CPU, without triton, or when layers/fused_kernels.py says so (TOKENSPEED_FUSED_KERNELS).

`RMSNorm.defer` leaves the norm to the projection after it (PendingNorm), which may fold it into
its own kernel (layers/small_batch_gemv.py) or apply it first.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed_worker.layers.fused_kernels import FUSED_DTYPES, use_fused


class PendingNorm:
    """An RMSNorm of x (+ residual) not yet applied, handed to the projection after it.

    The projection either folds the norm into its kernel or calls `apply`; then `residual` holds
    x + residual (x itself without a residual): the residual stream the next sublayer adds to."""

    __slots__ = ("norm", "x", "residual_in", "x_norm", "_residual")

    def __init__(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                 x_norm: RMSNorm | None = None) -> None:
        """x_norm: x is first normalized by it (a sublayer's post norm, Gemma's sandwich: of the
        same type and eps as norm) and then added to residual (given)."""
        self.norm, self.x, self.residual_in, self.x_norm = norm, x, residual, x_norm
        self._residual: torch.Tensor | None = None

    def normalize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual (norm(x), x); with x_norm,
        (norm(x_norm(x) + residual), x_norm(x) + residual). Records nothing."""
        if self.x_norm is not None:
            return self.norm.forward_after(self.x_norm, self.x, self.residual_in)
        if self.residual_in is None:
            return self.norm(self.x), self.x
        return self.norm(self.x, self.residual_in)

    def apply(self) -> torch.Tensor:
        """The normalized input, recording the residual stream."""
        hidden, self._residual = self.normalize()
        return hidden

    def folded(self, residual: torch.Tensor) -> None:
        """Record the residual stream a kernel that folded the norm in computed."""
        self._residual = residual

    @property
    def residual(self) -> torch.Tensor:
        if self._residual is None:
            raise RuntimeError("the pending norm was not consumed: its residual is not computed yet")
        return self._residual


class RMSNorm(nn.Module):
    unit_offset = False  # the kernels' form of the weight: w (here) or 1 + w (GemmaRMSNorm)

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
        """norm(x); or, given a residual, the fused pre-norm step: (norm(x + residual), x + residual).

        Any leading shape (Qwen3's q/k norms get [T, heads, head_dim] views); the residual is not
        modified (x + residual is a new tensor on both paths)."""
        kernels = use_fused(x, "norm")
        if kernels is not None and self._fusable(x, residual, kernels.MAX_HIDDEN):
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps, inplace=False,
                                              unit_offset=self.unit_offset)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_after(self, sublayer_norm: RMSNorm, y: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(s + residual), s + residual) for s = sublayer_norm(y): a sublayer's output
        normalized, added to the residual stream, and normalized for the next sublayer (Gemma's
        sandwich), in one kernel where both norms take it."""
        kernels = use_fused(y, "norm")
        if (kernels is not None and type(sublayer_norm) is type(self) and sublayer_norm.eps == self.eps
                and self._fusable(y, residual, kernels.MAX_HIDDEN) and sublayer_norm._fusable(y, None, kernels.MAX_HIDDEN)):
            return kernels.fused_add_rms_norm(y, residual, self.weight, self.eps, inplace=False,
                                              unit_offset=self.unit_offset, x_weight=sublayer_norm.weight)
        return self(sublayer_norm(y), residual)

    def defer(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> PendingNorm:
        """This norm of x (+ residual), left for the next projection to apply or fold in."""
        return PendingNorm(self, x, residual)

    def defer_after(self, sublayer_norm: RMSNorm, y: torch.Tensor, residual: torch.Tensor) -> PendingNorm:
        """`forward_after(sublayer_norm, y, residual)` left for the next projection to apply or fold
        in (the small-batch kernels take both norms where they share a type and eps; else the
        sublayer's norm is applied now)."""
        if type(sublayer_norm) is type(self) and sublayer_norm.eps == self.eps:
            return PendingNorm(self, y, residual, sublayer_norm)
        return PendingNorm(self, sublayer_norm(y), residual)

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor | None, max_hidden: int) -> bool:
        """What the kernel handles: x and weight of FUSED_DTYPES on one device, a residual of x's shape and dtype."""
        if x.dtype not in FUSED_DTYPES or x.dim() == 0 or x.shape[-1] != self.weight.shape[0] or x.shape[-1] > max_hidden:
            return False
        if x.device != self.weight.device or self.weight.dtype not in FUSED_DTYPES:
            return False
        return residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32 and rounded once to x's dtype (w starts at 0)."""

    unit_offset = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)
