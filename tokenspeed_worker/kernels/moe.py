"""The experts of a mixture-of-experts layer as grouped GEMMs (Triton), with no host sync:

    align_by_expert(ids, num_experts, block_m)  # three Triton kernels and two fills
    grouped_gemm(x, w, sorted_ids, block_experts, top_k, ...)  # one Triton kernel
    fused_experts(x, w13, w2, weights, ids)     # gate/up, SiLU * up, down x routing weight, sum

`align_by_expert` sorts the T x top_k (token, choice) pairs by expert and pads each expert's run to
a multiple of block_m, into a buffer of the worst-case size (T * top_k + E * (block_m - 1)): slot
-> pair index (T * top_k marks padding), and block -> expert (-1 past the last used block). The
sizes depend only on T, so a CUDA graph captures the whole step.

`grouped_gemm` gives each program one block of block_m pairs (one expert) and one tile of N: the
pairs' token rows of x (pair // top_k) times the expert's weight, written at the pairs' rows of
the output [T * top_k, N]; the down projection multiplies each row by its routing weight in the
epilogue; the programs take GROUP_M blocks at a time through all their column tiles, so those
blocks' rows and weight tiles are read from L2. Padding slots and unused blocks load and store
nothing. FP8 experts (`ExpertScales`):
each weight tile is widened exactly to the activations' dtype and each K step's product scaled per
output column by its tile's scale (weight-only FP8: half the bytes a decode step reads). This is the shape of vLLM's and
SGLang's fused_moe Triton kernel; a decode step (few tokens) reads only the chosen experts' tiles.

Decode steps may skip the sort (at most SMALL_PAIRS pairs; the model runner times both ways
and the strip configurations of `decode_configs`, layers/small_batch_gemv.py; without it, no more
pairs than experts, so that few experts are chosen twice): `small_experts` runs one kernel that
gives each program one pair and a strip of its expert's gate and up rows and writes
silu(gate) * up, then one that gives each program one token and a strip of the output columns and
sums its top_k experts' down products, each times its routing weight, so the layer's output
leaves in one store. Both read the weight strip with 16-byte vector loads on the CUDA cores, the
next tile loaded before the current one is multiplied, as the dense small-batch GEMV does
(kernels/gemv.py): at a few tokens a product is bound by the chosen experts' bytes, and padding
pairs to tensor-core tiles or sorting them costs more than it saves. `route` is the router's
softmax, top-k and renormalization in one kernel, one program per token. The route and decode
kernels launch with PDL (kernels/pdl.py) where it is on: each waits for its predecessor before
reading anything (what they read is the routing, just computed), so PDL only hides their launch
and ramp behind the previous kernel's tail.

Importable without triton: AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from tokenspeed_worker.kernels import pdl
from tokenspeed_worker.kernels.activation import silu_and_mul

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
    docstring), P = T * top_k + num_experts * (block_m - 1) rounded up to block_m. Two fills and
    three kernels: the experts' pair counts (a histogram per chunk of pairs, added up with atomics),
    one program placing the experts' runs, then the pairs scattered into them. The pairs' order
    within an expert's run is whatever the atomics give, which changes no result (each output row
    is its own pair's product)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    cursors = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)  # the counts, then the runs' starts
    block_e = triton.next_power_of_2(num_experts + 1)
    chunks = triton.cdiv(pairs, ALIGN_CHUNK)
    if chunks:
        _align_count_kernel[(chunks,)](flat, cursors, pairs, num_experts, BLOCK_E=block_e, CHUNK=ALIGN_CHUNK,
                                       num_warps=4)
    _align_runs_kernel[(1,)](cursors, block_experts, num_experts, block_experts.numel(), BLOCK_M=block_m,
                             BLOCK_E=block_e, BLOCK_B=64, num_warps=4)
    if chunks:
        _align_scatter_kernel[(chunks,)](flat, cursors, sorted_ids, pairs, CHUNK=ALIGN_CHUNK, num_warps=4)
    return sorted_ids, block_experts


# Pairs per program of the sort's count and scatter kernels.
ALIGN_CHUNK = 1024


if AVAILABLE:

    @triton.jit
    def _align_count_kernel(ids_ptr, counts_ptr, pairs, num_experts, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
        # One chunk of pairs: its experts' histogram (past the end counts in the spare bin
        # num_experts), added to the counts. Parallel over chunks: a single program walking every
        # chunk made the sort a sizeable part of a long prefill's MoE layer.
        p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        experts = tl.load(ids_ptr + p, mask=p < pairs, other=num_experts).to(tl.int32)
        e = tl.arange(0, BLOCK_E)
        tl.atomic_add(counts_ptr + e, tl.histogram(experts, BLOCK_E), mask=e < num_experts)

    @triton.jit
    def _align_runs_kernel(cursors_ptr, block_experts_ptr, num_experts, num_blocks,
                           BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
        # One program: each expert's pair count (cursors, as _align_count_kernel left them), its
        # run padded to BLOCK_M, the runs' starts (written over the counts: the scatter's cursors)
        # and each block's expert (-1 past the last run).
        e = tl.arange(0, BLOCK_E)
        real = e < num_experts
        counts = tl.load(cursors_ptr + e, mask=real, other=0)
        padded = tl.where(real, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        ends = tl.cumsum(padded, 0)
        tl.store(cursors_ptr + e, ends - padded, mask=real)
        used = tl.sum(padded, axis=0)
        for b0 in range(0, num_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            slot = b * BLOCK_M
            # the block's expert: how many runs end at or before its first slot
            expert = tl.sum(((ends[None, :] <= slot[:, None]) & real[None, :]).to(tl.int32), axis=1)
            tl.store(block_experts_ptr + b, tl.where(slot < used, expert, -1), mask=b < num_blocks)

    @triton.jit
    def _align_scatter_kernel(ids_ptr, cursors_ptr, sorted_ids_ptr, pairs, CHUNK: tl.constexpr):
        # Each pair takes the next slot of its expert's run.
        p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = p < pairs
        experts = tl.load(ids_ptr + p, mask=ok, other=0)
        slots = tl.atomic_add(cursors_ptr + experts, 1, mask=ok)
        tl.store(sorted_ids_ptr + slots, p.to(tl.int32), mask=ok)

    @triton.jit
    def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, weights_ptr, scale_ptr,
                             N, K, num_pairs, stride_x, stride_we, stride_wn, stride_out, stride_se, stride_sr,
                             TOP_K: tl.constexpr, MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             GROUP_M: tl.constexpr, W_FP8: tl.constexpr = False, SCALE_ROWS: tl.constexpr = 1,
                             SCALE_COLS: tl.constexpr = 1):
        # One axis of programs, GROUP_M blocks (mostly of one expert) through all their column tiles
        # before the next GROUP_M, so that those blocks' gathered rows and their expert's weight
        # tiles come from L2 rather than from memory again for each column tile.
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        num_m = tl.num_programs(0) // n_tiles
        in_group = GROUP_M * n_tiles
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_rows
        pid_n = (pid % in_group) // group_rows
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


    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
                      TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                      RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
        # One token: softmax in float32 over its experts, then TOP_K rounds of "take the largest,
        # lowest index first among equals", then the chosen weights renormalized to sum to 1.
        if PDL:  # kernels/pdl.py: everything here depends on the router's logits
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        token = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < num_experts
        logits = tl.load(logits_ptr + token.to(tl.int64) * stride_logits + offs, mask=ok,
                         other=-float("inf")).to(tl.float32)
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(ok, p, -1.0)  # never chosen
        slots = tl.arange(0, TOP_K_POW2)
        chosen = tl.zeros([TOP_K_POW2], dtype=tl.float32)
        chosen_ids = tl.zeros([TOP_K_POW2], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
            chosen = tl.where(slots == j, best, chosen)
            chosen_ids = tl.where(slots == j, idx, chosen_ids)
            p = tl.where(offs == idx, -1.0, p)
        if RENORMALIZE:
            chosen = chosen / tl.sum(chosen, axis=0)
        out = token.to(tl.int64) * TOP_K + slots
        tl.store(weights_ptr + out, chosen, mask=slots < TOP_K)
        tl.store(ids_ptr + out, chosen_ids, mask=slots < TOP_K)

    @triton.jit
    def _expert_gate_up_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, out_ptr, I, K, num_experts,
                               stride_x, stride_we, stride_wn, stride_out, stride_se, stride_sr,
                               TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               W_FP8: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                               COL_SCALES: tl.constexpr, PDL: tl.constexpr):
        # One pair (token, choice) and BLOCK_N of its expert's gate rows with the matching up
        # rows: out[pair, n] = silu(gate_n . x) * (up_n . x). A foreign expert (id >= the experts
        # held here) writes nothing: expert_down skips it too.
        if PDL:  # which weights to read depends on the routing just computed: wait first
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(ids_ptr + pair)
        if expert >= num_experts:
            return
        x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        base = w_ptr + expert.to(tl.int64) * stride_we
        gate_rows = base + offs_n.to(tl.int64)[:, None] * stride_wn
        up_rows = base + (I + offs_n).to(tl.int64)[:, None] * stride_wn
        first_mask = n_ok[:, None] & (offs_k < K)[None, :]
        g_next = tl.load(gate_rows + offs_k[None, :], mask=first_mask, other=0.0)
        u_next = tl.load(up_rows + offs_k[None, :], mask=first_mask, other=0.0)
        # FP8: row scales (a column group spanning K) multiply the sums at the end; block scales
        # (COL_SCALES: the strip lies in one row group, the host checks it) scale x per K step.
        scales = scale_ptr + expert.to(tl.int64) * stride_se
        gate_scale_row = scales + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sr
        up_scale_row = scales + ((I + pid_n * BLOCK_N) // SCALE_ROWS) * stride_sr
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            g = g_next.to(tl.float32)
            u = u_next.to(tl.float32)
            next_mask = n_ok[:, None] & (kk + BLOCK_K < K)[None, :]
            g_next = tl.load(gate_rows + (kk + BLOCK_K)[None, :], mask=next_mask, other=0.0)
            u_next = tl.load(up_rows + (kk + BLOCK_K)[None, :], mask=next_mask, other=0.0)
            x = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            if COL_SCALES:
                x_gate = x * tl.load(gate_scale_row + kk // SCALE_COLS, mask=k_ok, other=0.0)
                x_up = x * tl.load(up_scale_row + kk // SCALE_COLS, mask=k_ok, other=0.0)
                gate += tl.sum(g * x_gate[None, :], axis=1)
                up += tl.sum(u * x_up[None, :], axis=1)
            else:
                gate += tl.sum(g * x[None, :], axis=1)
                up += tl.sum(u * x[None, :], axis=1)
        if W_FP8 and not COL_SCALES:
            gate *= tl.load(scales + (offs_n // SCALE_ROWS) * stride_sr, mask=n_ok, other=0.0)
            up *= tl.load(scales + ((I + offs_n) // SCALE_ROWS) * stride_sr, mask=n_ok, other=0.0)
        hidden = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n, hidden.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _expert_down_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, weights_ptr, out_ptr, N, K, num_experts,
                            stride_h, stride_we, stride_wn, stride_out, stride_se, stride_sr,
                            TOP_K: tl.constexpr, CHOICES: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, W_FP8: tl.constexpr, SCALE_ROWS: tl.constexpr,
                            SCALE_COLS: tl.constexpr, COL_SCALES: tl.constexpr, PDL: tl.constexpr):
        # One token and BLOCK_N output columns: sum over its TOP_K choices of weight *
        # (down_e rows . h[pair]). Each K step loads every choice's tile at once ([CHOICES,
        # BLOCK_N, BLOCK_K], CHOICES = TOP_K rounded up to a power of two, the spare ones masked):
        # the grid is only the token's output columns, so a program walking the choices one tile at
        # a time kept too few bytes in flight. Foreign experts' loads are masked off.
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        token = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        c = tl.arange(0, CHOICES)
        pairs = token.to(tl.int64) * TOP_K + c
        experts = tl.load(ids_ptr + pairs, mask=c < TOP_K, other=num_experts)
        mine = (c < TOP_K) & (experts < num_experts)
        factors = tl.load(weights_ptr + pairs, mask=mine, other=0.0).to(tl.float32)
        w_rows = (w_ptr + experts.to(tl.int64)[:, None, None] * stride_we
                  + offs_n.to(tl.int64)[None, :, None] * stride_wn)
        h_rows = h_ptr + pairs[:, None] * stride_h
        expert_scales = scale_ptr + experts.to(tl.int64) * stride_se
        w_mask = mine[:, None, None] & n_ok[None, :, None]
        acc = tl.zeros([CHOICES, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            w = tl.load(w_rows + kk[None, None, :], mask=w_mask & k_ok[None, None, :], other=0.0).to(tl.float32)
            h = tl.load(h_rows + kk[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if COL_SCALES:
                h *= tl.load(expert_scales[:, None] + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sr
                             + (kk // SCALE_COLS)[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w * h[:, None, :], axis=2)
        if W_FP8 and not COL_SCALES:
            acc *= tl.load(expert_scales[:, None] + (offs_n // SCALE_ROWS)[None, :] * stride_sr,
                           mask=mine[:, None] & n_ok[None, :], other=0.0)
        out = tl.sum(acc * factors[:, None], axis=0)
        tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


# The grouped GEMM's program order (_grouped_gemm_kernel): this many blocks through all their column
# tiles at a time. Against the order it replaced (every block's first column tile, then every
# block's second), 7 to 30 % less time for each of six tile shapes at Qwen3-30B-A3B's 4,096- and
# 16,384-token prefills on an H100 (docs/benchmarks.md, seventeenth session).
GROUP_M = 8


class GroupedConfig(NamedTuple):
    """The grouped GEMM's tiles: block_m pairs (the sort pads each expert's run to it) x block_n
    output columns, block_k per K step; num_warps, num_stages (software pipelining depth)."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def _grouped_config(pairs: int) -> GroupedConfig:
    """Pairs per block: few for decode (each expert sees a token or two), more for prefill."""
    return GroupedConfig(16 if pairs <= 64 else 32 if pairs <= 1024 else 64)


