"""A sliding-window model at long context, through the real CLI and gRPC (issue 26): the KV a request
holds and its decode speed, by context length, with the window and without it.

For one model shape (a config folder; dummy weights) the script writes two copies of its config, one
with `sliding_window` = --window on every layer and one with full attention, and starts the worker
on each. For each context length (ascending) it streams one greedy request of that many prompt tokens
and --output-len new ones while polling GetLoads, and reports the time to first token, the
inter-token latency (p50), the decode rate after the first token, and the most KV the running
request held while it decoded (`num_used_tokens`; while its prompt's last chunk runs it holds that
chunk whole, reported apart). With the window, the held KV should stay near the window (plus a
step's tokens) and the decode rate should not fall as the context grows past it; without, both
follow the context.

    python scripts/bench_window.py --model scripts/model_configs/mistral-7b --window 4096 \
        --contexts 4096 8192 16384 32768 --output-len 128 --out window.json -- [worker flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb  # noqa: E402


def variant(source: Path, folder: Path, window: int | None, max_len: int) -> Path:
    """A copy of the config at `source` with every layer windowed (window) or none (None)."""
    config = json.loads((source / "config.json").read_text())
    config["sliding_window"] = window
    config["max_position_embeddings"] = max(int(config.get("max_position_embeddings") or 0), max_len)
    for key in ("layer_types", "use_sliding_window", "max_window_layers"):  # every layer alike (Mistral's form)
        config.pop(key, None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def one_request(stub, rid: str, prompt: list[int], output_len: int, poll_s: float) -> dict:
    """Stream one greedy request while a thread polls GetLoads; its figures.

    `kv_tokens_held_max` is the most KV the request held while it decoded (polls sent after its first
    token arrived, one of them at once): the figure the window bounds. Its prompt's last prefill
    chunk is held whole while that step runs, before the blocks it slid past are released, so the
    polls sent before the first token are reported apart (`kv_tokens_held_prefill_max`, bounded by
    the chunk, not the window).
    """
    held: list[tuple[float, int]] = []  # (when the poll was sent, tokens held)
    done, first_token = threading.Event(), threading.Event()

    def poll() -> None:
        while not done.is_set():
            sent = time.perf_counter()
            loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=30)
            held.append((sent, sum(load.num_used_tokens for load in loads.loads)))
            if first_token.is_set():
                done.wait(poll_s)
            else:
                first_token.wait(poll_s)  # the decode's first poll goes at once, not a period later

    poller = threading.Thread(target=poll, daemon=True)
    request = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True, n=1))
    stamps = []
    t0 = time.perf_counter()
    poller.start()
    try:
        for response in stub.Generate(request, timeout=3600):
            if response.HasField("chunk"):
                stamps += [time.perf_counter()] * len(response.chunk.token_ids)
                first_token.set()
    finally:
        done.set()
        poller.join()
    itl = np.diff(stamps)
    decoding = [n for sent, n in held if stamps and sent >= stamps[0]]
    return {"context": len(prompt), "output_tokens": len(stamps), "ttft_ms": 1000 * (stamps[0] - t0),
            "itl_ms_p50": 1000 * float(np.median(itl)) if len(itl) else None,
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None,
            "kv_tokens_held_max": max(decoding, default=0), "kv_polls_decoding": len(decoding),
            "kv_tokens_held_prefill_max": max((n for sent, n in held if not stamps or sent < stamps[0]), default=0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a config folder (dummy weights)")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--poll-ms", type=float, default=10.0, help="GetLoads every this many ms during a request")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", help="write the JSON result here too")
    ap.add_argument("worker_args", nargs="*", help="extra worker flags (after --)")
    args = ap.parse_args()
    from worker_harness import Worker

    source = Path(args.model).resolve()
    max_len = max(args.contexts) + args.output_len + 64
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(100, vocab - 100, size=n).tolist() for n in sorted(args.contexts)}
    result = {"command": " ".join(sys.argv), "model": source.name, "window": args.window, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="tokenspeed-window-") as tmp:
        for name, window in ((f"window {args.window}", args.window), ("full attention", None)):
            folder = variant(source, Path(tmp) / name.replace(" ", "_"), window, max_len)
            t0 = time.perf_counter()
            worker = Worker(folder, "--load-format", "dummy", "--max-model-len", str(max_len), *args.worker_args,
                            startup_timeout=args.startup_timeout)
            rows = []
            try:
                print(f"{name}: healthy in {time.perf_counter() - t0:.1f} s", flush=True)
                one_request(worker.stub, "warm-up", prompts[min(prompts)][:64], 8, args.poll_ms / 1000)
                worker.wait_graphs_captured()  # the steady state, not the engine's captures after startup
                for n, prompt in prompts.items():
                    row = one_request(worker.stub, f"ctx-{n}", prompt, args.output_len, args.poll_ms / 1000)
                    rows.append(row)
                    print(f"{name} context {n}: TTFT {row['ttft_ms']:.1f} ms, ITL p50 {row['itl_ms_p50']:.3f} ms, "
                          f"decode {row['decode_tok_s']:.1f} tok/s, KV held at most {row['kv_tokens_held_max']} "
                          f"tokens", flush=True)
            finally:
                worker.stop()
            result["variants"][name] = rows
    windowed = result["variants"][f"window {args.window}"]
    if len(windowed) > 1:  # the decode rate past the window against the first context's
        result["decode_rate_longest_over_shortest"] = windowed[-1]["decode_tok_s"] / windowed[0]["decode_tok_s"]
        result["kv_held_longest_over_window"] = windowed[-1]["kv_tokens_held_max"] / args.window
    result["median_itl_ms"] = {k: statistics.median(r["itl_ms_p50"] for r in v) for k, v in result["variants"].items()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
