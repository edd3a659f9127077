"""Offline engine throughput and its fraction of the step roofline.

    python scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 1000 --output-len 1000

All requests are submitted at once (ignore_eos, greedy) and the engine steps until done; with
--closed-loop C, C at first and one more each time one finishes, until --num-requests were sent
(the arrival pattern of bench_serving.py --closed-loop, with no client, gRPC or server between:
the engine's figure for the serving path to be compared with).
For every step the minimum time is (its GEMM FLOPs / measured matmul FLOP/s) + (weights +
the KV of every sequence in it) / measured copy bandwidth; the report gives Σ minimum / wall.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench_common import free_engine_memory, MODEL_SHAPES, ModelArithmetic, add_engine_args, build_engine, greedy_request, \
    hf_generate_tok_s, plan_recorder, sync, write_result
from roofline import copy_bandwidth, fp8_matmul_flops, matmul_flops


def gpu_step_marks(core) -> list:
    """CUDA events at the start of each step's forward and after its sampler, in stream order:
    the GPU's own clock says how long it idled between one step's last kernel and the next's first."""
    marks: list = []
    forward, sample = core.runner.forward, core.sampler.sample

    def marked_forward(plan):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        marks.append([start, None])
        return forward(plan)

    def marked_sample(logits, batch, **kwargs):
        result = sample(logits, batch, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks[-1][1] = end
        return result

    core.runner.forward, core.sampler.sample = marked_forward, marked_sample
    return marks


def gpu_idle_gaps(marks) -> tuple:
    if not marks:
        return (None, None, None)
    torch.cuda.synchronize()
    complete = [(a, b) for a, b in marks if b is not None]
    gaps = [complete[i][1].elapsed_time(complete[i + 1][0]) for i in range(len(complete) - 1)]
    busy = [a.elapsed_time(b) for a, b in complete]
    return (float(np.median(gaps)) if gaps else None, float(np.mean(gaps)) if gaps else None, float(np.mean(busy)))


def step_kind(decode_rows: int, prefill_tokens: int) -> str:
    if not prefill_tokens:
        return "decode, <= 128 rows" if decode_rows <= 128 else ("decode, <= 320 rows" if decode_rows <= 320 else
                                                                "decode, > 320 rows")
    return "mixed (prefill + decode rows)" if decode_rows else "prefill only"


def breakdown(records: list, shapes: list, busy_ms: list, arithmetic: ModelArithmetic, flops: float,
              bandwidth: float, fp8_flops: float | None = None) -> dict:
    """Per kind of step: how many, the GPU's busy time in them, their roofline and its parts
    (GEMM FLOPs, weights, KV), and roofline / busy. Says where the wall time above the roofline goes."""
    kinds: dict = {}
    busy_by_kind: dict = {}
    for record, shape, busy in zip(records, shapes, busy_ms):
        busy_by_kind.setdefault(step_kind(*shape), []).append(busy)
        num_tokens, num_sampled, kv_tokens, attended = record
        row = kinds.setdefault(step_kind(*shape), dict.fromkeys(
            ("steps", "decode_rows", "tokens", "busy_s", "roofline_s", "flops_s", "weights_s", "kv_s"), 0.0))
        row["steps"] += 1
        row["decode_rows"] += shape[0]
        row["tokens"] += num_tokens
        row["busy_s"] += busy / 1e3
        row["roofline_s"] += arithmetic.minimum_seconds(record, flops, bandwidth, fp8_flops)
        row["flops_s"] += arithmetic.flops_seconds(record, flops, fp8_flops)
        row["weights_s"] += arithmetic.step_weight_bytes(num_tokens) / bandwidth
        row["kv_s"] += arithmetic.kv_bytes_per_token * kv_tokens / bandwidth
    for kind, row in kinds.items():
        # A step far above the median is a stall (a kernel compiling on first use, the host late).
        row["busy_ms_median"], row["busy_ms_max"] = float(np.median(busy_by_kind[kind])), max(busy_by_kind[kind])
        row["fraction_of_roofline"] = row["roofline_s"] / row["busy_s"] if row["busy_s"] else None
        row["mean_decode_rows"] = row.pop("decode_rows") / row["steps"]
    return kinds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--closed-loop", type=int, default=0, metavar="C",
                    help="C requests in flight, the next submitted as one finishes (0: all at once)")
    ap.add_argument("--hf-baseline-batch", type=int, default=0, help="also time transformers at this batch")
    ap.add_argument("--out", default=".cache/bench_offline.json")
    args = ap.parse_args()

    print(f"measuring copy bandwidth and matmul throughput on {args.device}...", flush=True)
    bandwidth = copy_bandwidth(args.device)
    flops = matmul_flops(args.device)
    print(f"  {bandwidth / 1e9:.0f} GB/s, {flops / 1e12:.1f} TFLOP/s", flush=True)
    core = build_engine(args, max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.max_num_seqs)
    arithmetic = ModelArithmetic.from_core(core)
    fp8_flops = fp8_matmul_flops(args.device) if arithmetic.fp8_linear else None
    if fp8_flops:
        print(f"  FP8 linear layers: {fp8_flops / 1e12:.1f} TFLOP/s (FP8 GEMM)", flush=True)
    records: list = []
    rng = np.random.default_rng(0)
    vocab = core.runner.vocab_size
    core.add_request(greedy_request(10**9, rng.integers(10, vocab - 10, 16), 4))  # warm-up
    for _ in core.run_steps():
        pass
    host_times: list = []
    shapes: list = []
    plan_recorder(core, arithmetic, records, host_times, shapes)
    gpu_marks = gpu_step_marks(core) if torch.device(args.device).type == "cuda" else None
    submitted = 0

    def submit(count: int) -> None:
        nonlocal submitted
        for _ in range(min(count, args.num_requests - submitted)):
            submitted += 1
            core.add_request(greedy_request(submitted, rng.integers(10, vocab - 10, args.input_len), args.output_len))

    submit(args.closed_loop or args.num_requests)
    sync(args.device)
    t0 = time.perf_counter()
    steps = 0
    produced = 0
    last_report = t0
    for out in core.run_steps():  # overlapping host and device work when the engine does (GPU default)
        steps += 1
        if out is not None:
            produced += len(out.tokens)
            if args.closed_loop:
                submit(len(out.finished_ids))
        now = time.perf_counter()
        if now - last_report > 10:
            print(f"  {steps} steps, {produced} tokens, {produced / (now - t0):.0f} tok/s", flush=True)
            last_report = now
    sync(args.device)
    wall = time.perf_counter() - t0
    minimum = sum(arithmetic.minimum_seconds(record, flops, bandwidth, fp8_flops) for record in records)
    idle = gpu_idle_gaps(gpu_marks)
    busy_ms = [a.elapsed_time(b) for a, b in gpu_marks if b is not None] if gpu_marks else []
    kinds = (breakdown(records, shapes, busy_ms, arithmetic, flops, bandwidth, fp8_flops)
             if len(busy_ms) == len(records) else None)
    result = {
        "gpu_idle_gap_ms_median": idle[0], "gpu_idle_gap_ms_mean": idle[1], "gpu_busy_ms_mean": idle[2],
        "model": args.model, "device": args.device, "dtype": str(core.runner.dtype),
        "attention_backend": getattr(core.runner.attention_backend, "name", core.cfg.model.attention_backend), "date": time.strftime("%Y-%m-%d"),
        "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs, "closed_loop": args.closed_loop or None, "kv_pool_tokens": core.num_blocks * core.cfg.cache.block_size,
        "copy_bandwidth_tb_s": bandwidth / 1e12, "matmul_tflop_s": flops / 1e12,
        "fp8_matmul_tflop_s": fp8_flops / 1e12 if fp8_flops else None,
        "wall_s": wall, "steps": steps, "output_tokens": produced, "output_tok_s": produced / wall,
        "step_roofline_s": minimum, "fraction_of_step_roofline": minimum / wall,
        "preemptions": core.scheduler.num_preemptions,
        # Host time per step in the native scheduler (schedule + commit + resolve); with overlap
        # scheduling the GPU does not wait for it unless the host falls behind.
        "host_scheduler_ms_per_step": 1000 * sum(host_times) / max(steps, 1),
        "step_ms_mean": 1000 * wall / max(steps, 1),
        "overlap_schedule": core.overlap_schedule,
        "tensor_parallel_size": core.cfg.parallel.tensor_parallel_size, "cuda_graphs": core.runner.cuda_graphs is not None,
        "by_step_kind": kinds,
    }
    print(f"{produced} output tokens in {wall:.1f}s = {produced / wall:.0f} tok/s; step roofline {minimum:.1f}s "
          f"({100 * minimum / wall:.1f}% of it)", flush=True)
    if idle[0] is not None:
        print(f"GPU idle between steps: median {idle[0]:.3f} ms, mean {idle[1]:.3f} ms; busy {idle[2]:.3f} ms per step",
              flush=True)
    for kind, row in (kinds or {}).items():
        print(f"  {kind}: {row['steps']:.0f} steps, {row['mean_decode_rows']:.0f} decode rows, busy {row['busy_s']:.2f} s, "
              f"roofline {row['roofline_s']:.2f} s ({100 * row['fraction_of_roofline']:.1f}%; flops {row['flops_s']:.2f}, "
              f"weights {row['weights_s']:.2f}, kv {row['kv_s']:.2f}); step median {row['busy_ms_median']:.1f} ms, "
              f"max {row['busy_ms_max']:.1f} ms", flush=True)
    write_result(args.out, result)  # before the baseline, which may run out of memory
    if args.hf_baseline_batch:
        del core, arithmetic, gpu_marks
        free_engine_memory()
        print(f"transformers generate at batch {args.hf_baseline_batch}...", flush=True)
        result["transformers_batch"] = args.hf_baseline_batch
        result["transformers_tok_s"] = hf_generate_tok_s(
            str(MODEL_SHAPES.get(args.model, args.model)), args.device, args.hf_baseline_batch,
            min(args.input_len, 512), min(args.output_len, 64), args.model in MODEL_SHAPES)
        print(f"  transformers: {result['transformers_tok_s']:.0f} tok/s", flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
