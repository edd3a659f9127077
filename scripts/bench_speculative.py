"""Speculative decoding through the real CLI and gRPC: output tokens/s with and without
`--speculative-algorithm NGRAM`, against workers this script starts.

Two parts (random weights accept nothing, so acceptance is forced where it is not real):
  oracle    a plain worker first serves every prompt greedily and its outputs are recorded; a
            speculative worker then drafts each request the recorded continuation
            (TOKENSPEED_SPECULATIVE_ORACLE) and its verification keeps each draft token with
            the forced probability --accept (engine/speculative.py OracleDrafter): tokens/s per
            acceptance level and batch size, each step computing and sampling every drafted
            position as a real one does. At acceptance 0 the figure is the cost of verifying
            drafts that all fail (and of the back-off after them). `same_output` (outputs equal
            to the plain run's) holds on exact arithmetic; random bf16 weights flip near-tied
            greedy choices when the batch shape changes, so there it is information only.
  text      real text (--text-model, e.g. SmolLM2-135M-Instruct) on a copy-heavy task (a passage
            and code to repeat with small edits): NGRAM's measured acceptance and its speedup.

    python scripts/bench_speculative.py --model DIR --batch 1 16 64 --accept 1.0 0.8 0.5 0 --draft-tokens 5
    python scripts/bench_speculative.py --text-model SMOLLM2_DIR --parts text

Every request is greedy with ignore_eos, so lengths are exact. Prints a JSON result (also --out).
Worker flags after `--` (e.g. --load-format dummy on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb  # noqa: E402

PASSAGE = (
    "The committee met on Tuesday to review the proposal for the new library. After a long discussion "
    "about the budget, the schedule and the location, the members agreed that the building should be "
    "finished within two years, that it should hold at least forty thousand books, and that the reading "
    "rooms should stay open until ten in the evening on weekdays. The chair thanked everyone for their work."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n\n"
    "def average_price(items):\n"
    "    if not items:\n"
    "        return 0\n"
    "    return sum(item.price for item in items) / len(items)\n"
)
TEXT_PROMPTS = (
    f"Repeat the following passage exactly, word for word.\n\nPassage:\n{PASSAGE}\n\nRepeated passage:\n",
    f"Rewrite this Python code, renaming `items` to `products`. Keep everything else the same.\n\n{CODE}\n"
    "Rewritten code:\n",
    f"Copy this text, but replace 'library' with 'museum':\n{PASSAGE}\n\nCopy:\n",
)


def generate(stub, rid: str, prompt: list[int], output_len: int) -> dict:
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), stream=False,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True, n=1))
    t0 = time.perf_counter()
    complete = list(stub.Generate(req, timeout=3600))[-1].complete
    return {"ids": list(complete.output_ids), "seconds": time.perf_counter() - t0,
            "drafted": complete.spec_draft_tokens, "accepted": complete.spec_accepted_tokens}


def wave(stub, prompts: list[list[int]], output_len: int, tag: str) -> tuple[list[dict], float]:
    """All prompts at once (one thread each); returns their results and the wave's wall seconds."""
    results: list[dict | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = generate(stub, f"{tag}-{i}-{time.monotonic_ns()}", prompts[i], output_len)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def figures(results: list[dict], wall: float, output_len: int) -> dict:
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    return {"output_tok_s": len(results) * output_len / wall, "wall_s": wall,
            "per_request_tok_s": float(np.mean([output_len / r["seconds"] for r in results])),
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None}


def start(model: str, args, extra: tuple[str, ...] = (), env: dict | None = None):
    from worker_harness import Worker

    flags = ("--max-model-len", str(args.max_model_len), *args.worker_args, *extra)
    t0 = time.perf_counter()
    worker = Worker(model, *flags, startup_timeout=args.startup_timeout, env=env)
    print(f"worker {' '.join(extra) or '(plain)'} healthy in {time.perf_counter() - t0:.1f} s", flush=True)
    waited = worker.wait_graphs_captured()
    if waited is not None:
        print(f"  its decode graphs left for after startup captured {waited:.1f} s later", flush=True)
    return worker


def spec_flags(width: int) -> tuple[str, ...]:
    return ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(width))


