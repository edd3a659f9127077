"""The attention module the models hold: one per layer, bound to its KV cache and the backend by the runner."""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed_worker.layers.attention.backend import AttentionBackend, GraphHoles
from tokenspeed_worker.layers.layernorm import RMSNorm
from tokenspeed_worker.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        """sliding_window: each query sees the last `sliding_window` positions only (Gemma's local
        layers); logit_softcap: scores capped by softcap * tanh(scores / softcap) (Gemma 2). Either
        needs a backend with supports_windows_and_softcap (the runner checks)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window or None
        self.logit_softcap = logit_softcap or None
        # Plain attributes, not buffers: the cache is not part of the weights.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend) -> None:
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend

    def forward_with_rotary(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, H, D], may be a strided view
        k: torch.Tensor,  # [T, Hkv, D], may be a strided view
        v: torch.Tensor,  # [T, Hkv * D] or [T, Hkv, D]
        rotary_emb: RotaryEmbedding,
        attn_metadata: object,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """(q_norm and k_norm over each head,) rotary on q and k, then attention -> [T, H * D].

        With the fused kernels on (rotary_emb.fuses, layers/fused_kernels.py): where the backend
        rotates inside its attention kernel (`fuses_rope`: decode steps of the triton backend),
        one kernel does it all, the head norms included where it takes them; else, with a backend
        that attends over K/V written beforehand, one kernel rotates q and writes the rotated k and
        v into the cache, and the backend only attends; otherwise rotary_emb, then forward. While a
        piecewise graph is captured (attn_metadata a GraphHoles), the norms, the rotary and the KV
        write (at the static slots) stay in the piece where the backend attends over K/V written
        beforehand, and only the attention runs between the pieces; otherwise all of it does."""
        if isinstance(attn_metadata, GraphHoles):
            if self.backend is not None and self.backend.supports_prewritten_kv:
                if q_norm is not None:
                    q, k = q_norm(q), k_norm(k)
                return self.attend_prewritten(self.rope_and_write_kv(positions, q, k, v, rotary_emb, attn_metadata),
                                              attn_metadata)
            return attn_metadata.hole(
                lambda md, p, q_, k_, v_: self.forward_with_rotary(p, q_, k_, v_, rotary_emb, md, q_norm, k_norm),
                positions, q, k, v)
        fused = self.fuses_rope(rotary_emb, q, attn_metadata)
        norms = {}
        if q_norm is not None:
            if fused and self._fuses_head_norms(q_norm, k_norm, q):
                norms = {"q_norm": q_norm, "k_norm": k_norm}
            else:
                q, k = q_norm(q), k_norm(k)
        if fused:
            out = self.backend.attend_rotary(
                q, k, v.view(-1, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache, attn_metadata,
                self.scale, positions, rotary_emb.cos_cache, rotary_emb.sin_cache, **self._extras(), **norms,
            )
            return out.view(-1, self.num_heads * self.head_dim)
        if self.backend is not None and self.backend.supports_prewritten_kv and rotary_emb.fuses(q):
            return self.attend_prewritten(self.rope_and_write_kv(positions, q, k, v, rotary_emb, attn_metadata),
                                          attn_metadata)
        q, k = rotary_emb(positions, q, k)
        return self(q, k, v, attn_metadata)

    def _fuses_head_norms(self, q_norm: RMSNorm, k_norm: RMSNorm, q: torch.Tensor) -> bool:
        """Whether attend_rotary can apply these head norms itself: the backend takes them, both of
        one form and eps, weights [D] of q's dtype."""
        return (self.backend.fuses_head_norms and type(q_norm) is type(k_norm) and q_norm.eps == k_norm.eps
                and all(n.weight.shape == (self.head_dim,) and n.weight.dtype == q.dtype for n in (q_norm, k_norm)))

    @property
    def needs_window_or_softcap(self) -> bool:
        return self.sliding_window is not None or self.logit_softcap is not None

    def _extras(self) -> dict:
        """The backend's window/softcap arguments, passed only where this layer has them (backends
        without them take none)."""
        return {"window": self.sliding_window, "softcap": self.logit_softcap} if self.needs_window_or_softcap else {}

    def fuses_rope(self, rotary_emb: RotaryEmbedding, q: torch.Tensor, attn_metadata: object) -> bool:
        """Whether forward_with_rotary leaves the rotary and the KV write to the attention kernel
        (never inside a piecewise capture, whose pieces write K/V themselves or leave the whole call
        to the step)."""
        return (not isinstance(attn_metadata, GraphHoles) and self.backend is not None
                and rotary_emb.rotary_dim == self.head_dim and rotary_emb.fuses(q)
                and self.backend.fuses_rope(attn_metadata))

    def rope_and_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          rotary_emb: RotaryEmbedding, attn_metadata: object) -> torch.Tensor:
        """Rotated q [T, H, D]; the rotated k and v written into this layer's cache at the step's slots."""
        return rotary_emb.rope_and_write_kv(
            positions, q, k, v.view(-1, self.num_kv_heads, self.head_dim),
            self.k_cache, self.v_cache, attn_metadata.slot_mapping,
        )

    def attend_prewritten(self, q: torch.Tensor, attn_metadata: object, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D], already rotated, with the step's K/V already in the cache (QKVLinear.forward_rotary)
        -> [T, H * D]; written into `out` ([T, H, D]) where given (backends that attend into one)."""
        if isinstance(attn_metadata, GraphHoles):
            if self.backend.attends_into:  # straight into the piecewise graphs' static buffer
                return attn_metadata.hole(lambda md, o, q_: self.attend_prewritten(q_, md, o), q,
                                          into=((q.shape[0], self.num_heads, self.head_dim), q.dtype))
            return attn_metadata.hole(lambda md, q_: self.attend_prewritten(q_, md), q)
        extras = self._extras()
        if out is not None:
            extras["out"] = out
        out = self.backend.attend(q, self.k_cache, self.v_cache, attn_metadata, self.scale, **extras)
        return out.view(-1, self.num_heads * self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: object) -> torch.Tensor:
        """q: [T, H * D], k/v: [T, Hkv * D] -> [T, H * D]."""
        if self.backend is None:
            raise RuntimeError("the KV cache is not allocated: call ModelRunner.allocate_kv_cache first")
        if isinstance(attn_metadata, GraphHoles):
            return attn_metadata.hole(lambda md, q_, k_, v_: self.forward(q_, k_, v_, md), q, k, v)
        out = self.backend.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.k_cache,
            self.v_cache,
            attn_metadata,
            self.scale,
            **self._extras(),
        )
        return out.view(-1, self.num_heads * self.head_dim)
