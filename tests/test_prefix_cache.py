"""Prefix caching in the native scheduler core: hash-chained full blocks shared
between requests (prompt and output blocks, across turns and preemptions), exact
reference counts, LRU eviction tail first, flush, caching off, n>1 siblings
(`wait_for`), collision safety, KV events, and outputs equal to a no-cache run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from tokenspeed_worker.scheduler.scheduler import ROOT_BLOCK_HASH, Scheduler, block_hash
from tokenspeed_worker.scheduler.plan import SchedulePlan

from test_scheduler_core import check_plan

MASK64 = (1 << 64) - 1


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    token_budget: int = 64,
    **kwargs,
) -> Scheduler:
    return Scheduler(num_blocks, block_size, max_num_seqs, max_model_len, token_budget, **kwargs)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def seq(n: int, start: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


class Driver:
    """Steps a scheduler, sampling distinct tokens, and keeps every plan's rows."""

    def __init__(self, sched: Scheduler, first_token: int = 1000) -> None:
        self.sched = sched
        self.token = first_token
        self.outputs: dict[int, list[int]] = {}
        self.rows: dict[int, list[tuple[int, int]]] = {}  # req -> [(context, query)]

    def step(self) -> tuple[SchedulePlan, list[int]]:
        plan = self.sched.schedule()
        if plan.num_reqs:
            check_plan(self.sched, plan)
        for b, r in enumerate(plan.req_ids.tolist()):
            self.rows.setdefault(r, []).append((int(plan.context_lens[b]), int(plan.query_lens[b])))
        sampled = np.arange(self.token, self.token + len(plan.sample_rows), dtype=np.int64)
        self.token += len(sampled)
        for b, t in zip(plan.sample_rows.tolist(), sampled.tolist()):
            self.outputs.setdefault(int(plan.req_ids[b]), []).append(t)
        done, _ = self.sched.advance(sampled)
        return plan, done.tolist()

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not drain")


def py_splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def py_block_hash(parent: int | None, tokens, bits: int = 64) -> int:
    """The documented hash (block_hash.hpp), re-implemented: signed int64 out."""
    h = (ROOT_BLOCK_HASH if parent is None else parent) & MASK64
    for t in tokens:
        h = py_splitmix64(h ^ (int(t) & MASK64))
    h &= (1 << bits) - 1
    return h - (1 << 64) if h >= 1 << 63 else h


def chain_hashes(tokens: np.ndarray, block_size: int, bits: int = 64) -> list[int]:
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        hashes.append(py_block_hash(hashes[-1] if hashes else None, tokens[i * block_size : (i + 1) * block_size], bits))
    return hashes


# -- the hash ------------------------------------------------------------------------


def test_block_hash_is_the_documented_deterministic_chain():
    tokens = seq(8, 5)
    h0 = block_hash(None, tokens[:4])
    assert h0 == py_block_hash(None, tokens[:4])
    assert block_hash(h0, tokens[4:]) == py_block_hash(h0, tokens[4:])
    assert block_hash(None, [5, 6, 7, 8]) == h0  # any int iterable
    assert block_hash(None, tokens[:4]) != block_hash(None, tokens[1:5])
    assert -(1 << 63) <= h0 < (1 << 63)


# -- matching ------------------------------------------------------------------------


