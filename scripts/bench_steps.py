"""One engine step of each kind, timed alone: where a step's time goes on the host and on the device.

    python scripts/bench_steps.py --model llama-3.2-1b --batch 64 --prompt-len 128 [--profile mixed]

Kinds (each repeated --repeats times, without overlap so each step stands alone):
- prefill: one new request of --prompt-len tokens and nothing else (a user's first token at batch 1);
- decode: --batch requests decoding one token each (a CUDA graph replay where captured);
- mixed: --batch - 1 requests decoding and one new --prompt-len prompt in the same step (what a
  served closed loop runs each time a client's next request arrives mid-decode).

For each kind: the host time of `launch()` (schedule, inputs, the forward's and sampling's launches),
the whole step's wall time (launch, then complete: the device finished and the outputs resolved), and
the device time between two CUDA events around the launch. A step whose launch takes nearly its wall
time is host-bound. `--profile KIND` prints cProfile's top functions of that kind's launches.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch

from bench_common import add_engine_args, build_engine, greedy_request, sync, write_result


def _timed_step(core, device, records: dict, kind: str, profiler: cProfile.Profile | None):
    cuda = torch.device(device).type == "cuda"
    sync(device)
    start = end = None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    launched = core.launch()
    if profiler is not None:
        profiler.disable()
    t1 = time.perf_counter()
    if cuda:
        end.record()
    out = core.complete(launched)
    sync(device)
    t2 = time.perf_counter()
    rec = records.setdefault(kind, {"launch_ms": [], "step_ms": [], "device_ms": [], "rows": []})
    rec["rows"].append(int(out.req_ids.shape[0]))  # requests that got a token from the step
    rec["launch_ms"].append(1000 * (t1 - t0))
    rec["step_ms"].append(1000 * (t2 - t0))
    if cuda:
        rec["device_ms"].append(start.elapsed_time(end))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", choices=("prefill", "decode", "mixed"), help="cProfile this kind's launches")
    ap.add_argument("--out", default=".cache/bench_steps.json")
    args = ap.parse_args()

    batch, plen, repeats = args.batch, args.prompt_len, args.repeats
    core = build_engine(args, max_model_len=plen + 4 * repeats + 64, max_num_seqs=batch,
                        overlap_schedule=False)
    rng = np.random.default_rng(0)
    vocab = core.runner.vocab_size
    next_id = iter(range(1, 1 << 30))
    records: dict = {}
    profiles = {args.profile: cProfile.Profile()} if args.profile else {}

    def prompt():
        return rng.integers(10, vocab - 10, plen)

    # Warm-up: two lone requests, untimed (a prefill and a one-row decode; the medians absorb what the
    # first mixed step still compiles).
    for _ in range(2):
        rid = next(next_id)
        core.add_request(greedy_request(rid, prompt(), 1))
        while core.has_work():
            core.step()

    # prefill: a lone new request (it finishes with its first token).
    for _ in range(repeats):
        core.add_request(greedy_request(next(next_id), prompt(), 1))
        _timed_step(core, args.device, records, "prefill", profiles.get("prefill"))
        while core.has_work():
            core.step()

    # decode at `batch`, and mixed: batch - 1 decoding plus one new prompt, aborted after its prefill.
    for rid in [next(next_id) for _ in range(batch - 1)]:
        core.add_request(greedy_request(rid, prompt(), 4 * repeats + 32))
    while core.loads().num_waiting:  # every prompt prefilled (a step's token budget may not hold them all)
        core.step()
    core.step()  # the batch decodes
    for _ in range(repeats):
        extra = next(next_id)
        core.add_request(greedy_request(extra, prompt(), 64))
        _timed_step(core, args.device, records, "mixed", profiles.get("mixed"))
        _timed_step(core, args.device, records, "decode", profiles.get("decode"))  # batch rows, graph
        core.abort(extra)
        core.step()  # the abort applied: batch - 1 rows again

    result = {"model": args.model, "device": args.device, "batch": batch, "prompt_len": plen, "repeats": repeats,
              "cuda_graphs": core.runner.cuda_graphs is not None}
    print(f"{args.model}, batch {batch}, prompt {plen}, medians of {repeats}:")
    for kind, rec in records.items():
        summary = {k: statistics.median(v) for k, v in rec.items() if v}
        result[kind] = summary
        device_ms = f"; device {summary['device_ms']:.3f} ms" if "device_ms" in summary else ""
        print(f"  {kind:8s} launch (host) {summary['launch_ms']:.3f} ms; step {summary['step_ms']:.3f} ms{device_ms}; "
              f"{summary['rows']} rows")
    for kind, prof in profiles.items():
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(f"cProfile of the {kind} launches ({repeats} of them), by own time:")
        print("\n".join(text.getvalue().splitlines()[:60]))
        result[f"profile_{kind}"] = text.getvalue()
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
