"""Triton silu(gate) * up over the fused gate_up projection [T, 2 * I] -> [T, I], in one pass.

Rounded as torch's `F.silu(gate) * up` in the model dtype: silu is computed in float32 as
gate / (1 + exp(-gate)) (torch's formula; CUDA's expf through libdevice and an IEEE division on
the GPU, as in torch's CUDA kernel) and rounded to the dtype; the product of that and up is
computed in float32 and rounded once, as torch's elementwise multiply does for bf16/fp16.
The layers use it through layers/fused_kernels.py (TOKENSPEED_FUSED_KERNELS).

Importable without triton (CPU machines): AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

import torch

from tokenspeed_worker.kernels.norm import AVAILABLE, interpreting

if AVAILABLE:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr,
        stride_x, stride_out, inter,
        LIBDEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-gate)
        else:
            e = tl.exp(-gate)
        act = tl.math.div_rn(gate, 1.0 + e).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * I] as [gate | up] (rows may be strided, the last dimension contiguous) -> silu(gate) * up [..., I]."""
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
    _silu_and_mul_kernel[(out_rows.shape[0], triton.cdiv(inter, block))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), inter,
        LIBDEVICE=not interpreting(),
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
    )
    return out


__all__ = ["AVAILABLE", "silu_and_mul"]