def test_shared_prefix_matches_exactly_its_full_blocks():
    sched = make(block_size=4)
    drv = Driver(sched)
    a = seq(10, 100)
    sched.add_request(1, a, 5, [])
    drv.step()  # 1 computed its 10 prompt tokens: blocks 0 and 1 are full and registered
    assert sched.num_cached_blocks == 2
    b = np.concatenate([a[:9], seq(6, 500)])  # shares 9 tokens: 2 full blocks
    sched.add_request(2, b, 3, [])
    plan, _ = drv.step()
    row = list(plan.req_ids).index(2)
    assert plan.context_lens[row] == 8 and plan.query_lens[row] == len(b) - 8
    assert list(plan.positions[plan.cu_query_lens[row] :]) == list(range(8, len(b)))
    np.testing.assert_array_equal(plan.input_ids[plan.cu_query_lens[row] :], b[8:])
    assert list(sched.block_ids(2)[:2]) == list(sched.block_ids(1)[:2])
    assert list(sched.cached_tokens(ids(1, 2, 77))) == [0, 8, 0]
    assert sched.prefix_query_tokens == 10 + 15 and sched.prefix_hit_tokens == 8
    assert sched.cache_hit_rate == pytest.approx(8 / 25)
    assert sched.cached_tokens(ids(2)).dtype == np.int32


def test_whole_prompt_cached_still_computes_a_token():
    sched = make(block_size=4)
    drv = Driver(sched)
    sched.add_request(1, seq(8, 100), 1, [])
    drv.run()
    assert sched.num_cached_blocks == 2 and sched.num_evictable_blocks == 2
    sched.add_request(2, seq(8, 100), 2, [])  # identical: the last block is recomputed
    sched.add_request(3, seq(9, 100), 2, [])  # one more token: both blocks match
    plan, _ = drv.step()
    assert list(plan.req_ids) == [2, 3]
    assert list(plan.context_lens) == [4, 8] and list(plan.query_lens) == [4, 1]
    assert list(plan.sample_rows) == [0, 1]
    assert list(sched.cached_tokens(ids(2, 3))) == [4, 8]
    drv.run()
    assert sched.num_free_blocks == sched.num_total_blocks


def test_multi_turn_reuses_prompt_and_output_blocks():
    sched = make(block_size=4)
    drv = Driver(sched)
    turn1 = seq(10, 100)
    sched.add_request(1, turn1, 7, [])
    tables = []
    while sched.contains(1):
        if sched.block_ids(1).size:
            tables.append(sched.block_ids(1).copy())
        drv.step()
    history = np.concatenate([turn1, drv.outputs[1]])  # 17 tokens, 16 computed: 4 blocks
    turn2 = np.concatenate([history, seq(5, 900)])
    sched.add_request(2, turn2, 2, [])
    plan, _ = drv.step()
    assert plan.context_lens[0] == 16 and sched.cached_tokens(ids(2))[0] == 16
    # block 3 holds only generated tokens (positions 12..15)
    assert list(sched.block_ids(2)[:4]) == list(tables[-1][:4])


def test_preempted_request_readmission_reuses_its_surviving_prefix():
    sched = make(num_blocks=8, block_size=2, token_budget=64)
    drv = Driver(sched)
    sched.add_request(1, seq(4, 100), 8, [])
    sched.add_request(2, seq(4, 200), 8, [])
    before = None
    while sched.num_preemptions == 0:
        if sched.block_ids(2).size:
            before = sched.block_ids(2).copy()
        drv.step()
    assert sched.block_ids(2).size == 0
    while sched.block_ids(2).size == 0:
        drv.step()
    # released tail first, so its prefix outlived the eviction of its tail
    readmitted = drv.rows[2][-1]
    assert readmitted[0] == 4
    assert list(sched.block_ids(2)[:2]) == list(before[:2])
    drv.run()
    ref = make(num_blocks=100, block_size=2, enable_prefix_caching=False)
    ref_drv = Driver(ref)
    ref.add_request(1, seq(4, 100), 8, [])
    ref.add_request(2, seq(4, 200), 8, [])
    ref_drv.run()
    assert len(drv.outputs[2]) == len(ref_drv.outputs[2]) == 8


# -- eviction ------------------------------------------------------------------------


