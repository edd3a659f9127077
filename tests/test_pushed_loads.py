"""The load the worker pushes on SubscribeKvEvents, as the real smg gateway (1.13) uses it: two
workers behind the gateway's default cache_aware policy; the gateway skips its GetLoads poll for
both (fresh pushed loads), and when one worker's engine stalls (fault injection: a 10 s stall
while requests are in flight) it stops routing new requests to it within a few seconds, from the
pushed `engine_silence_ms`, and routes to it again once its engine produces output."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import Gateway, Worker, tiny_models

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STALL_S = 10.0
FLAGS = ["--max-model-len", "512", "--max-total-tokens", "8192", "--served-model-name", "tiny",
         "--enable-log-requests"]


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_gateway_skips_polls_and_routes_around_a_stalled_engine():
    model = tiny_models()["llama-gqa-tied"]
    healthy = Worker(model, *FLAGS)
    stalling = Worker(model, *FLAGS, env={"TOKENSPEED_FAULT_INJECT": f"hang@30:{STALL_S:g}"})
    gateway = None
    try:
        gateway = Gateway(model, [healthy.address, stalling.address])
        time.sleep(2)  # registration, then the subscriptions
        t0 = time.monotonic()

        # Four long streams straight to the stalling worker: its engine stalls at step 30 with them
        # in flight. The gap in their chunks is the stall, as a client saw it.
        arrivals: list[list[float]] = [[] for _ in range(4)]

        def direct(i: int) -> None:
            req = pb.GenerateRequest(request_id=f"direct-{i}", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8] * 5),
                                     sampling_params=pb.SamplingParams(max_new_tokens=80, temperature=0.0,
                                                                       ignore_eos=True, n=1), stream=True)
            for _ in stalling.stub.Generate(req, timeout=120):
                arrivals[i].append(time.monotonic())

        # Meanwhile a client sends a short completion through the gateway every 0.3 s.
        sent: list[tuple[float, str | None, int]] = []  # (send time, response id, HTTP status)
        stop = threading.Event()

        def one(k: int) -> None:
            t = time.monotonic()
            body = {"model": "tiny", "prompt": f"request {k}", "max_tokens": 4, "temperature": 0}
            req = urllib.request.Request(gateway.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    sent.append((t, json.loads(r.read())["id"], r.status))
            except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                sent.append((t, None, getattr(e, "code", -1)))

        def client() -> None:
            threads = []
            for k in range(200):
                if stop.is_set():
                    break
                th = threading.Thread(target=one, args=(k,))
                th.start()
                threads.append(th)
                time.sleep(0.3)
            for th in threads:
                th.join(90)

        streams = [threading.Thread(target=direct, args=(i,)) for i in range(4)]
        for th in streams:
            th.start()
        traffic = threading.Thread(target=client)
        traffic.start()
        for th in streams:
            th.join(120)
        time.sleep(8)  # traffic after the recovery
        stop.set()
        traffic.join(120)

        times = sorted(t for a in arrivals for t in a)
        gap, stall_start = max((b - a, a) for a, b in zip(times, times[1:]))
        stall_end = stall_start + gap
        assert gap > STALL_S - 1, f"no stall seen in the direct streams (largest gap {gap:.1f}s)"

        assert sent and all(status == 200 for _, _, status in sent), sent
        logs = {"healthy": healthy.log_path.read_text(), "stalling": stalling.log_path.read_text()}

        def served_by(rid: str) -> str:
            where = [name for name, log in logs.items() if f"Req: {rid} " in log]
            assert len(where) == 1, (rid, where)
            return where[0]

        during = [served_by(rid) for t, rid, _ in sent if stall_start + 5 <= t <= stall_end - 0.5]
        after = [served_by(rid) for t, rid, _ in sent if t >= stall_end + 3]
        print(f"stall {stall_start - t0:.1f}..{stall_end - t0:.1f}s; sent during it (after 5 s): {during}; "
              f"after the recovery: {after}")
        assert len(during) >= 10 and set(during) == {"healthy"}, during
        assert "stalling" in after, after

        metrics = gateway.metrics()
        for w in (healthy, stalling):
            url = f"grpc://{w.address}"
            assert _metric(metrics, "smg_engine_load_polls_total", worker=url, mode="skipped_fresh_push") >= 1, metrics
            assert _metric(metrics, "smg_kv_event_batches_total", worker=url, disposition="load_only") >= 5
        assert _metric(metrics, "smg_worker_stall_transitions_total", worker=f"grpc://{stalling.address}") >= 1
        assert _metric(metrics, "smg_worker_stall_transitions_total", worker=f"grpc://{healthy.address}") == 0
        log = gateway.log_path.read_text()
        assert re.search(r"Worker vetoed by liveness.*engine reports no output", log), log[-4000:]
        assert "Worker re-admitted by liveness" in log
    finally:
        if gateway is not None:
            gateway.stop()
        assert healthy.stop() == 0, healthy.log()
        assert stalling.stop() == 0, stalling.log()
