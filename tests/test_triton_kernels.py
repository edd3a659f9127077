"""The Triton paged-attention (and RMSNorm) kernels against plain torch references.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), with small shapes so the file stays well under a minute; on CUDA the same tests run
compiled, plus larger shapes marked `gpu`. triton must be importable (CI installs
triton==3.6.0): without it this module fails at import instead of skipping.

The caches start as NaN everywhere and only positions inside each request's sequence get real
values, and the block tables' padding points at NaN blocks, so a kernel that lets any key past a
sequence (or a padding table entry) into its sums produces NaN.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    # Read when triton is imported (its own @triton.jit helpers, tl.cdiv and tl.sum among them,
    # are decorated then): too late once triton is in, so say so instead of failing obscurely.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402,F401  (no skip: CI must have triton)

from tokenspeed_worker.kernels import attention, norm  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
BLOCK_SIZE = 16
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


class PagedCase:
    """A batch of requests whose K/V sit in randomly placed blocks of a paged cache."""

    def __init__(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        num_kv_heads: int,
        group: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        block_size: int = BLOCK_SIZE,
        spare_columns: int = 5,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.query_lens = seq_lens, query_lens
        self.num_kv_heads, self.group, self.head_dim = num_kv_heads, group, head_dim
        self.num_heads = num_kv_heads * group
        self.block_size = block_size
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_needed) + 7  # the 7 spare blocks stay NaN
        width = max(blocks_needed) + spare_columns
        placement = torch.randperm(num_blocks, generator=gen)
        spare = placement[sum(blocks_needed):]
        tables = spare[torch.randint(0, len(spare), (len(seq_lens), width), generator=gen)]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"))
        v_cache = torch.full(shape, float("nan"))
        used = 0
        for b, (seq_len, count) in enumerate(zip(seq_lens, blocks_needed)):
            tables[b, :count] = placement[used:used + count]
            used += count
            for pos in range(seq_len):
                block, offset = tables[b, pos // block_size], pos % block_size
                k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
                v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
        self.k_cache = k_cache.to(dtype).to(DEVICE)
        self.v_cache = v_cache.to(dtype).to(DEVICE)
        self.block_tables = tables.to(torch.int32).to(DEVICE)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        self.q = torch.randn(starts[-1], self.num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        self.scale = head_dim**-0.5

    def reference(self, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """float32 [T, H, D]: softmax attention over the gathered sequence, causal after the prefix
        (each query over its last `window` positions with a window; scores soft-capped)."""
        bs, hkv, d = self.block_size, self.num_kv_heads, self.head_dim
        k_slots = self.k_cache.float().reshape(-1, hkv, d)
        v_slots = self.v_cache.float().reshape(-1, hkv, d)
        outputs, start = [], 0
        for b, (seq_len, query_len) in enumerate(zip(self.seq_lens, self.query_lens)):
            positions = torch.arange(seq_len, device=DEVICE)
            slots = self.block_tables[b, positions // bs].long() * bs + positions % bs
            k = k_slots[slots].repeat_interleave(self.group, dim=1)  # [L, H, D]: GQA by head grouping
            v = v_slots[slots].repeat_interleave(self.group, dim=1)
            q = self.q[start:start + query_len].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            query_pos = seq_len - query_len + torch.arange(query_len, device=DEVICE)
            hidden = positions[None, None, :] > query_pos[None, :, None]
            if window:
                hidden = hidden | (positions[None, None, :] <= query_pos[None, :, None] - window)
            scores = scores.masked_fill(hidden, float("-inf"))
            outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
            start += query_len
        return torch.cat(outputs)


def _decode_case(seq_lens, group, head_dim, dtype, seed=0, num_kv_heads=2) -> PagedCase:
    return PagedCase(seq_lens, [1] * len(seq_lens), num_kv_heads, group, head_dim, dtype, seed)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "NaN/inf: a key past a sequence or a padding block leaked in"
    torch.testing.assert_close(actual.float(), expected, **TOLERANCE[dtype])


DECODE_SEQ_LENS = {
    1: [133],
    3: [1, 16, 257],
    8: [1, 2, 15, 16, 17, 64, 100, 300],
}


@pytest.mark.parametrize(
    "batch,group,head_dim,dtype,num_splits",
    [
        (1, 1, 32, torch.float32, None),
        (1, 4, 64, torch.float32, 3),
        (3, 4, 64, torch.float32, 1),
        (3, 1, 128, torch.float32, 4),
        (3, 4, 32, torch.bfloat16, None),
        (8, 4, 128, torch.bfloat16, 8),
        (8, 1, 64, torch.float16, 2),
    ],
)
def test_decode_matches_reference(batch, group, head_dim, dtype, num_splits):
    case = _decode_case(DECODE_SEQ_LENS[batch], group, head_dim, dtype, seed=batch * 10 + group)
    out = torch.empty_like(case.q)
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out, num_splits=num_splits
    )
    _assert_close(out, case.reference(), dtype)


def test_decode_fixed_num_splits_ignores_empty_splits_and_stale_workspace():
    # What a CUDA graph does: one num_splits and one workspace (made for a larger batch) for every
    # replay. Most splits are empty for these short sequences; the workspace starts as NaN and
    # keeps the previous call's entries, none of which may reach the output.
    num_splits = 32
    workspace = attention.decode_workspace(6, 8, 64, num_splits, DEVICE, num_kv_heads=2)
    partial_out, partial_lse, counter = workspace
    partial_out.fill_(float("nan"))
    partial_lse.fill_(float("nan"))
    for seed, seq_lens in enumerate(([300, 1, 40], [1, 17, 2], [129, 5, 64])):
        case = _decode_case(seq_lens, group=4, head_dim=64, dtype=torch.float32, seed=seed)
        out = torch.empty_like(case.q)
        attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
            num_splits=num_splits, workspace=workspace,
        )
        _assert_close(out, case.reference(), torch.float32)
        assert (counter == 0).all()


def _used_splits(case: PagedCase, num_splits: int) -> list[int]:
    block_n = attention._decode_block_n(case.head_dim, case.k_cache.element_size())
    return [attention._decode_split_tokens(n, num_splits, block_n)[1] for n in case.seq_lens]


@pytest.mark.parametrize(
    "group,dtype", [(1, torch.float32), (4, torch.float32), (4, torch.bfloat16), (3, torch.float32)]
)
def test_decode_fused_reduce_mixes_one_split_and_many_split_requests(group, dtype):
    # One launch: requests of <= MIN_TOKENS_PER_SPLIT keys write `out` from their single program,
    # longer ones are combined by whichever of their splits arrives last. The same workspace
    # serves two calls in a row: each must leave every arrival counter back at 0.
    seq_lens, num_splits = [1, 5, 130, 300, 700], 8
    workspace = attention.decode_workspace(len(seq_lens), 2 * group, 32, num_splits, DEVICE, num_kv_heads=2)
    partial_out, partial_lse, counter = workspace
    partial_out.fill_(float("nan"))
    partial_lse.fill_(float("nan"))
    for seed in (1, 2):
        case = _decode_case(seq_lens, group=group, head_dim=32, dtype=dtype, seed=seed + group)
        assert _used_splits(case, num_splits) == [1, 1, 3, 5, 6]  # splits of >= 64 keys
        out = torch.full_like(case.q, float("nan"))
        attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
            num_splits=num_splits, workspace=workspace,
        )
        _assert_close(out, case.reference(), dtype)
        assert counter.shape == (len(seq_lens), 2) and (counter == 0).all()


@pytest.mark.parametrize("num_splits", [16, 64])
def test_decode_with_many_more_splits_than_the_sequences_need(num_splits):
    # What a batch-1/2 CUDA graph captures (64 splits): nearly all splits are empty, the
    # short request still takes the direct path, the long ones reduce over their used splits only.
    case = _decode_case([129, 700, 3], group=4, head_dim=32, dtype=torch.float32, seed=7, num_kv_heads=1)
    assert _used_splits(case, num_splits) == [3, 11, 1]
    workspace = attention.decode_workspace(8, case.num_heads, 32, num_splits, DEVICE)  # larger batch, Hkv = H
    workspace[0].fill_(float("nan"))
    for _ in range(2):
        out = torch.full_like(case.q, float("nan"))
        attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
            workspace=workspace,  # num_splits from the workspace
        )
        _assert_close(out, case.reference(), torch.float32)
        assert (workspace[2] == 0).all()


def test_decode_reduces_more_splits_than_one_reduce_tile():
    # 20 used splits: the reducing program combines them over two SPLIT_TILE (16) steps.
    case = _decode_case([2500, 40], group=4, head_dim=32, dtype=torch.float32, seed=8, num_kv_heads=1)
    assert _used_splits(case, 24) == [20, 1]
    assert attention._reduce_split_tile(4, 32) == 16
    workspace = attention.decode_workspace(2, case.num_heads, 32, 24, DEVICE, num_kv_heads=1)
    out = torch.empty_like(case.q)
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
        num_splits=24, workspace=workspace,
    )
    _assert_close(out, case.reference(), torch.float32)
    assert (workspace[2] == 0).all()


def test_decode_of_short_sequences_never_touches_the_workspace():
    # Every request fits in one split (<= MIN_TOKENS_PER_SPLIT = 64 keys): the kernel writes `out`
    # directly even with num_splits 16, so the NaN-poisoned partials stay as they were and the counter stays 0.
    case = _decode_case([1, 30, 50, 64], group=2, head_dim=32, dtype=torch.float32, seed=4)
    assert _used_splits(case, 16) == [1, 1, 1, 1]
    partial_out, partial_lse, counter = attention.decode_workspace(4, case.num_heads, 32, 16, DEVICE, 2)
    partial_out.fill_(float("nan"))
    partial_lse.fill_(float("nan"))
    out = torch.empty_like(case.q)
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
        num_splits=16, workspace=(partial_out, partial_lse, counter),
    )
    _assert_close(out, case.reference(), torch.float32)
    assert partial_out.isnan().all() and partial_lse.isnan().all() and (counter == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_single_split_threshold_keeps_short_requests_in_one_program(dtype):
    # single_split_tokens=256: the requests of <= 256 keys run one program per kv head (out written
    # directly, workspace untouched for them); the longer ones still split and reduce. The result
    # is the reference either way, and the counters are back at 0.
    seq_lens, num_splits = [1, 70, 130, 256, 257, 700], 8
    case = _decode_case(seq_lens, group=4, head_dim=32, dtype=dtype, seed=21, num_kv_heads=2)
    block_n = attention._decode_block_n(32, case.k_cache.element_size())
    used = [attention._decode_split_tokens(n, num_splits, block_n, 256)[1] for n in seq_lens]
    assert used == [1, 1, 1, 1, 5, 6] and _used_splits(case, num_splits) == [1, 2, 3, 4, 5, 6]
    partial_out, partial_lse, counter = attention.decode_workspace(len(seq_lens), case.num_heads, 32, num_splits,
                                                                   DEVICE, 2)
    partial_out.fill_(float("nan"))
    partial_lse.fill_(float("nan"))
    out = torch.full_like(case.q, float("nan"))
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
        num_splits=num_splits, workspace=(partial_out, partial_lse, counter), single_split_tokens=256,
    )
    _assert_close(out, case.reference(), dtype)
    assert (counter == 0).all()
    assert partial_out[:4].isnan().all() and partial_lse[:4].isnan().all()  # one-program requests
    assert not partial_lse[4:, :, 0].isnan().any()  # the split ones went through the workspace


def test_decode_rejects_a_negative_single_split_threshold():
    case = _decode_case([5], group=1, head_dim=32, dtype=torch.float32)
    with pytest.raises(ValueError, match="single_split_tokens"):
        attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t,
                                         case.scale, torch.empty_like(case.q), single_split_tokens=-1)


def test_decode_split_boundaries_never_make_splits_shorter_than_the_minimum():
    for block_n in (32, 64):
        for num_splits in (1, 2, 8, 64):
            for seq_len in (1, 5, 127, 128, 129, 256, 257, 1000, 8192):
                tokens, used = attention._decode_split_tokens(seq_len, num_splits, block_n)
                assert tokens % block_n == 0 and tokens >= attention.MIN_TOKENS_PER_SPLIT
                assert 1 <= used <= num_splits and (used - 1) * tokens < seq_len <= used * tokens
                assert (used == 1) == (seq_len <= attention.MIN_TOKENS_PER_SPLIT or num_splits == 1)
                for single in (0, 64, 256, 1000):  # at most `single` keys: one range of whole tiles
                    tokens, used = attention._decode_split_tokens(seq_len, num_splits, block_n, single)
                    assert tokens % block_n == 0 and (used - 1) * tokens < seq_len <= used * tokens
                    if seq_len <= single:
                        assert used == 1
                    else:
                        assert (tokens, used) == attention._decode_split_tokens(seq_len, num_splits, block_n)


def test_decode_takes_num_splits_from_the_workspace():
    case = _decode_case([70, 3], group=2, head_dim=32, dtype=torch.float32)
    workspace = attention.decode_workspace(2, case.num_heads, 32, 5, DEVICE)
    out = torch.empty_like(case.q)
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out, workspace=workspace
    )
    _assert_close(out, case.reference(), torch.float32)


def test_decode_reads_strided_q_and_writes_strided_out():
    # q as the attention layer gets it: a view into the fused qkv projection.
    case = _decode_case([50, 200], group=4, head_dim=64, dtype=torch.float32)
    num_heads, head_dim = case.num_heads, case.head_dim
    qkv = torch.randn(2, num_heads + 2 * case.num_kv_heads, head_dim, device=DEVICE)
    qkv[:, :num_heads] = case.q
    out_buffer = torch.full((2, num_heads * 2, head_dim), 7.0, device=DEVICE)
    out = out_buffer[:, ::2]
    attention.paged_decode_attention(
        qkv[:, :num_heads], case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
        num_splits=2,
    )
    _assert_close(out, case.reference(), torch.float32)
    assert (out_buffer[:, 1::2] == 7.0).all()


def _rope_decode_inputs(case: PagedCase, seed: int = 0, cache_dtype: torch.dtype | None = None):
    """What the attention layer has before the rotary: the unrotated q, k, v as views into one q/k/v
    projection output, the rows' positions (seq_len - 1), slots (where the block table puts key
    seq_len - 1; NaN in the cache, as not yet written) and a RotaryEmbedding over the head."""
    from test_fused_kernels import _rope

    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, head_dim = len(case.seq_lens), case.num_heads, case.num_kv_heads, case.head_dim
    qkv = (2 * torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=gen)).to(case.q.dtype).to(DEVICE)
    if cache_dtype is not None:
        case.k_cache, case.v_cache = case.k_cache.to(cache_dtype), case.v_cache.to(cache_dtype)
    positions = torch.tensor([n - 1 for n in case.seq_lens], device=DEVICE)
    slots = torch.stack([case.block_tables[b, (n - 1) // case.block_size].long() * case.block_size
                         + (n - 1) % case.block_size for b, n in enumerate(case.seq_lens)])
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, kv_heads, head_dim)[slots] = float("nan")
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    return q, k, v, positions, slots, _rope(head_dim, max_position=512)


@pytest.mark.parametrize(
    "seq_lens,group,head_dim,dtype,num_splits,single_split",
    [
        ([133], 4, 64, torch.bfloat16, None, 0),
        ([133], 4, 64, torch.bfloat16, 4, 256),
        ([1, 16, 257], 4, 32, torch.float32, 3, 0),
        ([1, 16, 257], 1, 64, torch.float16, 1, 0),
        ([2, 64, 65, 300], 2, 128, torch.bfloat16, 8, 64),
    ],
)
def test_decode_with_rope_equals_rotary_kernel_then_decode(seq_lens, group, head_dim, dtype, num_splits, single_split):
    # The fused path (rotary + KV write inside the decode kernel) against the two kernels it replaces:
    # the same rotated key and value bits in the caches at the rows' slots, and the same output up
    # to the order of the sums (the step's key is folded in after the tiles, not inside one).
    from tokenspeed_worker.kernels import rotary

    case = _decode_case(seq_lens, group, head_dim, dtype, seed=len(seq_lens) + group)
    q, k, v, positions, slots, rope = _rope_decode_inputs(case, seed=head_dim)
    outs, caches = [], []
    for fused in (True, False):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
        fused_rope = None
        q_in = q
        if fused:
            fused_rope = attention.DecodeRope(k, v, positions, rope.cos_cache, rope.sin_cache, slots)
        else:
            q_in = rotary.rope_and_write_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache,
                                            slots)
        attention.paged_decode_attention(q_in, k_cache, v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
                                         num_splits=num_splits, single_split_tokens=single_split, rope=fused_rope)
        outs.append(out)
        caches.append((k_cache, v_cache))
    _assert_close(outs[0], outs[1].float(), dtype)
    for fused_cache, plain_cache in zip(caches[0], caches[1]):
        assert torch.equal(fused_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0))  # the spare blocks stay NaN


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float32, 32)])
def test_decode_with_head_norms_equals_norm_kernels_then_rotary_then_decode(unit_offset, dtype, head_dim):
    # Qwen3's (Llama-form) and Gemma 3's ((1 + w) form) q/k norms inside the decode kernel's rotary,
    # against the norm kernel on q and k, the rotary + KV-write kernel, then the decode: the same
    # cache bits, the same output up to the order of the sums.
    from tokenspeed_worker.kernels import norm, rotary

    case = _decode_case([1, 37, 130], 2, head_dim, dtype, seed=11)
    q, k, v, positions, slots, rope = _rope_decode_inputs(case, seed=5)
    gen = torch.Generator().manual_seed(12)
    q_w, k_w = ((0.5 * torch.randn(head_dim, generator=gen) + (0.0 if unit_offset else 1.0)).to(dtype).to(DEVICE)
                for _ in range(2))
    outs, caches = [], []
    for fused in (True, False):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
        if fused:
            fused_rope = attention.DecodeRope(k, v, positions, rope.cos_cache, rope.sin_cache, slots, q_w, k_w,
                                              1e-6, unit_offset)
            attention.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens_t, case.scale,
                                             out, num_splits=2, rope=fused_rope)
        else:
            q_n = norm.rms_norm(q, q_w, 1e-6, unit_offset=unit_offset)
            k_n = norm.rms_norm(k, k_w, 1e-6, unit_offset=unit_offset)
            q_rot = rotary.rope_and_write_kv(q_n, k_n, v, positions, rope.cos_cache, rope.sin_cache, k_cache,
                                             v_cache, slots)
            attention.paged_decode_attention(q_rot, k_cache, v_cache, case.block_tables, case.seq_lens_t,
                                             case.scale, out, num_splits=2)
        outs.append(out)
        caches.append((k_cache.nan_to_num(7.0), v_cache.nan_to_num(7.0)))
    _assert_close(outs[0], outs[1].float(), dtype)
    # the norm's mean of squares is summed in another order: at most a rounding step in a key
    if dtype == torch.bfloat16:
        torch.testing.assert_close(caches[0][0], caches[1][0], atol=0, rtol=2**-7)
    else:
        torch.testing.assert_close(caches[0][0], caches[1][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][1], caches[1][1])


def test_decode_with_rope_into_an_fp8_cache_saturates_like_the_rotary_kernel():
    from tokenspeed_worker.kernels import rotary

    fp8 = torch.float8_e4m3fn
    case = _decode_case([40, 129], group=4, head_dim=64, dtype=torch.bfloat16, seed=9)
    q, k, v, positions, slots, rope = _rope_decode_inputs(case, seed=2, cache_dtype=fp8)
    k.mul_(300)  # some rotated keys and values saturate at 448
    v.mul_(300)
    outs, caches = [], []
    for fused in (True, False):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
        if fused:
            rope_args = attention.DecodeRope(k, v, positions, rope.cos_cache, rope.sin_cache, slots)
            attention.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens_t, case.scale, out,
                                             num_splits=2, rope=rope_args)
        else:
            q_rot = rotary.rope_and_write_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache,
                                             slots)
            attention.paged_decode_attention(q_rot, k_cache, v_cache, case.block_tables, case.seq_lens_t, case.scale,
                                             out, num_splits=2)
        outs.append(out)
        caches.append((k_cache.float().nan_to_num(7.0), v_cache.float().nan_to_num(7.0)))
    assert caches[0][0].abs().max() == 448.0
    _assert_close(outs[0], outs[1].float(), torch.bfloat16)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("field", ["k", "cos_cache", "positions"])
def test_decode_rejects_rope_inputs_that_do_not_fit_and_names_them(field):
    case = _decode_case([20, 20], group=2, head_dim=32, dtype=torch.float32)
    q, k, v, positions, slots, rope = _rope_decode_inputs(case)
    args = dict(k=k, v=v, positions=positions, cos_cache=rope.cos_cache, sin_cache=rope.sin_cache, slot_mapping=slots)
    args[field] = {"k": k[:, :1], "cos_cache": rope.cos_cache[:, :16], "positions": positions[:1]}[field]
    with pytest.raises(ValueError, match=field.split("_")[0]):
        attention.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t,
                                         case.scale, torch.empty(q.shape, device=DEVICE),
                                         rope=attention.DecodeRope(**args))


@pytest.mark.parametrize("which", ["batch", "counter", "pair"])
def test_decode_rejects_a_workspace_too_small(which):
    case = _decode_case([20, 20], group=1, head_dim=32, dtype=torch.float32)
    workspace = attention.decode_workspace(1 if which == "batch" else 2, case.num_heads, 32, 4, DEVICE)
    if which == "counter":
        workspace = (workspace[0], workspace[1], workspace[2][:, :1])  # Hkv is 2
    elif which == "pair":
        workspace = workspace[:2]  # no arrival counter: the pre-fusion (partial_out, partial_lse)
    with pytest.raises(ValueError, match="workspace"):
        attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale,
            torch.empty_like(case.q), num_splits=4, workspace=workspace,
        )


def test_choose_num_splits_fills_the_gpu_without_splitting_short_contexts():
    assert attention.choose_num_splits(1, 8, 8192, "cpu") > 8  # batch 1: split to fill 132 SMs
    assert attention.choose_num_splits(1, 8, 8192, "cpu") <= attention.MAX_SPLITS
    assert attention.choose_num_splits(256, 8, 8192, "cpu") == 1  # already 2048 programs
    assert attention.choose_num_splits(1, 8, 60, "cpu") == 1  # one short split is enough


EXTEND_CASES = {
    # (context_lens, query_lens) per request: prefix hits, chunks, fresh prompts and decode rows.
    1: ([0], [77]),
    3: ([0, 48, 130], [33, 1, 70]),
    8: ([0, 16, 5, 100, 0, 31, 200, 1], [1, 40, 1, 17, 64, 1, 33, 2]),
}


@pytest.mark.parametrize(
    "batch,group,head_dim,dtype",
    [
        (1, 1, 32, torch.float32),
        (1, 4, 64, torch.bfloat16),
        (3, 4, 64, torch.float32),
        (3, 1, 128, torch.bfloat16),
        (8, 4, 32, torch.float32),
        (8, 4, 128, torch.bfloat16),
    ],
)
def test_extend_matches_reference(batch, group, head_dim, dtype):
    context_lens, query_lens = EXTEND_CASES[batch]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    case = PagedCase(seq_lens, query_lens, 2, group, head_dim, dtype, seed=batch + group)
    out = torch.empty_like(case.q)
    attention.paged_extend_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.seq_lens_t,
        case.scale, out, max(query_lens),
    )
    _assert_close(out, case.reference(), dtype)


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (40, 0.0), (0, 1.5), (24, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_windows_and_soft_caps_match_reference(window, softcap, dtype):
    """Gemma's layers: each query over its last `window` positions (windows shorter than a tile,
    than a split, than the sequence, and across tile edges), scores soft-capped; the decode kernel
    with one split, several and the single-split threshold, the extend kernel over prefixes,
    chunks and decode rows."""
    seq_lens = [1, 16, 57, 300]
    case = _decode_case(seq_lens, 4, 64, dtype, seed=window + int(softcap))
    for num_splits, single in ((1, 0), (3, 0), (8, 64)):
        out = torch.empty_like(case.q)
        attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t,
                                         case.scale, out, num_splits=num_splits, single_split_tokens=single,
                                         window=window, softcap=softcap)
        _assert_close(out, case.reference(window, softcap), dtype)
    context_lens, query_lens = EXTEND_CASES[8]
    case = PagedCase([c + q for c, q in zip(context_lens, query_lens)], query_lens, 2, 4, 64, dtype, seed=3)
    out = torch.empty_like(case.q)
    attention.paged_extend_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
                                     case.seq_lens_t, case.scale, out, max(query_lens), window=window, softcap=softcap)
    _assert_close(out, case.reference(window, softcap), dtype)


def test_extend_with_a_larger_max_query_len_and_an_empty_query():
    # A padded batch (CUDA graphs, or a request with nothing to compute this step): the extra
    # query tiles and the zero-length request write nothing.
    context_lens, query_lens = [10, 3, 0], [20, 0, 9]
    seq_lens = [max(1, c + q) for c, q in zip(context_lens, query_lens)]
    case = PagedCase(seq_lens, query_lens, 2, 4, 32, torch.float32, seed=3)
    out = torch.empty_like(case.q)
    attention.paged_extend_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.seq_lens_t,
        case.scale, out, 200,
    )
    _assert_close(out, case.reference(), torch.float32)


def test_extend_of_single_token_queries_equals_decode():
    case = _decode_case([1, 31, 90], group=4, head_dim=64, dtype=torch.float32, seed=5)
    decoded, extended = torch.empty_like(case.q), torch.empty_like(case.q)
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, decoded, num_splits=3
    )
    attention.paged_extend_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.seq_lens_t,
        case.scale, extended, 1,
    )
    torch.testing.assert_close(decoded, extended, atol=2e-6, rtol=2e-6)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm (layers/layernorm.py): statistics in float32, weight in the model dtype.
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 96), (torch.bfloat16, 256), (torch.float16, 1000)])
def test_fused_add_rms_norm_matches_reference_and_updates_residual_in_place(dtype, hidden):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(5, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    expected_residual = x + residual
    expected = _rms_norm_reference(expected_residual, weight, 1e-6)
    normed, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    # The mean of squares is summed in another order: at most one rounding step apart.
    torch.testing.assert_close(normed, expected, **TOLERANCE[dtype])


def test_rms_norm_matches_reference():
    x = torch.randn(3, 4, 128, device=DEVICE).to(torch.bfloat16)
    weight = torch.randn(128, device=DEVICE).to(torch.bfloat16)
    torch.testing.assert_close(norm.rms_norm(x, weight, 1e-5), _rms_norm_reference(x, weight, 1e-5),
                               **TOLERANCE[torch.bfloat16])


gpu = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_decode_llama_8b_shape_on_gpu(num_splits):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 3000, (24,), generator=gen).tolist()
    case = _decode_case(seq_lens, group=4, head_dim=128, dtype=torch.bfloat16, num_kv_heads=8)
    out = torch.empty_like(case.q)
    attention.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale, out, num_splits=num_splits
    )
    _assert_close(out, case.reference(), torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 1), (256, 2)])
def test_extend_long_prefill_on_gpu(head_dim, group):
    context_lens, query_lens = [0, 700, 0, 1500], [1024, 300, 1, 1]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    case = PagedCase(seq_lens, query_lens, 4, group, head_dim, torch.bfloat16, seed=2)
    out = torch.empty_like(case.q)
    attention.paged_extend_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.seq_lens_t,
        case.scale, out, max(query_lens),
    )
    _assert_close(out, case.reference(), torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_decode_replays_in_a_cuda_graph():
    # Captured once with one num_splits and workspace; replayed with other lengths in place.
    case = _decode_case([900, 5, 64, 1], group=4, head_dim=128, dtype=torch.bfloat16, num_kv_heads=8)
    out = torch.empty_like(case.q)
    workspace = attention.decode_workspace(4, case.num_heads, 128, 16, DEVICE)
    seq_lens = case.seq_lens_t.clone()

    def step():
        attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, seq_lens, case.scale, out,
            num_splits=16, workspace=workspace,
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([900, 5, 64, 1], [3, 5, 1, 1], [450, 2, 64, 1]):  # within what the cache holds
        case.seq_lens = lens
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, case.reference(), torch.bfloat16)
        assert (workspace[2] == 0).all()  # every replay leaves the arrival counters at 0


@pytest.mark.gpu
@gpu
def test_decode_batch_1_graph_with_64_splits_on_gpu():
    # The serving shape this launch was fused for: batch 1, Llama-8B heads, a graph captured with
    # 64 splits replayed for short and long contexts (one split, a few, all 64 busy), many times
    # in a row so that a missed counter reset or a reduce that reads unfinished partials shows.
    case = _decode_case([8192], group=4, head_dim=128, dtype=torch.bfloat16, num_kv_heads=8)
    out = torch.empty_like(case.q)
    workspace = attention.decode_workspace(1, case.num_heads, 128, 64, DEVICE, num_kv_heads=8)
    seq_lens = case.seq_lens_t.clone()

    def step():
        attention.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, seq_lens, case.scale, out,
            num_splits=64, workspace=workspace,
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seq_len in (128, 129, 200, 256, 1000, 8192, 77):
        case.seq_lens = [seq_len]
        seq_lens.fill_(seq_len)
        expected = case.reference()
        for _ in range(50):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _assert_close(out, expected, torch.bfloat16)
        assert (workspace[2] == 0).all()


# -- greedy argmax over the vocabulary (kernels/sampling.py) ---------------------------


def test_gumbel_draw_never_takes_a_filtered_token_at_the_largest_hash():
    # (seed 14991, position 0, index 1065): the 24 hashed bits all ones, whose noise was +inf (and NaN on a
    # filtered token) before the uniform was kept below 1; the kernel draws what the torch backend draws.
    from tokenspeed_worker.kernels import sampling
    from tokenspeed_worker.sampling.sampler import row_keys

    gen = torch.Generator().manual_seed(3)
    scores = torch.randn((1, 4096), generator=gen)
    scores[0, 1065] = float("-inf")
    keys = row_keys(torch.tensor([14991]), torch.tensor([0]))
    got = sampling.gumbel_argmax(scores.to(DEVICE), keys.to(DEVICE), block=512).cpu()
    gumbel = -torch.log(-torch.log(hashed_uniform_cpu(14991, 0, 4096)))
    assert got.item() != 1065 and got.item() == int((scores + gumbel).argmax())


def hashed_uniform_cpu(seed: int, position: int, vocab: int) -> torch.Tensor:
    from tokenspeed_worker.sampling.sampler import hashed_uniform

    return hashed_uniform(torch.tensor([seed]), torch.tensor([position]), vocab)


@pytest.mark.parametrize("rows,vocab,block", [(1, 1000, 128), (5, 4096, 512), (3, 777, 64), (2, 1, 64)])
def test_chunked_argmax_equals_torch_argmax_with_ties(rows, vocab, block):
    from tokenspeed_worker.kernels import sampling

    gen = torch.Generator().manual_seed(rows * vocab)
    scores = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # many ties across chunks
    scores[0, vocab // 2:] = 3.0  # the row's maximum repeats in many chunks: the first must win
    scores = scores.to(DEVICE)
    got = sampling.argmax(scores, block=block)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), scores.cpu().argmax(dim=-1))
    # A strided view (every other row) and -inf entries, as filtered scores have.
    wide = torch.full((2 * rows, vocab), float("-inf"), device=DEVICE)
    wide[::2] = scores
    assert torch.equal(sampling.argmax(wide[::2], block=block).cpu(), scores.cpu().argmax(dim=-1))


@pytest.mark.parametrize("rows,vocab,block,dtype", [(1, 1000, 128, torch.bfloat16), (5, 4096, 512, torch.float16),
                                                    (3, 777, 64, torch.float32), (2, 1, 64, torch.bfloat16)])
def test_widen_and_argmax_equals_the_copy_and_torch_argmax_and_reuses_its_workspace(rows, vocab, block, dtype):
    # The decode graphs' tail in one launch: the float32 logits and the first maximum of each row,
    # with ties across chunks; the workspace (counters back at zero) serves the next call, as a
    # replay reuses it, including a call with fewer rows.
    from tokenspeed_worker.kernels import sampling

    workspace = sampling.argmax_workspace(rows + 2, vocab, DEVICE, block=block)
    for seed in range(2):
        gen = torch.Generator().manual_seed(rows * vocab + seed)
        logits = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype)
        logits[0, vocab // 2:] = 3.0  # the row's maximum repeats in many chunks: the first must win
        logits = logits.to(DEVICE)
        out_logits = torch.full((rows, vocab), 7.0, device=DEVICE)
        tokens = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
        sampling.widen_and_argmax(logits, out_logits, tokens, workspace, block=block)
        assert torch.equal(out_logits, logits.float())
        assert torch.equal(tokens.cpu(), logits.float().cpu().argmax(dim=-1))
        assert int(workspace[2].abs().sum()) == 0
        rows = max(1, rows - 1)


def test_widen_and_argmax_rejects_a_workspace_too_small():
    from tokenspeed_worker.kernels import sampling

    logits = torch.zeros((3, 100), device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        sampling.widen_and_argmax(logits, torch.empty_like(logits), torch.empty(3, dtype=torch.int64, device=DEVICE),
                                  sampling.argmax_workspace(2, 100, DEVICE))
