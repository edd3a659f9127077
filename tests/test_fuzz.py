"""Property-based fuzzing of every RPC of a real worker process (tiny model, loopback only).

Hypothesis builds GenerateRequest protos with random and extreme fields (and raw bytes that may
not parse at all) and checks that every call ends cleanly: a stream whose samples each end with
exactly one GenerateComplete, or a gRPC status from the allowed set with a message; never
UNKNOWN or INTERNAL. After every example the deep HealthCheck must stay healthy, and after the
whole run the engine must hold no request and no KV block.

Sizes: TOKENSPEED_FUZZ_SCALE (default 1.0) scales every max_examples; run with -s to see the
number of examples each test ran.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import time

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from tokenspeed_worker.proto import common_pb2, tokenspeed_scheduler_pb2 as pb
from worker_harness import Worker, tiny_models, wait_idle

MAX_MODEL_LEN = 128
SERVICE = "/tokenspeed.grpc.scheduler.TokenSpeedScheduler"
SCALE = float(os.environ.get("TOKENSPEED_FUZZ_SCALE", "1.0"))
CALL_TIMEOUT_S = 30.0  # per Generate (a loaded 2-core CI machine runs two test files); DEADLINE_EXCEEDED is an allowed ending
U32 = 2**32 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
NEED_MESSAGE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

COUNTS: dict[str, int] = {}


def _fuzz_settings(n: int):
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        database=None,  # no .hypothesis/ folder in the repository
        phases=(Phase.explicit, Phase.generate),  # shrinking a live-server failure costs too much time
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@pytest.fixture(scope="module")
def worker():
    w = Worker(tiny_models()["llama-gqa-tied"], "--max-model-len", str(MAX_MODEL_LEN),
               "--max-total-tokens", "2048", "--block-size", "8")
    yield w
    assert w.stop() == 0, w.log()


@pytest.fixture(scope="module")
def vocab(worker) -> int:
    return worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as p:
        yield p


# ---- strategies ---------------------------------------------------------------------------------

# Protobuf strings must be valid UTF-8: no lone surrogates.
TEXT = st.characters(blacklist_categories=("Cs",))
EMOJI = st.sampled_from(["😀", "👍🏽", "🇫🇷", "\u200d", "\x00", "\n", "é", "中文", "\ufeff", "🦀🦀"])


def text(max_size=12):
    """Unicode text with multi-code-point emoji and odd characters mixed in."""
    return st.lists(st.one_of(TEXT, EMOJI), max_size=max_size).map("".join)


REQUEST_IDS = st.one_of(
    st.just(""),
    st.sampled_from(["dup", "chatcmpl-dup", "gnt-x", "é", "😀"]),  # repeat within bursts and runs
    text(20),
    st.integers(1000, 20000).map(lambda k: "r" * k),  # very long
)

FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 1e-30, 0.5, 1.0, 1.0000001,
                     2.0, 2.0000002, 100.0, 100.1, -100.0, -100.1, 3.4e38, -3.4e38]),
    st.floats(width=32),
)
INT32 = st.one_of(st.sampled_from([I32_MIN, -2, -1, 0, 1, 2, 20, 21, 255, 256, 257, I32_MAX]),
                  st.integers(I32_MIN, I32_MAX))
UINT32 = st.one_of(st.sampled_from([0, 1, 2, 255, 256, 257, 10**6, 2**31, U32]), st.integers(0, U32))


@st.composite
def input_ids(draw, vocab, wild):
    if not wild:
        return draw(st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40),
                              st.lists(st.sampled_from([0, 1, 2, vocab - 1]), min_size=1, max_size=8),
                              st.lists(st.integers(0, vocab - 1), min_size=MAX_MODEL_LEN - 8,
                                       max_size=MAX_MODEL_LEN - 1)))  # a full context: 1..8 tokens of room
    kind = draw(st.sampled_from(["empty", "huge", "long"]))
    if kind == "empty":
        return []
    if kind == "huge":
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=10))
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from([vocab, vocab + 1, 2**31, U32])
                                                          | st.integers(vocab, U32)))
        return ids
    # at / past the context
    return draw(st.lists(st.integers(0, vocab - 1), min_size=MAX_MODEL_LEN, max_size=MAX_MODEL_LEN + 300))


def maybe(strategy):
    """None (field left unset) or a value."""
    return st.one_of(st.none(), strategy)


# Per field: values the worker must accept (edge values included), and anything at all.
VALID_FLOATS = {
    "temperature": st.one_of(st.sampled_from([0.0, 1e-45, 1e-6, 1.0, 100.0, 3.4e38]), st.floats(0, 5)),
    "top_p": st.one_of(st.sampled_from([1e-45, 1e-6, 0.5, 1.0]), st.floats(0.01, 1.0)),
    "min_p": st.one_of(st.sampled_from([0.0, 1e-45, 0.5, 1.0]), st.floats(0.0, 1.0)),
    "frequency_penalty": st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2.0, 2.0)),
    "presence_penalty": st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2.0, 2.0)),
    "repetition_penalty": st.one_of(st.sampled_from([1e-45, 1e-6, 1.0, 2.0]), st.floats(0.01, 2.0)),
}
FIELDS = ["input_ids", "request_id", "tokenized", "sampling_params", "temperature", "top_p", "min_p",
          "frequency_penalty", "presence_penalty", "repetition_penalty", "top_k", "max_new_tokens",
          "min_new_tokens", "stop", "stop_token_ids", "n", "logit_bias", "constraint", "custom_params",
          "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "extra"]


@st.composite
def sampling_params(draw, vocab, wild):
    """`wild`: the set of fields that get arbitrary (likely invalid) values; the rest stay valid."""
    sp = pb.SamplingParams()
    for name, valid in VALID_FLOATS.items():
        value = draw(maybe(FLOATS if name in wild else valid))
        if value is not None:
            setattr(sp, name, value)
    top_k = draw(maybe(INT32 if "top_k" in wild else
                       st.one_of(st.sampled_from([-1, 1, 2, vocab - 1, vocab, vocab + 1, I32_MAX]),
                                 st.integers(1, I32_MAX))))
    if top_k is not None:
        sp.top_k = top_k
    mnt = draw(maybe(UINT32 if "max_new_tokens" in wild else st.one_of(st.integers(1, 8), st.just(U32))))
    if mnt is not None:
        sp.max_new_tokens = mnt
    sp.min_new_tokens = draw(UINT32 if "min_new_tokens" in wild else st.sampled_from([0, 0, 1, 4, 1000]))
    stop = st.one_of(text(6).filter(bool), EMOJI, st.text(TEXT, min_size=50, max_size=300))
    if "stop" in wild:
        stop = st.one_of(stop, st.just(""))
    sp.stop.extend(draw(st.lists(stop, max_size=4)))
    sp.stop_token_ids.extend(draw(st.lists(
        st.one_of(st.integers(0, vocab - 1), UINT32) if "stop_token_ids" in wild else st.integers(0, vocab - 1),
        max_size=5)))
    sp.ignore_eos = draw(st.booleans())
    sp.skip_special_tokens = draw(st.booleans())
    sp.spaces_between_special_tokens = draw(st.booleans())
    sp.no_stop_trim = draw(st.booleans())
    if "n" in wild:
        sp.n = draw(st.one_of(st.sampled_from([0, 127, 128, 129, 200]), st.integers(0, 200)))
    else:
        sp.n = draw(st.one_of(st.integers(1, 3), st.integers(1, 3), st.sampled_from([16, 64, 128])))
    if "logit_bias" in wild:
        bias_key = st.one_of(st.integers(0, vocab - 1).map(str), st.integers(-(2**70), 2**70).map(str), text(8),
                             st.sampled_from(["", " 5", "5 ", "+5", "0x10", "1_0", "٣", "1e3", "nan", "-0"]))
        if draw(st.integers(0, 9)) == 0:
            for i in range(draw(st.sampled_from([1024, 1025]))):
                sp.logit_bias[str(i % vocab) + " " * (i // vocab)] = 1.0
        else:
            for key, value in draw(st.dictionaries(bias_key, FLOATS, min_size=1, max_size=5)).items():
                sp.logit_bias[key] = value
    else:
        for key, value in draw(st.dictionaries(st.integers(0, vocab - 1), st.one_of(
                st.sampled_from([-100.0, 100.0, 0.0]), st.floats(-100, 100)), max_size=5)).items():
            sp.logit_bias[str(key)] = value
    if "constraint" in wild:
        constraint = draw(st.sampled_from(["regex", "json_schema", "ebnf_grammar", "structural_tag"]))
        setattr(sp, constraint, draw(text(20)))
    if "custom_params" in wild:
        custom = Struct()
        custom.update(draw(st.dictionaries(text(5), st.one_of(st.floats(allow_nan=False), text(5), st.booleans()),
                                           max_size=3)))
        sp.custom_params.CopyFrom(custom)
    seed = draw(maybe(st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))))
    if seed is not None:
        sp.sampling_seed = seed
    return sp


@st.composite
def generate_requests(draw, vocab):
    # Half the requests are valid (with edge values); the others break 1..3 fields at random.
    wild = draw(st.one_of(st.just(frozenset()), st.frozensets(st.sampled_from(FIELDS), min_size=1, max_size=3)))
    req = pb.GenerateRequest(request_id=draw(REQUEST_IDS if "request_id" in wild else st.one_of(
        st.sampled_from(["dup", "chatcmpl-dup", "é", "😀"]),  # repeat within bursts and across examples
        text(20).filter(bool), st.integers(1000, 20000).map(lambda k: "r" * k))))
    if "tokenized" not in wild:
        req.tokenized.CopyFrom(pb.TokenizedInput(input_ids=draw(input_ids(vocab, "input_ids" in wild)),
                                                 original_text=draw(text(10))))
    if "sampling_params" not in wild:
        req.sampling_params.CopyFrom(draw(sampling_params(vocab, wild)))
    req.return_logprob = draw(st.booleans())
    lsl = draw(st.sampled_from([0, 1, I32_MAX, -2, I32_MIN] if "logprob_start_len" in wild else [None, -1]))
    if lsl is not None:
        req.logprob_start_len = lsl
    req.top_logprobs_num = draw(INT32 if "top_logprobs_num" in wild else st.sampled_from([0, 0, 1, 5, 20]))
    req.token_ids_logprob.extend(draw(
        st.one_of(st.lists(UINT32, min_size=1, max_size=4), st.lists(st.integers(0, vocab - 1), min_size=257,
                                                                     max_size=260))
        if "token_ids_logprob" in wild else st.lists(st.integers(0, vocab - 1), max_size=4)))
    req.stream = draw(st.booleans())
    if "extra" in wild:
        extra = draw(st.sampled_from(["mm", "mm_empty", "encode", "kv", "dp"]))
        if extra == "mm":
            item = req.mm_inputs.items.add(content_hash=b"\x00\xff", placeholder_token_id=1)
            item.placeholders.add(offset=0, length=1)
        elif extra == "mm_empty":
            req.mm_inputs.SetInParent()
        elif extra == "encode":
            req.encode_bootstrap_info.items.add(item_index=0, bootstrap_host="127.0.0.1", bootstrap_port=1)
        elif extra == "kv":
            req.kv_bootstrap_info.CopyFrom(pb.KvBootstrapInfo(bootstrap_host=draw(text(8)), bootstrap_port=-1,
                                                              bootstrap_room=2**63 - 1))
        else:
            req.data_parallel_rank = draw(INT32)
    elif draw(st.booleans()):
        req.data_parallel_rank = 0
    # Keep otherwise-valid requests short: many samples only with a few tokens each.
    sp = req.sampling_params
    if sp.n > 3 and (not sp.HasField("max_new_tokens") or sp.max_new_tokens > 4):
        sp.max_new_tokens = draw(st.integers(1, 4))
    return req


# ---- checks ----------------------------------------------------------------------------------


def check_status(err: grpc.RpcError, what: str) -> grpc.StatusCode:
    code = err.code()
    assert code in ALLOWED, f"{what}: status {code} {err.details()!r}"
    if code in NEED_MESSAGE:
        assert err.details(), f"{what}: {code} without a message"
    return code


def effective_n(req) -> int:
    """Samples the worker runs: proto3's 0 (n unset, or no sampling_params at all) is one."""
    return max(1, req.sampling_params.n)


