"""Small-batch GEMV for decode steps of few rows, with the neighbouring small ops folded in.

One kernel computes, for x of at most MAX_ROWS rows,

    out = epilogue( prologue(x [, residual]) @ W^T [+ b] )

- prologue NORM: x (+ residual, the sum rounded to the dtype and written once, by the first
  column block) -> RMSNorm with the same roundings as kernels/norm.py, recomputed by every
  program from the row (a few kB, read from L2) instead of a separate launch;
- epilogue SILU: W holds [gate | up] rows (the fused gate_up_proj); each program computes matching
  gate and up columns and writes silu(gate) * up rounded like kernels/activation.py;
- epilogue ROPE (RotaryKV): W is the q/k/v projection; q comes back rotated, the rotated k and the
  v go into the paged KV cache, as layers/rotary.py's rope_and_write_kv.

W is x's dtype or float8 e4m3 with one float32 scale per row (per output channel): the tiles widen
to float32 exactly, and each finished sum is multiplied once by its weight row's scale, before the
bias and the epilogue (W_SCALE; without scales the kernel is compiled without them). FP8 weights
also have tensor-core configurations (Fp8Mma, W8A8): the input rows quantized to e4m3 per row in
the kernel, one FP8 warpgroup MMA per K step, no weight widened on the CUDA cores. Past MAX_ROWS
rows (a speculative verify step, a decode batch of 5 to 16) only tensor-core configurations run:
Fp8Mma, and Mma for 16-bit weights (the rows in the weight's dtype, one warpgroup MMA per K step),
up to MMA_MAX_ROWS rows.

At so few rows the product is bound by the weight bytes: each program streams a strip of weight
rows once for all input rows, on the CUDA cores (each row its own accumulator). One-shot
configurations run one program per strip; Persistent ones run a few programs per multiprocessor
that loop over the strips, the next strip's loads in flight while the current one is multiplied.
cuBLAS and cuBLASLt epilogues cannot normalize the input rows, hence a kernel of our own.
layers/small_batch_gemv.py chooses, per site, row count and shape, between this kernel and the
unfused torch/cuBLAS path by timing both.

Importable without triton: AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from tokenspeed_worker.kernels import compile_ahead, pdl
from tokenspeed_worker.kernels.fp8 import FP8_MAX as _FP8_MAX, MIN_SCALE as _FP8_MIN_SCALE
from tokenspeed_worker.layers.kv_cache import saturation_limit

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from tokenspeed_worker.kernels.activation import _gated
    from tokenspeed_worker.kernels.norm import interpreting

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    libdevice = None
    AVAILABLE = False

MAX_ROWS = 4  # rows (tokens) the CUDA-core configurations take: each row is its own accumulator
MMA_MAX_ROWS = 16  # rows the tensor-core configurations (Mma, Fp8Mma) take: the MMA's narrow side


class Persistent(NamedTuple):
    """A persistent configuration: per_sm programs per multiprocessor, each looping over strips of
    block_n weight rows (the whole of K in one tile); strip s + programs' loads are issued before
    strip s is multiplied, and the input rows (normalized) are read once per program instead of
    once per strip. The one-shot grid pays, per strip, a program start, the input rows' L2 round
    trips and a stretch with no weight loads in flight; here weight loads are in flight throughout."""

    block_n: int
    num_warps: int
    per_sm: int


class Fp8Mma(NamedTuple):
    """A tensor-core configuration for FP8 weights (W8A8): one program per block_n weight rows,
    looping over K in block_k steps (software-pipelined num_stages deep); the input rows are
    quantized to e4m3 per row (scale max|row| / 448, as kernels/fp8.quantize_rows: the FP8 GEMM's
    activations at many rows) and each step is one FP8 tensor-core dot of the weight tile with the
    rows, float32 accumulators. No weight is widened on the CUDA cores; the weight and the row
    scales multiply each finished sum."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class Mma(NamedTuple):
    """A tensor-core configuration for 16-bit weights (x's dtype): as Fp8Mma, with the input rows
    (normalized) in the weight's dtype instead of quantized, one 16-bit warpgroup MMA per K step.
    For 5 to MMA_MAX_ROWS rows, where one accumulator per row on the CUDA cores would cost more
    instructions per weight byte than the bandwidth leaves."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class BlockScales(NamedTuple):
    """Block-wise FP8 weight scales: scales[i, j] (float32, contiguous) multiplies the weight's rows
    [i * rows, (i + 1) * rows) and columns [j * cols, (j + 1) * cols) (the edge tiles cut)."""

    scales: torch.Tensor
    rows: int
    cols: int


def takes_block_scales(config: tuple, block_rows: int) -> bool:
    """Whether a configuration can read weights with block scales of `block_rows`-row tiles: a
    one-shot one whose strips of BLOCK_N rows never straddle two tile rows."""
    return not isinstance(config, (Persistent, Fp8Mma, Mma)) and block_rows % config[0] == 0


def _check_block_scales(blocks: BlockScales, weight: torch.Tensor, weight_scale, config: tuple) -> None:
    n, k = weight.shape
    expected = (-(-n // blocks.rows), -(-k // blocks.cols))
    if weight_scale is not None or weight.dtype != torch.float8_e4m3fn:
        raise ValueError("weight_block_scales go with an fp8 weight and no weight_scale")
    if blocks.scales.dtype != torch.float32 or tuple(blocks.scales.shape) != expected or not blocks.scales.is_contiguous():
        raise ValueError(f"weight_block_scales must be contiguous float32 of shape {expected} ({blocks.rows} x "
                         f"{blocks.cols} tiles); got {blocks.scales.dtype} {tuple(blocks.scales.shape)}")
    if blocks.scales.device != weight.device:
        raise ValueError(f"weight_block_scales must be on the weight's device ({weight.device})")
    if not takes_block_scales(config, blocks.rows):
        raise ValueError(f"{config} cannot read block scales of {blocks.rows}-row tiles (one-shot configurations "
                         f"whose BLOCK_N divides the tile's rows)")


PERSISTENT_MAX_ELEMENTS = 32768  # rows x next_power_of_2(K): the input rows held as float32 across the program
# Tried per shape by layers/small_batch_gemv.py: one-shot (BLOCK_N, BLOCK_K, num_warps) (one program per
# BLOCK_N weight rows, looping over K), then Persistent ones. The first is the default where nothing
# was timed (CPU, interpreter, or a shape first seen while capturing).
# The wide-K ones (2048) are for long rows such as down_proj's (K = 8192 at 1B, 14336 at 8B), where
# more bytes per program and iteration keep more loads in flight.
CONFIGS = ((8, 512, 4), (16, 512, 4), (4, 1024, 4), (16, 256, 4), (32, 256, 8), (4, 2048, 4), (2, 2048, 4),
           (8, 1024, 8), (4, 2048, 8),
           Persistent(1, 4, 4), Persistent(2, 4, 4), Persistent(2, 8, 2), Persistent(4, 8, 2))
# Sites with the RMSNorm prologue also try it in one pass (a fourth field, True): the squares are
# summed alongside the product and 1 / RMS scales the result, instead of every program first reading
# the row for its RMS. It rounds the normalized input differently from the norm layer (x * w in
# float32, scaled after the sum, vs. x * rstd rounded, then * w rounded), by about one bfloat16 step.
NORM_CONFIGS = CONFIGS + ((4, 1024, 4, True), (8, 512, 4, True), (4, 2048, 8, True), (8, 1024, 8, True))


def _wider(config: tuple) -> tuple:
    """The configuration that moves as many bytes per tile over FP8 weights (one byte each, not two):
    twice BLOCK_K for a one-shot one, twice block_n for a Persistent one."""
    if isinstance(config, Persistent):
        return config._replace(block_n=2 * config.block_n)
    return (config[0], 2 * config[1], *config[2:])


# FP8 weights: the same configurations with tiles of the same bytes (their first is the default),
# and the tensor-core ones (64-row strips: one warpgroup MMA's side).
FP8_MMA_CONFIGS = (Fp8Mma(64, 256, 4, 4), Fp8Mma(64, 512, 4, 3), Fp8Mma(128, 256, 8, 3))
FP8_CONFIGS = tuple(_wider(c) for c in CONFIGS) + FP8_MMA_CONFIGS
FP8_NORM_CONFIGS = tuple(_wider(c) for c in NORM_CONFIGS) + FP8_MMA_CONFIGS
# 16-bit weights past MAX_ROWS rows (the same tile bytes as the FP8 ones: half the K per step).
MMA_CONFIGS = (Mma(64, 128, 4, 4), Mma(64, 256, 4, 3), Mma(128, 128, 8, 3))


def supports_rotary(config: tuple) -> bool:
    """Whether a configuration has the rotary + KV-write epilogue (the one-shot ones)."""
    return not isinstance(config, (Persistent, Fp8Mma, Mma))


def takes_gemma_forms(config: tuple) -> bool:
    """Whether a configuration has Gemma's prologue and epilogue forms (unit_offset, x_norm_weight,
    gelu): the one-shot two-pass ones and the Persistent ones."""
    if isinstance(config, Persistent):
        return True
    return not isinstance(config, (Fp8Mma, Mma)) and not (len(config) > 3 and config[3])


def configs_for(weight_dtype: torch.dtype, norm: bool = False, block_rows: int | None = None,
                gemma: bool = False, rows: int = 1) -> tuple:
    """The configurations to time for a weight of this dtype: NORM_CONFIGS / CONFIGS, or their FP8
    forms for float8 e4m3 weights; norm: the site has the RMSNorm prologue (adds the one-pass ones);
    block_rows: the weight has block scales of tiles this many rows high (those that take them);
    gemma: the site uses Gemma's forms (those that take them); rows past MAX_ROWS (up to
    MMA_MAX_ROWS): the tensor-core ones only (MMA_CONFIGS, FP8_MMA_CONFIGS)."""
    if rows > MAX_ROWS:
        if rows > MMA_MAX_ROWS or gemma or (weight_dtype == torch.float8_e4m3fn and block_rows is not None):
            return ()
        return FP8_MMA_CONFIGS if weight_dtype == torch.float8_e4m3fn else MMA_CONFIGS
    if weight_dtype == torch.float8_e4m3fn:
        configs = FP8_NORM_CONFIGS if norm else FP8_CONFIGS
        if block_rows is not None:
            configs = tuple(c for c in configs if takes_block_scales(c, block_rows))
    else:
        configs = NORM_CONFIGS if norm else CONFIGS
    return tuple(c for c in configs if takes_gemma_forms(c)) if gemma else configs


if AVAILABLE:

    @triton.jit
    def _normed(x32, rstd, nw, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """The norm's output rounded to dtype, as kernels/norm.py rounds it: Llama's form (x * rstd
        rounded, times w, rounded) or Gemma's (UNIT_OFFSET: x * rstd * (1 + w) in float32, rounded once)."""
        if UNIT_OFFSET:
            return ((x32 * rstd) * (1.0 + nw.to(tl.float32))).to(dtype)
        normed = (x32 * rstd).to(dtype)
        return (normed.to(tl.float32) * nw.to(tl.float32)).to(dtype)

    @triton.jit
    def _row_sum(x_ptr, residual_ptr, x_norm_weight_ptr, row, kk, k_ok, x_rstd, stride_x, stride_residual,
                 ADD_RESIDUAL: tl.constexpr, NORM_X: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """Row `row`'s x (NORM_X: x normalized with its own weight first, Gemma's sublayer output)
        (+ residual), rounded to the dtype, over columns kk."""
        dtype = x_ptr.dtype.element_ty
        xt = tl.load(x_ptr + row * stride_x + kk, mask=k_ok, other=0.0)
        if NORM_X:
            xt = _normed(xt.to(tl.float32), x_rstd, tl.load(x_norm_weight_ptr + kk, mask=k_ok, other=0.0), dtype,
                         UNIT_OFFSET)
        if ADD_RESIDUAL:
            rt = tl.load(residual_ptr + row * stride_residual + kk, mask=k_ok, other=0.0)
            xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(dtype)
        return xt

    @triton.jit
    def _row_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, row, kk, k_ok, rstd, pid_n,
                stride_x, stride_residual, stride_residual_out,
                NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                x_norm_weight_ptr, x_rstd, NORM_X: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """Row `row`'s input over columns kk, float32: x, or the normalized x (+ residual) (NORM_X:
        x normalized first; UNIT_OFFSET: Gemma's form of both norms)."""
        if NORM:
            xt = _row_sum(x_ptr, residual_ptr, x_norm_weight_ptr, row, kk, k_ok, x_rstd, stride_x, stride_residual,
                          ADD_RESIDUAL, NORM_X, UNIT_OFFSET)
            if ADD_RESIDUAL:
                tl.store(residual_out_ptr + row * stride_residual_out + kk, xt, mask=k_ok & (pid_n == 0))
            nw = tl.load(norm_weight_ptr + kk, mask=k_ok, other=0.0)
            xt = _normed(xt.to(tl.float32), rstd, nw, x_ptr.dtype.element_ty, UNIT_OFFSET)
        else:
            xt = tl.load(x_ptr + row * stride_x + kk, mask=k_ok, other=0.0)
        return xt.to(tl.float32)

    @triton.jit
    def _row_in_one_pass(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, row, kk, k_ok, pid_n,
                         stride_x, stride_residual, stride_residual_out, ADD_RESIDUAL: tl.constexpr):
        """One-pass prologue: (x (+ residual)) * norm weight over columns kk, float32, and the
        squares of x (+ residual) for the row's RMS; 1 / RMS multiplies the finished sum instead
        (a per-row scalar), so no program first walks the whole row to normalize it."""
        xt = tl.load(x_ptr + row * stride_x + kk, mask=k_ok, other=0.0)
        if ADD_RESIDUAL:
            rt = tl.load(residual_ptr + row * stride_residual + kk, mask=k_ok, other=0.0)
            xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * stride_residual_out + kk, xt, mask=k_ok & (pid_n == 0))
        nw = tl.load(norm_weight_ptr + kk, mask=k_ok, other=0.0)
        x32 = xt.to(tl.float32)
        return x32 * nw.to(tl.float32), x32 * x32

    @triton.jit
    def _rstd_of(sum_sq, K, eps, LIBDEVICE: tl.constexpr, AXIS: tl.constexpr = 0):
        """1 / sqrt(mean + eps) of the squares summed along AXIS of sum_sq (K of them in all)."""
        mean_sq = tl.sum(sum_sq, axis=AXIS) / K + eps
        if LIBDEVICE:
            return libdevice.rsqrt(mean_sq)
        return 1.0 / tl.sqrt_rn(mean_sq)

    @triton.jit
    def _row_rstd(x_ptr, residual_ptr, row, K, stride_x, stride_residual, eps,
                  ADD_RESIDUAL: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr,
                  x_norm_weight_ptr, x_rstd, NORM_X: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """1 / sqrt(mean((x + residual)^2) + eps) of one row, the sum rounded to the dtype first
        (NORM_X: of x normalized with x_rstd and its weight, then + residual: _row_sum)."""
        offs_k = tl.arange(0, BLOCK_K)
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            xt = _row_sum(x_ptr, residual_ptr, x_norm_weight_ptr, row, kk, k_ok, x_rstd, stride_x, stride_residual,
                          ADD_RESIDUAL, NORM_X, UNIT_OFFSET)
            x32 = xt.to(tl.float32)
            sum_sq += x32 * x32
        return _rstd_of(sum_sq, K, eps, LIBDEVICE)

    @triton.jit
    def _epilogue(acc, acc_up, bias_ptr, out_ptr, row, offs_n, n_ok, stride_out,
                  SILU: tl.constexpr, HAS_BIAS: tl.constexpr, LIBDEVICE: tl.constexpr, GELU: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU:  # the unfused path rounds gate_up's output, then act (SiLU, or GELU-tanh), then the product
            acc = _gated(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype, GELU, LIBDEVICE)
        tl.store(out_ptr + row * stride_out + offs_n, acc.to(dtype), mask=n_ok)

    @triton.jit
    def _rope_epilogue(a, b, bias_ptr, q_out_ptr, row, offs_n, d, head,
                       positions_ptr, slots_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                       stride_q_out, stride_cos, stride_sin, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
                       num_heads, num_kv_heads,
                       HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, KV_SATURATE: tl.constexpr):
        """Row `row`'s columns d and d + HALF of head `head` of the q/k/v product: q heads rotated into
        q_out, k heads rotated and v heads as they are into the caches at the row's slot; roundings
        as the projection's output followed by kernels/rotary.py."""
        dtype = q_out_ptr.dtype.element_ty
        if HAS_BIAS:
            a += tl.load(bias_ptr + offs_n).to(tl.float32)
            b += tl.load(bias_ptr + offs_n + HALF).to(tl.float32)
        a = a.to(dtype).to(tl.float32)  # the projection's output, as the unfused path stores it
        b = b.to(dtype).to(tl.float32)
        if head < num_heads + num_kv_heads:  # q and k heads: rotate (x * cos + rotate_half(x) * sin)
            position = tl.load(positions_ptr + row).to(tl.int64)
            cos1 = tl.load(cos_ptr + position * stride_cos + d).to(dtype).to(tl.float32)
            cos2 = tl.load(cos_ptr + position * stride_cos + HALF + d).to(dtype).to(tl.float32)
            sin1 = tl.load(sin_ptr + position * stride_sin + d).to(dtype).to(tl.float32)
            sin2 = tl.load(sin_ptr + position * stride_sin + HALF + d).to(dtype).to(tl.float32)
            out1 = ((a * cos1).to(dtype).to(tl.float32) - (b * sin1).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            out2 = ((b * cos2).to(dtype).to(tl.float32) + (a * sin2).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        else:
            out1 = a
            out2 = b
        if head < num_heads:
            q_row = q_out_ptr + row * stride_q_out + head * HEAD_DIM
            tl.store(q_row + d, out1.to(dtype))
            tl.store(q_row + HALF + d, out2.to(dtype))
        else:
            slot = tl.load(slots_ptr + row).to(tl.int64)
            if KV_SATURATE > 0:  # an fp8 cache: e4m3 has no infinity
                out1 = tl.clamp(out1, -KV_SATURATE, KV_SATURATE)
                out2 = tl.clamp(out2, -KV_SATURATE, KV_SATURATE)
            if head < num_heads + num_kv_heads:
                dst = k_cache_ptr + slot * stride_kc_slot + (head - num_heads) * stride_kc_h
            else:
                dst = v_cache_ptr + slot * stride_vc_slot + (head - num_heads - num_kv_heads) * stride_vc_h
            tl.store(dst + d, out1.to(k_cache_ptr.dtype.element_ty))
            tl.store(dst + HALF + d, out2.to(k_cache_ptr.dtype.element_ty))

    @triton.jit
    def _block_scaled(x, scale, ON: tl.constexpr):
        if ON:
            return x * scale
        return x

    @triton.jit
    def _gemv_kernel(
        x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
        positions_ptr, slots_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
        N, K, up_offset,
        stride_x, stride_residual, stride_residual_out, stride_w, stride_out, stride_w_blocks,
        stride_cos, stride_sin, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
        num_heads, num_kv_heads,
        eps,
        ROWS: tl.constexpr,
        NORM: tl.constexpr,
        ADD_RESIDUAL: tl.constexpr,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
        ONE_PASS: tl.constexpr,
        ROPE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        KV_SATURATE: tl.constexpr,
        W_SCALE: tl.constexpr,
        W_BLOCK_ROWS: tl.constexpr = 1,
        W_BLOCK_COLS: tl.constexpr = 0,
        x_norm_weight_ptr=None,
        NORM_X: tl.constexpr = False,
        UNIT_OFFSET: tl.constexpr = False,
        GELU: tl.constexpr = False,
    ):
        # One program: BLOCK_N output columns (weight rows) over the whole of K, for every input
        # row. Each step loads a [BLOCK_N, BLOCK_K] weight tile with 16-byte vector loads and
        # multiplies it on the CUDA cores by each row's slice (a few kB, L2-resident); the grid is
        # N / BLOCK_N programs, small enough to all be resident at once, so the loads of many
        # programs are in flight together (no shared memory, no tensor cores: at <= 4 rows the
        # product is bound by the weight bytes alone).
        pid_n = tl.program_id(0)
        if ROPE:
            # Epilogue ROPE: the program takes BLOCK_N columns d of one head's first half and the
            # matching d + HEAD_DIM / 2 (its "up" columns, up_offset = HEAD_DIM / 2), the pairs rotary
            # mixes; heads in q/k/v order, each in HEAD_DIM / 2 / BLOCK_N programs.
            head = pid_n // (HEAD_DIM // 2 // BLOCK_N)
            d = (pid_n % (HEAD_DIM // 2 // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_n = head * HEAD_DIM + d
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
        up_rows = w_ptr + (up_offset + offs_n).to(tl.int64)[:, None] * stride_w
        # The first weight tile, loaded before waiting on the previous kernel (kernels/pdl.py:
        # weights are never written by a step); each iteration then loads the next tile before
        # using the current one, so a tile's loads are in flight while the last one is multiplied.
        w_next = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        wu_next = w_next
        if SILU or ROPE:
            wu_next = tl.load(up_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        scale = 1.0
        up_scale = 1.0
        if W_SCALE:  # the rows' scales, as constant as the weights: loaded with the first tile
            scale = tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)
            if SILU or ROPE:
                up_scale = tl.load(w_scale_ptr + up_offset + offs_n, mask=n_ok, other=0.0)
        # Block scales (W_BLOCK_ROWS x W_BLOCK_COLS tiles): the strip's rows lie in one tile row (the
        # host checks it), so a K step's scales depend on the column alone: they scale the input
        # slice (ROWS x BLOCK_K multiplies) instead of the weight tile (BLOCK_N x BLOCK_K).
        first = pid_n * BLOCK_N
        if ROPE:
            first = head * HEAD_DIM + (pid_n % (HEAD_DIM // 2 // BLOCK_N)) * BLOCK_N
        gate_blocks = w_scale_ptr + (first // W_BLOCK_ROWS).to(tl.int64) * stride_w_blocks
        up_blocks = w_scale_ptr + ((up_offset + first) // W_BLOCK_ROWS).to(tl.int64) * stride_w_blocks
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rstd0 = 1.0
        rstd1 = 1.0
        rstd2 = 1.0
        rstd3 = 1.0
        xr0 = 1.0  # NORM_X: each row's own rstd (x before the residual add), for its first norm
        xr1 = 1.0
        xr2 = 1.0
        xr3 = 1.0
        if NORM and not ONE_PASS:
            if NORM_X:
                xr0 = _row_rstd(x_ptr, residual_ptr, 0, K, stride_x, stride_residual, eps, False, LIBDEVICE, BLOCK_K,
                                    x_norm_weight_ptr, 1.0, False, UNIT_OFFSET)
                if ROWS > 1:
                    xr1 = _row_rstd(x_ptr, residual_ptr, 1, K, stride_x, stride_residual, eps, False, LIBDEVICE, BLOCK_K,
                                    x_norm_weight_ptr, 1.0, False, UNIT_OFFSET)
                if ROWS > 2:
                    xr2 = _row_rstd(x_ptr, residual_ptr, 2, K, stride_x, stride_residual, eps, False, LIBDEVICE, BLOCK_K,
                                    x_norm_weight_ptr, 1.0, False, UNIT_OFFSET)
                if ROWS > 3:
                    xr3 = _row_rstd(x_ptr, residual_ptr, 3, K, stride_x, stride_residual, eps, False, LIBDEVICE, BLOCK_K,
                                    x_norm_weight_ptr, 1.0, False, UNIT_OFFSET)
            rstd0 = _row_rstd(x_ptr, residual_ptr, 0, K, stride_x, stride_residual, eps, ADD_RESIDUAL, LIBDEVICE, BLOCK_K,
                              x_norm_weight_ptr, xr0, NORM_X, UNIT_OFFSET)
            if ROWS > 1:
                rstd1 = _row_rstd(x_ptr, residual_ptr, 1, K, stride_x, stride_residual, eps, ADD_RESIDUAL, LIBDEVICE,
                                  BLOCK_K, x_norm_weight_ptr, xr1, NORM_X, UNIT_OFFSET)
            if ROWS > 2:
                rstd2 = _row_rstd(x_ptr, residual_ptr, 2, K, stride_x, stride_residual, eps, ADD_RESIDUAL, LIBDEVICE,
                                  BLOCK_K, x_norm_weight_ptr, xr2, NORM_X, UNIT_OFFSET)
            if ROWS > 3:
                rstd3 = _row_rstd(x_ptr, residual_ptr, 3, K, stride_x, stride_residual, eps, ADD_RESIDUAL, LIBDEVICE,
                                  BLOCK_K, x_norm_weight_ptr, xr3, NORM_X, UNIT_OFFSET)
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        up0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        up1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        up2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        up3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        sq0 = tl.zeros([BLOCK_K], dtype=tl.float32)
        sq1 = tl.zeros([BLOCK_K], dtype=tl.float32)
        sq2 = tl.zeros([BLOCK_K], dtype=tl.float32)
        sq3 = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            w = w_next.to(tl.float32)
            wu = wu_next.to(tl.float32)
            k_next = kk + BLOCK_K
            next_mask = n_ok[:, None] & (k_next < K)[None, :]  # past K: no load, no traffic
            w_next = tl.load(w_rows + k_next[None, :], mask=next_mask, other=0.0)
            if SILU or ROPE:
                wu_next = tl.load(up_rows + k_next[None, :], mask=next_mask, other=0.0)
            if W_BLOCK_COLS:
                g_scale = tl.load(gate_blocks + kk // W_BLOCK_COLS, mask=k_ok, other=0.0)
                u_scale = g_scale
                if SILU or ROPE:
                    u_scale = tl.load(up_blocks + kk // W_BLOCK_COLS, mask=k_ok, other=0.0)
            else:  # unused (_block_scaled passes x through): one type for both branches
                g_scale = tl.full([BLOCK_K], 1.0, tl.float32)
                u_scale = g_scale
            if ONE_PASS:
                x0, s0 = _row_in_one_pass(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 0, kk, k_ok, pid_n,
                                            stride_x, stride_residual, stride_residual_out, ADD_RESIDUAL)
                sq0 += s0
            else:
                x0 = _row_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 0, kk, k_ok, rstd0, pid_n,
                               stride_x, stride_residual, stride_residual_out, NORM, ADD_RESIDUAL,
                               x_norm_weight_ptr, xr0, NORM_X, UNIT_OFFSET)
            acc0 += tl.sum(w * _block_scaled(x0, g_scale, W_BLOCK_COLS)[None, :], axis=1)
            if SILU or ROPE:
                up0 += tl.sum(wu * _block_scaled(x0, u_scale, W_BLOCK_COLS)[None, :], axis=1)
            if ROWS > 1:
                if ONE_PASS:
                    x1, s1 = _row_in_one_pass(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 1, kk, k_ok, pid_n,
                                                stride_x, stride_residual, stride_residual_out, ADD_RESIDUAL)
                    sq1 += s1
                else:
                    x1 = _row_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 1, kk, k_ok, rstd1, pid_n,
                                   stride_x, stride_residual, stride_residual_out, NORM, ADD_RESIDUAL,
                               x_norm_weight_ptr, xr1, NORM_X, UNIT_OFFSET)
                acc1 += tl.sum(w * _block_scaled(x1, g_scale, W_BLOCK_COLS)[None, :], axis=1)
                if SILU or ROPE:
                    up1 += tl.sum(wu * _block_scaled(x1, u_scale, W_BLOCK_COLS)[None, :], axis=1)
            if ROWS > 2:
                if ONE_PASS:
                    x2, s2 = _row_in_one_pass(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 2, kk, k_ok, pid_n,
                                                stride_x, stride_residual, stride_residual_out, ADD_RESIDUAL)
                    sq2 += s2
                else:
                    x2 = _row_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 2, kk, k_ok, rstd2, pid_n,
                                   stride_x, stride_residual, stride_residual_out, NORM, ADD_RESIDUAL,
                               x_norm_weight_ptr, xr2, NORM_X, UNIT_OFFSET)
                acc2 += tl.sum(w * _block_scaled(x2, g_scale, W_BLOCK_COLS)[None, :], axis=1)
                if SILU or ROPE:
                    up2 += tl.sum(wu * _block_scaled(x2, u_scale, W_BLOCK_COLS)[None, :], axis=1)
            if ROWS > 3:
                if ONE_PASS:
                    x3, s3 = _row_in_one_pass(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 3, kk, k_ok, pid_n,
                                                stride_x, stride_residual, stride_residual_out, ADD_RESIDUAL)
                    sq3 += s3
                else:
                    x3 = _row_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 3, kk, k_ok, rstd3, pid_n,
                                   stride_x, stride_residual, stride_residual_out, NORM, ADD_RESIDUAL,
                               x_norm_weight_ptr, xr3, NORM_X, UNIT_OFFSET)
                acc3 += tl.sum(w * _block_scaled(x3, g_scale, W_BLOCK_COLS)[None, :], axis=1)
                if SILU or ROPE:
                    up3 += tl.sum(wu * _block_scaled(x3, u_scale, W_BLOCK_COLS)[None, :], axis=1)
        if ONE_PASS:
            rstd0 = _rstd_of(sq0, K, eps, LIBDEVICE)
            acc0 *= rstd0
            up0 *= rstd0
            if ROWS > 1:
                rstd1 = _rstd_of(sq1, K, eps, LIBDEVICE)
                acc1 *= rstd1
                up1 *= rstd1
            if ROWS > 2:
                rstd2 = _rstd_of(sq2, K, eps, LIBDEVICE)
                acc2 *= rstd2
                up2 *= rstd2
            if ROWS > 3:
                rstd3 = _rstd_of(sq3, K, eps, LIBDEVICE)
                acc3 *= rstd3
                up3 *= rstd3
        if W_SCALE:  # once per finished sum, before the bias and the epilogue
            acc0 *= scale
            up0 *= up_scale
            if ROWS > 1:
                acc1 *= scale
                up1 *= up_scale
            if ROWS > 2:
                acc2 *= scale
                up2 *= up_scale
            if ROWS > 3:
                acc3 *= scale
                up3 *= up_scale
        if ROPE:
            _rope_epilogue(acc0, up0, bias_ptr, out_ptr, 0, offs_n, d, head, positions_ptr, slots_ptr, cos_ptr, sin_ptr,
                           k_cache_ptr, v_cache_ptr, stride_out, stride_cos, stride_sin, stride_kc_slot, stride_kc_h,
                           stride_vc_slot, stride_vc_h, num_heads, num_kv_heads, HEAD_DIM // 2, HEAD_DIM, HAS_BIAS,
                           KV_SATURATE)
            if ROWS > 1:
                _rope_epilogue(acc1, up1, bias_ptr, out_ptr, 1, offs_n, d, head, positions_ptr, slots_ptr, cos_ptr,
                               sin_ptr, k_cache_ptr, v_cache_ptr, stride_out, stride_cos, stride_sin, stride_kc_slot,
                               stride_kc_h, stride_vc_slot, stride_vc_h, num_heads, num_kv_heads, HEAD_DIM // 2,
                               HEAD_DIM, HAS_BIAS, KV_SATURATE)
            if ROWS > 2:
                _rope_epilogue(acc2, up2, bias_ptr, out_ptr, 2, offs_n, d, head, positions_ptr, slots_ptr, cos_ptr,
                               sin_ptr, k_cache_ptr, v_cache_ptr, stride_out, stride_cos, stride_sin, stride_kc_slot,
                               stride_kc_h, stride_vc_slot, stride_vc_h, num_heads, num_kv_heads, HEAD_DIM // 2,
                               HEAD_DIM, HAS_BIAS, KV_SATURATE)
            if ROWS > 3:
                _rope_epilogue(acc3, up3, bias_ptr, out_ptr, 3, offs_n, d, head, positions_ptr, slots_ptr, cos_ptr,
                               sin_ptr, k_cache_ptr, v_cache_ptr, stride_out, stride_cos, stride_sin, stride_kc_slot,
                               stride_kc_h, stride_vc_slot, stride_vc_h, num_heads, num_kv_heads, HEAD_DIM // 2,
                               HEAD_DIM, HAS_BIAS, KV_SATURATE)
        else:
            _epilogue(acc0, up0, bias_ptr, out_ptr, 0, offs_n, n_ok, stride_out, SILU, HAS_BIAS, LIBDEVICE, GELU)
            if ROWS > 1:
                _epilogue(acc1, up1, bias_ptr, out_ptr, 1, offs_n, n_ok, stride_out, SILU, HAS_BIAS, LIBDEVICE, GELU)
            if ROWS > 2:
                _epilogue(acc2, up2, bias_ptr, out_ptr, 2, offs_n, n_ok, stride_out, SILU, HAS_BIAS, LIBDEVICE, GELU)
            if ROWS > 3:
                _epilogue(acc3, up3, bias_ptr, out_ptr, 3, offs_n, n_ok, stride_out, SILU, HAS_BIAS, LIBDEVICE, GELU)

    @triton.jit
    def _whole_row(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, row, offs_k, k_ok, pid, K,
                   stride_x, stride_residual, stride_residual_out, eps,
                   NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr, LIBDEVICE: tl.constexpr,
                   x_norm_weight_ptr, NORM_X: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """Row `row`'s whole input, float32 (offs_k covers K): x, or the normalized x (+ residual),
        with _row_rstd's and _row_in's roundings (NORM_X: x normalized with its own weight before the
        residual add; UNIT_OFFSET: Gemma's form of both norms); program 0 writes x (+ residual)."""
        dtype = x_ptr.dtype.element_ty
        xt = tl.load(x_ptr + row * stride_x + offs_k, mask=k_ok, other=0.0)
        if NORM:
            if NORM_X:
                x32 = xt.to(tl.float32)
                xw = tl.load(x_norm_weight_ptr + offs_k, mask=k_ok, other=0.0)
                xt = _normed(x32, _rstd_of(x32 * x32, K, eps, LIBDEVICE), xw, dtype, UNIT_OFFSET)
            if ADD_RESIDUAL:
                rt = tl.load(residual_ptr + row * stride_residual + offs_k, mask=k_ok, other=0.0)
                xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(dtype)
                tl.store(residual_out_ptr + row * stride_residual_out + offs_k, xt, mask=k_ok & (pid == 0))
            x32 = xt.to(tl.float32)
            nw = tl.load(norm_weight_ptr + offs_k, mask=k_ok, other=0.0)
            xt = _normed(x32, _rstd_of(x32 * x32, K, eps, LIBDEVICE), nw, dtype, UNIT_OFFSET)
        return xt.to(tl.float32)

    @triton.jit
    def _strip_out(w, wu, xr, scale, up_scale, bias_ptr, out_ptr, row, offs_n, n_ok, stride_out,
                   SILU: tl.constexpr, HAS_BIAS: tl.constexpr, LIBDEVICE: tl.constexpr, W_SCALE: tl.constexpr,
                   GELU: tl.constexpr):
        """One input row's products with a strip (w, and wu: its up rows under SILU), each times its
        weight row's scale under W_SCALE, through _epilogue (GELU: gelu_tanh(gate) * up under SILU)."""
        acc = tl.sum(w * xr[None, :], axis=1)
        if W_SCALE:
            acc *= scale
        up = acc
        if SILU:
            up = tl.sum(wu * xr[None, :], axis=1)
            if W_SCALE:
                up *= up_scale
        _epilogue(acc, up, bias_ptr, out_ptr, row, offs_n, n_ok, stride_out, SILU, HAS_BIAS, LIBDEVICE, GELU)

    @triton.jit
    def _gemv_persistent_kernel(
        x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
        N, K, up_offset,
        stride_x, stride_residual, stride_residual_out, stride_w, stride_out,
        eps,
        x_norm_weight_ptr,
        ROWS: tl.constexpr,
        NORM: tl.constexpr,
        ADD_RESIDUAL: tl.constexpr,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
        W_SCALE: tl.constexpr,
        NORM_X: tl.constexpr = False,
        UNIT_OFFSET: tl.constexpr = False,
        GELU: tl.constexpr = False,
    ):
        # A Persistent configuration: program p takes strips p, p + programs, ... of BLOCK_N weight
        # rows over the whole of K (BLOCK_K >= K). The next strip's tile is loaded before the current
        # one is multiplied, so every program keeps a strip of weight loads in flight from its first
        # load (before the PDL wait: weights are never written by a step) to its last strip; the
        # input rows are read and normalized once, into registers (in Gemma's forms too: NORM_X,
        # UNIT_OFFSET, and GELU in the gated epilogue, as the one-shot kernel has them).
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        offs_b = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        first = pid * BLOCK_N + offs_b
        first_mask = (first < N)[:, None] & k_ok[None, :]
        w_next = tl.load(w_ptr + first.to(tl.int64)[:, None] * stride_w + offs_k[None, :], mask=first_mask, other=0.0)
        wu_next = w_next
        if SILU:
            wu_next = tl.load(w_ptr + (up_offset + first).to(tl.int64)[:, None] * stride_w + offs_k[None, :],
                              mask=first_mask, other=0.0)
        s_next = 1.0  # the strip's rows' scales (W_SCALE), loaded with its tile
        su_next = 1.0
        if W_SCALE:
            s_next = tl.load(w_scale_ptr + first, mask=first < N, other=0.0)
            if SILU:
                su_next = tl.load(w_scale_ptr + up_offset + first, mask=first < N, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x0 = _whole_row(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 0, offs_k, k_ok, pid, K, stride_x,
                        stride_residual, stride_residual_out, eps, NORM, ADD_RESIDUAL, LIBDEVICE,
                        x_norm_weight_ptr, NORM_X, UNIT_OFFSET)
        x1 = x0
        x2 = x0
        x3 = x0
        if ROWS > 1:
            x1 = _whole_row(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 1, offs_k, k_ok, pid, K, stride_x,
                            stride_residual, stride_residual_out, eps, NORM, ADD_RESIDUAL, LIBDEVICE,
                            x_norm_weight_ptr, NORM_X, UNIT_OFFSET)
        if ROWS > 2:
            x2 = _whole_row(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 2, offs_k, k_ok, pid, K, stride_x,
                            stride_residual, stride_residual_out, eps, NORM, ADD_RESIDUAL, LIBDEVICE,
                            x_norm_weight_ptr, NORM_X, UNIT_OFFSET)
        if ROWS > 3:
            x3 = _whole_row(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, 3, offs_k, k_ok, pid, K, stride_x,
                            stride_residual, stride_residual_out, eps, NORM, ADD_RESIDUAL, LIBDEVICE,
                            x_norm_weight_ptr, NORM_X, UNIT_OFFSET)
        for strip in range(pid, tl.cdiv(N, BLOCK_N), programs):
            w = w_next.to(tl.float32)
            wu = wu_next.to(tl.float32)
            s = s_next
            su = su_next
            offs_n = strip * BLOCK_N + offs_b
            n_ok = offs_n < N
            nxt = offs_n + programs * BLOCK_N  # past N (the last strip): no load, no traffic
            nxt_mask = (nxt < N)[:, None] & k_ok[None, :]
            w_next = tl.load(w_ptr + nxt.to(tl.int64)[:, None] * stride_w + offs_k[None, :], mask=nxt_mask, other=0.0)
            if SILU:
                wu_next = tl.load(w_ptr + (up_offset + nxt).to(tl.int64)[:, None] * stride_w + offs_k[None, :],
                                  mask=nxt_mask, other=0.0)
            if W_SCALE:
                s_next = tl.load(w_scale_ptr + nxt, mask=nxt < N, other=0.0)
                if SILU:
                    su_next = tl.load(w_scale_ptr + up_offset + nxt, mask=nxt < N, other=0.0)
            _strip_out(w, wu, x0, s, su, bias_ptr, out_ptr, 0, offs_n, n_ok, stride_out, SILU, HAS_BIAS, LIBDEVICE,
                       W_SCALE, GELU)
            if ROWS > 1:
                _strip_out(w, wu, x1, s, su, bias_ptr, out_ptr, 1, offs_n, n_ok, stride_out, SILU, HAS_BIAS,
                           LIBDEVICE, W_SCALE, GELU)
            if ROWS > 2:
                _strip_out(w, wu, x2, s, su, bias_ptr, out_ptr, 2, offs_n, n_ok, stride_out, SILU, HAS_BIAS,
                           LIBDEVICE, W_SCALE, GELU)
            if ROWS > 3:
                _strip_out(w, wu, x3, s, su, bias_ptr, out_ptr, 3, offs_n, n_ok, stride_out, SILU, HAS_BIAS,
                           LIBDEVICE, W_SCALE, GELU)

    @triton.jit
    def _rows_rstd(x_ptr, residual_ptr, offs_m, m_ok, K, stride_x, stride_residual, eps,
                   ADD_RESIDUAL: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr):
        """_row_rstd of rows offs_m at once ([16]; rows not m_ok read nothing)."""
        offs_k = tl.arange(0, BLOCK_K)
        sum_sq = tl.zeros([16, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask = m_ok[:, None] & (kk < K)[None, :]
            xt = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
            if ADD_RESIDUAL:
                rt = tl.load(residual_ptr + offs_m[:, None] * stride_residual + kk[None, :], mask=mask, other=0.0)
                xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(x_ptr.dtype.element_ty)
            x32 = xt.to(tl.float32)
            sum_sq += x32 * x32
        return _rstd_of(sum_sq, K, eps, LIBDEVICE, 1)

    @triton.jit
    def _gemv_mma_kernel(
        x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
        N, K, up_offset,
        stride_x, stride_residual, stride_residual_out, stride_w, stride_out,
        eps,
        ROWS: tl.constexpr,
        NORM: tl.constexpr,
        ADD_RESIDUAL: tl.constexpr,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        DOT_F32: tl.constexpr,
        QUANT: tl.constexpr,
        W_SCALE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        MIN_SCALE: tl.constexpr,
    ):
        # A tensor-core configuration: out^T[BLOCK_N, 16 (ROWS used)] = W[BLOCK_N, K] @ Q[16, K]^T,
        # float32 accumulators. Q is the input rows (after the residual add and RMSNorm, rounded as
        # kernels/norm.py rounds them), recomputed by every program from the rows (L2-resident)
        # instead of a separate launch: with QUANT (Fp8Mma: W is e4m3) quantized per row as
        # kernels/fp8.quantize_rows does, else (Mma) in W's 16-bit dtype. The weight is the dot's
        # first operand so that its strip is the 64-row side a warpgroup MMA needs and the few rows
        # the narrow one (swap-AB).
        dtype = out_ptr.dtype.element_ty
        pid_n = tl.program_id(0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_m = tl.arange(0, 16)
        m_ok = offs_m < ROWS
        offs_k = tl.arange(0, BLOCK_K)
        scale = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
        up_scale = scale
        if W_SCALE:
            scale = tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)
            if SILU:
                up_scale = tl.load(w_scale_ptr + up_offset + offs_n, mask=n_ok, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rstd = tl.full([16], 1.0, dtype=tl.float32)
        if NORM:
            rstd = _rows_rstd(x_ptr, residual_ptr, offs_m, m_ok, K, stride_x, stride_residual, eps, ADD_RESIDUAL,
                              LIBDEVICE, BLOCK_K)
        x_scale = tl.full([16], 1.0, dtype=tl.float32)
        x_inv = x_scale
        if QUANT:
            # Each row's scale: the largest |input| over the whole row (a pass over the rows first).
            amax = tl.zeros([16, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xt = _rows_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, offs_m, m_ok, k0 + offs_k, K,
                              rstd, pid_n, stride_x, stride_residual, stride_residual_out, NORM, ADD_RESIDUAL, False)
                amax = tl.maximum(amax, tl.abs(xt))
            x_scale = tl.maximum(tl.max(amax, axis=1) / FP8_MAX, MIN_SCALE)
            # Times the reciprocal, not divided (quantize_rows divides): a division per element would
            # cost more instructions than the weight bytes allow; at most one e4m3 rounding apart.
            x_inv = tl.math.div_rn(tl.full([16], 1.0, dtype=tl.float32), x_scale)
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
        up_rows = w_ptr + (up_offset + offs_n).to(tl.int64)[:, None] * stride_w
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + offs_k
            w_mask = n_ok[:, None] & (kk < K)[None, :]
            w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
            xt = _rows_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, offs_m, m_ok, kk, K, rstd, pid_n,
                          stride_x, stride_residual, stride_residual_out, NORM, ADD_RESIDUAL, True)
            if QUANT:
                q = tl.clamp(xt * x_inv[:, None], -FP8_MAX, FP8_MAX).to(w_ptr.dtype.element_ty)
            else:
                q = xt.to(w_ptr.dtype.element_ty)
            if DOT_F32:  # the interpreter: the same exact products (e4m3 and 16-bit values are f32 values)
                acc = tl.dot(w.to(tl.float32), tl.trans(q.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(q), acc)
            if SILU:
                wu = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
                if DOT_F32:
                    acc_up = tl.dot(wu.to(tl.float32), tl.trans(q.to(tl.float32)), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(wu, tl.trans(q), acc_up)
        acc = acc * scale[:, None] * x_scale[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SILU:  # as _epilogue: gate_up's output rounded, then silu, then the product
            up = (acc_up * up_scale[:, None] * x_scale[None, :]).to(dtype).to(tl.float32)
            acc = _gated(acc.to(dtype).to(tl.float32), up, dtype, False, LIBDEVICE)
        tl.store(out_ptr + offs_m[None, :] * stride_out + offs_n[:, None], acc.to(dtype),
                 mask=m_ok[None, :] & n_ok[:, None])

    @triton.jit
    def _rows_in(x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, offs_m, m_ok, kk, K, rstd, pid_n,
                 stride_x, stride_residual, stride_residual_out,
                 NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr):
        """Rows offs_m's input over columns kk, float32 [16, len(kk)]: x, or the normalized x (+ residual),
        rounded as _row_in's; WRITE_RESIDUAL: program 0 writes x + residual."""
        k_ok = kk < K
        mask = m_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
        if NORM:
            if ADD_RESIDUAL:
                rt = tl.load(residual_ptr + offs_m[:, None] * stride_residual + kk[None, :], mask=mask, other=0.0)
                xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if WRITE_RESIDUAL:
                    tl.store(residual_out_ptr + offs_m[:, None] * stride_residual_out + kk[None, :], xt,
                             mask=mask & (pid_n == 0))
            nw = tl.load(norm_weight_ptr + kk, mask=k_ok, other=0.0)
            xt = _normed(xt.to(tl.float32), rstd[:, None], nw[None, :], x_ptr.dtype.element_ty, False)
        return xt.to(tl.float32)


_spills: dict[tuple, int] = {}

def spilled_registers(args: tuple, meta: dict, shape_key: tuple) -> int:
    """Registers the persistent kernel spills for these arguments (compiled, not launched; cached
    per shape and constexprs). Each persistent program holds its input rows and two weight strips
    in registers; where that is too much the compiler spills to local memory, which the driver then
    reserves at launch for every thread the GPU can hold: memory the KV pool was sized without.
    0 in the interpreter."""
    if interpreting() or compile_ahead.active():  # compile-only: checked at the real launch, from the cache
        return 0
    key = (*shape_key, *sorted(meta.items()))
    if key not in _spills:
        compiled = _gemv_persistent_kernel.warmup(*args, grid=(1,), **meta)
        compiled._init_handles()  # loads the binary: n_spills is read from it
        _spills[key] = int(getattr(compiled, "n_spills", 0) or 0)
    return _spills[key]


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 2 elsewhere (the interpreter: a few strips per program)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    t = t.reshape(-1, k)
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass
class RotaryKV:
    """Epilogue of a q/k/v product: rotary on q and k heads (full rotary_dim = head_dim, the pairs
    d and d + head_dim / 2, cos/sin tables [max_position, head_dim] float32) and the rotated k and the
    v heads written into the caches (each viewable as [slots, num_kv_heads, head_dim]) at slots.
    Only q [rows, num_heads, head_dim] is returned."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor  # int [rows]
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # int [rows]


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    rotary: RotaryKV | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_block_scales: BlockScales | None = None,
    unit_offset: bool = False,
    x_norm_weight: torch.Tensor | None = None,
    gelu: bool = False,
    config: tuple = CONFIGS[0],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, residual_out) for x of at most MAX_ROWS rows.

    - plain: out = x @ weight^T (+ bias), residual_out None;
    - norm_weight given: out = rmsnorm(x [+ residual]) * norm_weight @ weight^T (+ bias), with
      residual_out = x + residual (a new tensor; x itself when there is no residual);
    - silu: weight is [gate | up] (2I x K) and out = silu(gate) * up, [rows, I] (no bias);
    - rotary: weight is q/k/v ((H + 2 Hkv) * D x K); out is the rotated q, [rows, H, D], and the
      rotated k and the v go into the caches (RotaryKV), as layers/rotary.py's rope_and_write_kv.

    weight is x's dtype or torch.float8_e4m3fn. With weight_scale (float32, contiguous, on weight's
    device, one per weight row: all 2I of [gate | up] under silu, all (H + 2 Hkv) * D under rotary)
    the weight is weight.float() * weight_scale[:, None]: each row's float32 sum is multiplied by its
    scale once, before the bias and the epilogue. An fp8 weight needs it or weight_block_scales
    (BlockScales: one float32 scale per rows x cols tile, as block-wise FP8 checkpoints ship them;
    one-shot configurations only, whose BLOCK_N divides the tile's rows and the up/rotary offset,
    so each strip of weight rows lies in one tile row). A weight of x's dtype without either is
    taken as it is.

    Gemma's forms (one-shot two-pass and Persistent configurations, `takes_gemma_forms`): unit_offset: the
    norm scales by 1 + norm_weight, rounded once (GemmaRMSNorm); x_norm_weight: x is first
    normalized with that weight (the same form and eps) before the residual add, a sublayer's post
    norm (RMSNorm.forward_after; residual_out is then norm_x(x) + residual); gelu: like silu, with
    gelu_tanh(gate) * up.
    """
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    if unit_offset or x_norm_weight is not None or gelu:
        if not takes_gemma_forms(config):
            raise ValueError(f"{config} has no Gemma forms (unit_offset, x_norm_weight, gelu): use a one-shot "
                             f"two-pass or a Persistent configuration")
        if (unit_offset or x_norm_weight is not None) and norm_weight is None:
            raise ValueError("unit_offset and x_norm_weight go with norm_weight")
        if x_norm_weight is not None and (residual is None or x_norm_weight.shape != (x.shape[-1],)):
            raise ValueError(f"x_norm_weight needs a residual and the hidden size {x.shape[-1]}")
        if gelu and silu:
            raise ValueError("silu and gelu are two activations: pass one")
    k = x.shape[-1]
    rows = _rows(x, k)
    m = rows.shape[0]
    mma = isinstance(config, (Fp8Mma, Mma))
    if m > (MMA_MAX_ROWS if mma else MAX_ROWS):
        raise ValueError(f"small_batch_linear takes at most {MAX_ROWS} rows ({MMA_MAX_ROWS} in a tensor-core "
                         f"configuration), got {m}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} (or is not contiguous along K)")
    if weight.dtype not in (x.dtype, torch.float8_e4m3fn):
        raise ValueError(f"weight dtype {weight.dtype} must be x's ({x.dtype}) or torch.float8_e4m3fn")
    if weight_block_scales is not None:
        _check_block_scales(weight_block_scales, weight, weight_scale, config)
    elif weight_scale is None:
        if weight.dtype == torch.float8_e4m3fn:
            raise ValueError("an fp8 weight needs weight_scale (float32, one per weight row) or weight_block_scales")
    elif weight_scale.dtype != torch.float32 or weight_scale.shape != (weight.shape[0],):
        raise ValueError(f"weight_scale must be float32 of shape ({weight.shape[0]},), one per weight row; got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    elif not weight_scale.is_contiguous() or weight_scale.device != weight.device:
        raise ValueError(f"weight_scale must be contiguous and on the weight's device ({weight.device}); got "
                         f"{'' if weight_scale.is_contiguous() else 'non-contiguous, '}{weight_scale.device}")
    gated = silu or gelu
    if gated and (bias is not None or weight.shape[0] % 2):
        raise ValueError("silu and gelu need an even number of weight rows [gate | up] and no bias")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    persistent = isinstance(config, Persistent)
    if mma:
        block_n, block_k, num_warps = config.block_n, config.block_k, config.num_warps
        if rotary is not None:
            raise ValueError(f"{config} has no rotary epilogue: use a one-shot configuration")
        if isinstance(config, Fp8Mma) and weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{config} takes FP8 weights (with their scales), got {weight.dtype}")
        if isinstance(config, Mma) and weight.dtype != x.dtype:
            raise ValueError(f"{config} takes weights of x's dtype ({x.dtype}), got {weight.dtype}")
    elif persistent:
        block_n, num_warps, block_k = config.block_n, config.num_warps, triton.next_power_of_2(k)
        if rotary is not None:
            raise ValueError(f"{config} has no rotary epilogue: use a one-shot configuration")
        if m * block_k > PERSISTENT_MAX_ELEMENTS:
            raise ValueError(f"{config}: {m} rows x K {k} exceed the {PERSISTENT_MAX_ELEMENTS} input elements a "
                             f"persistent program holds")
    else:
        block_n, block_k, num_warps, *one_pass = config
    if rotary is not None:
        r = rotary
        half = r.head_dim // 2
        if gated or r.head_dim % 2 or half % block_n or n != (r.num_heads + 2 * r.num_kv_heads) * r.head_dim:
            raise ValueError(f"rotary needs q/k/v rows ({r.num_heads} + 2 x {r.num_kv_heads}) x {r.head_dim}, no silu "
                             f"and half a head a multiple of BLOCK_N {block_n}; weight has {n} rows")
        if r.cos_cache.shape[-1] != r.head_dim or r.sin_cache.shape != r.cos_cache.shape:
            raise ValueError(f"cos/sin tables {tuple(r.cos_cache.shape)} must cover the whole head ({r.head_dim})")
        out = torch.empty((*x.shape[:-1], r.num_heads, r.head_dim), dtype=x.dtype, device=x.device)
        k_slots = r.k_cache.view(-1, r.num_kv_heads, r.head_dim)
        v_slots = r.v_cache.view(-1, r.num_kv_heads, r.head_dim)
        if k_slots.stride(2) != 1 or v_slots.stride(2) != 1 or k_slots.dtype != v_slots.dtype:
            raise ValueError("the K and V caches must be contiguous along head_dim and share a dtype")
        positions, slots = r.positions.contiguous(), r.slot_mapping.contiguous()
        cos_cache, sin_cache = r.cos_cache.contiguous(), r.sin_cache.contiguous()
    if weight_block_scales is not None and gated and n % block_n:
        raise ValueError(f"block scales under silu need I ({n}) a multiple of BLOCK_N {block_n}: an up strip "
                         f"would straddle two tile rows")
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
    pdl_on = pdl.enabled(x.device)
    if mma:
        out_rows = out.view(-1, n)
        compile_ahead.launch(
            _gemv_mma_kernel, (triton.cdiv(n, block_n),),
            rows, residual_rows, residual_out_rows, norm_weight if norm_weight is not None else weight, weight,
            weight_scale if weight_scale is not None else weight, bias if bias is not None else weight, out_rows,
            n, k, n if silu else 0,
            rows.stride(0), residual_rows.stride(0), residual_out_rows.stride(0), weight.stride(0),
            out_rows.stride(0), float(eps),
            ROWS=m, NORM=norm_weight is not None, ADD_RESIDUAL=norm_weight is not None and residual is not None,
            SILU=silu, HAS_BIAS=bias is not None, LIBDEVICE=not interpreting(), BLOCK_N=block_n, BLOCK_K=block_k,
            PDL=pdl_on, NUM_STAGES=config.num_stages, DOT_F32=interpreting(), QUANT=isinstance(config, Fp8Mma),
            W_SCALE=weight_scale is not None, FP8_MAX=_FP8_MAX,
            MIN_SCALE=_FP8_MIN_SCALE, num_warps=num_warps, **pdl.launch_options(pdl_on))
        return out, residual_out
    if persistent:
        out_rows = out.view(-1, n)
        programs = min(triton.cdiv(n, block_n), _multiprocessors(x.device) * config.per_sm)
        args = (rows, residual_rows, residual_out_rows, norm_weight if norm_weight is not None else weight, weight,
                weight_scale if weight_scale is not None else weight, bias if bias is not None else weight, out_rows,
                n, k, n if gated else 0,
                rows.stride(0), residual_rows.stride(0), residual_out_rows.stride(0), weight.stride(0),
                out_rows.stride(0), float(eps), x_norm_weight if x_norm_weight is not None else weight)
        meta = dict(ROWS=m, NORM=norm_weight is not None, ADD_RESIDUAL=norm_weight is not None and residual is not None,
                    SILU=gated, HAS_BIAS=bias is not None, LIBDEVICE=not interpreting(), BLOCK_N=block_n,
                    BLOCK_K=block_k, PDL=pdl_on, W_SCALE=weight_scale is not None, NORM_X=x_norm_weight is not None,
                    UNIT_OFFSET=unit_offset, GELU=gelu, num_warps=num_warps, **pdl.launch_options(pdl_on))
        spills = spilled_registers(args, meta, (x.dtype, weight.dtype, n, k, x.device))
        if spills:
            raise ValueError(f"{config} spills {spills} registers at {m} rows x K {k}: refused (a spilling kernel "
                             f"makes the driver reserve local memory for every resident thread)")
        compile_ahead.launch(_gemv_persistent_kernel, (programs,), *args, **meta)
        return out, residual_out
    scales = weight if weight_scale is None and weight_block_scales is None else (
        weight_scale if weight_block_scales is None else weight_block_scales.scales)
    if rotary is None:
        out_rows = out.view(-1, n)
        grid = triton.cdiv(n, block_n)
        up_offset = n if gated else 0
        positions = slots = cos_cache = sin_cache = k_slots = v_slots = weight  # unused pointers
        stride_cos = stride_sin = stride_kc_slot = stride_kc_h = stride_vc_slot = stride_vc_h = 0
        heads = (0, 0, 0)
    else:
        out_rows = out.view(m, -1)
        grid = (n // rotary.head_dim) * (half // block_n)
        up_offset = half
        stride_cos, stride_sin = cos_cache.stride(0), sin_cache.stride(0)
        stride_kc_slot, stride_kc_h = k_slots.stride(0), k_slots.stride(1)
        stride_vc_slot, stride_vc_h = v_slots.stride(0), v_slots.stride(1)
        heads = (rotary.num_heads, rotary.num_kv_heads, rotary.head_dim)
    compile_ahead.launch(
        _gemv_kernel, (grid,),
        rows, residual_rows, residual_out_rows,
        norm_weight if norm_weight is not None else weight, weight,
        scales, bias if bias is not None else weight, out_rows,
        positions, slots, cos_cache, sin_cache, k_slots, v_slots,
        n, k, up_offset,
        rows.stride(0), residual_rows.stride(0), residual_out_rows.stride(0), weight.stride(0), out_rows.stride(0),
        scales.stride(0),
        stride_cos, stride_sin, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
        heads[0], heads[1],
        float(eps),
        ROWS=m,
        NORM=norm_weight is not None,
        ADD_RESIDUAL=norm_weight is not None and residual is not None,
        SILU=gated,
        HAS_BIAS=bias is not None,
        LIBDEVICE=not interpreting(),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl_on,
        ONE_PASS=bool(one_pass and one_pass[0]) and norm_weight is not None,
        ROPE=rotary is not None,
        HEAD_DIM=max(2, heads[2]),
        KV_SATURATE=saturation_limit(k_slots.dtype) if rotary is not None else 0.0,
        W_SCALE=weight_scale is not None,
        W_BLOCK_ROWS=weight_block_scales.rows if weight_block_scales is not None else 1,
        W_BLOCK_COLS=weight_block_scales.cols if weight_block_scales is not None else 0,
        x_norm_weight_ptr=x_norm_weight if x_norm_weight is not None else weight,
        NORM_X=x_norm_weight is not None,
        UNIT_OFFSET=unit_offset,
        GELU=gelu,
        num_warps=num_warps,
        **pdl.launch_options(pdl_on),
    )
    return out, residual_out


__all__ = ["AVAILABLE", "BlockScales", "takes_block_scales", "CONFIGS", "FP8_CONFIGS", "FP8_MMA_CONFIGS", "Fp8Mma", "MMA_CONFIGS", "MMA_MAX_ROWS", "Mma", "supports_rotary", "FP8_NORM_CONFIGS", "MAX_ROWS", "takes_gemma_forms", "NORM_CONFIGS", "configs_for", "PERSISTENT_MAX_ELEMENTS", "Persistent", "RotaryKV",
           "small_batch_linear"]
