"""Host cost per decode step of the grammar work (engine/grammar.py), no GPU and no model needed.

    python scripts/bench_grammar_host.py --rows 32 --steps 64

A batch of --batch rows, --rows of them constrained by the JSON schema of bench_grammar.py, steps
through --steps decode steps of `fill_bitmask` (the next step's masks) then `accept` (each row's
sampled token), on the CPU only: the tokenizer (--tokenizer) and xgrammar, with the model's vocab
size given (--vocab-size; 128256, Llama-3.2-1B's, by default, as bench_grammar.py measures).

Two paths, timed around those two calls:
  old          the previous implementation: matchers over the model's whole vocab, the whole
               bitmask reset each step
  new          Grammars: matchers over the tokenizer's ids when the model's vocab pads far past them
               (engine/grammar.py's module doc), only the rows that need it reset
First both run in lockstep, untimed: every step checks that they give the very same bitmask
(every row of the batch, so the same matcher states after the previous step's accepts) and the same
terminated rows; the run fails otherwise. Then each path is timed alone (its caches warm, as in the
engine) replaying the same tokens, best of --repeat runs. Tokens: --mode text follows a tokenized
JSON document valid under the schema (each row from its own offset); --mode random samples a
uniformly random allowed token from the mask.

Prints fill and accept ms per step for each path and writes a JSON result (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_grammar import SCHEMA  # noqa: E402
from tokenspeed_worker.engine.grammar import Grammars, logger  # noqa: E402


class OldGrammars(Grammars):
    """The previous fill_bitmask / accept (a plain loop over matchers built over the whole vocab),
    verbatim, for the baseline."""

    NARROW_MIN_PADDING = 1 << 62  # never narrow

    def fill_bitmask(self, rows):
        positions = [i for i, row in enumerate(rows.tolist()) if row in self.matchers]
        if not positions:
            return None
        size = len(rows)
        if self._bitmask is None or self._bitmask.shape[0] < size:
            self._bitmask = self._xgr.allocate_token_bitmask(max(size, 8), self.vocab_size)
        bitmask = self._bitmask[:size]
        bitmask.fill_(-1)
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
                    logger.warning("grammar rejected token %d of row %d (it was masked in)", token, row)


def json_document(min_tokens: int, tokenizer, seed: int = 0) -> list[int]:
    """Token ids of a JSON document valid under SCHEMA, at least min_tokens long."""
    rng = random.Random(seed)
    records: list[dict] = []
    while True:
        for _ in range(32):
            i = len(records)
            records.append({
                "name": f"Person {i} " + rng.choice(["Smith", "Lee", "O'Brien", "Müller", "Nguyễn"]),
                "age": rng.randint(0, 99),
                "tags": [rng.choice(["red", "blue", "x1", "ok", "née"]) for _ in range(rng.randint(0, 4))],
                "address": {"street": f"{rng.randint(1, 999)} Main St", "city": rng.choice(["Paris", "NYC", "Köln"])}})
        if len(records) >= 64:
            text = json.dumps(records, indent=2 if seed % 2 == 0 else None, ensure_ascii=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= min_tokens:
                return ids


def random_allowed(bitmask_row: torch.Tensor, vocab_size: int, rng: np.random.Generator) -> int:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits)
    return int(rng.choice(allowed))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=".cache/grammar_tokenizer", help="Hugging Face tokenizer folder")
    ap.add_argument("--vocab-size", type=int, default=128256, help="the model's vocab size (bitmask width)")
    ap.add_argument("--rows", type=int, default=32, help="constrained rows")
    ap.add_argument("--batch", type=int, default=None, help="rows in the batch (default 2 x --rows)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps measured (after --warmup)")
    ap.add_argument("--warmup", type=int, default=4, help="steps run first and not measured")
    ap.add_argument("--mode", choices=("text", "random"), default="text", help="which tokens the rows take")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per path; the best is reported")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default, as the engine runs; the old path's "
                         "per-step bitmask.fill_(-1) uses them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".cache/bench_grammar_host.json", help="JSON result")
    args = ap.parse_args()
    batch = args.batch or 2 * args.rows
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if not 0 < args.rows <= batch:
        raise SystemExit("--rows must be in [1, --batch]")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"building 2 grammar sets over {args.tokenizer} (vocab size {args.vocab_size})...", flush=True)
    paths = {
        "old": OldGrammars(args.tokenizer, args.vocab_size),
        "new": Grammars(args.tokenizer, args.vocab_size),
    }
    schema = json.dumps(SCHEMA)
    rows = np.arange(batch, dtype=np.int64)
    constrained = [i * batch // args.rows for i in range(args.rows)]  # spread over the batch
    stride = 29
    total = args.warmup + args.steps
    doc = json_document(64 + stride * args.rows + total + 8, tokenizer, args.seed) if args.mode == "text" else []
    compiled = {name: g._compile("json_schema", schema) for name, g in paths.items()}

    def start(name: str) -> Grammars:
        """The path's rows, fresh: each from its own offset into the document in text mode."""
        g = paths[name]
        for k, row in enumerate(constrained):
            g.start(row, compiled[name])
            for t in doc[:64 + stride * k]:
                assert g.matchers[row].accept_token(t)
        return g

    print(f"matcher vocab: old {paths['old'].matcher_vocab_size}, new {paths['new'].matcher_vocab_size}; "
          f"batch {batch}, {args.rows} constrained, mode {args.mode}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}", flush=True)

    # 1. Validation: all paths in lockstep; the tokens of each step are recorded for the timing.
    for name in paths:
        start(name)
    rng = np.random.default_rng(args.seed)
    steps_tokens: list[np.ndarray] = []
    checked_masks = checked_tokens = 0
    for step in range(total + 1):
        masks = {}
        for name, g in paths.items():
            out = g.fill_bitmask(rows)
            masks[name] = None if out is None else (out[0].clone(), list(out[1]))
        ref = masks["old"]
        for name, got in masks.items():
            if (got is None) != (ref is None) or (ref is not None and (
                    got[1] != ref[1] or not torch.equal(got[0], ref[0]))):
                raise SystemExit(f"step {step}: {name}'s bitmask differs from the old path's")
        checked_masks += 0 if ref is None else len(ref[1])
        if step == total:  # the states after the last accepts: one more mask, compared above
            break
        tokens = np.zeros(batch, dtype=np.int64)
        for k, row in enumerate(constrained):
            if args.mode == "text":
                tokens[row] = doc[64 + stride * k + step]
            elif not paths["old"].matchers[row].is_terminated():
                tokens[row] = random_allowed(ref[0][row], args.vocab_size, rng)
        steps_tokens.append(tokens)
        before = {name: [g.matchers[r].is_terminated() for r in constrained] for name, g in paths.items()}
        for g in paths.values():
            g.accept(rows, tokens)
        ended = {name: g.terminated(rows) for name, g in paths.items()}
        if any(e != ended["old"] for e in ended.values()) or any(b != before["old"] for b in before.values()):
            raise SystemExit(f"step {step}: the paths disagree on which grammars terminated")
        checked_tokens += sum(not t for t in before["old"])
    print(f"validated: identical bitmasks and terminations on all paths over {total + 1} fills "
          f"({checked_masks} row masks) and {checked_tokens} accepted tokens", flush=True)

    # 2. Timing: each path alone (its own caches warm, as in the engine), replaying the same tokens,
    # best of --repeat runs.
    times = {name: {"fill": float("inf"), "accept": float("inf"), "total": float("inf")} for name in paths}
    for _ in range(args.repeat):
        for name in paths:
            g = start(name)
            fill = accept = 0.0
            for step, tokens in enumerate(steps_tokens):
                t0 = time.perf_counter()
                g.fill_bitmask(rows)
                t1 = time.perf_counter()
                g.accept(rows, tokens)
                t2 = time.perf_counter()
                if step >= args.warmup:
                    fill += t1 - t0
                    accept += t2 - t1
            if fill + accept < times[name]["total"]:
                times[name] = {"fill": fill, "accept": accept, "total": fill + accept}
    for g in paths.values():
        g.shutdown()

    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "tokenizer": args.tokenizer,
        "vocab_size": args.vocab_size, "tokenizer_vocab": len(tokenizer.get_vocab()),
        "matcher_vocab_new": paths["new"].matcher_vocab_size, "batch": batch, "rows": args.rows,
        "steps": args.steps, "repeat": args.repeat, "mode": args.mode,
        "torch_threads": torch.get_num_threads(),
        "validated": {"steps": total + 1, "row_masks_compared": checked_masks, "tokens_accepted": checked_tokens},
        "paths": {},
    }
    base = (times["old"]["fill"] + times["old"]["accept"]) / args.steps
    print(f"{'path':10s} {'fill ms':>9s} {'accept ms':>10s} {'total ms':>9s}  vs old  (per step, {args.rows} rows)")
    for name, t in times.items():
        fill, accept = 1000 * t["fill"] / args.steps, 1000 * t["accept"] / args.steps
        speedup = base * 1000 / (fill + accept)
        result["paths"][name] = {"fill_ms_per_step": fill, "accept_ms_per_step": accept,
                                 "total_ms_per_step": fill + accept, "speedup_vs_old": speedup}
        print(f"{name:10s} {fill:9.3f} {accept:10.3f} {fill + accept:9.3f}  {speedup:5.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
