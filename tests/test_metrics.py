"""--enable-metrics (Prometheus), --enable-log-request-stats and --enable-log-requests, against
a real worker process on a tiny model: scrape the endpoint after known traffic, read the log."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import grpc
import pytest

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import Worker, free_port, tiny_models

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 12]
MODEL = "tiny-metrics"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models()["llama-gqa-tied"]


@pytest.fixture(scope="module")
def worker(model_dir):
    port = free_port()
    w = Worker(model_dir, "--max-model-len", "4096", "--max-total-tokens", "16384", "--block-size", "8",
               "--enable-cache-report",
               "--served-model-name", MODEL, "--enable-metrics", "--metrics-reporters", "prometheus",
               "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--enable-log-request-stats",
               "--enable-log-requests", "--log-requests-level", "1")
    w.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield w
    assert w.stop() == 0, w.log()


def gen(prompt, *, rid, max_new_tokens=None, stream=False, **sampling):
    sp = pb.SamplingParams(n=1, **sampling)
    if max_new_tokens is not None:
        sp.max_new_tokens = max_new_tokens
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=sp, stream=stream)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels) -> float:
    labels = {"model_name": MODEL, **labels}
    return samples.get((name, frozenset(labels.items())), 0.0)


def stats_lines(worker) -> dict[str, dict]:
    """rid -> the fields of its `Req: <rid> Finish! RequestStats(...)` line."""
    text = worker.log_path.read_text(errors="replace")
    out = {}
    for rid, body in re.findall(r"Req: (\S+) Finish! RequestStats\((.*)\)$", text, flags=re.M):
        fields = {}
        for key, raw in re.findall(r"(\w+)=('[^']*'|[^,]+)", body):
            fields[key] = raw.strip("'") if raw.startswith("'") else (None if raw == "None" else float(raw))
        out[rid] = fields
    return out


def test_metrics_counters_histograms_gauges_and_stats_line(worker):
    before = scrape(worker.metrics_url)
    tag = time.monotonic_ns()
    completes = {}

    # length: ignore_eos, a fixed number of tokens
    rid_len = f"len-{tag}"
    (resp,) = list(worker.stub.Generate(
        gen(PROMPT, rid=rid_len, max_new_tokens=6, temperature=0.0, ignore_eos=True), timeout=60))
    completes[rid_len] = resp.complete
    assert resp.complete.finish_reason == "length" and resp.complete.completion_tokens == 6
    greedy = list(resp.complete.output_ids)

    # stop: a stop token id the greedy continuation reaches at its third token
    stop_tok = greedy[2]
    k = greedy.index(stop_tok)
    rid_stop = f"stop-{tag}"
    (resp,) = list(worker.stub.Generate(
        gen(PROMPT, rid=rid_stop, max_new_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]), timeout=60))
    completes[rid_stop] = resp.complete
    assert resp.complete.finish_reason == "stop" and resp.complete.completion_tokens == k + 1

    # abort: a long stream, aborted after its first chunk
    rid_abort = f"abort-{tag}"
    stream = worker.stub.Generate(gen(PROMPT, rid=rid_abort, ignore_eos=True, stream=True), timeout=120)
    assert next(stream).HasField("chunk")
    assert worker.stub.Abort(pb.AbortRequest(request_id=rid_abort)).success
    rest = list(stream)
    completes[rid_abort] = rest[-1].complete
    assert rest[-1].complete.finish_reason == "abort"

    # an error: rejected before the engine
    with pytest.raises(grpc.RpcError) as e:
        list(worker.stub.Generate(gen([10**9], rid=f"bad-{tag}", max_new_tokens=2), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    time.sleep(2.5)  # two gauge refreshes with the engine idle
    after = scrape(worker.metrics_url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tokenspeed:request_success_total", finish_reason="length") == 1
    assert delta("tokenspeed:request_success_total", finish_reason="stop") == 1
    assert delta("tokenspeed:request_success_total", finish_reason="abort") == 1
    assert delta("tokenspeed:request_errors_total", code="INVALID_ARGUMENT") == 1
    total_out = sum(c.completion_tokens for c in completes.values())
    assert delta("tokenspeed:generation_tokens_total") == total_out
    assert delta("tokenspeed:prompt_tokens_total") == 3 * len(PROMPT)
    cached = sum(c.cached_tokens for c in completes.values())
    assert delta("tokenspeed:prefix_cache_hit_tokens_total") == cached
    assert cached > 0  # the same prompt three times: the later ones hit the prefix cache
    assert delta("tokenspeed:time_to_first_token_seconds_count") == 3
    assert delta("tokenspeed:e2e_request_latency_seconds_count") == 3
    assert delta("tokenspeed:request_queue_time_seconds_count") == 3
    assert delta("tokenspeed:inter_token_latency_seconds_count") == sum(
        c.completion_tokens - 1 for c in completes.values())
    assert delta("tokenspeed:step_duration_seconds_count") >= max(c.completion_tokens for c in completes.values())
    assert value(after, "tokenspeed:num_requests_running") == 0
    assert value(after, "tokenspeed:num_requests_waiting") == 0
    assert 0.0 <= value(after, "tokenspeed:kv_cache_usage_perc") <= 1.0
    assert 0.0 < value(after, "tokenspeed:prefix_cache_hit_rate") <= 1.0
    assert ("tokenspeed:num_preemptions_total", frozenset({("model_name", MODEL)})) in after

    stats = stats_lines(worker)
    for rid, reason in ((rid_len, "length"), (rid_stop, "stop"), (rid_abort, "abort")):
        s, c = stats[rid], completes[rid]
        assert s["status"] == ("aborted" if reason == "abort" else "finished")
        assert s["reason"] == reason
        assert s["prompt_tokens"] == len(PROMPT)
        assert s["output_tokens"] == c.completion_tokens
        assert s["cache_tokens"] == c.cached_tokens
        assert s["cache_hit_rate"] == pytest.approx(c.cached_tokens / len(PROMPT), abs=1e-3)
        assert s["queue_ms"] >= 0 and s["prefill_ms"] >= 0
        assert s["ttft_ms"] >= s["prefill_ms"] and s["total_ms"] >= s["ttft_ms"]
        assert s["ttft_ms"] == pytest.approx(s["queue_ms"] + s["prefill_ms"], abs=0.3)
        assert s["recv_ts"] - 0.002 <= s["commit_ts"] <= s["finish_ts"] + 0.002
        assert abs(s["finish_ts"] - time.time()) < 120
        assert s["preempt_ms"] == 0.0 and s["preempt_count"] == 0
        assert s["acc_len"] is None and s["acc_rate"] is None
        assert s["decode_tps"] >= 0
    line = re.search(rf"Req: {rid_len} Finish! RequestStats\(status='finished', reason='length', prompt_tokens=10, "
                     r"cache_tokens=\d+, output_tokens=6, cache_hit_rate=[\d.]+, queue_ms=[\d.]+, prefill_ms=[\d.]+, "
                     r"ttft_ms=[\d.]+, total_ms=[\d.]+, preempt_ms=0.0, preempt_count=0, decode_tps=[\d.]+, "
                     r"acc_len=None, acc_rate=None, recv_ts=[\d.]+, commit_ts=[\d.]+, finish_ts=[\d.]+\)$",
                     worker.log_path.read_text(), flags=re.M)
    assert line, worker.log()

    # --enable-log-requests: arrival and finish, each naming the request id
    log = worker.log_path.read_text()
    for rid in (rid_len, rid_stop, rid_abort):
        assert re.search(rf"Req: {rid} Receive! n=1, prompt_tokens=10, .*sampling=\(temperature=", log)
        assert re.search(rf"Req: {rid} Done! status=", log)
    assert re.search(rf"Req: bad-{tag} Rejected! INVALID_ARGUMENT", log)


def _port_open(port: int) -> bool:
    """Whether a socket listens on port: binding it (SO_REUSEADDR, which Linux refuses only while a
    socket listens there) fails. Not a connect() probe: a port from free_port() is in the ephemeral
    range, and a connect to it with no listener can pick that same port as its source and connect
    to itself (a flaky CI failure of the test below)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_max_new_tokens_zero_is_counted_and_logged(worker):
    """The prompt-back request (/v1/completions echo, max_tokens 0) never reaches the engine, yet
    counts as a request that finished by length, with its log line."""
    before = scrape(worker.metrics_url)
    rid = f"zero-{time.monotonic_ns()}"
    req = gen(PROMPT, rid=rid, max_new_tokens=0)
    req.sampling_params.n = 2
    out = list(worker.stub.Generate(req, timeout=30))
    assert [r.complete.finish_reason for r in out] == ["length", "length"]
    after = scrape(worker.metrics_url)
    assert value(after, "tokenspeed:request_success_total", finish_reason="length") - \
        value(before, "tokenspeed:request_success_total", finish_reason="length") == 2
    log = worker.log()
    assert f"Req: {rid} Receive!" in log and f"Req: {rid} Done! status=finished, reason=length" in log


def test_port_probe_sees_listeners_only():
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as prometheus_client's server
        listener.bind(("0.0.0.0", 0))
        port = listener.getsockname()[1]
        assert not _port_open(port)  # bound, not listening
        listener.listen()
        assert _port_open(port)
    assert not _port_open(port)


def test_metrics_disabled_means_no_port(model_dir):
    port = free_port()
    w = Worker(model_dir, "--max-model-len", "256", "--max-total-tokens", "2048", "--metrics-port", str(port))
    try:
        list(w.stub.Generate(gen(PROMPT, rid="x", max_new_tokens=2), timeout=60))
        assert not _port_open(port)
        assert not _port_open(w.port + 1000)
        assert "Finish! RequestStats" not in w.log() and "Receive!" not in w.log()
    finally:
        assert w.stop() == 0
