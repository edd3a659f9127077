"""The FP8 GEMMs on the GPU against float references: per-token activation quantization (bit for
bit against torch), cuBLASLt's row-wise scaled GEMM at Llama shapes from 1 to 8192 rows, and an
online-FP8 layer through the Linear layer at every row count (the small-batch GEMV kernel's rows
and the scaled GEMM's), each within a stated tolerance of float64 over the FP8 values.

Tolerances: the FP8 operands are exact in float32, so what remains is the accumulation order
(tensor cores accumulate in float32 with fewer guard bits) and the bf16 output's rounding:
‖out − ref‖ / ‖ref‖ below 1e-2 (bf16 output alone is about 2e-3).
"""

from __future__ import annotations

import pytest
import torch

from tokenspeed_worker.kernels import fp8

ON_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")]
SHAPES = {  # site: (N, K) of Llama-3.1-8B
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05
    return fp8.quantize_weight_rows(w)


@pytest.mark.parametrize("k", [4096, 14336, 28672])
def test_quantize_rows_kernel_equals_torch_on_the_gpu(k):
    g = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(37, k, device="cuda", generator=g) * torch.logspace(-3, 2, 37, device="cuda")[:, None])
    x = x.to(torch.bfloat16)
    x[5] = 0
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = fp8.quantize_rows_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("site", list(SHAPES))
@pytest.mark.parametrize("m", [1, 5, 64, 1000, 8192])
def test_scaled_mm_against_float64(site, m):
    n, k = SHAPES[site]
    w, s_w = _fp8_weight(n, k, seed=n + k)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    q, s_x = fp8.quantize_rows(x)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if site == "qkv" else None
    out = fp8.scaled_mm(q, s_x, w, s_w, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = (q.double() * s_x.double()) @ (w.double() * s_w.double()[:, None]).t()
    if bias is not None:
        ref += bias.double()
    assert _relative(out, ref) < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 300])
