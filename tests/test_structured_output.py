"""Structured output with xgrammar (engine/grammar.py) on SmolLM2-135M-Instruct, in the engine and
over gRPC: every constraint kind the wire defines, invalid constraints refused with the field named,
constrained and unconstrained requests in one batch (with overlap scheduling on), n = 2, and a
compiling grammar never stalling the other streams."""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest

pytest.importorskip("xgrammar")

from tokenspeed_worker.config import EngineConfig  # noqa: E402
from tokenspeed_worker.engine.engine_core import EngineCore  # noqa: E402
from tokenspeed_worker.engine.messages import FINISH_STOP, AddRequest  # noqa: E402
from tokenspeed_worker.sampling.params import SamplingParams  # noqa: E402
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb  # noqa: E402
from worker_harness import Worker, smollm2_dir  # noqa: E402

pytestmark = pytest.mark.smollm2

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir()))


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def core():
    m = str(smollm2_dir())
    return EngineCore(EngineConfig.build(m, dtype="float32", max_model_len=1024, max_num_seqs=8,
                                         max_total_tokens=16384, tokenizer_path=m, overlap_schedule=True))


def request(tok, req_id, prompt, constraint=None, max_new=64, temperature=0.0):
    params = SamplingParams(temperature=temperature, seed=req_id, stop_token_ids=[tok.eos_token_id])
    return AddRequest(req_id, np.asarray(prompt, np.int32), max_new, params, constraint=constraint)


def run(core, requests):
    for r in requests:
        core.add_request(r)
    outs = {r.req_id: [] for r in requests}
    reasons = {}
    steps = []
    for out in core.run_steps():
        if out is None:
            continue
        steps.append(set(out.req_ids.tolist()))
        for rid, token in zip(out.req_ids.tolist(), out.tokens.tolist()):
            outs[rid].append(token)
        reasons.update(zip(out.finished_ids.tolist(), out.finish_reasons.tolist()))
    return outs, reasons, core.take_failures(), steps


def text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def check_person(value: str) -> None:
    obj = json.loads(value)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    assert len(obj["name"]) <= 20 and 0 <= obj["age"] <= 150


def test_every_constraint_kind_in_one_batch_with_an_unconstrained_request(core, tok):
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>",
                                                "content": {"type": "json_schema", "json_schema": PERSON,
                                                            "max_whitespace_cnt": 1},
                                                "end": "</answer>"}}
    reqs = [
        request(tok, 1, chat(tok, "Describe a person as JSON."), ("json_schema", json.dumps(PERSON))),
        request(tok, 2, chat(tok, "Give me a phone number."), ("regex", r"[0-9]{3}-[0-9]{4}")),
        request(tok, 3, chat(tok, "Is the sky blue?"), ("ebnf_grammar", ebnf)),
        request(tok, 4, chat(tok, "Answer with a person."), ("structural_tag", json.dumps(tag)), max_new=96),
        request(tok, 5, chat(tok, "Tell me a story."), None, max_new=24),
        request(tok, 6, chat(tok, 'Reply with exactly this JSON object: {"ok": true}'),
                ("json_schema", json.dumps({"type": "object"})), max_new=96),
    ]
    outs, reasons, failures, _ = run(core, reqs)
    assert failures == []
    check_person(text(tok, outs[1]))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text(tok, outs[2]))
    assert re.fullmatch(r"The answer is (yes|no)\.", text(tok, outs[3]))
    tagged = re.fullmatch(r"<answer>(.*)</answer>", text(tok, outs[4]), re.S)
    assert tagged, text(tok, outs[4])
    check_person(tagged.group(1))
    assert isinstance(json.loads(text(tok, outs[6])), dict)
    assert len(outs[5]) == 24 and reasons[5] == 2  # the unconstrained one ran to its length
    for rid in (1, 2, 3, 4, 6):
        assert reasons[rid] == 1 and outs[rid][-1] == tok.eos_token_id  # the grammar ended it: "stop"
    assert not core.grammars.active and core.scheduler.num_used_tokens == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_completes_before_min_new_tokens_ends_the_request(core, tok, temperature):
    """min_new_tokens holds back the stop ids, and a complete grammar allows nothing else: the
    grammar wins, as over ignore_eos. The output is the grammar's, ended by its stop token ("stop"),
    never tokens the grammar forbids (the draw took id 0 there). An unconstrained request with a
    minimum in the same batch still runs to it."""
    def with_min(req, minimum):
        req.sampling_params.min_new_tokens = minimum
        return req

    reqs = [with_min(request(tok, 1, chat(tok, "Pick a number."), ("regex", "[0-9]{3}"), max_new=20,
                             temperature=temperature), 6),
            with_min(request(tok, 2, chat(tok, "Pick a number."), ("ebnf_grammar", 'root ::= "yes" | "no"'),
                             max_new=20, temperature=temperature), 10),
            with_min(request(tok, 3, chat(tok, "Say hi."), None, max_new=12, temperature=temperature), 12)]
    outs, reasons, failures, _ = run(core, reqs)
    assert failures == []
    assert re.fullmatch(r"[0-9]{3}", text(tok, outs[1])), outs[1]
    assert text(tok, outs[2]) in ("yes", "no"), outs[2]
    for rid in (1, 2):
        assert reasons[rid] == 1 and outs[rid][-1] == tok.eos_token_id and 0 not in outs[rid], outs[rid]
    assert len(outs[3]) == 12
    assert not core.grammars.active and core.scheduler.num_used_tokens == 0


