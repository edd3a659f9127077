"""In-step timing of the small-batch GEMV sites' choices: which kernel configuration is fastest inside the
captured decode step, against the one each site chose when timed alone.

    python scripts/tune_step.py --model llama-3.2-1b --batch 1 [--top 6] [--context 256]

layers/small_batch_gemv.py times each site's paths one at a time (a CUDA graph of that one call, L2 flushed).
Inside a step the kernels overlap their neighbours (programmatic dependent launch: a kernel's first
weight tile loads before the previous kernel finishes), which a lone timing cannot see. This
script builds the engine (which makes those choices), then for each site at the given batch size
replaces its choice by each of its `--top` fastest alone and the unfused path, captures the whole
decode step (model + LM head) as a CUDA graph and times `--reps` back-to-back replays; it keeps the
fastest and goes on to the next site (coordinate descent, `--passes` times over the sites). It ends
by timing the original and the tuned choices alternately and writes everything as JSON (--out).
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import time

import torch

from bench_common import add_engine_args, build_engine, write_result


def parse_choice(name: str):
    return name if name == "unfused" else ast.literal_eval(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="keys each row attends to in the timed step")
    ap.add_argument("--top", type=int, default=6, help="configurations per site, fastest alone first")
    ap.add_argument("--reps", type=int, default=200,
                    help="graph replays per timing, at most (fewer where 0.15 s of steps takes fewer)")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--confirm", type=int, default=5, help="alternating original/tuned timings at the end")
    ap.add_argument("--out", default=".cache/tune_step.json")
    args = ap.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("tune_step needs a CUDA device (--device cuda)")
    started = time.perf_counter()
    core = build_engine(args, max_model_len=max(2048, args.context + 64), max_num_seqs=max(args.batch, 1),
                        cudagraph_capture_sizes=[args.batch])
    runner = core.runner
    gemv = runner.small_batch_gemv
    graphs = runner.cuda_graphs
    if graphs is None:
        raise SystemExit("CUDA graphs are off: nothing to tune in-step")
    size = args.batch
    width = math.ceil(args.context / runner.block_size)
    if size * width > runner.dummy_block:
        raise SystemExit(f"the pool has {runner.dummy_block} blocks, {size * width} needed")
    with torch.inference_mode():  # each row attends `context` keys in blocks of its own; writes go to the dummy block
        inputs = graphs.inputs[size]
        inputs.input_ids.fill_(100)
        inputs.positions.fill_(args.context - 1)
        inputs.seq_lens.fill_(args.context)
        inputs.block_tables[:, :width].copy_(
            torch.arange(size * width, dtype=torch.int32, device=inputs.block_tables.device).view(size, width))

    def step_us() -> float:
        with torch.inference_mode():
            step = graphs._make_step(size)
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(10):
                graph.replay()
            times = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.reps):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(1000.0 * start.elapsed_time(end) / args.reps)
            del graph
        return min(times)

    keys = [key for key in gemv.decisions if key[1] == size]
    original = {key: gemv.decisions[key] for key in keys}
    base = step_us()
    reps = max(20, min(args.reps, int(150_000 / base)))  # about 0.15 s of replays per timing, whatever the model
    if reps != args.reps:
        args.reps = reps
        base = step_us()
    print(f"{args.model} batch {size}, {args.context} keys: step {base:.1f} us with the lone-timed choices", flush=True)
    sites = []
    for pass_ in range(args.passes):
        for key in keys:
            alone = gemv.timings.get(key, {})
            names = sorted(alone, key=alone.get)
            candidates = [n for n in names if n != "unfused"][: args.top] + ["unfused"]
            current = gemv.decisions[key]
            in_step = {}
            for name in candidates:
                gemv.decisions[key] = parse_choice(name)
                in_step[name] = step_us()
            best = min(in_step, key=in_step.get)
            gemv.decisions[key] = parse_choice(best)
            label = "/".join(str(p) for p in key)
            print(f"  pass {pass_} {label}: was {current}, in-step best {best} "
                  f"({in_step[best]:.1f} us vs {in_step.get(str(current), float('nan')):.1f}); "
                  + ", ".join(f"{n} {in_step[n]:.1f} (alone {alone.get(n, float('nan')):.2f})" for n in candidates),
                  flush=True)
            sites.append({"pass": pass_, "site": label, "was": str(current), "best": best,
                          "in_step_us": in_step, "alone_us": {n: alone.get(n) for n in candidates}})
    tuned = {key: gemv.decisions[key] for key in keys}
    rounds = []
    for _ in range(args.confirm):
        gemv.decisions.update(original)
        a = step_us()
        gemv.decisions.update(tuned)
        b = step_us()
        rounds.append((a, b))
    orig_us = statistics.median(a for a, _ in rounds)
    tuned_us = statistics.median(b for _, b in rounds)
    print(f"{args.model} batch {size}: lone-timed choices {orig_us:.1f} us/step, in-step tuned {tuned_us:.1f} "
          f"({100 * (orig_us / tuned_us - 1):+.2f} % speed); {time.perf_counter() - started:.0f} s in all", flush=True)
    write_result(args.out, {
        "model": args.model, "batch": size, "context": args.context, "reps": args.reps,
        "original": {"/".join(map(str, k)): str(v) for k, v in original.items()},
        "tuned": {"/".join(map(str, k)): str(v) for k, v in tuned.items()},
        "step_us_original": orig_us, "step_us_tuned": tuned_us, "confirm_rounds_us": rounds, "sites": sites,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