def test_eviction_is_lru_and_tail_first():
    sched = make(num_blocks=6, block_size=2, enable_kv_events=True)
    drv = Driver(sched)
    a, b = seq(4, 100), seq(4, 200)
    ha, hb = chain_hashes(a, 2), chain_hashes(b, 2)
    for req_id, p in ((1, a), (2, b)):
        sched.add_request(req_id, p, 1, [])
        drv.run()
    assert sched.num_evictable_blocks == 4 and sched.num_free_blocks == 6
    sched.drain_kv_events()
    # Touch a's first block: re-matching takes it off the LRU list; released again, it
    # is the most recent.
    sched.add_request(3, np.concatenate([a[:2], ids(7)]), 1, [])
    drv.run()
    assert sched.cached_tokens(ids(3))[0] == 0  # already forgotten after finishing
    assert drv.rows[3][0] == (2, 1)
    # LRU now: a1, b1, b0, a0 (b released tail first; a0 re-released last)
    sched.add_request(4, seq(11, 300), 1, [])  # 6 blocks: 2 free, then evicts all 4
    plan, _ = drv.step()
    removed = [e[1] for e in sched.drain_kv_events() if e[0] == "removed"]
    assert removed == [ha[1], hb[1], hb[0], ha[0]]
    drv.run()


def test_partial_eviction_keeps_the_prefix():
    sched = make(num_blocks=5, block_size=2)
    drv = Driver(sched)
    a = seq(6, 100)  # 3 full blocks, released tail first
    sched.add_request(1, a, 1, [])
    drv.run()
    sched.add_request(2, seq(5, 500), 1, [])  # 3 blocks: 2 free + the evicted tail of a
    drv.run()
    sched.add_request(3, np.concatenate([a, ids(1)]), 1, [])
    drv.step()
    assert drv.rows[3][0] == (4, 3)  # a's first two blocks survived


def test_referenced_blocks_are_never_evicted_or_reused():
    sched = make(num_blocks=10, block_size=2, max_num_seqs=4)
    drv = Driver(sched)
    shared = seq(6, 100)
    sched.add_request(1, shared, 1, [])
    drv.run()  # 3 evictable blocks
    sched.add_request(2, np.concatenate([shared, ids(9)]), 5, [])
    drv.step()  # 2 matched the 3 cached blocks: off the LRU list, ref 1
    assert drv.rows[2][0] == (6, 1)
    held = set(sched.block_ids(2).tolist())
    refs, evictable, _ = sched.debug_blocks()
    assert all(refs[b] == 1 and not evictable[b] for b in held)
    assert sched.num_evictable_blocks == 0
    sched.add_request(3, seq(7, 700), 1, [])  # needs every block 2 will not hold
    while sched.contains(3):
        drv.step()
        if sched.contains(3):
            assert held.isdisjoint(sched.block_ids(3).tolist())
        assert held <= set(sched.block_ids(2).tolist())
    sched.abort(2)
    assert sched.num_free_blocks == sched.num_total_blocks


# -- flush ---------------------------------------------------------------------------


def test_flush_while_requests_run():
    sched = make(block_size=4, enable_kv_events=True)
    drv = Driver(sched)
    sched.add_request(1, seq(12, 100), 1, [])
    drv.run()  # 3 evictable blocks
    sched.add_request(2, seq(9, 500), 20, [])
    drv.step()
    drv.step()
    assert sched.num_cached_blocks == 5 and sched.num_evictable_blocks == 3
    held = sched.block_ids(2).copy()
    free_before = sched.num_free_blocks
    sched.drain_kv_events()
    plan = sched.schedule()  # flush between schedule and advance
    assert sched.flush_prefix_cache() == 5
    assert sched.drain_kv_events() == [("cleared",)]
    assert sched.num_cached_blocks == 0 and sched.num_evictable_blocks == 0
    assert sched.num_free_blocks == free_before
    sched.advance(np.full(len(plan.sample_rows), 3, dtype=np.int64))
    assert list(sched.block_ids(2)) == list(held)
    for _ in range(6):  # 2 keeps decoding; its new full blocks are not registered
        drv.step()
    assert sched.num_cached_blocks == 0
    sched.add_request(3, seq(13, 100), 1, [])
    sched.add_request(4, seq(10, 500), 1, [])
    drv.step()
    assert list(sched.cached_tokens(ids(3, 4))) == [0, 0]
    sched.abort(2)
    drv.run()
    cached = sched.num_cached_blocks
    assert cached == sched.num_evictable_blocks > 0
    assert sched.flush_prefix_cache() == cached
    assert sched.num_free_blocks == sched.num_total_blocks and sched.num_cached_blocks == 0


