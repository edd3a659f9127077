"""The per-step grammar work of engine/grammar.py, its matchers built over the tokenizer's own ids
when the model's vocab pads far past them and its bitmask rows reset only where needed, gives
exactly the masks and accept
results of the plain loop over matchers of the whole vocab (the previous implementation, rebuilt
here on xgrammar directly): over a few dozen steps of random allowed tokens, with rows that
terminate, a rejected token, a row released and reused, and unconstrained rows in the batch."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from tokenspeed_worker.engine.grammar import Grammars  # noqa: E402
from worker_harness import smollm2_dir  # noqa: E402

pytestmark = pytest.mark.smollm2

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# (kind, text) per constrained row: long-running JSON, and grammars short enough to terminate.
CONSTRAINTS = [("json_schema", json.dumps(PERSON)), ("regex", "(yes|no|maybe)"),
               ("ebnf_grammar", 'root ::= "a" [0-9]? "b"'),
               ("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 3})),
               ("regex", "[a-z]{2,6}")]


@pytest.fixture(scope="module")
def tok_path() -> str:
    return str(smollm2_dir())


@pytest.fixture(scope="module")
def tokenizer(tok_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_path)


class Reference:
    """The previous Grammars.fill_bitmask / accept: matchers over the whole vocab, a plain loop."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self.matchers: dict[int, object] = {}
        self.rejected: list[tuple[int, int]] = []

    def compile(self, kind: str, text: str):
        return {"json_schema": self.compiler.compile_json_schema, "regex": self.compiler.compile_regex,
                "ebnf_grammar": self.compiler.compile_grammar}[kind](text)

    def fill_bitmask(self, rows):
        positions = [i for i, row in enumerate(rows.tolist()) if row in self.matchers]
        if not positions:
            return None
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i in positions:
            matcher = self.matchers[int(rows[i])]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask, positions

    def accept(self, rows, tokens) -> None:
        for row, token in zip(rows.tolist(), tokens.tolist()):
            matcher = self.matchers.get(row)
            if matcher is not None and not matcher.is_terminated():
                if not matcher.accept_token(int(token)):
                    self.rejected.append((row, int(token)))

    def terminated(self, rows) -> list[int]:
        return [row for row in rows.tolist() if row in self.matchers and self.matchers[row].is_terminated()]


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def rejected_rows(caplog) -> list[tuple[int, int]]:
    out = [(r.args[1], r.args[0]) for r in caplog.records if r.getMessage().startswith("grammar rejected token")]
    caplog.clear()
    return out


@pytest.mark.parametrize("padding", [0, 4096 + 7], ids=["vocab=tokenizer", "vocab padded"])
@pytest.mark.parametrize("batch,constrained", [(24, 18), (80, 72)])
def test_narrow_vocab_and_row_resets_match_the_plain_loop(tok_path, tokenizer, caplog, padding, batch, constrained):
    vocab = len(tokenizer.get_vocab())
    vocab_size = vocab + padding
    ref = Reference(tokenizer, vocab_size)
    serial = Grammars(tok_path, vocab_size)
    if padding > 1024:  # matchers over the tokenizer's ids, whole words: the rest are cleared per row
        assert serial.matcher_vocab_size == -(-vocab // 32) * 32 < vocab_size
    else:
        assert serial.matcher_vocab_size == vocab_size
    grammars = {"serial": serial}
    compiled = {name: [g._compile(k, t) for k, t in CONSTRAINTS] for name, g in grammars.items()}
    ref_compiled = [ref.compile(k, t) for k, t in CONSTRAINTS]

    def start(row: int, which: int) -> None:
        ref.matchers[row] = xgr.GrammarMatcher(ref_compiled[which])
        for name, g in grammars.items():
            g.start(row, compiled[name][which])

    def release(row: int) -> None:
        ref.matchers.pop(row, None)
        for g in grammars.values():
            g.release(row)

    rng = np.random.default_rng(batch + padding)
    # Engine rows are not batch positions: a permutation, the constrained ones spread over the batch.
    rows = rng.permutation(np.arange(100, 100 + batch)).astype(np.int64)
    for k, row in enumerate(rows[:constrained].tolist()):
        start(row, k % len(CONSTRAINTS))
    eos = tokenizer.eos_token_id
    ended_total = 0
    caplog.set_level(logging.WARNING, logger="tokenspeed_worker.engine.grammar")
    for step in range(36):
        if step == 12:  # a request ends and another takes its row (a row masked before, now again)
            row = int(rows[0])
            release(row)
            start(row, 1)
        if step == 20:  # a request ends and its row stays unconstrained (its mask row must reset)
            release(int(rows[1]))
        want = ref.fill_bitmask(rows)
        for name, g in grammars.items():
            got = g.fill_bitmask(rows)
            assert got is not None and got[1] == want[1], (name, step)
            assert got[0].shape == want[0].shape and torch.equal(got[0], want[0]), (name, step)
        tokens = np.zeros(batch, dtype=np.int64)
        for i, row in enumerate(rows.tolist()):
            matcher = ref.matchers.get(row)
            if matcher is None or matcher.is_terminated():
                tokens[i] = rng.integers(0, vocab)  # unconstrained: anything
                continue
            allowed = allowed_ids(want[0][i], vocab_size)
            assert allowed.size and allowed.max() < vocab  # padding ids never allowed
            # Prefer EOS when allowed, so the short grammars terminate within the run.
            tokens[i] = eos if eos in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
        if step == 7:  # a token its mask did not allow: rejected (and logged) by every path alike
            i = next(i for i, row in enumerate(rows.tolist())
                     if row in ref.matchers and not ref.matchers[row].is_terminated())
            tokens[i] = int(np.setdiff1d(np.arange(vocab), allowed_ids(want[0][i], vocab_size))[0])
        ref.accept(rows, tokens)
        for name, g in grammars.items():
            caplog.clear()
            g.accept(rows, tokens)
            assert sorted(rejected_rows(caplog)) == sorted(ref.rejected), (name, step)
            assert g.terminated(rows) == ref.terminated(rows), (name, step)
        if step == 7:
            assert len(ref.rejected) == 1
        ref.rejected.clear()
        ended_total = len(ref.terminated(rows))
    assert ended_total >= 3  # rows did terminate (and were then skipped by fill and accept)
    for g in grammars.values():
        g.shutdown()

