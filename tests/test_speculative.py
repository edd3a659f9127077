"""Speculative decoding (NGRAM): the n-gram drafter, the scheduler's drafts and verified steps, and
the engine's output, which must equal decoding without speculation token for token (greedy and
seeded sampling), under concurrency, chunked prefill, prefix hits, preemption, stops, aborts,
logprobs and n > 1, with every KV block back in the pool at the end."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenspeed_worker.config import EngineConfig, SpeculativeConfig
from tokenspeed_worker.engine.engine_core import EngineCore
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.scheduler.scheduler import Scheduler, ngram_draft
from test_scheduler_core import check_ownership
from worker_harness import Worker, tiny_models

DEVICE = os.environ.get("TOKENSPEED_TEST_DEVICE", "cpu")


# -- the drafter ---------------------------------------------------------------------------------


def draft(tokens, k=4, lo=1, hi=12):
    return ngram_draft(np.asarray(tokens), lo, hi, k).tolist()


def test_ngram_proposes_what_followed_the_longest_then_latest_match():
    # Suffix [2, 3] occurred twice; [1, 2, 3] once (at the start): the longest wins.
    assert draft([1, 2, 3, 9, 8, 5, 2, 3, 7, 1, 2, 3]) == [9, 8, 5, 2]
    # Two occurrences of the same length: the latest.
    assert draft([5, 1, 6, 0, 5, 2, 6, 0, 5], k=2, hi=1) == [2, 6]
    # Nothing matches, or less than min_match does.
    assert draft([1, 2, 3, 4]) == []
    assert draft([1, 2, 9, 2], lo=2) == []
    assert draft([1]) == [] and draft([1, 1], k=0) == []


def test_ngram_continues_a_repeating_pattern():
    assert draft([7, 7, 7], k=5) == [7, 7, 7, 7, 7]
    assert draft([4, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]


# -- the scheduler with a fake model -------------------------------------------------------------

VOCAB = 12


def fake_next(history: np.ndarray) -> int:
    """A deterministic 'model' of the whole history that often repeats itself (so n-gram drafts are
    often right, and sometimes wrong)."""
    h = int((history * (np.arange(history.shape[0]) * 7 + 3)).sum())
    if h % 5 and history.shape[0] >= 3:
        return int(history[-3])
    return h % VOCAB


def requests_for(seed: int, n: int = 16):
    rng = np.random.default_rng(seed)
    out = []
    for req_id in range(n):
        prompt_ids = rng.integers(0, VOCAB, rng.integers(1, 30))
        out.append((req_id, prompt_ids, int(rng.integers(1, 40)), [int(rng.integers(0, VOCAB))]))
    return out


def run_fake(sched: Scheduler, requests, speculative: bool, abort_at: dict[int, int] | None = None):
    """Every step through a simulated KV pool read back by the plan's slots (a wrong slot, block or
    draft position changes the outputs); verified steps keep drafts while the model agrees."""
    bs = sched.block_size
    kv = np.full(sched.num_total_blocks * bs, -1, dtype=np.int64)
    outputs = {r[0]: [] for r in requests}
    reasons: dict[int, int] = {}
    for req in requests:
        sched.add_request(*req, speculates=speculative)
    live = {r[0] for r in requests}
    steps = drafted = 0
    while sched.has_work():
        plan = sched.schedule()
        kv[plan.slot_mapping] = plan.input_ids
        cu = plan.cu_query_lens
        tokens, counts = [], []
        for b in plan.sample_rows:
            d = int(plan.draft_lens[b])
            drafted += d
            kept = []
            for j in range(d + 1):
                pos = np.arange(plan.seq_lens[b] - d + j)
                history = kv[plan.block_tables[b][pos // bs].astype(np.int64) * bs + pos % bs]
                assert (history >= 0).all()
                kept.append(fake_next(history))
                if j == d or kept[-1] != plan.input_ids[cu[b + 1] - d + j]:
                    break
            tokens += kept
            counts.append(len(kept))
        if plan.has_drafts:
            sched.commit()
            done, why, _, used = sched.resolve_verified(np.asarray(tokens, np.int64), np.asarray(counts, np.int32))
        else:
            done, why = sched.advance(np.asarray(tokens, np.int64))
            used = counts
        at = 0
        for b, c, u in zip(plan.sample_rows, counts, used):
            outputs[int(plan.req_ids[b])] += tokens[at:at + int(u)]
            at += c
        reasons.update(zip(done.tolist(), why.tolist()))
        live -= set(done.tolist())
        for req_id in [r for r, s in (abort_at or {}).items() if s == steps and r in live]:
            sched.abort(req_id)
            live.discard(req_id)
            reasons[req_id] = -1
        check_ownership(sched, live)
        steps += 1
        assert steps < 5000
    return outputs, reasons, steps, drafted


def make_sched(num_blocks=40, speculative=True, **kw) -> Scheduler:
    return Scheduler(num_blocks, 4, 8, 1024, kw.pop("token_budget", 16), enable_prefix_caching=True,
                     num_speculative_tokens=3 if speculative else 0, ngram_max_match=4 if speculative else 0, **kw)


@pytest.mark.parametrize("seed", range(8))
def test_verified_steps_give_the_tokens_of_plain_decoding(seed):
    requests = requests_for(seed)
    reference, ref_reasons, ref_steps, _ = run_fake(make_sched(10_000, speculative=False, token_budget=4096),
                                                    requests, False)
    # A small pool (preemption, drafts dropped for room), chunked prefill and prefix caching.
    got, reasons, steps, drafted = run_fake(make_sched(), requests, True)
    assert got == reference and reasons == ref_reasons
    assert drafted > 0


def test_aborts_and_finishes_return_every_block():
    requests = requests_for(3, 12)
    sched = make_sched()
    _, reasons, _, _ = run_fake(sched, requests, True, abort_at={1: 2, 4: 5, 7: 9})
    assert sched.num_free_blocks == sched.num_total_blocks
    assert sum(1 for r in reasons.values() if r == -1) >= 1


@pytest.mark.parametrize("seed", range(6))
def test_random_aborts_under_speculation_leak_nothing(seed):
    """Many speculating requests, a third aborted at random steps (mid-prefill, mid-verify): the
    others' tokens are those of plain decoding, ownership stays sound every step, and the pool is
    whole at the end."""
    rng = np.random.default_rng(100 + seed)
    requests = requests_for(100 + seed, 30)
    reference, _, _, _ = run_fake(make_sched(10_000, speculative=False, token_budget=4096), requests, False)
    abort_at = {int(r): int(rng.integers(0, 40)) for r in rng.choice(30, 10, replace=False)}
    sched = make_sched(num_blocks=60)
    got, reasons, _, drafted = run_fake(sched, requests, True, abort_at=abort_at)
    assert drafted > 0
    for req_id, tokens in got.items():
        if reasons.get(req_id) != -1:
            assert tokens == reference[req_id]
        else:
            assert tokens == reference[req_id][: len(tokens)]
    assert sched.num_free_blocks == sched.num_total_blocks and not sched.has_work()


def test_resolve_verified_refuses_counts_outside_the_draft():
    sched = make_sched()
    sched.add_request(0, np.array([1, 2, 1, 2, 1, 2]), 10, [], speculates=True)
    plan = sched.schedule()
    sched.advance(np.array([1]))  # the prefill's token: [.., 2, 1] now has a draft
    plan = sched.schedule()
    assert plan.has_drafts and plan.draft_lens.tolist() == [3]
    sched.commit()
    with pytest.raises(ValueError, match="outside"):
        sched.resolve_verified(np.array([2] * 5), np.array([5]))
    with pytest.raises(ValueError, match="add up"):
        sched.resolve_verified(np.array([2] * 3), np.array([2]))


def test_drafts_never_pass_max_new_tokens():
    sched = make_sched()
    sched.add_request(0, np.array([3, 3, 3, 3]), 3, [], speculates=True)
    sched.schedule()
    sched.advance(np.array([3]))
    plan = sched.schedule()
    assert plan.draft_lens.tolist() == [1]  # 1 output so far; the verify may make 2 more
    sched.commit()
    done, why, _, used = sched.resolve_verified(np.array([3, 3]), np.array([2]))
    assert done.tolist() == [0] and used.tolist() == [2]


def test_a_large_batch_drafts_for_none():
    sched = make_sched(max_speculative_batch=1)
    for req_id in (0, 1):
        sched.add_request(req_id, np.array([3, 3, 3, 3]), 9, [], speculates=True)
    sched.schedule()
    sched.advance(np.array([3, 3]))
    assert sched.schedule().draft_lens.tolist() == [0, 0]
    assert sched.num_undrafted_batches == 1
    sched.advance(np.array([3, 3]))
    sched.abort(1)
    assert sched.schedule().draft_lens.tolist() == [3]
    assert sched.num_undrafted_batches == 1


def test_rejected_drafts_back_off():
    sched = make_sched()
    sched.add_request(0, np.array([3, 3, 3, 3]), 100, [], speculates=True)
    sched.schedule()
    sched.advance(np.array([3]))
    drafted = []
    for _ in range(20):  # the model never agrees: it samples 4 after each 3 drafted
        plan = sched.schedule()
        drafted.append(int(plan.draft_lens[0]))
        if plan.has_drafts:
            sched.commit()
            sched.resolve_verified(np.array([5]), np.array([1]))
        else:
            sched.advance(np.array([3]))
    # Drafts, then skips of 1, 3, 7, 15 steps (a 5 breaks the pattern until 3s repeat again).
    assert [i for i, d in enumerate(drafted) if d] == [0, 2, 6, 14]
    assert sched.num_backoff_steps == 1 + 3 + 7 + 5  # the last skip cut by the 20 steps


def test_may_draft_says_whether_the_next_step_can_draft():
    """False while the decoding batch is too large or every request backs off, so the engine can
    overlap those steps; a pending step's rows get no draft, but their back-off still counts down."""
    sched = make_sched(max_speculative_batch=1)
    assert not sched.may_draft()  # nothing decodes
    for req_id in (0, 1):
        sched.add_request(req_id, np.array([3, 3, 3, 3]), 100, [], speculates=True)
    sched.schedule()
    sched.advance(np.array([3, 3]))
    assert not sched.may_draft()  # two decode, one may speculate
    sched.abort(1)
    assert sched.may_draft()
    plan = sched.schedule()
    assert plan.has_drafts
    sched.commit()
    sched.resolve_verified(np.array([5]), np.array([1]))  # nothing kept: skip 1 step
    assert not sched.may_draft()
    sched.schedule()  # skips (the back-off's one step), then overlapped: its token is pending
    sched.commit()
    assert sched.may_draft()
    assert not sched.schedule().has_drafts  # its last token is not known yet
    sched.commit()
    sched.resolve(np.array([3]))
    sched.resolve(np.array([3]))
    assert sched.schedule().has_drafts


