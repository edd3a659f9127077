"""Scheduling features end to end in the engine core, checked against Hugging Face transformers:
prefix hits (shared system prompt, multi-turn), forced preemption, n samples, and a long
prompt arriving during decodes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine.engine_core import EngineCore
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.sampling.params import SamplingParams
from worker_harness import hf_greedy, tiny_models

DEVICE = os.environ.get("TOKENSPEED_TEST_DEVICE", "cpu")
MODEL = "llama-gqa-tied"


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap_schedule(request, monkeypatch):
    """Every test runs with steps one after another and with overlap scheduling (launch N+1, then
    complete N), which must give the same tokens."""
    monkeypatch.setenv("TOKENSPEED_OVERLAP_SCHEDULE", "1" if request.param else "0")
    return request.param


def make_core(**overrides) -> EngineCore:
    cfg = dict(model_path=str(tiny_models()[MODEL]), dtype="float32", device=DEVICE, block_size=4,
               max_model_len=256, max_num_seqs=16, max_total_tokens=4096, chunked_prefill_size=33)
    cfg.update(overrides)
    return EngineCore(EngineConfig.build(**cfg))


def request(req_id, prompt, max_new, *, temperature=0.0, seed=0, wait_for=-1, top_k=-1):
    return AddRequest(req_id, np.asarray(prompt, dtype=np.int32), max_new,
                      SamplingParams(temperature=temperature, top_k=top_k, seed=seed), wait_for=wait_for)


def run(core: EngineCore, requests, arrive_at=None):
    """Step until every request finished (through run_steps, so overlapping when the core does).
    Returns outputs, cached tokens and per-step token owners."""
    arrive_at = arrive_at or [0] * len(requests)
    outputs = {r.req_id: [] for r in requests}
    cached = {r.req_id: 0 for r in requests}
    steps = []
    pending = sorted(zip(arrive_at, range(len(requests))), key=lambda x: x[0])
    done: set[int] = set()
    step = 0
    while pending and pending[0][0] <= step:
        core.add_request(requests[pending.pop(0)[1]])
    for out in core.run_steps():
        step += 1
        while pending and pending[0][0] <= step:
            core.add_request(requests[pending.pop(0)[1]])
        assert step < 5000
        if out is None:
            steps.append(set())
            continue
        steps.append(set(out.req_ids.tolist()))
        for rid, tok, c in zip(out.req_ids.tolist(), out.tokens.tolist(), out.cached_tokens.tolist()):
            outputs[rid].append(tok)
            cached[rid] = c
        done.update(out.finished_ids.tolist())
    return outputs, cached, steps


def random_tokens(rng, n, vocab=512):
    return rng.integers(3, vocab, size=n).tolist()


def test_shared_system_prompt_hits_the_prefix_cache_and_equals_transformers():
    core = make_core()
    model = tiny_models()[MODEL]
    rng = np.random.default_rng(1)
    system = random_tokens(rng, 41)
    prompts = [system + random_tokens(rng, 3 + i) for i in range(4)]
    # The first goes alone, the rest come after it finished: they reuse its blocks.
    first, c1, _ = run(core, [request(1, prompts[0], 8)])
    assert c1[1] == 0
    outs, cached, _ = run(core, [request(i + 2, p, 8) for i, p in enumerate(prompts[1:])])
    for i, p in enumerate(prompts[1:]):
        assert cached[i + 2] == (len(system) // 4) * 4  # every full block of the shared prefix
        assert outs[i + 2] == hf_greedy(model, p, 8)
    assert first[1] == hf_greedy(model, prompts[0], 8)
    assert core.scheduler.cache_hit_rate > 0


def test_multi_turn_conversation_reuses_every_previous_turn():
    core = make_core()
    model = tiny_models()[MODEL]
    rng = np.random.default_rng(2)
    history = random_tokens(rng, 30)
    for turn in range(4):
        out, cached, _ = run(core, [request(turn + 1, history, 6)])
        assert out[turn + 1] == hf_greedy(model, history, 6), f"turn {turn}"
        if turn:
            # Everything up to the previous answer was cached, minus its last partial block.
            assert cached[turn + 1] >= ((previous_len - 1) // 4) * 4
        previous_len = len(history) + len(out[turn + 1]) - 1  # the last token's K/V is never computed
        history = history + out[turn + 1] + random_tokens(rng, 7)


def test_no_prefix_caching_recomputes_everything():
    core = make_core(enable_prefix_caching=False)
    rng = np.random.default_rng(3)
    prompt = random_tokens(rng, 40)
    run(core, [request(1, prompt, 4)])
    _, cached, _ = run(core, [request(2, prompt, 4)])
    assert cached[2] == 0
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_forced_preemption_gives_the_same_greedy_output(caching):
    # 24 blocks of 4 tokens: six requests growing to 40 tokens each cannot all fit at once. Admission
    # admits whenever a prompt fits (no reservation for the outputs), so the pool overflows.
    core = make_core(max_total_tokens=96, enable_prefix_caching=caching, schedule_conservativeness=0.0)
    model = tiny_models()[MODEL]
    rng = np.random.default_rng(4)
    prompts = [random_tokens(rng, 10 + 3 * i) for i in range(6)]
    outs, _, _ = run(core, [request(i + 1, p, 24) for i, p in enumerate(prompts)], arrive_at=[0, 0, 1, 1, 2, 2])
    assert core.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert outs[i + 1] == hf_greedy(model, p, 24), f"request {i + 1}"
    assert core.scheduler.num_used_tokens == 0


def test_request_that_can_never_fit_is_refused():
    core = make_core(max_total_tokens=64)
    with pytest.raises(ValueError):
        core.add_request(request(1, list(range(3, 60)), 20))
    assert core.scheduler.num_waiting == 0


@pytest.mark.parametrize("caching", [True, False])
def test_n_greedy_samples_share_the_prefill_and_agree(caching):
    core = make_core(enable_prefix_caching=caching)
    model = tiny_models()[MODEL]
    rng = np.random.default_rng(5)
    prompt = random_tokens(rng, 37)
    reqs = [request(1, prompt, 8)] + [request(i, prompt, 8, wait_for=1) for i in (2, 3, 4)]
    outs, cached, steps = run(core, reqs)
    expected = hf_greedy(model, prompt, 8)
    assert all(outs[i] == expected for i in (1, 2, 3, 4))
    assert [cached[i] for i in (2, 3, 4)] == [36, 36, 36]  # the prompt's 9 full blocks, prefilled once


def test_n_seeded_samples_are_reproducible_whatever_the_batch():
    rng = np.random.default_rng(6)
    prompt = random_tokens(rng, 20)

    def sample(with_neighbours: bool):
        core = make_core()
        reqs = [request(1, prompt, 12, temperature=1.0, seed=11)]
        reqs += [request(i, prompt, 12, temperature=1.0, seed=11 + i, wait_for=1) for i in (2, 3, 4)]
        if with_neighbours:
            reqs += [request(9, random_tokens(rng, 50), 20, temperature=0.7, seed=5)]
        outs, _, _ = run(core, reqs)
        return [outs[i] for i in (1, 2, 3, 4)]

    a, b = sample(False), sample(True)
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # different seeds give different samples


def test_long_prompt_arriving_during_decodes_delays_them_by_at_most_one_step():
    core = make_core(chunked_prefill_size=16)
    rng = np.random.default_rng(7)
    decoders = [request(i, random_tokens(rng, 5), 40) for i in (1, 2, 3)]
    long_prompt = request(4, random_tokens(rng, 200), 2)
    _, _, steps = run(core, decoders + [long_prompt], arrive_at=[0, 0, 0, 6])
    # From the step each decoder produced its first token until it finished, it produced one
    # every step: the 200-token prompt was chunked around them, never stalling them.
    for rid in (1, 2, 3):
        produced = [i for i, owners in enumerate(steps) if rid in owners]
        assert produced == list(range(produced[0], produced[0] + 40))
    prefill_steps = [i for i, owners in enumerate(steps) if 4 not in owners and i >= 6]
    assert len(prefill_steps) > 5  # the long prompt really was spread over many steps


def test_a_pool_shorter_than_the_context_is_said_at_startup(caplog):
    """A KV pool that cannot hold one --max-model-len request refuses such requests one by one: the
    start says so once, with the flags that change it; a pool that can says nothing."""
    import logging

    with caplog.at_level(logging.WARNING, logger="tokenspeed_worker.engine.engine_core"):
        make_core(max_model_len=256, max_total_tokens=256)
        assert not [r for r in caplog.records if "KV pool holds" in r.getMessage()]
        make_core(max_model_len=256, max_total_tokens=100)
    (record,) = [r for r in caplog.records if "KV pool holds" in r.getMessage()]
    assert record.getMessage().startswith("the KV pool holds 100 tokens, fewer than --max-model-len 256")
    assert "--max-total-tokens" in record.getMessage() and "--gpu-memory-utilization" in record.getMessage()
