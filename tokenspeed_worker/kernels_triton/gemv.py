"""Skinny matrix products for decode steps of few rows, with the neighbouring small ops folded in.

At batch 1 to 16 a decoder layer's matrix products are weight-bandwidth bound and the small
kernels around them (add + RMSNorm before q/k/v and before gate/up, SiLU·mul after gate/up, and
cuBLAS's own split-K reduction after o_proj and down_proj) cost a launch each: on an H200 about
650 µs of a 4.5 ms Llama-8B step. One kernel here does

    out = epilogue( prologue(x [, residual]) @ W^T [+ b] )

- prologue NORM: x (+ residual, the sum rounded to the dtype and written once, by the first
  column block) -> RMSNorm with the same roundings as kernels_triton/norm.py, recomputed by every
  program from the row (a few kB, read from L2) instead of a separate launch;
- epilogue SILU: W holds [gate | up] rows (the fused gate_up_proj); each program computes matching
  gate and up columns and writes silu(gate) * up rounded like kernels_triton/activation.py.

The rows are padded to 16 for the tensor cores (tl.dot); the weight tiles stream through the
software pipeline (num_stages), which is what keeps enough bytes in flight per multiprocessor. No
library offers these fusions for a skinny product (cuBLAS and cuBLASLt epilogues cannot normalize
the input rows), hence a kernel of our own. layers/skinny.py decides, per shape and row count,
whether this kernel or the unfused torch/cuBLAS path is faster on the machine, by timing both
once, before the CUDA graphs are captured.

Importable without triton: AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from tokenspeed_worker.kernels_triton.attention import fix_triton_interpreter
    from tokenspeed_worker.kernels_triton.norm import interpreting

    fix_triton_interpreter()
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    libdevice = None
    AVAILABLE = False

MAX_ROWS = 16  # rows (tokens) the kernel takes: one tensor-core tile of rows
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried per shape by layers/skinny.py; the first is the
# default where nothing was timed (CPU, interpreter, or a shape first seen while capturing).
CONFIGS = ((32, 256, 4, 4), (16, 256, 4, 4), (64, 128, 4, 4), (32, 128, 4, 6))


if AVAILABLE:

    @triton.jit
    def _skinny_kernel(
        x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, w_ptr, bias_ptr, out_ptr,
        M, N, K, up_offset,
        stride_x, stride_residual, stride_residual_out, stride_w, stride_out,
        eps,
        NORM: tl.constexpr,
        ADD_RESIDUAL: tl.constexpr,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        dtype = x_ptr.dtype.element_ty
        offs_m = tl.arange(0, 16)
        m_ok = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
        r_rows = residual_ptr + offs_m.to(tl.int64)[:, None] * stride_residual
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
        up_rows = w_ptr + (up_offset + offs_n).to(tl.int64)[:, None] * stride_w

        if NORM:  # first pass over the (small) rows: their mean square
            sum_sq = tl.zeros([16], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                mask = m_ok[:, None] & (kk < K)[None, :]
                xt = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
                if ADD_RESIDUAL:
                    rt = tl.load(r_rows + kk[None, :], mask=mask, other=0.0)
                    xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(dtype)
                x32 = xt.to(tl.float32)
                sum_sq += tl.sum(x32 * x32, axis=1)
            mean_sq = sum_sq / K + eps
            if LIBDEVICE:
                rstd = libdevice.rsqrt(mean_sq)
            else:
                rstd = 1.0 / tl.sqrt_rn(mean_sq)

        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            mask = m_ok[:, None] & k_ok[None, :]
            xt = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            if NORM:
                if ADD_RESIDUAL:
                    rt = tl.load(r_rows + kk[None, :], mask=mask, other=0.0)
                    xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(dtype)
                    tl.store(residual_out_ptr + offs_m.to(tl.int64)[:, None] * stride_residual_out + kk[None, :], xt,
                             mask=mask & (pid_n == 0))
                nw = tl.load(norm_weight_ptr + kk, mask=k_ok, other=0.0)
                normed = (xt.to(tl.float32) * rstd[:, None]).to(dtype)
                xt = (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
            acc += tl.dot(xt, tl.trans(w))
            if SILU:
                wu = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
                acc_up += tl.dot(xt, tl.trans(wu))

        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:  # the unfused path rounds gate_up's output, then silu, then the product
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            if LIBDEVICE:
                e = libdevice.exp(-gate)
            else:
                e = tl.exp(-gate)
            act = tl.math.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
            acc = act * up
        out_mask = m_ok[:, None] & n_ok[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    t = t.reshape(-1, k)
    return t if t.stride(-1) == 1 else t.contiguous()


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    config: tuple[int, int, int, int] = CONFIGS[0],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, residual_out) for x of at most MAX_ROWS rows.

    - plain: out = x @ weight^T (+ bias), residual_out None;
    - norm_weight given: out = rmsnorm(x [+ residual]) * norm_weight @ weight^T (+ bias), with
      residual_out = x + residual (a new tensor; x itself when there is no residual);
    - silu: weight is [gate | up] (2I x K) and out = silu(gate) * up, [rows, I] (no bias).
    """
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    k = x.shape[-1]
    rows = _rows(x, k)
    m = rows.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} (or is not contiguous along K)")
    if silu and (bias is not None or weight.shape[0] % 2):
        raise ValueError("silu needs an even number of weight rows [gate | up] and no bias")
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    residual_out = None
    residual_rows = residual_out_rows = rows
    if norm_weight is not None:
        if norm_weight.shape != (k,):
            raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not fit hidden size {k}")
        if residual is not None:
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
            residual_rows = _rows(residual, k)
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            residual_out_rows = residual_out.view(-1, k)
        else:
            residual_out = x
    if m == 0 or n == 0:
        return out, residual_out
    block_n, block_k, num_warps, num_stages = config
    out_rows = out.view(-1, n)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        rows, residual_rows, residual_out_rows,
        norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out_rows,
        m, n, k, n if silu else 0,
        rows.stride(0), residual_rows.stride(0), residual_out_rows.stride(0), weight.stride(0), out_rows.stride(0),
        float(eps),
        NORM=norm_weight is not None,
        ADD_RESIDUAL=norm_weight is not None and residual is not None,
        SILU=silu,
        HAS_BIAS=bias is not None,
        LIBDEVICE=not interpreting(),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, residual_out


__all__ = ["AVAILABLE", "CONFIGS", "MAX_ROWS", "skinny_linear"]
