"""Where a decode step's time goes on the GPU: kernels by total time, GPU busy time per step vs wall.

    python scripts/profile_decode.py --model llama-3.1-8b --batch 1 --steps 32

Runs `batch` requests to steady decode, then profiles `steps` decode steps with torch.profiler
(CUDA activity). Prints the kernels ranked by total device time, their sum per step (the
device busy time), the wall time per step, and the gap between the two (host work the device
waited for, launch latency between kernels). Writes the table as JSON (--out).

--positions NAME=PERIOD breaks one kernel's calls down by their place in a repeating pattern, in
launch order: `_gemv_kernel=4` gives a decoder layer's four small-batch GEMV products (q/k/v, o, gate/up,
down where each takes the kernel) their own mean time and mean idle gap before them (the previous
kernel's end to this one's start). With programmatic dependent launch on (TOKENSPEED_PDL, the
default) a kernel's time includes its wait for the one before; TOKENSPEED_PDL=0 gives its own.
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
    ap.add_argument("--positions", action="append", default=[], metavar="NAME=PERIOD",
                    help="per-position times of kernel NAME's calls, repeating every PERIOD calls")
    ap.add_argument("--boundary", default=None, metavar="LAST,FIRST",
                    help="between steps: the device time from the end of kernel LAST (a step's last, e.g. "
                         "_argmax_over_chunks) to the start of the next kernel FIRST (the next step's first, e.g. "
                         "_resolve_pending_kernel), and what ran in between")
    ap.add_argument("--prefill-requests", type=int, default=0,
                    help="profile mixed steps instead: once the batch decodes steadily, add this many requests "
                         "of --prefill-len prompt tokens; the profiled steps prefill them beside the decodes")
    ap.add_argument("--prefill-len", type=int, default=1000)
    ap.add_argument("--out", default=".cache/profile_decode.json")
    args = ap.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("profile_decode needs a CUDA device (--device cuda)")
    # Enough new tokens that no request finishes before the profiled steps, however many steps the
    # prompts take to prefill (chunks of at least 2048 tokens).
    new_tokens = args.steps + 48 + args.batch * args.prompt_len // 2048
    total = args.prompt_len + new_tokens + 16
    total = max(total, args.prefill_len + 16)
    core = build_engine(args, max_model_len=total + 16, max_num_seqs=max(args.batch + args.prefill_requests, 1))
    rng = np.random.default_rng(0)
    vocab = core.runner.vocab_size
    for i in range(args.batch):
        core.add_request(greedy_request(i + 1, rng.integers(10, vocab - 10, args.prompt_len), new_tokens))
    steps = core.run_steps()
    while core.scheduler.num_waiting:  # every prompt admitted and (chunked) prefilling
        next(steps)
    for _ in range(16):  # the last prefill chunks, then warm decode steps
        next(steps)
    for i in range(args.prefill_requests):  # admitted by the next step, prefilled in chunks beside the decodes
        core.add_request(greedy_request(args.batch + i + 1, rng.integers(10, vocab - 10, args.prefill_len), 4))
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
    if args.prefill_requests:
        print(f"mixed steps: {args.prefill_requests} prompts of {args.prefill_len} tokens beside the decodes")
    print(f"{args.model} batch {args.batch}: wall {wall_us:.0f} us/step, device busy {busy_us:.0f} us/step "
          f"({100 * busy_us / wall_us:.1f}%), {launches:.0f} kernels/step", flush=True)
    print(f"{'us/step':>9} {'calls':>6}  kernel")
    for k in kernels[: args.top]:
        print(f"{k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  {k['name']}")
    positions = {spec: by_position(prof, *spec.rsplit("=", 1)) for spec in args.positions}
    for spec, rows in positions.items():
        print(f"{spec}: {'position':>8} {'calls':>6} {'us':>7} {'gap us':>7}")
        for row in rows:
            print(f"{'':{len(spec) + 1}} {row['position']:8d} {row['calls']:6d} {row['us']:7.2f} {row['gap_before_us']:7.2f}")
    boundary = None
    if args.boundary:
        boundary = step_boundaries(device_events(prof), *args.boundary.split(",", 1))
        print(f"between steps ({args.boundary}): {boundary['gap_us']:.2f} us mean over {boundary['boundaries']} "
              f"boundaries, of which idle {boundary['idle_us']:.2f} us")
        for op in boundary["ops"]:
            print(f"  {op['us']:7.2f} us  {op['name']}")
    write_result(args.out, {"model": args.model, "batch": args.batch, "steps": args.steps, "boundary": boundary,
                            "prefill_requests": args.prefill_requests, "prefill_len": args.prefill_len,
                            "positions": positions,
                            "overlap_schedule": core.overlap_schedule,
                            "cuda_graphs": core.runner.cuda_graphs is not None,
                            "wall_us_per_step": wall_us, "device_busy_us_per_step": busy_us,
                            "kernels_per_step": launches, "kernels": kernels[:60],
                            "date": time.strftime("%Y-%m-%d")})
    return 0


def device_events(prof) -> list:
    """The profile's device-side events (kernels, copies, memsets) in start order, as (name, start µs, end µs)."""
    from torch.autograd import DeviceType

    events = (e for e in prof.events() if e.device_type == DeviceType.CUDA)
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in events), key=lambda e: e[1])