def test_a_request_without_speculation_gets_no_draft():
    sched = make_sched()
    sched.add_request(0, np.array([3, 3, 3, 3]), 9, [], speculates=False)
    sched.schedule()
    sched.advance(np.array([3]))
    assert sched.schedule().draft_lens.tolist() == [0]


# -- the engine, on a tiny Llama ----------------------------------------------------------------

MODEL = "llama-gqa-tied"


@pytest.fixture(autouse=True)
def no_overlap_env(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_OVERLAP_SCHEDULE", raising=False)


def make_core(speculative: bool, **overrides) -> EngineCore:
    cfg = dict(model_path=str(tiny_models()[MODEL]), dtype="float32", device=DEVICE, block_size=4,
               max_model_len=256, max_num_seqs=16, max_total_tokens=4096, chunked_prefill_size=33)
    if speculative:
        cfg.update(speculative_algorithm="NGRAM", num_speculative_tokens=4)
    cfg.update(overrides)
    return EngineCore(EngineConfig.build(**cfg))


def request(req_id, prompt, max_new, **params):
    wait_for = params.pop("wait_for", -1)
    return AddRequest(req_id, np.asarray(prompt, dtype=np.int32), max_new, SamplingParams(**params),
                      wait_for=wait_for)


def run(core: EngineCore, requests, abort: dict[int, int] | None = None):
    """Outputs (tokens and logprobs) per request, the finish reasons, the per-request draft counts."""
    outputs = {r.req_id: [] for r in requests}
    logprobs = {r.req_id: [] for r in requests}
    reasons, spec = {}, {}
    for r in requests:
        core.add_request(r)
    for step, out in enumerate(core.run_steps()):
        for req_id, at in (abort or {}).items():
            if at == step:
                core.abort(req_id)
                reasons[req_id] = "abort"
        if out is None:
            continue
        for i, (rid, tok) in enumerate(zip(out.req_ids.tolist(), out.tokens.tolist())):
            outputs[rid].append(tok)
            if out.logprobs is not None:
                logprobs[rid].append(float(out.logprobs[i]))
        reasons.update(zip(out.finished_ids.tolist(), out.finish_reasons.tolist()))
        if out.spec_ids is not None:
            for rid, d, a in zip(out.spec_ids.tolist(), out.spec_draft_tokens.tolist(),
                                 out.spec_accepted_tokens.tolist()):
                assert 0 <= a <= d
                spec[rid] = (spec.get(rid, (0, 0))[0] + d, spec.get(rid, (0, 0))[1] + a)
    return outputs, logprobs, reasons, spec


def mixed_requests():
    rng = np.random.default_rng(5)
    system = rng.integers(3, 500, 40).tolist()
    reqs = []
    for i in range(8):
        prompt = (system if i % 2 else []) + rng.integers(3, 500, 5 + 9 * i).tolist()
        params = {}
        if i % 4 == 1:
            params = dict(temperature=0.9, top_p=0.95, seed=100 + i)
        if i % 4 == 2:
            params = dict(temperature=0.7, top_k=20, seed=7, return_logprob=True, top_logprobs_num=2)
        if i == 3:
            params = dict(min_new_tokens=10, stop_token_ids=[int(prompt[-1])])
        if i == 5:  # each drafted position counts the drafts before it
            params = dict(frequency_penalty=0.5, presence_penalty=0.3)
        if i == 7:
            params = dict(repetition_penalty=1.3, temperature=0.8, seed=3)
        reqs.append(request(i, prompt, 30 + 5 * i, **params))
    return reqs


def test_engine_output_equals_decoding_without_speculation():
    reference = run(make_core(False), mixed_requests())
    core = make_core(True)
    got = run(core, mixed_requests())
    assert got[0] == reference[0]
    for rid in (2, 6):  # the requests that asked for logprobs: every kept token's (another batch shape)
        assert len(got[1][rid]) == len(reference[0][rid])
        np.testing.assert_allclose(got[1][rid], reference[1][rid], atol=2e-4)
    assert got[2] == reference[2]
    spec = got[3]
    assert spec.get(5, (0, 0))[0] > 0, "the penalized request got no drafts"
    assert sum(a for _, a in spec.values()) > 0, "no draft was ever kept"
    assert core.spec_accepted_tokens == sum(a for _, a in spec.values())
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks
    loads = core.loads()
    assert loads.spec_accept_rate == core.spec_accepted_tokens / core.spec_draft_tokens
    assert loads.spec_accept_length > 1.0


@pytest.mark.parametrize("max_batch", [3, 32])
def test_overlapped_steps_between_verified_ones_give_the_same_tokens(max_batch):
    """Overlap scheduling on: the steps that cannot draft (more than max_batch decoding, every
    request backing off) launch before the pending one completes, those that may draft wait for
    it; the output is that of plain decoding, and every block comes back."""
    reference = run(make_core(False), mixed_requests())
    core = make_core(True, overlap_schedule=True, max_speculative_batch=max_batch)
    assert core.overlap_schedule
    overlapped = []
    launch = core.launch

    def spy():
        overlapped.append(core.scheduler.num_unresolved > 0)
        return launch()

    core.launch = spy
    got = run(core, mixed_requests())
    assert got[0] == reference[0] and got[2] == reference[2]
    for rid in (2, 6):
        np.testing.assert_allclose(got[1][rid], reference[1][rid], atol=2e-4)
    assert any(overlapped) and core.spec_accepted_tokens > 0
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks


def test_engine_under_preemption_prefix_hits_and_aborts():
    # A pool of 48 blocks of 4 for 8 requests of up to ~110 tokens: preemption by recompute.
    reference = run(make_core(False, max_total_tokens=192, schedule_conservativeness=0.0), mixed_requests())
    core = make_core(True, max_total_tokens=192, schedule_conservativeness=0.0)
    got = run(core, mixed_requests())
    assert got[0] == reference[0] and got[2] == reference[2]
    assert core.scheduler.num_preemptions > 0
    core = make_core(True, max_total_tokens=192, schedule_conservativeness=0.0)
    outputs, _, reasons, _ = run(core, mixed_requests(), abort={2: 3, 6: 8})
    assert reasons[2] == reasons[6] == "abort"
    for rid in (0, 1, 3):
        assert outputs[rid] == reference[0][rid]
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks
    assert core.num_requests == 0


def test_n_samples_share_the_prompt_and_speculate_each():
    def reqs():
        prompt = list(range(10, 40))
        return [request(0, prompt, 40, temperature=1.0, seed=3),
                request(1, prompt, 40, temperature=1.0, seed=4, wait_for=0),
                request(2, prompt, 40, temperature=0.0, wait_for=0)]
    reference = run(make_core(False), reqs())
    got = run(make_core(True), reqs())
    assert got[0] == reference[0] and got[2] == reference[2]


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="MTP"):
        SpeculativeConfig(speculative_algorithm="MTP")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(speculative_algorithm="NGRAM", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="window"):
        SpeculativeConfig(speculative_algorithm="NGRAM", ngram_min_match=5, ngram_max_match=3)


