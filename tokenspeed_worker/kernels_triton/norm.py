"""Triton RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

The fused form reads x and the residual once, writes the new residual back in place and the
normalized row out, in one pass (torch does an add, a square, a mean, a multiply and two casts,
each through memory). The rounding follows layers/layernorm.py (Hugging Face): the sum is rounded
to the model dtype, statistics are taken in float32, the normalized row is rounded to the input
dtype and only then multiplied by the weight.

Importable without triton (CPU machines): AVAILABLE says whether the kernels can be used.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from tokenspeed_worker.kernels_triton.attention import fix_triton_interpreter

    fix_triton_interpreter()  # bfloat16 rounding in TRITON_INTERPRET=1 as on the GPU
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    AVAILABLE = False

MAX_HIDDEN = 65536  # one row per program, held in registers


if AVAILABLE:

    @triton.jit
    def _fused_add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr,
        stride_x, stride_residual, stride_out,
        hidden, eps,
        ADD_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0)
        if ADD_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_residual + cols, mask=in_row, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(residual_ptr + row * stride_residual + cols, x, mask=in_row)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
        normed = (x32 * rstd).to(x_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
        out = normed.to(tl.float32) * weight.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or hidden > MAX_HIDDEN:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden} (at most {MAX_HIDDEN})")
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    residual_rows = residual.view(-1, hidden) if residual is not None else rows  # view: written in place
    if residual is not None and residual_rows.stride(-1) != 1:
        raise ValueError("residual must be contiguous along the hidden dimension")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _fused_add_rms_norm_kernel[(rows.shape[0],)](
        rows, residual_rows, weight.contiguous(), out_rows,
        rows.stride(0), residual_rows.stride(0), out_rows.stride(0),
        hidden, float(eps),
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dimension, rounded like layers/layernorm.RMSNorm."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, in residual's dtype); returns (weight * rmsnorm(residual), residual).

    The same values as RMSNorm.forward(x, residual) in layers/layernorm.py; x and residual must
    share a dtype.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, weight, eps), residual


__all__ = ["AVAILABLE", "fused_add_rms_norm", "rms_norm"]