def step_boundaries(events: list, last: str, first: str) -> dict:
    """Each step boundary: the end of a `last` kernel to the start of the next `first` one (name
    prefixes). Returns the mean span, the mean idle time inside it (no device event running) and the
    events inside it by name, each with its mean device time per boundary."""
    spans, idle, ops = [], [], {}
    open_at = None  # end of the last `last` kernel not yet followed by a `first` one
    inside: list = []
    for name, start, end in events:
        if open_at is not None and name.startswith(first):
            spans.append(start - open_at)
            busy, cursor = 0.0, open_at
            for _, s0, e0 in inside:  # union of the events' intervals inside the span
                s0, e0 = max(s0, cursor), min(e0, start)
                if e0 > s0:
                    busy += e0 - s0
                    cursor = e0
            idle.append(spans[-1] - busy)
            for op_name, s0, e0 in inside:
                ops[op_name] = ops.get(op_name, 0.0) + (e0 - s0)
            open_at, inside = None, []
        if name.startswith(last):
            open_at, inside = end, []
        elif open_at is not None:
            inside.append((name, start, end))
    n = len(spans)
    return {"boundaries": n, "gap_us": float(np.mean(spans)) if n else 0.0, "idle_us": float(np.mean(idle)) if n else 0.0,
            "ops": sorted(({"name": k[:110], "us": v / n} for k, v in ops.items()), key=lambda o: -o["us"]) if n else []}


def by_position(prof, name: str, period: str) -> list[dict]:
    """Mean device time of kernel `name`'s calls at each position modulo `period` (launch order), and
    the mean gap between the end of the device's previous kernel and each call's start."""
    from torch.autograd import DeviceType

    period_n = int(period)
    device_events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                           key=lambda e: e.time_range.start)
    sums = [[0, 0.0, 0.0] for _ in range(period_n)]  # calls, microseconds, gap before
    previous_end = None
    count = None  # positions count from a step's start: its input copies (host to device) come first
    for event in device_events:
        if event.name.startswith("Memcpy HtoD"):
            count = 0
        elif count is not None and event.name.startswith(name):
            row = sums[count % period_n]
            row[0] += 1
            row[1] += event.time_range.end - event.time_range.start
            row[2] += max(0.0, event.time_range.start - previous_end) if previous_end is not None else 0.0
            count += 1
        previous_end = event.time_range.end if previous_end is None else max(previous_end, event.time_range.end)
    return [{"position": i, "calls": c, "us": t / c if c else 0.0, "gap_before_us": g / c if c else 0.0}
            for i, (c, t, g) in enumerate(sums)]


if __name__ == "__main__":
    raise SystemExit(main())