# Tuned tiles. A tuning run on a GPU (scripts/bench_moe.py --tune) times every one of
# GROUPED_CANDIDATES at each of TUNED_PAIRS for one layer's shape and keeps the fastest that agrees
# with the default tiles, as {tiles_key(...)/pairs: tiles_text(config)} in the cache folder's
# kernel_cache.MOE_FILE (the package ships them per GPU model, as the other kernel choices); a
# layer takes those of its shape (layers/moe.FusedMoE.take_tuned_tiles) and a step the ones tuned
# at the pair count nearest its own (`nearest_tiles`); without any, `_grouped_config`.
# The candidates: the defaults, and the shapes of vLLM's tuned fused_moe tables for Hopper.
GROUPED_CANDIDATES = (
    GroupedConfig(16), GroupedConfig(32), GroupedConfig(64),
    GroupedConfig(16, 64, 128, 4, 4), GroupedConfig(32, 64, 128, 4, 4), GroupedConfig(64, 64, 64, 4, 3),
    GroupedConfig(64, 128, 64, 4, 4), GroupedConfig(64, 128, 128, 8, 3), GroupedConfig(128, 64, 64, 4, 4),
    GroupedConfig(128, 128, 64, 8, 4), GroupedConfig(128, 256, 64, 8, 3),
)
# (tokens x top_k) pair counts a tuning run times: from a decode step past the decode kernels
# (SMALL_PAIRS) to a 16k-token prefill at top-8.
TUNED_PAIRS = tuple(1 << i for i in range(5, 18))