# -- caching off, siblings -----------------------------------------------------------


def test_caching_off_retains_nothing_but_siblings_share():
    sched = make(block_size=4, enable_prefix_caching=False, enable_kv_events=True)
    drv = Driver(sched)
    sched.add_request(1, seq(10, 100), 1, [])
    drv.run()
    assert sched.num_cached_blocks == 0 and sched.num_evictable_blocks == 0
    kinds = [e[0] for e in sched.drain_kv_events()]
    assert kinds == ["stored", "stored", "removed", "removed"]
    sched.add_request(2, seq(10, 100), 1, [])
    drv.step()
    assert drv.rows[2][0] == (0, 10) and sched.cached_tokens(ids(2))[0] == 0
    # n = 3 samples of one prompt: the prompt is prefilled once
    prompt = seq(14, 300)
    sched.add_request(10, prompt, 4, [])
    sched.add_request(11, prompt, 4, [], wait_for=10)
    sched.add_request(12, prompt, 4, [], wait_for=10)
    plan, _ = drv.step()
    assert list(plan.req_ids) == [10]
    plan, _ = drv.step()
    assert list(plan.req_ids) == [10, 11, 12]
    assert list(plan.context_lens) == [14, 12, 12] and list(plan.query_lens) == [1, 2, 2]
    assert list(sched.block_ids(11)[:3]) == list(sched.block_ids(10)[:3]) == list(sched.block_ids(12)[:3])
    assert list(sched.cached_tokens(ids(10, 11, 12))) == [0, 12, 12]
    drv.run()
    assert sched.num_free_blocks == sched.num_total_blocks and sched.num_cached_blocks == 0


def test_sibling_waits_without_blocking_the_queue():
    sched = make(block_size=4, token_budget=24)
    drv = Driver(sched)
    sched.add_request(1, seq(20, 100), 4, [])
    sched.add_request(2, seq(20, 100), 4, [], wait_for=1)
    sched.add_request(3, seq(4, 900), 4, [])  # behind the sibling, still admitted
    plan, _ = drv.step()
    assert list(plan.req_ids) == [1, 3] and sched.num_waiting == 1
    plan, _ = drv.step()  # 1 decodes now: its sibling is eligible
    assert list(plan.req_ids) == [1, 3, 2]
    assert list(plan.context_lens) == [20, 4, 16]


def test_sibling_of_an_aborted_or_unknown_parent():
    for caching in (True, False):
        sched = make(block_size=4, token_budget=8, enable_prefix_caching=caching)
        drv = Driver(sched)
        sched.add_request(1, seq(20, 100), 4, [])
        sched.add_request(2, seq(20, 100), 4, [], wait_for=1)
        drv.step()
        drv.step()  # 1 is mid-prefill (16 of 20): its sibling still waits
        assert sched.num_waiting == 1 and sched.block_ids(2).size == 0
        sched.abort(1)
        drv.step()
        # its computed blocks outlive it only in the cache
        assert drv.rows[2][0][0] == (16 if caching else 0)
        sched.add_request(3, seq(3, 5), 2, [], wait_for=999)  # unknown parent: no wait
        drv.run()
        assert 3 in drv.rows
    with pytest.raises(ValueError, match="itself"):
        sched.add_request(4, seq(3, 5), 2, [], wait_for=4)


