"""Triton RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

The fused form reads x and the residual once and writes the new residual (in place, or to a new
tensor) and the normalized row, in one pass (torch does an add, a square, a mean, a multiply and
two casts, each through memory). The rounding follows layers/layernorm.py (Hugging Face): the sum
is rounded to the model dtype, statistics are taken in float32, the normalized row is rounded to
the input dtype and only then multiplied by the weight (Gemma's form, `unit_offset`: the float32
row times 1 + weight, rounded once). The reciprocal square root is CUDA's
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
from tokenspeed_worker.kernels import fp8

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
    def _rms_scale(x32, weight_ptr, cols, in_row, hidden, eps, dtype: tl.constexpr,
                   UNIT_OFFSET: tl.constexpr, LIBDEVICE: tl.constexpr):
        """weight * rmsnorm(x) in float32: Llama's form (the normalized row rounded to dtype first)
        or Gemma's (UNIT_OFFSET: times 1 + weight, nothing rounded before the product)."""
        mean_square = tl.sum(x32 * x32, axis=0) / hidden + eps
        if LIBDEVICE:
            rstd = libdevice.rsqrt(mean_square)
        else:
            rstd = 1.0 / tl.sqrt_rn(mean_square)
        weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            return (x32 * rstd) * (1.0 + weight)
        return (x32 * rstd).to(dtype).to(tl.float32) * weight

    @triton.jit
    def _fused_add_rms_norm_kernel(
        x_ptr, residual_ptr, residual_out_ptr, weight_ptr, x_weight_ptr, out_ptr, scale_ptr,
        rows_per_group, stride_x_group, stride_x_row, stride_residual, stride_residual_out, stride_out,
        hidden, eps,
        ADD_RESIDUAL: tl.constexpr,
        NORM_X: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
        QUANT_MAX: tl.constexpr = 0.0,
        QUANT_MIN_SCALE: tl.constexpr = 0.0,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < hidden
        dtype = x_ptr.dtype.element_ty
        x_offset = (row // rows_per_group) * stride_x_group + (row % rows_per_group) * stride_x_row
        x = tl.load(x_ptr + x_offset + cols, mask=in_row, other=0.0)
        if NORM_X:  # x normalized first (Gemma's norm after a sublayer), rounded to the dtype
            x = _rms_scale(x.to(tl.float32), x_weight_ptr, cols, in_row, hidden, eps, dtype,
                           UNIT_OFFSET, LIBDEVICE).to(dtype)
        if ADD_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_residual + cols, mask=in_row, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=in_row)
        out = _rms_scale(x.to(tl.float32), weight_ptr, cols, in_row, hidden, eps, dtype, UNIT_OFFSET, LIBDEVICE)
        if QUANT_MAX > 0:  # the row rounded to the dtype, then quantized with its own scale (kernels/fp8.quantize_rows)
            out = out.to(dtype).to(tl.float32)
            scale = tl.maximum(tl.max(tl.where(in_row, tl.abs(out), 0.0), axis=0) / QUANT_MAX, QUANT_MIN_SCALE)
            out = tl.clamp(tl.math.div_rn(out, scale), -QUANT_MAX, QUANT_MAX)
            tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, residual_out: torch.Tensor | None, weight: torch.Tensor, eps: float,
    unit_offset: bool = False, x_weight: torch.Tensor | None = None, quantized: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    hidden = x.shape[-1]
    for w in (weight, weight if x_weight is None else x_weight):
        if w.shape != (hidden,) or hidden > MAX_HIDDEN:
            raise ValueError(f"weight {tuple(w.shape)} does not fit hidden size {hidden} (at most {MAX_HIDDEN})")
    out = torch.empty(x.shape, dtype=fp8.FP8_DTYPE if quantized else torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    out_rows = out.view(-1, hidden)
    num_rows = out_rows.shape[0]
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device) if quantized else out_rows
    if num_rows == 0:
        return (out_rows, scale) if quantized else out
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
        rows, residual_rows, residual_out_rows, weight.contiguous(),
        weight if x_weight is None else x_weight.contiguous(), out_rows, scale,
        rows.shape[1], rows.stride(0), rows.stride(1),
        residual_rows.stride(0), residual_out_rows.stride(0), out_rows.stride(0),
        hidden, float(eps),
        ADD_RESIDUAL=residual is not None,
        NORM_X=x_weight is not None,
        UNIT_OFFSET=unit_offset,
        LIBDEVICE=not interpreting(),
        BLOCK=block,
        QUANT_MAX=fp8.FP8_MAX if quantized else 0.0,
        QUANT_MIN_SCALE=fp8.MIN_SCALE if quantized else 0.0,
        num_warps=min(16, max(1, block // 512)),
    )
    return (out_rows, scale) if quantized else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dimension, rounded like layers/layernorm.RMSNorm (unit_offset:
    (1 + weight) * rmsnorm(x) rounded once, like GemmaRMSNorm); contiguous."""
    return _launch(x, None, None, weight, eps, unit_offset)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = True,
    unit_offset: bool = False, x_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), the sum rounded to the dtype.

    The same values as RMSNorm.forward(x, residual) in layers/layernorm.py; x and residual must
    share a shape and dtype. inplace: the sum is written into residual (returned); else into a
    new contiguous tensor, leaving residual as it was. unit_offset: both norms in Gemma's form.
    x_weight: x is first replaced by its own norm with that weight (rounded to the dtype; the same
    eps), as Gemma normalizes a sublayer's output before adding it to the residual stream.
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
    return _launch(x, residual, residual_out, weight, eps, unit_offset, x_weight), residual_out


def add_rms_norm_quantized(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [M, K] float8 e4m3, s [M, 1] float32, x + residual (x itself without a residual)): the
    norm of x (+ residual) in Llama's form, rounded to x's dtype, then each row quantized with its
    own scale: the same bits as kernels/fp8.quantize_rows(rms_norm(...)), without the normalized
    rows going through memory (the FP8 GEMM's input for a norm's projection). The residual is not
    modified; x + residual is a new tensor."""
    if residual is None:
        return (*_launch(x, None, None, weight, eps, quantized=True), x)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q, scale = _launch(x, residual, residual_out, weight, eps, quantized=True)
    return q, scale, residual_out


__all__ = ["AVAILABLE", "add_rms_norm_quantized", "fused_add_rms_norm", "interpreting", "rms_norm"]
