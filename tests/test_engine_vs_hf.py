"""The whole engine core (native scheduler + runner + sampler) against Hugging Face transformers.

Requests of different lengths arrive at different steps, so batches mix
prefill chunks and decodes; every request's greedy tokens must equal what
transformers generates for it alone.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine.engine_core import EngineCore
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.sampling.params import SamplingParams
from worker_harness import hf_greedy, smollm2_dir, tiny_models

# The GPU machine runs this same file with TOKENSPEED_TEST_DEVICE=cuda (scripts/gpu_check.sh).
DEVICE = os.environ.get("TOKENSPEED_TEST_DEVICE", "cpu")


def greedy(req_id, prompt, max_new):
    return AddRequest(req_id, np.asarray(prompt, dtype=np.int32), max_new, SamplingParams(temperature=0.0))


def run_staggered(core: EngineCore, requests: list[AddRequest], arrive_at: list[int]) -> dict[int, list[int]]:
    """Steps through run_steps (overlapping launch and completion when the core does)."""
    outputs = {r.req_id: [] for r in requests}
    pending = sorted(zip(arrive_at, range(len(requests))))
    step = 0
    done = set()
    while pending and pending[0][0] <= step:
        core.add_request(requests[pending.pop(0)[1]])
    for out in core.run_steps():
        step += 1
        while pending and pending[0][0] <= step:
            core.add_request(requests[pending.pop(0)[1]])
        if out is None:
            continue
        for rid, tok in zip(out.req_ids.tolist(), out.tokens.tolist()):
            outputs[rid].append(tok)
        done.update(out.finished_ids.tolist())
        assert step < 10_000
    return outputs


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias", "qwen3-qknorm", "qwen3-moe", "qwen2-moe", "mixtral",
                                  "mistral", "phi3", "gemma2", "gemma3"])
@pytest.mark.parametrize("budget", [16, 33])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_staggered_mixed_batches_equal_transformers(name, budget, overlap):
    model = tiny_models()[name]
    core = EngineCore(EngineConfig.build(str(model), dtype="float32", device=DEVICE, block_size=4, max_model_len=256,
                                         max_num_seqs=8, max_total_tokens=4096, chunked_prefill_size=budget,
                                         overlap_schedule=overlap))
    rng = np.random.default_rng(7)
    vocab = core.runner.vocab_size
    lengths = [5, 40, 17, 3, 64, 9]
    requests = [greedy(i + 1, rng.integers(3, vocab, size=n).tolist(), 10) for i, n in enumerate(lengths)]
    outputs = run_staggered(core, requests, arrive_at=[0, 0, 2, 3, 5, 9])
    for r in requests:
        assert outputs[r.req_id] == hf_greedy(model, r.prompt_ids.tolist(), 10), f"request {r.req_id}"
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks


def test_smollm2_greedy_equals_transformers():
    model = smollm2_dir()
    core = EngineCore(EngineConfig.build(str(model), dtype="float32", device=DEVICE, max_model_len=512,
                                         max_total_tokens=2048))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    requests = [greedy(i + 1, tok(p)["input_ids"], 16) for i, p in enumerate(prompts)]
    outputs = run_staggered(core, requests, arrive_at=[0, 1, 1])
    for r in requests:
        assert outputs[r.req_id] == hf_greedy(model, r.prompt_ids.tolist(), 16)
    assert "Paris" in tok.decode(outputs[1])
