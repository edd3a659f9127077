"""Serving benchmark over gRPC (our own client of TokenSpeedScheduler, calling it as the gateway
does): output tokens/s, time to first token, inter-token latency and end-to-end latency
(p50/p90/p99) for C concurrent streams, against a worker this script starts (or one at --address).
With matplotlib installed, --plot DIR writes throughput-vs-concurrency and latency-distribution PNGs.

    python scripts/bench_serving.py --model DIR --concurrency 1 16 64 256 --prompt-len 128 --output-len 64

Every request uses ignore_eos so lengths are exact. Prints progress and a JSON result
(also written to --out). On a GPU, pass the worker's flags after `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb  # noqa: E402


def one_stream(stub, rid, prompt, output_len, results, stream=True):
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True, n=1))
    t0 = time.perf_counter()
    stamps = []
    n = 0
    for r in stub.Generate(req, timeout=3600):
        if r.HasField("chunk"):
            now = time.perf_counter()
            stamps.extend([now] * len(r.chunk.token_ids))
            n += len(r.chunk.token_ids)
        elif not stream and r.HasField("complete"):  # everything at once: its time is the first token's
            stamps.append(time.perf_counter())
            n += len(r.complete.output_ids)
    results.append({"ttft": stamps[0] - t0, "e2e": time.perf_counter() - t0, "tokens": n,
                    "itl": list(np.diff(stamps)) if len(stamps) > 1 else []})


_CLIENT_STUB = None


def _client_stub(address: str):
    """One channel per client process (made after the process started: gRPC channels do not survive fork)."""
    global _CLIENT_STUB
    if _CLIENT_STUB is None:
        from tokenspeed_worker.proto import tokenspeed_scheduler_pb2_grpc as pb_grpc

        _CLIENT_STUB = pb_grpc.TokenSpeedSchedulerStub(grpc.insecure_channel(address))
    return _CLIENT_STUB


def run_streams(stub, queues, output_len, stream=True):
    """One thread per queue of (rid, prompt), each running its requests back to back (a queue of one:
    a plain stream): the results of all of them."""
    results: list[dict] = []

    def run(jobs) -> None:
        for rid, prompt in jobs:
            one_stream(stub, rid, prompt, output_len, results, stream)

    threads = [threading.Thread(target=run, args=(jobs,)) for jobs in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def client_streams(address, queues, output_len, stream=True):
    """run_streams in a client process (--client-procs), on its own channel."""
    return run_streams(_client_stub(address), queues, output_len, stream)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_counters(metrics_port: int) -> dict[str, float]:
    """The worker's step and token counters from its Prometheus endpoint (--metrics-port)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    wanted = {"tokenspeed:step_duration_seconds_count": "steps", "tokenspeed:step_duration_seconds_sum": "step_s",
              "tokenspeed:generation_tokens_total": "tokens"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:  # summed over label sets
                out[wanted[sample.name]] = out.get(wanted[sample.name], 0.0) + sample.value
    return out


