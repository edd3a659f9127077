"""Reference attention in plain PyTorch: runs anywhere torch runs (CPU in CI, CUDA to check kernels).

Requests are attended in at most two padded groups, decodes (one query token) and
the rest, so one long prefill does not pad every decode to its length. Each group
gathers its K/V from the paged cache through the block tables into [G, Lk] and
calls scaled_dot_product_attention once with a mask that is causal within the query
and cuts each request at its own sequence length (a sliding-window layer gathers only
the keys its window reaches). The index math is built once per step (per window);
each layer only gathers and attends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenspeed_worker.layers.attention.backend import AttentionBackend, AttentionInputs
from tokenspeed_worker.layers.kv_cache import write_kv_cache


@dataclass
class _RequestGroup:
    """Requests attended together, padded to the group's longest query (Lq) and sequence (Lk)."""

    token_index: torch.Tensor  # int64 [G, Lq] the step's token behind each padded query row
    kv_slots: torch.Tensor  # int64 [G, Lk] the cache slot of each padded key position
    mask: torch.Tensor  # bool [G, 1, Lq, Lk] which keys each query may see
    padded_rows: torch.Tensor  # int64 [n] real query rows in the flattened [G * Lq] output
    token_rows: torch.Tensor  # int64 [n] where those rows go among the step's T tokens
    query_positions: torch.Tensor  # int64 [G, Lq] the last position each padded query row sees (its own)
    context_lens: torch.Tensor  # int64 [G] the keys before each request's first query
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # window -> keys_for's

    def keys_for(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_slots, mask) of the keys the queries may see: all of each sequence, or with a sliding
        window (transformers': a query sees a key iff q_pos - k_pos < window) only the
        Lq + window - 1 positions from each request's first query's window on, so that a decode past
        the window gathers the window, not the context; built once per window."""
        if not window:
            return self.kv_slots, self.mask
        if window not in self.windowed:
            max_query_len, max_seq_len = self.mask.shape[2], self.mask.shape[3]
            span = max_query_len + window - 1
            if span >= max_seq_len:  # the window cuts nothing off the gather: mask only
                k_pos = torch.arange(max_seq_len, device=self.mask.device).expand(self.kv_slots.shape[0], -1)
                slots = self.kv_slots
            else:
                first = (self.context_lens - window + 1).clamp(min=0)
                k_pos = first[:, None] + torch.arange(span, device=self.mask.device)  # [G, span]
                # Positions past a sequence's end are clamped into the gather and masked below.
                slots = torch.gather(self.kv_slots, 1, k_pos.clamp(max=max_seq_len - 1))
            seen = self.query_positions[:, :, None]
            mask = (k_pos[:, None, :] <= seen) & (k_pos[:, None, :] > seen - window)
            self.windowed[window] = (slots, mask.unsqueeze(1))
        return self.windowed[window]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    groups: list[_RequestGroup]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_windows_and_softcap = True

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        plan = inputs.plan
        host_query_lens = np.asarray(plan.query_lens)
        host_seq_lens = np.asarray(plan.seq_lens)
        is_decode = host_query_lens == 1
        groups = []
        for selected in (is_decode, ~is_decode):
            if selected.any():
                rows = np.nonzero(selected)[0]
                groups.append(
                    self._build_group(
                        inputs,
                        rows=None if len(rows) == plan.num_reqs else rows,
                        max_query_len=int(host_query_lens[rows].max()),
                        max_seq_len=int(host_seq_lens[rows].max()),
                        num_tokens=int(host_query_lens[rows].sum()),
                    )
                )
        return TorchAttentionMetadata(slot_mapping=inputs.slot_mapping, groups=groups)

    @staticmethod
    def _build_group(
        inputs: AttentionInputs, rows: np.ndarray | None, max_query_len: int, max_seq_len: int, num_tokens: int
    ) -> _RequestGroup:
        device = inputs.query_lens.device
        query_lens = inputs.query_lens.to(torch.int64)
        context_lens = inputs.context_lens.to(torch.int64)
        query_starts = torch.cumsum(query_lens, 0) - query_lens
        block_tables = inputs.block_tables.to(torch.int64)
        if rows is not None:
            index = torch.from_numpy(rows).to(device)
            query_lens, context_lens = query_lens[index], context_lens[index]
            query_starts, block_tables = query_starts[index], block_tables[index]
        num_rows = query_lens.shape[0]
        block_size = inputs.block_size

        q_pos = torch.arange(max_query_len, device=device)
        token_index = torch.where(q_pos < query_lens[:, None], query_starts[:, None] + q_pos, 0)

        k_pos = torch.arange(max_seq_len, device=device)
        block_column = (k_pos // block_size).clamp(max=block_tables.shape[1] - 1)
        kv_slots = block_tables[:, block_column] * block_size + k_pos % block_size

        # Query i of a request sits at position context_len + i and sees keys up to it; keys
        # past the request's sequence are padding. Padded query rows see the whole sequence
        # (an all-masked row would give NaN) and are dropped afterwards.
        seq_lens = context_lens + query_lens
        visible_to = torch.minimum(context_lens[:, None] + q_pos, seq_lens[:, None] - 1)
        mask = k_pos[None, None, :] <= visible_to[:, :, None]

        owner = torch.repeat_interleave(torch.arange(num_rows, device=device), query_lens, output_size=num_tokens)
        offset = torch.arange(num_tokens, device=device) - (torch.cumsum(query_lens, 0) - query_lens)[owner]
        return _RequestGroup(
            token_index=token_index,
            kv_slots=kv_slots,
            mask=mask.unsqueeze(1),
            padded_rows=owner * max_query_len + offset,
            token_rows=query_starts[owner] + offset,
            query_positions=visible_to,
            context_lens=context_lens,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """As the base class says; window: attend to the last `window` positions only (sliding
        window); softcap: scores become softcap * tanh(scores / softcap) before the softmax
        (Gemma 2), in the activations' dtype as transformers' eager attention computes them."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        write_kv_cache(k_cache, v_cache, metadata.slot_mapping, k, v)
        k_slots = k_cache.view(-1, num_kv_heads, head_dim)
        v_slots = v_cache.view(-1, num_kv_heads, head_dim)

        out = torch.empty_like(q)
        for group in metadata.groups:
            q_group = q[group.token_index].transpose(1, 2)  # [G, H, Lq, D]
            kv_slots, mask = group.keys_for(window)
            k_group = k_slots[kv_slots].to(q.dtype).transpose(1, 2)  # [G, Hkv, Lk, D] (an fp8 cache widened)
            v_group = v_slots[kv_slots].to(q.dtype).transpose(1, 2)
            if softcap:
                o = _softcapped_attention(q_group, k_group, v_group, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(
                    q_group, k_group, v_group, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
                )
            o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
            out.index_copy_(0, group.token_rows, o[group.padded_rows])
        return out


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float) -> torch.Tensor:
    """Attention with tanh-capped scores ([G, H, Lq, D] queries, [G, Hkv, Lk, D] keys and values),
    which scaled_dot_product_attention cannot take: transformers' eager order of operations."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
