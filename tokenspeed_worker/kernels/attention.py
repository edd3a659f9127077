"""Triton attention over the paged KV cache: split-KV decode and FlashAttention-2 style extend.

Both read K/V straight from the per-layer cache `[num_blocks, block_size, num_kv_heads, head_dim]`
through the block tables (slot = block_id * block_size + offset), never materializing a gathered
copy, and both handle GQA by giving one program all `group = num_heads // num_kv_heads` query heads
of a kv head, so each K/V element is read once per kv head instead of once per query head.

Decode (one query token per request) is memory-bound: the whole game is reading K/V at full
bandwidth. One request's keys are split into up to `num_splits` contiguous ranges of at least
MIN_TOKENS_PER_SPLIT keys (flash-decoding) so that even batch 1 fills the GPU; each (request, kv
head, split) program writes a partial result normalized by its own softmax sum plus its
log-sum-exp (base 2) to a workspace, then bumps a per-(request, kv head) arrival counter, and the
program that arrives last combines the splits, writes `out` and sets the counter back to 0: one
launch, no separate reduce kernel. A request whose keys fit in one split skips the workspace and
the counter and writes `out` directly. The split boundaries are computed on the device from
seq_lens, so a fixed num_splits (what a CUDA graph captures) works for every replay: splits past a
short sequence exit at once without touching the counter, and the last arrival knows how many to
wait for from the same boundaries. Nothing here reads a tensor on the host, so the call is
graph-capturable.

Extend (prefill chunks, mixed with decodes) is a tiled kernel: each program takes BLOCK_Q query
tokens x `group` heads as its BLOCK_M rows, walks the keys in BLOCK_N tiles (first the tiles every
row sees in full, unmasked, then the causal tail) with an online softmax.

Sliding windows and soft-caps (Gemma; Mistral-style windows): `window` and `softcap` are
compile-time constants (0: none, the kernels as without them). With a window the decode kernel
splits only the last `window` keys of each request, and the extend kernel starts at the first
row's window and masks each row to its own; a soft-cap replaces each tile's scores by
softcap * tanh(scores / softcap) before the softmax.

Importable without triton (CPU machines): AVAILABLE says whether the kernels can be used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tokenspeed_worker.kernels import compile_ahead, pdl
from tokenspeed_worker.kernels.norm import interpreting
from tokenspeed_worker.layers.kv_cache import saturation_limit

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

LOG2E = 1.4426950408889634

# Decode tunables. A split is never shorter than MIN_TOKENS_PER_SPLIT keys (rounded up to whole
# BLOCK_N tiles; shorter ones spend more on the workspace round trip than they save, and a sequence
# of at most that many keys is done by one program with no workspace); num_splits=None aims for about
# DECODE_PROGRAMS_PER_SM resident programs per multiprocessor, at most MAX_SPLITS.
MIN_TOKENS_PER_SPLIT = 64
DECODE_PROGRAMS_PER_SM = 4
MAX_SPLITS = 64
DEFAULT_NUM_SMS = 132  # multiprocessors assumed where there is no CUDA device (the interpreter)
REDUCE_SPLIT_TILE = 16  # splits combined per step by the program that reduces (at most)
REDUCE_TILE_ELEMENTS = 8192  # its [group, splits, head_dim] tile, float32


def _require_triton() -> None:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device | str | None = None) -> int:
    """Splits per request for decode: enough (request, kv head, split) programs to fill the GPU.

    max_context is an upper bound on the keys of any request (the default in
    paged_decode_attention uses block_tables.shape[1] * block_size, never reading seq_lens).
    """
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    wanted = -(-DECODE_PROGRAMS_PER_SM * _num_sms(device) // max(1, batch * num_kv_heads))
    by_length = -(-max(1, max_context) // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def decode_workspace(
    batch: int,
    num_heads: int,
    head_dim: int,
    num_splits: int,
    device: torch.device | str,
    num_kv_heads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode kernel's scratch: (partial_out float32 [B, H, num_splits, D],
    partial_lse float32 [B, H, num_splits], counter int32 [B, Hkv]).

    partial_out holds each split's output already divided by its softmax sum; partial_lse its
    log2-sum-exp2 of the scaled scores; counter how many splits of each (request, kv head) have
    written theirs so far. A workspace made for a larger batch (or more splits) can be passed for
    a smaller one: only the leading [:B, :, :num_splits] part (counter [:B, :Hkv]) is used.
    partial_out and partial_lse never need zeroing: entries of empty splits are neither written
    nor read. counter starts at zero and every call leaves it at zero (the program that reduces
    resets its entry), so one workspace serves every call and CUDA-graph replay; allocate it once,
    outside any capture. num_kv_heads: Hkv (None: num_heads, which fits any Hkv).
    """
    partial_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    partial_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    counter_width = num_heads if num_kv_heads is None else num_kv_heads
    counter = torch.zeros((batch, counter_width), dtype=torch.int32, device=device)
    return partial_out, partial_lse, counter


