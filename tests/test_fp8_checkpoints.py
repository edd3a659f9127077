"""FP8 checkpoints (compressed-tensors, quant_method fp8 per-tensor and block-wise, ModelOpt)
against transformers on the same weights dequantized, and the startup refusals of the real CLI.

On CPU the worker dequantizes the FP8 weights at load (layers/quantization/methods.py), so its
greedy tokens must equal transformers' on the reference checkpoint exactly. The FP8 form the GPU
keeps (FP8 weight, one scale per row, per-token quantized activations) is checked here on CPU
through the same code with kernels/fp8.py's float32 product, and against the real GEMMs on the GPU
(tests/test_fp8_gemm.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine.engine_core import EngineCore
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.layers.quantization import UnsupportedQuantization, resolve_quantization
from tokenspeed_worker.sampling.params import SamplingParams
from worker_harness import CACHE, REPO, _load_script, free_port, hf_greedy, needs_devices, tiny_models

PROMPTS = [[5, 17, 99, 230, 41, 7, 300], [12, 480, 3, 3, 77]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def fp8_models():
    return _load_script("make_fp8_models").make_all(CACHE / "fp8_models", tiny_models())


def engine_greedy(model_dir, **settings) -> dict[int, list[int]]:
    core = EngineCore(EngineConfig.build(str(model_dir), dtype="float32", device="cpu", block_size=4,
                                         max_model_len=128, max_num_seqs=4, max_total_tokens=512, **settings))
    for i, prompt in enumerate(PROMPTS):
        core.add_request(AddRequest(i + 1, np.asarray(prompt, dtype=np.int32), MAX_NEW, SamplingParams(temperature=0.0)))
    outputs = {i + 1: [] for i in range(len(PROMPTS))}
    for out in core.run_steps():
        if out is not None:
            for rid, tok in zip(out.req_ids.tolist(), out.tokens.tolist()):
                outputs[rid].append(tok)
    return outputs


@pytest.mark.parametrize("name", ["ct-tensor", "ct-channel", "fp8-tensor", "fp8-block", "fp8-sharded", "modelopt",
                                  "online", "fp8-block-moe", "ct-channel-moe"])
def test_fp8_checkpoint_greedy_equals_transformers_on_dequantized_weights(fp8_models, name):
    fp8_dir, ref_dir = fp8_models[name]
    outputs = engine_greedy(fp8_dir, **({"quantization": "fp8"} if name == "online" else {}))
    for i, prompt in enumerate(PROMPTS):
        assert outputs[i + 1] == hf_greedy(ref_dir, prompt, MAX_NEW), f"{name}, prompt {i}"


def test_detected_schemes(fp8_models):
    ct = resolve_quantization(str(fp8_models["ct-channel"][0]), None)
    assert (ct.method, ct.scheme.weight, ct.scheme.activation, ct.scheme.activation_granularity) == (
        "compressed-tensors", "channel", "dynamic", "token")
    assert ct.is_ignored("model.layers.0.self_attn.k_proj") and not ct.is_ignored("model.layers.1.self_attn.k_proj")
    block = resolve_quantization(str(fp8_models["fp8-block"][0]), "fp8")
    assert (block.scheme.weight, block.scheme.block, block.scheme.scale_name) == ("block", (128, 128), "weight_scale_inv")
    mo = resolve_quantization(str(fp8_models["modelopt"][0]), "modelopt")
    assert (mo.method, mo.scheme.activation) == ("modelopt", "static")
    assert mo.is_ignored("lm_head")
    assert resolve_quantization(str(tiny_models()["qwen2-bias"]), None) is None
    online = resolve_quantization(str(fp8_models["online"][0]), "fp8")
    assert (online.method, online.online, online.scheme.weight, online.scheme.activation_granularity) == (
        "fp8", True, "channel", "token")


def test_ignored_layers_load_unquantized(fp8_models):
    from worker_harness import make_runner

    runner = make_runner(fp8_models["ct-channel"][0], dtype="float32", device="cpu", block_size=4, max_model_len=64,
                         max_total_tokens=256)
    layers = runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.quant_method is None  # re: ignore entry
    assert layers[1].self_attn.qkv_proj.quant_method is not None
    assert layers[1].self_attn.qkv_proj.gemv is runner.small_batch_gemv is layers[0].self_attn.qkv_proj.gemv


def _block_layer(sizes=(24, 37), k=40, block=16, seed=0):
    """A fused layer loaded with block-wise FP8 shards `sizes` x k (tiles block x block, partial at
    the edges); returns (layer, the float weight its FP8 values and tile scales stand for)."""
    import torch

    from tokenspeed_worker.layers.linear import MergedLinear
    from tokenspeed_worker.layers.quantization import Fp8LinearScheme, QuantConfig
    from tokenspeed_worker.layers.quantization.methods import building

    quantize = _load_script("make_fp8_models").quantize
    config = QuantConfig("fp8", Fp8LinearScheme("block", block=(block, block), scale_name="weight_scale_inv"))
    torch.manual_seed(seed)
    with building(config):
        layer = MergedLinear(k, list(sizes), prefix="m.gate_up_proj", shard_names=["m.gate_proj", "m.up_proj"])
    expected = []
    for shard, rows in enumerate(sizes):
        w = torch.randn(rows, k) * torch.linspace(0.1, 3, k)
        q, scale, deq = quantize(w, "block", block=block)
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard)
        expected.append(deq)
    return layer, torch.cat(expected)


def test_block_scales_dequantize_by_block():
    """Several blocks per matrix, partial ones at the edges, over fused shards: where FP8 is not
    kept, the weight becomes its values times their tile's scale."""
    import torch

    layer, expected = _block_layer()
    layer.quant_method.process_weights_after_loading(layer, keep_fp8=False)
    assert torch.equal(layer.weight.data, expected) and layer.weight_scale_rows is None