# -- through the real CLI and gRPC --------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    """The same tiny model served plainly and with `--speculative-algorithm NGRAM`."""
    from test_metrics import free_port

    model = tiny_models()[MODEL]
    flags = ("--max-model-len", "256", "--max-total-tokens", "4096", "--sampling-backend", "torch")
    port = free_port()
    spec = Worker(model, *flags, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
                  "--enable-metrics", "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                  "--enable-log-request-stats")
    spec.metrics_url = f"http://127.0.0.1:{port}/metrics"
    plain = Worker(model, *flags)
    yield spec, plain
    assert spec.stop() == 0, spec.log()
    assert plain.stop() == 0, plain.log()


def grpc_request(prompt, rid, stream=False, max_new_tokens=None, **sampling):
    from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb

    sp = pb.SamplingParams(**sampling)  # n left unset, as a raw client does (proto3's 0)
    if max_new_tokens is not None:
        sp.max_new_tokens = max_new_tokens
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sp,
                              stream=stream, return_logprob=True)


def outputs_of(worker, request):
    ids, logprobs, completes = {}, {}, []
    for r in worker.stub.Generate(request, timeout=120):
        which = r.chunk if r.HasField("chunk") else r.complete
        ids.setdefault(which.index, []).extend(which.output_ids if r.HasField("complete") else which.token_ids)
        logprobs.setdefault(which.index, []).extend(which.output_logprobs.token_logprobs)
        if r.HasField("complete"):
            completes.append(r.complete)
    return ids, logprobs, completes


