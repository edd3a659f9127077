"""Every RPC of the worker, over real gRPC, against a real worker process on a tiny model."""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenspeed_worker.proto import common_pb2, tokenspeed_scheduler_pb2 as pb
from worker_harness import Worker, free_port, hf_greedy, tiny_models, wait_idle

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models()["llama-gqa-tied"]


@pytest.fixture(scope="module")
def worker(model_dir):
    w = Worker(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--max-total-tokens", "2048",
               "--block-size", "8", "--chunked-prefill-size", "64", "--served-model-name", "tiny-llama",
               "--enable-cache-report")
    yield w
    assert w.stop() == 0, w.log()


@pytest.fixture(scope="module")
def long_worker(model_dir):
    """A worker whose requests can run long enough to be cancelled mid-flight."""
    w = Worker(model_dir, "--max-model-len", "4096", "--max-total-tokens", "16384")
    yield w
    assert w.stop() == 0, w.log()


def gen(prompt, *, max_new_tokens=8, stream=False, rid=None, **sampling):
    sampling.setdefault("n", 1)
    sp = pb.SamplingParams(**sampling)
    if max_new_tokens is not None:
        sp.max_new_tokens = max_new_tokens
    return pb.GenerateRequest(
        request_id=rid or f"test-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=sp,
        stream=stream,
    )


def run(worker, request, timeout=60):
    return list(worker.stub.Generate(request, timeout=timeout))




PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


# ---- health, facts -------------------------------------------------------------


def test_both_health_surfaces_serve(worker):
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", "tokenspeed.grpc.scheduler.TokenSpeedScheduler"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    t0 = time.monotonic()
    r = worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert r.healthy, r.message
    assert time.monotonic() - t0 < 2.0


def test_health_watch_streams_the_status(worker):
    """grpc.health.v1 Watch (client-side health checking, load balancers): the status now, then
    each change; a plain coroutine writing with context.write, which the decode guard must await,
    not iterate (it answered UNKNOWN "'async for' requires an object with __aiter__")."""
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", "tokenspeed.grpc.scheduler.TokenSpeedScheduler"):
        call = health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        call.cancel()
    unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    unknown.cancel()


def test_a_port_in_use_is_a_clear_error_and_the_harness_starts_elsewhere(model_dir, monkeypatch):
    """A worker whose port is taken exits with "cannot listen on ADDRESS" (no traceback); the test
    harness then starts it on another port (free_port's pick can be taken by a parallel run)."""
    import socket

    import worker_harness

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        real_free_port = worker_harness.free_port
        monkeypatch.setattr(worker_harness, "free_port", lambda: next(picks, None) or real_free_port())
        w = Worker(model_dir, "--max-model-len", str(MAX_MODEL_LEN))
        try:
            assert w.port != taken
            first_log = (worker_harness.CACHE / "logs" / f"worker-{taken}.log").read_text()
            assert f"cannot listen on 127.0.0.1:{taken}" in first_log and "Traceback" not in first_log
            assert run(w, gen(PROMPT, max_new_tokens=2))[-1].HasField("complete")
        finally:
            assert w.stop() == 0, w.log()


def test_a_generate_handler_wakes_only_as_its_request_needs():
    """EngineClient wakes a request's handler per its wake_every (the servicer: 1 with stop strings,
    the stream interval when streaming, 0 otherwise): every step, at the first token and then every k
    tokens, or only at the end; an abort always wakes it."""
    import asyncio
    import types

    import numpy as np

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.messages import AddRequest, StepOutput
    from tokenspeed_worker.sampling.params import SamplingParams
    from tokenspeed_worker.server.engine_client import EngineClient

    async def main():
        client = EngineClient(EngineConfig.build("unused"))
        sent = []  # no engine process: what would go down its pipe
        client._replicas[0].sender = types.SimpleNamespace(send=sent.append)
        add = lambda: AddRequest(0, np.zeros(4, dtype=np.int32), 8, SamplingParams(temperature=0.0))  # noqa: E731
        (every,) = client.submit("every", [add()])
        (third,) = client.submit("third", [add()], wake_every=3)
        (end,) = client.submit("end", [add()], wake_every=0)
        (aborted,) = client.submit("aborted", [add()], wake_every=0)
        ids = np.array([st.engine_id for st in (every, third, end, aborted)])
        none = np.zeros(0, dtype=np.int64)
        woken = []
        for step in range(5):
            finished = np.array([end.engine_id]) if step == 4 else none
            client._on_message(StepOutput(req_ids=ids, tokens=np.full(4, step), finished_ids=finished,
                                          finish_reasons=np.ones(len(finished), dtype=np.int32)))
            woken.append([st.event.is_set() for st in (every, third, end, aborted)])
            for st in (every, third, end, aborted):
                if st.event.is_set():  # the handler takes what came, as SampleStream.take_new does
                    st.event.clear()
                    st.new_tokens = []
        assert [w[0] for w in woken] == [True] * 5
        assert [w[1] for w in woken] == [True, False, False, True, False]  # the first token, then 3 at a time
        assert [w[2] for w in woken] == [False, False, False, False, True]  # only its end
        assert [w[3] for w in woken] == [False] * 5 and len(aborted.new_tokens) == 5
        client.abort([aborted])
        assert aborted.event.is_set()

    asyncio.run(main())


