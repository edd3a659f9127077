"""Mistral and Phi-3 (models/mistral.py, models/phi3.py) beyond the shared engine-vs-transformers
tests (tests/test_engine_vs_hf.py runs their tiny models beside Llama's): longrope's long factors
past the original length, sliding windows that cover the served length, and what is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from test_engine_vs_hf import greedy, run_staggered
from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine.engine_core import EngineCore
from worker_harness import hf_greedy, tiny_models


def _copy_with(tmp_path, name: str, **changes):
    model = tmp_path / name
    shutil.copytree(tiny_models()[name], model)
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    return model


def _engine(model, max_model_len: int) -> EngineCore:
    return EngineCore(EngineConfig.build(str(model), dtype="float32", device="cpu", block_size=4,
                                         max_model_len=max_model_len, max_num_seqs=8, max_total_tokens=2048,
                                         chunked_prefill_size=24))


def test_phi3_longrope_past_its_original_length_equals_transformers(tmp_path):
    """Served past original_max_position_embeddings (32 here), every position takes longrope's long
    factors and its attention scaling: transformers' choice for any sequence longer than 32, so
    prompts of 33+ tokens give transformers' greedy tokens, in chunks across the 32 boundary."""
    model = _copy_with(tmp_path, "phi3", original_max_position_embeddings=32,
                       rope_parameters={"original_max_position_embeddings": 32})
    core = _engine(model, 128)
    rng = np.random.default_rng(3)
    requests = [greedy(i + 1, rng.integers(3, core.runner.vocab_size, size=n).tolist(), 8)
                for i, n in enumerate([33, 47, 60])]
    outputs = run_staggered(core, requests, arrive_at=[0, 1, 2])
    for r in requests:
        assert outputs[r.req_id] == hf_greedy(model, r.prompt_ids.tolist(), 8), f"request {r.req_id}"


@pytest.mark.parametrize("name", ["mistral", "phi3", "mixtral", "qwen2-sliding"])
def test_windows_shorter_than_the_prompts_equal_transformers(tmp_path, name):
    """sliding_window 8 against prompts of up to 40 tokens, in chunks across window edges: every
    layer windowed (Mistral, Phi-3, Mixtral), or the layers past max_window_layers (Qwen2 with
    use_sliding_window); greedy tokens equal transformers'. A window as long as the served length
    is dropped."""
    from tokenspeed_worker.layers.attention import Attention

    if name == "qwen2-sliding":
        model = _copy_with(tmp_path, "qwen2-bias", sliding_window=8, use_sliding_window=True, max_window_layers=1,
                           layer_types=None)  # transformers derives them from max_window_layers
    else:
        model = _copy_with(tmp_path, name, sliding_window=8)
    core = _engine(model, 64)
    windows = [m.sliding_window for m in core.runner.model.modules() if isinstance(m, Attention)]
    assert windows == ([None, 8, 8] if name == "qwen2-sliding" else [8, 8, 8])
    rng = np.random.default_rng(5)
    requests = [greedy(i + 1, rng.integers(3, core.runner.vocab_size, size=n).tolist(), 6)
                for i, n in enumerate([5, 20, 40])]
    outputs = run_staggered(core, requests, arrive_at=[0, 1, 1])
    for r in requests:
        assert outputs[r.req_id] == hf_greedy(model, r.prompt_ids.tolist(), 6), f"request {r.req_id}"
    assert not any(m.sliding_window for m in _engine(model, 8).runner.model.modules() if isinstance(m, Attention))


def test_a_windowed_model_whose_step_outgrows_the_pool_bounds_requests_by_the_pool(tmp_path):
    """A window bounds what a request holds only with room for the window and one step's tokens (the
    scheduler's peak_blocks): with a pool smaller than that, the longest request is the pool's, which
    the worker reports (and clamps unset lengths to), and such a request is admitted and served."""
    model = _copy_with(tmp_path, "mistral", sliding_window=5)

    def engine(chunk: int) -> EngineCore:
        return EngineCore(EngineConfig.build(str(model), dtype="float32", device="cpu", block_size=4,
                                             max_model_len=1024, max_num_seqs=8, max_total_tokens=160,
                                             chunked_prefill_size=chunk))

    small_step, large_step = engine(24), engine(512)
    assert small_step.max_request_tokens() == 1024  # the window and a 24-token step fit 40 blocks
    assert large_step.max_request_tokens() == 160
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, large_step.runner.vocab_size, size=30).tolist()
    outputs = run_staggered(large_step, [greedy(1, prompt, 160 - 30)], arrive_at=[0])
    assert len(outputs[1]) == 130