def test_constrained_batches_keep_overlap_scheduling_and_match_synchronous_steps(core, tok):
    # With overlap, step N+1 is launched before step N completes; its mask waits (inside the launch)
    # only for step N's tokens. Greedy outputs must equal those of synchronous steps, token for token.
    m = str(smollm2_dir())
    sync = EngineCore(EngineConfig.build(m, dtype="float32", max_model_len=1024, max_num_seqs=8,
                                         max_total_tokens=16384, tokenizer_path=m, overlap_schedule=False))
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'

    def reqs(base):
        return [
            request(tok, base + 1, chat(tok, "Describe a person as JSON."), ("json_schema", json.dumps(PERSON))),
            request(tok, base + 2, chat(tok, "Give me a phone number."), ("regex", r"[0-9]{3}-[0-9]{4}")),
            request(tok, base + 3, chat(tok, "Is the sky blue?"), ("ebnf_grammar", ebnf)),
            request(tok, base + 4, chat(tok, "Tell me a story."), None, max_new=20),
        ]

    events = []
    launch, complete = core.launch, core.complete

    def logged_launch():
        launched = launch()
        if launched is not None:
            events.append(("launch", core.grammars.active))
        return launched

    def logged_complete(launched):
        events.append(("complete", None))
        return complete(launched)

    core.launch, core.complete = logged_launch, logged_complete
    try:
        got, got_reasons, failures, _ = run(core, reqs(300))
    finally:
        del core.launch, core.complete
    expected, expected_reasons, _, _ = run(sync, reqs(300))
    assert failures == [] and got == expected and got_reasons == expected_reasons
    overlapped = [a for a, b in zip(events, events[1:]) if a[0] == b[0] == "launch" and b[1]]
    assert overlapped, "no step was launched while the previous one was pending under a constraint"
    check_person(text(tok, got[301]))
    assert core.scheduler.num_used_tokens == 0 and not core.grammars.active


def test_aborts_and_row_reuse_under_overlap_keep_every_grammar_consistent(core, tok):
    # Overlap with constraints: a step's tokens reach the matchers during the next launch, after the
    # server may have aborted requests and their rows gone to new ones (4 rows, constant churn).
    # Every request must end exactly once, finished outputs must match their regex, and nothing may
    # stay allocated.
    import random

    rng = random.Random(7)
    pattern = r"[0-9]{3}-[0-9]{4}"
    prompts = [chat(tok, f"Give me phone number {i}.") for i in range(24)]
    small = EngineCore(EngineConfig.build(str(smollm2_dir()), dtype="float32", max_model_len=512, max_num_seqs=4,
                                          max_total_tokens=4096, tokenizer_path=str(smollm2_dir()),
                                          overlap_schedule=True))
    outs, ended, aborted = {}, {}, set()
    next_id, pending = 500, None
    for turn in range(400):
        live = [rid for rid in outs if rid not in ended and rid not in aborted]
        if next_id < 524 and len(live) < 6:
            constraint = ("regex", pattern) if next_id % 3 else None
            small.add_request(request(tok, next_id, prompts[next_id - 500], constraint, max_new=12))
            outs[next_id] = []
            next_id += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            assert small.abort(victim)
            aborted.add(victim)
        results, pending, failed, _ = small.pipeline_step(pending)
        assert failed is None
        for out in results:
            for rid, token in zip(out.req_ids.tolist(), out.tokens.tolist()):
                assert rid not in ended and rid not in aborted, f"a token for request {rid} after it ended"
                outs[rid].append(token)
            for rid, reason in zip(out.finished_ids.tolist(), out.finish_reasons.tolist()):
                assert rid not in ended, f"request {rid} ended twice"
                ended[rid] = reason
        if next_id == 524 and pending is None and not small.has_work():
            break
    assert set(ended) | aborted == set(outs) and not set(ended) & aborted
    for rid, reason in ended.items():
        if (rid - 500) % 3 and reason == 1:
            assert re.fullmatch(pattern, text(tok, outs[rid])), (rid, text(tok, outs[rid]))
    assert len(aborted) > 2 and small.scheduler.num_used_tokens == 0 and not small.grammars.active


