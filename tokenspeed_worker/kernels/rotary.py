"""Triton rotary embedding (neox style) fused with the step's KV-cache write.

`rope_and_write_kv` takes q [T, H, D], k and v [T, Hkv, D] (views of the fused qkv projection:
any strides over tokens and heads, contiguous along D), the positions and the float32 cos/sin
tables of layers/rotary.RotaryEmbedding, and in one launch writes the rotated q to a new
contiguous [T, H, D] tensor, and the rotated k and the raw v straight into the paged cache at
`slot_mapping` (the caches viewed as [num_slots, Hkv, D]), replacing torch's ~10 rotary ops, the
q copy and the two index_copy_ of the attention backend.

Rounded as layers/rotary.py (Hugging Face) computes `x * cos + rotate_half(x) * sin` in the
model dtype: cos and sin are rounded to the dtype, each product is rounded to the dtype, and
the sum is rounded again (products and sum computed in float32, with fp contraction off so
float32 matches torch exactly). Partial rotary (rotary_dim < D) passes the rest of each head
through unchanged. The layers use it through layers/fused_kernels.py (TOKENSPEED_FUSED_KERNELS).

Importable without triton (CPU machines): AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

import torch

from tokenspeed_worker.kernels.norm import AVAILABLE
from tokenspeed_worker.kernels import pdl
from tokenspeed_worker.layers.kv_cache import saturation_limit

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """x rounded to dtype, back in float32."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rotate_heads(
        src, stride_src_h, dst, stride_dst_h, heads, num_heads,
        cos1, sin1, cos2, sin2,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
        SATURATE: tl.constexpr = 0.0,
    ):
        """Rotate heads `heads` (those < num_heads) of one token from src into dst. SATURATE > 0:
        clamp to +-SATURATE before the store (an fp8 KV cache: e4m3 has no infinity)."""
        dtype = src.dtype.element_ty
        in_heads = heads < num_heads
        d = tl.arange(0, BLOCK_HALF)
        mask = in_heads[:, None] & (d < HALF)[None, :]
        src_rows = src + heads[:, None] * stride_src_h
        dst_rows = dst + heads[:, None] * stride_dst_h
        x1 = tl.load(src_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_rows + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1]; negation is exact.
        out1 = _round(_round(x1 * cos1, dtype) - _round(x2 * sin1, dtype), dtype)
        out2 = _round(_round(x2 * cos2, dtype) + _round(x1 * sin2, dtype), dtype)
        if SATURATE > 0:
            out1 = tl.clamp(out1, -SATURATE, SATURATE)
            out2 = tl.clamp(out2, -SATURATE, SATURATE)
        tl.store(dst_rows + d[None, :], out1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst_rows + HALF + d[None, :], out2.to(dst.dtype.element_ty), mask=mask)
        if PASS > 0:
            p = tl.arange(0, BLOCK_PASS)
            pass_mask = in_heads[:, None] & (p < PASS)[None, :]
            rest = tl.load(src_rows + 2 * HALF + p[None, :], mask=pass_mask, other=0.0)
            if SATURATE > 0:
                rest = tl.clamp(rest.to(tl.float32), -SATURATE, SATURATE)
            tl.store(dst_rows + 2 * HALF + p[None, :], rest.to(dst.dtype.element_ty), mask=pass_mask)

    @triton.jit
    def _rope_and_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
        stride_q_out_t, stride_q_out_h, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
        stride_cos, stride_sin,
        num_heads, num_kv_heads,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        KV_SATURATE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (t, j): token t; j < cdiv(H, BLOCK_H) rotates a block of q heads, the rest a
        block of k heads (into the cache) and copy the same v heads."""
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        dtype = q_ptr.dtype.element_ty
        position = tl.load(positions_ptr + t).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)
        in_half = d < HALF
        cos1 = _round(tl.load(cos_ptr + position * stride_cos + d, mask=in_half, other=0.0), dtype)
        cos2 = _round(tl.load(cos_ptr + position * stride_cos + HALF + d, mask=in_half, other=0.0), dtype)
        sin1 = _round(tl.load(sin_ptr + position * stride_sin + d, mask=in_half, other=0.0), dtype)
        sin2 = _round(tl.load(sin_ptr + position * stride_sin + HALF + d, mask=in_half, other=0.0), dtype)
        num_q_blocks = tl.cdiv(num_heads, BLOCK_H)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if PDL:  # positions, slots and the tables are inputs of the step; q, k, v come from the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if j < num_q_blocks:
            heads = j * BLOCK_H + tl.arange(0, BLOCK_H)
            _rotate_heads(
                q_ptr + t * stride_q_t, stride_q_h, q_out_ptr + t * stride_q_out_t, stride_q_out_h, heads, num_heads,
                cos1[None, :], sin1[None, :], cos2[None, :], sin2[None, :],
                HALF, BLOCK_HALF, PASS, BLOCK_PASS,
            )
        else:
            heads = (j - num_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
            _rotate_heads(
                k_ptr + t * stride_k_t, stride_k_h, k_cache_ptr + slot * stride_kc_slot, stride_kc_h,
                heads, num_kv_heads,
                cos1[None, :], sin1[None, :], cos2[None, :], sin2[None, :],
                HALF, BLOCK_HALF, PASS, BLOCK_PASS, KV_SATURATE,
            )
            dd = tl.arange(0, BLOCK_D)
            v_mask = (heads < num_kv_heads)[:, None] & (dd < HEAD_DIM)[None, :]
            v = tl.load(v_ptr + t * stride_v_t + heads[:, None] * stride_v_h + dd[None, :], mask=v_mask, other=0.0)
            if KV_SATURATE > 0:
                v = tl.clamp(v.to(tl.float32), -KV_SATURATE, KV_SATURATE)
            tl.store(
                v_cache_ptr + slot * stride_vc_slot + heads[:, None] * stride_vc_h + dd[None, :],
                v.to(v_cache_ptr.dtype.element_ty), mask=v_mask,
            )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_and_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # int [T]
    cos_cache: torch.Tensor,  # float32 [max_position, rotary_dim]
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,  # any shape that views as [num_slots, Hkv, D], e.g. [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [T], each a valid slot
) -> torch.Tensor:
    """Rotate q into a new contiguous [T, H, D] tensor (returned); rotate k into k_cache and copy v
    into v_cache at slot_mapping (cast to the caches' dtype). Slots must be valid; positions must
    index the tables."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    rotary_dim = cos_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin tables {tuple(cos_cache.shape)} do not fit head_dim {head_dim}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    cos_cache, sin_cache = _last_dim_contiguous(cos_cache), _last_dim_contiguous(sin_cache)
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    block_d = triton.next_power_of_2(head_dim)
    # About 1024 elements of q (or of k and of v) per program: H=32, Hkv=8, D=128 is 4 + 1 programs a token.
    block_h = max(1, min(triton.next_power_of_2(max(num_kv_heads, 1)), 1024 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    pdl_on = pdl.enabled(q.device)
    _rope_and_write_kv_kernel[grid](
        q, k, v, positions, cos_cache, sin_cache, q_out, k_slots, v_slots, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_slots.stride(0), k_slots.stride(1), v_slots.stride(0), v_slots.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        num_heads, num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(max(half, 1)), PASS=rest,
        BLOCK_PASS=triton.next_power_of_2(max(rest, 1)),
        BLOCK_H=block_h,
        KV_SATURATE=saturation_limit(k_cache.dtype),
        PDL=pdl_on,
        **pdl.launch_options(pdl_on),
        num_warps=4 if block_h * block_d >= 1024 else max(1, block_h * block_d // 256),
        enable_fp_fusion=False,  # float32: x * cos + ... rounded after each product, as torch
    )
    return q_out


__all__ = ["AVAILABLE", "rope_and_write_kv"]
