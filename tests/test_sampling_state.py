"""SamplingState: rows come and go, grow, share a penalty slot pool, and count outputs on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tokenspeed_worker.sampling.sampler import Sampler
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.sampling.state import SamplingState

PENALIZED = SamplingParams(frequency_penalty=0.5)


def test_rows_grow_past_the_initial_capacity_and_keep_their_parameters():
    state = SamplingState(2, 50)
    for row in range(9):
        state.add_row(row, np.array([1]), SamplingParams(temperature=0.1 * row, top_k=row, seed=row))
    assert state.capacity == 16
    state.ensure_capacity(40)
    assert state.capacity == 64
    batch = state.batch(np.array([8, 0, 5]))
    torch.testing.assert_close(batch.temperature, torch.tensor([0.8, 0.0, 0.5]))
    assert batch.top_k.tolist() == [8, 0, 5] and batch.seed.tolist() == [8, 0, 5]
    assert batch.output_positions.tolist() == [0, 0, 0]
    assert not batch.all_greedy and batch.any_top_k and batch.max_top_k == 8


def test_add_and_remove_rows_and_refuse_misuse():
    state = SamplingState(4, 50)
    state.add_row(1, np.array([1, 2]), SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        state.add_row(1, np.array([1]), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.add_row(2, np.array([1]), SamplingParams(logit_bias={50: 1.0}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.add_row(2, np.array([1]), SamplingParams(token_ids_logprob=[-1]))
    assert not state.is_active(2)  # a refused row holds nothing
    state.remove_row(1)
    with pytest.raises(ValueError, match="not in use"):
        state.remove_row(1)
    # A recycled row starts afresh.
    state.add_row(1, np.array([1]), SamplingParams(temperature=0.0))
    assert state.output_positions(np.array([1])).tolist() == [0]
    assert state.batch(np.array([1])).plain_argmax


def test_an_all_greedy_batch_copies_no_basic_tensors():
    # Only sampled rows read the basic surface: an all-greedy batch leaves it None (no copies),
    # and the sampler still applies what changes the logits (here a min_new_tokens stop).
    state = SamplingState(4, 50)
    state.add_row(0, np.array([1]), SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(7,)))
    state.add_row(1, np.array([1]), SamplingParams(temperature=0.0))
    batch = state.batch(np.array([0, 1]))
    assert batch.all_greedy and batch.temperature is None and batch.seed is None
    assert not batch.plain_argmax and batch.stop_positions.tolist() == [0]
    logits = torch.zeros(2, 50)
    logits[:, 7] = 5.0
    assert Sampler().sample(logits, batch).tokens.tolist() == [0, 7]
    # A graph's argmax is taken as the tokens of a plain-argmax batch, never of any other.
    plain = state.batch(np.array([1]))
    given = torch.tensor([42])
    assert Sampler().sample(logits[1:], plain, greedy=given).tokens is given
    assert Sampler().sample(logits, batch, greedy=torch.tensor([1, 1])).tokens.tolist() == [0, 7]


def test_update_counts_over_several_steps_equal_counting_tokens():
    rng = np.random.default_rng(0)
    vocab = 64
    state = SamplingState(4, vocab)
    rows = np.array([0, 1, 2, 3])
    for row in rows:  # rows 0 and 2 penalized
        state.add_row(row, np.array([5]), PENALIZED if row % 2 == 0 else SamplingParams())
    history = {int(r): [] for r in rows}
    for step in range(12):
        active = rng.permutation(rows)[: rng.integers(1, 5)]
        tokens = rng.integers(0, vocab, active.shape[0])
        tokens[0] = 7  # repeats
        state.update(active, torch.from_numpy(tokens) if step % 2 else tokens)
        for row, token in zip(active.tolist(), tokens.tolist()):
            history[row].append(token)
    for row in rows.tolist():
        assert state.output_positions(np.array([row]))[0] == len(history[row])
        counts = state.output_counts(row)
        if row % 2 == 0:
            assert counts.dtype == torch.int32
            assert counts.tolist() == np.bincount(history[row], minlength=vocab).tolist()
        else:
            assert counts is None


def test_penalty_slots_are_reused_and_memory_is_released_on_remove():
    vocab = 1000
    state = SamplingState(8, vocab)
    assert state.penalty_pool_bytes == 0
    state.add_row(0, np.array([1]), SamplingParams())  # no penalty: no pool
    assert state.num_penalty_slots == 0
    for row in range(1, 6):
        state.add_row(row, np.array([row]), PENALIZED)
    assert state.num_penalty_slots == 8  # grown by doubling from 4
    assert state.penalty_pool_bytes == 8 * vocab * (4 + 1)
    state.update(np.array([3]), np.array([9]))
    slot_of_3 = state._slot[3]
    state.remove_row(3)
    state.add_row(6, np.array([2]), SamplingParams(presence_penalty=1.0))
    assert state._slot[6] == slot_of_3 and state.num_penalty_slots == 8  # reused, not grown
    assert int(state.output_counts(6).sum()) == 0  # and cleared
    for row in (1, 2, 4, 5, 6):
        state.remove_row(row)
    assert state.penalty_pool_bytes == 0 and state.num_penalty_slots == 0
    state.remove_row(0)


def test_repetition_prompt_mask_comes_from_the_prompt_and_ignores_ids_past_the_vocabulary():
    vocab = 30
    state = SamplingState(2, vocab)
    state.add_row(0, np.array([3, 3, 12, 45]), SamplingParams(repetition_penalty=2.0))
    logits = torch.full((1, vocab), 4.0)
    processed = Sampler.process_logits(logits, state.batch(np.array([0])))[0]
    assert (processed == 2.0).nonzero().flatten().tolist() == [3, 12]


def test_min_new_tokens_rows_leave_the_mask_once_they_reach_it():
    state = SamplingState(2, 30)
    state.add_row(0, np.array([1]), SamplingParams(min_new_tokens=2, stop_token_ids=[29, 29, 3]))
    state.add_row(1, np.array([1]), SamplingParams(min_new_tokens=5, stop_token_ids=[]))  # nothing to mask
    batch = state.batch(np.array([1, 0]))
    assert batch.stop_positions.tolist() == [1] and sorted(batch.stop_token_ids[0].tolist()) == [3, 29]
    state.update(np.array([0, 1]), np.array([4, 4]))
    state.update(np.array([0, 1]), np.array([4, 4]))
    assert state.batch(np.array([1, 0])).stop_positions is None


def test_logprob_requests_are_gathered_per_batch():
    state = SamplingState(4, 30)
    state.add_row(0, np.array([1]), SamplingParams(return_logprob=True, top_logprobs_num=2))
    state.add_row(1, np.array([1]), SamplingParams(top_logprobs_num=5, token_ids_logprob=[7, 8, 9]))
    state.add_row(2, np.array([1]), SamplingParams())
    batch = state.batch(np.array([2, 0, 1]))
    assert batch.return_logprob and batch.top_logprobs_num == 5
    assert batch.token_ids_logprob_counts.tolist() == [0, 0, 3]
    assert batch.token_ids_logprob[2].tolist() == [7, 8, 9]
    plain = state.batch(np.array([2]))
    assert not plain.needs_logprobs
    state.remove_row(0)
    state.remove_row(1)
    assert state._num_logprobs == 0


def test_preempted_rows_keep_their_state_without_re_adding():
    # Preemption frees KV blocks only; the row, its position and counts continue.
    state = SamplingState(2, 40)
    state.add_row(0, np.array([1, 2]), SamplingParams(seed=9, frequency_penalty=1.0))
    state.update(np.array([0]), np.array([5]))
    state.update(np.array([0]), np.array([5]))
    batch = state.batch(np.array([0]))  # ... preempted and resumed here: same call, same state
    assert batch.output_positions.tolist() == [2]
    assert state.output_counts(0)[5].item() == 2


def test_drafted_positions_count_the_drafts_before_them():
    """A speculative step's positions 1..k of a penalized row see the drafts before them as output
    tokens (and min_new_tokens counts them): the processed logits equal those of decoding the
    drafts one step at a time."""
    vocab = 40
    params = SamplingParams(temperature=0.7, seed=1, frequency_penalty=0.5, presence_penalty=0.2,
                            repetition_penalty=1.3, min_new_tokens=2, stop_token_ids=[9])
    prompt = np.array([3, 4, 5])
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    drafts = [7, 7, 9]
    spec = SamplingState(4, vocab)
    spec.add_row(1, prompt, params)
    spec.update(np.array([1]), np.array([4]))  # one output token so far
    batch = spec.batch(np.array([1, 1, 1, 1]), offsets=np.array([0, 1, 2, 3]), inputs=np.array([-1] + drafts))
    got = Sampler.process_logits(logits.repeat(4, 1), batch)
    plain = SamplingState(4, vocab)
    plain.add_row(1, prompt, params)
    plain.update(np.array([1]), np.array([4]))
    for j in range(4):
        if j:
            plain.update(np.array([1]), np.array([drafts[j - 1]]))
        want = Sampler.process_logits(logits, plain.batch(np.array([1])))
        torch.testing.assert_close(got[j:j + 1], want)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.lists(st.integers(0, 99), max_size=9)), min_size=1, max_size=25),
       st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
def test_ragged_padding_is_always_the_rows_own_ids(ops, gathered):
    """Whatever order rows are set, cleared and widened in, a gathered row's padding holds only its
    own ids (and value 0): a scatter over the whole padded row sets or adds nothing else."""
    from tokenspeed_worker.sampling.state import _Ragged

    ragged = _Ragged(2, with_values=True)
    own: dict[int, list[int]] = {}
    for row, ids in ops:
        if row >= ragged.counts.shape[0]:
            ragged.grow_rows(row + 1)
        if ids:
            ragged.set(row, np.asarray(ids, np.int64), np.arange(1, len(ids) + 1, dtype=np.float32))
            own[row] = ids
        else:
            ragged.clear(row)
            own.pop(row, None)
    rows = np.asarray([r for r in gathered if r in own], np.int64)
    if not rows.size:
        return
    ids, values = ragged.gather(rows)
    for i, row in enumerate(rows):
        n = len(own[row])
        assert ids[i, :n].tolist() == own[row] and values[i, :n].tolist() == list(range(1, n + 1))
        assert set(ids[i, n:].tolist()) <= set(own[row]) and not values[i, n:].any()
