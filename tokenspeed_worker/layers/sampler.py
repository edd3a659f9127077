"""Batched token sampling: temperature, top-k, top-p, min-p and per-request seeds, with no per-request loop.

Filters apply in HF's order: temperature, then top-k, then top-p, then min-p (each on
what the previous left). A row with temperature 0 is greedy (argmax of the raw logits).

Randomness is a counter-based hash rather than a stateful generator: the uniform
noise for vocabulary entry v of a row is mix(seed, output_position, v). So a seeded
request draws the same token at the same output position whatever else is in the
batch, in whichever order; unseeded requests get a random seed and take the same path.
The draw itself is the Gumbel-max trick: argmax(filtered logits / T + Gumbel noise)
is a sample of softmax(filtered logits / T).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MASK62 = (1 << 62) - 1


def _signed64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijective mix of 64 bits; int64 multiplication wraps like uint64."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def hashed_uniform(seeds: torch.Tensor, output_positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [S, V] uniform noise in (0, 1), a pure function of (seed, output position, vocab index)."""
    row_key = _splitmix64(_splitmix64(seeds * _GOLDEN + 1) + output_positions)  # [S]
    vocab = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN
    bits = _splitmix64(row_key[:, None] + vocab[None, :])
    top24 = _shift_right(bits, 40)  # 24 bits: exact in float32
    return (top24.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the logits' device, plus host flags that pick the fast paths."""

    temperatures: torch.Tensor  # float32 [S]; 0 = greedy
    top_ks: torch.Tensor  # int64 [S]; 0 = off
    top_ps: torch.Tensor  # float32 [S]; 1 = off
    min_ps: torch.Tensor  # float32 [S]; 0 = off
    seeds: torch.Tensor  # int64 [S]
    output_positions: torch.Tensor  # int64 [S] index of the token being drawn among the request's outputs
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_lists(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        min_ps: Sequence[float],
        seeds: Sequence[int | None],
        output_positions: Sequence[int],
        device: str | torch.device = "cpu",
    ) -> "SamplingTensors":
        """Lists or numpy arrays, one entry per row. top_k <= 0 means off; a None seed gets a random one."""
        temperatures = np.asarray(temperatures, dtype=np.float32)
        top_ks = np.maximum(np.asarray(top_ks, dtype=np.int64), 0)
        top_ps = np.asarray(top_ps, dtype=np.float32)
        min_ps = np.asarray(min_ps, dtype=np.float32)
        seeds = np.array([(int(s) if s is not None else random.getrandbits(62)) & _MASK62 for s in seeds], np.int64)
        output_positions = np.asarray(output_positions, dtype=np.int64)
        n = temperatures.shape[0]
        if not (top_ks.shape == top_ps.shape == min_ps.shape == seeds.shape == output_positions.shape == (n,)):
            raise ValueError("sampling parameter lists must all have one entry per row")
        sampled = temperatures > 0.0

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device, non_blocking=True)

        return cls(
            temperatures=tensor(temperatures),
            top_ks=tensor(top_ks),
            top_ps=tensor(top_ps),
            min_ps=tensor(min_ps),
            seeds=tensor(seeds),
            output_positions=tensor(output_positions),
            all_greedy=not sampled.any(),
            any_top_k=bool((sampled & (top_ks > 0)).any()),
            any_top_p=bool((sampled & (top_ps < 1.0)).any()),
            any_min_p=bool((sampled & (min_ps > 0.0)).any()),
        )


class Sampler:
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """logits float32 [S, V] -> int64 [S] sampled token ids."""
        greedy_tokens = logits.argmax(dim=-1)
        if params.all_greedy:
            return greedy_tokens
        is_greedy = params.temperatures <= 0.0
        temperatures = torch.where(is_greedy, 1.0, params.temperatures)
        scores = logits.float() / temperatures[:, None]
        scores = self._filter(scores, params)
        noise = hashed_uniform(params.seeds, params.output_positions, scores.shape[-1])
        gumbel = -torch.log(-torch.log(noise))
        sampled = (scores + gumbel).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, sampled)

    @staticmethod
    def _filter(scores: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Set filtered-out entries to -inf; the most likely token always survives."""
        if params.any_top_k or params.any_top_p:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            rank = torch.arange(scores.shape[-1], device=scores.device)
            remove = torch.zeros_like(sorted_scores, dtype=torch.bool)
            if params.any_top_k:
                top_ks = torch.where(params.top_ks > 0, params.top_ks, scores.shape[-1])
                remove |= rank[None, :] >= top_ks[:, None]
            if params.any_top_p:
                probs = sorted_scores.masked_fill(remove, float("-inf")).softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
                remove |= (mass_before >= params.top_ps[:, None]) & (params.top_ps[:, None] < 1.0)
            remove[:, 0] = False
            scores = scores.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))
        if params.any_min_p:
            # p >= min_p * p_max  <=>  score >= max_score + log(min_p); renormalization does not change it.
            threshold = scores.max(dim=-1, keepdim=True).values + torch.log(params.min_ps[:, None])
            scores = scores.masked_fill(scores < threshold, float("-inf"))
        return scores
