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


@pytest.mark.parametrize("name", ["mistral", "phi3", "mixtral"])
def test_a_window_must_cover_the_served_length(tmp_path, name):
    """sliding_window 32: served up to 32 positions (attention then sees every earlier token, as
    transformers' windowed attention does within the window); a longer --max-model-len is one
    clear error naming the flag, from the CLI's config and from the model itself."""
    from tokenspeed_worker.config.worker import _sliding_window

    model = _copy_with(tmp_path, name, sliding_window=32)
    assert _sliding_window(str(model)) == 32
    with pytest.raises(ValueError, match="sliding_window 32 is shorter than the served length 64.*--max-model-len 32"):
        _engine(model, 64)
    core = _engine(model, 32)
    rng = np.random.default_rng(5)
    requests = [greedy(i + 1, rng.integers(3, core.runner.vocab_size, size=n).tolist(), 6) for i, n in enumerate([20, 26])]
    outputs = run_staggered(core, requests, arrive_at=[0, 1])
    for r in requests:
        assert outputs[r.req_id] == hf_greedy(model, r.prompt_ids.tolist(), 6)


def test_the_cli_serves_a_windowed_model_up_to_its_window(tmp_path):
    """Unset, --max-model-len becomes the window; past it, one error naming the flag. A Qwen2-style
    window that use_sliding_window turns off counts for nothing."""
    from tokenspeed_worker import cli
    from tokenspeed_worker.config.worker import WorkerConfig

    model = _copy_with(tmp_path, "mistral", sliding_window=48)
    config = WorkerConfig.from_args(cli.prepare([str(model)]))
    assert config.engine.scheduler.max_model_len == 48
    with pytest.raises(ValueError, match="--max-model-len 100 exceeds the model's sliding_window \\(48\\)"):
        WorkerConfig.from_args(cli.prepare([str(model), "--max-model-len", "100"]))
    qwen2 = _copy_with(tmp_path, "qwen2-bias", sliding_window=48, use_sliding_window=False)
    assert WorkerConfig.from_args(cli.prepare([str(qwen2)])).engine.scheduler.max_model_len == 4096


def test_quantized_fused_phi3_projections_are_refused():
    import torch

    from tokenspeed_worker.models.phi3 import Phi3ForCausalLM

    class Config:
        num_attention_heads, num_key_value_heads, hidden_size = 4, 2, 64

    model = Phi3ForCausalLM.__new__(Phi3ForCausalLM)
    model.__dict__["config"] = Config()
    with pytest.raises(ValueError, match="quantized fused Phi-3 projections are not supported"):
        list(model._split_fused([("model.layers.0.self_attn.qkv_proj.weight_scale", torch.ones(1))]))
