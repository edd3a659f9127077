"""Triton paged attention (kernels in tokenspeed_worker/kernels_triton/attention.py): the GPU default.

Per step, `build_metadata` picks one of two paths from the host plan (no device syncs):
a decode-only batch (every query is one token) goes to `paged_decode_attention`
(split-K over the sequence, graph-capturable with a fixed split count); any other
batch goes to `paged_extend_attention` for all its rows (causal after each request's
cached context; a decode row is simply a query of length 1). Each layer first writes
its K/V at the step's slots with `index_copy_` (a device scatter, graph-safe).

Decode batches replayed as CUDA graphs (model_executor/cuda_graph.py) get their
metadata from `decode_graph_metadata`, built over the graph's static input buffers.

Without triton or CUDA the same logic runs on `_reference_*` functions written in
plain torch with the kernels' exact signatures (`allow_reference=True`), so CI checks
the dispatch and metadata on CPU against the torch backend.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenspeed_worker.layers.attention.backend import AttentionBackend, AttentionInputs

logger = logging.getLogger(__name__)

TRITON_UNAVAILABLE = "triton attention needs a CUDA device and the triton package"

# Split-K heuristic for decode: aim for this many programs per SM, never split a
# sequence into pieces shorter than MIN_TOKENS_PER_SPLIT, and never more than MAX_SPLITS.
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16


def triton_attention_kernels() -> tuple[object | None, str]:
    """(the kernels module, "") when the triton kernels can run, else (None, why not)."""
    try:
        from tokenspeed_worker.kernels_triton import attention as kernels
    except ImportError as error:
        return None, f"tokenspeed_worker.kernels_triton.attention does not import ({error})"
    if not getattr(kernels, "AVAILABLE", False):
        return None, "the triton package is not importable"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    return kernels, ""


def decode_num_splits(batch_size: int, num_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many pieces each decode sequence is split into so that small batches still fill the GPU.

    Enough (batch x heads x splits) programs for PROGRAMS_PER_SM per SM, but no split
    shorter than MIN_TOKENS_PER_SPLIT tokens of the longest sequence, and at most MAX_SPLITS.
    """
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, batch_size * num_heads))
    by_length = math.ceil(max(1, max_seq_len) / MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(wanted, by_length, MAX_SPLITS)))


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T] where each new token's K/V goes
    block_tables: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B] context + query
    query_start_loc: torch.Tensor | None  # int32 [B + 1]; None on the decode path
    max_query_len: int  # from the host plan
    decode_only: bool
    num_splits: int | None = None  # decode path only
    workspace: object | None = None  # decode path only: preallocated split-K partials


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, device: str | torch.device = "cuda", allow_reference: bool = False) -> None:
        """allow_reference: run the `_reference_*` torch functions when the triton kernels cannot run
        (CPU tests, or a GPU machine without the kernels module); otherwise that is a ValueError."""
        self.device = torch.device(device)
        kernels, why = triton_attention_kernels() if self.device.type == "cuda" else (None, f"device is {self.device}")
        if kernels is None and not allow_reference:
            raise ValueError(f"{TRITON_UNAVAILABLE} ({why}); use --attention-backend torch")
        self.uses_reference = kernels is None
        self.kernel_source = "reference torch functions" if kernels is None else "tokenspeed_worker.kernels_triton.attention"
        if kernels is None:
            self._decode: Callable = _reference_paged_decode_attention
            self._extend: Callable = _reference_paged_extend_attention
            self._workspace: Callable | None = None
        else:
            self._decode = kernels.paged_decode_attention
            self._extend = kernels.paged_extend_attention
            self._workspace = getattr(kernels, "decode_workspace", None)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if (
            self.device.type == "cuda"
        ) else 1

    # -- metadata -------------------------------------------------------------------------

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        plan = inputs.plan
        host_query_lens = np.asarray(plan.query_lens)
        max_query_len = int(host_query_lens.max())
        seq_lens = (inputs.context_lens + inputs.query_lens).to(torch.int32)
        block_tables = inputs.block_tables.contiguous()
        if max_query_len == 1:
            num_splits = decode_num_splits(
                plan.num_reqs, self.num_heads, int(np.asarray(plan.seq_lens).max()), self.num_sms
            )
            return TritonAttentionMetadata(
                slot_mapping=inputs.slot_mapping,
                block_tables=block_tables,
                seq_lens=seq_lens,
                query_start_loc=None,
                max_query_len=1,
                decode_only=True,
                num_splits=num_splits,
                workspace=self._make_workspace(plan.num_reqs, num_splits),
            )
        query_start_loc = torch.zeros(plan.num_reqs + 1, dtype=torch.int32, device=inputs.query_lens.device)
        torch.cumsum(inputs.query_lens, 0, out=query_start_loc[1:])
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            decode_only=False,
        )

    def decode_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> TritonAttentionMetadata:
        """Metadata over a CUDA graph's static buffers; the split count is fixed for the graph's
        batch size and the longest sequence its block table can hold (later steps' splits may be empty)."""
        batch_size = seq_lens.shape[0]
        max_seq_len = block_tables.shape[1] * self.block_size
        num_splits = decode_num_splits(batch_size, self.num_heads, max_seq_len, self.num_sms)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=None,
            max_query_len=1,
            decode_only=True,
            num_splits=num_splits,
            workspace=self._make_workspace(batch_size, num_splits),
        )

    def _make_workspace(self, batch_size: int, num_splits: int) -> object | None:
        if self._workspace is None or not self.num_heads:
            return None
        return self._workspace(batch_size, self.num_heads, self.head_dim, num_splits, self.device)

    # -- per layer ------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
        q = q.contiguous()
        out = torch.empty_like(q)
        if metadata.decode_only:
            self._decode(
                q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, out,
                num_splits=metadata.num_splits, workspace=metadata.workspace,
            )
        else:
            self._extend(
                q, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, scale, out,
                max_query_len=metadata.max_query_len,
            )
        return out


# -- reference implementations of the kernels' signatures (plain torch, any device) ----------


def _reference_paged_extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    max_query_len: int,
) -> None:
    """Each query token attends over its request's keys up to its own position (causal after the
    cached context), gathered through the block table. Per token, over the table's full width:
    slow, simple, and free of host syncs."""
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
    slots = block_tables.to(torch.int64)[owner][:, key_pos // block_size] * block_size + key_pos % block_size
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)  # [T, Hkv, L, D]
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)
    mask = (key_pos[None, :] <= position[:, None])[:, None, None, :]  # [T, 1, 1, L]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )
    out.copy_(o.squeeze(2))


def _reference_paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    out: torch.Tensor,  # [B, H, D]
    num_splits: int | None = None,
    workspace: object | None = None,
) -> None:
    """One query token per request at position seq_len - 1 (the split count does not change the result)."""
    batch_size = q.shape[0]
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device=q.device)
    _reference_paged_extend_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, max_query_len=1
    )