def run_level(stub, concurrency, prompt_len, output_len, rounds, vocab, seed, address=None, pool=None,
              closed_loop=False, server_pid=None, stream=True, engine_pid=None, metrics_port=None):
    """`rounds` waves of `concurrency` streams (each wave starts when the last one has ended), or with
    closed_loop `concurrency` streams that each run `rounds` requests back to back (a stream starts
    its next request as soon as its last one ends, as an engine with `concurrency` running requests
    keeps them: the comparison with bench_offline at --max-num-seqs `concurrency`). With a process
    pool (--client-procs) the streams are split across the client processes, so one Python
    client's GIL does not cap the message rate."""
    rng = np.random.default_rng(seed)
    results: list[dict] = []
    total = concurrency * rounds
    cpu0 = cpu_seconds(server_pid) if server_pid else None
    engine_cpu0 = cpu_seconds(engine_pid) if engine_pid else None
    counters0 = engine_counters(metrics_port) if metrics_port else None
    t0 = time.perf_counter()
    if closed_loop:
        queues = [[(f"bench-{concurrency}-{i}-{r}", rng.integers(10, vocab - 10, prompt_len).tolist())
                   for r in range(rounds)] for i in range(concurrency)]
        if pool is None:
            results = run_streams(stub, queues, output_len, stream)
        else:
            parts = [queues[k::pool.procs] for k in range(pool.procs)]
            for part in pool.map(client_streams, [address] * pool.procs, parts, [output_len] * pool.procs,
                                 [stream] * pool.procs):
                results.extend(part)
        print(f"  concurrency {concurrency}: {len(results)}/{total} requests done (closed loop)", flush=True)
    for r in range(0 if closed_loop else rounds):
        jobs = [(f"bench-{concurrency}-{r}-{i}", rng.integers(10, vocab - 10, prompt_len).tolist())
                for i in range(concurrency)]
        if pool is None:
            results.extend(run_streams(stub, [[job] for job in jobs], output_len, stream))
        else:
            parts = [[[job] for job in jobs[k::pool.procs]] for k in range(pool.procs)]
            for part in pool.map(client_streams, [address] * len(parts), parts, [output_len] * len(parts),
                                 [stream] * len(parts)):
                results.extend(part)
        print(f"  concurrency {concurrency}: {len(results)}/{total} requests done", flush=True)
    wall = time.perf_counter() - t0
    tokens = sum(x["tokens"] for x in results)
    itl = [v for x in results for v in x["itl"]]
    # The server process's CPU over the level (its threads included; the engine is another process):
    # near `wall` means the one server process is what the streams wait for.
    server = {}
    if cpu0 is not None:
        cpu = cpu_seconds(server_pid) - cpu0
        server = {"server_cpu_s": cpu, "server_cpu_fraction_of_wall": cpu / wall,
                  "server_cpu_us_per_output_token": 1e6 * cpu / max(tokens, 1)}
    # The engine's side of the same level: its process's CPU share (near 1: its host work, not the
    # device, sets the pace), and its steps from the worker's counters: how many, and how full (rows
    # per step against the C of an engine kept at C running requests: below C, the engine ran emptier
    # batches than offline; fewer steps per second at full rows: slower steps).
    if engine_cpu0 is not None:
        server["engine_cpu_fraction_of_wall"] = (cpu_seconds(engine_pid) - engine_cpu0) / wall
    if counters0 is not None:
        counters = engine_counters(metrics_port)
        steps = counters.get("steps", 0.0) - counters0.get("steps", 0.0)
        made = counters.get("tokens", 0.0) - counters0.get("tokens", 0.0)
        server.update(engine_steps=int(steps), engine_steps_per_s=steps / wall,
                      engine_tokens_per_step=made / steps if steps else None,
                      engine_step_ms_mean=1000 * (counters.get("step_s", 0.0) - counters0.get("step_s", 0.0)) / steps
                      if steps else None)
    return {
        **server,
        "concurrency": concurrency, "closed_loop": closed_loop, "stream": stream, "requests": len(results),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "wall_s": wall, "output_tok_s": tokens / wall,
        "per_stream_tok_s": statistics.mean(x["tokens"] / x["e2e"] for x in results),
        "ttft_ms_median": 1000 * statistics.median(x["ttft"] for x in results),
        "itl_ms_median": 1000 * statistics.median(itl) if itl else None,
        "itl_ms_p99": 1000 * float(np.percentile(itl, 99)) if itl else None,
        **{f"{name}_ms_p{q}": 1000 * float(np.percentile(values, q))
           for name, values in (("ttft", [x["ttft"] for x in results]), ("e2e", [x["e2e"] for x in results]),
                                ("itl", itl or [0.0]))
           for q in (50, 90, 99)},
        "_itl_samples": itl,
    }


class KvSubscription:
    """A SubscribeKvEvents stream read in a thread, as the smg gateway holds one on every worker."""

    def __init__(self, stub) -> None:
        from tokenspeed_worker.proto import common_pb2

        self.call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True))
        self.batches = self.events = self.load_only = 0
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.call:
                self.batches += 1
                self.events += len(batch.events)
                self.load_only += batch.load.load_only
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = f"{e.code().name}: {e.details()}"

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)

    def summary(self) -> dict:
        return {"batches": self.batches, "events": self.events, "load_only": self.load_only, "error": self.error}