def test_grpc_outputs_equal_the_plain_worker_and_report_drafts(workers):
    import concurrent.futures

    from test_metrics import scrape

    spec, plain = workers
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 500, 24).tolist()
    cases = [dict(temperature=0.0), dict(stream=True, temperature=0.0), dict(temperature=0.8, sampling_seed=11, n=2, max_new_tokens=60),
             dict(stream=True, temperature=1.0, top_k=30, sampling_seed=5, max_new_tokens=40),
             dict(temperature=0.0, max_new_tokens=1)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # concurrent, as a gateway sends them
        got = list(pool.map(lambda c: outputs_of(spec, grpc_request(prompt, f"spec-{id(c)}", **c)), cases))
    for case, (ids, logprobs, completes) in zip(cases, got):
        want_ids, want_logprobs, _ = outputs_of(plain, grpc_request(prompt, "plain", **case))
        assert ids == want_ids, case
        for index in want_logprobs:
            np.testing.assert_allclose(logprobs[index], want_logprobs[index], atol=2e-4)
        for c in completes:
            assert 0 <= c.spec_accepted_tokens <= c.spec_draft_tokens
    greedy = got[0][2][0]
    assert greedy.spec_draft_tokens > 0 and greedy.spec_accepted_tokens > 0, greedy
    assert got[4][2][0].spec_draft_tokens == 0  # one token: nothing to draft
    samples = scrape(spec.metrics_url)
    drafted = [v for (name, _), v in samples.items() if name == "tokenspeed:spec_draft_tokens_total"]
    accepted = [v for (name, _), v in samples.items() if name == "tokenspeed:spec_accepted_tokens_total"]
    assert drafted and accepted and 0 < accepted[0] <= drafted[0]
    names = {name for name, _ in samples}
    assert {"tokenspeed:spec_undrafted_batches_total", "tokenspeed:spec_backoff_steps_total"} <= names
    assert any("Finish!" in line and "acc_len=None" not in line for line in spec.log().splitlines())


def test_grpc_bad_speculative_flags_are_refused_at_startup():
    import subprocess
    import sys

    model = str(tiny_models()[MODEL])
    for flags, needle in ((["--speculative-algorithm", "MTP"], "--speculative-algorithm"),
                          (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"],
                           "--speculative-num-draft-tokens"),
                          (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
                            "--speculative-ngram-max-match-window-size", "2"], "window"),
                          # a speculative flag without the algorithm that reads it: refused, not ignored
                          (["--speculative-num-draft-tokens", "5"],
                           "--speculative-num-draft-tokens: only used with --speculative-algorithm"),
                          (["--speculative-algorithm", "NGRAM", "--eagle3-layers-to-capture", "1"],
                           "--eagle3-layers-to-capture: only used with --speculative-algorithm EAGLE3; not with NGRAM")):
        r = subprocess.run([sys.executable, "-m", "tokenspeed_worker", model, *flags], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and needle in r.stderr, (flags, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_tensor_parallel_speculation_equals_the_plain_worker(workers):
    from worker_harness import needs_devices

    needs_devices(2)
    _, plain = workers
    tp = Worker(tiny_models()[MODEL], "--max-model-len", "256", "--max-total-tokens", "4096", "--sampling-backend",
                "torch", "--tensor-parallel-size", "2", "--speculative-algorithm", "NGRAM")
    try:
        rng = np.random.default_rng(4)
        for i, case in enumerate([dict(temperature=0.0, max_new_tokens=50),
                                  dict(temperature=0.9, sampling_seed=3, n=2, max_new_tokens=30)]):
            prompt = rng.integers(3, 500, 12 + 5 * i).tolist()
            ids, _, completes = outputs_of(tp, grpc_request(prompt, f"tp-{i}", **case))
            assert ids == outputs_of(plain, grpc_request(prompt, "plain", **case))[0]
            if i == 0:
                assert completes[0].spec_accepted_tokens > 0
    finally:
        assert tp.stop() == 0, tp.log()


@pytest.mark.parametrize("accept", [1.0, 0.6])
def test_oracle_drafter_keeps_what_is_right(tmp_path, monkeypatch, accept):
    """The benchmarks' oracle: drafts of the recorded greedy continuation are all kept (accept 1),
    or about `accept` of them per position; the output never changes."""
    import json

    def reqs():
        rng = np.random.default_rng(2)
        return [request(i, rng.integers(3, 500, 20 + i).tolist(), 40) for i in range(3)]

    reference = run(make_core(False), reqs())[0]
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps([r.prompt_ids.tolist() + reference[r.req_id] for r in reqs()]))
    monkeypatch.setenv("TOKENSPEED_SPECULATIVE_ORACLE", str(path))
    monkeypatch.setenv("TOKENSPEED_SPECULATIVE_ORACLE_ACCEPT", str(accept))
    core = make_core(True)
    got = run(core, reqs())[0]
    assert got == reference
    rate = core.spec_accepted_tokens / core.spec_draft_tokens
    if accept == 1.0:
        assert rate == 1.0 and core.spec_steps <= 3 * (1 + 39 // 5) + 3
    else:
        assert 0.2 < rate < 0.9


def test_oracle_forces_its_acceptance_whatever_the_model_draws(tmp_path, monkeypatch):
    """At forced acceptance 1 the oracle's drafts are kept even where the model would draw
    otherwise (a benchmark's random weights): the output is the recorded continuation at every
    drafted position and the model's own token after each burst."""
    import json

    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 500, 24).tolist()
    recorded = rng.integers(3, 500, 40).tolist()  # not what the model computes
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps([{"tokens": prompt + recorded, "prompt_len": len(prompt), "accept": 1.0}]))
    monkeypatch.setenv("TOKENSPEED_SPECULATIVE_ORACLE", str(path))
    core = make_core(True)
    got = run(core, [request(0, prompt, 40)])[0][0]
    assert core.spec_draft_tokens > 0 and core.spec_accepted_tokens == core.spec_draft_tokens
    # The prefill's token is the model's; then bursts of 4 kept drafts and the model's next token
    # (the last burst is shorter: no draft passes max_new_tokens).
    drafted = [i for i in range(1, 35) if i % 5 != 0] + [36, 37, 38]
    assert [got[i] for i in drafted] == [recorded[i] for i in drafted]
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks


