"""Torch stand-ins for the Triton attention kernels (kernels/attention.py), with their exact signatures.

`reference_triton_backend` runs the triton backend's dispatch and metadata on them where the
kernels cannot run (CPU), so tests check that logic against the torch backend; the kernel tests
compare the kernels with them. Slow, simple, and free of host syncs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tokenspeed_worker.kernels.attention import DecodeRope
from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend, triton_attention_kernels
from tokenspeed_worker.layers.kv_cache import write_kv_cache
from tokenspeed_worker.layers.rotary import _rotate_half


def rotate_full_head(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated over the whole head at positions [T] (RotaryEmbedding.forward with
    rotary_dim == D, in x's dtype): the decode kernel's own rotary."""
    cos = cos_cache[positions].to(x.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(x.dtype).unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """layers/layernorm.RMSNorm's torch path over each head (GemmaRMSNorm's where unit_offset)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def reference_kernels() -> SimpleNamespace:
    """The kernels' interface on the torch functions below (no split count or workspace)."""
    return SimpleNamespace(
        __name__="reference torch functions",
        is_reference=True,
        paged_decode_attention=reference_paged_decode_attention,
        paged_extend_attention=reference_paged_extend_attention,
    )


def reference_triton_backend(device: str | torch.device = "cpu") -> TritonAttentionBackend:
    """The triton backend on the real kernels where they can run (CUDA), else on reference_kernels()."""
    kernels = triton_attention_kernels()[0] if torch.device(device).type == "cuda" else None
    return TritonAttentionBackend(device, kernels=kernels or reference_kernels())


def reference_paged_extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    max_query_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Each query token attends over its request's keys up to its own position (causal after the
    cached context; the last `window` of them with a window), gathered through the block table,
    scores soft-capped with `softcap`. Per token, over the table's full width: slow, simple, and
    free of host syncs."""
    num_tokens = q.shape[0]
    num_reqs, width = block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    device = q.device
    starts = query_start_loc.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    context_lens = seq_lens.to(torch.int64) - query_lens
    owner = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens, output_size=num_tokens)
    position = context_lens[owner] + torch.arange(num_tokens, device=device) - starts[:-1][owner]  # [T]
    key_pos = torch.arange(width * block_size, device=device)
    # Entries past a request's last block may be any bytes (the kernels mask them; the decode
    # graphs' packed buffer leaves them stale): clamped into the pool, gathered, masked below.
    table = block_tables.to(torch.int64).clamp(0, k_cache.shape[0] - 1)
    slots = table[owner][:, key_pos // block_size] * block_size + key_pos % block_size
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)  # [T, Hkv, L, D]
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)
    visible = key_pos[None, :] <= position[:, None]
    if window:
        visible = visible & (key_pos[None, :] > position[:, None] - window)
    mask = visible[:, None, None, :]  # [T, 1, 1, L]
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if softcap:
        group = q.shape[1] // num_kv_heads
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.unsqueeze(2), keys.transpose(-1, -2)) * scale  # [T, H, 1, L]
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
    else:
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != num_kv_heads,
        )
    out.copy_(o.squeeze(2))


def reference_paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    out: torch.Tensor,  # [B, H, D]
    num_splits: int | None = None,
    workspace: object | None = None,
    single_split_tokens: int = 0,
    rope: DecodeRope | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """One query token per request at position seq_len - 1 (the split count does not change the
    result); with rope, q and rope.k unrotated: rotated here, k and v written at the slots first."""
    if rope is not None:
        k = rope.k
        if rope.q_norm_weight is not None:
            q = _head_norm(q, rope.q_norm_weight, rope.norm_eps, rope.norm_unit_offset)
            k = _head_norm(k, rope.k_norm_weight, rope.norm_eps, rope.norm_unit_offset)
        q = rotate_full_head(q, rope.positions, rope.cos_cache, rope.sin_cache)
        k = rotate_full_head(k, rope.positions, rope.cos_cache, rope.sin_cache)
        write_kv_cache(k_cache, v_cache, rope.slot_mapping, k, rope.v)
    batch_size = q.shape[0]
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device=q.device)
    reference_paged_extend_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, max_query_len=1,
        window=window, softcap=softcap,
    )