def tiles_key(experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> str:
    """The stored key's shape part for experts [experts, 2 intermediate, hidden] of dtype (one
    rank's: its experts and intermediate rows)."""
    return f"{experts}/{hidden}/{intermediate}/{str(dtype).removeprefix('torch.')}"


def tiles_text(config: GroupedConfig) -> str:
    return ",".join(str(v) for v in config)


def parse_tiles(text: str) -> GroupedConfig | None:
    """A stored tiles_text back as tiles, or None where it is not one (five powers of two, block_m
    16 to 128: what the sort's padding and the kernel take)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        return None
    if len(values) != 5 or any(v <= 0 or v & (v - 1) for v in values[:4]) or values[4] <= 0:
        return None
    config = GroupedConfig(*values)
    return config if 16 <= config.block_m <= 128 and config.block_n >= 16 and config.block_k >= 16 else None


def nearest_tiles(tuned: dict[int, GroupedConfig], pairs: int) -> GroupedConfig | None:
    """The tiles tuned at the pair count nearest `pairs` (by ratio), or None where none are."""
    if not tuned:
        return None
    return tuned[min(tuned, key=lambda p: (abs(math.log2(p / max(pairs, 1))), p))]


class ExpertScales(NamedTuple):
    """FP8 expert weights' scales: scales[e, i, j] (float32, contiguous) multiplies expert e's rows
    [i * rows, (i + 1) * rows) and columns [j * cols, (j + 1) * cols)."""

    scales: torch.Tensor
    rows: int
    cols: int


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_experts: torch.Tensor,
                 top_k: int, block_m: int, weights: torch.Tensor | None = None, zero: bool = False,
                 w_scales: ExpertScales | None = None, config: GroupedConfig | None = None) -> torch.Tensor:
    """out [T * top_k, N]: row p = x[p // top_k] @ w[expert of p]^T (times weights.flatten()[p]
    when given); x [T, K] and w [E, N, K] contiguous along K, w float8 e4m3 with w_scales (whose
    column groups are a multiple of 16 wide or span K). Rows of pairs in no computed block are
    left unwritten, or zero with `zero`."""
    pairs = x.shape[0] * top_k
    n, k = w.shape[1], w.shape[2]
    out = (torch.zeros if zero else torch.empty)((pairs, n), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    config = config or GroupedConfig(block_m)
    block_n = config.block_n if n >= config.block_n else max(16, triton.next_power_of_2(n))
    block_k = config.block_k if k >= config.block_k else max(16, triton.next_power_of_2(k))
    scale_rows, scale_cols, scales, stride_se, stride_sr = 1, 1, x, 0, 0
    if w_scales is not None:
        scales, scale_rows = w_scales.scales, w_scales.rows
        scale_cols = w_scales.cols if w_scales.cols < k else 1 << 30  # one group spanning K
        while scale_cols % block_k:  # a K step within one column group
            block_k //= 2
        if block_k < 16:
            raise ValueError(f"grouped_gemm: FP8 scale groups of {w_scales.cols} columns (a multiple of 16 is needed)")
        stride_se, stride_sr = scales.stride(0), scales.stride(1)
    grid = (block_experts.numel() * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        x, w, out, sorted_ids, block_experts, weights if weights is not None else x, scales,
        n, k, pairs, x.stride(0), w.stride(0), w.stride(1), out.stride(0), stride_se, stride_sr,
        TOP_K=top_k, MUL_WEIGHTS=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32: exact products, not TF32
        W_FP8=w_scales is not None, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, GROUP_M=GROUP_M,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int32 [T, top_k]) of router logits [T, E]: the
    softmax's top_k (lowest index first among equal probabilities), renormalized to sum to 1
    where asked; layers/moe.select_experts computes the same in torch."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 TOP_K_POW2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
                                 RENORMALIZE=renormalize, num_warps=1 if experts <= 128 else 4,
                                 **_pdl(logits.device))
    return weights, ids


# At most this many (token, choice) pairs, and no more than the experts, take the decode kernels
# (module docstring): past either, experts chosen by several tokens are read once per token and
# the grouped GEMM's one read per block wins (docs/benchmarks.md, bench_moe.py).
SMALL_PAIRS = 128


class GemvConfig(NamedTuple):
    """A decode kernel's strip: BLOCK_N weight rows, BLOCK_K columns per load, num_warps."""

    block_n: int
    block_k: int
    num_warps: int


def decode_configs(weight: torch.Tensor) -> tuple[tuple[GemvConfig, GemvConfig], ...]:
    """(gate/up, down) strip configurations worth timing for experts of weight's dtype, the default
    first: the fastest pairs at one to sixteen tokens for the Qwen3-30B-A3B and Mixtral-8x7B shapes
    (bench_moe.py --configs)."""
    default = (_gemv_config(weight, down=False), _gemv_config(weight, down=True))
    if weight.element_size() == 1:
        others = [(GemvConfig(8, 256, 4), GemvConfig(4, 1024, 8)), (GemvConfig(16, 256, 4), GemvConfig(16, 256, 4))]
    else:
        others = [(GemvConfig(16, 256, 4), GemvConfig(4, 1024, 4)), (GemvConfig(8, 256, 4), GemvConfig(8, 256, 4))]
    return (default, *others)


def _gemv_config(weight: torch.Tensor, down: bool) -> GemvConfig:
    """The strips timed fastest at one to four tokens for the Qwen3-30B-A3B and Mixtral-8x7B
    shapes (bench_moe.py --configs): gate/up in strips of 8 rows (16 for FP8), 256 columns per
    step; down, whose grid is the tokens' output columns alone, in narrow strips of long steps
    (every choice's tile at once: 8 warps for FP8's 8-row strips, which spill at 4)."""
    fp8 = weight.element_size() == 1
    if down:
        return GemvConfig(8 if fp8 else 4, 1024, 8 if fp8 else 4)
    return GemvConfig(16 if fp8 else 8, 256, 4)


def _scale_args(w: torch.Tensor, w_scales: ExpertScales | None, block_n: int, strip_offset: int = 0):
    """(scales, stride_se, stride_sr, rows, cols, col_scales) for the decode kernels, or None where
    a strip of block_n rows would straddle two row groups of block scales (the grouped GEMM then)."""
    if w_scales is None:
        return w, 0, 0, 1, 1, False
    sc = w_scales.scales
    col_scales = w_scales.cols < w.shape[2]
    if col_scales and (w_scales.rows % block_n or strip_offset % block_n):
        return None
    return sc, sc.stride(0), sc.stride(1), w_scales.rows, w_scales.cols if col_scales else 1, col_scales


def small_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w13_scales: ExpertScales | None = None, w2_scales: ExpertScales | None = None,
                  gate_up_config: GemvConfig | None = None, down_config: GemvConfig | None = None
                  ) -> torch.Tensor | None:
    """fused_experts' result by the decode kernels (module docstring), or None where FP8 block
    scales do not fit their strips. ids >= E (foreign experts) add nothing."""
    tokens, top_k = ids.shape
    experts, inter, hidden = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    gate_up_config = gate_up_config or _gemv_config(w13, down=False)
    down_config = down_config or _gemv_config(w2, down=True)
    gate_up_scales = _scale_args(w13, w13_scales, gate_up_config.block_n, inter)
    down_scales = _scale_args(w2, w2_scales, down_config.block_n)
    if gate_up_scales is None or down_scales is None:
        return None
    ids = ids.contiguous()
    hidden_rows = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    sc, se, sr, rows, cols, col_scales = gate_up_scales
    _expert_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up_config.block_n))](
        x, w13, sc, ids, hidden_rows, inter, hidden, experts, x.stride(0), w13.stride(0), w13.stride(1),
        hidden_rows.stride(0), se, sr, TOP_K=top_k, BLOCK_N=gate_up_config.block_n, BLOCK_K=gate_up_config.block_k,
        W_FP8=w13_scales is not None, SCALE_ROWS=rows, SCALE_COLS=cols, COL_SCALES=col_scales,
        num_warps=gate_up_config.num_warps, **_pdl(x.device))
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    sc, se, sr, rows, cols, col_scales = down_scales
    _expert_down_kernel[(tokens, triton.cdiv(hidden, down_config.block_n))](
        hidden_rows, w2, sc, ids, weights.contiguous(), out, hidden, inter, experts, hidden_rows.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), se, sr, TOP_K=top_k, CHOICES=triton.next_power_of_2(top_k),
        BLOCK_N=down_config.block_n,
        BLOCK_K=down_config.block_k, W_FP8=w2_scales is not None, SCALE_ROWS=rows, SCALE_COLS=cols,
        COL_SCALES=col_scales, num_warps=down_config.num_warps, **_pdl(x.device))
    return out


