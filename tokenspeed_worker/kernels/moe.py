"""The experts of a mixture-of-experts layer as grouped GEMMs (Triton), with no host sync:

    align_by_expert(ids, num_experts, block_m)  # torch ops on the device
    grouped_gemm(x, w, sorted_ids, block_experts, top_k, ...)  # one Triton kernel
    fused_experts(x, w13, w2, weights, ids)     # gate/up, SiLU * up, down x routing weight, sum

`align_by_expert` sorts the T x top_k (token, choice) pairs by expert and pads each expert's run to
a multiple of block_m, into a buffer of the worst-case size (T * top_k + E * (block_m - 1)): slot
-> pair index (T * top_k marks padding), and block -> expert (-1 past the last used block). The
sizes depend only on T, so a CUDA graph captures the whole step.

`grouped_gemm` gives each program one block of block_m pairs (one expert) and one tile of N: the
pairs' token rows of x (pair // top_k) times the expert's weight, written at the pairs' rows of
the output [T * top_k, N]; the down projection multiplies each row by its routing weight in the
epilogue. Padding slots and unused blocks load and store nothing. FP8 experts (`ExpertScales`):
each weight tile is widened exactly to the activations' dtype and each K step's product scaled per
output column by its tile's scale (weight-only FP8: half the bytes a decode step reads). This is the shape of vLLM's and
SGLang's fused_moe Triton kernel; a decode step (few tokens) reads only the chosen experts' tiles.

Importable without triton: AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    AVAILABLE = False


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [P], block_experts int32 [P / block_m]) for ids [T, top_k] (module
    docstring), P = T * top_k + num_experts * (block_m - 1) rounded up to block_m."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount reads the largest id back to the host (no graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # each expert's first slot
    first_of_expert = torch.cumsum(counts, 0) - counts  # its first pair in `order`
    sorted_experts = flat[order]
    slots = starts[sorted_experts] + torch.arange(pairs, device=ids.device) - first_of_expert[sorted_experts]
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[slots] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    ends = starts + padded
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    block_experts = torch.where(block_starts < ends[-1], block_experts, -1)
    return sorted_ids, block_experts


if AVAILABLE:

    @triton.jit
    def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, weights_ptr, scale_ptr,
                             N, K, num_pairs, stride_x, stride_we, stride_wn, stride_out, stride_se, stride_sr,
                             TOP_K: tl.constexpr, MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             W_FP8: tl.constexpr = False, SCALE_ROWS: tl.constexpr = 1,
                             SCALE_COLS: tl.constexpr = 1):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_experts_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pairs < num_pairs
        tokens = (pairs // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + tokens[:, None] * stride_x
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # FP8 weights (W_FP8): tiles of SCALE_ROWS x SCALE_COLS share a scale; a K step
        # lies in one column group (BLOCK_K divides SCALE_COLS), so its product is scaled per
        # output column once, the weight tile widened exactly to the activations' dtype.
        scale_rows = scale_ptr + expert.to(tl.int64) * stride_se + (offs_n // SCALE_ROWS) * stride_sr
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if W_FP8:
                s = tl.load(scale_rows + k0 // SCALE_COLS, mask=n_ok, other=0.0)
                acc += tl.dot(a, tl.trans(b.to(a.dtype)), input_precision=DOT_PRECISION) * s[None, :]
            else:
                acc += tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION)
        if MUL_WEIGHTS:
            acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
        out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


def _block_m(pairs: int) -> int:
    """Pairs per block: few for decode (each expert sees a token or two), more for prefill."""
    return 16 if pairs <= 64 else 32 if pairs <= 1024 else 64


class ExpertScales(NamedTuple):
    """FP8 expert weights' scales: scales[e, i, j] (float32, contiguous) multiplies expert e's rows
    [i * rows, (i + 1) * rows) and columns [j * cols, (j + 1) * cols)."""

    scales: torch.Tensor
    rows: int
    cols: int


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_experts: torch.Tensor,
                 top_k: int, block_m: int, weights: torch.Tensor | None = None, zero: bool = False,
                 w_scales: ExpertScales | None = None) -> torch.Tensor:
    """out [T * top_k, N]: row p = x[p // top_k] @ w[expert of p]^T (times weights.flatten()[p]
    when given); x [T, K] and w [E, N, K] contiguous along K, w float8 e4m3 with w_scales (whose
    column groups are a multiple of 16 wide or span K). Rows of pairs in no computed block are
    left unwritten, or zero with `zero`."""
    pairs = x.shape[0] * top_k
    n, k = w.shape[1], w.shape[2]
    out = (torch.zeros if zero else torch.empty)((pairs, n), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    scale_rows, scale_cols, scales, stride_se, stride_sr = 1, 1, x, 0, 0
    if w_scales is not None:
        scales, scale_rows = w_scales.scales, w_scales.rows
        scale_cols = w_scales.cols if w_scales.cols < k else 1 << 30  # one group spanning K
        while scale_cols % block_k:  # a K step within one column group
            block_k //= 2
        if block_k < 16:
            raise ValueError(f"grouped_gemm: FP8 scale groups of {w_scales.cols} columns (a multiple of 16 is needed)")
        stride_se, stride_sr = scales.stride(0), scales.stride(1)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, w, out, sorted_ids, block_experts, weights if weights is not None else x, scales,
        n, k, pairs, x.stride(0), w.stride(0), w.stride(1), out.stride(0), stride_se, stride_sr,
        TOP_K=top_k, MUL_WEIGHTS=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32: exact products, not TF32
        W_FP8=w_scales is not None, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, num_warps=4, num_stages=3)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, foreign: bool = False, w13_scales: ExpertScales | None = None,
                  w2_scales: ExpertScales | None = None) -> torch.Tensor:
    """sum over the top_k choices of weight * down_e(silu(gate_e x) * up_e x), [T, H]: x [T, H],
    w13 [E, 2 I, H] (gate rows, then up rows), w2 [E, H, I], weights float32 and ids [T, top_k];
    FP8 weights with their scales (grouped_gemm). foreign: ids may also hold E, a choice of an
    expert another rank holds (expert parallelism), which adds nothing here: its pairs are sorted
    into blocks no program computes."""
    tokens, top_k = ids.shape
    experts = w13.shape[0]
    block_m = _block_m(tokens * top_k)
    sorted_ids, block_experts = align_by_expert(ids, experts + 1 if foreign else experts, block_m)
    if foreign:
        block_experts = torch.where(block_experts == experts, -1, block_experts)
    gate_up = grouped_gemm(x, w13, sorted_ids, block_experts, top_k, block_m, w_scales=w13_scales)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up  # [T * top_k, I], one row per (token, choice)
    down = grouped_gemm(hidden, w2, sorted_ids, block_experts, 1, block_m, weights.reshape(-1).contiguous(),
                        zero=foreign, w_scales=w2_scales)
    return down.view(tokens, top_k, -1).sum(dim=1)


__all__ = ["AVAILABLE", "align_by_expert", "fused_experts", "grouped_gemm"]