@pytest.mark.parametrize("sizes,block_rows", [((48, 74), 1), ((64, 96), 32)], ids=["partial-tiles", "whole-tiles"])
def test_kept_block_fp8_runs_the_block_scaled_gemm(sizes, block_rows):
    """Kept FP8 with tile scales (the checkpoint's where every shard is whole tiles, else one per
    row): the product (the Triton kernel on CUDA, its torch reference on CPU) equals the float
    product over the activations' per-group quantization, and a KV-scale fold scales the rows."""
    import torch

    from tokenspeed_worker.kernels import fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k = 80  # two whole K groups of 32 and a partial one
    layer, expected = _block_layer(sizes, k=k, block=32)
    layer.quant_method.process_weights_after_loading(layer, keep_fp8=True)
    layer = layer.to(device)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_block_rows == block_rows
    torch.manual_seed(4)
    for rows in (1, 3, 40, 130):
        x = torch.randn(rows, k).to(torch.bfloat16)
        out = layer(x.to(device)).cpu()
        # Quantized on the layer's device: CUDA's amax / 448 is amax * (1 / 448), the CPU's a true
        # division, and scales one bit apart round some values apart.
        q, s = (t.cpu() for t in fp8.quantize_groups_reference(x.to(device), 32))
        reference = (q.float() * fp8.expand_scales(s, 1, 32, q.shape)) @ expected.t()
        torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    before = layer(torch.ones(1, k).to(torch.bfloat16).to(device)).float().cpu()
    layer.scale_output_rows(0.25, slice(8, 30))  # inside tiles: the scales become per-row
    after = layer(torch.ones(1, k).to(torch.bfloat16).to(device)).float().cpu()
    factor = torch.ones(sum(sizes))
    factor[8:30] = 0.25
    torch.testing.assert_close(after, before * factor, rtol=1e-2, atol=1e-2)
    assert layer.weight_block_rows == 1


