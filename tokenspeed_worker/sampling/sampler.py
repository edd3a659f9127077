"""Batched token sampling over the whole OpenAI sampling surface, with no per-request loop.

`Sampler.sample` takes a step's logits and its `SamplingBatch` (the rows' `SamplingParams` as
device tensors, sampling/state.py) and returns a `SampleOutput`. Per step, for the S rows that
sample, in this order (each on what the previous left):
1. logit_bias: logit[id] += bias;
2. penalties: repetition (HF: over prompt and output tokens, a positive logit is divided by
   p, a negative one multiplied), then frequency and presence (OpenAI: over output tokens,
   logit -= frequency * count + presence * (count > 0));
3. min_new_tokens: while a row has fewer outputs than that, its stop ids get -inf (unless a
   complete grammar allows nothing else: then the grammar wins, `_grammar_over_min_tokens`);
4. temperature; a row with temperature 0 is greedy: argmax of the logits after steps 1-3;
5. top-k, then top-p, then min-p (the most likely token always survives);
6. the draw.

Randomness is a counter-based hash rather than a stateful generator: the uniform noise
for vocabulary entry v of a row is mix(seed, output_position, v) (splitmix64). So a
seeded request draws the same token at the same output position whatever else is in the
batch, in whichever order; unseeded requests get a random seed and take the same path.
The draw is the Gumbel-max trick: argmax(filtered logits / T + Gumbel noise) is a sample
of softmax(filtered logits / T).

Logprobs are *raw*: log_softmax of the model's logits before any of steps 1-5 (vLLM's
default "raw_logprobs"), for the chosen token, the top-K and requested ids alike; see
sampling/logprobs.py.

Backends: "torch" (CPU and GPU) and "triton" (CUDA), which fuses the hashed noise and the
Gumbel argmax over the vocabulary into one pass (kernels/sampling.py); both draw
from the same hash, so they choose the same tokens. Filtering is shared torch code.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_worker.sampling.logprobs import token_logprobs

SAMPLING_BACKENDS = ("torch", "triton")

_MASK62 = (1 << 62) - 1
# top-k alone is done with torch.topk below this k (cheaper than a full sort of the vocabulary).
_TOPK_WITHOUT_SORT_MAX_K = 1024


def _signed64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN_U64 = 0x9E3779B97F4A7C15
MIX1_U64 = 0xBF58476D1CE4E5B9
MIX2_U64 = 0x94D049BB133111EB
_GOLDEN = _signed64(GOLDEN_U64)
_MIX1 = _signed64(MIX1_U64)
_MIX2 = _signed64(MIX2_U64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijective mix of 64 bits; int64 multiplication wraps like uint64."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def row_keys(seeds: torch.Tensor, output_positions: torch.Tensor) -> torch.Tensor:
    """int64 [S]: the per-row key of the noise, a pure function of (seed, output position)."""
    return _splitmix64(_splitmix64(seeds * _GOLDEN + 1) + output_positions)


# The largest float32 below 1: the noise's upper bound (hashed_uniform; kernels/sampling.py likewise).
UNIFORM_MAX = 1.0 - 2.0**-24


def hashed_uniform(seeds: torch.Tensor, output_positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [S, V] uniform noise in (0, 1), a pure function of (seed, output position, vocab index)."""
    row_key = row_keys(seeds, output_positions)  # [S]
    vocab = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN
    bits = _splitmix64(row_key[:, None] + vocab[None, :])
    top24 = _shift_right(bits, 40)  # 24 bits: exact in float32
    # top24 + 0.5 rounds to 2^24 for the largest value (half to even): clamped below 1, or -log(-log(u))
    # would be +inf there and that token drawn whatever its score, filtered tokens included (NaN).
    return ((top24.to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=UNIFORM_MAX)


@dataclass(slots=True)
class SamplingBatch:
    """A step's S sampling rows on the device, under `SamplingParams`' field names, plus host flags
    for the fast paths. Built by `SamplingState.batch` (or `from_lists`, the basic surface alone).

    The optional blocks are None/0 when no row of the batch uses them. "Positions" are indices
    into the batch (0..S-1), not engine rows.
    """

    # The basic surface, read only for sampled (temperature > 0) rows: SamplingState.batch leaves
    # these None when every row is greedy (no host-to-device copies).
    temperature: torch.Tensor | None  # float32 [S]; 0 = greedy
    top_k: torch.Tensor | None  # int64 [S]; 0 = off
    top_p: torch.Tensor | None  # float32 [S]; 1 = off
    min_p: torch.Tensor | None  # float32 [S]; 0 = off
    seed: torch.Tensor | None  # int64 [S]
    output_positions: torch.Tensor | None  # int64 [S] index of the token being drawn among the request's outputs
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int = 0  # largest top_k among sampled rows (0 = none)
    # logit_bias: rows at logit_bias_positions [B] add logit_bias_values [B, Mb] at logit_bias_ids [B, Mb]
    # (padding adds 0).
    logit_bias_positions: torch.Tensor | None = None
    logit_bias_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # Penalties: rows at penalty_positions [P] use slot penalty_slots [P] of these pool tensors.
    penalty_positions: torch.Tensor | None = None
    penalty_slots: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # int32 [slots, V] (the pool, not a copy)
    prompt_mask: torch.Tensor | None = None  # bool [slots, V] (the pool, not a copy)
    repetition_penalty: torch.Tensor | None = None  # float32 [P]; 1 = off
    frequency_penalty: torch.Tensor | None = None  # float32 [P]
    presence_penalty: torch.Tensor | None = None  # float32 [P]
    # Speculative decoding: tokens a penalized position counts beyond its slot's (the drafts before
    # it): penalty_extra_rows [N] index the P penalized positions, penalty_extra_tokens [N] the ids.
    penalty_extra_rows: torch.Tensor | None = None
    penalty_extra_tokens: torch.Tensor | None = None
    any_repetition: bool = False
    any_frequency_presence: bool = False
    # min_new_tokens: rows at stop_positions [Q] (still under their minimum) get -inf at stop_token_ids [Q, Ms].
    stop_positions: torch.Tensor | None = None
    stop_token_ids: torch.Tensor | None = None
    # Logprobs (raw): which outputs to compute.
    return_logprob: bool = False  # chosen-token logprobs [S]
    top_logprobs_num: int = 0  # K: the largest top_logprobs_num in the batch
    token_ids_logprob: torch.Tensor | None = None  # int64 [S, M] padded requested ids
    token_ids_logprob_counts: torch.Tensor | None = None  # int64 [S]
    # Structured output (engine/grammar.py): int32 [S, ceil(V/32)] allowed-token bitmask on the host
    # and the batch positions it constrains; applied after steps 1-3, before temperature.
    grammar_bitmask: torch.Tensor | None = None
    grammar_positions: list[int] | None = None

    @property
    def plain_argmax(self) -> bool:
        """All greedy and nothing changes the logits: the token is argmax of the raw logits."""
        return self.all_greedy and self.logit_bias_positions is None and self.penalty_positions is None and (
            self.stop_positions is None and self.grammar_bitmask is None
        )

    @property
    def needs_logprobs(self) -> bool:
        return self.return_logprob or self.top_logprobs_num > 0 or self.token_ids_logprob is not None

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        seed: Sequence[int | None],
        output_positions: Sequence[int],
        device: str | torch.device = "cpu",
    ) -> "SamplingBatch":
        """The basic surface from lists or numpy arrays, one entry per row. top_k <= 0 means off;
        a None seed gets a random one."""
        temperature = np.asarray(temperature, dtype=np.float32)
        top_k = np.maximum(np.asarray(top_k, dtype=np.int64), 0)
        top_p = np.asarray(top_p, dtype=np.float32)
        min_p = np.asarray(min_p, dtype=np.float32)
        seed = np.array([(int(s) if s is not None else random.getrandbits(62)) & _MASK62 for s in seed], np.int64)
        output_positions = np.asarray(output_positions, dtype=np.int64)
        n = temperature.shape[0]
        if not (top_k.shape == top_p.shape == min_p.shape == seed.shape == output_positions.shape == (n,)):
            raise ValueError("sampling parameter lists must all have one entry per row")

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device, non_blocking=True)

        return cls(
            temperature=tensor(temperature),
            top_k=tensor(top_k),
            top_p=tensor(top_p),
            min_p=tensor(min_p),
            seed=tensor(seed),
            output_positions=tensor(output_positions),
            **basic_flags(temperature, top_k, top_p, min_p),
        )


