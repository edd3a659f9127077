"""Device memory of each CUDA graph capture: the decode sizes, then the piecewise token counts.

    python scripts/bench_graph_memory.py --model llama-3.1-8b [--engine-arg KEY=VALUE ...] --out FILE

The engine is built as the worker builds it (weights, KV pool, the first decode sizes), then every
size and count left is captured one at a time, as a serving engine does while idle. For each
capture: the device memory it took (cudaMemGetInfo), and the caching allocator's segments split
into the graphs' private pool and the ordinary cache (eager warm-ups and checks, which later eager
steps reuse), with the bytes allocated in each. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_common import add_engine_args, build_engine, write_result

_MIB = 1 << 20


def pools() -> dict:
    """Bytes of the allocator's segments (and of their allocated blocks): graph pools, ordinary cache."""
    out = dict.fromkeys(("ordinary", "private", "ordinary_alloc", "private_alloc"), 0)
    for segment in torch.cuda.memory._snapshot()["segments"]:
        key = "ordinary" if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0) else "private"
        out[key] += segment["total_size"]
        out[key + "_alloc"] += segment["allocated_size"]
    return out


def state() -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"used": total - free, "reserved": torch.cuda.memory_reserved(), **pools()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--out", default=".cache/bench_graph_memory.json")
    args = ap.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("bench_graph_memory: CUDA graphs need --device cuda")
    core = build_engine(args, capture_all_graphs=False)
    runner = core.runner
    start = state()
    rows = []
    while runner.deferred_graphs:
        decode = runner.cuda_graphs is not None and bool(runner.cuda_graphs.deferred)
        left = runner.cuda_graphs.deferred if decode else runner.piecewise.deferred
        before, t0 = state(), time.perf_counter()
        runner.capture_deferred_graph()
        after = state()
        rows.append({"kind": "decode" if decode else "piecewise", "size": max(left), "seconds": time.perf_counter() - t0,
                     **{f"{key}_mib": (after[key] - before[key]) / _MIB for key in after}})
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    end = state()
    totals = {kind: {key: sum(r[f"{key}_mib"] for r in rows if r["kind"] == kind) for key in end}
              for kind in ("decode", "piecewise")}
    for kind, total in totals.items():
        print(f"{kind}: " + ", ".join(f"{key} {value:+.0f} MiB" for key, value in total.items()), flush=True)
    print(f"graph memory as the engine logs it: {runner.graph_bytes / _MIB:.0f} MiB; graph reserve at KV sizing "
          f"(without the profiled activations' share): {runner.cuda_graph_reserve_bytes() / _MIB:.0f} MiB", flush=True)
    write_result(args.out, {
        "model": args.model, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
        "start_mib": {k: v / _MIB for k, v in start.items()}, "end_mib": {k: v / _MIB for k, v in end.items()},
        "by_kind_mib": totals, "captures": rows, "logged_graph_mib": runner.graph_bytes / _MIB})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
