"""Structured output with xgrammar: constraints compiled off the step loop, masks applied per step.

xgrammar (PyPI `xgrammar`) compiles a JSON schema, regex, EBNF grammar or structural tag against
the model's tokenizer into a `CompiledGrammar` (thread-safe, cached by its text); a per-request
`GrammarMatcher` fills the vocabulary bitmask of the tokens allowed next and accepts the sampled one.

- The tokenizer info is built once, at startup, from the model's tokenizer (`build_grammars`).
- `Grammars.submit` starts compiling on a thread pool and returns at once; the request waits in the
  `GrammarQueue`, outside the scheduler, until its grammar is ready, so a large schema never delays
  other requests' steps. A grammar that fails to compile fails its request with INVALID_ARGUMENT
  naming the constraint and xgrammar's error.
- Per step, `fill_bitmask` writes the masks of the batch's constrained rows into one int32
  [S, ceil(V/32)] tensor (unconstrained rows stay all-allowed); the sampler applies it on the device.
- `accept` advances each row's matcher by the token it sampled. The next mask needs that state;
  the engine (engine/engine_core.py) keeps overlap scheduling: inside step N+1's launch, after its
  forward is enqueued, it waits for step N's tokens, accepts them and fills N+1's mask.
- Speculative decoding: a constrained row's drafted positions each get the mask of the matcher
  after the drafts before them (accepted, filled, then rolled back: `fill_bitmask`'s `inputs`), so a
  draft the grammar forbids is never kept; the engine then accepts the tokens kept.
- The request still ends as any other: the grammar allows only a stop token (EOS) once complete,
  which finishes it with "stop". max_new_tokens still applies.

xgrammar treats every id in [tokenizer vocabulary, model vocab_size) as a special token and scans
that list linearly in each `accept_token` (and in some mask fills): when the model's vocab pads far
past its tokenizer's, the matchers are built over the tokenizer's own ids (rounded up to whole
bitmask words) and the words past them are cleared in each filled row. The masks and the accept
results are the same (a padding id is rejected either way), without the scan. Matchers run on the
engine's thread, one row after another.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenspeed_worker.engine.messages import AddRequest

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
                 threads: int = 2, draft_tokens: int = 0) -> None:
        """threads: grammar compilations at once; draft_tokens: the most a matcher walks ahead and
        rolls back in one step (speculative decoding's drafts)."""
        self.draft_tokens = draft_tokens
        import inspect

        import xgrammar

        # xgrammar before 0.2 keeps no history unless asked (max_rollback_tokens 0 by default);
        # later ones always can roll back and deprecate the argument.
        rollback = inspect.signature(xgrammar.GrammarMatcher.__init__).parameters.get("max_rollback_tokens")
        self._bounded_rollback = rollback is not None and rollback.default == 0
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
        if self.draft_tokens and self._bounded_rollback:
            self.matchers[row] = self._xgr.GrammarMatcher(compiled, max_rollback_tokens=self.draft_tokens)
        else:
            self.matchers[row] = self._xgr.GrammarMatcher(compiled)

    def release(self, row: int) -> None:
        self.matchers.pop(row, None)

    @property
    def active(self) -> bool:
        return bool(self.matchers)

    # -- per step ----------------------------------------------------------------------------

    def fill_bitmask(self, rows, inputs=None) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask int32 [S, ceil(V/32)] on the host, batch positions constrained) for the step's
        sampled rows, or None when none of them is constrained. `inputs` (a step with drafts, rows
        repeating once per drafted position): per position, the draft token it follows, or -1 at a
        row's first position; each position's mask is then the matcher's after those drafts (a draft
        the grammar rejects leaves the rest of its row unmasked: the mask before it already forbids it)."""
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
        if inputs is not None:
            return self._fill_drafted(bitmask, row_list, positions, inputs), positions
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

    def _fill_drafted(self, bitmask: torch.Tensor, row_list: list[int], positions: list[int], inputs) -> torch.Tensor:
        if self._written:
            self._bitmask[sorted(self._written)] = -1
        written: set[int] = set()
        walked: dict[int, int] = {}  # row -> drafts its matcher accepted (rolled back after)
        stuck: set[int] = set()  # rows whose grammar rejected a draft, or ended
        for i in positions:
            row = row_list[i]
            matcher = self.matchers[row]
            if row in stuck:
                continue
            if inputs[i] >= 0:
                if matcher.is_terminated() or not matcher.accept_token(int(inputs[i])):
                    stuck.add(row)
                    continue
                walked[row] = walked.get(row, 0) + 1
            if matcher.is_terminated():
                continue
            if self._words < bitmask.shape[1]:
                bitmask[i, self._words:] = 0
            matcher.fill_next_token_bitmask(self._row_masks[i], 0)
            written.add(i)
        for row, count in walked.items():
            self.matchers[row].rollback(count)
        self._written = written
        return bitmask

    def accept_kept(self, row: int, tokens) -> int:
        """Advance a constrained row's matcher by a speculative step's kept tokens, in order, stopping
        after the one that ends its grammar; returns how many it took (all for an unconstrained row)."""
        matcher = self.matchers.get(row)
        if matcher is None:
            return len(tokens)
        for j, token in enumerate(tokens.tolist()):
            if not matcher.is_terminated() and not matcher.accept_token(int(token)):
                logger.warning("grammar rejected token %d of row %d (it was masked in)", token, row)
            if matcher.is_terminated():
                return j + 1
        return len(tokens)

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


class GrammarQueue:
    """Constrained requests waiting, outside the scheduler, for their grammar to compile."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[AddRequest, Future]] = {}  # req_id -> (request, compilation)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._waiting

    def add(self, req: AddRequest, compilation: Future) -> None:
        self._waiting[req.req_id] = (req, compilation)

    def discard(self, req_id: int) -> bool:
        """Drop a waiting request (aborted); False when it is not waiting here."""
        return self._waiting.pop(req_id, None) is not None

    def take_compiled(self) -> Iterator[tuple[AddRequest, object | None, str | None]]:
        """The requests whose compilation ended, in arrival order, each taken off the queue as it is
        yielded: (request, CompiledGrammar, None), or (request, None, the error message)."""
        for req_id, (req, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[req_id]
            try:
                compiled = future.result()
            except Exception as exc:  # noqa: BLE001 - xgrammar's errors name the problem
                yield req, None, f"sampling_params.{req.constraint[0]}: {error_text(exc)}"
                continue
            yield req, compiled, None


def build_grammars(grammar_backend: str, tokenizer_path: str | None, vocab_size: int,
                   draft_tokens: int = 0) -> Grammars | None:
    """The engine's Grammars over the model's `vocab_size` logits, or None when constraints are not
    served here. The server decided whether they are (launch.structured_output_available) and set
    grammar_backend "none" if not; engines built directly (tests, benchmarks) check here."""
    if grammar_backend == "none" or not tokenizer_path or not xgrammar_available():
        return None
    try:
        return Grammars(tokenizer_path, vocab_size, draft_tokens=draft_tokens)
    except Exception as exc:  # a tokenizer xgrammar cannot read: constraints are refused upstream
        logger.warning("structured output unavailable: %s", exc)
        return None


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