def check_generate_stream(req, responses, vocab) -> None:
    """A stream that ended OK: chunks (streaming only) then exactly one complete per index."""
    n = effective_n(req)
    assert responses, "an OK stream with no message"
    assert responses[-1].HasField("complete"), f"last message is not a GenerateComplete: {responses[-1]}"
    done: set[int] = set()
    prompt_len = len(req.tokenized.input_ids)
    sp = req.sampling_params
    room = MAX_MODEL_LEN - prompt_len
    limit = min(sp.max_new_tokens, room) if sp.HasField("max_new_tokens") else room
    for r in responses:
        assert r.request_id == (req.request_id or responses[0].request_id) and r.request_id
        kind = r.WhichOneof("response")
        assert kind in ("chunk", "complete"), r
        if kind == "chunk":
            assert req.stream, "a chunk on a non-streaming call"
            index = r.chunk.index
            assert index not in done, f"a chunk for index {index} after its complete"
            assert all(t < vocab for t in r.chunk.token_ids)
            assert r.chunk.prompt_tokens == prompt_len
        else:
            c = r.complete
            assert 0 <= c.index < n, f"complete index {c.index} for n={n}"
            assert c.index not in done, f"two completes for index {c.index}"
            done.add(c.index)
            assert c.finish_reason in ("stop", "length", "abort"), c.finish_reason
            assert c.prompt_tokens == prompt_len
            assert c.completion_tokens <= limit, (c.completion_tokens, limit)
            assert len(c.output_ids) <= c.completion_tokens
            assert all(t < vocab for t in c.output_ids)
            if req.stream:
                assert not c.output_ids, "a streaming complete repeats output ids"
    assert done == set(range(n)), f"completes for {sorted(done)}, want 0..{n - 1}"


