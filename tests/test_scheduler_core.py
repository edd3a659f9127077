"""The native scheduler core through its Python face: chunked prefill, ordering,
finishing, aborts, rejections, preemption by recompute, block ownership invariants,
and outputs under preemption/chunking equal to an unconstrained reference run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from tokenspeed_worker.scheduler.scheduler import FinishReason, Scheduler
from tokenspeed_worker.scheduler.plan import SchedulePlan


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_model_len: int = 1024,
    token_budget: int = 16,
    **kwargs,
) -> Scheduler:
    # These tests pin down chunking and admission arithmetic with prompts that share
    # prefixes (prompt() always counts from 100), so prefix caching is off unless a
    # test turns it on; tests/test_prefix_cache.py covers caching.
    kwargs.setdefault("enable_prefix_caching", False)
    return Scheduler(num_blocks, block_size, max_num_seqs, max_model_len, token_budget, **kwargs)


def prompt(n: int, start: int = 100) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def rows_of(plan: SchedulePlan) -> dict[int, int]:
    return {int(r): b for b, r in enumerate(plan.req_ids)}


def check_plan(sched: Scheduler, plan: SchedulePlan) -> None:
    """Slots lie in the request's own blocks, at the offset of their position, and
    the block table row is the request's block table padded with 0."""
    bs = sched.block_size
    cu = plan.cu_query_lens
    assert plan.block_tables.shape[0] == plan.num_reqs
    for b, req_id in enumerate(plan.req_ids):
        blocks = sched.block_ids(int(req_id))
        seq_len = int(plan.context_lens[b] + plan.query_lens[b])
        assert len(blocks) == -(-seq_len // bs)
        row = plan.block_tables[b]
        assert list(row[: len(blocks)]) == list(blocks)
        assert not row[len(blocks) :].any()
        pos = plan.positions[cu[b] : cu[b + 1]]
        assert list(pos) == list(range(int(plan.context_lens[b]), seq_len))
        slots = plan.slot_mapping[cu[b] : cu[b + 1]]
        assert np.array_equal(slots, blocks[pos // bs].astype(np.int64) * bs + pos % bs)
        tokens = sched.token_ids(int(req_id))
        assert np.array_equal(plan.input_ids[cu[b] : cu[b + 1]], tokens[pos])
    expected_samples = [
        b for b, r in enumerate(plan.req_ids) if plan.seq_lens[b] == len(sched.token_ids(int(r)))
    ]
    assert list(plan.sample_rows) == expected_samples


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulePlan, dict[int, int]]:
    plan = sched.schedule()
    if plan.num_reqs:
        check_plan(sched, plan)
    sampled = np.full(len(plan.sample_rows), token, dtype=np.int64)
    finished, reasons = sched.advance(sampled)
    return plan, dict(zip(finished.tolist(), reasons.tolist()))


# -- chunked prefill -----------------------------------------------------------------


def test_prompt_is_chunked_at_budget_16():
    sched = make(token_budget=16)
    sched.add_request(1, prompt(40), 4, [])
    lens, ctxs, samples = [], [], []
    for _ in range(3):
        plan, _ = step(sched)
        lens.append(int(plan.query_lens[0]))
        ctxs.append(int(plan.context_lens[0]))
        samples.append(len(plan.sample_rows))
    assert lens == [16, 16, 8]
    assert ctxs == [0, 16, 32]
    assert samples == [0, 0, 1]
    assert sched.output_len(1) == 1
    plan, _ = step(sched)
    assert list(plan.query_lens) == [1] and list(plan.context_lens) == [40]


def test_budget_33_shared_by_decode_continuation_and_admission():
    sched = make(token_budget=33, block_size=8)
    sched.add_request(1, prompt(50), 8, [])
    sched.add_request(2, prompt(20), 8, [])
    plan, _ = step(sched)
    assert list(plan.req_ids) == [1] and list(plan.query_lens) == [33]
    plan, _ = step(sched)  # 17 to finish request 1, 16 of request 2
    assert list(plan.req_ids) == [1, 2] and list(plan.query_lens) == [17, 16]
    assert list(plan.sample_rows) == [0]
    plan, _ = step(sched)  # request 1 decodes first, then request 2's last 4
    assert list(plan.req_ids) == [1, 2] and list(plan.query_lens) == [1, 4]
    assert list(plan.sample_rows) == [0, 1]
    assert plan.num_tokens == 5


def test_max_num_seqs_caps_running_requests():
    sched = make(max_num_seqs=2, token_budget=64)
    for i in range(5):
        sched.add_request(i, prompt(3), 4, [])
    plan, _ = step(sched)
    assert list(plan.req_ids) == [0, 1]
    assert sched.num_running == 2 and sched.num_waiting == 3


def test_decode_rows_come_before_prefill_rows():
    sched = make(token_budget=64)
    sched.add_request(1, prompt(5), 10, [])
    step(sched)
    sched.add_request(2, prompt(7), 10, [])
    plan, _ = step(sched)
    assert list(plan.req_ids) == [1, 2]
    assert list(plan.query_lens) == [1, 7]
    assert list(plan.sample_rows) == [0, 1]
    np.testing.assert_array_equal(plan.sample_token_index, [0, 7])


def test_sample_rows_skip_mid_prefill_chunks():
    sched = make(token_budget=8)
    sched.add_request(1, prompt(3), 10, [])
    sched.add_request(2, prompt(20), 10, [])
    plan, _ = step(sched)
    assert list(plan.query_lens) == [3, 5]
    assert list(plan.sample_rows) == [0]
    assert sched.output_len(2) == 0


def test_fifo_admission_does_not_skip_ahead():
    sched = make(num_blocks=10, block_size=4, token_budget=64)
    sched.add_request(1, prompt(24), 8, [])  # 6 blocks
    sched.add_request(2, prompt(20), 8, [])  # 5 blocks: does not fit beside 1
    sched.add_request(3, prompt(2), 8, [])  # would fit, but waits behind 2
    plan, _ = step(sched)
    assert list(plan.req_ids) == [1]
    assert sched.num_waiting == 2


# -- finishing -----------------------------------------------------------------------


def test_length_finish_after_max_new_tokens():
    sched = make()
    sched.add_request(1, prompt(5), 3, [])
    done = {}
    for _ in range(3):
        _, done = step(sched)
    assert done == {1: FinishReason.LENGTH}
    assert not sched.contains(1) and not sched.has_work()
    assert sched.num_free_blocks == sched.num_total_blocks


def test_stop_token_finishes_and_wins_over_length():
    sched = make()
    sched.add_request(1, prompt(5), 10, [9, 42])
    sched.add_request(2, prompt(5), 1, np.array([42], dtype=np.int32))
    _, done = step(sched, token=3)
    assert done == {2: FinishReason.LENGTH}
    _, done = step(sched, token=42)
    assert done == {1: FinishReason.STOP}
    assert sched.num_free_blocks == sched.num_total_blocks


def test_int32_prompt_is_accepted():
    sched = make()
    sched.add_request(1, np.arange(6, dtype=np.int32), 2, [])
    plan = sched.schedule()
    assert plan.input_ids.dtype == np.int64
    np.testing.assert_array_equal(plan.input_ids, np.arange(6))


def test_plan_dtypes_and_shapes():
    sched = make(block_size=4)
    sched.add_request(1, prompt(9), 2, [])
    sched.add_request(2, prompt(2), 2, [])
    plan = sched.schedule()
    assert plan.req_ids.dtype == np.int64 and plan.query_lens.dtype == np.int32
    assert plan.context_lens.dtype == np.int32 and plan.block_tables.dtype == np.int32
    assert plan.positions.dtype == np.int64 and plan.slot_mapping.dtype == np.int64
    assert plan.sample_rows.dtype == np.int32
    assert plan.block_tables.shape == (2, 3)
    empty = make().schedule()
    assert empty.num_reqs == 0 and empty.block_tables.shape == (0, 1)


# -- abort ---------------------------------------------------------------------------


def test_abort_waiting_prefilling_decoding_and_unknown():
    sched = make(num_blocks=32, token_budget=8, max_num_seqs=2)
    sched.add_request(1, prompt(3), 10, [])  # decoding after one step
    sched.add_request(2, prompt(20), 10, [])  # mid-prefill after one step
    sched.add_request(3, prompt(4), 10, [])  # waiting (max_num_seqs)
    step(sched)
    assert sched.output_len(1) == 1 and sched.output_len(2) == 0
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert sched.abort(3) and sched.num_waiting == 0
    assert sched.abort(2) and sched.num_running == 1
    assert sched.abort(1) and sched.num_running == 0
    assert not sched.abort(1) and not sched.abort(99)
    assert not sched.has_work()
    assert sched.num_free_blocks == sched.num_total_blocks
    assert sched.schedule().num_reqs == 0


def test_abort_between_schedule_and_advance_drops_its_token():
    sched = make(token_budget=64)
    sched.add_request(1, prompt(4), 5, [])
    sched.add_request(2, prompt(4), 5, [])
    sched.add_request(3, prompt(30), 5, [])
    plan = sched.schedule()
    assert list(plan.sample_rows) == [0, 1, 2]
    assert sched.abort(2)
    assert sched.abort(3)
    sched.add_request(2, prompt(4, start=5), 5, [])  # reused id: not the aborted one
    finished, _ = sched.advance(np.array([11, 22, 33], dtype=np.int64))
    assert len(finished) == 0
    assert list(sched.token_ids(1)) == list(prompt(4)) + [11]
    assert sched.output_len(2) == 0 and sched.num_waiting == 1
    for req_id in (1, 2):
        sched.abort(req_id)
    assert sched.num_free_blocks == sched.num_total_blocks


# -- misuse --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "req_id, n, max_new, match",
    [
        (1, 4, 4, "duplicate"),
        (2, 0, 4, "empty prompt"),
        (3, 4, 0, "max_new_tokens"),
        (4, 60, 10, "max_model_len"),
        (5, 30, 10, "whole KV pool"),
    ],
)
def test_add_request_rejects(req_id, n, max_new, match):
    sched = make(num_blocks=8, block_size=4, max_model_len=64)
    sched.add_request(1, prompt(4), 4, [])
    with pytest.raises(ValueError, match=match):
        sched.add_request(req_id, prompt(n), max_new, [])


def test_schedule_twice_without_advance_is_an_error():
    sched = make()
    with pytest.raises(RuntimeError, match="schedule"):
        sched.advance(np.zeros(0, dtype=np.int64))
    sched.schedule()  # empty: no advance needed
    sched.add_request(1, prompt(4), 4, [])
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="advance"):
        sched.schedule()
    with pytest.raises(ValueError, match="sample rows"):
        sched.advance(np.zeros(2, dtype=np.int64))
    sched.advance(np.zeros(len(plan.sample_rows), dtype=np.int64))
    with pytest.raises(RuntimeError):
        sched.advance(np.zeros(0, dtype=np.int64))
    with pytest.raises(KeyError):
        sched.output_len(5)


