"""The rotary tables (layers/rotary.py) of every supported rope type against transformers' own
rotary modules: the same cos and sin (attention scaling included) at every position, where
transformers' choice is the server's (longrope and dynamic NTK: the module docstring)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_worker.layers.rotary import SUPPORTED_ROPE_TYPES, get_rope, serving_length


def _llama_config(rope: dict, max_position: int = 256, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       max_position_embeddings=max_position, rope_parameters={"rope_theta": 10000.0, **rope}, **extra)


def _hf_cos_sin(config, positions: torch.Tensor, module=None):
    if module is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as module
    rotary = module(config)
    x = torch.zeros(1, positions.numel(), 8)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
                   "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("case", list(CASES))
def test_fixed_rope_types_equal_transformers(case):
    config = _llama_config(CASES[case])
    positions = torch.arange(256)
    cos, sin = _hf_cos_sin(config, positions)
    rope = get_rope(config, 32)
    torch.testing.assert_close(rope.cos_cache[positions], cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[positions], sin, rtol=1e-6, atol=1e-6)


def test_every_supported_type_is_tested_and_others_refused():
    assert set(SUPPORTED_ROPE_TYPES) <= {c.split("-")[0] for c in CASES} | {"longrope"}
    with pytest.raises(ValueError, match="rope_type 'proportional' is not supported"):
        get_rope(_llama_config({"rope_type": "proportional"}), 32)


def test_legacy_rope_scaling_spelling():
    """A config.json of transformers 4's day: rope_theta beside rope_scaling {"type": ...}."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256,
                         rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    cos, _ = _hf_cos_sin(config, torch.arange(256))
    torch.testing.assert_close(get_rope(config, 32).cos_cache, cos, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("served", [16, 256], ids=["within-original", "past-original"])
def test_longrope_takes_the_factors_transformers_takes_for_the_served_length(served):
    """Phi-3's longrope with partial rotary: short factors while the served length is within
    original_max_position_embeddings (transformers' choice for every sequence that fits), long
    ones past it (transformers' choice for every sequence past it), with its attention scaling."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    dim = 12  # rotary dims: 32 * 0.75 = 24 -> 12 factors
    config = Phi3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                        original_max_position_embeddings=16, partial_rotary_factor=0.75,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.0 + 0.1 * i for i in range(dim)],
                                         "long_factor": [2.0 + 0.5 * i for i in range(dim)],
                                         "original_max_position_embeddings": 16, "partial_rotary_factor": 0.75})
    with serving_length(served):
        rope = get_rope(config, 32)
    assert rope.rotary_dim == 24
    positions = torch.arange(served)  # transformers picks by the forward's longest position
    cos, sin = _hf_cos_sin(config, positions, Phi3RotaryEmbedding)
    torch.testing.assert_close(rope.cos_cache[positions], cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[positions], sin, rtol=1e-6, atol=1e-6)


def test_dynamic_ntk_scales_the_base_once_for_a_served_length_past_max_positions():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _llama_config({"rope_type": "dynamic", "factor": 2.0}, max_position=64)
    with serving_length(128):
        rope = get_rope(config, 32)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, torch.device("cpu"), seq_len=128)
    expected = torch.arange(128, dtype=torch.float32)[:, None] * inv_freq[None, :]  # every served position
    torch.testing.assert_close(rope.cos_cache[:, :16], expected.cos(), rtol=1e-6, atol=1e-6)
    unscaled = get_rope(config, 32)  # served within max_position_embeddings: transformers' own base
    assert unscaled.cos_cache.shape[0] == 64 and not torch.allclose(rope.cos_cache[:64], unscaled.cos_cache)


def test_max_model_len_may_reach_the_positions_a_scaling_stretches_to(tmp_path):
    """--max-model-len up to max_position_embeddings x factor (linear, dynamic; yarn from
    original_max_position_embeddings), as vLLM derives it; past that, one clear error."""
    import json

    from tokenspeed_worker.config.worker import _max_positions

    for rope, expected in (({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
                           ({"type": "dynamic", "factor": 2.0}, 65536), ({"rope_type": "linear", "factor": 0.5}, 32768),
                           ({"rope_type": "llama3", "factor": 8.0}, 32768), ({}, 32768)):
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "rope_scaling": rope}))
        assert _max_positions(str(tmp_path)) == expected, rope