def call_generate(worker, req, vocab) -> str:
    """Run one Generate to its end and check it; returns a short outcome label."""
    try:
        responses = list(worker.stub.Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        return check_status(e, f"Generate({_describe(req)})").name
    check_generate_stream(req, responses, vocab)
    return "OK"


def _describe(req) -> str:
    text_form = str(req)
    return text_form if len(text_form) < 3000 else text_form[:3000] + "..."


def assert_healthy(worker) -> None:
    r = worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert r.healthy, r.message
    assert worker.proc.poll() is None, worker.log()




def _count(name: str, outcome: str | None = None) -> None:
    """Count an example (outcome None) or one call's outcome."""
    key = name if outcome is None else f"{name}:{outcome}"
    COUNTS[key] = COUNTS.get(key, 0) + 1


def _report(name: str, unit: str = "examples") -> None:
    outcomes = {k.split(":", 1)[1]: v for k, v in sorted(COUNTS.items()) if k.startswith(name + ":")}
    total = COUNTS.get(name, sum(outcomes.values()))
    print(f"\n[fuzz] {name}: {total} {unit}; outcomes {outcomes}")


# ---- Generate ------------------------------------------------------------------------------------


def test_fuzz_generate_bursts(worker, vocab, pool):
    """Bursts of 1..4 concurrent random requests (request ids may repeat within a burst)."""

    @_fuzz_settings(220)
    @given(burst=st.lists(generate_requests(vocab), min_size=1, max_size=4))
    def run(burst):
        _count("generate_burst")
        futures = [pool.submit(call_generate, worker, req, vocab) for req in burst]
        for f in futures:
            _count("generate", f.result())
        assert_healthy(worker)

    run()
    _report("generate_burst")
    _report("generate", "calls")
    wait_idle(worker)


@st.composite
def valid_requests(draw, vocab):
    """Requests that pass validation, to hit the cancel paths while they run."""
    n = draw(st.integers(1, 4))
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=100))
    sp = pb.SamplingParams(n=n, ignore_eos=draw(st.booleans()), temperature=draw(st.sampled_from([0.0, 0.7, 1.0])))
    if draw(st.booleans()):
        sp.max_new_tokens = draw(st.one_of(st.integers(1, 64), st.just(U32)))
    if draw(st.booleans()):
        sp.stop.extend(draw(st.lists(text(3).filter(bool), min_size=1, max_size=3)))
    return pb.GenerateRequest(request_id=f"fz-{time.monotonic_ns()}-{draw(text(6))}",
                              tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sp,
                              stream=draw(st.booleans()), return_logprob=draw(st.booleans()),
                              top_logprobs_num=draw(st.integers(0, 20)))