def _min_split_tokens(block_n: int) -> int:
    """The shortest split, in keys: MIN_TOKENS_PER_SPLIT rounded up to whole BLOCK_N tiles."""
    return -(-MIN_TOKENS_PER_SPLIT // block_n) * block_n


def _decode_split_tokens(seq_len: int, num_splits: int, block_n: int, single_split_tokens: int = 0) -> tuple[int, int]:
    """(tokens_per_split, used_splits) of one request: the host mirror of the decode kernel's
    device computation (tests use it to know which requests take several splits)."""
    if seq_len <= single_split_tokens:
        return -(-seq_len // block_n) * block_n, 1
    per_split = -(-seq_len // num_splits)
    tokens_per_split = max(-(-per_split // block_n) * block_n, _min_split_tokens(block_n))
    return tokens_per_split, -(-seq_len // tokens_per_split)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products (the default would be TF32 on the GPU); for 16-bit
    # inputs the setting is irrelevant.
    return "ieee" if dtype == torch.float32 else "tf32"


def _fp16_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """A 16-bit query against an fp8 cache: the kernels' dots run in float16 (_fp16_query)."""
    return k_cache.element_size() == 1 and q.element_size() == 2


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal 4-d shapes")
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} do not fit cache heads/dim {num_kv_heads}/{cache_head_dim}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    return block_size, num_kv_heads, num_heads // num_kv_heads, head_dim


if AVAILABLE:

    @triton.jit
    def _fp16_query(q):
        """q for float16 dots against an fp8 cache: e4m3 widens to float16 in one instruction per
        pair (to bfloat16 it takes several, which made the fp8 decode kernel slower than the
        bfloat16 one); float16 holds every e4m3 value and softmax weight exactly enough (10
        mantissa bits to bfloat16's 7), and q is clamped to its range."""
        return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    @triton.jit
    def _softcap_log2(scores, SOFTCAP: tl.constexpr):
        """Scores in log2 units (raw * log2(e)) -> SOFTCAP * tanh(raw / SOFTCAP) in log2 units
        (Gemma 2's attention soft-cap); tanh from exp, finite at any magnitude."""
        x = scores * (0.6931471805599453 / SOFTCAP)  # raw / SOFTCAP
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        return tanh * (SOFTCAP * 1.4426950408889634)

    @triton.jit
    def _rope_row(x, x_swapped, cos, sin, first_half, dtype: tl.constexpr):
        """x * cos + rotate_half(x) * sin (neox) over a head's HEAD_DIM columns, rounded as
        kernels/rotary.py (each product, then the sum, to dtype); x_swapped is x with its
        halves swapped (column d holds x[(d + HEAD_DIM / 2) % HEAD_DIM]), cos and sin already
        rounded to dtype, first_half: d < HEAD_DIM / 2."""
        a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
        b = (x_swapped.to(tl.float32) * sin).to(dtype).to(tl.float32)
        return tl.where(first_half, a - b, a + b).to(dtype)

    @triton.jit
    def _head_norm(x, x_swapped, weight_ptr, offs_d, swapped_d, eps, dtype: tl.constexpr,
                   HEAD_DIM: tl.constexpr, FORM: tl.constexpr, LIBDEVICE: tl.constexpr):
        """RMSNorm of each row of x [rows, HEAD_DIM] (and of x_swapped, its halves swapped, with the
        same statistics) as kernels/norm.py computes it: FORM 1 Llama's (the normalized row rounded
        to dtype, then times the weight), FORM 2 Gemma's (times 1 + weight, rounded once)."""
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps
        if LIBDEVICE:
            rstd = libdevice.rsqrt(mean_square)[:, None]
        else:
            rstd = 1.0 / tl.sqrt_rn(mean_square)[:, None]
        w = tl.load(weight_ptr + offs_d).to(tl.float32)[None, :]
        w_swapped = tl.load(weight_ptr + swapped_d).to(tl.float32)[None, :]
        if FORM == 2:
            out = (x32 * rstd) * (1.0 + w)
            out_swapped = (x_swapped.to(tl.float32) * rstd) * (1.0 + w_swapped)
        else:
            out = (x32 * rstd).to(dtype).to(tl.float32) * w
            out_swapped = (x_swapped.to(tl.float32) * rstd).to(dtype).to(tl.float32) * w_swapped
        return out.to(dtype), out_swapped.to(dtype)

    # Arguments that change from one eager step to the next (the plan's block-table width, the
    # split count, a mixed batch's row offsets into seq_lens and the block tables) are not
    # specialized on: each distinct divisibility or 16-byte alignment would be a compile of its
    # own, and Triton compiles on first use, inside the step that needs it (most of a second).
    # They only feed scalar address arithmetic, so nothing is lost.
    @triton.jit(do_not_specialize=["stride_table", "stride_pl_batch", "stride_pl_head", "num_splits",
                                   "single_split_tokens"],
                do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "counter_ptr"])
    def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr, counter_ptr,
        k_new_ptr, v_new_ptr, positions_ptr, cos_ptr, sin_ptr, slots_ptr, q_norm_ptr, k_norm_ptr,
        scale_log2, norm_eps,
        stride_q_batch, stride_q_head,
        stride_k_block, stride_k_offset, stride_k_head,
        stride_v_block, stride_v_offset, stride_v_head,
        stride_table,
        stride_out_batch, stride_out_head,
        stride_po_batch, stride_po_head, stride_po_split,
        stride_pl_batch, stride_pl_head,
        stride_counter_batch,
        stride_kn_batch, stride_kn_head, stride_vn_batch, stride_vn_head, stride_cos, stride_sin,
        num_splits,
        single_split_tokens,
        GROUP: tl.constexpr,
        GROUP_BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_SPLIT_TOKENS: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        SPLIT_TILE: tl.constexpr,
        WRITE_OUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr,
        FP16_DOTS: tl.constexpr,
        ROPE: tl.constexpr,
        KV_SATURATE: tl.constexpr,
        WINDOW: tl.constexpr = 0,
        SOFTCAP: tl.constexpr = 0.0,
        HEAD_NORM: tl.constexpr = 0,
        LIBDEVICE: tl.constexpr = True,
    ):
        batch = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + batch)
        # The keys attended: [first, seq_len), the last WINDOW of them with a sliding window.
        if WINDOW > 0:
            first = tl.maximum(seq_len - WINDOW, 0)
        else:
            first = seq_len * 0
        span = seq_len - first
        # Splits cover whole BLOCK_N tiles, at least MIN_SPLIT_TOKENS keys each (_decode_split_tokens
        # mirrors this on the host). Splits [0, used_splits) all hold keys; the rest are empty.
        tokens_per_split = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT_TOKENS)
        # A request of at most single_split_tokens keys is one program per kv head whatever
        # num_splits: no workspace round trip (the backend times where that is faster).
        tokens_per_split = tl.where(span <= single_split_tokens, tl.cdiv(span, BLOCK_N) * BLOCK_N,
                                    tokens_per_split)
        used_splits = tl.cdiv(span, tokens_per_split)
        start = first + split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, seq_len)  # <= start for an empty split

        offs_g = tl.arange(0, GROUP_BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + offs_g
        head_ok = offs_g < GROUP
        table_row = block_tables_ptr + batch.to(tl.int64) * stride_table
        k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head
        v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head
        if ROPE:  # positions, slots and the cos/sin tables are inputs of the step: read before the wait
            dtype = q_ptr.dtype.element_ty
            position = tl.load(positions_ptr + batch).to(tl.int64)
            cos = tl.load(cos_ptr + position * stride_cos + offs_d).to(dtype).to(tl.float32)
            sin = tl.load(sin_ptr + position * stride_sin + offs_d).to(dtype).to(tl.float32)
            first_half = offs_d < HEAD_DIM // 2
            swapped_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
            slot = tl.load(slots_ptr + batch).to(tl.int64)
        if PDL:  # seq_lens and block tables are inputs of the step; q and the new keys come from the kernels before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        q_rows = q_ptr + batch.to(tl.int64) * stride_q_batch + heads[:, None] * stride_q_head
        q = tl.load(q_rows + offs_d[None, :], mask=head_ok[:, None], other=0.0)
        loop_end = end
        if ROPE:
            # q and the step's key arrive unrotated (the q/k/v projection's output): rotate them here,
            # instead of in a kernel of their own before this one (one launch and one round trip of
            # q through memory fewer per layer). The program whose keys end the sequence owns the
            # step's key: its loop stops before it (its cache slot is not written yet) and it folds
            # the key in from registers after the loop, then writes key and value to the cache.
            q_swapped = tl.load(q_rows + swapped_d[None, :], mask=head_ok[:, None], other=0.0)
            k_row = k_new_ptr + batch.to(tl.int64) * stride_kn_batch + kv_head * stride_kn_head
            k_new = tl.load(k_row + offs_d[None, :])  # [1, HEAD_DIM]
            k_swapped = tl.load(k_row + swapped_d[None, :])
            if HEAD_NORM > 0:  # q/k norms (Qwen3, Gemma 3) before the rotary, as the model applies them
                q, q_swapped = _head_norm(q, q_swapped, q_norm_ptr, offs_d, swapped_d, norm_eps, dtype,
                                          HEAD_DIM, HEAD_NORM, LIBDEVICE)
                k_new, k_swapped = _head_norm(k_new, k_swapped, k_norm_ptr, offs_d, swapped_d, norm_eps, dtype,
                                              HEAD_DIM, HEAD_NORM, LIBDEVICE)
            q = _rope_row(q, q_swapped, cos[None, :], sin[None, :], first_half[None, :], dtype)
            # one row: the sum over it is the row itself, as a vector
            k_new = tl.sum(_rope_row(k_new, k_swapped, cos[None, :], sin[None, :], first_half[None, :], dtype), axis=0)
            v_new = tl.load(v_new_ptr + batch.to(tl.int64) * stride_vn_batch + kv_head * stride_vn_head + offs_d)
            if KV_SATURATE > 0:  # an fp8 cache: e4m3 has no infinity
                k_new = tl.clamp(k_new.to(tl.float32), -KV_SATURATE, KV_SATURATE)
                v_new = tl.clamp(v_new.to(tl.float32), -KV_SATURATE, KV_SATURATE)
            k_new = k_new.to(k_cache_ptr.dtype.element_ty)
            v_new = v_new.to(v_cache_ptr.dtype.element_ty)
            owns_newest = (start < seq_len) & (end == seq_len)
            loop_end = tl.where(owns_newest, end - 1, end)
        if FP16_DOTS:
            q = _fp16_query(q)

        m_i = tl.full([GROUP_BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_BLOCK], dtype=tl.float32)
        acc = tl.zeros([GROUP_BLOCK, HEAD_DIM], dtype=tl.float32)
        for tile_start in range(start, loop_end, BLOCK_N):
            pos = tile_start + offs_n
            key_ok = pos < loop_end
            # Entries past the sequence's last block may be garbage: masked, never read.
            block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            in_block = (pos % BLOCK_SIZE).to(tl.int64)
            k = tl.load(
                k_head + (block_id * stride_k_block + in_block * stride_k_offset)[:, None] + offs_d[None, :],
                mask=key_ok[:, None], other=0.0,
            )
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
            if SOFTCAP > 0:
                scores = _softcap_log2(scores, SOFTCAP)
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every tile holds a key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_head + (block_id * stride_v_block + in_block * stride_v_offset)[:, None] + offs_d[None, :],
                mask=key_ok[:, None], other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new
        if ROPE:
            if owns_newest:
                # The step's key as one more key of the online softmax, rounded as the tiles are
                # (q and the key in q's dtype, the weight in q's dtype before it meets the value).
                k_last = k_new.to(q.dtype).to(tl.float32)
                score = tl.sum(q.to(tl.float32) * k_last[None, :], axis=1) * scale_log2
                if SOFTCAP > 0:
                    score = _softcap_log2(score, SOFTCAP)
                m_new = tl.maximum(m_i, score)
                alpha = tl.exp2(m_i - m_new)  # 0 where no tile came before (m_i = -inf)
                p_last = tl.exp2(score - m_new)
                l_i = l_i * alpha + p_last
                acc = acc * alpha[:, None] + (p_last.to(q.dtype).to(tl.float32)[:, None]
                                              * v_new.to(q.dtype).to(tl.float32)[None, :])
                m_i = m_new
                slot_in_block = slot % BLOCK_SIZE
                tl.store(k_head + (slot // BLOCK_SIZE) * stride_k_block + slot_in_block * stride_k_offset + offs_d,
                         k_new)
                tl.store(v_head + (slot // BLOCK_SIZE) * stride_v_block + slot_in_block * stride_v_offset + offs_d,
                         v_new)

        l_i = tl.where(l_i > 0, l_i, 1.0)  # an empty split (nothing stored) must not divide by zero
        split_out = acc / l_i[:, None]
        out_rows = out_ptr + batch.to(tl.int64) * stride_out_batch + heads[:, None] * stride_out_head + offs_d[None, :]
        if start < seq_len:  # an empty split stores nothing and never touches the counter
            if WRITE_OUT:  # one split per request (num_splits == 1): the result is final
                tl.store(out_rows, split_out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
            elif used_splits == 1:  # this request's keys fit in one split: no workspace, no counter
                tl.store(out_rows, split_out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
            else:
                po_batch = partial_out_ptr + batch.to(tl.int64) * stride_po_batch
                pl_batch = partial_lse_ptr + batch.to(tl.int64) * stride_pl_batch
                row = heads * stride_po_head + split * stride_po_split
                tl.store(po_batch + row[:, None] + offs_d[None, :], split_out, mask=head_ok[:, None])
                tl.store(pl_batch + heads * stride_pl_head + split, m_i + tl.log2(l_i), mask=head_ok)
                # Every thread's partial stores before the one thread's release of the counter
                # (a scalar atomic is issued by one thread; the barrier makes the others' stores
                # part of what it releases, as in CUDA's threadFenceReduction).
                tl.debug_barrier()
                counter = counter_ptr + batch.to(tl.int64) * stride_counter_batch + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == used_splits - 1:
                    # The last split to arrive: its acquire makes every used split's partials
                    # visible. Combine them as a separate reduce would, all GROUP heads at once
                    # (one round trip to L2 per SPLIT_TILE splits, not one per head).
                    offs_r = tl.arange(0, GROUP_PAD)
                    r_heads = kv_head * GROUP + offs_r
                    r_head_ok = offs_r < GROUP
                    offs_s = tl.arange(0, SPLIT_TILE)
                    lse_rows = pl_batch + r_heads[:, None] * stride_pl_head  # [GROUP_PAD, 1]
                    part_rows = po_batch + r_heads[:, None, None] * stride_po_head  # [GROUP_PAD, 1, 1]
                    r_m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
                    r_l = tl.zeros([GROUP_PAD], dtype=tl.float32)
                    r_acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
                    for first in range(0, used_splits, SPLIT_TILE):
                        splits = first + offs_s
                        ok = r_head_ok[:, None] & (splits < used_splits)[None, :]
                        # .cg: from L2, where the other programs' partials are (not a stale L1 line).
                        lse = tl.load(lse_rows + splits[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
                        lse = tl.where(r_head_ok[:, None], lse, 0.0)  # padding heads: finite, never stored
                        part = tl.load(
                            part_rows + splits[None, :, None] * stride_po_split + offs_d[None, None, :],
                            mask=ok[:, :, None], other=0.0, cache_modifier=".cg",
                        )
                        r_m_new = tl.maximum(r_m, tl.max(lse, axis=1))  # finite: the tile holds a used split
                        r_alpha = tl.exp2(r_m - r_m_new)
                        weight = tl.exp2(lse - r_m_new[:, None])
                        r_acc = r_acc * r_alpha[:, None] + tl.sum(weight[:, :, None] * part, axis=1)
                        r_l = r_l * r_alpha + tl.sum(weight, axis=1)
                        r_m = r_m_new
                    tl.store(
                        out_ptr + batch.to(tl.int64) * stride_out_batch + r_heads[:, None] * stride_out_head
                        + offs_d[None, :],
                        (r_acc / r_l[:, None]).to(out_ptr.dtype.element_ty), mask=r_head_ok[:, None],
                    )
                    # Every used split has arrived and no empty one ever will: back to 0 for the
                    # next launch (or graph replay), which the kernel boundary orders after this.
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit(do_not_specialize=["stride_table"],
                do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
    def _extend_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
        scale_log2,
        stride_q_token, stride_q_head,
        stride_k_block, stride_k_offset, stride_k_head,
        stride_v_block, stride_v_offset, stride_v_head,
        stride_table,
        stride_out_token, stride_out_head,
        GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP16_DOTS: tl.constexpr,
        WINDOW: tl.constexpr = 0,
        SOFTCAP: tl.constexpr = 0.0,
    ):
        # Longest (last) query tiles first: they have the most keys, so the tail of the grid is short.
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        batch = tl.program_id(2)
        query_start = tl.load(query_start_loc_ptr + batch)
        query_len = tl.load(query_start_loc_ptr + batch + 1) - query_start
        seq_len = tl.load(seq_lens_ptr + batch)
        context_len = seq_len - query_len
        tile_first = tile * BLOCK_Q

        # Row r of the tile is query token tile_first + r // GROUP, head kv_head * GROUP + r % GROUP.
        rows = tl.arange(0, BLOCK_M)
        q_index = tile_first + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_index < query_len)
        row_pos = context_len + q_index  # the row's position; it sees keys 0..row_pos
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        tokens = (query_start + q_index).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
            mask=row_ok[:, None], other=0.0,
        )
        if FP16_DOTS:
            q = _fp16_query(q)
        table_row = block_tables_ptr + batch.to(tl.int64) * stride_table
        k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head
        v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head

        # Keys [0, full_end) are visible to every row of the tile; [full_end, kv_end) need the causal mask.
        tile_ok = tile_first < query_len
        last_q = tl.minimum(tile_first + BLOCK_Q, query_len) - 1
        kv_end = tl.where(tile_ok, context_len + last_q + 1, 0)
        full_end = tl.where(tile_ok, (context_len + tile_first + 1) // BLOCK_N * BLOCK_N, 0)
        kv_start = full_end * 0  # keys [kv_start, full_end) are visible to every row of the tile
        if WINDOW > 0:
            # A row sees keys (row_pos - WINDOW, row_pos]: none before the first row's window, and
            # every tile walked takes the masked loop (the rows' windows end at different keys).
            kv_start = tl.maximum(context_len + tile_first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            full_end = kv_start

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for tile_start in range(kv_start, full_end, BLOCK_N):  # (empty with a window)
            pos = tile_start + offs_n
            block_id = tl.load(table_row + pos // BLOCK_SIZE).to(tl.int64)
            in_block = (pos % BLOCK_SIZE).to(tl.int64)
            k = tl.load(k_head + (block_id * stride_k_block + in_block * stride_k_offset)[:, None] + offs_d[None, :])
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
            if SOFTCAP > 0:
                scores = _softcap_log2(scores, SOFTCAP)
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + (block_id * stride_v_block + in_block * stride_v_offset)[:, None] + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new
        for tile_start in range(full_end, kv_end, BLOCK_N):
            pos = tile_start + offs_n
            key_ok = pos < kv_end
            block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            in_block = (pos % BLOCK_SIZE).to(tl.int64)
            k = tl.load(
                k_head + (block_id * stride_k_block + in_block * stride_k_offset)[:, None] + offs_d[None, :],
                mask=key_ok[:, None], other=0.0,
            )
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
            if SOFTCAP > 0:
                scores = _softcap_log2(scores, SOFTCAP)
            visible = (pos[None, :] <= row_pos[:, None]) & key_ok[None, :]
            if WINDOW > 0:
                visible = visible & (pos[None, :] > row_pos[:, None] - WINDOW)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # Without a window, key 0 is in the first tile walked and visible to every row, so m_i
            # is finite from there on. With one, a row may have seen no key yet (its window starts
            # past the tiles so far): its maximum stays -inf, its state 0, against a finite reference.
            m_ref = m_new
            if WINDOW > 0:
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(scores - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_head + (block_id * stride_v_block + in_block * stride_v_offset)[:, None] + offs_d[None, :],
                mask=key_ok[:, None], other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows of an empty tile are not stored
        tl.store(
            out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None],
        )


def _decode_block_n(head_dim: int, element_size: int = 2) -> int:
    """Keys per step: 64 x 128 x 16-bit K and V tiles; half as many for wider heads or float32."""
    return 64 if head_dim * element_size <= 256 else 32


def _reduce_split_tile(group_pad: int, head_dim: int) -> int:
    """Splits combined per step by the reducing program: its [group_pad, tile, head_dim] float32
    tile stays at most REDUCE_TILE_ELEMENTS (64 registers a thread at 4 warps)."""
    tile = REDUCE_SPLIT_TILE
    while tile > 2 and group_pad * tile * head_dim > REDUCE_TILE_ELEMENTS:
        tile //= 2
    return tile


@dataclass
class DecodeRope:
    """The rotary and KV-cache write that paged_decode_attention can do itself (its `rope`): q is
    then the unrotated query, and the kernel rotates q and k (neox style over the whole head, the
    cos/sin tables of layers/rotary.RotaryEmbedding) and writes the rotated k and v into the caches
    at slot_mapping, as kernels/rotary.rope_and_write_kv would before the attention."""

    k: torch.Tensor  # [B, Hkv, D], unrotated (strided over B and Hkv, contiguous along D)
    v: torch.Tensor  # [B, Hkv, D]
    positions: torch.Tensor  # int [B]
    cos_cache: torch.Tensor  # float32 [max_position, D]
    sin_cache: torch.Tensor
    slot_mapping: torch.Tensor  # int [B]: where block_tables puts each row's key seq_len - 1
    # Per-head RMSNorms of q and of k before the rotary (Qwen3's and Gemma 3's q_norm / k_norm),
    # with the roundings of kernels/norm.py: weights [D] of q's dtype, Gemma's (1 + w) form where
    # norm_unit_offset. None: q and k arrive normalized (or the model has none).
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False


def _check_rope(rope: DecodeRope, q: torch.Tensor, num_kv_heads: int) -> None:
    batch, _, head_dim = q.shape
    for name in ("k", "v"):
        t = getattr(rope, name)
        if t.shape != (batch, num_kv_heads, head_dim) or t.stride(2) != 1 or t.dtype != q.dtype:
            raise ValueError(f"rope.{name} {tuple(t.shape)} {t.dtype} must be [{batch}, {num_kv_heads}, {head_dim}] "
                             f"{q.dtype}, contiguous along the head")
    if head_dim % 2 or rope.cos_cache.shape[-1] != head_dim or rope.sin_cache.shape != rope.cos_cache.shape:
        raise ValueError(f"rope.cos_cache {tuple(rope.cos_cache.shape)} and rope.sin_cache "
                         f"{tuple(rope.sin_cache.shape)} must cover the whole (even) head {head_dim}")
    if rope.cos_cache.stride(-1) != 1 or rope.sin_cache.stride(-1) != 1:
        raise ValueError("rope.cos_cache and rope.sin_cache must be contiguous along the head")
    if rope.positions.shape != (batch,) or rope.slot_mapping.shape != (batch,):
        raise ValueError(f"rope.positions {tuple(rope.positions.shape)} and rope.slot_mapping "
                         f"{tuple(rope.slot_mapping.shape)} must be [{batch}]")
    if (rope.q_norm_weight is None) != (rope.k_norm_weight is None):
        raise ValueError("rope.q_norm_weight and rope.k_norm_weight come together")
    for w in (rope.q_norm_weight, rope.k_norm_weight):
        if w is not None and (w.shape != (head_dim,) or w.dtype != q.dtype or w.stride(0) != 1):
            raise ValueError(f"rope.q_norm_weight / k_norm_weight {tuple(w.shape)} {w.dtype} must be a contiguous "
                             f"[{head_dim}] of q's dtype {q.dtype}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    single_split_tokens: int = 0,
    rope: DecodeRope | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """One query token per request attends its whole sequence in the paged cache (its last `window`
    keys with a sliding window; scores capped by softcap * tanh(scores / softcap) with a soft-cap);
    writes `out` in place.

    q, out: [B, H, D] (strided along B and H, contiguous along D); k_cache, v_cache:
    [num_blocks, block_size, Hkv, D]; block_tables int32 [B, W] (entries past
    ceil(seq_len / block_size) are never read); seq_lens int32 [B], each >= 1, counting the
    current token, whose K/V is already in the cache.

    num_splits: at most this many key ranges per request, each of at least MIN_TOKENS_PER_SPLIT
    keys (whole BLOCK_N tiles); a request of at most `single_split_tokens` keys takes one range
    whatever num_splits (one program per kv head, no workspace round trip: at short contexts that
    can be faster than splitting; the triton backend times it at startup). None takes the
    workspace's split count when a workspace is given, else choose_num_splits(B, Hkv,
    W * block_size). Any value works for any seq_lens: splits past a short sequence exit at
    once, and a request whose keys fit in one split writes `out` directly
    (decided per request on the device, so also inside a CUDA graph captured with many splits).
    The splits of a longer request write partials to the workspace and the last of them to finish
    combines them into `out`, in the same launch. 1 writes `out` directly for every request (no
    workspace). workspace: decode_workspace(...) made for at least B requests, Hkv kv heads and
    num_splits splits, whose counter is zero (every call leaves it so); made here when None
    (allocate it up front for CUDA-graph capture: nothing is allocated per call then).
    rope: q is unrotated, and the kernel first does the rotary and the KV write (DecodeRope; with
    its q/k norm weights, the per-head norms before the rotary);
    None: q is rotated and every row's key seq_len - 1 is already in the cache.
    """
    _require_triton()
    block_size, num_kv_heads, group, head_dim = _check_cache(q, k_cache, v_cache)
    batch, num_heads = q.shape[0], q.shape[1]
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be [B, H, D] like q {tuple(q.shape)}, contiguous along D")
    if workspace is not None and len(workspace) != 3:
        raise ValueError("workspace must be (partial_out, partial_lse, counter) as decode_workspace makes it")
    if num_splits is None:
        if workspace is not None:
            num_splits = workspace[1].shape[2]
        else:
            num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if single_split_tokens < 0:
        raise ValueError(f"single_split_tokens must be >= 0, got {single_split_tokens}")
    if batch == 0:
        return
    block_n = _decode_block_n(head_dim, max(q.element_size(), k_cache.element_size()))  # an fp8 cache is widened to q
    group_pad = triton.next_power_of_2(group)
    write_out = num_splits == 1
    if write_out:
        partial_out = partial_lse = out  # unused by the kernel
        counter = seq_lens
        stride_counter = 0
    else:
        if workspace is None:
            workspace = decode_workspace(batch, num_heads, head_dim, num_splits, q.device, num_kv_heads)
        partial_out, partial_lse, counter = workspace
        if (partial_out.shape[0] < batch or partial_out.shape[1] != num_heads or partial_out.shape[2] < num_splits
                or partial_out.shape[3] != head_dim or partial_out.stride(3) != 1 or partial_lse.stride(2) != 1
                or partial_lse.shape[0] < batch or partial_lse.shape[1] != num_heads or partial_lse.shape[2] < num_splits
                or partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32
                or counter.dtype != torch.int32 or counter.dim() != 2 or counter.shape[0] < batch
                or counter.shape[1] < num_kv_heads or counter.stride(1) != 1):
            raise ValueError(
                f"workspace {tuple(partial_out.shape)}, {tuple(partial_lse.shape)}, {tuple(counter.shape)} does not "
                f"fit B={batch} H={num_heads} Hkv={num_kv_heads} splits={num_splits} D={head_dim}; "
                "see decode_workspace"
            )
        stride_counter = counter.stride(0)
    if rope is not None:
        _check_rope(rope, q, num_kv_heads)
        r = rope
        norms = (r.q_norm_weight, r.k_norm_weight) if r.q_norm_weight is not None else (q, q)
        rope_args = (r.k, r.v, r.positions, r.cos_cache, r.sin_cache, r.slot_mapping, *norms)
        rope_strides = (r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1), r.cos_cache.stride(0),
                        r.sin_cache.stride(0))
    else:
        rope_args = (q, q, seq_lens, q, q, seq_lens, q, q)  # unused pointers
        rope_strides = (0,) * 6
    pdl_on = pdl.enabled(q.device)
    compile_ahead.launch(
        _decode_split_kernel, (batch, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, seq_lens,
        out, partial_out, partial_lse, counter,
        *rope_args,
        float(scale) * LOG2E, float(rope.norm_eps if rope is not None else 0.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        stride_counter,
        *rope_strides,
        num_splits,
        int(single_split_tokens),
        GROUP=group,
        GROUP_BLOCK=max(16, triton.next_power_of_2(group)),  # tl.dot wants >= 16 rows
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        MIN_SPLIT_TOKENS=_min_split_tokens(block_n),
        GROUP_PAD=group_pad,
        SPLIT_TILE=_reduce_split_tile(group_pad, head_dim),
        WRITE_OUT=write_out,
        DOT_PRECISION=_dot_precision(q.dtype),
        PDL=pdl_on,
        FP16_DOTS=_fp16_dots(q, k_cache),
        ROPE=rope is not None,
        KV_SATURATE=saturation_limit(k_cache.dtype) if rope is not None else 0.0,
        WINDOW=int(window or 0),
        SOFTCAP=float(softcap or 0.0),
        HEAD_NORM=0 if rope is None or rope.q_norm_weight is None else 2 if rope.norm_unit_offset else 1,
        LIBDEVICE=not interpreting(),
        num_warps=4,
        num_stages=2,
        # A float32 model's rotary rounds each product as kernels/rotary.py does (no FMA there);
        # 16-bit dtypes round each product explicitly, so fusion cannot change their bits.
        enable_fp_fusion=not (rope is not None and q.dtype == torch.float32),
        **pdl.launch_options(pdl_on),
    )


def _extend_config(head_dim: int, group: int, max_query_len: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = BLOCK_Q tokens x group heads, BLOCK_N keys, num_warps, num_stages).

    Sized for sm_90 with 16-bit inputs: 128 x 64 tiles at head_dim <= 128 compile to wgmma with
    cp.async pipelining and no spills (182 registers at head_dim 128, one 8-warp program per SM);
    wider heads and float32 (a checking dtype, not a serving one) take smaller tiles.
    """
    wide = head_dim * element_size > 256
    block_m_max = 64 if wide else 128
    # A batch of short queries (decodes, small chunks) gets a small row tile instead of padding.
    block_m = min(block_m_max, max(16, triton.next_power_of_2(max_query_len * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 32 if wide else 64
    num_warps = 8 if block_m >= 64 else 4
    return block_m, block_n, num_warps, 2


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_query_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Query tokens of B requests attend their cached prefix and, causally, their own query; writes `out`.
    window: a query sees only the last `window` positions up to its own (0: all); softcap: scores
    capped by softcap * tanh(scores / softcap) (0: none).

    q, out: [T, H, D], request-major (strided along T and H, contiguous along D);
    query_start_loc int32 [B+1] (request b's tokens are q[query_start_loc[b]:query_start_loc[b+1]]);
    seq_lens int32 [B] = context + query, with the query's K/V already in the cache. Query token i
    of a request sits at position seq_len - query_len + i and sees positions <= its own.
    max_query_len: a host bound on every query_len (a larger one only launches idle programs).
    A query_len of 0 or 1 is fine (mixed prefill/decode batches).
    """
    _require_triton()
    block_size, num_kv_heads, group, head_dim = _check_cache(q, k_cache, v_cache)
    batch = seq_lens.shape[0]
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be [T, H, D] like q {tuple(q.shape)}, contiguous along D")
    if batch == 0 or max_query_len <= 0 or q.shape[0] == 0:
        return
    element_size = max(q.element_size(), k_cache.element_size())  # an fp8 cache is widened to q
    block_m, block_n, num_warps, num_stages = _extend_config(head_dim, group, max_query_len, element_size)
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, batch)
    compile_ahead.launch(
        _extend_kernel, grid,
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        FP16_DOTS=_fp16_dots(q, k_cache),
        WINDOW=int(window or 0),
        SOFTCAP=float(softcap or 0.0),
        num_warps=num_warps,
        num_stages=num_stages,
    )


__all__ = [
    "AVAILABLE",
    "DecodeRope",
    "choose_num_splits",
    "decode_workspace",
    "paged_decode_attention",
    "paged_extend_attention",
]
