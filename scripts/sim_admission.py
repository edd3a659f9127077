"""Admission policies on the real scheduler core, without a model: preemptions, recomputed tokens
and the step roofline of an offline workload (CPU only, seconds).

    python scripts/sim_admission.py --workload fixed --num-requests 1000 --input-len 1000 --output-len 1000 \
        --max-num-seqs 512 --pool-tokens 873536 --conservativeness 0 1

Drives `tokenspeed_worker.scheduler.Scheduler` (the native core the engine runs) step by step,
answering each sample row with a token: `fixed` requests all run to max_new_tokens (ignore_eos,
as bench_offline does); `chat` requests stop with a stop token after a lognormal number of tokens
(median --chat-median-output) while asking for --chat-max-new-tokens. The time of each step is its
roofline on the Llama-3.1-8B shape at the bandwidth and matrix throughput measured on the H200
(bench_offline's arithmetic: weights once, the KV of every row, GEMM and attention FLOPs), so
policies compare by the work they make the GPU do; the GPU runs confirm the real figure
(docs/benchmarks.md). Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench_common import ModelArithmetic, step_record  # noqa: E402  (puts the repo on sys.path)
from tokenspeed_worker.scheduler.scheduler import Scheduler  # noqa: E402

# Llama-3.1-8B, bf16: matmul parameters every token passes (32 layers of q, k, v, o, gate, up,
# down), the LM head (untied, as the embedding), KV bytes per token (32 layers x K and V x 8 heads x 128 x 2 B).
_LINEAR, _LM_HEAD = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336), 128256 * 4096
LLAMA_8B = ModelArithmetic(weight_bytes=2 * (_LINEAR + 2 * _LM_HEAD), kv_bytes_per_token=32 * 2 * 8 * 128 * 2,
                           linear_params=_LINEAR, lm_head_params=_LM_HEAD, num_layers=32, q_dim=4096)
STOP = 2


def simulate(args, conservativeness: float) -> dict:
    rng = np.random.default_rng(args.seed)
    block = 16
    sched = Scheduler(num_blocks=args.pool_tokens // block, block_size=block, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, token_budget=args.chunked_prefill_size,
                      schedule_conservativeness=conservativeness)
    targets: dict[int, int] = {}
    prompt_tokens = 0
    for req in range(args.num_requests):
        if args.workload == "fixed":
            prompt_len, max_new, target = args.input_len, args.output_len, args.output_len
        else:
            prompt_len = int(rng.integers(args.input_len // 4, args.input_len * 2))
            max_new = min(args.chat_max_new_tokens, args.max_model_len - prompt_len)
            target = int(min(max_new, max(1, rng.lognormal(np.log(args.chat_median_output), 0.8))))
        targets[req] = target
        prompt_tokens += prompt_len
        sched.add_request(req, rng.integers(3, 30000, prompt_len), max_new, stop_token_ids=[STOP])
    seconds = computed = steps = output = rows = 0.0
    started = time.perf_counter()
    while sched.has_work():
        plan = sched.schedule()
        if plan.num_reqs == 0:
            raise RuntimeError("the scheduler made no progress")
        steps += 1
        rows += plan.num_reqs
        computed += plan.num_tokens
        seconds += LLAMA_8B.minimum_seconds(step_record(plan), args.flops, args.bandwidth)
        sampled = np.full(len(plan.sample_rows), 5, dtype=np.int64)
        for i, row in enumerate(plan.sample_rows):
            req = int(plan.req_ids[row])
            if sched.output_len(req) + 1 >= targets[req]:
                sampled[i] = STOP
        finished, _ = sched.advance(sampled)
        output += len(plan.sample_rows)
    decode_and_prompt = prompt_tokens + sum(targets.values()) - args.num_requests  # tokens computed once each
    return {
        "conservativeness": conservativeness, "steps": int(steps), "preemptions": sched.num_preemptions,
        "recomputed_tokens": int(computed - decode_and_prompt), "mean_rows_per_step": rows / steps,
        "roofline_s": seconds, "output_tok_s_at_roofline": sum(targets.values()) / seconds,
        "final_expected_output_ratio": sched.expected_output_ratio, "host_s": time.perf_counter() - started,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("fixed", "chat"), default="fixed")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000, help="fixed: prompt length; chat: mean-ish prompt length")
    ap.add_argument("--output-len", type=int, default=1000, help="fixed: max_new_tokens, all produced")
    ap.add_argument("--chat-median-output", type=int, default=300)
    ap.add_argument("--chat-max-new-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--pool-tokens", type=int, default=873536, help="KV pool (bench_offline's 8B bf16 run: 873,536)")
    ap.add_argument("--bandwidth", type=float, default=4.07e12, help="bytes/s (measured on the H200)")
    ap.add_argument("--flops", type=float, default=760e12, help="bf16 FLOP/s (measured on the H200)")
    ap.add_argument("--conservativeness", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".cache/sim_admission.json")
    args = ap.parse_args()
    results = []
    for c in args.conservativeness:
        result = simulate(args, c)
        results.append(result)
        print(f"conservativeness {c:g}: {result['preemptions']} preemptions, {result['recomputed_tokens']} tokens "
              f"recomputed, {result['mean_rows_per_step']:.0f} rows/step, {result['steps']} steps, roofline "
              f"{result['roofline_s']:.1f} s = {result['output_tok_s_at_roofline']:.0f} tok/s "
              f"(ratio learned {result['final_expected_output_ratio']:.2f}; {result['host_s']:.1f} s here)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
