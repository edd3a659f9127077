"""Batch-1 decode latency of the engine and its fraction of the bandwidth roofline.

    python scripts/bench_latency.py --model llama-3.1-8b [--prompt-len 128] [--new-tokens 256]

A batch-1 decode step must read every weight once plus the request's KV cache, so its
minimum time is those bytes / the copy bandwidth measured in the same run. Reports the
median step time, tok/s, the roofline tok/s and the fraction reached; optionally the same
shape through transformers `generate` (--hf-baseline).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_common import free_engine_memory, MODEL_SHAPES, ModelArithmetic, add_engine_args, build_engine, greedy_request, \
    hf_generate_tok_s, sync, write_result
from roofline import copy_bandwidth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--out", default=".cache/bench_latency.json")
    args = ap.parse_args()

    print(f"measuring copy bandwidth on {args.device}...", flush=True)
    bandwidth = copy_bandwidth(args.device)
    print(f"  {bandwidth / 1e12:.2f} TB/s" if bandwidth > 1e12 else f"  {bandwidth / 1e9:.1f} GB/s", flush=True)
    core = build_engine(args, max_model_len=args.prompt_len + args.new_tokens + 16,
                        max_total_tokens=args.prompt_len + args.new_tokens + 64, max_num_seqs=1)
    arithmetic = ModelArithmetic.from_core(core)
    rng = np.random.default_rng(0)
    # A short warm-up request, then the measured one with another prompt: its first token is a
    # full prefill (no prefix-cache hit), as a new user's would be.
    prompts = [rng.integers(10, core.runner.vocab_size - 10, args.prompt_len) for _ in range(2)]
    for rid, new in ((1, 8), (2, args.new_tokens)):
        core.add_request(greedy_request(rid, prompts[rid - 1], new))
        # Time between consecutive outputs, as a client sees them (with overlap scheduling the host
        # work of one step runs while the GPU computes the next): the first is the TTFT.
        step_times = []
        sync(args.device)
        last = time.perf_counter()
        for out in core.run_steps():
            if out is None:
                continue
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
        print(f"  request {rid}: {len(step_times)} steps", flush=True)
    decode = step_times[1:]
    median = statistics.median(decode)
    contexts = args.prompt_len + np.arange(1, args.new_tokens)  # the decode steps' KV lengths
    roofline_step = arithmetic.step_bytes(arithmetic.kv_tokens(contexts) / len(contexts)) / bandwidth
    result = {
        "model": args.model, "device": args.device, "dtype": str(core.runner.dtype),
        "attention_backend": getattr(core.runner.attention_backend, "name", core.cfg.model.attention_backend), "date": time.strftime("%Y-%m-%d"),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "overlap_schedule": core.overlap_schedule,
        "tensor_parallel_size": core.cfg.parallel.tensor_parallel_size,
        "cuda_graphs": core.runner.cuda_graphs is not None,
        "copy_bandwidth_tb_s": bandwidth / 1e12, "weight_bytes": arithmetic.step_weight_bytes(1),
        "decode_step_ms_median": 1000 * median, "decode_step_ms_p90": 1000 * float(np.percentile(decode, 90)),
        "decode_tok_s": 1 / median, "roofline_tok_s": 1 / roofline_step,
        "fraction_of_bandwidth_roofline": roofline_step / median,
        "ttft_ms": 1000 * step_times[0],
        "skinny_kernels": core.runner.small_batch_gemv.report(),  # per site and row count: chosen path and its timings (µs)
        # By graph size: the in-step refinement of those choices (step µs before and after, what changed)
        "decode_step_tuning": getattr(core.runner.cuda_graphs, "tuning", {}),
        # The decode attention's single-split threshold per batch size, and its timings (µs: split, single)
        "decode_single_split_tokens": getattr(core.runner.attention_backend, "single_split_tokens", {}),
        "decode_single_split_timings": getattr(core.runner.attention_backend, "tuning", {}),
    }
    if result["decode_single_split_tokens"]:
        print(f"decode attention, one program per kv head up to (keys, by batch size): "
              f"{result['decode_single_split_tokens']}; at batch 1 (split, single µs by keys): "
              f"{result['decode_single_split_timings'].get(1)}", flush=True)
    print(f"batch-1 decode: {1000 * median:.2f} ms/step = {1 / median:.1f} tok/s; roofline {1 / roofline_step:.1f} "
          f"tok/s; {100 * roofline_step / median:.1f}% of it", flush=True)
    if args.hf_baseline:
        print("transformers generate at batch 1...", flush=True)
        del core, arithmetic
        free_engine_memory()
        result["transformers_tok_s"] = hf_generate_tok_s(str(MODEL_SHAPES.get(args.model, args.model)), args.device,
                                                         1, args.prompt_len, min(args.new_tokens, 64),
                                                         args.model in MODEL_SHAPES)
        result["ratio_to_transformers"] = result["decode_tok_s"] / result["transformers_tok_s"]
        print(f"  transformers: {result['transformers_tok_s']:.1f} tok/s", flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