def test_the_cli_serves_a_windowed_model_at_its_full_length(tmp_path):
    from tokenspeed_worker import cli
    from tokenspeed_worker.config.worker import WorkerConfig

    model = _copy_with(tmp_path, "mistral", sliding_window=48)
    assert WorkerConfig.from_args(cli.prepare([str(model)])).engine.scheduler.max_model_len == 4096


def test_quantized_fused_phi3_projections_are_refused():
    import torch

    from tokenspeed_worker.models.phi3 import Phi3ForCausalLM

    class Config:
        num_attention_heads, num_key_value_heads, hidden_size = 4, 2, 64

    model = Phi3ForCausalLM.__new__(Phi3ForCausalLM)
    model.__dict__["config"] = Config()
    with pytest.raises(ValueError, match="quantized fused Phi-3 projections are not supported"):
        list(model._split_fused([("model.layers.0.self_attn.qkv_proj.weight_scale", torch.ones(1))]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_logits_equal_transformers(name, backend):
    """Every position's logits of a prompt longer than the window (8), prefilled in one step and
    then decoded, against transformers' forward: the windows, Gemma 2's attention and final
    soft-caps (low enough to bind: without either, the logits move), Gemma 3's q/k norms and
    per-layer-type rope; in the torch backend and in the triton backend's kernels (Triton's
    interpreter on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from test_triton_backend import Plans, random_seqs
    from tokenspeed_worker.kernels import attention as attention_kernels
    from tokenspeed_worker.layers.attention import Attention
    from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend
    from worker_harness import make_runner

    model_dir = tiny_models()[name]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"

    def logits(change=None):
        chosen = TritonAttentionBackend(device, kernels=attention_kernels) if backend == "triton" else "torch"
        runner = make_runner(model_dir, attention_backend=chosen, dtype="float32", device=device, block_size=4,
                             max_model_len=64)
        if change is not None:
            change(runner.model)
        runner.allocate_kv_cache(32)
        (seq,) = random_seqs([30], seed=4)
        plans = Plans(num_blocks=32, seed=4)
        out = [runner.forward_all_logits(plans.plan([(seq, 30)]))]
        seq.tokens.append(7)
        out.append(runner.forward_all_logits(plans.plan([(seq, 1)])))
        return torch.cat(out).cpu(), seq.tokens

    got, tokens = logits()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    def no_windows(model):
        for m in model.modules():
            if isinstance(m, Attention):
                m.sliding_window = None

    tampered = [no_windows]
    if name == "gemma2":
        def no_attention_cap(model):
            for m in model.modules():
                if isinstance(m, Attention):
                    m.logit_softcap = None

        tampered += [no_attention_cap, lambda model: setattr(model, "final_logit_softcap", None)]
    error = (got - expected).abs().max().item()  # float32 rounding: about 1e-7
    for change in tampered:
        assert (logits(change)[0] - expected).abs().max().item() > 100 * max(error, 1e-7)


def test_windowed_and_capped_layers_refuse_a_backend_that_cannot_take_them():
    from worker_harness import make_runner

    from tokenspeed_worker.layers.attention.torch_backend import TorchAttentionBackend

    class Plain(TorchAttentionBackend):  # as the flashinfer backend is today
        name = "plain"
        supports_windows_and_softcap = False

    with pytest.raises(ValueError, match="sliding-window or soft-capped attention layers, which attention backend "
                                         "'plain' does not support yet: run with --attention-backend torch"):
        make_runner(tiny_models()["gemma2"], attention_backend=Plain(), dtype="float32", device="cpu", max_model_len=64)
    # a window as long as the served length masks nothing: dropped, so any backend serves Gemma 3
    runner = make_runner(tiny_models()["gemma3"], attention_backend=Plain(), dtype="float32", device="cpu",
                         max_model_len=8)
    assert not any(layer.needs_window_or_softcap for layer in runner.attention_layers)


@pytest.mark.parametrize("name", ["mistral", "phi3", "gemma2", "gemma3", "qwen3-moe", "qwen2-moe", "mixtral"])
def test_prefix_hits_and_forced_preemption_equal_transformers(name, monkeypatch):
    """A shared prefix longer than Gemma's window (8): cached blocks reused, requests preempted and
    recomputed, in chunks of 7 across window edges; greedy tokens still transformers' (the MoE
    models too: their experts' choices recomputed alike)."""
    from test_engine_scheduling import random_tokens, request, run

    monkeypatch.setenv("TOKENSPEED_OVERLAP_SCHEDULE", "1")
    model = tiny_models()[name]
    core = EngineCore(EngineConfig.build(str(model), dtype="float32", device="cpu", block_size=4, max_model_len=256,
                                         max_num_seqs=16, max_total_tokens=96, chunked_prefill_size=7,
                                         schedule_conservativeness=0.0))
    rng = np.random.default_rng(4)
    system = random_tokens(rng, 12)
    prompts = [system + random_tokens(rng, 3 + 3 * i) for i in range(6)]
    outs, cached, _ = run(core, [request(i + 1, p, 20) for i, p in enumerate(prompts)], arrive_at=[0, 0, 1, 1, 2, 2])
    assert core.scheduler.num_preemptions > 0 and any(cached.values())
    for i, p in enumerate(prompts):
        assert outs[i + 1] == hf_greedy(model, p, 20), f"request {i + 1}"
    assert core.scheduler.num_used_tokens == 0


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model():
    """Gemma3ForConditionalGeneration (the 4B-27B checkpoints): its text_config builds the model,
    the Hub's language_model.* weights load, the vision tower is skipped; greedy tokens of text
    prompts equal transformers' multimodal model's."""
    model = tiny_models()["gemma3-multimodal"]
    core = _engine(model, 128)
    assert type(core.runner.model).__name__ == "Gemma3ForCausalLM"
    rng = np.random.default_rng(9)
    requests = [greedy(i + 1, rng.integers(3, core.runner.vocab_size, size=n).tolist(), 8) for i, n in enumerate([12, 30])]
    outputs = run_staggered(core, requests, arrive_at=[0, 1])
    for r in requests:
        assert outputs[r.req_id] == hf_greedy(model, r.prompt_ids.tolist(), 8)


@pytest.mark.parametrize("pool", [36, 160], ids=["small-pool", "large-pool"])
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["sync", "overlap"])
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_a_windowed_model_holds_its_window_of_kv_not_its_length(tmp_path, monkeypatch, overlap, caching, pool):
    """Every layer windowed (8 positions, blocks of 4): a request's blocks wholly before every
    future query's window are released as it runs, so it holds a few blocks however long it gets
    (and a request longer than the pool is accepted when its window fits), while greedy tokens
    stay transformers' (with prefix hits on released-but-cached blocks, and forced preemption in a
    small pool); every block comes back at the end. A hybrid model (Gemma) keeps all."""
    from test_engine_scheduling import random_tokens, request

    monkeypatch.setenv("TOKENSPEED_OVERLAP_SCHEDULE", overlap)
    model = _copy_with(tmp_path, "mistral", sliding_window=8)
    core = EngineCore(EngineConfig.build(str(model), dtype="float32", device="cpu", block_size=4, max_model_len=256,
                                         max_num_seqs=8, max_total_tokens=pool, chunked_prefill_size=12,
                                         schedule_conservativeness=0.0, enable_prefix_caching=caching))
    assert core.runner.uniform_sliding_window == 8
    rng = np.random.default_rng(11)
    system = random_tokens(rng, 24)
    prompts = [system + random_tokens(rng, 5 + 7 * i) for i in range(5)]
    requests = [request(i + 1, p, 40) for i, p in enumerate(prompts)]
    pending = list(zip([0, 0, 3, 6, 9], requests))
    outputs = {r.req_id: [] for r in requests}
    most_held, step = 0, 0
    while pending and pending[0][0] <= step:
        core.add_request(pending.pop(0)[1])
    for out in core.run_steps():
        step += 1
        while pending and pending[0][0] <= step:
            core.add_request(pending.pop(0)[1])
        held_blocks = 0
        for r in requests:
            row = core.rows.row_of(r.req_id)  # the scheduler's id of a live request
            if row is not None and core.scheduler.contains(row):
                ids = core.scheduler.block_ids(row)
                most_held = max(most_held, int((ids >= 0).sum()))
                held_blocks += int((ids >= 0).sum())
        # What the loads report (GetLoads' num_used_tokens, token_usage): the KV held, not the lengths.
        assert core.scheduler.num_used_tokens <= 4 * held_blocks, (core.scheduler.num_used_tokens, held_blocks)
        if out is not None:
            for rid, tok in zip(out.req_ids.tolist(), out.tokens.tolist()):
                outputs[rid].append(tok)
        assert step < 5000
    # the window (8) and a 12-token chunk span at most 6 blocks of 4, the next block one more
    assert most_held <= 7, most_held
    for r, p in zip(requests, prompts):
        assert outputs[r.req_id] == hf_greedy(model, p, 40), f"request {r.req_id}"
    assert core.scheduler.num_used_tokens == 0
    assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks  # (cached ones count as free)
    if pool == 36:  # 9 blocks for five requests of 29-61 prompt tokens and 40 outputs each: some preempted
        assert core.scheduler.num_preemptions > 0
    else:  # room for the shared 24-token prefix to stay cached: later requests start on it
        assert (core.scheduler.prefix_hit_tokens > 0) == caching
    hybrid = EngineCore(EngineConfig.build(str(tiny_models()["gemma2"]), dtype="float32", device="cpu",
                                           max_model_len=64, max_total_tokens=256))
    assert hybrid.runner.uniform_sliding_window == 0


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_siblings_of_a_windowed_request_recompute_what_it_released(tmp_path, caching):
    """n > 1 on a windowed model: the samples after the first share its prompt blocks only up to
    the first it released (with the prefix cache off nothing else keeps them) and compute the rest;
    every sample's greedy tokens are transformers'."""
    from test_engine_scheduling import random_tokens, request, run

    model = _copy_with(tmp_path, "mistral", sliding_window=8)
    core = EngineCore(EngineConfig.build(str(model), dtype="float32", device="cpu", block_size=4, max_model_len=128,
                                         max_num_seqs=8, max_total_tokens=256, chunked_prefill_size=16,
                                         enable_prefix_caching=caching))
    prompt = random_tokens(np.random.default_rng(2), 37)
    reqs = [request(1, prompt, 12)] + [request(i, prompt, 12, wait_for=1) for i in (2, 3)]
    outs, _, _ = run(core, reqs)
    expected = hf_greedy(model, prompt, 12)
    assert all(outs[i] == expected for i in (1, 2, 3))
    assert core.scheduler.num_used_tokens == 0


def test_the_window_bench_shows_kv_bounded_by_the_window_through_the_cli(tmp_path):
    """scripts/bench_window.py (issue 26's long-context figure) on the tiny Mistral: through the real CLI
    and gRPC, the windowed copy's request holds about its window of KV at any context (GetLoads), the
    full-attention copy its whole length."""
    import subprocess
    import sys

    from worker_harness import REPO

    out = tmp_path / "window.json"
    subprocess.run([sys.executable, "scripts/bench_window.py", "--model", str(tiny_models()["mistral"]),
                    "--window", "16", "--contexts", "64", "256", "--output-len", "32", "--out", str(out), "--",
                    "--block-size", "16"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    windowed, full = result["variants"]["window 16"], result["variants"]["full attention"]
    assert [r["context"] for r in windowed] == [r["context"] for r in full] == [64, 256]
    for row in windowed:  # while decoding: the window, the block it ends in and the next one
        assert row["output_tokens"] == 32 and row["kv_polls_decoding"] >= 1, row
        assert 16 <= row["kv_tokens_held_max"] <= 16 + 2 * 16, row
        assert row["kv_tokens_held_prefill_max"] <= row["context"] + 16, row  # the prompt's chunk, no more
    for row in full:
        assert row["context"] <= row["kv_tokens_held_max"] <= row["context"] + 32, row
    assert result["kv_held_longest_over_window"] <= 3