def test_the_harness_bounds_a_tests_kv_pool_on_a_gpu_unless_the_test_or_a_bench_sizes_it(monkeypatch):
    """On a GPU the GPU suite's dozen test processes share one card: a test's worker that names no pool
    size gets a fixed one; a test that sizes it, a benchmark (no pytest) and a CPU keep their flags."""
    import torch
    import worker_harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert worker_harness._bounded_pool(("--max-model-len", "64")) == (
        "--max-model-len", "64", "--max-total-tokens", worker_harness.GPU_POOL_TOKENS)
    for sized in (("--max-total-tokens", "512"), ("--max-total-tokens=512",), ("--gpu-memory-utilization", "0.5")):
        assert worker_harness._bounded_pool(sized) == sized
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert worker_harness._bounded_pool(("--max-model-len", "64")) == ("--max-model-len", "64")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_harness._bounded_pool(("--max-model-len", "64")) == ("--max-model-len", "64")


def test_a_port_a_running_grpc_server_holds_fails_before_the_engine_starts(model_dir):
    """A second worker on a running one's port: grpc servers set SO_REUSEPORT by default, so it
    would bind the port too and take half of the first one's connections. It exits 1 with "cannot
    listen on", checked before its engine starts (no minutes of loading first)."""
    from tokenspeed_worker.server.launch import port_taken

    running = grpc.server(concurrent.futures.ThreadPoolExecutor(1))  # grpc's defaults, as another worker's
    port = running.add_insecure_port("127.0.0.1:0")
    running.start()
    try:
        assert port_taken("127.0.0.1", port)
        proc = subprocess.run([sys.executable, "-m", "tokenspeed_worker", str(model_dir), "--host", "127.0.0.1",
                               "--grpc-port", str(port)], capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out, out
        assert "engine start" not in out and "Traceback" not in out, out
    finally:
        running.stop(None)
    assert port_taken("127.0.0.1", port) is None  # free again (TIME_WAIT does not count)
    assert port_taken("127.0.0.1", 0) is None


@pytest.mark.parametrize("flags", [["--host", "999.1.1.1"], ["--enable-metrics", "--metrics-host", "999.1.1.1"]],
                         ids=["host", "metrics-host"])
def test_an_address_that_does_not_resolve_fails_before_the_engine_starts(model_dir, flags):
    """A mistyped --host (or --metrics-host) is one line naming the flag, exit 2, before the engine
    starts: not after the model has loaded, as grpc's own bind would say it."""
    from tokenspeed_worker.server.launch import unresolvable

    assert unresolvable("999.1.1.1") and unresolvable("127.0.0.1") is None and unresolvable("::") is None
    proc = subprocess.run([sys.executable, "-m", "tokenspeed_worker", str(model_dir), "--grpc-port", str(free_port()),
                           *flags], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and f"argument {flags[-2]}: cannot listen on '999.1.1.1'" in out, out
    assert "engine start" not in out and "Traceback" not in out, out
    assert "exiting with code 2" in out.strip().splitlines()[-1], out


def test_a_taken_metrics_port_fails_before_the_engine_starts(model_dir):
    """--enable-metrics on a port another process holds (or on the gRPC port itself) is one line
    naming it, before the engine starts: not after minutes of loading."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for extra, code, line in (([str(taken)], 1, f"cannot serve metrics on 127.0.0.1:{taken}"),
                                  (None, 2, "is the gRPC port")):
            grpc_port = free_port()
            metrics_port = extra or [str(grpc_port)]
            proc = subprocess.run([sys.executable, "-m", "tokenspeed_worker", str(model_dir), "--host", "127.0.0.1",
                                   "--grpc-port", str(grpc_port), "--enable-metrics", "--metrics-port", *metrics_port],
                                  capture_output=True, text=True, timeout=120)
            out = proc.stdout + proc.stderr
            assert proc.returncode == code and line in out, out
            assert "engine start" not in out and "Traceback" not in out, out


def test_the_listen_address_brackets_ipv6_hosts_once():
    from tokenspeed_worker.server.launch import listen_address

    assert listen_address("127.0.0.1", 50051) == "127.0.0.1:50051"
    assert listen_address("::", 50051) == "[::]:50051"
    assert listen_address("[::1]", 50051) == "[::1]:50051"
    assert listen_address("localhost", 1) == "localhost:1"


def test_the_log_reports_each_startup_phase_with_its_seconds(worker):
    """Operators see where startup went: each phase at info with its seconds as it ends, one line
    summing them, the warm-up generation, and the time from launch to serving."""
    import re

    log = worker.log()
    for phase in ("runtime setup", "model construction", "weight load", "memory profile and KV pool sizing", "KV cache allocation",
                  "attention timing", "CUDA graph capture", "kernel warm-up", "scheduler, sampler and grammar setup",
                  "interpreter start", "server setup", "engine process start", "engine start", "warm-up generation"):
        assert re.search(rf"startup: {re.escape(phase)} \d+\.\d s", log), (phase, log)
    assert re.search(r"startup: weight load \d+\.\d s \(\d+\.\d\d GiB of safetensors at [\d.]+ GiB/s\)", log)
    summary = re.search(r"startup phases: (.*) = (\d+\.\d) s", log)
    assert summary and "weight load" in summary.group(1)
    assert re.search(r"serving tiny-llama on 127\.0\.0\.1:\d+ \(port \d+\), ready \d+\.\d s after launch", log)


def test_the_server_process_never_imports_torch(worker):
    """torch is the engine processes' (seconds to import, more on a fresh GPU machine): the server
    process resolves the device through the CUDA driver and serves without it, so its part of
    startup stays short. Checked in its memory map after a request went through it."""
    assert run(worker, gen(PROMPT, max_new_tokens=2))[-1].HasField("complete")
    maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps


def test_the_device_count_without_torch_is_torchs():
    import torch

    from tokenspeed_worker.config import parsing

    assert parsing._torch_is_a_cuda_build() == (torch.version.cuda is not None)
    assert parsing._cuda_device_count() == torch.cuda.device_count()


def test_bytes_that_do_not_parse_get_invalid_argument_naming_the_method(worker):
    """Generate, a unary method, another streaming one and the standard health service (each guarded
    at registration, no interceptor): undecodable bytes get INVALID_ARGUMENT naming the method, never
    UNKNOWN, and the worker goes on serving."""
    ident = lambda b: b  # noqa: E731
    bad = b"\xd0\x04"  # field 26, wire type 0, with its varint cut short
    for path, streaming in (("/tokenspeed.grpc.scheduler.TokenSpeedScheduler/Generate", True),
                            ("/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetLoads", False),
                            ("/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetTokenizer", True),
                            ("/grpc.health.v1.Health/Check", False)):
        call = (worker.channel.unary_stream if streaming else worker.channel.unary_unary)(
            path, request_serializer=ident, response_deserializer=ident)
        with pytest.raises(grpc.RpcError) as e:
            list(call(bad, timeout=10)) if streaming else call(bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, e.value)
        assert e.value.details().startswith(f"{path}: the request does not parse"), e.value.details()
    assert run(worker, gen(PROMPT, max_new_tokens=2))[-1].HasField("complete")


def test_reflection_lists_the_service(worker):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(worker.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "tokenspeed.grpc.scheduler.TokenSpeedScheduler" in names
    assert "grpc.health.v1.Health" in names


def test_get_model_info_reports_real_values(worker, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    info = worker.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == "tiny-llama"
    assert info.model_path == str(model_dir.resolve())
    assert info.tokenizer_path == str(model_dir.resolve())
    assert info.max_context_length == MAX_MODEL_LEN
    assert info.vocab_size == config["vocab_size"]
    assert list(info.architectures) == config["architectures"]
    assert info.model_type == config["model_type"]
    eos = config["eos_token_id"]
    assert set([eos] if isinstance(eos, int) else eos) <= set(info.eos_token_ids)
    assert info.model_dtype == "float32"  # auto: float32 on a CPU; the tiny config says float32 too


def test_get_server_info(worker):
    info = worker.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.server_args["context_length"] == MAX_MODEL_LEN
    assert info.server_args["block_size"] == 8
    assert info.max_total_num_tokens == 2048
    assert info.tokenspeed_version
    assert info.uptime_seconds > 0
    assert info.start_time.seconds > 0
    assert info.scheduler_info["num_blocks"] == 256


def test_get_loads_sections(worker):
    r = worker.stub.GetLoads(pb.GetLoadsRequest(include=["core", "memory", "queues"]))
    assert r.dp_rank_count == 1 and len(r.loads) == 1
    load = r.loads[0]
    assert load.max_total_num_tokens == 2048
    assert load.HasField("memory") and load.memory.token_capacity == 2048 and load.memory.weight_gb > 0
    assert load.HasField("queues")
    core_only = worker.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert not core_only.HasField("memory")
    with pytest.raises(grpc.RpcError) as e:
        worker.stub.GetLoads(pb.GetLoadsRequest(include=["bogus"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "include" in e.value.details()


def test_get_tokenizer_streams_a_verified_zip(worker):
    chunks = list(worker.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names


def test_flush_cache(worker):
    r = worker.stub.FlushCache(common_pb2.FlushCacheRequest())
    assert r.success


def test_kv_events_are_served_without_kv_events_config(worker):
    """No flag needed: the stream answers at once with a load record (the gateway's subscription)."""
    call = worker.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True),
                                         timeout=30)
    try:
        first = next(call)
        assert first.load.load_only and first.sequence_number == 0 and first.load.max_total_num_tokens > 0
    finally:
        call.cancel()


def test_profile_writes_a_chrome_trace(worker, tmp_path):
    stop = worker.stub.StopProfile(common_pb2.StopProfileRequest())
    assert not stop.success and "no profile" in stop.message
    r = worker.stub.StartProfile(common_pb2.StartProfileRequest(output_dir=str(tmp_path)))
    assert r.success, r.message
    again = worker.stub.StartProfile(common_pb2.StartProfileRequest(output_dir=str(tmp_path)))
    assert not again.success and "already" in again.message
    run(worker, gen(PROMPT, max_new_tokens=4, temperature=0.0))
    r = worker.stub.StopProfile(common_pb2.StopProfileRequest())
    assert r.success, r.message
    traces = list(tmp_path.glob("tokenspeed-engine-*.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
    # num_steps: the profile ends by itself.
    steps_dir = tmp_path / "steps"
    assert worker.stub.StartProfile(common_pb2.StartProfileRequest(output_dir=str(steps_dir), num_steps=2)).success
    run(worker, gen(PROMPT, max_new_tokens=6, temperature=0.0))
    assert len(list(steps_dir.glob("*.trace.json"))) == 1
    # The first StopProfile after it names that file; a second has nothing to stop.
    r = worker.stub.StopProfile(common_pb2.StopProfileRequest())
    assert r.success and "already finished" in r.message and str(steps_dir) in r.message
    r = worker.stub.StopProfile(common_pb2.StopProfileRequest())
    assert not r.success and "no profile" in r.message
    # Profiles stopped within one second keep a file each.
    fast = tmp_path / "fast"
    for _ in range(3):
        assert worker.stub.StartProfile(common_pb2.StartProfileRequest(output_dir=str(fast))).success
        assert worker.stub.StopProfile(common_pb2.StopProfileRequest()).success
    assert len(list(fast.glob("tokenspeed-engine-*.trace.json"))) == 3
    with pytest.raises(grpc.RpcError) as e:
        worker.stub.StartProfile(common_pb2.StartProfileRequest(output_dir="relative/dir"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_dir" in e.value.details()


# ---- Generate ---------------------------------------------------------------------


def test_greedy_non_streaming_equals_transformers(worker, model_dir):
    out = run(worker, gen(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(out) == 1 and out[0].HasField("complete")
    c = out[0].complete
    assert list(c.output_ids) == hf_greedy(model_dir, PROMPT, 12)
    assert c.finish_reason == "length"
    assert c.prompt_tokens == len(PROMPT) and c.completion_tokens == 12


def test_streaming_chunks_then_one_complete(worker):
    expected = run(worker, gen(PROMPT, max_new_tokens=10, temperature=0.0, ignore_eos=True))[0].complete
    out = run(worker, gen(PROMPT, max_new_tokens=10, temperature=0.0, ignore_eos=True, stream=True))
    assert all(r.HasField("chunk") for r in out[:-1]) and out[-1].HasField("complete")
    streamed = [t for r in out[:-1] for t in r.chunk.token_ids]
    assert streamed == list(expected.output_ids)
    counts = [r.chunk.completion_tokens for r in out[:-1]]
    assert counts == sorted(counts) and counts[-1] == 10
    assert out[-1].complete.finish_reason == "length" and out[-1].complete.completion_tokens == 10


def test_stop_token_id_ends_with_stop_and_matched_token(worker):
    free = run(worker, gen(PROMPT, max_new_tokens=10, temperature=0.0, ignore_eos=True))[0].complete.output_ids
    stop = free[4]
    first = list(free).index(stop)
    c = run(worker, gen(PROMPT, max_new_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))[0].complete
    assert c.finish_reason == "stop"
    assert c.matched_token_id == stop
    assert list(c.output_ids) == list(free[:first])  # the matched stop token is trimmed
    assert c.completion_tokens == first + 1


def test_unset_max_new_tokens_runs_to_the_context_limit(worker):
    c = run(worker, gen(PROMPT, max_new_tokens=None, temperature=0.0, ignore_eos=True))[0].complete
    assert c.finish_reason == "length"
    assert c.prompt_tokens + c.completion_tokens == MAX_MODEL_LEN


def test_max_new_tokens_past_the_context_is_clamped(worker):
    c = run(worker, gen(PROMPT, max_new_tokens=100000, temperature=0.0, ignore_eos=True))[0].complete
    assert c.finish_reason == "length"
    assert c.prompt_tokens + c.completion_tokens == MAX_MODEL_LEN


def test_a_tiny_positive_temperature_is_greedy(worker):
    """temperature 1e-40 (the gateway takes any value in [0, 2]) divided the logits into inf: every
    token was id 0. Below 1e-5 it samples greedily, as vLLM and SGLang do."""
    greedy = run(worker, gen(PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True))[0].complete
    for t in (1e-40, 1e-7):
        tiny = run(worker, gen(PROMPT, max_new_tokens=6, temperature=t, ignore_eos=True, sampling_seed=3))[0].complete
        assert list(tiny.output_ids) == list(greedy.output_ids)


def test_seeded_sampling_is_reproducible(worker):
    def sample(seed):
        r = gen(PROMPT, max_new_tokens=12, temperature=1.0, top_p=0.95, top_k=50, min_p=0.01,
                ignore_eos=True, sampling_seed=seed)
        return list(run(worker, r)[0].complete.output_ids)

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c  # 12 tokens from a random model: a collision is practically impossible


def test_concurrent_requests_each_get_their_own_greedy_answer(worker, model_dir):
    prompts = [PROMPT[: 2 + i] * (1 + i % 3) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, worker, gen(p, max_new_tokens=6, temperature=0.0, ignore_eos=True,
                                                  stream=bool(i % 2))) for i, p in enumerate(prompts)]
        results = [f.result() for f in futures]
    for p, out in zip(prompts, results):
        tokens = [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids] + \
            list(out[-1].complete.output_ids)
        assert tokens == hf_greedy(model_dir, p, 6)
    wait_idle(worker)


# ---- bad input -------------------------------------------------------------------------

BAD = [
    ("missing tokenized", lambda: pb.GenerateRequest(request_id="b1"), "INVALID_ARGUMENT", "tokenized"),
    ("empty input_ids", lambda: gen([]), "INVALID_ARGUMENT", "tokenized.input_ids"),
    ("token id >= vocab", lambda: gen([1, 10**6]), "INVALID_ARGUMENT", "tokenized.input_ids"),
    ("prompt at the context limit", lambda: gen([1] * MAX_MODEL_LEN), "INVALID_ARGUMENT", "tokenized.input_ids"),
    ("negative temperature", lambda: gen(PROMPT, temperature=-0.5), "INVALID_ARGUMENT", "temperature"),
    ("top_p zero", lambda: gen(PROMPT, top_p=0.0), "INVALID_ARGUMENT", "top_p"),
    ("top_p above one", lambda: gen(PROMPT, top_p=1.5), "INVALID_ARGUMENT", "top_p"),
    ("top_k below -1", lambda: gen(PROMPT, top_k=-2), "INVALID_ARGUMENT", "top_k"),
    ("min_p above one", lambda: gen(PROMPT, min_p=1.5), "INVALID_ARGUMENT", "min_p"),
    ("stop token out of vocab", lambda: gen(PROMPT, stop_token_ids=[10**6]), "INVALID_ARGUMENT", "stop_token_ids"),
    ("n too large", lambda: gen(PROMPT, n=1000), "INVALID_ARGUMENT", "sampling_params.n"),
    ("too many stop strings", lambda: gen(PROMPT, stop=["a"] * 257), "INVALID_ARGUMENT", "sampling_params.stop"),
    ("stop strings too long", lambda: gen(PROMPT, stop=["a" * 16385]), "INVALID_ARGUMENT", "sampling_params.stop"),
    # Without xgrammar (a plain install) structured output is off: every constraint is UNIMPLEMENTED.
    ("json schema", lambda: gen(PROMPT, json_schema="{not json"),
     "INVALID_ARGUMENT" if importlib.util.find_spec("xgrammar") else "UNIMPLEMENTED", "json_schema"),
    ("prompt logprobs", lambda: pb.GenerateRequest(request_id="b2", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                     logprob_start_len=0), "UNIMPLEMENTED", "logprob_start_len"),
    ("prompt logprobs below -1", lambda: pb.GenerateRequest(request_id="b5", tokenized=pb.TokenizedInput(
        input_ids=PROMPT), logprob_start_len=-2), "INVALID_ARGUMENT", "logprob_start_len"),
    ("multimodal", lambda: pb.GenerateRequest(request_id="b3", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                mm_inputs=pb.MultimodalInputs()), "UNIMPLEMENTED", "mm_inputs"),
    ("pd disaggregation", lambda: pb.GenerateRequest(
        request_id="b4", tokenized=pb.TokenizedInput(input_ids=PROMPT),
        kv_bootstrap_info=pb.KvBootstrapInfo(bootstrap_host="h")), "UNIMPLEMENTED", "kv_bootstrap_info"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_a_status_naming_the_field(worker, case):
    _, make, code, field_name = case
    request = make()
    if not request.request_id:
        request.request_id = f"bad-{time.monotonic_ns()}"
    with pytest.raises(grpc.RpcError) as e:
        run(worker, request)
    assert e.value.code() == getattr(grpc.StatusCode, code)
    assert field_name in e.value.details()
    assert worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy


# ---- proto3 defaults: an unset plain scalar arrives as its zero ----------------------------


def test_raw_client_setting_only_input_ids_and_max_new_tokens(worker):
    """As a stranger's client builds it: no request_id, no n (proto3's 0), nothing else."""
    for stream in (False, True):
        request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                     sampling_params=pb.SamplingParams(max_new_tokens=5), stream=stream)
        out = run(worker, request)
        completes = [r.complete for r in out if r.HasField("complete")]
        assert len(completes) == 1 and completes[0].index == 0
        assert out[-1].request_id.startswith("gen-") and len({r.request_id for r in out}) == 1
        tokens = [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids] + list(completes[0].output_ids)
        # Sampled at temperature 1: EOS may come; a matched stop token is counted but trimmed from the ids.
        trimmed = 1 if completes[0].finish_reason == "stop" and completes[0].HasField("matched_token_id") else 0
        assert 1 <= len(tokens) + trimmed <= 5 and completes[0].completion_tokens == len(tokens) + trimmed
        assert completes[0].finish_reason in ("length", "stop")
    # No sampling_params at all: every field its default (up to the context limit, one sample).
    out = run(worker, pb.GenerateRequest(request_id=f"bare-{time.monotonic_ns()}",
                                         tokenized=pb.TokenizedInput(input_ids=PROMPT)))
    assert len(out) == 1 and out[0].complete.finish_reason in ("length", "stop")
    wait_idle(worker)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_max_new_tokens_zero_gives_the_prompt_back_at_once(worker, stream, n):
    """/v1/completions echo with max_tokens 0 (scoring clients): one GenerateComplete per sample,
    finish_reason length, no output, nothing held."""
    request = gen(PROMPT, max_new_tokens=0, stream=stream, n=n)
    out = run(worker, request, timeout=10)
    assert [r.WhichOneof("response") for r in out] == ["complete"] * max(n, 1)
    assert sorted(r.complete.index for r in out) == list(range(max(n, 1)))
    for r in out:
        c = r.complete
        assert r.request_id == request.request_id
        assert (c.finish_reason, c.prompt_tokens, c.completion_tokens, list(c.output_ids)) == \
            ("length", len(PROMPT), 0, [])
    wait_idle(worker)


def test_top_k_zero_is_off(worker):
    def answer(top_k):
        out = run(worker, gen(PROMPT, max_new_tokens=6, ignore_eos=True, top_k=top_k, sampling_seed=11))
        return list(out[-1].complete.output_ids)

    assert answer(0) == answer(-1)


def test_duplicate_in_flight_request_id_is_rejected(long_worker):
    rid = f"dup-{time.monotonic_ns()}"
    stream = long_worker.stub.Generate(gen(PROMPT, max_new_tokens=None, ignore_eos=True, stream=True, rid=rid))
    next(stream)  # in flight now
    with pytest.raises(grpc.RpcError) as e:
        run(long_worker, gen(PROMPT, rid=rid))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in e.value.details()
    assert long_worker.stub.Abort(pb.AbortRequest(request_id=rid)).success
    stream.cancel()
    wait_idle(long_worker)


# ---- cancellation frees blocks ------------------------------------------------------------


def test_abort_of_a_stream_ends_it_with_abort_and_frees_blocks(long_worker):
    rid = f"abort-{time.monotonic_ns()}"
    stream = long_worker.stub.Generate(gen(PROMPT, max_new_tokens=None, ignore_eos=True, stream=True, rid=rid))
    first = next(stream)
    assert first.HasField("chunk")
    load = long_worker.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.num_used_tokens > 0
    r = long_worker.stub.Abort(pb.AbortRequest(request_id=rid, reason="Stream dropped"))
    assert r.success
    rest = list(stream)
    assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    assert sum(1 for x in rest if x.HasField("complete")) == 1
    wait_idle(long_worker)


def test_abort_of_an_unknown_request_fails(worker):
    r = worker.stub.Abort(pb.AbortRequest(request_id="never-seen"))
    assert not r.success and "not found" in r.message


def test_cancelled_non_streaming_call_frees_blocks(long_worker):
    call = long_worker.stub.Generate(gen(PROMPT, max_new_tokens=None, ignore_eos=True))
    time.sleep(0.5)
    load = long_worker.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.num_running_reqs + load.num_waiting_reqs == 1
    call.cancel()
    wait_idle(long_worker)
    assert long_worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy


# ---- n samples, prefix cache ---------------------------------------------------------------

LONG_PROMPT = [(7 * i + 3) % 500 + 3 for i in range(41)]


def test_n_greedy_samples_one_complete_per_index(worker, model_dir):
    out = run(worker, gen(LONG_PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True, n=4))
    completes = [r.complete for r in out if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2, 3]
    expected = hf_greedy(model_dir, LONG_PROMPT, 6)
    assert all(list(c.output_ids) == expected for c in completes)
    wait_idle(worker)


def test_n_streaming_samples_carry_their_index(worker):
    out = run(worker, gen(LONG_PROMPT, max_new_tokens=5, temperature=1.0, ignore_eos=True, n=3, stream=True,
                          sampling_seed=7))
    per_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for r in out:
        if r.HasField("chunk"):
            per_index[r.chunk.index].extend(r.chunk.token_ids)
    completes = [r.complete for r in out if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert all(len(t) == 5 for t in per_index.values())
    again = run(worker, gen(LONG_PROMPT, max_new_tokens=5, temperature=1.0, ignore_eos=True, n=3, stream=True,
                            sampling_seed=7))
    again_per_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for r in again:
        if r.HasField("chunk"):
            again_per_index[r.chunk.index].extend(r.chunk.token_ids)
    assert again_per_index == per_index  # seeded: reproducible per index


def test_n_non_streaming_completes_arrive_in_index_order(long_worker):
    """A unary n=2 call whose sample 1 ends long before sample 0 still gets sample 0's complete
    first: smg numbers a unary response's choices by arrival, so arrival order is index order."""
    def sampled(stop_token_ids=(), stream=True):
        return run(long_worker, gen(PROMPT, max_new_tokens=40, temperature=1.5, ignore_eos=True, n=2, stream=stream,
                                    sampling_seed=11, stop_token_ids=list(stop_token_ids)))

    tokens: dict[int, list[int]] = {0: [], 1: []}
    for r in sampled():
        if r.HasField("chunk"):
            tokens[r.chunk.index].extend(r.chunk.token_ids)
    # A token sample 1 draws within its first three and sample 0 never draws: as a stop token, it
    # ends sample 1 there while sample 0 runs its 40 (seeded sampling does not depend on the stops).
    stop = next(t for t in tokens[1][:3] if t not in tokens[0])
    out = sampled([stop], stream=False)
    completes = [r.complete for r in out if r.HasField("complete")]
    assert [c.index for c in completes] == [0, 1]
    assert [c.finish_reason for c in completes] == ["length", "stop"]
    assert list(completes[0].output_ids) == tokens[0]
    assert list(completes[1].output_ids) == tokens[1][:tokens[1].index(stop)]  # the stop token trimmed
    assert completes[1].matched_token_id == stop
    wait_idle(long_worker)


def test_abort_ends_every_sample(long_worker):
    rid = f"abort-n-{time.monotonic_ns()}"
    stream = long_worker.stub.Generate(gen(PROMPT, max_new_tokens=None, ignore_eos=True, stream=True, rid=rid, n=3))
    next(stream)
    assert long_worker.stub.Abort(pb.AbortRequest(request_id=rid)).success
    completes = [r.complete for r in stream if r.HasField("complete")]
    assert all(c.finish_reason == "abort" for c in completes)
    wait_idle(long_worker)


def test_cached_tokens_and_hit_rate_are_real_and_flush_empties_the_cache(worker):
    worker.stub.FlushCache(common_pb2.FlushCacheRequest())
    first = run(worker, gen(LONG_PROMPT, max_new_tokens=2, temperature=0.0))[0].complete
    assert first.cached_tokens == 0
    second = run(worker, gen(LONG_PROMPT, max_new_tokens=2, temperature=0.0, stream=True))
    assert second[-1].complete.cached_tokens == 40  # 5 full blocks of 8
    assert all(r.chunk.cached_tokens == 40 for r in second[:-1])
    load = worker.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.cache_hit_rate > 0
    assert worker.stub.FlushCache(common_pb2.FlushCacheRequest()).success
    third = run(worker, gen(LONG_PROMPT, max_new_tokens=2, temperature=0.0))[0].complete
    assert third.cached_tokens == 0


def test_without_cache_report_cached_tokens_go_out_as_zero(model_dir):
    # --enable-cache-report off (the default): the hit happens (GetLoads, metrics) but is not reported.
    w = Worker(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--max-total-tokens", "2048", "--block-size", "8")
    try:
        run(w, gen(LONG_PROMPT, max_new_tokens=2, temperature=0.0))
        second = run(w, gen(LONG_PROMPT, max_new_tokens=2, temperature=0.0, stream=True))
        assert second[-1].complete.cached_tokens == 0
        assert all(r.chunk.cached_tokens == 0 for r in second[:-1])
        assert w.stub.GetLoads(pb.GetLoadsRequest()).loads[0].cache_hit_rate > 0
    finally:
        assert w.stop() == 0, w.log()


def test_the_health_check_counts_a_long_step_as_work_and_a_silent_loop_as_down():
    """The engine loop answers probes between steps: a long step (an 8k-token prompt chunk on a CPU
    runs over a minute) left the probe unanswered, and the gateway took the only worker out of
    service. Inside one step short of BUSY_STEP_HEALTHY_S the worker is healthy ("busy"); a loop
    silent between steps, a step past the limit, or a dead engine is not. (The decision alone, over
    a stand-in for the engine client's two calls; the shared "in a step since" is the engine loop's.)"""
    import asyncio

    from tokenspeed_worker.server import servicer as servicer_mod
    from tokenspeed_worker.server.engine_client import EngineUnavailable

    class Engine:
        def __init__(self, replies, busy):
            self.replies, self.busy = replies, busy

        async def probe_each(self, timeout):
            return self.replies

        def busy_seconds(self, k):
            return self.busy[k]

    def check(replies, busy):
        s = servicer_mod.TokenSpeedSchedulerServicer.__new__(servicer_mod.TokenSpeedSchedulerServicer)
        s.serving, s.engine = True, Engine(replies, busy)
        return asyncio.run(s.HealthCheck(pb.HealthCheckRequest(), None))

    timeout = asyncio.TimeoutError()
    ok = check([object()], [None])
    assert ok.healthy and ok.message == "ok"
    busy = check([timeout], [42.0])
    assert busy.healthy and "busy: one step running for 42s" in busy.message
    silent = check([timeout], [None])
    assert not silent.healthy and "between steps" in silent.message
    stuck = check([timeout], [servicer_mod.BUSY_STEP_HEALTHY_S + 1])
    assert not stuck.healthy and "in one step for" in stuck.message
    replica = check([object(), timeout], [None, None])
    assert not replica.healthy and "data-parallel replica 1" in replica.message
    dead = check([EngineUnavailable("engine process exited")], [None])
    assert not dead.healthy and "engine unavailable" in dead.message


def test_the_engine_loop_says_since_when_a_step_runs():
    from multiprocessing import RawValue

    from tokenspeed_worker.engine.process import _busy

    busy = RawValue("d", 0.0)
    seen = []
    assert _busy(busy, lambda x: seen.append(busy.value) or x, 7) == 7
    assert seen[0] > 0 and busy.value == 0.0
    with pytest.raises(ValueError):
        _busy(busy, lambda: (_ for _ in ()).throw(ValueError("step failed")))
    assert busy.value == 0.0
    assert _busy(None, lambda: 3) == 3
