"""FP8 KV-cache scales (layers/quantization/kv_scales.py): read from `--quantization-param-path` or
the checkpoint, folded into the attention weights so the cache holds k / s_k and v / s_v.

The proof uses "hot" and "cold" copies of the tiny models: k (and v) made 1024 times larger or
smaller and q (and the output projection) the inverse, which computes exactly what the model did
(powers of two scale without rounding). In an unscaled FP8 cache their keys saturate at +-448 or
sink below e4m3's smallest values; with their scales (2^14 or 2^-10) folded in, the weights are
bit for bit the original model's, so the logits equal the original model's on the same FP8 cache.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tokenspeed_worker.layers.quantization import kv_scales
from worker_harness import Worker, make_runner, tiny_models

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FACTOR = 2.0**14  # hot: the tiny models' keys (|k| up to a few) then reach thousands


def _write_scaled_copy(src, dst, factor: float, names: str | None = None):
    """A copy of the tiny model at `src` with k and v `factor` times larger and q, o the inverse
    (in the q/k norms where the model has them); `names`: also store the scales in the checkpoint
    under that naming ("modelopt", "compressed-tensors" or "kv")."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    state = load_file(str(dst / "model.safetensors"))
    qk_norm = any(".self_attn.k_norm." in k for k in state)
    factors = {"q_norm" if qk_norm else "q_proj": 1 / factor, "k_norm" if qk_norm else "k_proj": factor,
               "v_proj": factor, "o_proj": 1 / factor}
    for key in list(state):
        module, _, kind = key.rpartition(".")
        part = module.rpartition(".")[2]
        if ".self_attn." not in key or part not in factors or kind not in ("weight", "bias"):
            continue
        if kind == "bias" and part == "o_proj":
            continue  # o(x) = W x + b: only W scales x
        if state[key].dtype == torch.float8_e4m3fn:  # an FP8 checkpoint: its scale takes the factor
            key = f"{module}.weight_scale"
        state[key] = state[key] * factors[part]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.self_attn"
        scale = torch.tensor(factor, dtype=torch.float32)
        if names == "modelopt":
            state[f"{prefix}.k_proj.k_scale"], state[f"{prefix}.v_proj.v_scale"] = scale, scale.clone()
        elif names == "compressed-tensors":
            state[f"{prefix}.k_scale"], state[f"{prefix}.v_scale"] = scale, scale.clone()
        elif names == "kv":
            state[f"{prefix}.kv_scale"] = scale
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _scales_file(path, num_layers: int, scale: float, ranks=("0",)):
    path.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {r: {str(i): scale for i in range(num_layers)} for r in ranks}}}))
    return str(path)


def _logits(path, kv="fp8", **settings):
    """The logits of a prefill and a decode step of two sequences; on CUDA through the Triton
    backend (and an FP8 checkpoint's weights kept FP8), on CPU through the torch reference."""
    from test_triton_backend import BLOCK_SIZE

    backend = "auto" if DEVICE == "cuda" else "torch"
    runner = make_runner(str(path), dtype="float32", device=DEVICE, block_size=BLOCK_SIZE, kv_cache_dtype=kv,
                         attention_backend=backend, **settings)
    return _steps(runner), runner


def _steps(runner) -> torch.Tensor:
    """The logits of the same two steps on a fresh pool of `runner`'s."""
    from test_triton_backend import Plans, random_seqs

    runner.allocate_kv_cache(32)
    seqs = random_seqs([20, 9], seed=2)
    plans = Plans(num_blocks=32, seed=2)
    out = [runner.forward_all_logits(plans.plan([(s, len(s.tokens)) for s in seqs]))]
    for s in seqs:
        s.tokens.append(7)
    out.append(runner.forward_all_logits(plans.plan([(s, 1) for s in seqs])))
    return torch.cat(out)


