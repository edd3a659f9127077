"""The batched sampler: greedy, filters, seeded reproducibility, and the distribution it draws from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed_worker.layers.sampler import Sampler, SamplingTensors, hashed_uniform

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, device="cpu"):
    per_row = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * n  # noqa: E731
    return SamplingTensors.from_lists(
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
    tokens = Sampler().sample(logits, params(7, temperature=0.0, device=device))
    assert tokens.dtype == torch.int64 and tokens.device.type == device
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 1000)
    tokens = Sampler().sample(logits, params(64, temperature=1.5, top_k=1))
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(6, 50)
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 1.0]
    tokens = Sampler().sample(logits, params(6, temperature=temps, top_p=0.9))
    greedy_rows = [0, 2, 4]
    assert torch.equal(tokens[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_seeded_rows_reproduce_regardless_of_batch_mates_and_order():
    torch.manual_seed(0)
    logits = torch.randn(8, 400)
    seeds, positions = [11, 22, 33, 44, 55, 66, 77, 88], [0, 3, 3, 9, 1, 0, 2, 5]
    sampler = Sampler()
    full = sampler.sample(logits, params(8, 0.9, 50, 0.95, 0.01, seeds, positions))
    perm = [5, 2, 7, 0, 3]
    sub = sampler.sample(
        logits[perm], params(5, 0.9, 50, 0.95, 0.01, [seeds[i] for i in perm], [positions[i] for i in perm])
    )
    assert torch.equal(sub, full[perm])
    # Batch mates with other settings (greedy, other filters) change nothing either.
    mates = torch.randn(3, 400)
    mixed = sampler.sample(
        torch.cat([mates, logits[:2]]),
        SamplingTensors.from_lists([0.0, 2.0, 0.5, 0.9, 0.9], [0, 5, 0, 50, 50], [1.0, 0.5, 1.0, 0.95, 0.95],
                                   [0.0, 0.0, 0.2, 0.01, 0.01], [None, 1, 2, 11, 22], [0, 0, 0, 0, 3]),
    )
    assert torch.equal(mixed[3:], full[:2])


def test_seed_and_position_both_change_the_draw():
    logits = torch.zeros(1, 10_000)  # uniform: any change in noise changes the token
    draw = lambda seed, pos: Sampler().sample(logits, params(1, seeds=[seed], positions=[pos])).item()  # noqa: E731
    assert draw(5, 0) == draw(5, 0)
    assert len({draw(5, p) for p in range(8)}) > 4
    assert len({draw(s, 0) for s in range(8)}) > 4


def test_from_lists_accepts_numpy_arrays_and_big_seeds():
    from_numpy = SamplingTensors.from_lists(
        np.array([0.0, 0.7], np.float32), np.array([-1, 5]), np.array([1.0, 0.9], np.float32),
        np.zeros(2, np.float32), np.array([3, 2**63 - 1]), np.array([0, 4]),
    )
    from_lists = SamplingTensors.from_lists([0.0, 0.7], [0, 5], [1.0, 0.9], [0.0, 0.0], [3, 2**64 - 1], [0, 4])
    assert torch.equal(from_numpy.top_ks, torch.tensor([0, 5])) and from_numpy.any_top_k and not from_numpy.any_min_p
    assert not from_numpy.all_greedy and from_lists.seeds.dtype == torch.int64
    logits = torch.randn(2, 100)
    assert torch.equal(Sampler().sample(logits, from_numpy), Sampler().sample(logits, from_lists))


def test_unseeded_rows_get_random_seeds():
    logits = torch.zeros(1, 10_000)
    draws = {Sampler().sample(logits, params(1, seeds=[None])).item() for _ in range(8)}
    assert len(draws) > 4


def test_hashed_uniform_is_uniform_and_open_interval():
    u = hashed_uniform(torch.tensor([0, 1, 2**40]), torch.tensor([0, 7, 3]), 200_000)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert (torch.corrcoef(u) - torch.eye(3)).abs().max() < 0.01


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
    )
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
    tokens = Sampler().sample(logits, params(32, 0.7, 40, 0.9, 0.0))
    assert tokens.shape == (32,) and (tokens >= 0).all() and (tokens < 151_936).all()
    # Every sampled token is inside its row's top 40.
    top40 = logits.topk(40, dim=-1).indices
    assert (top40 == tokens[:, None]).any(-1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    logits = torch.randn(16, 5000)
    p = dict(temperature=0.8, top_k=100, top_p=0.9, min_p=0.02, seeds=list(range(16)), positions=list(range(16)))
    cpu = Sampler().sample(logits, params(16, **p))
    gpu = Sampler().sample(logits.cuda(), params(16, **p, device="cuda"))
    assert torch.equal(cpu, gpu.cpu())
