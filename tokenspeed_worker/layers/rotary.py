"""Rotary position embedding (neox style, as Llama and Qwen use it), with llama3 frequency scaling.

cos/sin are precomputed in float32 for every position up to max_position_embeddings and
cast to the activations' dtype when applied, the way Hugging Face does it.

`rope_and_write_kv` also writes the rotated k and the raw v into a paged KV cache; on CUDA it
is one Triton kernel (kernels/rotary.py, same roundings), used by
Attention.forward_with_rotary with backends that attend over K/V written beforehand. The torch
code stays the reference path (CPU, no triton, or switched off in layers/fused_kernels.py:
TOKENSPEED_FUSED_KERNELS).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenspeed_worker.layers.fused_kernels import FUSED_DTYPES, use_fused
from tokenspeed_worker.layers.kv_cache import write_kv_cache

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters_from_config(config: Any) -> dict:
    """The rope dict of a config, in transformers 5's form: {"rope_type", "rope_theta", ...}.

    transformers 5 keeps everything in `config.rope_parameters`; older configs spread it
    over `rope_theta` and `rope_scaling` (whose type key may be "type"). Both are accepted.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy_scaling = getattr(config, "rope_scaling", None)
    if not params and legacy_scaling:
        params = dict(legacy_scaling)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    params.setdefault("rope_type", params.pop("type", None) or "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    if params["rope_type"] == "llama3":
        params.setdefault(
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings,
        )
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        rope_type = rope_parameters["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
        base = rope_parameters["rope_theta"]
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).to(torch.float32) / self.rotary_dim
        inv_freq = 1.0 / (base**exponents)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not parameters: excluded from the state dict, rebuilt from the config.
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim], positions: [T]."""
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def fuses(self, q: torch.Tensor) -> bool:
        """Whether rope_and_write_kv runs the fused kernel for q (the switch, the dtype, an even rotary_dim)."""
        return q.dtype in FUSED_DTYPES and self.rotary_dim % 2 == 0 and use_fused(q, "rotary") is not None

    def rope_and_write_kv(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # views as [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> torch.Tensor:
        """Rotary on q (returned, contiguous) and k; the rotated k and v written into the caches at
        slot_mapping. One kernel when `fuses(q)`, else forward + index_copy_ (the same values)."""
        if self.fuses(q):
            return use_fused(q, "rotary").rope_and_write_kv(
                q, k, v, positions, self.cos_cache, self.sin_cache, k_cache, v_cache, slot_mapping
            )
        q, k = self.forward(positions, q, k)
        write_kv_cache(k_cache, v_cache, slot_mapping, k, v)
        return q.contiguous()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return x * cos + _rotate_half(x) * sin
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, passthrough), dim=-1)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters_from_config(config))