def test_sibling_does_not_follow_a_reused_parent_id():
    sched = make(block_size=4)
    drv = Driver(sched)
    sched.add_request(1, seq(8, 100), 1, [])
    drv.run()  # 1 finished: the id is free again
    sched.add_request(1, seq(20, 500), 4, [])
    sched.add_request(2, seq(9, 100), 2, [], wait_for=1)  # 1 is live: a sibling of the new 1
    plan, _ = drv.step()
    assert list(plan.req_ids) == [1]


# -- collisions ----------------------------------------------------------------------


def test_hash_collision_never_matches_other_tokens():
    bits = 1  # every hash is 0 or 1: collisions everywhere
    sched = make(block_size=2, _hash_bits=bits)
    drv = Driver(sched)
    a = ids(10, 11, 12, 13)
    sched.add_request(1, a, 1, [])
    drv.run()
    h0 = py_block_hash(None, a[:2], bits)
    assert sched.num_cached_blocks == 2 or chain_hashes(a, 2, bits)[1] == h0
    # a first block with a's block-0 hash but other tokens
    other = next(ids(t, t) for t in range(100) if py_block_hash(None, [t, t], bits) == h0)
    sched.add_request(2, np.concatenate([other, a[2:], ids(1)]), 1, [])
    drv.step()
    assert drv.rows[2][0][0] == 0  # same hash, other tokens: no match
    # a's exact tokens still match
    sched.add_request(3, np.concatenate([a, ids(1)]), 1, [])
    drv.step()
    assert drv.rows[3][0][0] >= 2


def test_hash_collision_after_another_parent_never_matches():
    """Same tokens, same (narrowed) hash, but a different parent block: the block's
    K/V was computed after other tokens, so it must not match."""
    bits, bs = 8, 2
    sched = make(block_size=bs, _hash_bits=bits)
    drv = Driver(sched)
    parent_a, t = ids(10, 11), ids(20, 21)
    x_a = py_block_hash(None, parent_a, bits)
    y = py_block_hash(x_a, t, bits)
    parent_c = next(
        ids(u, v)
        for u in range(30, 300)
        for v in range(30, 300)
        if (x_c := py_block_hash(None, [u, v], bits)) not in (x_a, y) and py_block_hash(x_c, t, bits) == y
    )
    sched.add_request(1, np.concatenate([parent_a, t, ids(1)]), 1, [])
    drv.run()
    sched.add_request(2, np.concatenate([parent_c, ids(1)]), 1, [])
    drv.run()
    assert sched.num_cached_blocks == 3
    sched.add_request(3, np.concatenate([parent_c, t, ids(1)]), 1, [])
    drv.step()
    assert drv.rows[3][0] == (2, 3)  # parent_c's block only; a's second block is refused


# -- KV events -----------------------------------------------------------------------


def test_kv_events_in_order():
    sched = make(num_blocks=4, block_size=4, enable_kv_events=True)
    drv = Driver(sched)
    a = seq(9, 100)
    h = chain_hashes(a, 4)
    sched.add_request(1, a, 1, [])
    drv.run()
    assert sched.drain_kv_events() == [
        ("stored", h[0], None, list(range(100, 104)), 4),
        ("stored", h[1], h[0], list(range(104, 108)), 4),
    ]
    assert sched.drain_kv_events() == []
    sched.add_request(2, seq(15, 500), 1, [])  # 4 blocks: evicts a's, tail first
    drv.run()
    events = sched.drain_kv_events()
    assert events[:2] == [("removed", h[1]), ("removed", h[0])]
    assert [e[0] for e in events[2:]] == ["stored"] * 3
    sched.flush_prefix_cache()
    assert sched.drain_kv_events() == [("cleared",)]
    quiet = make()
    quiet.add_request(1, a, 1, [])
    Driver(quiet).run()
    assert quiet.drain_kv_events() == []


# -- invariants under random operations ---------------------------------------------


