"""Speculative decoding's verification: which of a step's draft tokens the model keeps.

A decoding row with a draft d_1..d_k computes k + 1 tokens in one forward (its last accepted token,
then the draft) and samples at each of them as if each were an ordinary decode position: position
j draws the request's output token number o + j with its own seed's noise (sampling/sampler.py
keys the noise by seed and output position). Draft d_{j+1} is kept when the token drawn at
position j equals it; the first position whose draw differs gives its draw instead, and the row
ends there. So the tokens kept are exactly those the model would have produced one step at a
time: greedy output, and seeded sampling's, are unchanged by speculation, and the output follows
the model's distribution. For drafts proposed as single tokens (n-gram; a drafter's greedy
chain) this is what rejection sampling reduces to: a draft d is kept with probability p(d), and
the replacement is drawn from p (d excluded, since a draw equal to d was a keep).

`Verify` holds one launched step's layout; `accept` turns its sampled tokens into the counts the
scheduler takes (Scheduler.resolve_verified).

Drafts: NGRAM drafts are made inside the native scheduler (it holds the tokens). A drafter outside
it hands the scheduler a draft per request before each schedule (Scheduler.set_draft): the
benchmarks' `OracleDrafter` here; a draft model's drafter (EAGLE-3, MTP) fits the same call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from tokenspeed_worker.scheduler.plan import SchedulePlan


@dataclass
class Verify:
    """A step with drafts: its sample rows expanded to one entry per sampled position."""

    counts: np.ndarray  # int64 [S] positions per sample row (1 + its draft length)
    starts: np.ndarray  # int64 [S] each row's first entry among the expanded positions
    drafts: np.ndarray  # int64 [E] the draft token each position is checked against (-1: the last of its row)
    draft_lens: np.ndarray  # int64 [S]
    offsets: np.ndarray | None = None  # int64 [E] each position's place in its row (set by expand)
    # int64 [E]: the draft token each position follows (the one checked at the position before it),
    # -1 at a row's first position (set by expand).
    inputs: np.ndarray | None = None

    @classmethod
    def of(cls, plan: SchedulePlan) -> "Verify":
        counts = plan.sample_counts
        starts = np.cumsum(counts) - counts
        index = plan.sample_token_index
        last = np.zeros(index.shape[0], dtype=bool)
        last[starts + counts - 1] = True
        # Position j of a row checks the token computed after it: the draft at index + 1.
        following = np.minimum(index + 1, plan.input_ids.shape[0] - 1)
        drafts = np.where(last, -1, plan.input_ids[following])
        return cls(counts=counts, starts=starts, drafts=drafts, draft_lens=counts - 1)

    def expand(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows repeated once per position, each position's offset in its row) for [S] `rows`."""
        expanded = np.repeat(rows, self.counts)
        self.offsets = np.arange(expanded.shape[0], dtype=np.int64) - np.repeat(self.starts, self.counts)
        self.inputs = np.empty_like(self.drafts)
        self.inputs[1:] = self.drafts[:-1]
        self.inputs[self.starts] = -1
        return expanded, self.offsets

    def accept(self, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(kept int32 [S]: each row's drafts kept plus one, the token drawn after them; tokens int64:
        those kept, row after row) from the tokens drawn at every position, int64 [E]."""
        stop = sampled != self.drafts  # a mismatch, or a row's last position (its draft is -1)
        positions = np.where(stop, np.arange(sampled.shape[0]), sampled.shape[0])
        first = np.minimum.reduceat(positions, self.starts) if self.starts.shape[0] else positions[:0]
        kept = (first - self.starts + 1).astype(np.int32)
        return kept, sampled[self.select(kept)]

    def select(self, used: np.ndarray) -> np.ndarray:
        """int64: the positions of each row's first used[i] entries, in order."""
        used = np.asarray(used, dtype=np.int64)
        total = int(used.sum())
        return np.repeat(self.starts, used) + (np.arange(total) - np.repeat(np.cumsum(used) - used, used))


class OracleDrafter:
    """Benchmarks only (env TOKENSPEED_SPECULATIVE_ORACLE): forced acceptance over a recorded
    continuation. Each request whose prompt a recorded sequence begins with (the model's own
    greedy output, recorded in a first pass) is drafted that sequence's next tokens by position;
    each draft token is right with probability `accept` (by a hash of its position; a wrong one is
    changed to the next id), and `force` makes the verification keep exactly the right ones, up
    to the first wrong one, whatever the model computed there. The step still computes and
    samples every drafted position, so its cost is the real one at that acceptance; the output is
    the recorded tokens where kept (a benchmark's random weights make a different batch shape
    flip near-tied greedy choices, so the model's own draws would end the drafts by chance).
    Requests matching no sequence get no draft from it."""

    _KEY = 16  # sequences are indexed by their first tokens

    def __init__(self, path: str, accept: float, vocab_size: int, num_tokens: int) -> None:
        """path: a JSON list whose entries are {"tokens": prompt + output, "prompt_len": n} (or a
        bare token list: prompt_len 16), with "accept": a to give that sequence its own acceptance
        (else `accept`)."""
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        self.index: dict[tuple[int, ...], list[tuple[np.ndarray, int, float]]] = {}
        for entry in entries:
            if not isinstance(entry, dict):
                entry = {"tokens": entry}
            seq = np.asarray(entry["tokens"], dtype=np.int64)
            prompt_len = int(entry.get("prompt_len", self._KEY))
            self.index.setdefault(tuple(seq[: self._KEY].tolist()), []).append(
                (seq, prompt_len, float(entry.get("accept", accept))))
        self.vocab_size = vocab_size
        self.num_tokens = num_tokens
        self.right: dict[int, np.ndarray] = {}  # row -> bool per draft token given this step

    def propose(self, scheduler, rows: list[int]) -> None:
        self.right.clear()
        for row in rows:
            try:
                tokens = scheduler.token_ids(row)
            except KeyError:  # not in the scheduler (its grammar compiling): nothing to draft
                continue
            n = tokens.shape[0]
            for seq, prompt_len, rate in self.index.get(tuple(tokens[: self._KEY].tolist()), ()):
                if seq.shape[0] > n and n >= prompt_len and np.array_equal(seq[:prompt_len], tokens[:prompt_len]):
                    draft = seq[n: n + self.num_tokens].copy()
                    positions = np.arange(n, n + draft.shape[0], dtype=np.uint64)
                    u = ((positions * np.uint64(2654435761)) % np.uint64(1 << 20)).astype(np.float64) / (1 << 20)
                    right = u < rate
                    draft[~right] = (draft[~right] + 1) % self.vocab_size
                    self.right[row] = right
                    scheduler.set_draft(row, draft)
                    break

    def force(self, verify: Verify, rows: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """`sampled` (int64 [E], one per position of the step `verify`, `rows` its expanded rows) with
        each right draft token drawn where it is checked, so `verify.accept` keeps the right ones."""
        sampled = sampled.copy()
        for start, length in zip(verify.starts.tolist(), verify.draft_lens.tolist()):
            right = self.right.get(int(rows[start]))
            if right is None or length == 0:
                continue
            at = np.flatnonzero(right[:length])
            sampled[start + at] = verify.drafts[start + at]
        return sampled