def _relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model", ["llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("factor", [FACTOR, 2.0**-10], ids=["hot", "cold"])
def test_scaled_copies_need_their_scales_and_then_equal_the_original(tmp_path, model, factor):
    exact, _ = _logits(tiny_models()[model], kv="auto")  # the float32 cache
    original, _ = _logits(tiny_models()[model])
    scaled = _write_scaled_copy(tiny_models()[model], tmp_path / "m", factor)
    layers = json.loads((scaled / "config.json").read_text())["num_hidden_layers"]
    unscaled, runner = _logits(scaled)
    assert runner.kv_scales_source == "none"
    # Saturated (hot) or sunk to zero (cold) keys and values: several times e4m3's own error.
    assert _relative(unscaled, exact) > 3 * _relative(original, exact)
    with_file, runner = _logits(scaled, quantization_param_path=_scales_file(tmp_path / "s.json", layers, factor))
    assert runner.kv_scales_source == "file"
    assert torch.equal(with_file, original)
    same_in_float32, _ = _logits(scaled, kv="auto")  # a 16- or 32-bit cache needs no scales
    torch.testing.assert_close(same_in_float32, exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("names", ["modelopt", "compressed-tensors", "kv"])
def test_checkpoint_scales_under_each_naming_are_folded(tmp_path, names):
    model = tiny_models()["llama-gqa-tied"]
    original, _ = _logits(model)
    scaled = _write_scaled_copy(model, tmp_path / "m", FACTOR, names=names)
    got, runner = _logits(scaled)
    assert runner.kv_scales_source == "checkpoint"
    assert runner.model.checkpoint_kv_scales[0] == ({"kv": FACTOR} if names == "kv" else {"k": FACTOR, "v": FACTOR})
    assert torch.equal(got, original)
    _, runner = _logits(scaled, kv="auto")  # noted, not applied: the cache is float32
    assert runner.kv_scales_source == "unused"
    # The file wins over the checkpoint: scales of 1.0 leave the hot copy saturating.
    layers = json.loads((scaled / "config.json").read_text())["num_hidden_layers"]
    got, runner = _logits(scaled, quantization_param_path=_scales_file(tmp_path / "s.json", layers, 1.0))
    assert runner.kv_scales_source == "file" and not torch.allclose(got, original, rtol=0.05, atol=0.05)


def test_an_fp8_checkpoint_with_modelopt_scales(tmp_path):
    """ModelOpt FP8 weights (kept FP8 on CUDA: the fold goes into their row scales) and its k/v
    scales: the hot copy equals the original on the FP8 cache."""
    from worker_harness import CACHE, _load_script

    fp8_dir = _load_script("make_fp8_models").make_all(CACHE / "fp8_models", tiny_models())["modelopt"][0]
    original, runner = _logits(fp8_dir)
    assert runner.kv_scales_source == "checkpoint"  # its scales of 1.0
    scaled = _write_scaled_copy(fp8_dir, tmp_path / "m", FACTOR, names="modelopt")
    got, runner = _logits(scaled)
    assert runner.kv_scales_source == "checkpoint"
    assert torch.equal(got, original)


def test_fold_is_the_identity_for_any_scale():
    """Scales that are not powers of two: the model computes what it did, up to float32 rounding."""
    _, runner = _logits(tiny_models()["qwen2-bias"], kv="auto")
    before, _ = _logits(tiny_models()["qwen2-bias"], kv="auto")
    runner.model.fold_kv_cache_scales({0: (0.37, 2.9), 1: (5.3, 0.011)})
    torch.testing.assert_close(_steps(runner), before, rtol=1e-4, atol=1e-4)


def test_a_kept_fp8_layer_scales_its_row_scales_exactly():
    from test_fp8_checkpoints import _kept_layer

    layer, _ = _kept_layer("channel")
    weight = layer.weight.clone()
    rows = layer.weight_scale_rows.clone()
    layer.scale_output_rows(0.3, slice(10, 30))
    assert torch.equal(layer.weight, weight)  # the FP8 values are untouched
    expected = rows.clone()
    expected[10:30] *= 0.3
    assert torch.equal(layer.weight_scale_rows, expected)


def test_checkpoint_names():
    assert kv_scales.checkpoint_scale("model.layers.3.self_attn.k_proj.k_scale") == (3, "k")
    assert kv_scales.checkpoint_scale("model.layers.12.self_attn.v_scale") == (12, "v")
    assert kv_scales.checkpoint_scale("model.layers.0.self_attn.kv_scale") == (0, "kv")
    assert kv_scales.checkpoint_scale("model.layers.0.self_attn.k_proj.weight_scale") is None
    assert kv_scales.checkpoint_scale("model.layers.0.self_attn.k_proj.input_scale") is None


@pytest.mark.parametrize("doc,message", [
    ("{not json", "is not JSON"),
    ({"kv_cache": {}}, "has no kv_cache.scaling_factor object"),
    ({"kv_cache": {"dtype": "float8_e5m2", "scaling_factor": {"0": {"0": 1.0, "1": 1.0}}}}, "kv_cache.dtype 'float8_e5m2'"),
    ({"kv_cache": {"scaling_factor": {"0": {"0": 1.0}}}}, "kv_cache.scaling_factor.0 lacks layer 1"),
    ({"kv_cache": {"scaling_factor": {"0": {"0": 1.0, "1": -2}}}}, "kv_cache.scaling_factor.0.1 must be a positive"),
    ({"kv_cache": {"scaling_factor": {"0": {"0": 1.0, "1": 1.0, "7": 1.0}}}}, "kv_cache.scaling_factor.0.7: the model has layers 0-1"),
    ({"kv_cache": {"scaling_factor": {"0": {}, "1": {}, "2": {}}}}, "has 3 tensor-parallel ranks; expected 1 (for every rank) or 2"),
])
def test_bad_files_name_the_field(tmp_path, doc, message):
    path = tmp_path / "scales.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError, match="--quantization-param-path") as e:
        kv_scales.read_scales_file(str(path), num_layers=2, tp_rank=0, tp_size=2)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        kv_scales.read_scales_file(str(tmp_path / "missing.json"), num_layers=2)


def test_rank_entries_pick_this_ranks_scales(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"0": 1.5}, "1": {"0": 2.5}}}}))
    assert kv_scales.read_scales_file(str(path), 1, tp_rank=1, tp_size=2) == {0: 2.5}
    path.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"0": 1.5}}}}))
    assert kv_scales.read_scales_file(str(path), 1, tp_rank=1, tp_size=2) == {0: 1.5}