def part_oracle(args) -> dict:
    from tokenspeed_worker.proto import tokenspeed_scheduler_pb2_grpc as pb_grpc  # noqa: F401

    rng = np.random.default_rng(0)
    plain = start(args.model, args)
    vocab = plain.stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
    # One prompt set per (acceptance, batch): the oracle knows each prompt's acceptance.
    sets = {(a, b): [rng.integers(10, vocab - 10, args.prompt_len).tolist() for _ in range(b)]
            for a in args.accept for b in args.batch}
    rows: dict[tuple[float, int], dict] = {}
    oracle = []
    try:
        wave(plain.stub, sets[(args.accept[0], args.batch[0])][:1], 4, "warm")
        for (a, b), prompts in sets.items():
            results, wall = wave(plain.stub, prompts, args.output_len, "plain")
            rows[(a, b)] = {"accept_forced": a, "batch": b, "plain": figures(results, wall, args.output_len),
                            "_ids": [r["ids"] for r in results]}
            oracle += [{"tokens": p + r["ids"], "prompt_len": len(p), "accept": a} for p, r in zip(prompts, results)]
            print(f"  plain  batch {b:4d}: {rows[(a, b)]['plain']['output_tok_s']:9.1f} tok/s", flush=True)
    finally:
        plain.stop()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(oracle, f)
    out = []
    try:
        for width in args.draft_tokens:  # one speculative worker per verify width, against the one plain run
            spec = start(args.model, args, spec_flags(width), env={"TOKENSPEED_SPECULATIVE_ORACLE": f.name})
            try:
                wave(spec.stub, sets[(args.accept[0], args.batch[0])][:1], 4, "warm")
                for (a, b), prompts in sets.items():
                    results, wall = wave(spec.stub, prompts, args.output_len, "spec")
                    row = {k: v for k, v in rows[(a, b)].items() if k != "_ids"}
                    ids = rows[(a, b)]["_ids"]
                    row["draft_tokens"] = width
                    row["speculative"] = figures(results, wall, args.output_len)
                    row["same_output"] = [r["ids"] for r in results] == ids
                    row["same_output_tokens"] = float(np.mean([np.mean(np.equal(r["ids"], i))
                                                               for r, i in zip(results, ids)]))
                    row["speedup"] = row["speculative"]["output_tok_s"] / row["plain"]["output_tok_s"]
                    out.append(row)
                    print(f"  width {width} accept {a:.2f} batch {b:4d}: {row['speculative']['output_tok_s']:9.1f} "
                          f"tok/s (x{row['speedup']:.2f}, measured acceptance {row['speculative']['acceptance']}, "
                          f"same output {row['same_output']})", flush=True)
            finally:
                spec.stop()
    finally:
        os.unlink(f.name)
    return {"rows": out}


def part_text(args) -> dict:
    from transformers import AutoTokenizer

    model = args.text_model
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(p)["input_ids"] for p in TEXT_PROMPTS]
    out = {}
    texts = {}
    for name, extra in (("plain", ()), ("ngram", spec_flags(args.draft_tokens[0]))):
        worker = start(model, args, extra)
        try:
            # Every text once, untimed, at full length: the first requests of a fresh machine compile
            # kernels (a first text read 27 s on an H100). Then each text --text-repeats times, one at
            # a time (batch 1); its median run is kept.
            for i, prompt in enumerate(prompts):
                wave(worker.stub, [prompt], args.text_output_len, f"warm-{i}")
            runs = []
            for i, prompt in enumerate(prompts):
                timed = [wave(worker.stub, [prompt], args.text_output_len, f"{name}-{i}-{r}")
                         for r in range(args.text_repeats)]
                results, wall = sorted(timed, key=lambda t: t[1])[len(timed) // 2]
                runs.append(figures(results, wall, args.text_output_len))
                texts.setdefault(i, {})[name] = results[0]["ids"]
            out[name] = runs
        finally:
            worker.stop()
    for i in range(len(prompts)):
        plain_ids, ngram_ids = texts[i]["plain"], texts[i]["ngram"]
        out.setdefault("same_output", []).append(plain_ids == ngram_ids)
        # Where the two first differ (None: nowhere): in bf16 a verify step's logits may differ from
        # a one-token step's in the last bits, so a near-tie can go the other way from there on.
        out.setdefault("first_difference", []).append(
            next((k for k, (a, b) in enumerate(zip(plain_ids, ngram_ids)) if a != b), None))
        out.setdefault("speedup", []).append(out["ngram"][i]["output_tok_s"] / out["plain"][i]["output_tok_s"])
    out["sample_output"] = tokenizer.decode(texts[0]["plain"][:80])
    for i in range(len(prompts)):
        print(f"  text {i}: x{out['speedup'][i]:.2f}, acceptance {out['ngram'][i]['acceptance']}, "
              f"same output {out['same_output'][i]} (first difference at {out['first_difference'][i]})", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder for the oracle part")
    ap.add_argument("--text-model", help="a real model with its tokenizer for the text part")
    ap.add_argument("--parts", nargs="+", default=["oracle", "text"], choices=["oracle", "text"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--accept", type=float, nargs="+", default=[1.0, 0.8, 0.5, 0.0])
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[5],
                    help="--speculative-num-draft-tokens: tokens per verify step (the last one + drafts); several "
                    "widths: one speculative worker each against one plain run (the text part takes the first)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--text-output-len", type=int, default=256)
    ap.add_argument("--text-repeats", type=int, default=3, help="timed runs of each text (the median is kept)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_speculative.json"))
    ap.add_argument("worker_args", nargs="*", help="extra worker flags (after --)")
    args = ap.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cpus",
              "draft_tokens": args.draft_tokens, "worker_args": args.worker_args}
    if "oracle" in args.parts:
        if not args.model:
            ap.error("the oracle part needs --model")
        result["model"] = args.model
        result["oracle"] = part_oracle(args)
    if "text" in args.parts:
        if not args.text_model:
            ap.error("the text part needs --text-model")
        result["text_model"] = args.text_model
        result["text"] = part_text(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