# -- the kept tokens follow the model's distribution ----------------------------------------------


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_kept_tokens_follow_the_target_distribution():
    """Seeded draws at each drafted position, kept while they equal the draft: over many seeds the
    first output token follows the model's distribution at position 0 (chi-square), the first draft
    is kept with its probability there, and after a kept draft the next token follows position 1's
    distribution; each seed's first token is the one plain decoding draws."""
    import torch

    from tokenspeed_worker.engine.speculative import Verify
    from tokenspeed_worker.sampling.sampler import Sampler, SamplingBatch

    n, vocab = 6000, 6
    logits = torch.tensor([[1.0, 0.2, 1.4, -0.5, 0.3, 0.0],   # position 0: the draft d1 = 2 is likely
                           [0.1, 0.0, -1.0, 0.5, 1.2, 0.4],   # position 1: d2 = 4
                           [0.0] * vocab])
    drafts = [2, 4]
    probs = torch.softmax(logits, -1).numpy().astype(np.float64)
    seeds = np.arange(n) * 7919 + 11
    rows = np.repeat(seeds, 3)
    positions = np.tile(np.arange(3), n)
    batch = SamplingBatch.from_lists([1.0] * 3 * n, [0] * 3 * n, [1.0] * 3 * n, [0.0] * 3 * n, rows.tolist(),
                                     positions.tolist())
    sampled = Sampler("torch").sample(logits.repeat(n, 1), batch).tokens.numpy().astype(np.int64)
    counts = np.full(n, 3, dtype=np.int64)
    verify = Verify(counts=counts, starts=np.arange(n) * 3, drafts=np.tile(np.array(drafts + [-1]), n),
                    draft_lens=counts - 1)
    kept, tokens = verify.accept(sampled)
    first = tokens[np.concatenate([[0], np.cumsum(kept)[:-1]])]
    # 5 degrees of freedom: 20.5 is the 0.1 % critical value.
    assert chi_square(np.bincount(first, minlength=vocab), probs[0]) < 20.5
    kept_first = kept >= 2
    p = probs[0][drafts[0]]
    assert abs(kept_first.mean() - p) < 4 * np.sqrt(p * (1 - p) / n)
    second = tokens[np.concatenate([[0], np.cumsum(kept)[:-1]])[kept_first] + 1]
    assert chi_square(np.bincount(second, minlength=vocab), probs[1]) < 20.5
    plain = SamplingBatch.from_lists([1.0] * n, [0] * n, [1.0] * n, [0.0] * n, seeds.tolist(), [0] * n)
    assert np.array_equal(Sampler("torch").sample(logits[:1].repeat(n, 1), plain).tokens.numpy(), first)


