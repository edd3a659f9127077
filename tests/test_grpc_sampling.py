"""The sampling and output surface over gRPC against a real worker on a tiny model:
penalties, logit_bias, min_new_tokens, logprobs against transformers, stop strings,
--stream-interval, sampling defaults from generation_config.json, and invalid values."""

from __future__ import annotations

import json
import shutil
import time

import grpc
import numpy as np
import pytest
import torch

from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import CACHE, Worker, hf_greedy, tiny_models

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 300]
INTERVAL = 3


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models()["llama-gqa-tied"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def worker(model_dir, request):
    # Also with overlap scheduling (the GPU default) forced on: stop strings, logprobs, penalties
    # and min_new_tokens must not change when step N+1 is launched before step N completes.
    w = Worker(model_dir, "--max-model-len", "256", "--max-total-tokens", "4096", "--stream-interval", str(INTERVAL),
               "--sampling-backend", "torch", env={"TOKENSPEED_OVERLAP_SCHEDULE": "1" if request.param else "0"})
    yield w
    assert w.stop() == 0, w.log()


def gen(prompt=PROMPT, *, max_new_tokens=8, stream=False, logprobs=False, top=0, ids=(), **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    sampling.setdefault("n", 1)
    return pb.GenerateRequest(
        request_id=f"s-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling), stream=stream,
        return_logprob=logprobs, top_logprobs_num=top, token_ids_logprob=list(ids))


def complete(worker, request):
    out = list(worker.stub.Generate(request, timeout=60))
    return out[-1].complete, out


def hf_log_softmax(model_dir, ids):
    """transformers' log_softmax of the logits predicting each of ids[1:]."""
    from worker_harness import _HF_CACHE

    hf_greedy(model_dir, ids[:2], 1)  # loads and caches the model
    model = _HF_CACHE[str(model_dir)]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_match_transformers(worker, model_dir):
    c, _ = complete(worker, gen(max_new_tokens=6, logprobs=True, top=4, ids=(5, 6)))
    out = list(c.output_ids)
    lp = c.output_logprobs
    assert list(lp.token_ids) == out and len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6
    ref = hf_log_softmax(model_dir, PROMPT + out)
    for i, token in enumerate(out):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
        top_values, top_ids = row.topk(4)
        entry = lp.top_logprobs[i]
        assert list(entry.token_ids[:4]) == top_ids.tolist()
        assert np.allclose(entry.values[:4], top_values.numpy(), atol=1e-4)
        # The requested ids come after the top-k (those not already in it).
        for value, token_id in zip(entry.values[4:], entry.token_ids[4:]):
            assert token_id in (5, 6) and value == pytest.approx(row[token_id].item(), abs=1e-4)
        assert {5, 6} <= set(entry.token_ids)


def test_streamed_logprobs_align_with_chunks(worker):
    _, out = complete(worker, gen(max_new_tokens=7, stream=True, logprobs=True, top=2))
    for r in out[:-1]:
        assert list(r.chunk.output_logprobs.token_ids) == list(r.chunk.token_ids)
        assert len(r.chunk.output_logprobs.top_logprobs) == len(r.chunk.token_ids)


def test_stream_interval_batches_tokens_and_never_delays_the_first_or_the_last(worker):
    _, out = complete(worker, gen(max_new_tokens=8, stream=True))
    sizes = [len(r.chunk.token_ids) for r in out[:-1]]
    # The first token goes out at once (time to first token is not held for INTERVAL tokens, as in
    # SGLang and vLLM); then never fewer than INTERVAL tokens in a chunk but the last (a handler
    # that wakes late sends what piled up as one chunk); the final tokens go out with the finish.
    assert sum(sizes) == 8 and all(s >= INTERVAL for s in sizes[1:-1]) and sizes[-1] >= 1
    assert len(sizes) <= 1 + -(-7 // INTERVAL)
    assert out[-1].HasField("complete")


def test_logit_bias_forces_a_token(worker):
    c, _ = complete(worker, gen(max_new_tokens=5, logit_bias={"123": 100.0}))
    assert list(c.output_ids) == [123] * 5


def test_penalties_change_greedy_output_and_stay_deterministic(worker, model_dir):
    plain = list(complete(worker, gen(max_new_tokens=12))[0].output_ids)
    assert plain == hf_greedy(model_dir, PROMPT, 12)
    for field, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 2.0)):
        a = list(complete(worker, gen(max_new_tokens=12, **{field: value}))[0].output_ids)
        b = list(complete(worker, gen(max_new_tokens=12, **{field: value}))[0].output_ids)
        assert a == b


def test_repetition_penalty_equals_transformers(worker, model_dir):
    from transformers import AutoModelForCausalLM

    c, _ = complete(worker, gen(max_new_tokens=10, repetition_penalty=1.8))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, repetition_penalty=1.8,
                             pad_token_id=0, eos_token_id=None)
    assert list(c.output_ids) == ref[0, len(PROMPT):].tolist()