def basic_flags(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> dict:
    """Host flags of the basic surface from host arrays of one batch (top_k: 0 = off)."""
    sampled = temperature > 0.0
    top_k_rows = sampled & (top_k > 0)
    return dict(
        all_greedy=not sampled.any(),
        any_top_k=bool(top_k_rows.any()),
        any_top_p=bool((sampled & (top_p < 1.0)).any()),
        any_min_p=bool((sampled & (min_p > 0.0)).any()),
        max_top_k=int(top_k[top_k_rows].max()) if top_k_rows.any() else 0,
    )


@dataclass(slots=True)
class SampleOutput:
    """What one step sampled for S rows (device tensors, or their host copies: `to_host`). The
    logprob fields are None unless some row of the batch asked for them; then they hold values for
    every row (rows that did not ask are to be ignored, rows asking fewer than K top logprobs are
    sliced by the caller). Field names are those of `TokenLogprobs` and `StepOutput`."""

    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None = None  # float32 [S]: of the chosen token
    top_logprobs: torch.Tensor | None = None  # float32 [S, K], descending
    top_logprob_ids: torch.Tensor | None = None  # int64 [S, K]
    token_ids_logprobs: torch.Tensor | None = None  # float32 [S, M]
    token_ids_logprob_ids: torch.Tensor | None = None  # int64 [S, M] (padding at and past the count)
    token_ids_logprob_counts: torch.Tensor | None = None  # int64 [S]

    def to_host(self) -> "SampleOutput":
        """CPU copies, started without waiting: from CUDA, non-blocking copies into pinned memory, to
        be read only after an event recorded behind them fired; CPU tensors are copied at once (a
        decode graph's greedy tokens are a view of the buffer the next step's replay overwrites: the
        copy must be taken now, as on CUDA, where it is enqueued before that step)."""
        if self.logprobs is None:  # no row asked for logprobs: then none of them is set
            return SampleOutput(_to_host(self.tokens))
        return SampleOutput(
            _to_host(self.tokens), _to_host(self.logprobs), _to_host(self.top_logprobs),
            _to_host(self.top_logprob_ids), _to_host(self.token_ids_logprobs),
            _to_host(self.token_ids_logprob_ids), _to_host(self.token_ids_logprob_counts),
        )


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return t
    if t.device.type == "cpu":
        return t.clone()
    return t.to("cpu", non_blocking=True)


def _triton_importable() -> bool:
    from tokenspeed_worker.kernels import sampling as triton_sampling  # imports triton: only when asked

    return triton_sampling.AVAILABLE


def triton_sampling_available() -> bool:
    """Whether the triton backend can run here: triton importable and a CUDA device present."""
    return torch.cuda.is_available() and _triton_importable()


def default_sampling_backend(device: str | torch.device | None = None) -> str:
    """"triton" when sampling on CUDA and triton is importable, else "torch"."""
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return "triton" if on_cuda and triton_sampling_available() else "torch"


def greedy_workspace(max_rows: int, vocab_size: int, device: torch.device) -> tuple | None:
    """widen_and_greedy's scratch (kernels/sampling.argmax_workspace) on CUDA where Triton
    imports, else None (the unfused path needs none). Allocate outside any CUDA-graph capture."""
    if torch.device(device).type != "cuda" or not _triton_importable():
        return None
    from tokenspeed_worker.kernels.sampling import argmax_workspace

    return argmax_workspace(max_rows, vocab_size, device)


def widen_and_greedy(logits: torch.Tensor, out_logits: torch.Tensor, out_tokens: torch.Tensor,
                     workspace: tuple | None) -> None:
    """out_logits[:] = logits (float32) and out_tokens[:] = their rows' argmax: one Triton kernel
    given a workspace (greedy_workspace), else the copy and greedy_argmax. The decode graphs' tail
    (model_executor/cuda_graph.py)."""
    if workspace is not None and logits.is_cuda:
        from tokenspeed_worker.kernels.sampling import widen_and_argmax

        widen_and_argmax(logits, out_logits, out_tokens, workspace)
        return
    out_logits.copy_(logits)
    greedy_argmax(out_logits, out=out_tokens)


def greedy_argmax(scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:] = the first index of each row's maximum of float [S, V] scores: the Triton kernels
    on CUDA where Triton imports (the sampler's triton backend), else torch.argmax (the same
    index: both take the first maximum). Used inside the decode graphs (model_executor/cuda_graph.py)."""
    if scores.is_cuda and _triton_importable():
        from tokenspeed_worker.kernels.sampling import argmax

        return argmax(scores, out=out)
    return torch.argmax(scores, dim=-1, out=out)


class Sampler:
    def __init__(self, backend: str = "torch") -> None:
        if backend not in SAMPLING_BACKENDS:
            raise ValueError(f"unknown sampling backend {backend!r}; choose one of {', '.join(SAMPLING_BACKENDS)}")
        if backend == "triton" and not triton_sampling_available():
            raise ValueError(
                "sampling backend 'triton' needs the triton package and a CUDA device "
                f"(triton importable: {_triton_importable()}, CUDA available: {torch.cuda.is_available()}); "
                "use --sampling-backend torch"
            )
        self.backend = backend

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor | None = None) -> SampleOutput:
        """logits float32 [S, V] -> SampleOutput (tokens int64 [S] and the logprobs asked for).
        greedy: the rows' argmax of these logits, already computed (inside a decode graph); the
        tokens of a plain-argmax batch, so no kernel runs for them here."""
        if batch.plain_argmax:
            tokens = greedy if greedy is not None else self._argmax(logits)
        else:
            scores = self.process_logits(logits, batch)
            if batch.grammar_bitmask is not None:
                from tokenspeed_worker.engine.grammar import apply_bitmask

                if scores is logits:  # logprobs stay raw: mask a copy
                    scores = scores.clone()
                apply_bitmask(scores, batch.grammar_bitmask, batch.grammar_positions)
                if batch.stop_positions is not None:
                    self._grammar_over_min_tokens(scores, logits, batch)
            greedy_tokens = self._argmax(scores)
            if batch.all_greedy:
                tokens = greedy_tokens
            else:
                is_greedy = batch.temperature <= 0.0
                temperature = torch.where(is_greedy, 1.0, batch.temperature)
                scores = self._filter(scores / temperature[:, None], batch)
                tokens = torch.where(is_greedy, greedy_tokens, self._draw(scores, batch))
        if not batch.needs_logprobs:
            return SampleOutput(tokens)
        lp = token_logprobs(logits, tokens, batch.top_logprobs_num, batch.token_ids_logprob,
                            batch.token_ids_logprob_counts)
        return SampleOutput(tokens, lp.logprobs, lp.top_logprobs, lp.top_logprob_ids, lp.token_ids_logprobs,
                            lp.token_ids_logprob_ids, lp.token_ids_logprob_counts)

    @staticmethod
    def _grammar_over_min_tokens(scores: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch) -> None:
        """A complete grammar allows only its stop ids, which min_new_tokens holds back: no token would
        be left, and the draw would take id 0 against the grammar. There the grammar wins (as it wins
        over ignore_eos): a row under its minimum with nothing allowed gets its stop ids' raw logits
        back, under the grammar's mask again. No host sync: rows with a token left keep theirs."""
        from tokenspeed_worker.engine.grammar import apply_bitmask

        positions, ids = batch.stop_positions, batch.stop_token_ids
        rows = positions[:, None].expand_as(ids)
        dead = scores.index_select(0, positions).amax(dim=-1) == float("-inf")
        scores.index_put_((rows, ids), torch.where(dead[:, None], logits[rows, ids].float(), scores[rows, ids]))
        apply_bitmask(scores, batch.grammar_bitmask, batch.grammar_positions)

    def _argmax(self, scores: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum; the triton backend splits each row over many programs."""
        if self.backend == "triton" and scores.is_cuda:
            from tokenspeed_worker.kernels.sampling import argmax

            return argmax(scores)
        return scores.argmax(dim=-1)

    def _draw(self, scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Gumbel-max over filtered, temperature-scaled scores [S, V] -> int64 [S]."""
        if self.backend == "triton" and scores.is_cuda:
            from tokenspeed_worker.kernels.sampling import gumbel_argmax

            return gumbel_argmax(scores, row_keys(batch.seed, batch.output_positions))
        noise = hashed_uniform(batch.seed, batch.output_positions, scores.shape[-1])
        return (scores - torch.log(-torch.log(noise))).argmax(dim=-1)

    @staticmethod
    def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 1-3 of the module docstring (bias, penalties, min-tokens) -> float32 [S, V].

        The input is never modified (a copy is made when anything applies)."""
        scores = logits.float()
        changes = batch.logit_bias_positions is not None or batch.penalty_positions is not None
        if (changes or batch.stop_positions is not None) and scores is logits:
            scores = scores.clone()
        if batch.logit_bias_positions is not None:
            rows = batch.logit_bias_positions[:, None].expand_as(batch.logit_bias_ids)
            scores.index_put_((rows, batch.logit_bias_ids), batch.logit_bias_values, accumulate=True)
        if batch.penalty_positions is not None:
            sub = scores.index_select(0, batch.penalty_positions)
            counts = batch.output_counts.index_select(0, batch.penalty_slots)
            if batch.penalty_extra_rows is not None:
                counts.index_put_((batch.penalty_extra_rows, batch.penalty_extra_tokens),
                                  counts.new_ones(()).expand(batch.penalty_extra_rows.shape[0]), accumulate=True)
            if batch.any_repetition:
                seen = (counts > 0) | batch.prompt_mask.index_select(0, batch.penalty_slots)
                penalty = batch.repetition_penalty[:, None]
                sub = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
            if batch.any_frequency_presence:
                sub = sub - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)
            scores.index_copy_(0, batch.penalty_positions, sub)
        if batch.stop_positions is not None:
            rows = batch.stop_positions[:, None].expand_as(batch.stop_token_ids)
            scores.index_put_((rows, batch.stop_token_ids), scores.new_full((), float("-inf")))
        return scores

    @staticmethod
    def _filter(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Set filtered-out entries to -inf; the most likely token always survives."""
        vocab = scores.shape[-1]
        if batch.any_top_k and not batch.any_top_p and 0 < batch.max_top_k <= _TOPK_WITHOUT_SORT_MAX_K:
            # k-th largest score per row as the threshold; ties at it all survive.
            k = min(batch.max_top_k, vocab)
            top = scores.topk(k, dim=-1, sorted=True).values
            top_ks = torch.where(batch.top_k > 0, batch.top_k.clamp(max=k), k)
            kth = top.gather(1, (top_ks - 1)[:, None])
            kth = torch.where((batch.top_k > 0)[:, None], kth, float("-inf"))
            scores = scores.masked_fill(scores < kth, float("-inf"))
        elif batch.any_top_k or batch.any_top_p:
            # Stable, so tokens with equal scores keep vocabulary order whatever the batch.
            sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
            remove = torch.zeros_like(sorted_scores, dtype=torch.bool)
            if batch.any_top_k:
                # Everything below the k-th score goes, ties at it stay (as in the topk path above).
                top_ks = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
                remove |= sorted_scores < sorted_scores.gather(1, (top_ks - 1)[:, None])
            if batch.any_top_p:
                probs = sorted_scores.masked_fill(remove, float("-inf")).softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
                remove |= (mass_before >= batch.top_p[:, None]) & (batch.top_p[:, None] < 1.0)
            remove[:, 0] = False
            scores = scores.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))
        if batch.any_min_p:
            # p >= min_p * p_max  <=>  score >= max_score + log(min_p); renormalization does not change it.
            threshold = scores.max(dim=-1, keepdim=True).values + torch.log(batch.min_p[:, None])
            scores = scores.masked_fill(scores < threshold, float("-inf"))
        return scores
