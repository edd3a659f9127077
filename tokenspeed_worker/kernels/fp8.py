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

Block-wise checkpoints (`weight_block_size` [128, 128]: one scale per 128 x 128 weight tile, as
Qwen3-*-FP8 and DeepSeek ship) take the block-scaled product instead, in the same shape as
DeepSeek-V3's recipe:

- `quantize_groups(x, group)`: each row of x cut into groups of `group` columns (the weight
  block's width), each group with its own scale max(|group|) / 448.
- `block_scaled_mm(q_x, s_x, weight, s_w, block_rows, ...)`: a Triton GEMM stepping K one group
  at a time: the FP8 tensor-core dot of the group, scaled by the rows' group scales times the
  weight's tile scales, accumulated in float32. cuBLASLt's FP8 GEMM takes one scale per row and
  column, not per K group, hence a kernel of our own (vLLM and SGLang write one in Triton too).
  s_w is one row per `block_rows` weight rows: the checkpoint's tiles (128) where every stacked
  shard starts on a tile, else one row per weight row (block_rows 1).

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


    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, stride_s,
                                FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, GROUP: tl.constexpr,
                                BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        offs = group * GROUP + tl.arange(0, BLOCK)
        ok = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row * stride_s + group, scale)

    @triton.jit
    def _block_scaled_mm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                                stride_am, stride_as, stride_bn, stride_bs, stride_cm,
                                BLOCK_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # Tiles in groups of GROUP_M rows of tiles, so neighbouring programs share weight tiles in L2.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok, n_ok = offs_m < M, offs_n < N
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
        b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
        a_scales = as_ptr + offs_m.to(tl.int64) * stride_as
        b_scales = bs_ptr + (offs_n // BLOCK_ROWS).to(tl.int64) * stride_bs
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):  # one K group (the weight block's width) per step
            kk = kb * BLOCK_K + offs_k
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            s_a = tl.load(a_scales + kb, mask=m_ok, other=0.0)
            s_b = tl.load(b_scales + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * s_a[:, None] * s_b[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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


def quantize_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8 e4m3, s [M, ceil(K / group)] float32) of x [..., K] flattened to rows, in torch."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    m, k = rows.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(rows, (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], scale


def quantize_groups(x: torch.Tensor, group: int, *, use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8 e4m3, s [M, ceil(K / group)] float32): x [..., K] flattened to rows, each
    row's groups of `group` columns quantized with their own scale (module docstring). use_kernel
    as quantize_rows'."""
    if use_kernel is None:
        use_kernel = AVAILABLE and x.is_cuda
    if not use_kernel:
        q, scale = quantize_groups_reference(x, group)
        return q.contiguous(), scale
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, groups = rows.shape[0], triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, groups)](rows, q, scale, k, rows.stride(0), q.stride(0), scale.stride(0),
                                             FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, GROUP=group,
                                             BLOCK=triton.next_power_of_2(group), num_warps=1)
    return q, scale


def expand_scales(scales: torch.Tensor, rows: int, cols: int, shape: tuple[int, int]) -> torch.Tensor:
    """Tile scales [ceil(N / rows), ceil(K / cols)] spread to one per element of a [N, K] = `shape`
    matrix (the edge tiles cut): the scale each element is multiplied by."""
    return scales.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def block_gemm_supports(group: int) -> bool:
    """Whether block_scaled_mm's kernel takes K groups of `group` columns: one group is one
    tl.dot step, and an FP8 dot needs a power of two of at least 32 along K."""
    return group >= 32 and not group & (group - 1)


def block_scaled_mm_reference(q_x: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, s_w: torch.Tensor,
                              block_rows: int, group: int, bias: torch.Tensor | None = None,
                              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """block_scaled_mm in float32 torch: both operands widened with their group and tile scales."""
    x = q_x.to(torch.float32) * expand_scales(s_x, 1, group, q_x.shape)
    out = x @ (weight.to(torch.float32) * expand_scales(s_w, block_rows, group, weight.shape)).t()
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(out_dtype)


def block_scaled_mm(q_x: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, s_w: torch.Tensor,
                    block_rows: int, group: int, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16, *, use_kernel: bool | None = None) -> torch.Tensor:
    """sum over K groups g of `group` columns of (q_x[:, g] * s_x[:, g]) @ (weight[:, g] *
    s_w[n // block_rows, g])^T (+ bias) in out_dtype: q_x [M, K] and weight [N, K] float8 e4m3
    contiguous along K, s_x [M, G] (quantize_groups with the weight block's width `group`), s_w
    [ceil(N / block_rows), G] float32, G = ceil(K / group).
    use_kernel: None takes the Triton kernel on CUDA; True forces it (the interpreter, in tests)."""
    if use_kernel is None:
        use_kernel = AVAILABLE and q_x.is_cuda
    if not use_kernel:
        return block_scaled_mm_reference(q_x, s_x, weight, s_w, block_rows, group, bias, out_dtype)
    m, k = q_x.shape
    n = weight.shape[0]
    if not block_gemm_supports(group):
        raise ValueError(f"block_scaled_mm: a K group of {group} columns (a power of two >= 32 is needed)")
    out = torch.empty((m, n), dtype=out_dtype, device=q_x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128  # few rows: more, narrower tiles keep the SMs busy
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_scaled_mm_kernel[grid](
        q_x, s_x, weight, s_w, bias if bias is not None else s_w, out, m, n, k,
        q_x.stride(0), s_x.stride(0), weight.stride(0), s_w.stride(0), out.stride(0),
        BLOCK_ROWS=block_rows, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group,
        GROUP_M=8, num_warps=4 if block_m <= 64 else 8, num_stages=3)
    return out


__all__ = ["AVAILABLE", "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "quantize_rows", "quantize_rows_reference",
           "quantize_weight_rows", "scaled_mm", "quantize_groups", "quantize_groups_reference", "block_scaled_mm",
           "block_scaled_mm_reference"]
