"""Where a decode step's time goes on the GPU: kernels by total time, GPU busy time per step vs wall.

    python scripts/profile_decode.py --model llama-3.1-8b --batch 1 --steps 32

Runs `batch` requests to steady decode, then profiles `steps` decode steps with torch.profiler
(CUDA activity). Prints the kernels ranked by total device time, their sum per step (the
device busy time), the wall time per step, and the gap between the two (host work the device
waited for, launch latency between kernels). Writes the table as JSON (--out).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench_common import add_engine_args, build_engine, greedy_request, write_result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=".cache/profile_decode.json")
    args = ap.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("profile_decode needs a CUDA device (--device cuda)")
    # Enough new tokens that no request finishes before the profiled steps, however many steps the
    # prompts take to prefill (chunks of at least 2048 tokens).
    new_tokens = args.steps + 48 + args.batch * args.prompt_len // 2048
    total = args.prompt_len + new_tokens + 16
    core = build_engine(args, max_model_len=total + 16, max_num_seqs=max(args.batch, 1))
    rng = np.random.default_rng(0)
    vocab = core.runner.vocab_size
    for i in range(args.batch):
        core.add_request(greedy_request(i + 1, rng.integers(10, vocab - 10, args.prompt_len), new_tokens))
    steps = core.run_steps()
    while core.scheduler.num_waiting:  # every prompt admitted and (chunked) prefilling
        next(steps)
    for _ in range(16):  # the last prefill chunks, then warm decode steps
        next(steps)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for _ in steps:  # drain
        pass
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us and device_us > 0:
            kernels.append({"name": event.key[:110], "calls_per_step": event.count / args.steps,
                            "us_per_step": device_us / args.steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    busy_us = sum(k["us_per_step"] for k in kernels)
    launches = sum(k["calls_per_step"] for k in kernels)
    wall_us = 1e6 * wall / args.steps
    print(f"{args.model} batch {args.batch}: wall {wall_us:.0f} us/step, device busy {busy_us:.0f} us/step "
          f"({100 * busy_us / wall_us:.1f}%), {launches:.0f} kernels/step", flush=True)
    print(f"{'us/step':>9} {'calls':>6}  kernel")
    for k in kernels[: args.top]:
        print(f"{k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  {k['name']}")
    write_result(args.out, {"model": args.model, "batch": args.batch, "steps": args.steps,
                            "overlap_schedule": core.overlap_schedule,
                            "cuda_graphs": core.runner.cuda_graphs is not None,
                            "wall_us_per_step": wall_us, "device_busy_us_per_step": busy_us,
                            "kernels_per_step": launches, "kernels": kernels[:60],
                            "date": time.strftime("%Y-%m-%d")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