def test_invalid_constraints_fail_naming_the_field(core, tok):
    reqs = [request(tok, 11, chat(tok, "x"), ("json_schema", '{"type": "bogus"}')),
            request(tok, 12, chat(tok, "x"), ("regex", "(unclosed")),
            request(tok, 13, chat(tok, "x"), ("ebnf_grammar", "root ::= undefined_rule"))]
    outs, _, failures, _ = run(core, reqs)
    assert sorted(f[0] for f in failures) == [11, 12, 13]
    by_id = {f[0]: f for f in failures}
    assert all(f[1] == "INVALID_ARGUMENT" for f in failures)
    assert by_id[11][2].startswith("sampling_params.json_schema: ") and "bogus" in by_id[11][2]
    assert by_id[12][2].startswith("sampling_params.regex: ")
    assert by_id[13][2].startswith("sampling_params.ebnf_grammar: ")
    assert not any(outs.values())


def test_n2_samples_each_follow_the_grammar(core, tok):
    schema = ("json_schema", json.dumps(PERSON))
    prompt = chat(tok, "A person, as JSON.")
    reqs = [request(tok, 21, prompt, schema, temperature=1.0),
            AddRequest(22, np.asarray(prompt, np.int32), 64,
                       SamplingParams(temperature=1.0, seed=99, stop_token_ids=[tok.eos_token_id]),
                       wait_for=21, constraint=schema)]
    outs, _, failures, _ = run(core, reqs)
    assert failures == []
    for rid in (21, 22):
        check_person(text(tok, outs[rid]))


def test_a_compiling_grammar_does_not_stall_other_streams(core, tok):
    # A large schema (many properties, nested) compiles while another request decodes: that one
    # produces a token in every step from its first to its last.
    big = {"type": "object", "properties": {
        f"field_{i}": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array",
                                                                                      "items": {"type": "number"}}}}
        for i in range(150)}}
    free = request(tok, 31, chat(tok, "Tell me a story."), None, max_new=40)
    core.add_request(free)
    steps = []
    gen = core.run_steps()
    for _ in range(3):
        out = next(gen)
        steps.append(set(out.req_ids.tolist()) if out is not None else set())
    core.add_request(request(tok, 32, chat(tok, "Fill the form."), ("json_schema", json.dumps(big)), max_new=8))
    for out in gen:
        steps.append(set(out.req_ids.tolist()) if out is not None else set())
    produced = [i for i, owners in enumerate(steps) if 31 in owners]
    assert produced == list(range(produced[0], produced[0] + 40))
    assert core.take_failures() == []


def test_constrained_requests_survive_preemption(tok):
    # A pool too small for all of them at once: requests are preempted and recomputed; each keeps its
    # grammar state (the matcher lives with the request, which loses no sampled token).
    m = str(smollm2_dir())
    small = EngineCore(EngineConfig.build(m, dtype="float32", max_model_len=512, max_num_seqs=8,
                                          max_total_tokens=160, block_size=16, tokenizer_path=m,
                                          overlap_schedule=True,
                                          schedule_conservativeness=0.0))  # admit past what outputs will need
    schema = ("json_schema", json.dumps(PERSON))
    reqs = [request(tok, 40 + i, chat(tok, f"Person number {i} as JSON."), schema, max_new=64) for i in range(6)]
    outs, reasons, failures, _ = run(small, reqs)
    assert failures == [] and small.scheduler.num_preemptions > 0
    for r in reqs:
        check_person(text(tok, outs[r.req_id]))


# ---- over gRPC -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker():
    w = Worker(smollm2_dir(), "--max-model-len", "2048")
    yield w
    assert w.stop() == 0, w.log()