def test_fuzz_cancel_and_abort_mid_flight(worker, vocab, pool):
    """Valid requests cancelled (client side), aborted (Abort RPC) or cut by a short deadline."""

    def one(req, how, delay):
        call = worker.stub.Generate(req, timeout=delay if how == "deadline" else CALL_TIMEOUT_S)
        responses = []
        aborted = None
        try:
            if how == "cancel":
                time.sleep(delay)
                call.cancel()
            elif how == "abort":
                time.sleep(delay)
                aborted = worker.stub.Abort(pb.AbortRequest(request_id=req.request_id, reason="Stream dropped"),
                                            timeout=5).success
            responses = list(call)
        except grpc.RpcError as e:
            code = check_status(e, f"{how} after {delay:.3f}s of {_describe(req)}")
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                assert how == "deadline", f"{how}: a request ran past {CALL_TIMEOUT_S}s: {_describe(req)}"
            return f"{how}:{code.name}"
        check_generate_stream(req, responses, vocab)
        reasons = [r.complete.finish_reason for r in responses if r.HasField("complete")]
        if aborted:
            assert "abort" in reasons, f"Abort answered success but no sample ended with abort: {reasons}"
        else:
            assert "abort" not in reasons, f"finish_reason abort without an abort: {reasons}"
        return f"{how}:OK-abort" if aborted else f"{how}:OK"

    @_fuzz_settings(90)
    @given(burst=st.lists(st.tuples(valid_requests(vocab), st.sampled_from(["cancel", "abort", "deadline", "none"]),
                                    st.floats(0.0, 0.4)), min_size=1, max_size=6))
    def run(burst):
        _count("cancel_burst")
        futures = [pool.submit(one, *case) for case in burst]
        for f in futures:
            _count("cancel", f.result())
        assert_healthy(worker)

    run()
    _report("cancel_burst")
    _report("cancel", "calls")
    wait_idle(worker)