def test_k_groups_the_block_gemm_cannot_take_are_dequantized():
    """An FP8 dot needs K steps of 32+ columns: 16-wide blocks run dequantized, even where FP8 is kept."""
    import torch

    from tokenspeed_worker.kernels import fp8

    layer, expected = _block_layer(block=16)
    layer.quant_method.process_weights_after_loading(layer, keep_fp8=True)
    assert layer.weight.dtype == torch.get_default_dtype() and getattr(layer, "weight_scale_blocks", None) is None
    torch.testing.assert_close(layer.weight.data, expected)
    assert not fp8.block_gemm_supports(16) and not fp8.block_gemm_supports(96) and fp8.block_gemm_supports(128)


def test_a_block_gemm_that_disagrees_with_its_reference_falls_back_to_dequantized(monkeypatch, caplog):
    import torch

    from tokenspeed_worker.kernels import fp8
    from tokenspeed_worker.layers.quantization import methods

    layer, expected = _block_layer(block=32, k=80)
    layer.quant_method.process_weights_after_loading(layer, keep_fp8=True)
    methods._check_block_gemm([layer])  # agrees: kept
    assert layer.weight.dtype == torch.float8_e4m3fn
    monkeypatch.setattr(fp8, "block_scaled_mm", lambda *a, **k: fp8.block_scaled_mm_reference(*a, **k) * 1.5)
    methods._check_block_gemm([layer])
    assert "disagrees with its reference" in caplog.text
    assert layer.weight.dtype == torch.get_default_dtype() and getattr(layer, "weight_scale_blocks", None) is None
    torch.testing.assert_close(layer.weight.data, expected)
    x = torch.randn(2, 80)
    torch.testing.assert_close(layer(x), x @ expected.t())


@pytest.mark.parametrize("m,n,k,block_rows", [(3, 200, 300, 128), (40, 64, 128, 1), (1, 256, 256, 128),
                                               (70, 130, 200, 1)])
