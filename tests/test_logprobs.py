"""Raw logprobs: sampled tokens, top-k and requested ids, and prompt positions, against log_softmax."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokenspeed_worker.sampling import logprobs as logprobs_module
from tokenspeed_worker.sampling.logprobs import prompt_logprobs
from tokenspeed_worker.sampling.sampler import Sampler
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.sampling.state import SamplingState


def test_sampled_token_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(0)
    vocab = 120
    state = SamplingState(4, vocab)
    options = [
        SamplingParams(temperature=0.7, seed=1, return_logprob=True, top_logprobs_num=5,
                          token_ids_logprob=[3, 119]),
        SamplingParams(temperature=0.0, return_logprob=True, logit_bias={4: 30.0}, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, top_k=3, seed=2, top_logprobs_num=2, token_ids_logprob=[0]),
    ]
    for row, p in enumerate(options):
        state.add_row(row, np.array([4, 5]), p)
    logits = torch.randn(3, vocab) * 4
    out = Sampler().sample(logits, state.batch(np.arange(3)))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.tokens[1].item() == 4  # the bias decided the token ...
    # ... but logprobs stay those of the model's raw distribution, for every kind.
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.tokens[:, None])[:, 0], rtol=0, atol=1e-5)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.shape == (3, 5)
    expected_top = reference.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, expected_top.values, rtol=0, atol=1e-5)
    assert torch.equal(out.top_logprob_ids, expected_top.indices) and out.top_logprob_ids.dtype == torch.int64
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    counts = out.token_ids_logprob_counts.tolist()
    assert counts == [2, 0, 1]
    for i, ids in enumerate([[3, 119], [], [0]]):
        assert out.token_ids_logprob_ids[i, : counts[i]].tolist() == ids
        torch.testing.assert_close(out.token_ids_logprobs[i, : counts[i]], reference[i, ids], rtol=0, atol=1e-5)


def test_prompt_logprobs_match_transformers_on_a_tiny_model(monkeypatch):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        logits = model(prompt).logits[0].float()  # [T, V]: row t predicts token t+1
    next_ids = torch.cat([prompt[0, 1:], torch.tensor([-1])])
    reference = torch.log_softmax(logits, dim=-1)
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 97 * 3)  # three positions per chunk
    out = prompt_logprobs(logits, next_ids, top_k=4, token_ids=[5, 96])
    torch.testing.assert_close(out.logprobs[:-1], reference[:-1].gather(1, prompt[0, 1:, None])[:, 0],
                               rtol=0, atol=1e-5)
    assert torch.isnan(out.logprobs[-1])  # the last position has no next prompt token
    top = reference.topk(4, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values, rtol=0, atol=1e-5)
    assert torch.equal(out.top_logprob_ids, top.indices)
    torch.testing.assert_close(out.token_ids_logprobs, reference[:, [5, 96]], rtol=0, atol=1e-5)
    assert out.token_ids_logprob_ids.shape == (11, 2) and out.token_ids_logprob_counts.tolist() == [2] * 11


def test_prompt_logprobs_without_extras_and_empty():
    logits = torch.randn(4, 10)
    out = prompt_logprobs(logits, torch.tensor([1, 2, 3, 4]))
    assert out.top_logprobs is None and out.token_ids_logprobs is None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[torch.arange(4), [1, 2, 3, 4]])
    empty = prompt_logprobs(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64), top_k=2, token_ids=[1])
    assert (empty.logprobs.shape == (0,) and empty.top_logprobs.shape == (0, 2)
            and empty.token_ids_logprobs.shape == (0, 1))