def _cli(*args):
    import subprocess
    import sys

    from worker_harness import REPO, free_port

    cmd = [sys.executable, "-m", "tokenspeed_worker", *map(str, args), "--device", "cpu", "--port", str(free_port())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_the_cli_refuses_a_bad_file_or_a_16_bit_cache_with_exit_2(tmp_path):
    model = tiny_models()["llama-gqa-tied"]
    good = _scales_file(tmp_path / "good.json", 2, 1.0)
    result = _cli(model, "--quantization-param-path", good)  # --kv-cache-dtype auto
    assert result.returncode == 2 and "--quantization-param-path" in result.stderr
    assert "add --kv-cache-dtype fp8_e4m3" in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"0": 1.0}}}}))
    result = _cli(model, "--kv-cache-dtype", "fp8_e4m3", "--quantization-param-path", bad)
    assert result.returncode == 2 and "kv_cache.scaling_factor.0 lacks layer 1" in result.stderr, result.stderr


def test_a_cold_model_through_the_cli_equals_the_original_on_an_fp8_cache(tmp_path):
    """The worker as an operator runs it: the cold copy with its scales file greedy-decodes the
    original model's tokens on the same FP8 cache and says where its scales came from; without the
    file it warns. (The tiny model's greedy tokens barely depend on attention, so the logits tests
    above are the ones that show the scales matter.)"""
    from test_grpc_sampling import complete, gen

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.engine_core import EngineCore
    from tokenspeed_worker.engine.messages import AddRequest
    from tokenspeed_worker.sampling.params import SamplingParams

    model = tiny_models()["llama-gqa-tied"]
    scaled = _write_scaled_copy(model, tmp_path / "cold", 2.0**-10)
    layers = json.loads((scaled / "config.json").read_text())["num_hidden_layers"]
    prompt = np.random.default_rng(5).integers(3, 250, 40).tolist()
    core = EngineCore(EngineConfig.build(str(model), dtype="float32", device="cpu", max_model_len=128,
                                         max_total_tokens=512, kv_cache_dtype="fp8"))
    core.add_request(AddRequest(1, np.array(prompt, dtype=np.int32), 12, SamplingParams(temperature=0.0, seed=1)))
    expected = [t for out in core.run_steps() if out is not None for t in out.tokens.tolist()]
    flags = ("--max-model-len", "128", "--max-total-tokens", "512", "--kv-cache-dtype", "fp8_e4m3")
    got = {}
    for name, extra in (("file", ("--quantization-param-path", _scales_file(tmp_path / "s.json", layers, 2.0**-10))),
                        ("none", ())):
        worker = Worker(scaled, *flags, *extra)
        try:
            c, _ = complete(worker, gen(prompt, max_new_tokens=12))
            got[name] = list(c.output_ids)
            log = worker.log()
        finally:
            worker.stop()
        if name == "file":
            assert "per-layer scales from the --quantization-param-path file folded into the weights" in log, log
        else:
            assert "FP8 KV cache without scales" in log, log
    assert got["file"] == expected