def test_online_fp8_linear_layer_at_every_row_count(rows):
    """A gate_up layer quantized online: the small-batch GEMV kernels (rows <= 16: CUDA-core ones to 4,
    tensor-core ones to 16; timed against the scaled GEMM) and the scaled GEMM both within 1e-2 of float64 over the FP8 values, and within the
    activations' quantization error of the bf16 layer."""
    from tokenspeed_worker.layers.activation import PendingActivation, SiluAndMul
    from tokenspeed_worker.layers.layernorm import PendingNorm, RMSNorm
    from tokenspeed_worker.layers.linear import MergedLinear
    from tokenspeed_worker.layers.quantization import Fp8LinearScheme, QuantConfig
    from tokenspeed_worker.layers.quantization.methods import building, process_weights_after_loading
    from tokenspeed_worker.kernels import gemv
    from tokenspeed_worker.layers.small_batch_gemv import SmallBatchGemv
    from tokenspeed_worker.layers import small_batch_gemv

    hidden, inter = 4096, 14336
    chooser = SmallBatchGemv()
    torch.manual_seed(rows)
    with (torch.device("cuda"), small_batch_gemv.building(chooser),
          building(QuantConfig("fp8", Fp8LinearScheme("channel", "dynamic", "token"), online=True))):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = MergedLinear(hidden, [inter, inter], prefix="m.gate_up_proj", shard_names=["g", "u"])
            norm = RMSNorm(hidden)
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        dense = torch.randn(2 * inter, hidden, device="cuda") * 0.02
        for shard in range(2):  # as methods.quantize_online feeds the loaders: FP8 rows and their scales
            q, scale = fp8.quantize_weight_rows(dense[shard * inter:(shard + 1) * inter])
            layer.weight.weight_loader(layer.weight, q, shard)
            layer.weight_scale.weight_loader(layer.weight_scale, scale, shard)
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, device="cuda"))
    process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        out = layer(PendingNorm(norm, x, residual), SiluAndMul())
        if isinstance(out, PendingActivation):  # many rows: the activation is left to the down projection
            out = out.apply()
        normed = norm(x.clone(), residual.clone())[0]
        w = layer.weight.double() * layer.weight_scale_rows.double()[:, None]
        q, s = fp8.quantize_rows(normed)
        errors = {}
        # The GEMV kernel keeps the activations bf16; the scaled GEMM quantizes them per token.
        for path, inputs in (("gemv", normed.double()), ("scaled_mm", q.double() * s.double())):
            gate_up = inputs @ w.t()
            errors[path] = _relative(out, torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        if rows <= gemv.MMA_MAX_ROWS:  # the chooser timed the kernels on the FP8 weight against the scaled GEMM
            key = next(k for k in chooser.decisions if k[0] == "add_norm_gate_up_silu" or k[0] == "norm_gate_up_silu")
            assert "float8_e4m3fn" in key[4] and len(chooser.timings[key]) > 1
            chosen = [v for k, v in chooser.decisions.items()
                      if v != small_batch_gemv.UNFUSED and (k == key or k[0] == "linear")]
            # A CUDA-core configuration keeps the activations bf16; a tensor-core one (Fp8Mma, W8A8)
            # quantizes them per row as the scaled GEMM's path does (within one e4m3 rounding).
            path = "gemv" if chosen and not isinstance(chosen[0], gemv.Fp8Mma) else "scaled_mm"
        else:
            assert not chooser.decisions
            path = "scaled_mm"
        assert errors[path] < 1e-2, errors
        unquantized = normed.double() @ dense.double().t()
        unquantized = torch.nn.functional.silu(unquantized[:, :inter]) * unquantized[:, inter:]
        assert _relative(out, unquantized) < 0.1


def test_a_norms_fp8_projection_quantizes_inside_the_norm_kernel(monkeypatch):
    """Many rows of an FP8 projection after a pending norm: one kernel normalizes and quantizes each
    row (kernels/norm.add_rms_norm_quantized), and the layer's output and residual stream are the
    same bits as the norm, quantize_rows and the scaled GEMM one after the other."""
    from tokenspeed_worker.kernels import norm as norm_kernels
    from tokenspeed_worker.layers.layernorm import PendingNorm, RMSNorm
    from tokenspeed_worker.layers.linear import QKVLinear
    from tokenspeed_worker.layers.quantization import Fp8LinearScheme, QuantConfig
    from tokenspeed_worker.layers.quantization.methods import building, process_weights_after_loading

    hidden, rows = 4096, 300
    with torch.device("cuda"), building(QuantConfig("fp8", Fp8LinearScheme("channel", "dynamic", "token"),
                                                    online=True)):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = QKVLinear(hidden, 128, 32, 8, prefix="m.qkv_proj", shard_names=["q", "k", "v"])
            norm = RMSNorm(hidden)
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for shard, size in zip("qkv", (4096, 1024, 1024)):
            q, scale = fp8.quantize_weight_rows(torch.randn(size, hidden, device="cuda") * 0.02)
            layer.weight.weight_loader(layer.weight, q, shard)
            layer.weight_scale.weight_loader(layer.weight_scale, scale, shard)
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, device="cuda"))
    process_weights_after_loading(layer)
    calls = []
    real = norm_kernels.add_rms_norm_quantized
    monkeypatch.setattr(norm_kernels, "add_rms_norm_quantized", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        pending = PendingNorm(norm, x, residual)
        out = layer(pending)
        normed, expected_residual = norm(x, residual)
        q, s = fp8.quantize_rows(normed)
        expected = fp8.scaled_mm(q, s, layer.weight, layer.weight_scale_rows, None, torch.bfloat16)
    assert calls == [1]
    assert torch.equal(pending.residual, expected_residual)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("gelu", [False, True])
def test_a_down_projection_quantizes_its_activation_in_one_kernel(monkeypatch, gelu):
    """Many rows of an FP8 MLP: gate_up_proj returns its activation pending, and the FP8 down
    projection applies and quantizes it in one kernel (kernels/activation.act_and_mul_quantized):
    the same bits as the activation kernel, quantize_rows and the scaled GEMM one after the other."""
    from tokenspeed_worker.kernels import activation as act_kernels
    from tokenspeed_worker.layers.activation import GeluTanhAndMul, PendingActivation, SiluAndMul
    from tokenspeed_worker.layers.linear import MergedLinear, RowParallelLinear, load_into
    from tokenspeed_worker.layers.quantization import Fp8LinearScheme, QuantConfig
    from tokenspeed_worker.layers.quantization.methods import building, process_weights_after_loading

    hidden, inter, rows = 1024, 3584, 300
    with torch.device("cuda"), building(QuantConfig("fp8", Fp8LinearScheme("channel", "dynamic", "token"),
                                                    online=True)):
        torch.set_default_dtype(torch.bfloat16)
        try:
            gate_up = MergedLinear(hidden, [inter, inter], prefix="m.gate_up_proj", shard_names=["g", "u"])
            down = RowParallelLinear(inter, hidden, prefix="m.down_proj")
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for shard in range(2):
            q, scale = fp8.quantize_weight_rows(torch.randn(inter, hidden, device="cuda") * 0.03)
            gate_up.weight.weight_loader(gate_up.weight, q, shard)
            gate_up.weight_scale.weight_loader(gate_up.weight_scale, scale, shard)
        q, scale = fp8.quantize_weight_rows(torch.randn(hidden, inter, device="cuda") * 0.03)
        load_into(down.weight, q)  # a non-stacked parameter: its own (sharding) loader, as the model loader calls it
        load_into(down.weight_scale, scale)
    for layer in (gate_up, down):
        process_weights_after_loading(layer)
    calls = []
    real = act_kernels.act_and_mul_quantized
    monkeypatch.setattr(act_kernels, "act_and_mul_quantized", lambda *a, **k: calls.append(1) or real(*a, **k))
    act = GeluTanhAndMul() if gelu else SiluAndMul()
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        pending = gate_up(x, activation=act)
        assert isinstance(pending, PendingActivation)
        out = down(pending)
        q, s = fp8.quantize_rows(act(gate_up(x)))
        expected = fp8.scaled_mm(q, s, down.weight, down.weight_scale_rows, None, torch.bfloat16)
    assert calls == [1]
    assert torch.equal(out, expected)