def test_block_scaled_gemm_kernel_equals_torch(m, n, k, block_rows):
    """The Triton kernels (the interpreter on CPU): group quantization bit for bit, the block-scaled
    GEMM within the bf16 output's rounding; partial groups, tiles and M/N tiles at the edges."""
    import torch

    from tokenspeed_worker.kernels import fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(m + n)
    x = (torch.randn(m, k) * torch.logspace(-2, 1, k)).to(torch.bfloat16).to(device)
    q, s = fp8.quantize_groups(x, 128, use_kernel=True)
    q_ref, s_ref = fp8.quantize_groups_reference(x, 128)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    w = torch.randn(n, k).to(torch.float8_e4m3fn).to(device)
    s_w = (torch.rand(-(-n // block_rows), -(-k // 128)) + 0.5).to(device)
    bias = torch.randn(n).to(torch.bfloat16).to(device)
    out = fp8.block_scaled_mm(q, s, w, s_w, block_rows, 128, bias, torch.bfloat16, use_kernel=True)
    ref = fp8.block_scaled_mm_reference(q, s, w, s_w, block_rows, 128, bias, torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def _cli(model_dir, *flags):
    cmd = [sys.executable, "-m", "tokenspeed_worker", str(model_dir), "--device", "cpu", "--port", str(free_port()), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("case", ["mismatch", "online-mismatch", "unsupported-scheme", "unsupported-flag"])
def test_cli_refuses_with_exit_2_naming_the_field(fp8_models, tmp_path, case):
    if case == "mismatch":
        result, expected = _cli(fp8_models["fp8-tensor"][0], "--quantization", "modelopt"), "--quantization modelopt"
        assert "'fp8'" in result.stderr
    elif case == "online-mismatch":  # online quantization is fp8 only
        result = _cli(tiny_models()["qwen2-bias"], "--quantization", "modelopt")
        expected = "--quantization modelopt does not match the checkpoint: its config.json has no quantization_config"
    elif case == "unsupported-scheme":
        model = tmp_path / "int4"
        shutil.copytree(fp8_models["ct-tensor"][0], model)
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)
        (model / "config.json").write_text(json.dumps(config))
        result, expected = _cli(model), "config_groups.group_0.weights.type/num_bits 'int4' is not supported"
    else:
        result = _cli(fp8_models["fp8-tensor"][0], "--quantization", "awq")
        expected = "--quantization awq is not supported yet (supported: fp8, compressed-tensors, modelopt)"
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr


def test_unsupported_quant_method_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(UnsupportedQuantization, match="quant_method 'awq' is not supported"):
        resolve_quantization(str(tmp_path), None)


@pytest.mark.parametrize("name,method", [("ct-channel", "compressed-tensors"), ("online", "fp8")])
def test_tp2_per_channel_fp8_through_the_cli_equals_transformers(fp8_models, name, method):
    """Per-channel scales split with their rows (column-parallel) and stay whole (row-parallel);
    online FP8 quantizes each whole checkpoint row before the split, so every rank holds the scales
    one GPU would."""
    from test_grpc_sampling import complete, gen
    from worker_harness import Worker

    needs_devices(2)
    fp8_dir, ref_dir = fp8_models[name]
    worker = Worker(fp8_dir, "--max-model-len", "128", "--max-total-tokens", "512", "--tensor-parallel-size", "2",
                    "--quantization", method)
    try:
        for prompt in PROMPTS:
            c, _ = complete(worker, gen(prompt, max_new_tokens=MAX_NEW))
            assert list(c.output_ids) == hf_greedy(ref_dir, prompt, MAX_NEW), prompt
    finally:
        assert worker.stop() == 0, worker.log()


# ---- the FP8 form kept on the GPU, through the same code on CPU ------------------------------


def _kept_layer(scheme_weight: str, rows=(24, 40), k=48, online=False, seed=0):
    """A fused layer loaded from a float weight (online) or an FP8 one with `scheme_weight` scales,
    processed into the kept-FP8 form; returns (layer, the float weight its FP8 values stand for)."""
    import torch

    from tokenspeed_worker.layers.linear import MergedLinear
    from tokenspeed_worker.layers.quantization import Fp8LinearScheme, QuantConfig
    from tokenspeed_worker.layers.quantization.methods import building

    from tokenspeed_worker.kernels import fp8

    quantize = _load_script("make_fp8_models").quantize
    scheme = Fp8LinearScheme(scheme_weight)
    torch.manual_seed(seed)
    with building(QuantConfig("fp8", scheme, online=online)):
        layer = MergedLinear(k, list(rows), prefix="m.gate_up_proj", shard_names=["m.gate_proj", "m.up_proj"])
    expected = []
    for shard, n in enumerate(rows):
        w = torch.randn(n, k) * torch.linspace(0.1, 3, k)
        if online:  # as methods.quantize_online feeds the loaders
            q, scale = fp8.quantize_weight_rows(w)
            deq = quantize(w, "channel")[2]
        else:
            q, scale, deq = quantize(w, scheme_weight)
        layer.weight.weight_loader(layer.weight, q, shard)
        getattr(layer, "weight_scale").weight_loader(layer.weight_scale, scale, shard)
        expected.append(deq)
    layer.quant_method.process_weights_after_loading(layer, keep_fp8=True)
    return layer, torch.cat(expected)


@pytest.mark.parametrize("scheme_weight,online", [("tensor", False), ("channel", False), ("channel", True)])
def test_kept_fp8_form_holds_fp8_weights_and_a_scale_per_row(scheme_weight, online):
    import torch

    layer, expected = _kept_layer(scheme_weight, online=online)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_rows.shape == (64,)
    assert not hasattr(layer, "weight_scale")  # the checkpoint's scales are gone
    assert torch.equal(layer.weight.float() * layer.weight_scale_rows[:, None], expected)


def test_kept_fp8_product_quantizes_each_token_and_scales_in_the_epilogue():
    import torch

    from tokenspeed_worker.kernels import fp8

    layer, expected = _kept_layer("channel")
    torch.manual_seed(1)
    x = torch.randn(3, 5, 48) * torch.tensor([0.01, 1.0, 100.0]).view(3, 1, 1)  # rows of very different ranges
    out = layer(x)
    assert out.shape == (3, 5, 64) and out.dtype == x.dtype
    q, s = fp8.quantize_rows_reference(x)
    assert s.shape == (15, 1) and torch.equal(q.float().abs().amax(dim=1), torch.full((15,), 448.0))
    reference = ((q.float() * s) @ expected.t()).view(3, 5, 64)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    exact = x @ expected.t()  # the activations' own rounding: within a few e4m3 steps of the unquantized x
    assert ((out - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("k,one_pass_limit", [(40, None), (200, 64)], ids=["one-pass", "two-pass"])
def test_quantize_rows_kernel_equals_torch(monkeypatch, k, one_pass_limit):
    """The Triton kernel (the interpreter on CPU) against the torch reference, bit for bit: rows of
    very different ranges and a zero row."""
    import torch

    from tokenspeed_worker.kernels import fp8

    if one_pass_limit is not None:  # rows longer than the one-pass limit: amax first, then quantize
        monkeypatch.setattr(fp8, "MAX_K_ONE_PASS", one_pass_limit)
    torch.manual_seed(2)
    x = (torch.randn(4, k) * torch.tensor([1e-3, 1.0, 30.0, 0.0]).view(4, 1)).to(torch.bfloat16)
    x = x.to("cuda" if torch.cuda.is_available() else "cpu")
    q, s = fp8.quantize_rows(x, use_kernel=True)
    q_ref, s_ref = fp8.quantize_rows_reference(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[3].item() == pytest.approx(fp8.MIN_SCALE) and not q[3].float().any()


def _spy_small_batch_linear(mp: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments of every kernels.gemv.small_batch_linear call from here on (mp's scope)."""
    from tokenspeed_worker.kernels import gemv

    calls, real = [], gemv.small_batch_linear

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    mp.setattr(gemv, "small_batch_linear", spy)
    return calls


def test_kept_fp8_layer_takes_the_small_batch_kernel_for_few_rows():
    """A kept-FP8 layer hands few rows to the small-batch GEMV kernel (the interpreter here, in its
    first FP8 configuration) with its per-row scales, 5 to 16 rows to its tensor-core configurations;
    more rows take the scaled GEMM."""
    import torch

    from tokenspeed_worker.kernels import gemv
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.small_batch_gemv import SmallBatchGemv

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU
    layer, expected = _kept_layer("tensor")
    layer = layer.to(device)
    layer.gemv = SmallBatchGemv()
    torch.manual_seed(3)
    with fused_kernels("force"), pytest.MonkeyPatch.context() as mp:
        calls = _spy_small_batch_linear(mp)
        x = torch.randn(3, 48).to(torch.bfloat16)
        out = layer(x.to(device)).cpu()
        assert [kwargs["config"] for kwargs in calls] == [gemv.FP8_CONFIGS[0]]
        torch.testing.assert_close(out.double(), x.double() @ expected.double().t(), rtol=2e-2, atol=2e-2)
        layer(torch.randn(9, 48).to(torch.bfloat16).to(device))  # past MAX_ROWS: a tensor-core configuration
        assert [kwargs["config"] for kwargs in calls[1:]] == [gemv.FP8_MMA_CONFIGS[0]]
        layer(torch.randn(17, 48).to(torch.bfloat16).to(device))  # past MMA_MAX_ROWS: the scaled GEMM
        assert len(calls) == 2


@pytest.mark.parametrize("sizes,gemv_rows", [((64, 96), True), ((48, 74), False)], ids=["whole-tiles", "partial"])
def test_kept_block_fp8_layer_takes_the_small_batch_kernel_for_few_rows(sizes, gemv_rows):
    """A kept block-FP8 layer whose shards are whole tile rows hands few rows to the small-batch
    GEMV kernel with its tile scales (the interpreter here); expanded per-row scales (shards cut
    inside a tile) and more rows take the block-scaled GEMM."""
    import torch

    from tokenspeed_worker.kernels import fp8, gemv
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.small_batch_gemv import SmallBatchGemv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer, expected = _block_layer(sizes, k=80, block=32)
    layer.quant_method.process_weights_after_loading(layer, keep_fp8=True)
    layer = layer.to(device)
    layer.gemv = SmallBatchGemv()
    torch.manual_seed(5)
    with fused_kernels("force"), pytest.MonkeyPatch.context() as mp:
        calls = _spy_small_batch_linear(mp)
        x = torch.randn(3, 80).to(torch.bfloat16)
        out = layer(x.to(device)).cpu()
        if gemv_rows:
            (kwargs,) = calls
            assert kwargs["config"] == gemv.configs_for(fp8.FP8_DTYPE, block_rows=32)[0]
            assert kwargs["weight_block_scales"].rows == 32 and kwargs["weight_block_scales"].cols == 32
            reference = x.double() @ expected.double().t()  # 16-bit rows, FP8 weights: no activation rounding
            torch.testing.assert_close(out.double(), reference, rtol=2e-2, atol=2e-2)
        else:
            assert calls == []
        layer(torch.randn(9, 80).to(torch.bfloat16).to(device))  # past MAX_ROWS: the block-scaled GEMM
        assert len(calls) == (1 if gemv_rows else 0)


def test_online_fp8_quantizes_each_linear_weight_as_it_streams_in(fp8_models):
    """`--quantization fp8`: the runner's layers hold FP8 weights and per-row scales from the first
    tensor on (no 16-bit copy of a quantized layer is ever made whole); embeddings, norms and the
    LM head pass through as they are."""
    import torch
    from safetensors import safe_open

    from tokenspeed_worker.layers.quantization import methods
    from worker_harness import make_runner

    fp8_dir, _ = fp8_models["online"]
    runner = make_runner(fp8_dir, dtype="float32", device="cpu", block_size=4, max_model_len=64,
                         max_total_tokens=256, quantization="fp8")
    modules = methods.online_modules(runner.model)
    assert "model.layers.0.self_attn.q_proj" in modules and "model.layers.1.mlp.down_proj" in modules
    assert not any("embed" in m or "lm_head" in m or "norm" in m for m in modules)
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        source = [(name, f.get_tensor(name)) for name in sorted(f.keys())]
    out = dict(methods.quantize_online(runner.model, iter(source), torch.device("cpu")))
    for name, tensor in source:
        module = name.removesuffix(".weight")
        if module in modules:
            assert out[name].dtype == torch.float8_e4m3fn and out[f"{module}.weight_scale"].shape == (tensor.shape[0],)
            assert out[name].float().abs().amax(dim=1).eq(448).all()  # each row's largest maps to 448
        else:
            assert out[name] is tensor


def test_online_fp8_of_a_dummy_model_is_the_same_model_rounded(fp8_models):
    """`--load-format dummy --quantization fp8` draws the unquantized dummy model's weights and
    quantizes them (what scripts/fp8_accuracy.py compares): each weight, dequantized, is the bf16
    one to FP8's rounding, never its unscaled FP8 values."""
    import torch

    from worker_harness import make_runner

    _, ref_dir = fp8_models["online"]
    settings = dict(dtype="bfloat16", device="cpu", block_size=4, max_model_len=64, max_total_tokens=256,
                    load_format="dummy")
    plain = dict(make_runner(ref_dir, **settings).model.named_parameters())
    online = dict(make_runner(ref_dir, quantization="fp8", **settings).model.named_parameters())
    assert plain.keys() == online.keys()
    for name, weight in plain.items():
        error = (online[name].float() - weight.float()).abs().max().item()
        assert error <= weight.float().abs().max().item() / 16, name  # e4m3: 3 mantissa bits
