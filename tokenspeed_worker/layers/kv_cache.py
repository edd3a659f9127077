"""Writing a step's keys and values into the paged KV cache (torch; the fused kernel does it on CUDA)."""

from __future__ import annotations

import torch


def saturation_limit(dtype: torch.dtype) -> float:
    """Where writes into a cache of this dtype saturate: an fp8 dtype's largest finite value (e4m3 has
    no infinity); 0.0 (no saturation) for wider dtypes. Both write paths use it (here and the Triton
    write kernel, kernels/rotary.py)."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 and dtype.is_floating_point else 0.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype, saturated into an fp8 cache (saturation_limit)."""
    if x.dtype == dtype:
        return x
    limit = saturation_limit(dtype)
    return x.clamp(-limit, limit).to(dtype) if limit else x.to(dtype)


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into the caches (viewed as [slots, Hkv, D]) at slot_mapping [T]: a device scatter,
    graph-safe. An fp8 cache is written through byte views (torch has no fp8 index_copy_ on CPU)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows, values = cache.view(-1, num_kv_heads, head_dim), to_cache_dtype(x, cache.dtype)
        if cache.element_size() == 1:
            rows, values = rows.view(torch.uint8), values.view(torch.uint8)
        rows.index_copy_(0, slot_mapping, values)
