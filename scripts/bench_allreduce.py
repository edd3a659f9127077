"""Tensor-parallel all-reduce latency by message size: NCCL against the one-shot kernel over peer
memory (distributed.PeerAllReduce), both as the model runs them (inside CUDA graphs), to place
the size up to which the worker takes the one-shot path (distributed.ONE_SHOT_MAX_BYTES).

    python scripts/bench_allreduce.py [--gpus 2] [--hidden 4096 8192] [--rows 1 2 4 ... 512]

One process per GPU over NCCL (multicast off). For each message (rows x hidden, bf16) each path is
captured as CALLS back-to-back all-reduces in one graph, replayed REPLAYS times, and timed on
rank 0 (median per call); every message's one-shot sums are checked against NCCL's first (with
two GPUs they must be the same bits). Prints a table and writes a JSON result (--out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CALLS = 20


def _graph_us(torch, fn, x, replays: int) -> float:
    """Median microseconds per call of fn(x), CALLS calls captured in one CUDA graph."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        torch.distributed.barrier()  # the ranks start each replay together
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def rank_main(rank: int, size: int, port: int, args, results) -> None:
    import torch

    from tokenspeed_worker import distributed

    device = torch.device("cuda", rank)
    distributed.init(rank, size, f"tcp://127.0.0.1:{port}", device)
    max_bytes = max(args.rows) * max(args.hidden) * 2
    choice = distributed.setup_peer_all_reduce(torch.bfloat16, device, max_bytes=max_bytes)
    peer = distributed._PEER
    rows_out = []
    for hidden in args.hidden:
        for rows in args.rows:
            x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16,
                            generator=torch.Generator(device=device).manual_seed(rank))
            ref = x.clone()
            torch.distributed.all_reduce(ref)
            row = {"rows": rows, "hidden": hidden, "bytes": rows * hidden * 2}
            row["nccl_us"] = _graph_us(torch, torch.distributed.all_reduce, x.clone(), args.replays)
            if peer is not None:
                got = peer.all_reduce(x)
                row["same_as_nccl"] = bool(torch.equal(got, ref)) if size == 2 else bool(
                    torch.allclose(got, ref, atol=1e-2, rtol=1e-2))
                row["one_shot_us"] = _graph_us(torch, peer.all_reduce, x, args.replays)
                row["one_shot_speedup"] = row["nccl_us"] / row["one_shot_us"]
            rows_out.append(row)
            if rank == 0:
                print(f"  {rows:4d} x {hidden}: NCCL {row['nccl_us']:7.1f} us"
                      + (f", one-shot {row['one_shot_us']:7.1f} us ({row['one_shot_speedup']:.2f}x, same sums: "
                         f"{row['same_as_nccl']})" if peer is not None else ""), flush=True)
    if rank == 0:
        results.put({"choice": choice, "rows": rows_out, "gpu": torch.cuda.get_device_name(device),
                     "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    distributed.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_allreduce.json"))
    args = ap.parse_args()
    from tokenspeed_worker.distributed import MULTICAST_OFF
    from tokenspeed_worker.engine.tp_worker import free_port

    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)  # inherited by the ranks
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, args.gpus, port, args, results)) for rank in range(args.gpus)]
    for p in procs:
        p.start()
    print(f"all-reduce over {args.gpus} GPUs, bf16, {CALLS} calls per CUDA graph, median of {args.replays} replays",
          flush=True)
    result = results.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    print(f"path chosen by setup: {result['choice']}", flush=True)
    faster = [r["bytes"] for r in result["rows"] if r.get("one_shot_speedup", 0) > 1.0]
    result.update({"gpus": args.gpus, "calls_per_graph": CALLS, "replays": args.replays,
                   "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cpus",
                   "largest_message_one_shot_wins_bytes": max(faster) if faster else 0})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    return 0 if all(r.get("same_as_nccl", True) for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