def hf_baseline(model: str, prompt_len: int, output_len: int, batch: int) -> float:
    """transformers generate (greedy, same lengths) output tok/s: the peer measured in the same run."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.randint(10, m.config.vocab_size - 10, (batch, prompt_len))
    with torch.inference_mode():
        m.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = m.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                         pad_token_id=0)
        wall = time.perf_counter() - t0
    return batch * (out.shape[1] - prompt_len) / wall


def plot(levels: list[dict], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    conc = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(conc, [lv["output_tok_s"] for lv in levels], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(folder / "throughput_vs_concurrency.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for lv in levels:
        samples = np.sort(np.asarray(lv["_itl_samples"]) * 1000)
        if samples.size:
            ax.plot(samples, np.linspace(0, 1, samples.size), label=f"C={lv['concurrency']}")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of tokens")
    ax.legend()
    ax.set_title("inter-token latency distribution")
    fig.tight_layout()
    fig.savefig(folder / "itl_cdf.png", dpi=120)
    print(f"plots in {folder}", flush=True)


def parse_startup_phases(log: str) -> dict[str, float]:
    """{phase: seconds} from the worker's `startup: PHASE S s` log lines (docs/operations.md), in order."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"startup: ([^:\n]+?) (\d+\.\d) s", log)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared if needed)")
    ap.add_argument("--address", help="use a running worker instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2,
                    help="waves of C requests per level (with --closed-loop: requests per stream)")
    ap.add_argument("--closed-loop", action="store_true",
                    help="C streams each running --rounds requests back to back, instead of waves of C")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_serving.json"))
    ap.add_argument("--hf-baseline", action="store_true",
                    help="also time transformers generate at the same lengths (batch 1 and the largest C)")
    ap.add_argument("--plot", help="folder for PNG plots (needs matplotlib)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="client processes sharing each wave's streams (a single Python client tops out at "
                         "several thousand streamed messages per second)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the worker may take to be healthy")
    ap.add_argument("--subscribe", action="store_true",
                    help="hold a SubscribeKvEvents stream open during the run, as the smg gateway does "
                         "(its batches and load records are counted in the result)")
    ap.add_argument("--no-stream", action="store_true",
                    help="non-streaming Generate calls (one GenerateComplete each, as the gateway sends for "
                         "stream=false): no inter-token latency, TTFT is the whole request's")
    ap.add_argument("--engine-steps", action="store_true",
                    help="start the worker with --enable-metrics and report the engine's steps per level (how "
                         "many per second, tokens per step); the metrics cost the server some CPU")
    ap.add_argument("worker_args", nargs="*", help="extra worker flags (after --)")
    args = ap.parse_args()

    worker = metrics_port = None
    startup_s = worker_ready_s = None
    startup_phases: dict[str, float] = {}
    if args.address:
        address = args.address
    else:
        from worker_harness import Worker, free_port, smollm2_dir

        model = args.model or str(smollm2_dir())
        print(f"starting worker for {model}", flush=True)
        t_launch = time.perf_counter()
        metrics_port = free_port() if args.engine_steps else None
        worker = Worker(model, "--max-model-len", str(max(2048, args.prompt_len + args.output_len + 8)),
                        *(["--enable-metrics", "--metrics-port", str(metrics_port)] if metrics_port else []),
                        *args.worker_args,
                        startup_timeout=args.startup_timeout)
        startup_s = time.perf_counter() - t_launch  # launch to grpc.health.v1 SERVING
        log = worker.log()
        ready = re.search(r"ready ([0-9.]+) s after launch", log)  # the worker's own figure, from its creation
        worker_ready_s = float(ready.group(1)) if ready else None
        print(f"worker healthy {startup_s:.1f} s after launch (its own line: ready {worker_ready_s} s)", flush=True)
        startup_phases = parse_startup_phases(log)
        print("startup phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in startup_phases.items()), flush=True)
        address = worker.address
    channel = grpc.insecure_channel(address)
    stub = __import__("tokenspeed_worker.proto.tokenspeed_scheduler_pb2_grpc", fromlist=["x"]).TokenSpeedSchedulerStub(
        channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    server = stub.GetServerInfo(pb.GetServerInfoRequest())
    subscription = KvSubscription(stub) if args.subscribe else None
    engine_pid = int(server.scheduler_info["engine_pid"]) if worker and "engine_pid" in server.scheduler_info else None
    pool = None
    if args.client_procs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn"))
        pool.procs = args.client_procs
    try:
        # Warm once so the first level does not pay one-time costs (and the client processes start).
        run_level(stub, 1, args.prompt_len, 4, 1, info.vocab_size, 0)
        # A GPU start captures some decode graphs after it serves: time the steady state, not those captures.
        graphs_wait_s = worker.wait_graphs_captured() if worker else None
        if graphs_wait_s is not None:
            print(f"decode graphs left for after startup captured {graphs_wait_s:.1f} s after the first request",
                  flush=True)
        if pool is not None:
            run_level(stub, args.client_procs, args.prompt_len, 4, 1, info.vocab_size, 0, address, pool)
        levels = [run_level(stub, c, args.prompt_len, args.output_len, args.rounds, info.vocab_size, 1, address, pool,
                            args.closed_loop, worker.proc.pid if worker else None, not args.no_stream,
                            engine_pid, metrics_port)
                  for c in args.concurrency]
    finally:
        if subscription is not None:
            subscription.close()
        if pool is not None:
            pool.shutdown()
        channel.close()
        if worker:
            worker.stop()
    # The weight bytes a batch-1 step reads (not an untied embedding table, only the chosen
    # experts); an older worker reports only all of its weights.
    scheduler_info = server.scheduler_info
    weight_bytes = float(scheduler_info["decode_read_bytes"] if "decode_read_bytes" in scheduler_info
                         else scheduler_info["weight_bytes"])
    device = server.scheduler_info["device"]
    from roofline import copy_bandwidth

    bandwidth = copy_bandwidth("cuda" if device.startswith("cuda") else "cpu")
    roofline_tok_s = bandwidth / weight_bytes  # batch-1 decode reads those bytes once per token
    for lv in levels:
        if lv["concurrency"] == 1 and lv["itl_ms_median"]:
            lv["batch1_decode_tok_s"] = 1000.0 / lv["itl_ms_median"]
            lv["fraction_of_bandwidth_roofline"] = lv["batch1_decode_tok_s"] / roofline_tok_s
    if args.hf_baseline:
        model_path = info.model_path
        for lv in levels:
            print(f"  transformers generate at batch {lv['concurrency']}...", flush=True)
            lv["transformers_output_tok_s"] = hf_baseline(model_path, args.prompt_len, args.output_len,
                                                          lv["concurrency"])
            lv["ratio_to_transformers"] = lv["output_tok_s"] / lv["transformers_output_tok_s"]
    result = {
        "measured_copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weight_bytes,
        "batch1_roofline_tok_s": roofline_tok_s,
        "model": info.served_model_name, "device": server.scheduler_info["device"],
        "dtype": server.scheduler_info["dtype"], "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d"), "client_procs": args.client_procs, "startup_s": startup_s,
        "worker_ready_s": worker_ready_s, "graphs_after_startup_wait_s": graphs_wait_s,
        "startup_phases": startup_phases,
        "kv_events_subscription": subscription.summary() if subscription is not None else None,
        "levels": levels,
    }
    if args.plot:
        plot(levels, Path(args.plot))
    for lv in levels:
        lv.pop("_itl_samples", None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for lv in levels:
        extra = ""
        if "fraction_of_bandwidth_roofline" in lv:
            extra += f", {100 * lv['fraction_of_bandwidth_roofline']:.0f}% of the bandwidth roofline"
        if "ratio_to_transformers" in lv:
            extra += f", {lv['ratio_to_transformers']:.2f}x transformers"
        if "server_cpu_s" in lv:
            extra += (f"; server process CPU {100 * lv['server_cpu_fraction_of_wall']:.0f}% of the wall, "
                      f"{lv['server_cpu_us_per_output_token']:.0f} us per token")
        if "engine_cpu_fraction_of_wall" in lv:
            extra += f"; engine process CPU {100 * lv['engine_cpu_fraction_of_wall']:.0f}%"
        if lv.get("engine_tokens_per_step"):
            extra += (f"; engine {lv['engine_steps_per_s']:.0f} steps/s, {lv['engine_tokens_per_step']:.1f} tokens "
                      f"per step, {lv['engine_step_ms_mean']:.2f} ms launch to output")
        print(f"C={lv['concurrency']:>3}: {lv['output_tok_s']:8.1f} output tok/s, "
              f"{lv['per_stream_tok_s']:6.1f} tok/s per stream, TTFT {lv['ttft_ms_median']:.0f} ms, "
              + (f"ITL median {lv['itl_ms_median']:.1f} ms p99 {lv['itl_ms_p99']:.1f} ms" if lv["itl_ms_median"] is not None
                 else "not streamed") + extra)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