def test_min_new_tokens_holds_back_the_stop_token(worker, model_dir):
    greedy = hf_greedy(model_dir, PROMPT, 8)
    stop = greedy[0]
    early, _ = complete(worker, gen(max_new_tokens=8, stop_token_ids=[stop]))
    assert early.finish_reason == "stop" and early.completion_tokens == 1
    held, _ = complete(worker, gen(max_new_tokens=8, stop_token_ids=[stop], min_new_tokens=4))
    assert held.completion_tokens >= 4
    assert stop not in list(held.output_ids)[:3]


def test_stop_string_spanning_tokens(worker, model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    seeded = dict(temperature=1.0, sampling_seed=3, max_new_tokens=24)  # varied text, reproducible
    free = list(complete(worker, gen(**seeded))[0].output_ids)
    text = tok.decode(free)
    # A stop string that starts inside the output, spans at least two tokens, and first occurs there.
    pieces = [tok.decode(free[:k]) for k in range(len(free) + 1)]
    candidates = []
    for k in range(2, len(free) - 3):
        start = len(pieces[k]) - 1
        stop = text[start:len(pieces[k + 2])]
        if start > 0 and len(stop) >= 3 and text.find(stop) == start:
            candidates.append((start, stop))
    assert candidates, text
    start, stop = candidates[0]
    for stream in (False, True):
        c, out = complete(worker, gen(stop=[stop], stream=stream, **seeded))
        ids = list(c.output_ids) if not stream else [t for r in out[:-1] for t in r.chunk.token_ids]
        assert c.finish_reason == "stop" and c.matched_stop_str == stop
        kept = tok.decode(ids)
        assert stop not in kept and text.startswith(kept)
        # Ends where the stop string starts: the token straddling its start is kept.
        assert start <= len(kept) < start + len(stop)
    kept_all, _ = complete(worker, gen(stop=[stop], no_stop_trim=True, **seeded))
    assert tok.decode(list(kept_all.output_ids)).endswith(stop) or stop in tok.decode(list(kept_all.output_ids))
    # min_new_tokens past the stop's completing token: the stop string is not matched there (vLLM's
    # rule); the output runs on to the length limit, as the stop never occurs again in this text.
    completing = next(j for j in range(len(free)) if len(pieces[j + 1]) >= start + len(stop))
    later, _ = complete(worker, gen(stop=[stop], min_new_tokens=completing + 2, **seeded))
    assert list(later.output_ids)[:completing + 2] == free[:completing + 2]
    if text.find(stop, start + 1) < 0:
        assert later.finish_reason == "length" and list(later.output_ids) == free


INVALID = [
    ("frequency_penalty", dict(frequency_penalty=3.0)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("logit_bias", dict(logit_bias={"100000": 1.0})),
    ("logit_bias", dict(logit_bias={"abc": 1.0})),
    ("logit_bias", dict(logit_bias={" 1": 1.0})),
    ("logit_bias", dict(logit_bias={"1_0": 1.0})),
    ("logit_bias", dict(logit_bias={"\u0661": 1.0})),  # ARABIC-INDIC DIGIT ONE
    ("sampling_params.n", dict(n=129)),
    ("stop", dict(stop=[""])),
    ("sampling_params.min_new_tokens: must be at most max_new_tokens (5), got 10",
     dict(max_new_tokens=5, min_new_tokens=10)),  # as vLLM and SGLang refuse it
]


@pytest.mark.parametrize("field_name,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_values_name_the_field(worker, field_name, kwargs):
    with pytest.raises(grpc.RpcError) as e:
        complete(worker, gen(**kwargs))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_name in e.value.details()


def test_invalid_logprob_options(worker):
    for request, field_name in ((gen(top=50), "top_logprobs_num"), (gen(ids=(10**6,)), "token_ids_logprob")):
        with pytest.raises(grpc.RpcError) as e:
            complete(worker, request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_name in e.value.details()


def test_constraints_apply_with_the_tiny_models_tokenizer(worker, model_dir):
    # Structured output (engine/grammar.py; tests/test_structured_output.py has the full set). A
    # grammar that completes ends the request with "stop" even under ignore_eos.
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    c, _ = complete(worker, gen(regex="(ab)+", max_new_tokens=8))
    assert c.finish_reason == "length" and tok.decode(c.output_ids) == "abababab"
    c, _ = complete(worker, gen(ebnf_grammar='root ::= "a" "b"', max_new_tokens=8))
    assert c.finish_reason == "stop" and tok.decode(c.output_ids, skip_special_tokens=True) == "ab"
    with pytest.raises(grpc.RpcError) as e:
        complete(worker, gen(structural_tag="{}"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.structural_tag" in e.value.details()


def test_default_sampling_params_come_from_generation_config(model_dir):
    folder = CACHE / "tiny_with_defaults"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(model_dir, folder)
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    gen_cfg.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    w = Worker(folder, "--max-model-len", "128", "--max-total-tokens", "1024")
    try:
        info = w.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert json.loads(info.default_sampling_params_json) == {
            "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    finally:
        assert w.stop() == 0
