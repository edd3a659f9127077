"""Writing a step's keys and values into the paged KV cache (torch; the fused kernel does it on CUDA)."""

from __future__ import annotations

import torch


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into the caches (viewed as [slots, Hkv, D]) at slot_mapping [T]: a device scatter,
    graph-safe."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
