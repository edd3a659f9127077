"""The sampler alone: time per step at batch B x vocab V, greedy and with every option on,
against the time to read the logits once from memory (measured in the same run).

    python scripts/bench_sampler.py [--batch 256] [--vocab 128256] [--device cuda] [--backend torch triton]

Every option on: temperature, top-k, top-p, min-p, the three penalties, logit_bias,
min_new_tokens, and logprobs (chosen token + top-5). Prints progress and a JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenspeed_worker.sampling.sampler import Sampler, triton_sampling_available  # noqa: E402
from tokenspeed_worker.sampling.params import SamplingParams  # noqa: E402
from tokenspeed_worker.sampling.state import SamplingState  # noqa: E402


def timed(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_sampler.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    backends = args.backend or (["torch", "triton"] if device.type == "cuda" and triton_sampling_available()
                                else ["torch"])
    B, V = args.batch, args.vocab
    logits = torch.randn(B, V, device=device, dtype=torch.float32) * 3
    read_once = timed(lambda: logits.sum(), device, args.iters)  # one pass over the logits
    rng = np.random.default_rng(0)
    rows = np.arange(B)
    configs = {
        "greedy": SamplingParams(temperature=0.0),
        "temperature": SamplingParams(temperature=0.8, seed=1),
        "all_options": SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1, frequency_penalty=0.5, presence_penalty=0.5,
            repetition_penalty=1.1, logit_bias={5: 2.0, 17: -1.0}, min_new_tokens=4, stop_token_ids=(2,),
            return_logprob=True, top_logprobs_num=5),
    }
    results = {"batch": B, "vocab": V, "device": str(device), "read_logits_once_ms": 1000 * read_once,
               "logits_bytes": B * V * 4, "date": time.strftime("%Y-%m-%d"), "runs": []}
    print(f"reading the logits once ({B * V * 4 / 1e6:.0f} MB): {1000 * read_once:.3f} ms", flush=True)
    for backend in backends:
        sampler = Sampler(backend)
        for name, params in configs.items():
            state = SamplingState(B, V, device)
            for r in range(B):
                state.add_row(r, rng.integers(0, V, 512).astype(np.int32), params)
            for _ in range(8):  # some output history for the penalties
                state.update(rows, torch.from_numpy(rng.integers(0, V, B)).to(device))

            def step():
                return sampler.sample(logits, state.batch(rows)).tokens

            t = timed(step, device, args.iters)
            run = {"backend": backend, "config": name, "ms_per_step": 1000 * t, "ratio_to_read_once": t / read_once}
            results["runs"].append(run)
            print(f"{backend:6s} {name:12s}: {1000 * t:8.3f} ms per step = {t / read_once:6.1f}x reading the "
                  f"logits once", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