# -- EAGLE-3 --------------------------------------------------------------------------------------


def make_eagle3_head(target: Path, out: Path, copying: bool = True) -> Path:
    """A tiny EAGLE-3 head for `target` in the published layout (config.json, safetensors with the
    published names, d2t over a draft vocabulary). copying=True makes it draft what the history
    is mostly made of: q and k are zero (attention averages the context), v carries the normed
    token embedding, the LM head is the target's embedding, fc and the MLP's output are zero; so a
    greedy run stuck on one token gets its drafts kept. Else every weight is random."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = json.loads((target / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    vocab = cfg["vocab_size"]
    draft_vocab = vocab if copying else vocab // 2
    config = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                  "max_position_embeddings", "vocab_size") if k in cfg}
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, intermediate_size=2 * hidden,
                  draft_vocab_size=draft_vocab, tie_word_embeddings=False, hidden_act="silu",
                  rope_parameters=cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(11)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    w = {
        "fc.weight": rnd(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rnd(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rnd(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rnd(2 * hidden, hidden),
        "midlayer.mlp.up_proj.weight": rnd(2 * hidden, hidden),
        "midlayer.mlp.down_proj.weight": rnd(hidden, 2 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rnd(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    }
    if copying:
        embed = load_file(str(next(target.glob("*.safetensors"))))["model.embed_tokens.weight"].float()
        group = heads // kv
        for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                     "midlayer.mlp.down_proj.weight"):
            w[name].zero_()
        v = torch.zeros(kv * head_dim, 2 * hidden)
        v[:, : kv * head_dim] = torch.eye(kv * head_dim)  # the first kv*head_dim dims of norm(embedding)
        o = torch.zeros(hidden, heads * head_dim)
        for k in range(kv):  # the first head of each kv group writes its kv head's dims back in place
            o[k * head_dim:(k + 1) * head_dim, k * group * head_dim:(k * group + 1) * head_dim] = torch.eye(head_dim)
        w["midlayer.self_attn.v_proj.weight"], w["midlayer.self_attn.o_proj.weight"] = v, o
        lm = embed.clone()
        lm[:, kv * head_dim:] = 0
        w["lm_head.weight"] = lm
    else:  # a draft vocabulary of every other target id
        w["d2t"] = torch.arange(draft_vocab, dtype=torch.int64)  # draft id i -> target id 2i
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory):
    target = tiny_models()[MODEL]
    base = tmp_path_factory.mktemp("eagle3")
    return {"copying": make_eagle3_head(target, base / "copying"),
            "random": make_eagle3_head(target, base / "random", copying=False)}


def eagle_core(head: Path, **overrides) -> EngineCore:
    cfg = dict(speculative_algorithm="EAGLE3", draft_model_path=str(head))
    cfg.update(overrides)
    core = make_core(False, **cfg)
    return core


@pytest.mark.parametrize("head", ["copying", "random"])
def test_eagle3_output_equals_decoding_without_speculation(eagle_heads, head):
    reference = run(make_core(False), mixed_requests())
    core = eagle_core(eagle_heads[head], num_speculative_tokens=3)
    got = run(core, mixed_requests())
    assert got[0] == reference[0] and got[2] == reference[2]
    for rid in (2, 6):
        np.testing.assert_allclose(got[1][rid], reference[1][rid], atol=2e-4)
    assert core.spec_draft_tokens > 0
    if head == "copying":
        assert core.spec_accepted_tokens > 0
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks


def test_eagle3_under_preemption_and_prefix_hits(eagle_heads):
    reference = run(make_core(False, max_total_tokens=192, schedule_conservativeness=0.0), mixed_requests())
    core = eagle_core(eagle_heads["copying"], max_total_tokens=192, schedule_conservativeness=0.0)
    got = run(core, mixed_requests())
    assert got[0] == reference[0] and got[2] == reference[2]
    assert core.scheduler.num_preemptions > 0 and core.spec_accepted_tokens > 0


def test_eagle3_drafts_equal_a_dense_reference(eagle_heads):
    """The drafts the paged, incremental drafter proposes equal the head run densely from scratch
    over the request's whole history (the target's hidden states recomputed in one prefill)."""
    from tokenspeed_worker.models.llama_eagle3 import Eagle3Head, read_config

    head_dir = eagle_heads["random"]
    core = eagle_core(head_dir, num_speculative_tokens=3, chunked_prefill_size=7)
    proposed = []
    original = core.scheduler.set_draft

    def spy(row, tokens):
        proposed.append((core.scheduler.token_ids(row).copy(), np.asarray(tokens).copy()))
        original(row, tokens)

    core.scheduler.set_draft = spy
    rng = np.random.default_rng(8)
    run(core, [request(0, rng.integers(3, 500, 19).tolist(), 12)])
    assert len(proposed) >= 3
    ref_head = Eagle3Head(read_config(str(head_dir)), core.runner.hf_config.hidden_size)
    ref_head.load(str(head_dir))
    ref_head.to(core.runner.device)
    embed = core.runner.model.model.embed_tokens
    for tokens, draft in proposed[:4]:
        n = tokens.shape[0]
        aux = target_aux(core, tokens[: n - 1])  # the target's states at positions 0..n-2
        want = dense_chain(ref_head, embed, tokens, aux, len(draft))
        assert draft.tolist() == want, (n, draft, want)


def target_aux(core: EngineCore, tokens: np.ndarray) -> torch.Tensor:
    """The target's captured states at every position of `tokens`, from one fresh prefill."""
    from tokenspeed_worker.scheduler.plan import SchedulePlan

    runner = core.runner
    n = tokens.shape[0]
    blocks = -(-n // runner.block_size)
    base = core.num_blocks - blocks  # the pool's last blocks: free at the end of a run
    table = np.arange(base, base + blocks, dtype=np.int32)[None]
    positions = np.arange(n, dtype=np.int64)
    plan = SchedulePlan(np.zeros(1, np.int64), np.array([n], np.int32), np.zeros(1, np.int32), tokens.astype(np.int64),
                        positions, (table[0][positions // runner.block_size].astype(np.int64) * runner.block_size
                                    + positions % runner.block_size), table, np.zeros(1, np.int32))
    runner.forward(plan)
    aux = runner.model.model.aux_hidden
    runner.model.model.aux_hidden = None
    return aux


def dense_chain(head, embed, tokens: np.ndarray, aux: torch.Tensor, k: int) -> list[int]:
    """EAGLE-3's chain computed densely: pairs (token p + 1, target state p) for p = 0..n-2, causal
    attention over them in plain torch, then k - 1 steps on the head's own states."""
    layer = head.midlayer
    a = layer.self_attn
    keys, values, out_tokens = [], [], []

    def step(e, hidden, positions):
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], dim=-1)
        q = a.q_proj(x).view(-1, layer.num_heads, layer.head_dim)
        kk = a.k_proj(x).view(-1, layer.num_kv_heads, layer.head_dim)
        q, kk = layer.rotary_emb(positions, q, kk)
        keys.append(kk)
        values.append(a.v_proj(x).view(-1, layer.num_kv_heads, layer.head_dim))
        K, V = torch.cat(keys), torch.cat(values)
        rep = layer.num_heads // layer.num_kv_heads
        K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
        total, new = K.shape[0], q.shape[0]
        mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
        scores = torch.einsum("qhd,khd->hqk", q, K) * layer.head_dim ** -0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), V)
        out = a.o_proj(attn.reshape(new, -1))
        y, residual = layer.post_attention_layernorm(out, hidden)
        m = layer.mlp
        y = m.down_proj(torch.nn.functional.silu(m.gate_proj(y)) * m.up_proj(y))
        normed, pre = head.norm(y, residual)
        return head.lm_head(normed), pre

    device = aux.device
    with torch.inference_mode():
        ids = torch.from_numpy(tokens[1:].astype(np.int64)).to(device)
        hidden = head.fc(aux.float())
        e = embed(ids).float()
        logits, pre = step(e, hidden, torch.arange(ids.shape[0], device=device))
        token = int(head.target_ids(logits[-1:].argmax(-1))[0])
        out_tokens.append(token)
        g, position = pre[-1:], ids.shape[0]
        for _ in range(k - 1):
            logits, g = step(embed(torch.tensor([token], device=device)).float(), g,
                             torch.tensor([position], device=device))
            token = int(head.target_ids(logits.argmax(-1))[0])
            out_tokens.append(token)
            position += 1
    return out_tokens


