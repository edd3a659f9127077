"""Rotary position embedding (neox style, as Llama, Qwen, Mistral and Phi-3 use it), with the
frequency scalings of long-context checkpoints.

cos/sin are precomputed in float32 for every position up to max_position_embeddings (or the
served length, where a scaling stretches the positions past it) and cast to the activations'
dtype when applied, the way Hugging Face does it. The inverse
frequencies and the attention scaling (YaRN's and longrope's factor on cos/sin) come from
transformers' own rope functions (`ROPE_INIT_FUNCTIONS`), so each type computes what
transformers computes:

- "default", "linear", "llama3", "yarn": fixed frequencies, exactly transformers'.
- "longrope" (Phi-3 128k): transformers takes the long factors for a whole forward once its
  longest position passes original_max_position_embeddings, the short ones before. A server
  rotates every position of every request alike (the KV cache keeps keys rotated once): the long
  factors when the served length (--max-model-len, `serving_length`) passes
  original_max_position_embeddings, else the short ones. Equal to transformers for any sequence
  when the served length is within the original length, and for sequences past it otherwise.
- "dynamic" (NTK): transformers rescales the base for a forward whose longest position passes
  max_position_embeddings. Here the base is scaled once for the served length (unchanged when
  that is within max_position_embeddings, then equal to transformers).

Any other type is one clear startup error.

`rope_and_write_kv` also writes the rotated k and the raw v into a paged KV cache; on CUDA it
is one Triton kernel (kernels/rotary.py, same roundings), used by
Attention.forward_with_rotary with backends that attend over K/V written beforehand. The torch
code stays the reference path (CPU, no triton, or switched off in layers/fused_kernels.py:
TOKENSPEED_FUSED_KERNELS).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tokenspeed_worker.layers.fused_kernels import FUSED_DTYPES, use_fused
from tokenspeed_worker.layers.kv_cache import write_kv_cache

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

_SERVING_LENGTH: int | None = None  # the served --max-model-len while a runner builds its model


@contextmanager
def serving_length(length: int | None) -> Iterator[None]:
    """Within the block, rotary tables are built for sequences of at most `length` positions
    (longrope's and dynamic NTK's choice, module docstring); None: max_position_embeddings."""
    global _SERVING_LENGTH
    previous, _SERVING_LENGTH = _SERVING_LENGTH, length
    try:
        yield
    finally:
        _SERVING_LENGTH = previous


def served_length() -> int | None:
    """The served length set by `serving_length` (None outside it)."""
    return _SERVING_LENGTH


def rope_parameters_from_config(config: Any, layer_type: str | None = None) -> dict:
    """The rope dict of a config, in transformers 5's form: {"rope_type", "rope_theta", ...}.

    transformers 5 keeps everything in `config.rope_parameters`; older configs spread it
    over `rope_theta` and `rope_scaling` (whose type key may be "type"). Both are accepted.
    Per-layer-type parameters (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}})
    take `layer_type`'s.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy_scaling = getattr(config, "rope_scaling", None)
    if not params and legacy_scaling:
        params = dict(legacy_scaling)
    if params and all(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            raise ValueError(f"per-layer-type rope parameters ({', '.join(sorted(params))}) without one for "
                             f"{layer_type or 'this model'}'s layers")
        params = dict(params[layer_type])
    params.setdefault("rope_type", params.pop("type", None) or "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault(
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings,
        )
    return params


def rope_frequencies(config: Any, head_dim: int, length: int | None = None,
                     layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [rotary_dim / 2], attention scaling of cos/sin) for config's
    rope (layer_type's, where the config has one per layer type), by transformers' rope
    functions, for sequences of at most `length` positions (module docstring; default
    max_position_embeddings)."""
    params = rope_parameters_from_config(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    rotary_dim = int(head_dim * params["partial_rotary_factor"])
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers' functions read the config's rope_parameters (and head_dim): hand them a copy in
    # transformers 5's form, whatever form the checkpoint's config.json took
    config = copy.copy(config)
    config.rope_parameters = params
    config.head_dim = head_dim
    length = length or config.max_position_embeddings
    seq_len = None
    if rope_type == "longrope" and length > params["original_max_position_embeddings"]:
        seq_len = params["original_max_position_embeddings"] + 1  # the long factors
    elif rope_type == "dynamic" and length > config.max_position_embeddings:
        seq_len = length
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.float(), float(attention_scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        """Tables for positions [0, max_position): cos/sin of position * inv_freq (rotary_dim =
        2 * len(inv_freq) of the head's first dimensions rotate), times attention_scaling."""
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        positions = torch.arange(max_position, dtype=torch.float32)  # on the default device (the model's)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not parameters: excluded from the state dict, rebuilt from the config.
        self.register_buffer("cos_cache", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_scaling, persistent=False)

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


def get_rope(config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """The model's rotary tables (layer_type's, where the config has one rope per layer type), for
    the served length where a runner set one (`serving_length`)."""
    inv_freq, attention_scaling = rope_frequencies(config, head_dim, _SERVING_LENGTH, layer_type)
    return RotaryEmbedding(head_dim, max(config.max_position_embeddings, _SERVING_LENGTH or 0), inv_freq,
                           attention_scaling)


def rope_from_parameters(head_dim: int, max_position: int, rope_parameters: dict) -> RotaryEmbedding:
    """Rotary tables for a rope dict in transformers 5's form (tests and benchmarks)."""
    from transformers import PretrainedConfig

    config = PretrainedConfig(rope_parameters=dict(rope_parameters), max_position_embeddings=max_position,
                              head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1)
    return RotaryEmbedding(head_dim, max_position, *rope_frequencies(config, head_dim))
