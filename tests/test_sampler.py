"""The batched sampler: greedy, filters, penalties, bias, min-tokens, seeded reproducibility, backends,
and the distribution it draws from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from tokenspeed_worker.sampling.sampler import (
    SAMPLING_BACKENDS,
    Sampler,
    SamplingBatch,
    default_sampling_backend,
    hashed_uniform,
    triton_sampling_available,
)
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.sampling.state import SamplingState

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, device="cpu"):
    per_row = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * n  # noqa: E731
    return SamplingBatch.from_lists(
        per_row(temperature), per_row(top_k), per_row(top_p), per_row(min_p),
        seeds if seeds is not None else list(range(n)), positions if positions is not None else [0] * n, device,
    )


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The target distribution, written plainly: temperature, top-k, top-p, min-p, renormalize."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        mass_before = np.cumsum(q[order]) - q[order]
        keep[order[mass_before >= top_p]] = False
        q = np.where(keep, p, 0.0)
        q /= q.sum()
    if min_p > 0.0:
        keep &= q >= min_p * q.max()
        q = np.where(keep, p, 0.0)
        q /= q.sum()
    return q


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = torch.randn(7, 300, device=device)
    tokens = Sampler().sample(logits, params(7, temperature=0.0, device=device)).tokens
    assert tokens.dtype == torch.int64 and tokens.device.type == device
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 1000)
    tokens = Sampler().sample(logits, params(64, temperature=1.5, top_k=1)).tokens
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(6, 50)
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 1.0]
    tokens = Sampler().sample(logits, params(6, temperature=temps, top_p=0.9)).tokens
    greedy_rows = [0, 2, 4]
    assert torch.equal(tokens[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_seeded_rows_reproduce_regardless_of_batch_mates_and_order():
    torch.manual_seed(0)
    logits = torch.randn(8, 400)
    seeds, positions = [11, 22, 33, 44, 55, 66, 77, 88], [0, 3, 3, 9, 1, 0, 2, 5]
    sampler = Sampler()
    full = sampler.sample(logits, params(8, 0.9, 50, 0.95, 0.01, seeds, positions)).tokens
    perm = [5, 2, 7, 0, 3]
    sub = sampler.sample(
        logits[perm], params(5, 0.9, 50, 0.95, 0.01, [seeds[i] for i in perm], [positions[i] for i in perm])
    ).tokens
    assert torch.equal(sub, full[perm])
    # Batch mates with other settings (greedy, other filters) change nothing either.
    mates = torch.randn(3, 400)
    mixed = sampler.sample(
        torch.cat([mates, logits[:2]]),
        SamplingBatch.from_lists([0.0, 2.0, 0.5, 0.9, 0.9], [0, 5, 0, 50, 50], [1.0, 0.5, 1.0, 0.95, 0.95],
                                   [0.0, 0.0, 0.2, 0.01, 0.01], [None, 1, 2, 11, 22], [0, 0, 0, 0, 3]),
    ).tokens
    assert torch.equal(mixed[3:], full[:2])


def test_seed_and_position_both_change_the_draw():
    logits = torch.zeros(1, 10_000)  # uniform: any change in noise changes the token

    def draw(seed, pos):
        return Sampler().sample(logits, params(1, seeds=[seed], positions=[pos])).tokens.item()

    assert draw(5, 0) == draw(5, 0)
    assert len({draw(5, p) for p in range(8)}) > 4
    assert len({draw(s, 0) for s in range(8)}) > 4


def test_from_lists_accepts_numpy_arrays_and_big_seeds():
    from_numpy = SamplingBatch.from_lists(
        np.array([0.0, 0.7], np.float32), np.array([-1, 5]), np.array([1.0, 0.9], np.float32),
        np.zeros(2, np.float32), np.array([3, 2**63 - 1]), np.array([0, 4]),
    )
    from_lists = SamplingBatch.from_lists([0.0, 0.7], [0, 5], [1.0, 0.9], [0.0, 0.0], [3, 2**64 - 1], [0, 4])
    assert torch.equal(from_numpy.top_k, torch.tensor([0, 5])) and from_numpy.any_top_k and not from_numpy.any_min_p
    assert not from_numpy.all_greedy and from_lists.seed.dtype == torch.int64
    logits = torch.randn(2, 100)
    assert torch.equal(Sampler().sample(logits, from_numpy).tokens, Sampler().sample(logits, from_lists).tokens)


def test_unseeded_rows_get_random_seeds():
    logits = torch.zeros(1, 10_000)
    draws = {Sampler().sample(logits, params(1, seeds=[None])).tokens.item() for _ in range(8)}
    assert len(draws) > 4


def test_hashed_uniform_is_uniform_and_open_interval():
    u = hashed_uniform(torch.tensor([0, 1, 2**40]), torch.tensor([0, 7, 3]), 200_000)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert (torch.corrcoef(u) - torch.eye(3)).abs().max() < 0.01


# A (seed, output position, vocab index) whose 24 hashed bits are all ones: (2^24 - 1 + 0.5) / 2^24
# rounds to 1.0 in float32, which made its Gumbel noise +inf (found by a first-contact sweep: a
# masked token drawn through a grammar, top_k=1 not greedy, about vocab / 2^24 of sampled tokens).
TOP_NOISE = (14991, 0, 1065)


def test_the_largest_hash_stays_below_one_and_its_token_obeys_every_filter():
    seed, position, index = TOP_NOISE
    u = hashed_uniform(torch.tensor([seed]), torch.tensor([position]), 4096)
    assert u[0, index] < 1.0 and torch.isfinite(-torch.log(-torch.log(u))).all()
    torch.manual_seed(0)
    logits = torch.randn(1, 4096)
    logits[0, index] = logits.min() - 1.0  # the least likely token
    sampler = Sampler("torch")
    top1 = sampler.sample(logits, params(1, temperature=1.0, top_k=1, seeds=[seed], positions=[position]))
    assert top1.tokens.tolist() == logits.argmax(dim=-1).tolist()
    banned = logits.clone()
    banned[0, index] = float("-inf")  # as a grammar mask or a -100 bias leaves it
    drawn = sampler.sample(banned, params(1, temperature=0.7, seeds=[seed], positions=[position])).tokens
    assert drawn.item() != index and torch.isfinite(banned[0, drawn]).all()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.6, 0, 1.0, 0.0),
        (1.3, 4, 1.0, 0.0),
        (1.0, 0, 0.7, 0.0),
        (0.8, 0, 1.0, 0.1),
        (1.0, 6, 0.8, 0.05),
    ],
)
def test_empirical_distribution_matches_filtered_softmax(temperature, top_k, top_p, min_p):
    vocab, n = 10, 40_000
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0])
    logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))]
    tokens = Sampler().sample(
        logits.expand(n, vocab).contiguous(),
        params(n, temperature, top_k, top_p, min_p, seeds=list(range(1000, 1000 + n))),
    ).tokens
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    probs = expected_probs(logits.numpy(), temperature, top_k, top_p, min_p)
    assert counts[probs == 0].sum() == 0, "sampled a filtered-out token"
    expected = probs[probs > 0] * n
    chi2 = (((counts[probs > 0] - expected) ** 2) / expected).sum()
    dof = int((probs > 0).sum()) - 1
    # Far beyond the 99.9th percentile of chi-square with <= 9 degrees of freedom (27.9).
    assert chi2 < 3 * dof + 30, (chi2, counts, probs)


def test_sampler_is_batched_over_large_vocab():
    logits = torch.randn(32, 151_936)
    tokens = Sampler().sample(logits, params(32, 0.7, 40, 0.9, 0.0)).tokens
    assert tokens.shape == (32,) and (tokens >= 0).all() and (tokens < 151_936).all()
    # Every sampled token is inside its row's top 40.
    top40 = logits.topk(40, dim=-1).indices
    assert (top40 == tokens[:, None]).any(-1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    logits = torch.randn(16, 5000)
    p = dict(temperature=0.8, top_k=100, top_p=0.9, min_p=0.02, seeds=list(range(16)), positions=list(range(16)))
    cpu = Sampler().sample(logits, params(16, **p)).tokens
    gpu = Sampler().sample(logits.cuda(), params(16, **p, device="cuda")).tokens
    assert torch.equal(cpu, gpu.cpu())


# ---- penalties, logit_bias, min_new_tokens (through SamplingState, as the engine builds batches) ----


def make_state(vocab, rows, device="cpu"):
    """rows: list of (prompt_ids, SamplingParams, output_ids): added at rows 0.. and stepped through
    their outputs one token at a time, as the engine would."""
    state = SamplingState(2, vocab, device)
    for row, (prompt, row_params, outputs) in enumerate(rows):
        state.add_row(row, np.asarray(prompt, np.int64), row_params)
        for token in outputs:
            state.update(np.array([row]), torch.tensor([token], device=device))
    return state


def test_repetition_penalty_equals_transformers():
    torch.manual_seed(0)
    vocab = 97
    rows = [
        ([1, 5, 5, 9, 60], SamplingParams(repetition_penalty=1.3), [9, 2, 2, 70]),
        ([3], SamplingParams(repetition_penalty=0.7), [3, 3, 11]),
        ([], SamplingParams(repetition_penalty=2.0), [96, 0]),
    ]
    state = make_state(vocab, rows)
    logits = torch.randn(3, vocab) * 3
    processed = Sampler.process_logits(logits, state.batch(np.arange(3)))
    for i, (prompt, row_params, outputs) in enumerate(rows):
        hf = RepetitionPenaltyLogitsProcessor(row_params.repetition_penalty)(
            torch.tensor([prompt + outputs]), logits[i : i + 1].clone()
        )
        assert torch.equal(processed[i], hf[0])


def test_frequency_and_presence_penalties_follow_openai_formula_over_outputs_only():
    torch.manual_seed(1)
    vocab = 50
    rows = [
        ([4, 4, 4], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [4, 7, 7, 7, 8]),
        ([7], SamplingParams(frequency_penalty=-1.0), [7, 1]),
        ([], SamplingParams(presence_penalty=2.0), [0, 0, 49]),
    ]
    state = make_state(vocab, rows)
    logits = torch.randn(3, vocab)
    processed = Sampler.process_logits(logits, state.batch(np.arange(3))).numpy()
    for i, (_, p, outputs) in enumerate(rows):
        counts = np.bincount(outputs, minlength=vocab)  # prompt tokens do not count
        expected = logits[i].numpy() - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        np.testing.assert_allclose(processed[i], expected, rtol=0, atol=1e-6)


def test_logit_bias_adds_to_the_named_tokens_only():
    logits = torch.randn(2, 30)
    state = make_state(30, [([], SamplingParams(logit_bias={3: 100.0, 29: -5.5, 0: 0.25}), []),
                            ([], SamplingParams(), [])])
    processed = Sampler.process_logits(logits, state.batch(np.arange(2)))
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[0, 29] -= 5.5
    expected[0, 0] += 0.25
    assert torch.equal(processed, expected)
    # A +100 bias wins greedy decoding; the input logits are left untouched.
    greedy = make_state(30, [([], SamplingParams(temperature=0.0, logit_bias={17: 100.0}), [])])
    before = logits[:1].clone()
    assert Sampler().sample(logits[:1], greedy.batch(np.array([0]))).tokens.item() == 17
    assert torch.equal(logits[:1], before)


def test_min_new_tokens_masks_stop_tokens_exactly_until_the_threshold():
    vocab, eos, stop = 20, 19, 5
    logits = torch.zeros(1, vocab)
    logits[0, eos], logits[0, stop], logits[0, 8] = 9.0, 8.0, 1.0
    state = make_state(vocab, [([1, 2], SamplingParams(temperature=0.0, min_new_tokens=3,
                                                          stop_token_ids=[eos, stop]), [])])
    sampler, tokens = Sampler(), []
    for _ in range(5):
        batch = state.batch(np.array([0]))
        processed = Sampler.process_logits(logits, batch)
        masked = torch.isinf(processed[0]).nonzero().flatten().tolist()
        assert masked == ([stop, eos] if len(tokens) < 3 else [])
        token = sampler.sample(logits, batch).tokens
        tokens.append(token.item())
        state.update(np.array([0]), token)
    assert tokens == [8, 8, 8, eos, eos]


def reference_process(logits: np.ndarray, prompt, outputs, p: SamplingParams) -> np.ndarray:
    """Steps 1-3 in plain numpy, in the documented order."""
    z = logits.astype(np.float32).copy()
    for token, bias in p.logit_bias.items():
        z[token] += np.float32(bias)
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=z.shape[0])
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    r = np.float32(p.repetition_penalty)
    z = np.where(seen, np.where(z < 0, z * r, z / r), z).astype(np.float32)
    z = z - np.float32(p.frequency_penalty) * counts - np.float32(p.presence_penalty) * (counts > 0)
    if len(outputs) < p.min_new_tokens:
        z[list(p.stop_token_ids)] = -np.inf
    return z


def test_combined_processing_order():
    torch.manual_seed(2)
    vocab = 40
    p = SamplingParams(temperature=0.0, logit_bias={2: 3.0, 6: -1.0}, repetition_penalty=1.5,
                          frequency_penalty=0.4, presence_penalty=0.3, min_new_tokens=4, stop_token_ids=[6, 39])
    prompt, outputs = [2, 3, 6], [2, 2, 10]
    state = make_state(vocab, [(prompt, p, outputs)])
    logits = torch.randn(1, vocab) * 2
    processed = Sampler.process_logits(logits, state.batch(np.array([0])))[0].numpy()
    np.testing.assert_allclose(processed, reference_process(logits[0].numpy(), prompt, outputs, p), atol=1e-6)
    # Bias before repetition: +3 then /1.5 (positive) is not the same as /1.5 then +3.
    assert abs(processed[2] - ((logits[0, 2].item() + 3.0) / 1.5 - 0.4 * 2 - 0.3)) < 1e-5


def test_batched_rows_with_extras_equal_each_row_alone():
    torch.manual_seed(3)
    vocab = 300
    rows = [
        ([1, 2, 3], SamplingParams(temperature=0.8, top_k=20, seed=1, repetition_penalty=1.2), [4, 5]),
        ([9], SamplingParams(temperature=1.0, top_p=0.9, seed=2), [1]),  # no extras
        ([], SamplingParams(temperature=0.0, logit_bias={7: 2.0}, frequency_penalty=0.5), [7, 7, 7]),
        ([5, 5], SamplingParams(temperature=1.2, min_p=0.05, seed=3, min_new_tokens=9,
                                   stop_token_ids=[0, 1, 2], presence_penalty=1.0, return_logprob=True,
                                   top_logprobs_num=3, token_ids_logprob=[4, 8]), [3]),
        ([2], SamplingParams(temperature=0.7, seed=4, logit_bias={1: -50.0}), []),
    ]
    state = make_state(vocab, rows)
    logits = torch.randn(len(rows), vocab)
    sampler = Sampler()
    for _ in range(3):  # several steps: counts and output positions move on
        order = np.array([3, 0, 4, 1, 2])
        together = sampler.sample(logits[order], state.batch(order)).tokens
        for i, row in enumerate(order):
            alone = sampler.sample(logits[row : row + 1], state.batch(np.array([row]))).tokens
            assert together[i] == alone[0], row
        # The row without extras draws exactly what the basic surface alone draws.
        plain = SamplingBatch.from_lists([1.0], [0], [0.9], [0.0], [2], state.output_positions(np.array([1])))
        assert together[3] == sampler.sample(logits[1:2], plain).tokens[0]
        state.update(order, together)
        logits = torch.randn(len(rows), vocab)


def test_a_later_row_with_more_stop_ids_leaves_the_earlier_rows_stops_alone():
    # Found by the hypothesis test below: a row whose stop list widened the padded table gave the
    # rows set before it zeros in the new columns, so their min_new_tokens masked token 0 too.
    vocab = 40
    first = SamplingParams(temperature=0.5, top_k=3, seed=2, min_new_tokens=1, stop_token_ids=[1])
    second = SamplingParams(temperature=0.0, min_new_tokens=1, stop_token_ids=[0, 1, 7])
    state = make_state(vocab, [([], first, []), ([], second, [])])
    batch = state.batch(np.arange(2))
    logits = torch.zeros(2, vocab)
    scores = Sampler.process_logits(logits, batch)
    assert torch.isinf(scores[0]).nonzero().flatten().tolist() == [1]
    assert torch.isinf(scores[1]).nonzero().flatten().tolist() == [0, 1, 7]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(126383)) * 2
    together = Sampler().sample(logits, batch).tokens
    assert together[0] == Sampler().sample(logits[:1], state.batch(np.array([0]))).tokens[0]


@st.composite
def row_options(draw, vocab):
    token = st.integers(0, vocab - 1)
    return (
        draw(st.lists(token, max_size=6)),
        SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
            top_k=draw(st.sampled_from([-1, 1, 3, 10])),
            top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
            min_p=draw(st.sampled_from([0.0, 0.1])),
            seed=draw(st.integers(0, 2**63 - 1)),
            frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.5])),
            presence_penalty=draw(st.sampled_from([0.0, 1.0])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
            logit_bias=draw(st.dictionaries(token, st.floats(-10, 10, width=32), max_size=3)),
            min_new_tokens=draw(st.integers(0, 3)),
            stop_token_ids=draw(st.lists(token, max_size=3)),
            return_logprob=draw(st.booleans()),
            top_logprobs_num=draw(st.integers(0, 4)),
            token_ids_logprob=draw(st.lists(token, max_size=3)),
        ),
        draw(st.lists(token, max_size=4)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row_options(40), min_size=1, max_size=6), logits_seed=st.integers(0, 2**31))
def test_hypothesis_batched_sample_equals_per_row_sample(rows, logits_seed):
    vocab = 40
    state = make_state(vocab, rows)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(logits_seed)) * 2
    order = np.random.default_rng(logits_seed).permutation(len(rows))
    sampler = Sampler()
    together = sampler.sample(logits[order], state.batch(order))
    for i, row in enumerate(order):
        alone = sampler.sample(logits[row : row + 1], state.batch(np.array([row])))
        assert together.tokens[i] == alone.tokens[0]
        p = rows[row][1]
        if p.return_logprob:
            torch.testing.assert_close(together.logprobs[i], alone.logprobs[0], rtol=0, atol=1e-6)
        if p.top_logprobs_num:
            k = p.top_logprobs_num
            torch.testing.assert_close(together.top_logprobs[i, :k], alone.top_logprobs[0, :k], rtol=0, atol=1e-6)
        if p.token_ids_logprob:
            m = int(together.token_ids_logprob_counts[i])
            assert m == len(p.token_ids_logprob)
            assert together.token_ids_logprob_ids[i, :m].tolist() == list(p.token_ids_logprob)
            torch.testing.assert_close(together.token_ids_logprobs[i, :m], alone.token_ids_logprobs[0, :m],
                                       rtol=0, atol=1e-6)


def test_plain_batches_take_the_fast_paths():
    state = make_state(100, [([1], SamplingParams(temperature=0.0), []), ([2], SamplingParams(), [])])
    greedy = state.batch(np.array([0]))
    assert greedy.plain_argmax and not greedy.needs_logprobs
    assert greedy.logit_bias_positions is None and greedy.penalty_positions is None and greedy.stop_positions is None
    out = Sampler().sample(torch.randn(1, 100), greedy)
    assert out.logprobs is None and out.top_logprobs is None and out.token_ids_logprobs is None
    assert not state.batch(np.array([0, 1])).plain_argmax


def test_top_k_with_ties_keeps_the_same_set_on_both_filter_paths():
    # bf16 logits tie often: top-k alone (topk path) and top-k with top-p (sort path) must agree.
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    alone = Sampler._filter(logits, params(1, top_k=2))
    with_top_p = Sampler._filter(logits, params(1, top_k=2, top_p=0.9999))
    assert torch.isfinite(alone).tolist() == [[True, False, True, True, True, False]]
    assert torch.equal(torch.isfinite(alone), torch.isfinite(with_top_p))


# ---- backends ----


def test_backend_names_and_default():
    assert SAMPLING_BACKENDS == ("torch", "triton")
    assert default_sampling_backend("cpu") == "torch"
    assert default_sampling_backend() in SAMPLING_BACKENDS
    with pytest.raises(ValueError, match="unknown sampling backend"):
        Sampler("cuda")
    if triton_sampling_available():
        assert Sampler("triton").backend == "triton"
    else:
        with pytest.raises(ValueError, match="needs the triton package and a CUDA device"):
            Sampler("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_backend_draws_equal_torch_backend():
    torch.manual_seed(5)
    sampler_torch, sampler_triton = Sampler("torch"), Sampler("triton")
    for vocab, n in [(151_936, 16), (5000, 64), (4096, 3), (1, 2)]:
        logits = torch.randn(n, vocab, device="cuda") * 2
        seeds, positions = list(range(7, 7 + n)), [i * 3 % 11 for i in range(n)]
        for p in [dict(), dict(temperature=0.6, top_k=50), dict(top_p=0.9, min_p=0.02),
                  dict(temperature=[0.0, 1.0] * (n // 2) + [1.0] * (n % 2))]:
            batch = params(n, seeds=seeds, positions=positions, device="cuda", **p)
            expected = sampler_torch.sample(logits, batch).tokens
            assert torch.equal(sampler_triton.sample(logits, batch).tokens, expected), (vocab, p)
    # Penalized and biased rows through SamplingState on the GPU.
    state = make_state(1000, [([1, 2], SamplingParams(seed=1, repetition_penalty=1.3, logit_bias={5: 1.0}),
                               [3, 3]), ([], SamplingParams(seed=2, frequency_penalty=0.5), [7])], device="cuda")
    logits = torch.randn(2, 1000, device="cuda")
    batch = state.batch(np.arange(2))
    assert torch.equal(sampler_triton.sample(logits, batch).tokens, sampler_torch.sample(logits, batch).tokens)
