"""Overlap scheduling in the native scheduler: commit() / resolve() let step N+1 be planned while
step N's sampled tokens are still on the device. Checked against the plain schedule/advance
protocol with a fake model that reads every token back through the plan's slots (so a wrong
pending-token reference, slot or block changes the outputs), under chunking, preemption, prefix
caching, stop tokens and aborts; plus the protocol's misuse errors."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed_worker.scheduler.scheduler import Scheduler
from test_scheduler_core import VOCAB, check_ownership, make, random_requests, run_with_fake_model


class FakeDevice:
    """The model and the device's token buffer: resolves a plan's pending input ids (-1 - i =
    sample i of the previous step) from the previous step's samples, as the model runner does."""

    def __init__(self, sched: Scheduler) -> None:
        self.bs = sched.block_size
        self.kv = np.full(sched.num_total_blocks * self.bs, -1, dtype=np.int64)
        self.last_sampled = np.zeros(0, dtype=np.int64)

    def forward(self, plan) -> np.ndarray:
        ids = plan.input_ids.copy()
        pending = ids < 0
        if pending.any():
            ids[pending] = self.last_sampled[-1 - ids[pending]]
        self.kv[plan.slot_mapping] = ids
        sampled = []
        for b in plan.sample_rows:
            pos = np.arange(plan.seq_lens[b])
            history = self.kv[plan.block_tables[b][pos // self.bs].astype(np.int64) * self.bs + pos % self.bs]
            assert (history >= 0).all()
            sampled.append(int((history * (pos * 7 + 3)).sum() % VOCAB))
        self.last_sampled = np.asarray(sampled, dtype=np.int64)
        return self.last_sampled


def run_overlapped(sched: Scheduler, requests, abort_at: dict[int, int] | None = None):
    """The engine's overlap loop: launch (schedule + forward + commit) step N, then resolve step N-1."""
    device = FakeDevice(sched)
    outputs = {req_id: [] for req_id, *_ in requests}
    reasons: dict[int, int] = {}
    for req in requests:
        sched.add_request(*req)
    pending: deque = deque()
    step = 0
    wasted = 0
    while sched.has_work() or pending:
        launched = False
        if sched.has_work():
            plan = sched.schedule()
            if plan.num_reqs:
                sampled = device.forward(plan)
                sched.commit()
                pending.append((plan.req_ids[plan.sample_rows].copy(), sampled))
                launched = True
        for req_id in [r for r, at in (abort_at or {}).items() if at == step]:
            sched.abort(req_id)
            reasons[req_id] = -1
        if len(pending) == 2 or (pending and not launched):
            req_ids, sampled = pending.popleft()
            done, why, live = sched.resolve(sampled)
            wasted += int((~live).sum())
            for req_id, token in zip(req_ids[live].tolist(), sampled[live].tolist()):
                assert req_id not in reasons, "a token after the request ended"
                outputs[req_id].append(token)
            for req_id, reason in zip(done.tolist(), why.tolist()):
                reasons[req_id] = reason
        step += 1
        assert step < 20_000
    return outputs, reasons, wasted


@pytest.mark.parametrize("seed", range(6))
def test_overlapped_outputs_equal_the_plain_protocol(seed):
    rng = np.random.default_rng(seed)
    requests = random_requests(rng, 24)
    reference = make(num_blocks=10_000, block_size=4, max_num_seqs=64, token_budget=4096,
                     chunked_prefill=False, max_prefill_tokens=100_000)
    expected, expected_reasons = run_with_fake_model(reference, requests)
    configs = [(4096, 4, 10_000, True, False), (16, 4, 13, True, False), (33, 2, 25, True, True),
               (5, 3, 17, True, True), (16, 4, 13, False, False)]
    for budget, block_size, num_blocks, chunked, caching in configs:
        sched = make(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6, token_budget=budget,
                     chunked_prefill=chunked, enable_prefix_caching=caching)
        got, got_reasons, _ = run_overlapped(sched, requests)
        assert got == expected, (budget, block_size, num_blocks, chunked, caching)
        assert got_reasons == expected_reasons
        assert sched.num_free_blocks == sched.num_total_blocks
        assert sched.num_unresolved == 0 and not sched.has_work()


def test_stop_token_wastes_at_most_one_dropped_token_per_request():
    # Every request samples its stop token first: each computed one token more than it keeps.
    requests = [(i, np.arange(5 + i, dtype=np.int64), 10, list(range(VOCAB))) for i in range(4)]
    sched = make()
    outputs, reasons, wasted = run_overlapped(sched, requests)
    assert all(len(out) == 1 for out in outputs.values())
    assert set(reasons.values()) == {1}  # FinishReason.STOP
    assert wasted <= len(requests)
    assert sched.num_free_blocks == sched.num_total_blocks


def test_length_limit_is_known_at_commit_and_never_scheduled_again():
    sched = make()
    sched.add_request(0, np.arange(6, dtype=np.int64), 2, [])
    device = FakeDevice(sched)
    plan = sched.schedule()
    first = device.forward(plan)
    sched.commit()
    plan = sched.schedule()  # decodes its 2nd (last) token from the pending 1st
    assert plan.num_reqs == 1 and plan.input_ids.tolist() == [-1]
    second = device.forward(plan)
    sched.commit()
    assert sched.num_running == 0  # output complete: waits for resolve only
    done, _, live = sched.resolve(first)
    assert done.size == 0 and live.tolist() == [True]
    assert sched.schedule().num_reqs == 0 and not sched.has_work()
    done, why, live = sched.resolve(second)
    assert done.tolist() == [0] and why.tolist() == [2] and live.tolist() == [True]
    assert sched.num_free_blocks == sched.num_total_blocks


def test_abort_with_two_steps_unresolved_drops_both_tokens_and_frees_blocks():
    sched = make()
    sched.add_request(0, np.arange(6, dtype=np.int64), 20, [])
    sched.add_request(1, np.arange(9, dtype=np.int64), 20, [])
    device = FakeDevice(sched)
    steps = []
    for _ in range(2):
        plan = sched.schedule()
        steps.append(device.forward(plan))
        sched.commit()
    assert sched.num_unresolved == 2
    assert sched.abort(1)
    _, _, live = sched.resolve(steps[0])
    assert live.tolist() == [True, False]
    _, _, live = sched.resolve(steps[1])
    assert live.tolist() == [True, False]
    check_ownership(sched, {0})
    assert sched.abort(0)
    assert sched.num_free_blocks == sched.num_total_blocks


def test_protocol_misuse_is_refused():
    sched = make()
    sched.add_request(0, np.arange(6, dtype=np.int64), 20, [])
    with pytest.raises(RuntimeError, match="no committed step"):
        sched.resolve(np.zeros(0, dtype=np.int64))
    with pytest.raises(RuntimeError, match="without a plan"):
        sched.commit()
    device = FakeDevice(sched)
    for _ in range(2):
        device.forward(sched.schedule())
        sched.commit()
    with pytest.raises(RuntimeError, match="two committed steps"):
        sched.schedule()
    with pytest.raises(ValueError, match="sample rows"):
        sched.resolve(np.zeros(3, dtype=np.int64))
    sched.resolve(np.array([5], dtype=np.int64))
    sched.schedule()
    with pytest.raises(RuntimeError, match="unresolved"):
        sched.advance(np.array([5], dtype=np.int64))
    with pytest.raises(RuntimeError, match="live requests"):
        sched.drop_plan()
    assert sched.abort(0)
    sched.drop_plan()
    sched.resolve(np.array([5], dtype=np.int64))
    assert sched.num_unresolved == 0
    assert sched.num_free_blocks == sched.num_total_blocks


operation = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 12), st.integers(1, 24), st.integers(0, VOCAB - 1)),
    st.tuples(st.just("steps"), st.integers(1, 8)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(3, 10),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 5),
    token_budget=st.integers(1, 20),
    chunked=st.booleans(),
    caching=st.booleans(),
    ops=st.lists(operation, min_size=4, max_size=40),
)
def test_random_overlapped_operations_keep_block_ownership_sound(
    num_blocks, block_size, max_num_seqs, token_budget, chunked, caching, ops
):
    sched = make(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=64,
                 token_budget=token_budget, chunked_prefill=chunked, max_prefill_tokens=token_budget,
                 enable_prefix_caching=caching)
    device = FakeDevice(sched)
    live: set[int] = set()
    pending: deque = deque()
    next_id = 0

    def resolve_oldest() -> None:
        done, _, _ = sched.resolve(pending.popleft())
        for req_id in done.tolist():
            assert req_id in live
            live.discard(req_id)

    for op in ops:
        if op[0] == "submit":
            _, n, max_new, stop = op
            n = min(n, num_blocks * block_size - 1)
            max_new = max(1, min(max_new, num_blocks * block_size - n, 64 - n))
            sched.add_request(next_id, np.arange(10, 10 + n, dtype=np.int64), max_new, [stop])
            live.add(next_id)
            next_id += 1
        elif op[0] == "steps":
            for _ in range(op[1]):
                launched = False
                if sched.has_work():
                    plan = sched.schedule()
                    if plan.num_reqs:
                        pending.append(device.forward(plan))
                        sched.commit()
                        launched = True
                if len(pending) == 2 or (pending and not launched):
                    resolve_oldest()
                check_ownership(sched, live, awaiting_resolve_ok=True)
        else:
            assert sched.abort(op[1]) == (op[1] in live)
            live.discard(op[1])
    while pending:
        resolve_oldest()
    check_ownership(sched, live)
    for req_id in list(live):
        assert sched.abort(req_id)
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_work() and sched.num_used_tokens == 0
