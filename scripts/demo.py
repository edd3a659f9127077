"""The main job, end to end on this machine: tokenspeed-worker serving SmolLM2-135M-Instruct
on CPU, the real smg gateway in front, one chat request, the answer printed.

    python scripts/demo.py [--question TEXT] [--keep-running]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with code {proc.returncode}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    sys.exit(f"{what} did not come up within {timeout:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--keep-running", action="store_true", help="leave worker and gateway up until Ctrl-C")
    args = ap.parse_args()

    from prepare_smollm2 import prepare

    model = prepare()
    print(f"model folder: {model}", flush=True)
    grpc_port, http_port = free_port(), free_port()
    worker = subprocess.Popen([sys.executable, "-m", "tokenspeed_worker", str(model), "--host", "127.0.0.1",
                               "--grpc-port", str(grpc_port), "--served-model-name", "SmolLM2-135M-Instruct",
                               "--max-model-len", "2048"])
    procs = [worker]
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        health = health_pb2_grpc.HealthStub(channel)

        def worker_ready() -> bool:
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1
            except grpc.RpcError:
                return False

        wait_for(worker_ready, "tokenspeed-worker", 300, worker)
        print(f"tokenspeed-worker serving on 127.0.0.1:{grpc_port}", flush=True)
        smg = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
        gateway = subprocess.Popen(
            [smg, "launch", "--host", "127.0.0.1", "--port", str(http_port), "--worker-urls",
             f"grpc://127.0.0.1:{grpc_port}", "--model-path", str(model), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--worker-startup-timeout-secs", "60",
             "--worker-startup-check-interval", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"))
        procs.append(gateway)
        base = f"http://127.0.0.1:{http_port}"
        wait_for(lambda: urllib.request.urlopen(base + "/readiness", timeout=2).status == 200, "smg gateway", 90,
                 gateway)
        print(f"smg gateway on {base}", flush=True)
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": args.question}],
                "max_tokens": args.max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        elapsed = time.perf_counter() - t0
        print(f"\nQ: {args.question}\nA: {answer['choices'][0]['message']['content']}")
        print(f"({answer['usage']['completion_tokens']} tokens in {elapsed:.2f}s, "
              f"finish_reason={answer['choices'][0]['finish_reason']})", flush=True)
        if args.keep_running:
            print("worker and gateway running; Ctrl-C to stop")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM) if p is not worker else p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
