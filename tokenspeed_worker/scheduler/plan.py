"""The flat arrays one scheduler step hands to the model runner.

Vocabulary (docs/architecture.md): a *block* is a fixed run of `block_size` KV
positions in the pool; a *slot* is one position, numbered
`block_id * block_size + offset`; a request's *block table* lists its blocks in
order; *context* is what is already in the KV cache before this step; *query*
is what this step computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SchedulePlan:
    """One step. B requests, T = sum(query_lens) tokens, S sampling requests.

    Requests appear in any order; the tokens of request b occupy
    input_ids[cu_query_lens[b]:cu_query_lens[b + 1]].
    """

    req_ids: np.ndarray  # int64 [B] engine-internal request ids
    query_lens: np.ndarray  # int32 [B] tokens computed this step per request (>= 1)
    context_lens: np.ndarray  # int32 [B] tokens already in the KV cache before this step
    input_ids: np.ndarray  # int64 [T] token ids, request-major
    positions: np.ndarray  # int64 [T] position of each token in its sequence
    slot_mapping: np.ndarray  # int64 [T] KV slot each new token's K/V is written to
    block_tables: np.ndarray  # int32 [B, W] blocks of each request, padded with 0 past its need
    sample_rows: np.ndarray  # int32 [S] rows b (into B) whose last query token yields a new token
    # Speculative decoding: int32 [B] draft tokens ending each row's query (0: none), or None for
    # none at all. A sample row with d > 0 samples at each of its last d + 1 tokens.
    draft_lens: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.req_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        return self.context_lens + self.query_lens

    @property
    def cu_query_lens(self) -> np.ndarray:
        """int64 [B + 1] prefix sums of query_lens."""
        out = np.zeros(self.num_reqs + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=out[1:])
        return out

    @property
    def has_drafts(self) -> bool:
        return self.draft_lens is not None and bool(self.draft_lens.any())

    @property
    def sample_counts(self) -> np.ndarray:
        """int64 [S] positions each sample row samples at: 1 + its draft length."""
        if self.draft_lens is None:
            return np.ones(self.sample_rows.shape[0], dtype=np.int64)
        return 1 + self.draft_lens[self.sample_rows].astype(np.int64)

    @property
    def sample_token_index(self) -> np.ndarray:
        """int64 [sum(sample_counts)] index into the T tokens of each position sampled at: each sample
        row's last query token, or with a draft of d its last d + 1 tokens, in order."""
        last = self.cu_query_lens[1:][self.sample_rows] - 1
        if not self.has_drafts:
            return last
        counts = self.sample_counts
        starts = np.repeat(last - counts + 1, counts)
        return starts + (np.arange(starts.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts))

    @staticmethod
    def empty() -> "SchedulePlan":
        z32 = np.zeros(0, dtype=np.int32)
        z64 = np.zeros(0, dtype=np.int64)
        return SchedulePlan(z64, z32, z32, z64, z64, z64, np.zeros((0, 1), dtype=np.int32), z32)