def test_allocator_refuses_double_free_and_counts_references():
    from tokenspeed_worker._scheduler_core import BlockAllocator

    pool = BlockAllocator(3)
    block = pool.allocate()
    pool.share(block)
    assert pool.ref_count(block) == 2 and pool.num_free == 2
    pool.release(block)
    pool.release(block)
    assert pool.num_free == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(block)
    with pytest.raises(IndexError):
        pool.release(7)


def test_allocator_aborts_on_leak_at_destruction():
    code = (
        "from tokenspeed_worker._scheduler_core import BlockAllocator\n"
        "pool = BlockAllocator(2); pool.allocate(); del pool\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "leak" in result.stderr


# -- stats ---------------------------------------------------------------------------


def test_stats_follow_the_requests():
    sched = make(num_blocks=16, block_size=4, token_budget=8, max_num_seqs=1)
    sched.add_request(1, prompt(10), 4, [])
    sched.add_request(2, prompt(6), 4, [])
    assert sched.waiting_tokens == 16 and sched.num_used_tokens == 0
    step(sched)
    assert sched.num_used_tokens == 8 and sched.waiting_tokens == 6
    assert sched.num_free_blocks == 14
    step(sched)
    assert sched.num_used_tokens == 10 and sched.output_len(1) == 1
    assert sched.num_free_blocks == 13


# -- no chunking ---------------------------------------------------------------------


def test_without_chunking_whole_prompts_up_to_max_prefill_tokens():
    sched = make(token_budget=8, chunked_prefill=False, max_prefill_tokens=20)
    sched.add_request(1, prompt(12), 4, [])
    sched.add_request(2, prompt(8), 4, [])
    sched.add_request(3, prompt(2), 4, [])
    plan, _ = step(sched)
    assert list(plan.req_ids) == [1, 2] and list(plan.query_lens) == [12, 8]
    sched.add_request(4, prompt(50), 4, [])  # larger than max_prefill_tokens: alone
    plan, _ = step(sched)
    assert list(plan.req_ids) == [1, 2, 3] and list(plan.query_lens) == [1, 1, 2]
    plan, _ = step(sched)
    assert list(plan.req_ids) == [1, 2, 3, 4] and list(plan.query_lens) == [1, 1, 1, 50]


# -- preemption ----------------------------------------------------------------------


def test_preemption_recomputes_newest_and_it_finishes_with_all_tokens():
    # 6 blocks of 2 slots: two requests of 4 prompt tokens need 3 blocks each to
    # hold 6 tokens, so decode soon runs out of blocks.
    sched = make(num_blocks=6, block_size=2, token_budget=64)
    sched.add_request(1, prompt(4), 6, [])
    sched.add_request(2, prompt(4, start=200), 6, [])
    outputs: dict[int, list[int]] = {1: [], 2: []}
    finished: dict[int, int] = {}
    token = 0
    preempted_seen = False
    while sched.has_work():
        plan = sched.schedule()
        check_plan(sched, plan)
        sampling = [int(plan.req_ids[b]) for b in plan.sample_rows]
        sampled = np.arange(token, token + len(sampling), dtype=np.int64)
        token += len(sampling)
        for req_id, t in zip(sampling, sampled.tolist()):
            outputs[req_id].append(t)
        if sched.num_preemptions and not preempted_seen:
            preempted_seen = True
            assert sched.num_waiting == 1 and 2 not in sampling
            assert sched.block_ids(2).size == 0
            # all its tokens, prompt and output so far, wait to be recomputed
            assert sched.waiting_tokens == 4 + len(outputs[2])
        done, reasons = sched.advance(sampled)
        finished.update(zip(done.tolist(), reasons.tolist()))
    assert preempted_seen and sched.num_preemptions >= 1
    assert finished == {1: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    assert len(outputs[1]) == 6 and len(outputs[2]) == 6
    assert sched.num_free_blocks == sched.num_total_blocks


# -- reference equivalence -----------------------------------------------------------

VOCAB = 50


def run_with_fake_model(
    sched: Scheduler, requests: list[tuple[int, np.ndarray, int, list[int]]]
) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Drives the scheduler with a model whose next token is a hash of every token
    before it, read back from a simulated KV pool through the plan's block tables:
    wrong slots, shared blocks or lost tokens change the outputs."""
    bs = sched.block_size
    kv = np.full(sched.num_total_blocks * bs, -1, dtype=np.int64)
    outputs = {req_id: [] for req_id, *_ in requests}
    reasons: dict[int, int] = {}
    for req in requests:
        sched.add_request(*req)
    while sched.has_work():
        plan = sched.schedule()
        kv[plan.slot_mapping] = plan.input_ids
        sampled = []
        for b in plan.sample_rows:
            pos = np.arange(plan.seq_lens[b])
            history = kv[plan.block_tables[b][pos // bs].astype(np.int64) * bs + pos % bs]
            assert (history >= 0).all()
            sampled.append(int((history * (pos * 7 + 3)).sum() % VOCAB))
            outputs[int(plan.req_ids[b])].append(sampled[-1])
        done, why = sched.advance(np.array(sampled, dtype=np.int64))
        reasons.update(zip(done.tolist(), why.tolist()))
    return outputs, reasons


# -- admission that keeps room for the outputs (schedule_conservativeness) ----------------------


def run_to_end(sched: Scheduler, stop_after: dict[int, int] | None = None) -> tuple[int, dict[int, int]]:
    """Step until done; a request in stop_after samples its stop token 0 at that output length
    (others sample 7). Returns (most requests running at once, finish reasons)."""
    most, reasons = 0, {}
    while sched.has_work():
        plan = sched.schedule()
        check_plan(sched, plan)
        most = max(most, sched.num_running)
        sampled = np.full(len(plan.sample_rows), 7, dtype=np.int64)
        for i, b in enumerate(plan.sample_rows):
            req = int(plan.req_ids[b])
            if stop_after and sched.output_len(req) + 1 >= stop_after.get(req, 10**9):
                sampled[i] = 0
        done, why = sched.advance(sampled)
        reasons.update(zip(done.tolist(), why.tolist()))
    return most, reasons


@pytest.mark.parametrize("conservativeness", [0.0, 1.0])
def test_reservation_admits_only_what_can_finish(conservativeness):
    # 10 blocks of 4: each request holds 6 prompt tokens (2 blocks) and grows to 20 (5 blocks).
    # Admitting whenever a prompt fits takes five and preempts; keeping room for the outputs
    # (nothing finished yet: all of max_new_tokens) takes two at a time and never preempts.
    sched = make(num_blocks=10, block_size=4, token_budget=64, schedule_conservativeness=conservativeness)
    for i in range(6):
        sched.add_request(i, prompt(6, start=100 * i), 14, [0])
    most, reasons = run_to_end(sched)
    assert reasons == {i: FinishReason.LENGTH for i in range(6)}
    if conservativeness:
        assert sched.num_preemptions == 0 and most == 2
    else:
        assert sched.num_preemptions > 0 and most == 5
    assert sched.num_free_blocks == sched.num_total_blocks and sched.reserved_blocks == 0


def test_expected_output_ratio_learns_what_requests_really_produce():
    # Requests ask for 36 tokens and stop after 2: the ratio falls from 1 toward 2/36, and the
    # reservation with it, so later requests run together where the first ones could not.
    sched = make(num_blocks=24, block_size=4, token_budget=64, schedule_conservativeness=1.0)
    assert sched.expected_output_ratio == 1.0
    for i in range(4):
        sched.add_request(i, prompt(4, start=100 * i), 36, [0])
    most_first, _ = run_to_end(sched, {i: 2 for i in range(4)})
    assert most_first == 2  # 40 tokens (10 blocks) each expected: two fit in 24 blocks
    learned = sched.expected_output_ratio
    assert 2 / 36 < learned < 1.0
    for _ in range(60):  # more requests that stop early: the mean converges
        sched.add_request(1000 + _, prompt(4, start=7), 36, [0])
        run_to_end(sched, {1000 + _: 2})
    assert sched.expected_output_ratio < 0.1
    for i in range(8):
        sched.add_request(100 + i, prompt(4, start=100 * i), 36, [0])
    sched.schedule()
    assert sched.num_running == 8 and sched.reserved_blocks <= 8  # about 2 tokens each expected


def test_a_request_alone_is_admitted_whatever_it_may_need():
    # Expected to need the whole pool, it still runs when nothing else does; the next one waits.
    sched = make(num_blocks=10, block_size=4, token_budget=64, schedule_conservativeness=100.0)
    sched.add_request(1, prompt(4), 36, [0])
    sched.add_request(2, prompt(4, start=300), 36, [0])
    most, reasons = run_to_end(sched)
    assert most == 1 and reasons == {1: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    assert sched.num_preemptions == 0


def test_conservativeness_must_not_be_negative():
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        make(schedule_conservativeness=-1.0)


def random_requests(rng: np.random.Generator, n: int) -> list[tuple[int, np.ndarray, int, list[int]]]:
    """n requests: (id, prompt of 1..29 tokens, max_new_tokens 1..19, one stop token)."""
    requests = []
    for req_id in range(n):
        prompt_ids = rng.integers(0, VOCAB, rng.integers(1, 30))
        requests.append((req_id, prompt_ids, int(rng.integers(1, 20)), [int(rng.integers(0, VOCAB))]))
    return requests


@pytest.mark.parametrize("seed", range(6))
def test_outputs_under_preemption_and_chunking_match_reference(seed):
    rng = np.random.default_rng(seed)
    requests = random_requests(rng, 24)
    # Huge pool, every request admitted at once, prompts never split.
    reference = make(
        num_blocks=10_000, block_size=4, max_num_seqs=64, token_budget=4096,
        chunked_prefill=False, max_prefill_tokens=100_000,
    )
    expected, expected_reasons = run_with_fake_model(reference, requests)
    # Pools just big enough for the largest request (48 tokens): preemption guaranteed.
    tight_configs = [(16, 4, 13, True, 0.0), (33, 2, 25, True, 0.0), (5, 3, 17, True, 0.0), (16, 4, 13, False, 0.0),
                     (16, 4, 13, True, 1.0), (5, 3, 17, False, 1.0)]
    for budget, block_size, num_blocks, chunked, conservativeness in tight_configs:
        tight = make(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=6, token_budget=budget,
            chunked_prefill=chunked, schedule_conservativeness=conservativeness,
        )
        got, got_reasons = run_with_fake_model(tight, requests)
        assert got == expected
        assert got_reasons == expected_reasons
        assert tight.num_preemptions > 0 or conservativeness > 0
        assert tight.num_free_blocks == tight.num_total_blocks


# -- randomized invariants -----------------------------------------------------------


def check_ownership(sched: Scheduler, live: set[int], awaiting_resolve_ok: bool = False) -> None:
    """Every reference is one block-table entry of a live request (prefix caching
    shares blocks, so a block may sit in several tables), and every block nobody
    holds is available. awaiting_resolve_ok: with overlap scheduling, a live request
    whose output completed at commit is neither waiting nor running until resolved."""
    refs, evictable, _ = sched.debug_blocks()
    tables = [sched.block_ids(req_id) for req_id in live]
    for table in tables:
        assert len(set(table.tolist())) == len(table), "a block twice in one table"
    held = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int32)
    assert np.array_equal(refs, np.bincount(held, minlength=len(refs))), "references != table entries"
    assert not (evictable.astype(bool) & (refs > 0)).any()
    assert int((refs > 0).sum()) + sched.num_free_blocks == sched.num_total_blocks
    if awaiting_resolve_ok:
        assert sched.num_waiting + sched.num_running <= len(live)
    else:
        assert sched.num_waiting + sched.num_running == len(live)
    assert all(sched.contains(r) for r in live)


# Steps run in bursts and tokens rarely hit a stop token, so requests live long
# enough for decode to exhaust the tiny pool and preempt.
operation = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 12), st.integers(1, 24), st.integers(0, 60)),
    st.tuples(st.just("submit_fitting"), st.integers(1, 12), st.integers(1, 24), st.integers(0, 60)),
    st.tuples(st.just("submit_fitting"), st.integers(1, 12), st.integers(1, 24), st.integers(0, 60)),
    st.tuples(st.just("steps"), st.integers(1, 8), st.integers(0, 20)),
    st.tuples(st.just("steps"), st.integers(1, 8), st.integers(0, 20)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("abort_in_flight"), st.integers(0, 30)),
)


@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(3, 10),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 5),
    token_budget=st.integers(1, 20),
    chunked=st.booleans(),
    caching=st.booleans(),
    conservativeness=st.sampled_from([0.0, 0.0, 0.5, 1.0, 4.0]),
    ops=st.lists(operation, min_size=4, max_size=50),
)
def test_random_operations_keep_block_ownership_sound(
    num_blocks, block_size, max_num_seqs, token_budget, chunked, caching, conservativeness, ops
):
    sched = make(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=64,
        token_budget=token_budget, chunked_prefill=chunked, max_prefill_tokens=token_budget,
        enable_prefix_caching=caching, schedule_conservativeness=conservativeness,
    )
    live: set[int] = set()
    next_id = 0

    def run_step(token: int, abort_id: int | None = None) -> None:
        plan = sched.schedule()
        if plan.num_reqs:
            check_plan(sched, plan)
        if abort_id is not None and sched.abort(abort_id):
            live.discard(abort_id)
            check_ownership(sched, live)
        sampled = np.full(len(plan.sample_rows), token, dtype=np.int64)
        done, _ = sched.advance(sampled)
        for req_id in done.tolist():
            assert req_id in live
            live.discard(req_id)

    for op in ops:
        if op[0] in ("submit", "submit_fitting"):
            _, n, max_new, stop = op
            if op[0] == "submit_fitting":  # as long as the pool allows: pressure
                n = min(n, num_blocks * block_size - 1)
                max_new = max(1, min(max_new, num_blocks * block_size - n))
            try:
                sched.add_request(next_id, prompt(n, start=10), max_new, [stop])
                live.add(next_id)
            except ValueError:
                assert -(-(n + max_new) // block_size) > num_blocks or n + max_new > 64
            next_id += 1
        elif op[0] == "steps":
            for _ in range(op[1]):
                run_step(op[2])
                check_ownership(sched, live)
        elif op[0] == "abort":
            assert sched.abort(op[1]) == (op[1] in live)
            live.discard(op[1])
        else:
            run_step(op[1] % 21, abort_id=op[1])
        check_ownership(sched, live)
    target(float(sched.num_preemptions), label="preemptions")  # steer toward pool pressure
    for req_id in list(live):
        assert sched.abort(req_id)
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_work() and sched.num_used_tokens == 0


@pytest.mark.parametrize("conservativeness", [0.0, 1.0])
def test_long_random_run_drains_every_request(conservativeness):
    rng = np.random.default_rng(1234)
    sched = make(num_blocks=9, block_size=3, max_num_seqs=4, max_model_len=27, token_budget=7,
                 schedule_conservativeness=conservativeness)
    live: set[int] = set()
    for i in range(300):
        n = int(rng.integers(1, 20))
        sched.add_request(i, prompt(n), int(rng.integers(1, 27 - n + 1)), [int(rng.integers(0, 500))])
        live.add(i)
    steps = 0
    while sched.has_work():
        plan = sched.schedule()
        check_plan(sched, plan)
        done, _ = sched.advance(rng.integers(0, 500, len(plan.sample_rows)))
        live -= set(done.tolist())
        check_ownership(sched, live)
        steps += 1
        assert steps < 20_000
    assert not live and sched.num_free_blocks == sched.num_total_blocks


def test_admission_simulator_shows_the_reservation_avoiding_preemption(tmp_path):
    # scripts/sim_admission.py prices the real core's schedule at the 8B roofline (docs/benchmarks.md).
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "sim_admission.py"
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, str(script), "--num-requests", "40", "--input-len", "100", "--output-len", "100",
                    "--max-num-seqs", "32", "--pool-tokens", "3200", "--conservativeness", "0", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    off, on = json.loads(out.read_text())["results"]
    assert off["preemptions"] > 0 and off["recomputed_tokens"] > 0
    assert on["preemptions"] == 0 and on["recomputed_tokens"] == 0 and on["mean_rows_per_step"] <= 16
