"""Soak: hundreds of concurrent streams against a real worker for a bounded time (loopback only).

200 requests stay in flight (grpc.aio, one asyncio loop): random prompt lengths (some sharing a
prefix), random max_new_tokens (1..64), streaming or not, n 1..3; each one is left to finish, or
cancelled by the client after a random delay, or ended with an Abort RPC for its request_id (as the
gateway does for a dropped stream). Checks: every call ends before its deadline, finished ones end
with exactly one GenerateComplete per index with consistent counts, aborted/cancelled ones end with
finish_reason "abort" or CANCELLED; afterwards the engine holds no request and no KV block, and the
worker's resident memory (server + engine process) grew by at most 20% + 50 MB over the soak,
measured against the value after a warm-up phase.

Knobs: TOKENSPEED_SOAK_SECONDS (default 45), TOKENSPEED_SOAK_WARMUP_SECONDS (default 10),
TOKENSPEED_SOAK_CONCURRENCY (default 200). Run with -s to see throughput and memory.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb, tokenspeed_scheduler_pb2_grpc as pb_grpc
from worker_harness import Worker, process_tree_rss_kb, tiny_models, wait_idle

MAX_MODEL_LEN = 256
SOAK_SECONDS = float(os.environ.get("TOKENSPEED_SOAK_SECONDS", "45"))
WARMUP_SECONDS = float(os.environ.get("TOKENSPEED_SOAK_WARMUP_SECONDS", "10"))
CONCURRENCY = int(os.environ.get("TOKENSPEED_SOAK_CONCURRENCY", "200"))
CALL_DEADLINE_S = 60.0  # a call past this counts as a hang
RSS_GROWTH_FRACTION = 0.20
RSS_GROWTH_SLACK_KB = 50 * 1024
SHARED_PREFIX = [(13 * i + 5) % 400 + 3 for i in range(96)]


@pytest.fixture(scope="module")
def worker():
    w = Worker(tiny_models()["llama-gqa-tied"], "--max-model-len", str(MAX_MODEL_LEN), "--max-total-tokens", "8192")
    yield w
    assert w.stop() == 0, w.log()


@dataclass
class Stats:
    started: int = 0
    outcomes: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def fail(self, message: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(message)
        self.outcomes["FAILED"] += 1


def make_request(rng: random.Random, seq: int, vocab: int) -> pb.GenerateRequest:
    prompt_len = rng.choice([rng.randint(1, 16), rng.randint(1, 128), rng.randint(100, 200)])
    if rng.random() < 0.3:  # shares a prefix with others: prefix cache hits, shared blocks
        prompt = SHARED_PREFIX[: min(prompt_len, len(SHARED_PREFIX))] + [rng.randrange(vocab) for _ in range(8)]
    else:
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    sp = pb.SamplingParams(
        n=rng.randint(1, 3),
        max_new_tokens=rng.randint(1, 64),
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([-1, 20]),
        min_p=0.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        ignore_eos=rng.random() < 0.5,
    )
    return pb.GenerateRequest(request_id=f"soak-{seq}-{rng.getrandbits(32):08x}",
                              tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sp,
                              stream=rng.random() < 0.7, return_logprob=rng.random() < 0.1)


def check_finished(req, responses, *, aborted: bool) -> str | None:
    """None if the stream is a well-formed ending, else what is wrong."""
    n = req.sampling_params.n
    if not responses or not responses[-1].HasField("complete"):
        return f"stream did not end with a GenerateComplete ({len(responses)} messages)"
    prompt_len = len(req.tokenized.input_ids)
    limit = min(req.sampling_params.max_new_tokens, MAX_MODEL_LEN - prompt_len)
    tokens: dict[int, int] = Counter()
    done: dict[int, pb.GenerateComplete] = {}
    for r in responses:
        if r.request_id != req.request_id:
            return f"request_id {r.request_id!r} on the stream of {req.request_id!r}"
        if r.HasField("chunk"):
            if not req.stream:
                return "a chunk on a non-streaming call"
            if r.chunk.index in done:
                return f"chunk for index {r.chunk.index} after its complete"
            tokens[r.chunk.index] += len(r.chunk.token_ids)
        else:
            c = r.complete
            if c.index in done or c.index >= n:
                return f"unexpected complete for index {c.index} (n={n}, done {sorted(done)})"
            done[c.index] = c
            tokens[c.index] += len(c.output_ids)
    if sorted(done) != list(range(n)):
        return f"completes for {sorted(done)}, want 0..{n - 1}"
    for i, c in done.items():
        allowed = ("stop", "length", "abort") if aborted else ("stop", "length")
        if c.finish_reason not in allowed:
            return f"index {i}: finish_reason {c.finish_reason!r} (aborted={aborted})"
        if c.prompt_tokens != prompt_len or c.completion_tokens > limit:
            return f"index {i}: counts {c.prompt_tokens}/{c.completion_tokens} (prompt {prompt_len}, limit {limit})"
        if c.finish_reason == "length" and c.completion_tokens != limit:
            return f"index {i}: length after {c.completion_tokens} tokens, limit {limit}"
        trimmed = 1 if c.finish_reason == "stop" and c.HasField("matched_token_id") else 0
        if c.finish_reason != "abort" and tokens[i] != c.completion_tokens - trimmed:
            return f"index {i}: {tokens[i]} tokens delivered, completion_tokens {c.completion_tokens} ({c.finish_reason})"
    if aborted and not any(c.finish_reason == "abort" for c in done.values()):
        return "Abort answered success but no sample ended with abort"
    return None


async def one_call(stub, rng: random.Random, seq: int, vocab: int, stats: Stats) -> None:
    req = make_request(rng, seq, vocab)
    action = rng.choice(["finish", "finish", "cancel", "abort"])
    delay = rng.uniform(0.0, 1.5)
    stats.started += 1
    t0 = time.monotonic()
    call = stub.Generate(req, timeout=CALL_DEADLINE_S)
    abort_ok: list[bool] = []

    async def interfere():
        await asyncio.sleep(delay)
        if action == "cancel":
            call.cancel()
        else:
            r = await stub.Abort(pb.AbortRequest(request_id=req.request_id, reason="Stream dropped"), timeout=10)
            abort_ok.append(r.success)

    side = asyncio.create_task(interfere()) if action != "finish" else None
    try:
        await _collect(call, req, action, side, abort_ok, stats, t0)
    finally:
        if side is not None and not side.done():
            side.cancel()


async def _collect(call, req, action, side, abort_ok, stats, t0) -> None:
    responses = []
    code, details = grpc.StatusCode.OK, ""
    try:
        async for r in call:
            responses.append(r)
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling() or action != "cancel":
            raise
        code = grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as e:
        code = e.code()
        details = e.details()
    if side is not None:
        try:
            await side
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            stats.fail(f"{req.request_id}: Abort RPC failed: {e.code()} {e.details()}")
            return
    stats.latencies.append(time.monotonic() - t0)
    if code == grpc.StatusCode.CANCELLED and action == "cancel":
        stats.outcomes["cancelled"] += 1
        return
    if code != grpc.StatusCode.OK:
        stats.fail(f"{req.request_id} ({action}): status {code.name} {details!r}")
        return
    aborted = bool(abort_ok and abort_ok[0])
    problem = check_finished(req, responses, aborted=aborted)
    if problem:
        stats.fail(f"{req.request_id} ({action}, stream={req.stream}, n={req.sampling_params.n}): {problem}")
        return
    stats.completion_tokens += sum(r.complete.completion_tokens for r in responses if r.HasField("complete"))
    stats.outcomes["aborted" if aborted else f"{action}:completed"] += 1


async def drive(address: str, seconds: float, seed: int, vocab: int) -> tuple[Stats, float]:
    stats = Stats()
    end = time.monotonic() + seconds
    seq = iter(range(10**9))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TokenSpeedSchedulerStub(channel)

        async def lane(k: int) -> None:
            rng = random.Random(seed * 100003 + k)
            while time.monotonic() < end:
                s = next(seq)
                try:
                    await asyncio.wait_for(one_call(stub, rng, s, vocab, stats), CALL_DEADLINE_S + 15)
                except asyncio.TimeoutError:
                    stats.fail(f"call {s} hung past {CALL_DEADLINE_S + 15}s on the client")

        t0 = time.monotonic()
        await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
        return stats, time.monotonic() - t0




def tree_rss(worker) -> dict[int, int]:
    rss = process_tree_rss_kb(worker.proc.pid)
    assert len(rss) >= 2, f"the engine child process of {worker.proc.pid} was not found: {rss}"
    return rss


def summarize(name: str, stats: Stats, wall: float) -> str:
    done = sum(v for k, v in stats.outcomes.items() if k != "FAILED")
    lat = sorted(stats.latencies) or [0.0]
    return (f"[soak] {name}: {stats.started} calls in {wall:.1f}s, {done} ended cleanly "
            f"({done / wall:.1f}/s), {stats.completion_tokens} completion tokens "
            f"({stats.completion_tokens / wall:.0f} tok/s); latency p50 {lat[len(lat) // 2]:.2f}s "
            f"max {lat[-1]:.2f}s; {dict(stats.outcomes)}")


def test_soak_concurrent_streams(worker, capsys):
    vocab = worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size

    warm, warm_wall = asyncio.run(drive(worker.address, WARMUP_SECONDS, 1, vocab))
    with capsys.disabled():
        print("\n" + summarize("warm-up", warm, warm_wall))
    assert not warm.failures, "\n".join(warm.failures)
    wait_idle(worker)
    rss_before = tree_rss(worker)

    stats, wall = asyncio.run(drive(worker.address, SOAK_SECONDS, 2, vocab))
    with capsys.disabled():
        print(summarize("soak", stats, wall))
    assert not stats.failures, "\n".join(stats.failures)
    completed = sum(v for k, v in stats.outcomes.items() if k.endswith("completed"))
    assert completed > 0 and stats.outcomes["aborted"] > 0 and stats.outcomes["cancelled"] > 0, stats.outcomes

    load = wait_idle(worker, timeout=10.0)
    assert load.num_total_reqs == 0
    assert worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
    assert worker.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).active_requests == 0
    assert worker.proc.poll() is None, worker.log()

    rss_after = tree_rss(worker)
    before, after = sum(rss_before.values()), sum(rss_after.values())
    with capsys.disabled():
        print(f"[soak] RSS after warm-up {before / 1024:.0f} MB {rss_before}, after soak {after / 1024:.0f} MB "
              f"{rss_after} ({(after - before) / 1024:+.1f} MB)")
    assert after <= before * (1 + RSS_GROWTH_FRACTION) + RSS_GROWTH_SLACK_KB, (rss_before, rss_after)
    for pid, kb in rss_after.items():
        base = rss_before.get(pid, 0)
        assert kb <= base * (1 + RSS_GROWTH_FRACTION) + RSS_GROWTH_SLACK_KB, f"pid {pid}: {base} kB -> {kb} kB"
