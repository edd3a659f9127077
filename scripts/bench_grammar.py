"""Per-step cost of structured output: a decode batch where half the requests are constrained.

    python scripts/bench_grammar.py --model llama-3.2-1b --tokenizer DIR --batch 64 --steps 32

Runs the same batch twice in the engine, greedy, ignore_eos: all requests unconstrained, then
half of them under a JSON schema (xgrammar, engine/grammar.py). Reports the mean decode step
time of each, their difference as a fraction of the unconstrained step, and the host time the
grammar work itself takes per step (filling the batch's bitmask, accepting the sampled tokens),
measured around those calls. With constraints the engine completes every step before launching
the next (the next mask needs this step's tokens), so the difference also includes the overlap
given up.

`--tokenizer` is the tokenizer the grammar compiles against (any Hugging Face tokenizer folder
whose vocabulary fits the model's; the named shapes carry only config.json). Prints progress
and writes a JSON result (--out).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench_common import MODEL_SHAPES, add_engine_args, build_engine, sync, write_result
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.sampling.params import SamplingParams

# A list of records long enough that no constrained request completes (and leaves the batch) while
# it is measured.
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}}}},
    "required": ["name", "age", "tags", "address"]}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 64}


def run(core, batch: int, constrained: int, steps: int, prompt_len: int, rng, timings: dict,
        tokens: dict | None = None) -> float:
    """Mean decode step seconds over `steps` steps, after the prefill and a few warm steps.
    tokens: filled with {request index: [token ids]} of the constrained requests."""
    vocab = core.runner.vocab_size
    base = 10_000 * (1 + len(timings.setdefault("runs", [])))

    def seen(out):
        if out is not None and tokens is not None:
            for rid, token in zip(out.req_ids.tolist(), out.tokens.tolist()):
                if 0 <= rid - base < constrained:
                    tokens.setdefault(rid - base, []).append(int(token))
        return out

    for i in range(batch):
        constraint = ("json_schema", json.dumps(SCHEMA)) if i < constrained else None
        core.add_request(AddRequest(base + i, rng.integers(10, min(vocab, 30_000), prompt_len).astype(np.int32),
                                    steps + 16, SamplingParams(temperature=0.0, seed=i), constraint=constraint))
    gen = (seen(out) for out in core.run_steps())
    while core.waiting_for_grammar or core.scheduler.num_waiting:  # compiles and prefills
        next(gen)
    for _ in range(4):
        next(gen)
    sync(core.cfg.model.device)
    t0 = time.perf_counter()
    done = 0
    for out in gen:
        if out is not None:
            done += 1
        if done == steps:
            break
    sync(core.cfg.model.device)
    mean = (time.perf_counter() - t0) / steps
    for _ in gen:  # drain
        pass
    timings["runs"].append(mean)
    return mean


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder the grammars compile against")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out", default=".cache/bench_grammar.json")
    args = ap.parse_args()
    core = build_engine(args, max_model_len=args.prompt_len + args.steps + 64, max_num_seqs=args.batch,
                        tokenizer_path=args.tokenizer)
    if core.grammars is None:
        raise SystemExit("structured output unavailable (xgrammar missing, or no tokenizer in --tokenizer)")
    grammars = core.grammars
    host = {"fill": 0.0, "accept": 0.0, "calls": 0}
    fill, accept = grammars.fill_bitmask, grammars.accept

    def timed_fill(rows):
        t0 = time.perf_counter()
        result = fill(rows)
        host["fill"] += time.perf_counter() - t0
        host["calls"] += 1
        return result

    def timed_accept(rows, tokens):
        t0 = time.perf_counter()
        accept(rows, tokens)
        host["accept"] += time.perf_counter() - t0

    grammars.fill_bitmask, grammars.accept = timed_fill, timed_accept
    rng = np.random.default_rng(0)
    timings: dict = {}
    print("warm-up...", flush=True)
    run(core, args.batch, args.batch // 2, 4, args.prompt_len, rng, {})
    print(f"batch {args.batch}, unconstrained...", flush=True)
    plain = run(core, args.batch, 0, args.steps, args.prompt_len, rng, timings)
    host.update(fill=0.0, accept=0.0, calls=0)
    print(f"batch {args.batch}, {args.batch // 2} constrained by a JSON schema...", flush=True)
    tokens: dict = {}
    mixed = run(core, args.batch, args.batch // 2, args.steps, args.prompt_len, rng, timings, tokens)
    calls = max(1, host["calls"])
    # Correctness on this device: replay each constrained output through a fresh matcher of the
    # same grammar; every token must be accepted (the masks applied on the device kept them legal).
    compiled = grammars._compile("json_schema", json.dumps(SCHEMA))
    valid = 0
    for ids in tokens.values():
        matcher = grammars._xgr.GrammarMatcher(compiled)
        valid += all(matcher.accept_token(t) for t in ids)
    print(f"constrained outputs accepted by a fresh matcher: {valid} of {len(tokens)} "
          f"({sum(map(len, tokens.values()))} tokens)", flush=True)
    if core.scheduler.num_preemptions:
        print(f"note: {core.scheduler.num_preemptions} preemptions", flush=True)
    result = {
        "model": args.model if args.model in MODEL_SHAPES else str(args.model), "device": args.device,
        "batch": args.batch, "constrained": args.batch // 2, "steps": args.steps, "date": time.strftime("%Y-%m-%d"),
        "step_ms_unconstrained": 1000 * plain, "step_ms_half_constrained": 1000 * mixed,
        "grammar_overhead_fraction": (mixed - plain) / plain,
        "host_fill_bitmask_ms_per_step": 1000 * host["fill"] / calls,
        "host_accept_ms_per_step": 1000 * host["accept"] / calls,
        "overlap_schedule": core.overlap_schedule,
        "constrained_outputs_valid": valid, "constrained_outputs": len(tokens),
        "constrained_tokens_checked": sum(map(len, tokens.values())),
    }
    print(f"step {1000 * plain:.2f} ms unconstrained, {1000 * mixed:.2f} ms with half constrained "
          f"({100 * result['grammar_overhead_fraction']:+.1f}%); host: fill bitmask "
          f"{result['host_fill_bitmask_ms_per_step']:.3f} ms, accept {result['host_accept_ms_per_step']:.3f} ms per step",
          flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
