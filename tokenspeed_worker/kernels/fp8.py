"""FP8 (e4m3) products of many rows: per-token activation quantization and the scaled GEMM.

    y = (q_x * s_x) @ (W_fp8 * s_w)^T (+ bias)

- `quantize_rows(x)`: each row of x (bf16/fp16/fp32) to float8 e4m3 with its own float32 scale
  s_x = max(|row|) / 448 (at least MIN_SCALE, so a zero row quantizes to zeros), q = round(x / s_x)
  saturated to +-448. One program per row: on the GPU a Triton kernel (one read of the row, one
  write of the quantized row and its scale); elsewhere torch, which computes the same values.
- `scaled_mm(q_x, s_x, weight, s_w, bias, out_dtype)`: the product above for a row-wise s_x
  [M, 1] and a channel-wise s_w [N]. On CUDA it is cuBLASLt's FP8 tensor-core GEMM through
  torch._scaled_mm with both scale vectors applied in its epilogue (row-wise scaling: compute
  capability 9.0+); elsewhere the same math in float32 (the reference the GPU path is tested against).

The small-batch path (a few rows, weight-bound) does not come here: kernels/gemv.py reads the FP8
weight and applies s_w in-register, with 16-bit activations.

Importable without triton: AVAILABLE says whether the Triton kernel can be used.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    AVAILABLE = False

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest activation scale (vLLM's choice): a row of zeros (or tiny values) still divides safely.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
MAX_K_ONE_PASS = 16384  # rows up to this long are held in registers whole: one read of the row


if AVAILABLE:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
                              FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
                              ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        if ONE_PASS:  # BLOCK_K >= K: the row is read once and held
            ok = offs < K
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
            q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ok = k0 + offs < K
                x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
            for k0 in range(0, K, BLOCK_K):
                ok = k0 + offs < K
                x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
                q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
                tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8 e4m3, s [M, 1] float32) of x [..., K] flattened to rows, in torch."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows(x: torch.Tensor, *, use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8 e4m3, s [M, 1] float32): x [..., K] flattened to rows, each quantized with
    its own scale (module docstring). use_kernel: None takes the Triton kernel on CUDA when triton
    is there; True forces it (the interpreter, in tests); False takes torch."""
    if use_kernel is None:
        use_kernel = AVAILABLE and x.is_cuda
    if not use_kernel:
        return quantize_rows_reference(x)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    one_pass = k <= MAX_K_ONE_PASS
    block = triton.next_power_of_2(k) if one_pass else 4096
    _quantize_rows_kernel[(m,)](rows, q, scale, k, rows.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                MIN_SCALE=MIN_SCALE, BLOCK_K=block, ONE_PASS=one_pass,
                                num_warps=8 if block >= 4096 else 4)
    return q, scale


def quantize_weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_fp8 [N, K], s_w [N] float32) of a float weight [N, K]: one scale per output channel
    (online FP8: a bf16/fp16 checkpoint quantized at load)."""
    q, scale = quantize_rows_reference(weight)
    return q, scale.reshape(-1)


def scaled_mm(q_x: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, s_w: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(q_x * s_x) @ (weight * s_w[:, None])^T (+ bias) in out_dtype: q_x [M, K] and weight [N, K]
    float8 e4m3 (both contiguous along K), s_x [M, 1] and s_w [N] float32."""
    if q_x.is_cuda:
        # cuBLASLt with row-wise scales needs a [K, N] column-major B (weight^T is that view) and
        # bf16 output (an fp16 model's is cast: the FP8 operands carry less precision than either).
        if out_dtype == torch.bfloat16:
            return torch._scaled_mm(q_x, weight.t(), scale_a=s_x, scale_b=s_w.view(1, -1), bias=bias,
                                    out_dtype=out_dtype)
        out = torch._scaled_mm(q_x, weight.t(), scale_a=s_x, scale_b=s_w.view(1, -1), out_dtype=torch.bfloat16)
        return out.to(out_dtype) if bias is None else out.to(out_dtype) + bias
    out = (q_x.to(torch.float32) * s_x) @ (weight.to(torch.float32) * s_w.view(-1, 1)).t()
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(out_dtype)


__all__ = ["AVAILABLE", "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "quantize_rows", "quantize_rows_reference",
           "quantize_weight_rows", "scaled_mm"]
