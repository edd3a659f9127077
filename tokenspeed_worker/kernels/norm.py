"""Triton RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

The fused form reads x and the residual once and writes the new residual (in place, or to a new
tensor) and the normalized row, in one pass (torch does an add, a square, a mean, a multiply and
two casts, each through memory). The rounding follows layers/layernorm.py (Hugging Face): the sum
is rounded to the model dtype, statistics are taken in float32, the normalized row is rounded to
the input dtype and only then multiplied by the weight. The reciprocal square root is CUDA's
rsqrtf on the GPU (what torch.rsqrt calls there) and 1/sqrt in the interpreter (torch on CPU);
the mean of squares is summed in another order than torch's, so results can differ from the
torch path by a rounding step.

Rows may be strided: x of [rows, hidden], or [A, B, hidden] with any strides over A and B (Qwen3
normalizes each head of q and k, views into the fused qkv projection). The layers use these
kernels through layers/fused_kernels.py (the switch: TOKENSPEED_FUSED_KERNELS).

Importable without triton (CPU machines): AVAILABLE says whether the kernels can be used.
"""

from __future__ import annotations


import torch

from tokenspeed_worker import env

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    libdevice = None
    AVAILABLE = False

MAX_HIDDEN = 65536  # one row per program, held in registers


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (no libdevice there: plain tl math instead)."""
    return env.triton_interpreter()


if AVAILABLE:

    @triton.jit
    def _fused_add_rms_norm_kernel(
        x_ptr, residual_ptr, residual_out_ptr, weight_ptr, out_ptr,
        rows_per_group, stride_x_group, stride_x_row, stride_residual, stride_residual_out, stride_out,
        hidden, eps,
        ADD_RESIDUAL: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < hidden
        x_offset = (row // rows_per_group) * stride_x_group + (row % rows_per_group) * stride_x_row
        x = tl.load(x_ptr + x_offset + cols, mask=in_row, other=0.0)
        if ADD_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_residual + cols, mask=in_row, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=in_row)
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) / hidden + eps
        if LIBDEVICE:
            rstd = libdevice.rsqrt(mean_square)
        else:
            rstd = 1.0 / tl.sqrt_rn(mean_square)
        normed = (x32 * rstd).to(x_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
        out = normed.to(tl.float32) * weight.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, residual_out: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or hidden > MAX_HIDDEN:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden} (at most {MAX_HIDDEN})")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    num_rows = out_rows.shape[0]
    if num_rows == 0:
        return out
    # x as [groups, rows_per_group, hidden] with any strides over the first two (no copy of a
    # strided view), contiguous along hidden.
    rows = x if x.dim() == 3 else x.reshape(-1, x.shape[-2], hidden) if x.dim() > 3 else x.reshape(-1, 1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    residual_rows = residual_out_rows = out_rows  # unused without a residual
    if residual is not None:
        residual_rows = residual.reshape(-1, hidden)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        residual_out_rows = residual_out.view(-1, hidden)
        if residual_out_rows.stride(-1) != 1:
            raise ValueError("an in-place residual must be contiguous along the hidden dimension")
    block = triton.next_power_of_2(hidden)
    _fused_add_rms_norm_kernel[(num_rows,)](
        rows, residual_rows, residual_out_rows, weight.contiguous(), out_rows,
        rows.shape[1], rows.stride(0), rows.stride(1),
        residual_rows.stride(0), residual_out_rows.stride(0), out_rows.stride(0),
        hidden, float(eps),
        ADD_RESIDUAL=residual is not None,
        LIBDEVICE=not interpreting(),
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dimension, rounded like layers/layernorm.RMSNorm; contiguous."""
    return _launch(x, None, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), the sum rounded to the dtype.

    The same values as RMSNorm.forward(x, residual) in layers/layernorm.py; x and residual must
    share a shape and dtype. inplace: the sum is written into residual (returned); else into a
    new contiguous tensor, leaving residual as it was.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if inplace:
        residual_out = residual
        try:
            residual.view(-1, x.shape[-1])
        except RuntimeError as error:
            raise ValueError(f"an in-place residual must be viewable as rows ({error})") from None
    else:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(x, residual, residual_out, weight, eps), residual_out


__all__ = ["AVAILABLE", "fused_add_rms_norm", "interpreting", "rms_norm"]
