"""Triton silu(gate) * up (and gelu_tanh(gate) * up, Gemma's) over the fused gate_up projection
[T, 2 * I] -> [T, I], in one pass.

Rounded as torch's `F.silu(gate) * up` in the model dtype: silu is computed in float32 as
gate / (1 + exp(-gate)) (torch's formula; CUDA's expf through libdevice and an IEEE division on
the GPU, as in torch's CUDA kernel) and rounded to the dtype (GELU: torch's tanh formula in
float32, CUDA's tanhf); the product of that and up is
computed in float32 and rounded once, as torch's elementwise multiply does for bf16/fp16.
The layers use it through layers/fused_kernels.py (TOKENSPEED_FUSED_KERNELS).

Importable without triton (CPU machines): AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

import torch

from tokenspeed_worker.kernels import fp8
from tokenspeed_worker.kernels.norm import AVAILABLE, interpreting

if AVAILABLE:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _gated(gate, up, dtype: tl.constexpr, GELU_TANH: tl.constexpr, LIBDEVICE: tl.constexpr):
        """act(gate) * up in float32 (gate, up float32), with torch's roundings: act rounded to
        dtype, the product left for the caller to round."""
        if GELU_TANH:  # torch's formula: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
            if LIBDEVICE:
                act = 0.5 * gate * (1.0 + libdevice.tanh(inner))
            else:  # the interpreter has no tanh: 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2 z))
                act = gate / (1.0 + tl.exp(-2.0 * inner))
        else:
            if LIBDEVICE:
                e = libdevice.exp(-gate)
            else:
                e = tl.exp(-gate)
            act = tl.math.div_rn(gate, 1.0 + e)
        return act.to(dtype).to(tl.float32) * up

    @triton.jit
    def _act_and_mul_kernel(
        x_ptr, out_ptr,
        stride_x, stride_out, inter,
        GELU_TANH: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = _gated(gate, up, x_ptr.dtype.element_ty, GELU_TANH, LIBDEVICE)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_and_mul_quantized_kernel(
        x_ptr, q_ptr, scale_ptr,
        stride_x, stride_q, inter,
        FP8_MAX: tl.constexpr,
        MIN_SCALE: tl.constexpr,
        GELU_TANH: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row per program, held whole: act(gate) * up rounded to the dtype, then quantized
        with the row's own scale (kernels/fp8.quantize_rows' arithmetic)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = _gated(gate, up, x_ptr.dtype.element_ty, GELU_TANH, LIBDEVICE).to(x_ptr.dtype.element_ty)
        out = out.to(tl.float32)
        scale = tl.maximum(tl.max(tl.where(mask, tl.abs(out), 0.0), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(out, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * I] as [gate | up] (rows may be strided, the last dimension contiguous) -> silu(gate) * up [..., I]."""
    return _act_and_mul(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * I] as [gate | up] -> gelu(gate, approximate="tanh") * up [..., I], rounded as torch."""
    return _act_and_mul(x, out, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be even: [gate | up]")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, inter)
    if out_rows.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(out_rows.shape[0], triton.cdiv(inter, block))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), inter,
        GELU_TANH=gelu_tanh,
        LIBDEVICE=not interpreting(),
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
    )
    return out


MAX_QUANTIZED_INTER = 16384  # act_and_mul_quantized holds a row in registers (kernels/fp8.MAX_K_ONE_PASS)


def act_and_mul_quantized(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [M, I] float8 e4m3, s [M, 1] float32) of act(gate) * up over x [..., 2 * I] (act: SiLU,
    or GELU-tanh): the same bits as kernels/fp8.quantize_rows(silu_and_mul(x)) (or gelu's), without
    the activated rows going through memory (the FP8 GEMM's input for the down projection).
    None where a row is too long to hold (I > MAX_QUANTIZED_INTER)."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    inter = x.shape[-1] // 2
    if x.shape[-1] % 2 or inter > MAX_QUANTIZED_INTER:
        return None
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    q = torch.empty((m, inter), dtype=fp8.FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or inter == 0:
        return q, scale
    block = triton.next_power_of_2(inter)
    _act_and_mul_quantized_kernel[(m,)](
        rows, q, scale, rows.stride(0), q.stride(0), inter,
        FP8_MAX=fp8.FP8_MAX, MIN_SCALE=fp8.MIN_SCALE, GELU_TANH=gelu_tanh, LIBDEVICE=not interpreting(),
        BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return q, scale


__all__ = ["AVAILABLE", "act_and_mul_quantized", "gelu_tanh_and_mul", "silu_and_mul"]