def check_pool(sched: Scheduler, live: set[int], bits: int) -> None:
    refs, evictable, registered = sched.debug_blocks()
    tables = {r: sched.block_ids(r) for r in live}
    held = np.concatenate(list(tables.values())) if tables else np.zeros(0, dtype=np.int32)
    assert int(refs.sum()) == len(held)
    assert np.array_equal(refs, np.bincount(held, minlength=len(refs)))
    referenced = refs > 0
    evict = evictable.astype(bool)
    assert not (evict & referenced).any()
    assert (registered[evict] == 1).all()
    num_free = sched.num_free_blocks - sched.num_evictable_blocks
    assert int(evict.sum()) == sched.num_evictable_blocks
    assert num_free + sched.num_evictable_blocks + int(referenced.sum()) == sched.num_total_blocks
    assert int(registered.sum()) == sched.num_cached_blocks
    bs = sched.block_size
    for block in np.flatnonzero(registered):
        block_hash_, parent, tokens = sched.debug_cached_block(int(block))
        assert len(tokens) == bs
        assert block_hash_ == py_block_hash(parent, tokens, bits)
    for r, table in tables.items():
        tokens = sched.token_ids(r)
        full = min(len(table), len(tokens) // bs)
        hashes = chain_hashes(tokens[: full * bs], bs, bits)
        for j in range(full):
            entry = sched.debug_cached_block(int(table[j]))
            if entry is not None:  # a registered block in its table holds its tokens
                assert np.array_equal(entry[2], tokens[j * bs : (j + 1) * bs])
                assert entry[0] == hashes[j] and entry[1] == (hashes[j - 1] if j else None)


PREFIXES = [seq(7, 10), seq(5, 40), np.concatenate([seq(5, 10), seq(4, 70)])]

add_op = st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 6), st.integers(1, 12), st.booleans())
steps_op = st.tuples(st.just("steps"), st.integers(1, 6), st.integers(0, 10**6))
prefix_operation = st.one_of(
    add_op, add_op, add_op,
    st.tuples(st.just("next_turn"), st.integers(0, 40), st.integers(0, 4), st.integers(1, 8)),
    steps_op, steps_op, steps_op,
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("flush"), st.integers(0, 3)),  # 2, 3: no-op, so flushes stay rare
)


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 12),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 4),
    token_budget=st.integers(1, 16),
    chunked=st.booleans(),
    caching=st.booleans(),
    bits=st.sampled_from([64, 64, 2]),
    ops=st.lists(prefix_operation, min_size=15, max_size=50),
)
def test_random_operations_keep_reference_counts_exact(
    num_blocks, block_size, max_num_seqs, token_budget, chunked, caching, bits, ops
):
    sched = make(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=48,
        token_budget=token_budget, chunked_prefill=chunked, max_prefill_tokens=token_budget,
        enable_prefix_caching=caching, enable_kv_events=True, _hash_bits=bits,
    )
    live: set[int] = set()
    next_id = 0
    rng = np.random.default_rng(len(ops))
    history: dict[int, np.ndarray] = {}  # every request's last known tokens

    def add(p: np.ndarray, max_new: int, wait_for: int = -1) -> None:
        nonlocal next_id
        max_new = max(1, min(max_new, num_blocks * block_size - len(p), 48 - len(p)))
        try:
            sched.add_request(next_id, p, max_new, [5], wait_for=wait_for)
            live.add(next_id)
            history[next_id] = p
        except ValueError:
            assert -(-(len(p) + max_new) // block_size) > num_blocks or len(p) + max_new > 48
        next_id += 1

    for op in ops:
        if op[0] == "add":
            _, which, extra, max_new, sibling = op
            base = PREFIXES[which] if which < len(PREFIXES) else seq(0, 0)
            p = np.concatenate([base, rng.integers(0, 4, extra)]).astype(np.int64)
            if len(p) == 0:
                p = ids(1)
            add(p, max_new, max(live) if sibling and live else -1)
        elif op[0] == "next_turn":  # prompt = an earlier request's prompt + output + more
            _, of, extra, max_new = op
            if of in live:
                history[of] = sched.token_ids(of)
            if of in history:
                add(np.concatenate([history[of], rng.integers(0, 4, extra)]).astype(np.int64), max_new)
        elif op[0] == "steps":
            step_rng = np.random.default_rng(op[2])
            for _ in range(op[1]):
                plan = sched.schedule()
                if plan.num_reqs:
                    check_plan(sched, plan)
                for r in plan.req_ids.tolist():
                    history[r] = sched.token_ids(r)
                done, _ = sched.advance(step_rng.integers(0, 6, len(plan.sample_rows)))
                live -= set(done.tolist())
                check_pool(sched, live, bits)
        elif op[0] == "abort":
            assert sched.abort(op[1]) == (op[1] in live)
            live.discard(op[1])
        elif op[0] == "flush" and op[1] < 2:
            if op[1] == 1:  # flush between schedule and advance
                plan = sched.schedule()
                sched.flush_prefix_cache()
                check_pool(sched, live, bits)
                done, _ = sched.advance(np.zeros(len(plan.sample_rows), dtype=np.int64))
                live -= set(done.tolist())
            else:
                sched.flush_prefix_cache()
            assert sched.num_cached_blocks == 0
        check_pool(sched, live, bits)
    target(float(sched.prefix_hit_tokens), label="prefix hits")
    sched.drain_kv_events()
    for r in list(live):
        assert sched.abort(r)
    refs, _, _ = sched.debug_blocks()
    assert not refs.any() and sched.num_free_blocks == sched.num_total_blocks
    sched.flush_prefix_cache()
    assert sched.num_evictable_blocks == 0 and sched.num_cached_blocks == 0
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_work()


# -- reference equivalence -----------------------------------------------------------

VOCAB = 50


def run_conversations(sched: Scheduler, requests: list[tuple], follow_ups: dict[int, tuple]) -> dict[int, list[int]]:
    """A fake model whose next token hashes every earlier token, read back from a
    simulated KV pool through the block tables: a wrong match, a reused block or a
    lost token changes the outputs. `requests` are (id, prompt, max_new, stops,
    wait_for); when request r finishes, follow_ups[r] = (id, extra, max_new) is added
    with prompt = r's prompt + output + extra (the next turn)."""
    bs = sched.block_size
    kv = np.full(sched.num_total_blocks * bs, -1, dtype=np.int64)
    prompts = {req[0]: np.asarray(req[1], dtype=np.int64) for req in requests}
    outputs: dict[int, list[int]] = {req[0]: [] for req in requests}
    for req_id, p, max_new, stops, wait_for in requests:
        sched.add_request(req_id, p, max_new, stops, wait_for=wait_for)
    steps = 0
    while sched.has_work():
        steps += 1
        assert steps < 20_000
        plan = sched.schedule()
        kv[plan.slot_mapping] = plan.input_ids
        sampled = []
        for b in plan.sample_rows:
            pos = np.arange(plan.seq_lens[b])
            history = kv[plan.block_tables[b][pos // bs].astype(np.int64) * bs + pos % bs]
            assert (history >= 0).all()
            sampled.append(int((history * (pos * 7 + 3)).sum() % VOCAB))
            outputs[int(plan.req_ids[b])].append(sampled[-1])
        done, _ = sched.advance(np.array(sampled, dtype=np.int64))
        for r in done.tolist():
            if r in follow_ups:
                new_id, extra, max_new = follow_ups[r]
                p = np.concatenate([prompts[r], outputs[r], extra]).astype(np.int64)
                prompts[new_id] = p
                outputs[new_id] = []
                sched.add_request(new_id, p, max_new, [])
    return outputs


def conversations(rng: np.random.Generator) -> tuple[list[tuple], dict[int, tuple]]:
    """Requests over three shared system prompts, sibling groups, and second turns."""
    systems = [rng.integers(0, VOCAB, n) for n in (9, 14, 5)]
    requests, follow_ups = [], {}
    req_id = 0
    for _ in range(10):
        p = np.concatenate([systems[rng.integers(0, 3)], rng.integers(0, VOCAB, rng.integers(1, 8))])
        first = req_id
        requests.append((first, p, int(rng.integers(1, 10)), [int(rng.integers(0, VOCAB))], -1))
        req_id += 1
        for _ in range(int(rng.integers(0, 3))):  # n > 1 samples
            requests.append((req_id, p, int(rng.integers(1, 10)), [int(rng.integers(0, VOCAB))], first))
            req_id += 1
        if rng.random() < 0.5:
            follow_ups[first] = (1000 + first, rng.integers(0, VOCAB, rng.integers(1, 5)), int(rng.integers(1, 6)))
    return requests, follow_ups


@pytest.mark.parametrize("seed", range(4))
def test_outputs_with_prefix_caching_match_the_uncached_reference(seed):
    requests, follow_ups = conversations(np.random.default_rng(seed))
    reference = make(
        num_blocks=10_000, block_size=4, max_num_seqs=64, max_model_len=128, token_budget=4096,
        chunked_prefill=False, max_prefill_tokens=100_000, enable_prefix_caching=False,
    )
    expected = run_conversations(reference, requests, follow_ups)
    # largest request: 14 + 7 + 9 (turn 1) + 4 + 5 = 39 tokens
    tight_configs = [
        dict(num_blocks=12, block_size=4, token_budget=16),
        dict(num_blocks=24, block_size=2, token_budget=7),
        dict(num_blocks=14, block_size=3, token_budget=33),
        dict(num_blocks=12, block_size=4, token_budget=16, chunked_prefill=False),
        dict(num_blocks=12, block_size=4, token_budget=16, _hash_bits=2),
        dict(num_blocks=24, block_size=2, token_budget=5, enable_prefix_caching=False),
    ]
    hits = preemptions = 0
    for config in tight_configs:
        tight = make(max_num_seqs=6, max_model_len=128, **config)
        got = run_conversations(tight, requests, follow_ups)
        assert got == expected, config
        assert tight.num_free_blocks == tight.num_total_blocks
        hits += tight.prefix_hit_tokens
        preemptions += tight.num_preemptions
    assert hits > 0 and preemptions > 0


def test_kv_events_wire_bytes_equal_the_python_encoding():
    """drain_kv_events_wire (the native protobuf encoder the engine uses) writes exactly what the
    Python encoder makes of drain_kv_events' tuples: the same scheduler history driven twice."""
    from tokenspeed_worker.engine.kv_event_publisher import events_wire
    from tokenspeed_worker.proto import common_pb2

    def history(sched):
        drv = Driver(sched)
        sched.add_request(1, seq(9, 100), 1, [])
        drv.run()
        sched.add_request(2, seq(15, 500), 1, [])  # evicts the first request's blocks
        drv.run()
        sched.flush_prefix_cache()
        sched.add_request(3, seq(13, 900), 1, [])
        drv.run()

    tuples, native = make(num_blocks=4, block_size=4, enable_kv_events=True), \
        make(num_blocks=4, block_size=4, enable_kv_events=True)
    history(tuples)
    history(native)
    events = tuples.drain_kv_events()
    assert {e[0] for e in events} == {"stored", "removed", "cleared"}
    assert any(e[0] == "stored" and e[1] < 0 for e in events)  # negative int64 hashes: 10-byte varints
    data, count = native.drain_kv_events_wire(7, 3)
    want, want_count = events_wire(events, 7, 3)
    assert count == want_count and count < len(events)  # chains merged
    assert common_pb2.KvEventBatch.FromString(data) == common_pb2.KvEventBatch.FromString(want)
    assert [e.event_id for e in common_pb2.KvEventBatch.FromString(data).events] == [7 + 3 * i for i in range(count)]
    assert native.drain_kv_events_wire(0, 1) == (b"", 0)
