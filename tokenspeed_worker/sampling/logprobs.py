"""Log-probabilities of tokens, for sampled tokens and for prompt positions.

Convention (the same everywhere in the worker): logprobs are *raw* — log_softmax of the
model's logits as the LM head produced them, before logit_bias, penalties, min-tokens
masking, temperature and the top-k/top-p/min-p filters. This is vLLM's default
("raw_logprobs"), it makes a token's logprob independent of the sampling options, and
it is what prompt logprobs must be anyway (no sampling happens at prompt positions).

Three kinds, all computed from the same [N, V] log_softmax:
- the logprob of one given token per position (the sampled token, or the next prompt token);
- the top-k logprobs per position: values float32 [N, K] sorted descending, ids int64 [N, K];
- the logprobs of requested token ids: a padded [N, M] of values and ids plus a count per
  position (entries at or past the count are padding and hold no meaning).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# log_softmax of a [T, V] float32 block is computed this many elements at a time, so prompt
# logprobs of a long prompt over a 128k vocabulary do not allocate T x V x 4 bytes at once.
_CHUNK_ELEMENTS = 1 << 25  # 128 MiB of float32


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of N positions (sampled rows, or prompt positions). Device tensors; the field
    names are those of `SampleOutput` and `StepOutput`."""

    logprobs: torch.Tensor  # float32 [N]: of the chosen/next token (NaN where that id is < 0)
    top_logprobs: torch.Tensor | None = None  # float32 [N, K], descending
    top_logprob_ids: torch.Tensor | None = None  # int64 [N, K]
    token_ids_logprobs: torch.Tensor | None = None  # float32 [N, M]: of the requested ids
    token_ids_logprob_ids: torch.Tensor | None = None  # int64 [N, M]: the requested ids (padding past the count)
    token_ids_logprob_counts: torch.Tensor | None = None  # int64 [N]: how many of the M columns are real


def _logprobs_block(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    top_k: int,
    ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    valid = chosen >= 0
    chosen_lp = logprobs.gather(1, chosen.clamp(min=0)[:, None]).squeeze(1)
    chosen_lp = torch.where(valid, chosen_lp, float("nan"))
    top_values = top_ids = None
    if top_k > 0:
        top_values, top_ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1, sorted=True)
    ids_values = logprobs.gather(1, ids) if ids is not None else None
    return chosen_lp, top_values, top_ids, ids_values


def token_logprobs(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    top_k: int = 0,
    ids: torch.Tensor | None = None,
    ids_counts: torch.Tensor | None = None,
) -> TokenLogprobs:
    """Raw logprobs for N positions of logits [N, V].

    chosen: int64 [N] (negative = none, gives NaN); top_k: K >= 0 (0 = none);
    ids: int64 [N, M] padded ids per position (any in-range id as padding) with ids_counts [N].
    Works in chunks of positions, so N may be a whole prompt.
    """
    n, vocab = logits.shape
    if ids is not None and ids_counts is None:
        ids_counts = torch.full((n,), ids.shape[1], dtype=torch.int64, device=logits.device)
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    parts = [
        _logprobs_block(logits[i : i + step], chosen[i : i + step], top_k, None if ids is None else ids[i : i + step])
        for i in range(0, n, step)
    ] or [_logprobs_block(logits, chosen, top_k, ids)]

    def cat(k: int) -> torch.Tensor | None:
        return torch.cat([p[k] for p in parts]) if parts[0][k] is not None else None

    return TokenLogprobs(cat(0), cat(1), cat(2), cat(3), ids, ids_counts)


def prompt_logprobs(
    logits: torch.Tensor,
    next_token_ids: torch.Tensor,
    top_k: int = 0,
    token_ids: Sequence[int] = (),
) -> TokenLogprobs:
    """Logprobs at prompt positions (for logprob_start_len >= 0) from all-token logits.

    logits: [T, V] (row t predicts token t+1); next_token_ids: int64 [T], the token that
    actually follows position t (negative where none, e.g. the last prompt position; its
    logprob is NaN). top_k: K top logprobs per position (0 = none). token_ids: the same
    requested ids at every position (ids [T, M], ids_counts all M). Raw logprobs; float32.
    """
    logits = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
    next_token_ids = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    vocab = logits.shape[-1]
    ids = None
    if len(token_ids):
        bad = [t for t in token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"token_ids {bad[:5]} outside the vocabulary of {vocab}")
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device).expand(logits.shape[0], -1)
    return token_logprobs(logits, next_token_ids, top_k, ids)