# ---- raw bytes -----------------------------------------------------------------------------------

RAW_UNARY = ["HealthCheck", "Abort", "GetModelInfo", "GetServerInfo", "GetLoads", "FlushCache",
             ]  # StartProfile/StopProfile left out: random bytes would start real profiles writing files
RAW_STREAM = ["Generate", "GetTokenizer", "SubscribeKvEvents"]
# A subscription that parses is a stream that never ends by itself: its client's deadline ends it
# (DEADLINE_EXCEEDED, allowed). A short one, or each such example costs the whole CALL_TIMEOUT_S.
RAW_TIMEOUT_S = {"SubscribeKvEvents": 2.0}
# What raw bytes must end with (beyond ALLOWED): a method with no request fields may well succeed.
RAW_MAY_SUCCEED = set(RAW_UNARY + RAW_STREAM)


@st.composite
def raw_payloads(draw, vocab):
    kind = draw(st.sampled_from(["bytes", "bytes", "valid", "truncated", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    valid = draw(generate_requests(vocab)).SerializeToString()
    if kind == "valid":
        return valid
    if kind == "truncated":
        return valid[: draw(st.integers(0, max(0, len(valid) - 1)))]
    data = bytearray(valid or b"\x00")
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


REQUEST_TYPES = {
    "Generate": pb.GenerateRequest, "HealthCheck": pb.HealthCheckRequest, "Abort": pb.AbortRequest,
    "GetModelInfo": pb.GetModelInfoRequest, "GetServerInfo": pb.GetServerInfoRequest,
    "GetLoads": pb.GetLoadsRequest, "FlushCache": common_pb2.FlushCacheRequest,
    "StartProfile": common_pb2.StartProfileRequest, "StopProfile": common_pb2.StopProfileRequest,
    "GetTokenizer": common_pb2.GetTokenizerRequest, "SubscribeKvEvents": common_pb2.SubscribeKvEventsRequest,
}


def parses(method: str, payload: bytes) -> bool:
    try:
        REQUEST_TYPES[method].FromString(payload)
        return True
    except Exception:  # noqa: BLE001  (DecodeError, or a field that is not valid UTF-8)
        return False


def raw_call(worker, method: str, payload: bytes) -> str:
    path = f"{SERVICE}/{method}"
    ident = lambda b: b  # noqa: E731
    try:
        if method in RAW_STREAM:
            list(worker.channel.unary_stream(path, request_serializer=ident, response_deserializer=ident)(
                payload, timeout=RAW_TIMEOUT_S.get(method, CALL_TIMEOUT_S)))
        else:
            worker.channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)(
                payload, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        code = e.code()
        if method in ("StartProfile", "StopProfile", "SubscribeKvEvents") and code == grpc.StatusCode.UNIMPLEMENTED:
            return code.name
        return check_status(e, f"raw {method}({payload!r:.300})").name
    return "OK"


RAW_METHODS = st.sampled_from(RAW_STREAM[:1] * 4 + RAW_UNARY + RAW_STREAM)


def test_fuzz_raw_bytes_that_parse(worker, vocab):
    """Bytes (random, mutated, truncated or valid) that do parse as the method's request type."""

    @_fuzz_settings(250)
    @given(method=RAW_METHODS, payload=raw_payloads(vocab))
    def run(method, payload):
        if not parses(method, payload):
            _count("raw_unparseable_skipped")
            return
        _count("raw")
        _count("raw", f"{method}:{raw_call(worker, method, payload)}")
        assert_healthy(worker)

    run()
    _report("raw")
    print(f"[fuzz] raw: {COUNTS.get('raw_unparseable_skipped', 0)} unparseable payloads left to the next test")
    wait_idle(worker)


def test_fuzz_raw_bytes_that_do_not_parse(worker, vocab):
    """Bytes that are not a valid encoding of the method's request type: INVALID_ARGUMENT (or another
    allowed status), never UNKNOWN/INTERNAL; the worker stays healthy."""

    @_fuzz_settings(40)
    @example(method="Generate", payload=b"\xd0\x04")
    @given(method=RAW_METHODS, payload=raw_payloads(vocab))
    def run(method, payload):
        if parses(method, payload):
            return
        _count("raw_bad")
        try:
            _count("raw_bad", f"{method}:{raw_call(worker, method, payload)}")
        finally:
            assert_healthy(worker)

    try:
        run()
    finally:
        _report("raw_bad")


# ---- the other RPCs ------------------------------------------------------------------------------

SECTIONS = st.one_of(st.sampled_from(["core", "memory", "queues", "disagg", "all", "ALL", "Core", "", " core"]),
                     text(8))


@st.composite
def other_calls(draw):
    which = draw(st.sampled_from(["Abort", "GetLoads", "FlushCache", "GetModelInfo", "GetServerInfo",
                                  "GetTokenizer", "HealthCheck"]))
    if which == "Abort":
        return which, pb.AbortRequest(request_id=draw(REQUEST_IDS), reason=draw(text(30)))
    if which == "GetLoads":
        req = pb.GetLoadsRequest(include=draw(st.lists(SECTIONS, max_size=4)))
        dp = draw(maybe(st.one_of(st.sampled_from([0, 0, 1, -1]), INT32)))
        if dp is not None:
            req.dp_rank = dp
        return which, req
    if which == "FlushCache":
        return which, common_pb2.FlushCacheRequest(timeout_s=draw(st.one_of(
            st.sampled_from([0.0, -1.0, 0.001, 1.0, math.nan, math.inf, -math.inf, 3.4e38]),
            st.floats(width=32))))
    if which == "GetModelInfo":
        return which, pb.GetModelInfoRequest()
    if which == "GetServerInfo":
        return which, pb.GetServerInfoRequest()
    if which == "GetTokenizer":
        return which, common_pb2.GetTokenizerRequest()
    return which, pb.HealthCheckRequest()


def test_fuzz_other_rpcs(worker, vocab):
    stub = worker.stub

    @_fuzz_settings(300)
    @given(call=other_calls())
    def run(call):
        which, req = call
        _count("other")
        try:
            if which == "GetTokenizer":
                chunks = list(stub.GetTokenizer(req, timeout=15))
                assert chunks and chunks[-1].sha256
            else:
                r = getattr(stub, which)(req, timeout=15)
                if which == "Abort":
                    assert not r.success and r.message  # nothing of these ids runs here
                elif which == "GetLoads":
                    sections = {s.lower() for s in req.include}
                    assert sections <= {"core", "memory", "queues", "disagg", "all"}, f"accepted {req.include}"
                    assert not req.HasField("dp_rank") or req.dp_rank == 0
                    assert r.dp_rank_count == 1 and len(r.loads) == 1
                elif which == "FlushCache":
                    assert r.success, r.message
                elif which == "GetModelInfo":
                    assert r.vocab_size == vocab
                elif which == "HealthCheck":
                    assert r.healthy, r.message
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = check_status(e, f"{which}({req})").name
        _count("other", f"{which}:{outcome}")
        assert_healthy(worker)

    run()
    _report("other")


def test_idle_and_healthy_after_everything(worker, capsys):
    """Runs last in this module: every request of the fuzzing above is gone and every KV block free."""
    load = wait_idle(worker, timeout=10.0)
    assert load.num_total_reqs == 0
    assert_healthy(worker)
    info = worker.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.active_requests == 0, info.active_requests
    total = sum(v for k, v in COUNTS.items() if ":" not in k and k not in ("generate_burst", "cancel_burst"))
    total += sum(v for k, v in COUNTS.items() if k.startswith(("generate:", "cancel:")))
    with capsys.disabled():
        print(f"\n[fuzz] fuzzed calls in all: {total}; {dict(sorted(COUNTS.items()))}")
