"""Structured output with xgrammar: constraints compiled off the step loop, masks applied per step.

xgrammar (PyPI `xgrammar`) does what we need and no more: it compiles a JSON schema, regex, EBNF
grammar or structural tag against the model's tokenizer into a `CompiledGrammar` (thread-safe,
cached by its text), and a per-request `GrammarMatcher` fills the vocabulary bitmask of the tokens
allowed next and accepts the sampled one.

- The tokenizer info is built once, at startup, from the model's tokenizer.
- `submit` starts compiling on a thread pool and returns at once. The engine keeps the request out
  of the scheduler until its grammar is ready (`poll`), so a large schema never delays other
  requests' steps. A grammar that fails to compile fails its request with INVALID_ARGUMENT naming
  the constraint and xgrammar's error.
- Per step, `fill_bitmask` writes the masks of the batch's constrained rows into one int32
  [S, ceil(V/32)] tensor (unconstrained rows stay all-allowed); the sampler applies it on the device.
- `accept` advances each row's matcher by the token it sampled. The next mask needs that state;
  the engine (engine/engine_core.py) keeps overlap scheduling: inside step N+1's launch, after its forward
  is enqueued, it waits for step N's tokens, accepts them and fills N+1's mask.
- The request still ends as any other: the grammar allows only a stop token (EOS) once complete,
  which finishes it with "stop". max_new_tokens still applies.

Per-step host cost. xgrammar treats every id in [tokenizer vocabulary, model vocab_size) as a
special token, and each `accept_token` scans the list of special ids linearly, as does each mask
fill in some states: when the model's vocab pads far past its tokenizer's, that scan dominates both
(~14 us a call for 79k padding ids, against ~1 us an accept and ~5 us a fill without). So when the
padding is large, the matchers are built over the tokenizer's own ids (rounded up to whole
bitmask words) and the words past them are cleared in each filled row: the same masks, the same
accept results (a padding id is rejected either way), without the scan. A thread pool over the
rows was measured too and dropped: on the H200 host's 16 cores, 8 threads took 0.58 ms a step for
32 rows and one thread 0.25 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf_grammar", "structural_tag")
GRAMMAR_BACKENDS = ("xgrammar", "none")


def xgrammar_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None


class GrammarUnavailable(RuntimeError):
    pass


def grammar_vocab_size(tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                       min_padding: int = 1024) -> int:
    """The vocabulary the matchers are built over: the model's `vocab_size`, or, when it pads at least
    `min_padding` ids past the tokenizer's vocabulary, the tokenizer's ids rounded up to a multiple
    of 32 (whole bitmask words; the ids past them are never allowed, see the module doc)."""
    vocab = tokenizer.get_vocab()
    size = max(len(vocab), max(vocab.values()) + 1)  # as xgrammar's TokenizerInfo counts it
    narrow = -(-size // 32) * 32
    if vocab_size - narrow < min_padding or any(t >= narrow for t in stop_token_ids or ()):
        return vocab_size
    return narrow


class Grammars:
    """The engine's grammar compiler, pending compilations and per-row matchers."""

    # Build the matchers over the tokenizer's ids when the model pads at least this many ids past them.
    NARROW_MIN_PADDING = 1024

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int] | None = None,
                 threads: int = 2) -> None:
        """threads: grammar compilations at once."""
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.vocab_size = vocab_size
        self.matcher_vocab_size = grammar_vocab_size(tokenizer, vocab_size, stop_token_ids, self.NARROW_MIN_PADDING)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.matcher_vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        # Compilation runs here, never on the step loop (xgrammar releases the GIL while compiling).
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.matchers: dict[int, object] = {}  # engine row -> GrammarMatcher
        self._bitmask: torch.Tensor | None = None
        self._words = xgr.get_bitmask_shape(1, self.matcher_vocab_size)[1]  # bitmask words a matcher fills
        self._row_masks: list[torch.Tensor] = []  # per bitmask row: its first self._words words (a view)
        self._written: set[int] = set()  # bitmask rows holding a matcher's mask (the others: all allowed)

    # -- compile ----------------------------------------------------------------------------

    def submit(self, kind: str, text: str) -> Future:
        """Compile a constraint in the background; the future's result is a CompiledGrammar."""
        return self.pool.submit(self._compile, kind, text)

    def _compile(self, kind: str, text: str):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(text)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "ebnf_grammar":
            return c.compile_grammar(text)
        if kind == "structural_tag":
            return c.compile_structural_tag(text)
        raise ValueError(f"unknown constraint kind {kind!r}")

    def start(self, row: int, compiled) -> None:
        """The row's matcher, from its compiled grammar (the request enters the scheduler now)."""
        self.matchers[row] = self._xgr.GrammarMatcher(compiled)

    def release(self, row: int) -> None:
        self.matchers.pop(row, None)

    @property
    def active(self) -> bool:
        return bool(self.matchers)

    # -- per step ----------------------------------------------------------------------------

    def fill_bitmask(self, rows) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask int32 [S, ceil(V/32)] on the host, batch positions constrained) for the step's
        sampled rows, or None when none of them is constrained."""
        row_list = rows.tolist()
        positions = [i for i, row in enumerate(row_list) if row in self.matchers]
        if not positions:
            return None
        size = len(row_list)
        if self._bitmask is None or self._bitmask.shape[0] < size:
            self._bitmask = self._xgr.allocate_token_bitmask(max(size, 8), self.vocab_size)  # all allowed
            self._row_masks = [self._bitmask[i, :self._words] for i in range(self._bitmask.shape[0])]
            self._written = set()
        bitmask = self._bitmask[:size]
        # A finished grammar is ended by the engine, never masked.
        work = [(self.matchers[row_list[i]], i) for i in positions if not self.matchers[row_list[i]].is_terminated()]
        # Rows hold a matcher's mask or all-allowed. A fill rewrites a row's first self._words words
        # whole, so only the rows a matcher wrote before and none writes now are reset, and the words
        # past those (padding ids, never allowed) are cleared only in rows newly written.
        written = {i for _, i in work}
        stale = [i for i in self._written if i not in written]
        if stale:
            self._bitmask[stale] = -1
        fresh = [i for i in written if i not in self._written]
        if fresh and self._words < bitmask.shape[1]:
            bitmask[fresh, self._words:] = 0
        self._written = written
        for matcher, i in work:
            matcher.fill_next_token_bitmask(self._row_masks[i], 0)
        return bitmask, positions

    def accept(self, rows, tokens) -> None:
        """Advance each constrained row's matcher by its sampled token."""
        for row, token in zip(rows.tolist(), tokens.tolist()):
            matcher = self.matchers.get(row)
            if matcher is not None and not matcher.is_terminated():
                if not matcher.accept_token(int(token)):
                    logger.warning("grammar rejected token %d of row %d (it was masked in)", token, row)

    def terminated(self, rows) -> list[int]:
        """Rows whose grammar is complete (it accepted its stop token): the engine ends them with
        "stop" even when that token is not one of the request's stop ids (ignore_eos)."""
        return [row for row in rows.tolist() if row in self.matchers and self.matchers[row].is_terminated()]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def error_text(exc: Exception) -> str:
    """xgrammar's compile error without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    import re

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor, positions: list[int]) -> None:
    """Disallowed tokens of the constrained rows get -inf, in place (scores float32 [S, V], any device)."""
    import xgrammar as xgr

    mask = bitmask.to(scores.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(scores, mask, vocab_size=scores.shape[-1], indices=positions)