def test_eagle3_checks_its_head(tmp_path, eagle_heads):
    import json

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 Llama head"):
        eagle_core(bad)
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(speculative_algorithm="EAGLE3")


def test_grpc_eagle3_worker_equals_the_plain_worker(workers, eagle_heads):
    _, plain = workers
    w = Worker(tiny_models()[MODEL], "--max-model-len", "256", "--max-total-tokens", "4096", "--sampling-backend",
               "torch", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
               str(eagle_heads["copying"]), "--speculative-num-steps", "3")
    try:
        rng = np.random.default_rng(6)
        for i, case in enumerate([dict(temperature=0.0, max_new_tokens=60), dict(stream=True, temperature=0.0),
                                  dict(temperature=0.9, sampling_seed=3, n=2, max_new_tokens=30)]):
            prompt = rng.integers(3, 500, 10 + 7 * i).tolist()
            ids, _, completes = outputs_of(w, grpc_request(prompt, f"e3-{i}", **case))
            assert ids == outputs_of(plain, grpc_request(prompt, "plain", **case))[0], case
            if i == 0:
                assert completes[0].spec_draft_tokens > 0
        assert "EAGLE-3 draft head" in w.log()
    finally:
        assert w.stop() == 0, w.log()


def test_grpc_bad_eagle3_flags_are_refused_at_startup():
    import subprocess
    import sys

    model = str(tiny_models()[MODEL])
    for flags, needle in ((["--speculative-algorithm", "EAGLE3"], "--speculative-draft-model-path"),
                          (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", model],
                           "not an EAGLE-3 Llama head"),
                          (["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "4"],
                           "--speculative-eagle-topk 4")):
        r = subprocess.run([sys.executable, "-m", "tokenspeed_worker", model, *flags], capture_output=True,
                           text=True, timeout=180)
        assert r.returncode != 0 and needle in r.stderr, (flags, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_speculative_config_json_fills_the_flags_it_stands_for(eagle_heads):
    from tokenspeed_worker.config import WorkerConfig, parse_args

    model = str(tiny_models()[MODEL])
    args = parse_args([model, "--speculative-config",
                       json_text({"method": "eagle3", "model": str(eagle_heads["random"]), "num_speculative_tokens": 5}),
                       "--eagle3-layers-to-capture", "0,1,2"])
    spec = WorkerConfig.from_args(args).engine.speculative
    assert (spec.speculative_algorithm, spec.draft_model_path, spec.num_speculative_tokens, spec.eagle3_layers) == (
        "EAGLE3", str(eagle_heads["random"]), 5, (0, 1, 2))
    # An explicit flag wins over the JSON.
    args = parse_args([model, "--speculative-config", json_text({"method": "eagle3"}), "--speculative-algorithm",
                       "NGRAM", "--speculative-num-draft-tokens", "3"])
    spec = WorkerConfig.from_args(args).engine.speculative
    assert (spec.speculative_algorithm, spec.num_speculative_tokens) == ("NGRAM", 2)
    core = eagle_core(eagle_heads["random"], eagle3_layers=(0, 0, 2))
    assert core.runner.model.model.aux_layers == (0, 0, 2)
    with pytest.raises(ValueError, match="three of the model's 3 layers"):
        eagle_core(eagle_heads["random"], eagle3_layers=(0, 5, 2))


def json_text(value) -> str:
    import json

    return json.dumps(value)


def test_data_parallel_replicas_speculate_and_push_their_acceptance(workers):
    """Two data-parallel replicas, each speculating: outputs as the plain worker's, and the pushed load
    record (SubscribeKvEvents, as the gateway holds it) carries the speculative accept length and rate."""
    from test_kv_events import StreamReader

    from worker_harness import needs_devices

    needs_devices(2)
    _, plain = workers
    w = Worker(tiny_models()[MODEL], "--max-model-len", "256", "--max-total-tokens", "4096", "--sampling-backend",
               "torch", "--dp-size", "2", "--speculative-algorithm", "NGRAM")
    stream = StreamReader(w.stub, load_records_before_first_batch=True)
    try:
        rng = np.random.default_rng(12)
        for i in range(4):
            prompt = rng.integers(3, 500, 15 + i).tolist()
            case = dict(temperature=0.0, max_new_tokens=40)
            assert outputs_of(w, grpc_request(prompt, f"dp-{i}", **case))[0] == \
                outputs_of(plain, grpc_request(prompt, "plain", **case))[0]
        got = stream.until(lambda got: any(b.load.HasField("speculative") for _, b in got), timeout=30)
        record = [b.load.speculative for _, b in got if b.load.HasField("speculative")][-1]
        assert record.accept_length > 1.0 and 0.0 < record.accept_rate <= 1.0
    finally:
        stream.close()
        assert w.stop() == 0, w.log()
