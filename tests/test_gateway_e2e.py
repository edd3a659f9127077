"""End to end: the real smg gateway in front of a real worker serving SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import Gateway, Worker, hf_greedy, smollm2_dir

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def stack(model_dir):
    worker = Worker(model_dir, "--served-model-name", "smollm2", "--max-model-len", "2048")
    try:
        gateway = Gateway(model_dir, [worker.address])
    except Exception:
        worker.stop()
        raise
    yield worker, gateway
    gateway.stop()
    assert worker.stop() == 0, worker.log()


def post(gateway, path, body, timeout=120):
    req = urllib.request.Request(gateway.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stream_events(gateway, path, body, timeout=120):
    req = urllib.request.Request(gateway.url + path, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


@pytest.fixture(scope="module")
def reference_answer(model_dir):
    """transformers' greedy answer to the same chat, decoded the way the gateway decodes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    out = hf_greedy(model_dir, list(ids), MAX_TOKENS, eos_ids=[tok.eos_token_id])
    return tok.decode(out, skip_special_tokens=True)


def test_models_lists_the_served_model(stack):
    _, gateway = stack
    with urllib.request.urlopen(gateway.url + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())
    assert "smollm2" in [m["id"] for m in models["data"]]


def test_chat_completion_equals_transformers(stack, reference_answer):
    _, gateway = stack
    r = post(gateway, "/v1/chat/completions",
             {"model": "smollm2", "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0})
    content = r["choices"][0]["message"]["content"]
    assert content.strip() == reference_answer.strip()
    assert "Paris" in content
    assert r["usage"]["completion_tokens"] <= MAX_TOKENS
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


def test_streaming_chat_equals_non_streaming(stack, reference_answer):
    _, gateway = stack
    events = list(stream_events(gateway, "/v1/chat/completions",
                                {"model": "smollm2", "messages": QUESTION, "max_tokens": MAX_TOKENS,
                                 "temperature": 0}))
    text = "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e.get("choices"))
    assert text.strip() == reference_answer.strip()
    finishes = [e["choices"][0].get("finish_reason") for e in events if e.get("choices")]
    assert finishes[-1] in ("stop", "length") or any(finishes)


def test_completions(stack, model_dir):
    _, gateway = stack
    r = post(gateway, "/v1/completions",
             {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert "Paris" in r["choices"][0]["text"]


def test_completions_echo_with_max_tokens_zero(stack):
    """How lm-evaluation-harness and other scoring clients ask for the prompt back (the gateway
    project's test_non_streaming_echo_max_tokens_zero / test_streaming_echo_max_tokens_zero)."""
    worker, gateway = stack
    prompt = "The capital of France is"
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 0, "temperature": 0, "echo": True}
    r = post(gateway, "/v1/completions", body)
    assert r["choices"][0]["text"] == prompt
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    assert r["usage"]["completion_tokens"] == 0
    texts, reasons = [], []
    for event in stream_events(gateway, "/v1/completions", body):
        for choice in event.get("choices", []):
            texts.append(choice.get("text") or "")
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    assert "".join(texts) == prompt and len(reasons) == 1 and reasons[0] in ("stop", "length")
    load = worker.stub.GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0]
    assert load.num_running_reqs == 0 and load.num_used_tokens == 0


def test_client_dropping_a_stream_frees_its_request(stack):
    worker, gateway = stack
    req = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        data=json.dumps({"model": "smollm2", "messages": QUESTION, "max_tokens": 1500, "temperature": 1.0,
                         "ignore_eos": True, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=60)
    for _ in range(3):
        r.readline()
    load = worker.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.num_running_reqs == 1 and load.num_used_tokens > 0
    r.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 15
    while True:
        load = worker.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            break
        assert time.monotonic() < deadline, f"request still held after the client left: {load}"
        time.sleep(0.2)


def test_worker_errors_reach_the_client_as_http_400(stack):
    _, gateway = stack
    # The gateway validates the OpenAI ranges itself; a stop token outside the vocabulary is
    # what only the worker can refuse: INVALID_ARGUMENT -> 400 with the worker's message.
    with pytest.raises(urllib.error.HTTPError) as e:
        post(gateway, "/v1/chat/completions",
             {"model": "smollm2", "messages": QUESTION, "max_tokens": 4, "stop_token_ids": [999999]})
    assert e.value.code == 400
    assert "stop_token_ids" in e.value.read().decode()
    # UNIMPLEMENTED -> 501: tests/test_structured_output.py (a worker with --grammar-backend none).


def test_logprobs_and_top_logprobs(stack):
    _, gateway = stack
    r = post(gateway, "/v1/chat/completions",
             {"model": "smollm2", "messages": QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": True,
              "top_logprobs": 3})
    content = r["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) <= 6
    for entry in content:
        assert entry["logprob"] <= 0
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert entry["logprob"] == pytest.approx(tops[0]["logprob"], abs=1e-4)  # greedy: the top token


def test_stop_string_ends_the_answer(stack):
    _, gateway = stack
    r = post(gateway, "/v1/chat/completions",
             {"model": "smollm2", "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0,
              "stop": ["Paris"]})
    choice = r["choices"][0]
    assert "Paris" not in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < MAX_TOKENS


def test_seed_reproducible_and_n_2(stack):
    _, gateway = stack
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 12, "temperature": 1.0, "seed": 42, "n": 2}
    a = post(gateway, "/v1/chat/completions", body)
    b = post(gateway, "/v1/chat/completions", body)
    texts_a = [c["message"]["content"] for c in sorted(a["choices"], key=lambda c: c["index"])]
    texts_b = [c["message"]["content"] for c in sorted(b["choices"], key=lambda c: c["index"])]
    assert len(texts_a) == 2 and texts_a == texts_b


def test_max_tokens_and_ignore_eos(stack):
    _, gateway = stack
    r = post(gateway, "/v1/chat/completions",
             {"model": "smollm2", "messages": QUESTION, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 40
    assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral", "fp8-block-moe", "phi3", "gemma2",
                                  "gemma3-multimodal"])
def test_each_model_family_serves_through_the_gateway(name):
    """The tiny random Qwen3-MoE, Qwen2-MoE (a shared expert beside the routed ones), Mixtral, Phi-3 (fused checkpoint projections, partial rotary,
    longrope), Gemma 2 (sliding windows shorter than the prompt, soft-caps), Gemma 3 as a multimodal
    checkpoint (its language model served), and the Qwen3-MoE as a block-wise FP8 checkpoint,
    behind the real gateway:
    its chat completion, greedy, is transformers' greedy continuation of the same templated prompt
    (on the FP8 weights dequantized). (Llama: the SmolLM2 stack above; the other families' models
    against transformers: tests/test_engine_vs_hf.py, tests/test_dense_families.py.)"""
    from transformers import AutoTokenizer

    from worker_harness import CACHE, _load_script, tiny_models

    if name == "fp8-block-moe":
        model_dir, ref_dir = _load_script("make_fp8_models").make_all(CACHE / "fp8_models", tiny_models())[name]
    else:
        model_dir = ref_dir = tiny_models()[name]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    # A random model may end on part of a UTF-8 character: transformers renders it as U+FFFD, the
    # gateway's incremental decoder holds it back.
    expected = tok.decode(hf_greedy(ref_dir, list(ids), 12), skip_special_tokens=True).rstrip("\ufffd")
    worker = Worker(model_dir, "--served-model-name", name, "--max-model-len", "256")
    try:
        gateway = Gateway(model_dir, [worker.address])
        try:
            r = post(gateway, "/v1/chat/completions", {"model": name, "messages": QUESTION, "max_tokens": 12,
                                                       "temperature": 0, "ignore_eos": True})
            assert r["choices"][0]["message"]["content"] == expected
            assert r["usage"]["completion_tokens"] == 12
        finally:
            gateway.stop()
    finally:
        assert worker.stop() == 0, worker.log()


def test_ngram_speculation_behind_the_gateway(stack, model_dir):
    """A worker with `--speculative-algorithm NGRAM` behind the real gateway answers a copy-heavy chat
    as the plain worker does (non-streaming and streaming, a stop string cut inside a burst of kept
    drafts, seeded n=2 sampling), keeping drafts."""
    _, plain_gateway = stack
    worker = Worker(model_dir, "--served-model-name", "smollm2", "--max-model-len", "2048",
                    "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
                    "--enable-log-request-stats")
    try:
        gateway = Gateway(model_dir, [worker.address])
        try:
            passage = ("The committee met on Tuesday to review the proposal for the new library. The members "
                       "agreed that the building should be finished within two years.")
            copy = [{"role": "user", "content": f"Repeat this text exactly: {passage}"}]
            bodies = [{"model": "smollm2", "messages": copy, "max_tokens": 36, "temperature": 0},
                      {"model": "smollm2", "messages": copy, "max_tokens": 36, "temperature": 0,
                       "stop": ["review the"]},
                      {"model": "smollm2", "messages": copy, "max_tokens": 12, "temperature": 0.8, "seed": 7,
                       "n": 2},
                      # Speculation keeps more of sample 1's drafts, so it ends first: its choice must
                      # still be index 1 (smg numbers a unary response's choices by arrival).
                      {"model": "smollm2", "messages": [{"role": "user", "content": "List the numbers one to "
                                                         "twenty, separated by commas."}],
                       "max_tokens": 30, "temperature": 0.7, "seed": 3, "n": 2}]
            answers = []
            for body in bodies:
                want, got = post(plain_gateway, "/v1/chat/completions", body), post(gateway, "/v1/chat/completions",
                                                                                      body)
                texts = [sorted((c["index"], c["message"]["content"], c["finish_reason"]) for c in r["choices"])
                         for r in (want, got)]
                assert texts[1] == texts[0], body
                assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
                answers.append(texts[0])
            assert answers[1][0][2] == "stop" and "review the" not in answers[1][0][1]
            events = list(stream_events(gateway, "/v1/chat/completions", bodies[0]))
            text = "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events
                           if e.get("choices"))
            assert text == answers[0][0][1]
            streamed: dict[int, str] = {}
            for e in stream_events(gateway, "/v1/chat/completions", bodies[3]):
                for c in e.get("choices", []):
                    streamed[c["index"]] = streamed.get(c["index"], "") + ((c.get("delta") or {}).get("content") or "")
            assert [streamed[0], streamed[1]] == [answers[3][0][1], answers[3][1][1]]
        finally:
            gateway.stop()
        stats = [line for line in worker.log().splitlines() if "Finish!" in line]
        assert any("acc_rate=None" not in line and "acc_rate=0.0," not in line for line in stats), stats[-3:]
    finally:
        assert worker.stop() == 0, worker.log()