def _pdl(device: torch.device) -> dict:
    """The PDL constexpr and launch option of the route and decode-expert kernels (kernels/pdl.py:
    each waits before reading anything, so the next may start while it drains)."""
    on = pdl.enabled(device)
    return {"PDL": on, **pdl.launch_options(on)}


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, foreign: bool = False, w13_scales: ExpertScales | None = None,
                  w2_scales: ExpertScales | None = None, total_experts: int | None = None,
                  config: GroupedConfig | None = None,
                  decode: tuple[GemvConfig, GemvConfig] | bool | None = None) -> torch.Tensor:
    """sum over the top_k choices of weight * down_e(silu(gate_e x) * up_e x), [T, H]: x [T, H],
    w13 [E, 2 I, H] (gate rows, then up rows), w2 [E, H, I], weights float32 and ids [T, top_k];
    FP8 weights with their scales (grouped_gemm). foreign: ids may also hold E, a choice of an
    expert another rank holds (expert parallelism), which adds nothing here: its pairs are sorted
    into blocks no program computes. A decode step's few pairs take the decode kernels: at most
    SMALL_PAIRS and total_experts (the model's, all ranks together; default the E held here), or as
    `decode` says: False for the grouped GEMMs, (gate/up, down) strip configurations for the decode
    kernels (the grouped GEMMs where those cannot take the scales); config: the grouped GEMMs'
    tiles (default `_grouped_config` by the pair count; tuned ones: nearest_tiles)."""
    tokens, top_k = ids.shape
    if decode is None:
        decode = 0 < tokens * top_k <= min(SMALL_PAIRS, total_experts or w13.shape[0])
    if decode is not False and tokens:
        configs = decode if isinstance(decode, tuple) else (None, None)
        out = small_experts(x, w13, w2, weights, ids, w13_scales, w2_scales, *configs)
        if out is not None:
            return out
    experts = w13.shape[0]
    config = config or _grouped_config(tokens * top_k)
    block_m = config.block_m
    sorted_ids, block_experts = align_by_expert(ids, experts + 1 if foreign else experts, block_m)
    if foreign:
        block_experts = torch.where(block_experts == experts, -1, block_experts)
    gate_up = grouped_gemm(x, w13, sorted_ids, block_experts, top_k, block_m, w_scales=w13_scales, config=config)
    hidden = silu_and_mul(gate_up)  # [T * top_k, I], one row per (token, choice); torch's roundings
    down = grouped_gemm(hidden, w2, sorted_ids, block_experts, 1, block_m, weights.reshape(-1).contiguous(),
                        zero=foreign, w_scales=w2_scales, config=config)
    return down.view(tokens, top_k, -1).sum(dim=1)


__all__ = ["AVAILABLE", "GROUPED_CANDIDATES", "SMALL_PAIRS", "TUNED_PAIRS", "ExpertScales", "GemvConfig",
           "GroupedConfig", "align_by_expert", "decode_configs", "fused_experts", "grouped_gemm", "nearest_tiles",
           "parse_tiles", "route", "small_experts", "tiles_key", "tiles_text"]