def gen(tok, prompt_text, **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_new_tokens", 64)
    sampling.setdefault("n", 1)
    return pb.GenerateRequest(request_id=f"so-{np.random.randint(1 << 30)}",
                              tokenized=pb.TokenizedInput(input_ids=chat(tok, prompt_text)),
                              sampling_params=pb.SamplingParams(**sampling))


def test_grpc_json_schema_and_refusals(worker, tok):
    info = worker.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.constrained_decoding == "requested"
    out = list(worker.stub.Generate(gen(tok, "A person as JSON.", json_schema=json.dumps(PERSON)), timeout=120))
    complete = out[-1].complete
    assert complete.finish_reason == "stop"
    check_person(text(tok, list(complete.output_ids)))
    for field, value, fragment in (("json_schema", "{not json", "not valid JSON"),
                                   ("json_schema", '{"type": "bogus"}', "bogus"),
                                   ("regex", "(unclosed", "sampling_params.regex"),
                                   ("ebnf_grammar", "", "must not be empty")):
        with pytest.raises(grpc.RpcError) as e:
            list(worker.stub.Generate(gen(tok, "x", **{field: value}), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling_params.{field}" in e.value.details() and fragment in e.value.details()


def test_grpc_constraint_with_logprobs_and_a_stop_string(worker, tok):
    req = gen(tok, "A person as JSON.", json_schema=json.dumps(PERSON), stop=['"age"'])
    req.return_logprob = True
    req.top_logprobs_num = 2
    complete = list(worker.stub.Generate(req, timeout=120))[-1].complete
    assert complete.finish_reason == "stop" and complete.matched_stop_str == '"age"'
    out = text(tok, list(complete.output_ids))
    assert out.startswith("{") and '"name"' in out and '"age"' not in out
    lp = complete.output_logprobs
    assert len(lp.token_logprobs) == len(complete.output_ids) and all(v <= 0.0 for v in lp.token_logprobs)


def test_grammar_backend_none_refuses_constraints(tok):
    w = Worker(smollm2_dir(), "--max-model-len", "1024", "--grammar-backend", "none")
    try:
        assert w.stub.GetServerInfo(pb.GetServerInfoRequest()).constrained_decoding == ""
        with pytest.raises(grpc.RpcError) as e:
            list(w.stub.Generate(gen(tok, "x", regex="a+"), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "sampling_params.regex" in e.value.details()
    finally:
        assert w.stop() == 0, w.log()


# ---- through the real gateway (smg): response_format, forced tool choice, regex, ebnf -------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def stack():
    from worker_harness import Gateway

    w = Worker(smollm2_dir(), "--served-model-name", "smollm2", "--max-model-len", "2048")
    try:
        g = Gateway(smollm2_dir(), [w.address])
    except Exception:
        w.stop()
        raise
    yield g
    g.stop()
    assert w.stop() == 0, w.log()


def chat_body(content, **extra):
    return {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": 96,
            "temperature": 0, **extra}


def person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.mark.e2e
def test_gateway_response_format_json_schema_and_json_object(stack):
    from test_gateway_e2e import post, stream_events

    r = post(stack, "/v1/chat/completions", chat_body("A person as JSON.", response_format=person_format()))
    assert r["choices"][0]["finish_reason"] == "stop"
    check_person(r["choices"][0]["message"]["content"])
    events = list(stream_events(stack, "/v1/chat/completions",
                                chat_body("A person as JSON.", response_format=person_format())))
    streamed = "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e.get("choices"))
    check_person(streamed)
    r = post(stack, "/v1/chat/completions", chat_body('Reply with the JSON object {"ok": true}.', max_tokens=128,
                                                      response_format={"type": "json_object"}))
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)


@pytest.mark.e2e
def test_gateway_forced_tool_choice_returns_valid_tool_calls(stack):
    from test_gateway_e2e import post

    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, max_tokens in ((named, 96), ("required", 400)):
        r = post(stack, "/v1/chat/completions", chat_body("What is the weather in Paris?", tools=[WEATHER],
                                                          tool_choice=choice, max_tokens=max_tokens))
        choice_out = r["choices"][0]
        calls = choice_out["message"].get("tool_calls") or []
        assert choice_out["finish_reason"] == "tool_calls" and calls, choice_out
        for call in calls:
            assert call["function"]["name"] == "get_weather"
            args = json.loads(call["function"]["arguments"])
            assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 30


@pytest.mark.e2e
def test_gateway_regex_ebnf_and_invalid_schema(stack):
    import urllib.error

    from test_gateway_e2e import post

    r = post(stack, "/v1/chat/completions", chat_body("A phone number?", regex="[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r["choices"][0]["message"]["content"])
    r = post(stack, "/v1/chat/completions", chat_body("Is the sky blue?", ebnf='root ::= "yes" | "no"'))
    assert r["choices"][0]["message"]["content"] in ("yes", "no")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    with pytest.raises(urllib.error.HTTPError) as e:
        post(stack, "/v1/chat/completions", chat_body("x", response_format=bad))
    assert e.value.code == 400
    assert "sampling_params.json_schema" in e.value.read().decode()


@pytest.mark.e2e
def test_gateway_maps_structured_output_off_to_501():
    # UNIMPLEMENTED from the worker reaches the client as HTTP 501 with the worker's message.
    import urllib.error

    from test_gateway_e2e import post
    from worker_harness import Gateway

    w = Worker(smollm2_dir(), "--served-model-name", "smollm2", "--max-model-len", "1024", "--grammar-backend", "none")
    try:
        g = Gateway(smollm2_dir(), [w.address])
        try:
            with pytest.raises(urllib.error.HTTPError) as e:
                post(g, "/v1/chat/completions", chat_body("x", response_format={"type": "json_object"}))
            assert e.value.code == 501
            assert "structured output is off" in e.value.read().decode()
        finally:
            g.stop()
    finally:
        assert w.stop() == 0, w.log()


def test_speculative_drafts_follow_the_grammar(core, tok):
    """With NGRAM speculation, a constrained row's drafted positions are masked by its grammar after
    the drafts before them: every constraint gives the tokens it gives without speculation, drafts
    are kept (a repetitive schema), and the grammar's end stops a burst of kept drafts."""
    m = str(smollm2_dir())
    spec = EngineCore(EngineConfig.build(m, dtype="float32", max_model_len=1024, max_num_seqs=8,
                                         max_total_tokens=16384, tokenizer_path=m, speculative_algorithm="NGRAM",
                                         num_speculative_tokens=4))
    listing = {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                          "ok": {"type": "boolean"}},
                                          "required": ["id", "ok"], "additionalProperties": False},
               "minItems": 6, "maxItems": 6}

    def reqs():
        return [
            request(tok, 1, chat(tok, "Describe a person as JSON."), ("json_schema", json.dumps(PERSON))),
            request(tok, 2, chat(tok, "List six items with ids 1 to 6, all ok."), ("json_schema", json.dumps(listing)),
                    max_new=160),
            request(tok, 3, chat(tok, "Give me a phone number."), ("regex", r"([0-9]{3}-){3}[0-9]{4}")),
            request(tok, 4, chat(tok, "Tell me a story."), None, max_new=24),
            request(tok, 5, chat(tok, "Describe a person as JSON."), ("json_schema", json.dumps(PERSON)),
                    temperature=0.9),
        ]

    want, want_reasons, failures, _ = run(core, reqs())
    assert failures == []
    got, got_reasons, failures, _ = run(spec, reqs())
    assert failures == [] and got == want and got_reasons == want_reasons
    json.loads(text(tok, got[2]))
    assert spec.spec_accepted_tokens > 0
    assert not spec.grammars.active and spec.scheduler.num_used_tokens == 0


def test_a_constrained_request_after_a_verified_step_that_ended_a_request_mid_draft(core, tok):
    """NGRAM: a request ends on a stop token inside a verified step (the step's output drops the
    drafts after it), then a constrained request arrives: its first mask must not replay that
    step's tokens into the matchers (the verified step advanced them itself), nor fail the engine.
    Found through the gateway: the engine died with a shape mismatch and took the worker down."""
    m = str(smollm2_dir())
    spec = EngineCore(EngineConfig.build(m, dtype="float32", max_model_len=512, max_num_seqs=8,
                                         max_total_tokens=8192, tokenizer_path=m, speculative_algorithm="NGRAM",
                                         num_speculative_tokens=4))
    repeat = [16, 28, 30, 33, 35, 37, 42, 45, 51, 60] * 8
    # The model copies the pattern: a verified step drafts 30 33 35 37 42 and keeps them, and the
    # stop token 35 ends the request at the third, so the step outputs 3 of its 5 positions.
    stopper = AddRequest(1, np.asarray(repeat, np.int32), 30, SamplingParams(temperature=0.0, stop_token_ids=[35]))
    outs, reasons, failures, _ = run(spec, [stopper])
    assert failures == [] and reasons[1] == FINISH_STOP and outs[1][-3:] == [30, 33, 35]
    last = spec._last_launched
    assert last.verify is not None and last.out.req_ids.shape[0] < last.rows.shape[0]
    constrained = [request(tok, 2, repeat, ("regex", "[a-z]{5,20}"), max_new=24)]
    want = run(core, [request(tok, 2, repeat, ("regex", "[a-z]{5,20}"), max_new=24)])
    got = run(spec, constrained)
    assert got[2] == [] and got[0] == want[0] and got[1] == want[1]
    assert re.fullmatch("[a-z]{5,20}", text(tok, got[0][2]))
    assert not spec.grammars.active and spec.scheduler.num_used_tokens == 0
