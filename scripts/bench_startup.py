"""Launch to healthy through the real CLI, cold and warm (issue 27's two startup figures).

For each model: `tokenspeed-worker MODEL --load-format dummy --cache-dir DIR` with DIR new and empty
(cold: no compiled kernels, no timed choices but the ones the package ships for this GPU model), then
again with the same DIR (warm: what the first start left; --warm-repeats N times, the median
reported). Each start is timed from launch to the gRPC health check's SERVING, then one greedy
request is served (its seconds reported: the first request must not pay what the start skipped),
then the worker stops with SIGTERM. The worker's own "startup phases" line and its launch-to-ready
figure come with each start.

    python scripts/bench_startup.py --model scripts/model_configs/llama-3.2-1b --out startup.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def one_start(model: str, cache_dir: str, extra: list[str], timeout: float) -> dict:
    from worker_harness import Worker

    from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb

    t0 = time.perf_counter()
    worker = Worker(model, "--load-format", "dummy", "--cache-dir", cache_dir, *extra, startup_timeout=timeout)
    healthy = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        request = pb.GenerateRequest(
            request_id="startup-first", tokenized=pb.TokenizedInput(input_ids=list(range(1, 129))),
            sampling_params=pb.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, n=1), stream=False)
        tokens = sum(len(r.complete.output_ids) for r in worker.stub.Generate(request, timeout=120)
                     if r.HasField("complete"))
        first_request = time.perf_counter() - t1
        log = worker.log_path.read_text(errors="replace")
    finally:
        worker.stop()
    phases = re.search(r"startup phases: (.*)", log)
    ready = re.search(r"ready ([0-9.]+) s after launch", log)
    return {"healthy_s": round(healthy, 2), "first_request_s": round(first_request, 3), "first_request_tokens": tokens,
            "worker_ready_s": float(ready.group(1)) if ready else None,
            "phases": phases.group(1).strip() if phases else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", required=True, help="config folders (dummy weights)")
    ap.add_argument("--startup-timeout", type=float, default=400.0)
    ap.add_argument("--warm-repeats", type=int, default=1,
                    help="warm starts after the cold one (their median is the warm figure: starts of one tree "
                         "vary by about a second)")
    ap.add_argument("--out", help="write the JSON result here too")
    ap.add_argument("worker_args", nargs="*", help="extra worker flags (after --)")
    args = ap.parse_args()
    result = {"command": " ".join(sys.argv), "models": {}}
    for model in (str(Path(m).resolve()) for m in args.model):
        with tempfile.TemporaryDirectory(prefix="tokenspeed-cold-") as cache_dir:
            runs = {}
            warm = []
            for kind in ["cold"] + ["warm"] * args.warm_repeats:
                run = one_start(model, cache_dir, args.worker_args, args.startup_timeout)
                if kind == "cold":
                    runs[kind] = run
                else:
                    warm.append(run)
                print(f"{Path(model).name} {kind}: healthy in {run['healthy_s']:.1f} s, first request "
                      f"{run['first_request_s']:.2f} s; phases: {run['phases']}", flush=True)
            # "warm": the start of median launch-to-healthy time, with every warm start's in healthy_s_all.
            runs["warm"] = dict(sorted(warm, key=lambda r: r["healthy_s"])[(len(warm) - 1) // 2],
                                healthy_s_all=[r["healthy_s"] for r in warm])
        result["models"][Path(model).name] = runs
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
