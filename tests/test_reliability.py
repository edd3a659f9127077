"""Never lose, hang or leak a request: drain on SIGTERM, engine death, watchdog, an out-of-memory
step, overload, and API-key auth — each against a real worker process, each bounded in time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenspeed_worker.proto import common_pb2, tokenspeed_scheduler_pb2 as pb
from worker_harness import Worker, tiny_models

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models()["llama-gqa-tied"]


@pytest.fixture(scope="module")
def long_model_dir(model_dir, tmp_path_factory):
    """The tiny model with a 64k context: a request to its limit outlasts a drain timeout of seconds
    on any machine (a GPU decodes the tiny model's 4k context in about that)."""
    folder = tmp_path_factory.mktemp("long") / "llama-gqa-tied-64k"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    return folder


def gen(max_new_tokens=None, stream=True, rid=None):
    sp = pb.SamplingParams(temperature=0.0, ignore_eos=True, n=1)
    if max_new_tokens is not None:
        sp.max_new_tokens = max_new_tokens
    return pb.GenerateRequest(request_id=rid or f"r-{time.monotonic_ns()}",
                              tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=sp, stream=stream)


class Collector(threading.Thread):
    """Runs one Generate call to its end, recording every message and the final status."""

    def __init__(self, stub, request, metadata=None, timeout: float = 60):
        super().__init__(daemon=True)
        self.stub, self.request, self.metadata, self.timeout = stub, request, metadata, timeout
        self.messages: list = []
        self.code = None
        self.details = ""
        self.first = threading.Event()
        self.start()

    def run(self):
        try:
            for r in self.stub.Generate(self.request, timeout=self.timeout, metadata=self.metadata):
                self.messages.append(r)
                self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()
        self.first.set()

    @property
    def completes(self):
        return [m.complete for m in self.messages if m.HasField("complete")]


def wait_exit(worker: Worker, timeout: float) -> int:
    worker.proc.wait(timeout)
    return worker.proc.returncode


def test_sigterm_drains_in_flight_requests_then_aborts_the_rest(long_model_dir):
    w = Worker(long_model_dir, "--max-model-len", "65536", "--max-total-tokens", "131072", "--drain-timeout", "3")
    health = health_pb2_grpc.HealthStub(w.channel)
    short = [Collector(w.stub, gen(max_new_tokens=30)) for _ in range(2)]
    long = [Collector(w.stub, gen()) for _ in range(2)]  # to the context limit: cannot finish in 3 s
    for c in short + long:
        assert c.first.wait(30)
    w.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    # Not serving at once, on both surfaces.
    deadline = time.monotonic() + 1.0
    while True:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        assert time.monotonic() < deadline, "health still SERVING 1 s after SIGTERM"
        time.sleep(0.02)
    assert not w.stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy
    with pytest.raises(grpc.RpcError) as e:
        list(w.stub.Generate(gen(max_new_tokens=4), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    for c in short + long:
        c.join(20)
        assert not c.is_alive()
    for c in short:  # finished within the drain
        assert c.code == grpc.StatusCode.OK and [x.finish_reason for x in c.completes] == ["length"]
    for c in long:  # cut at the drain timeout, with exactly one terminal message
        assert c.code == grpc.StatusCode.OK and [x.finish_reason for x in c.completes] == ["abort"]
        assert c.messages[-1].HasField("complete")
    assert wait_exit(w, 20) == 0
    assert time.monotonic() - t0 < 15
    w.stop()


def test_engine_killed_during_load_fails_every_request_and_exits_non_zero(model_dir):
    w = Worker(model_dir, "--max-model-len", "4096", "--max-total-tokens", "16384")
    engine_pid = int(w.stub.GetServerInfo(pb.GetServerInfoRequest()).scheduler_info["engine_pid"])
    calls = [Collector(w.stub, gen(stream=bool(i % 2))) for i in range(4)]
    time.sleep(0.5)
    os.kill(engine_pid, signal.SIGKILL)
    for c in calls:
        c.join(20)
        assert c.code == grpc.StatusCode.INTERNAL and "engine" in c.details
    assert wait_exit(w, 20) == 1
    w.stop()


def test_watchdog_fails_requests_when_the_engine_stops_making_progress(model_dir):
    w = Worker(model_dir, "--max-model-len", "512", "--max-total-tokens", "4096", "--watchdog-timeout", "2",
               env={"TOKENSPEED_FAULT_INJECT": "hang@20"})
    c = Collector(w.stub, gen(max_new_tokens=100))
    c.join(30)
    assert c.code == grpc.StatusCode.INTERNAL and "progress" in c.details
    assert wait_exit(w, 20) == 1
    w.stop()


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["sync", "overlap"])
def test_out_of_memory_in_a_step_fails_only_that_step(model_dir, overlap):
    # The warm-up generation is steps 1-2; step 4 is the second step of the first real request
    # (with overlap, launched while step 3 is still to complete).
    w = Worker(model_dir, "--max-model-len", "512", "--max-total-tokens", "4096",
               env={"TOKENSPEED_FAULT_INJECT": "oom@4", "TOKENSPEED_OVERLAP_SCHEDULE": overlap})
    try:
        first = Collector(w.stub, gen(max_new_tokens=20))
        first.join(30)
        assert first.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in first.details
        after = Collector(w.stub, gen(max_new_tokens=5, stream=False))
        after.join(30)
        assert after.code == grpc.StatusCode.OK and after.completes[0].completion_tokens == 5
        assert w.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
        load = w.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        assert load.num_used_tokens == 0 and load.num_running_reqs == 0
    finally:
        assert w.stop() == 0


def test_queue_bound_gives_resource_exhausted(model_dir):
    w = Worker(model_dir, "--max-model-len", "4096", "--max-total-tokens", "16384", "--max-num-seqs", "1",
               "--max-queued-requests", "2")
    try:
        running = Collector(w.stub, gen())  # occupies the only running slot
        assert running.first.wait(30)
        queued = [Collector(w.stub, gen(max_new_tokens=2)) for _ in range(2)]
        deadline = time.monotonic() + 5
        while w.stub.GetLoads(pb.GetLoadsRequest()).loads[0].num_waiting_reqs < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:
            list(w.stub.Generate(gen(max_new_tokens=2), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-queued-requests" in e.value.details()
        assert "2 samples waiting, 1 more asked" in e.value.details()
        # More samples than the bound can ever hold: refused as the request's own fault, naming n.
        with pytest.raises(grpc.RpcError) as e:
            wide = gen(max_new_tokens=2)
            wide.sampling_params.n = 3
            list(w.stub.Generate(wide, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.n: 3" in e.value.details()
        load = w.stub.GetLoads(pb.GetLoadsRequest(include=["queues"])).loads[0]
        assert load.num_waiting_reqs == 2 and load.queues.waiting == 2 and load.num_running_reqs == 1
        w.stub.Abort(pb.AbortRequest(request_id=running.request.request_id))
        for c in queued + [running]:
            c.join(30)
            assert c.code == grpc.StatusCode.OK
    finally:
        assert w.stop() == 0


def test_api_key_guards_every_rpc_but_health(model_dir):
    w = Worker(model_dir, "--max-model-len", "128", "--max-total-tokens", "1024", "--api-key", "s3cret")
    good = (("authorization", "Bearer s3cret"),)
    bad = (("authorization", "Bearer nope"),)
    try:
        # Health stays open.
        assert w.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
        health = health_pb2_grpc.HealthStub(w.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        calls = [
            lambda md: w.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=5),
            lambda md: w.stub.GetLoads(pb.GetLoadsRequest(), metadata=md, timeout=5),
            lambda md: w.stub.FlushCache(common_pb2.FlushCacheRequest(), metadata=md, timeout=5),
            lambda md: w.stub.Abort(pb.AbortRequest(request_id="x"), metadata=md, timeout=5),
            lambda md: list(w.stub.Generate(gen(max_new_tokens=2), metadata=md, timeout=10)),
            lambda md: list(w.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=md, timeout=10)),
        ]
        # The scheme in any case (RFC 7235); the key exactly, after one space.
        lower = (("authorization", "bearer s3cret"),)
        wrong = [bad, (("authorization", "Basic s3cret"),), (("authorization", "Bearer S3CRET"),),
                 (("authorization", "s3cret"),), (("authorization", "Bearers3cret"),)]
        for call in calls:
            for md in (None, *wrong):
                with pytest.raises(grpc.RpcError) as e:
                    call(md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in e.value.details()
            call(good)  # the right key works
            call(lower)
    finally:
        assert w.stop() == 0


def test_an_empty_api_key_serves_without_a_key_and_says_so(model_dir):
    # `--api-key "$KEY"` with KEY unset: open, as with no flag, but a warning says so.
    w = Worker(model_dir, "--max-model-len", "128", "--max-total-tokens", "1024", "--api-key", "")
    try:
        assert "--api-key is empty: every client is served without a key" in w.log()
        assert w.stub.GetLoads(pb.GetLoadsRequest(), timeout=5) is not None
    finally:
        assert w.stop() == 0


def test_a_pool_smaller_than_the_context_bounds_requests_instead_of_refusing_them(model_dir):
    """--max-total-tokens below --max-model-len: the worker reports the pool as its context length
    (GetModelInfo, as the gateway reads it), clamps max_new_tokens (unset or too large) to it, and
    refuses only a prompt that alone fills it, naming the field. Before, every request without
    max_new_tokens was refused with an engine message naming no field."""
    w = Worker(model_dir, "--max-model-len", "512", "--max-total-tokens", "128", "--block-size", "16")
    try:
        info = w.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.max_context_length == 128 and info.max_req_input_len == 127
        assert "fewer than the context length 512" in w.log()
        for max_new in (None, 1000, 1):
            req = gen(max_new_tokens=max_new, stream=False)
            (done,) = [r.complete for r in w.stub.Generate(req, timeout=60)]
            want = 1 if max_new == 1 else 128 - len(PROMPT)
            assert done.finish_reason == "length" and done.completion_tokens == want
        # a prompt of exactly one token less than the pool: one token out
        long = pb.GenerateRequest(request_id="long", tokenized=pb.TokenizedInput(input_ids=[7] * 127),
                                  sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True, n=1))
        (done,) = [r.complete for r in w.stub.Generate(long, timeout=60)]
        assert done.completion_tokens == 1
        too_long = pb.GenerateRequest(request_id="too-long", tokenized=pb.TokenizedInput(input_ids=[7] * 128))
        with pytest.raises(grpc.RpcError) as e:
            list(w.stub.Generate(too_long, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenized.input_ids" in e.value.details()
        assert w.stub.GetLoads(pb.GetLoadsRequest()).loads[0].num_used_tokens == 0
    finally:
        assert w.stop() == 0
