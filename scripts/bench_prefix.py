"""Shared-prefix multi-turn workload: how much prefill the prefix cache saves.

    python scripts/bench_prefix.py [--model DIR] [--conversations 8] [--turns 4] [-- worker flags]

C conversations share one system prompt; each runs T turns, every turn sending the whole
history (system + previous turns with their answers) plus new user tokens, as a chat client
does. The same workload runs twice against a fresh worker: prefix caching on, then off.
Reports the prefix hit rate (GetLoads), prefill tokens saved (sum of cached_tokens over sum of
prompt tokens), and time to first token per turn. Prints progress and a JSON result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from tokenspeed_worker.proto import common_pb2  # noqa: E402
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb  # noqa: E402
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2_grpc as pb_grpc  # noqa: E402


def conversation(stub, cid, system, turns, user_len, output_len, vocab, rng_seed, records):
    rng = np.random.default_rng(rng_seed)
    history = list(system)
    for turn in range(turns):
        history += rng.integers(10, vocab - 10, user_len).tolist()
        req = pb.GenerateRequest(
            request_id=f"conv-{cid}-{turn}-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=history),
            stream=True, sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=output_len,
                                                           ignore_eos=True, n=1))
        t0 = time.perf_counter()
        ttft = None
        answer: list[int] = []
        for r in stub.Generate(req, timeout=3600):
            if r.HasField("chunk"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                answer.extend(r.chunk.token_ids)
            else:
                records.append({"turn": turn, "prompt": len(history), "cached": r.complete.cached_tokens,
                                "ttft": ttft})
        history += answer


def run_workload(address, args, vocab):
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.TokenSpeedSchedulerStub(channel)
    # Warm up at the workload's shapes (first kernels, allocator growth) with a prompt the
    # measured run never sees, then empty the cache so the measured run starts cold.
    warm: list[dict] = []
    warm_threads = [threading.Thread(target=conversation, args=(
        stub, f"warm{c}", np.random.default_rng(999).integers(10, vocab - 10, args.system_len).tolist(), 2,
        args.user_len, args.output_len, vocab, 900 + c, warm)) for c in range(args.conversations)]
    for t in warm_threads:
        t.start()
    for t in warm_threads:
        t.join()
    stub.FlushCache(common_pb2.FlushCacheRequest())
    rng = np.random.default_rng(0)
    system = rng.integers(10, vocab - 10, args.system_len).tolist()
    records: list[dict] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(stub, c, system, args.turns, args.user_len,
                                                           args.output_len, vocab, 100 + c, records))
               for c in range(args.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    load = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    channel.close()
    # GetLoads' rate counts since start (the warm-up included); the per-request figures don't.
    prompt = sum(r["prompt"] for r in records)
    cached = sum(r["cached"] for r in records)
    per_turn = {}
    for turn in range(args.turns):
        rows = [r for r in records if r["turn"] == turn]
        per_turn[turn] = {"ttft_ms_median": 1000 * statistics.median(r["ttft"] for r in rows),
                          "prompt_tokens": sum(r["prompt"] for r in rows),
                          "cached_tokens": sum(r["cached"] for r in rows)}
    return {"wall_s": wall, "requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens_saved": cached / prompt if prompt else 0.0, "getloads_cache_hit_rate": load.cache_hit_rate,
            "ttft_ms_median": 1000 * statistics.median(r["ttft"] for r in records), "per_turn": per_turn}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_prefix.json"))
    ap.add_argument("worker_args", nargs="*", help="extra worker flags (after --)")
    args = ap.parse_args()

    from worker_harness import Worker, smollm2_dir

    model = args.model or str(smollm2_dir())
    results = {}
    for mode in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        print(f"{mode}: starting worker for {model}", flush=True)
        worker = Worker(model, mode, "--max-model-len", "8192", "--enable-cache-report", *args.worker_args)
        try:
            worker.wait_graphs_captured()  # the steady state, not the engine's captures after startup
            vocab = worker.stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
            info = worker.stub.GetServerInfo(pb.GetServerInfoRequest())
            device = info.scheduler_info["device"]
            results[mode.lstrip("-")] = run_workload(worker.address, args, vocab)
        finally:
            worker.stop()
        r = results[mode.lstrip("-")]
        print(f"  {r['requests']} requests in {r['wall_s']:.1f}s: prefill tokens saved "
              f"{100 * r['prefill_tokens_saved']:.1f}%, GetLoads hit rate {100 * r['getloads_cache_hit_rate']:.1f}%, "
              f"TTFT median {r['ttft_ms_median']:.0f} ms", flush=True)
    on, off = results["enable-prefix-caching"], results["no-enable-prefix-caching"]
    result = {"model": model, "device": device, "date": time.strftime("%Y-%m-%d"), "workload": vars(args),
              "results": results, "ttft_speedup": off["ttft_ms_median"] / on["ttft_ms_median"],
              "wall_speedup": off["wall_s"] / on["wall_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"TTFT median: {on['ttft_ms_median']:.0f} ms with the prefix cache vs {off['ttft_ms_median']:.0f} ms "
          f"without ({result['ttft_speedup']:.2f}x); wall {result['wall_speedup']:.2f}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
