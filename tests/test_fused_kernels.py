"""The fused Triton kernels of the decoder layer (add + RMSNorm, silu * mul, rotary + KV write)
against the torch code they replace, and the switch between them (layers/fused_kernels.py).

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest before
triton is imported) with small shapes; on CUDA the same tests run compiled. The whole-model
tests force the fused path on CPU (mode "force") and compare a tiny model's logits against the
torch path (mode "off").
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402,F401  (no skip: CI must have triton)

from tokenspeed_worker.kernels import activation, norm, rotary  # noqa: E402
from tokenspeed_worker.layers import fused_kernels  # noqa: E402
from tokenspeed_worker.layers.activation import GeluTanhAndMul, SiluAndMul  # noqa: E402
from tokenspeed_worker.layers.fused_kernels import fused_kernels as fused_mode  # noqa: E402
from tokenspeed_worker.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from tokenspeed_worker.layers.rotary import rope_from_parameters  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=_gen(seed))).to(dtype).to(DEVICE)


def _ulps_apart(got: torch.Tensor, expected: torch.Tensor) -> int:
    """Largest distance in units in the last place (of the dtype, at the expected value's exponent)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    diff = (got.double() - expected.double()).abs()
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[expected.dtype]
    ulp = torch.exp2(torch.floor(torch.log2(expected.double().abs().clamp_min(1e-30))) - mantissa)
    return int((diff / ulp).ceil().max().item()) if diff.numel() else 0


# -- add + RMSNorm ----------------------------------------------------------------------------


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 200), (37, 96)])
def test_rms_norm_layer_fused_matches_torch(dtype, num_tokens, hidden):
    layer = RMSNorm(hidden, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=_gen(3)))
    layer = layer.to(dtype)
    x = _randn(num_tokens, hidden, dtype=dtype, seed=1)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=2)
    residual_before = residual.clone()
    with fused_mode("off"):
        expected_out, expected_residual = layer(x, residual)
        expected_plain = layer(x)
    with fused_mode("force"):
        out, new_residual = layer(x, residual)
        plain = layer(x)
    torch.testing.assert_close(residual, residual_before, atol=0, rtol=0)  # not modified
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)  # x + residual, rounded once
    assert out.dtype == expected_out.dtype and plain.shape == expected_plain.shape
    # The mean of squares is summed in another order: at most a rounding step apart.
    assert _ulps_apart(out, expected_out) <= (1 if dtype == torch.bfloat16 else 8)
    assert _ulps_apart(plain, expected_plain) <= (1 if dtype == torch.bfloat16 else 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_head_views(dtype):
    """Qwen3's q_norm/k_norm: [T, heads, head_dim] views into the fused qkv projection."""
    num_tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4, scale=3.0)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    assert not q.is_contiguous()
    layer = RMSNorm(head_dim, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(head_dim, generator=_gen(5)) + 0.5)
    layer = layer.to(dtype)
    for x in (q, k, q.transpose(0, 1), q[..., :].unsqueeze(0)):  # 3-d strided, 3-d transposed, 4-d
        with fused_mode("off"):
            expected = layer(x)
        with fused_mode("force"):
            got = layer(x)
        assert got.shape == expected.shape
        assert _ulps_apart(got, expected) <= (1 if dtype == torch.bfloat16 else 8)
    # A last dimension that is not contiguous is copied first.
    x = qkv.view(num_tokens, -1, 2)[..., 0]
    layer2 = RMSNorm(x.shape[-1]).to(DEVICE).to(dtype)
    with fused_mode("off"):
        expected = layer2(x)
    with fused_mode("force"):
        got = layer2(x)
    assert _ulps_apart(got, expected) <= (1 if dtype == torch.bfloat16 else 8)


def test_fused_add_rms_norm_in_place_and_out_of_place():
    x = _randn(3, 40, dtype=torch.float32, seed=6)
    residual = _randn(3, 40, dtype=torch.float32, seed=7)
    weight = _randn(40, dtype=torch.float32, seed=8)
    expected_sum = x + residual
    before = residual.clone()
    _, out_of_place = norm.fused_add_rms_norm(x, residual, weight, 1e-6, inplace=False)
    assert out_of_place.data_ptr() != residual.data_ptr()
    torch.testing.assert_close(residual, before, atol=0, rtol=0)
    torch.testing.assert_close(out_of_place, expected_sum, atol=0, rtol=0)
    normed, in_place = norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert in_place.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(normed, _rms_norm_reference(expected_sum, weight, 1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_forms_match_torch(dtype):
    """Gemma's (1 + w) norm, alone, fused with the residual add, on strided head views, and
    `forward_after` (a sublayer's output normalized, added to the stream, normalized again) in one
    kernel, against the torch path (transformers' GemmaRMSNorm, rounded once)."""
    hidden = 96
    post, pre = GemmaRMSNorm(hidden, eps=1e-6).to(DEVICE), GemmaRMSNorm(hidden, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        post.weight.copy_(0.3 * torch.randn(hidden, generator=_gen(21)))
        pre.weight.copy_(0.3 * torch.randn(hidden, generator=_gen(22)))
    post, pre = post.to(dtype), pre.to(dtype)
    y = _randn(7, hidden, dtype=dtype, seed=23, scale=4.0)
    residual = _randn(7, hidden, dtype=dtype, seed=24)
    heads = _randn(7, 3 * 32, dtype=dtype, seed=25).view(7, 3, 32)[:, :2]  # strided [T, heads, head_dim]
    head_norm = GemmaRMSNorm(32).to(DEVICE).to(dtype)
    results = {}
    for mode in ("off", "force"):
        with fused_mode(mode):
            results[mode] = (pre(y), *pre(y, residual), *pre.forward_after(post, y, residual), head_norm(heads))
    for got, expected in zip(results["force"], results["off"]):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        if dtype == torch.bfloat16:
            assert _ulps_apart(got, expected) <= 1
        else:  # sums of a few-ulp-apart norm and the residual cancel: compare absolutely
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-6)
    # forward_after's stream is residual + post(y), each rounded to the dtype once
    torch.testing.assert_close(results["off"][4], residual + post._norm(y), atol=0, rtol=0)
    # Deferred (for the next projection to fold in), the same values when applied
    for mode in ("off", "force"):
        with fused_mode(mode):
            for pending, expected in ((pre.defer(y), (pre(y), y)), (pre.defer(y, residual), pre(y, residual)),
                                      (pre.defer_after(post, y, residual), pre.forward_after(post, y, residual))):
                for got, want in zip(pending.normalize(), expected):
                    assert torch.equal(got, want)


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_then_fp8_quantization_in_one_kernel(with_residual):
    """add_rms_norm_quantized: the same bits as the norm kernel's output quantized by quantize_rows
    (a zero row included: the smallest scale), the residual stream as the fused add's."""
    from tokenspeed_worker.kernels import fp8

    x = _randn(6, 96, dtype=torch.bfloat16, seed=31, scale=5.0)
    x[2] = 0
    residual = _randn(6, 96, dtype=torch.bfloat16, seed=32) if with_residual else None
    if with_residual:
        residual[2] = 0
    weight = (1 + 0.2 * torch.randn(96, generator=_gen(33))).to(torch.bfloat16).to(DEVICE)
    q, scale, stream = norm.add_rms_norm_quantized(x, residual, weight, 1e-6)
    if with_residual:
        normed, expected_stream = norm.fused_add_rms_norm(x, residual, weight, 1e-6, inplace=False)
    else:
        normed, expected_stream = norm.rms_norm(x, weight, 1e-6), x
    q_ref, scale_ref = fp8.quantize_rows_reference(normed)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == (6, 96) and scale.shape == (6, 1)
    assert torch.equal(stream, expected_stream)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# -- silu(gate) * up --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(1, 1500), (37, 100)])
def test_silu_and_mul_matches_torch(dtype, num_tokens, inter):
    x = _randn(num_tokens, 2 * inter, dtype=dtype, seed=9, scale=3.0)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = activation.silu_and_mul(x)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    # silu's exp differs from torch's by float32 ulps, so the rounding to bfloat16
    # agrees nearly always; where it does not, by one step.
    assert _ulps_apart(got, expected) <= (1 if dtype == torch.bfloat16 else 4)
    if dtype == torch.bfloat16:
        assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_torch(dtype):
    x = _randn(37, 2 * 300, dtype=dtype, seed=26, scale=3.0)
    wide = _randn(5, 700, dtype=dtype, seed=27)[:, :600]  # rows strided
    layer = GeluTanhAndMul()
    for inp in (x, wide):
        gate, up = inp.chunk(2, dim=-1)
        expected = F.gelu(gate, approximate="tanh") * up
        with fused_mode("force"):
            got = layer(inp)
        assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
        # At most a step apart after rounding (and where gelu underflows, the interpreter's form gives
        # tiny values where torch's tanh gives 0). On the GPU the kernel's tanh is CUDA's, as torch's:
        # nearly all equal.
        if dtype == torch.bfloat16:
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=2**-7)
            assert not ON_CUDA or (got == expected).float().mean() > 0.99
        else:
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("gelu", [False, True])
def test_activation_then_fp8_quantization_in_one_kernel(gelu):
    """act_and_mul_quantized: the same bits as the activation kernel's output quantized by
    quantize_rows (a zero row included), strided rows too; None past the rows it can hold."""
    from tokenspeed_worker.kernels import fp8

    wide = _randn(5, 2 * 300 + 40, dtype=torch.bfloat16, seed=34, scale=3.0)
    x = wide[:, :600]
    x[1] = 0
    q, scale = activation.act_and_mul_quantized(x, gelu_tanh=gelu)
    activated = activation.gelu_tanh_and_mul(x) if gelu else activation.silu_and_mul(x)
    q_ref, scale_ref = fp8.quantize_rows_reference(activated)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == (5, 300)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    too_long = torch.zeros(1, 2 * (activation.MAX_QUANTIZED_INTER + 1), dtype=torch.bfloat16, device=DEVICE)
    assert activation.act_and_mul_quantized(too_long) is None


def test_a_pending_activation_applies_like_the_layer():
    """layers/activation.PendingActivation: apply() is the activation layer's output."""
    from tokenspeed_worker.layers.activation import PendingActivation

    x = _randn(4, 64, dtype=torch.bfloat16, seed=35)
    for act in (SiluAndMul(), GeluTanhAndMul()):
        for mode in ("off", "force"):
            with fused_mode(mode):
                assert torch.equal(PendingActivation(x, act).apply(), act(x))


def test_silu_and_mul_layer_strided_rows_and_3d():
    wide = _randn(6, 300, dtype=torch.bfloat16, seed=10, scale=2.0)
    x = wide[:, :200]  # rows strided by 300
    layer = SiluAndMul()
    for inp in (x, x.reshape(2, 3, 200)):
        with fused_mode("off"):
            expected = layer(inp)
        with fused_mode("force"):
            got = layer(inp)
        assert got.shape == expected.shape
        assert _ulps_apart(got, expected) <= 1


# -- rotary + KV-cache write ------------------------------------------------------------------


def _rope(head_dim: int, partial: float = 1.0, max_position: int = 512, rope_type: str = "default"):
    params = dict(rope_type=rope_type, rope_theta=10000.0, partial_rotary_factor=partial)
    if rope_type == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    return rope_from_parameters(head_dim, max_position, params).to(DEVICE)


ROPE_CASES = [
    # num_tokens, heads, kv_heads, head_dim, partial rotary factor, rope type
    (1, 32, 8, 128, 1.0, "llama3"),
    (37, 32, 8, 64, 1.0, "default"),
    (37, 4, 2, 64, 0.5, "default"),
    (5, 6, 2, 128, 0.25, "default"),
    (3, 3, 1, 48, 1.0, "default"),  # head_dim not a power of 2, heads not a multiple of the block
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,partial,rope_type", ROPE_CASES)
def test_rope_and_write_kv_matches_torch(dtype, num_tokens, heads, kv_heads, head_dim, partial, rope_type):
    rope = _rope(head_dim, partial, rope_type=rope_type)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=11, scale=2.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as in the model
    q = q.view(num_tokens, heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    num_blocks, block_size = 8, 8
    positions = torch.randint(0, 512, (num_tokens,), generator=_gen(12)).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=_gen(13))[:num_tokens].to(DEVICE)
    k_cache = _randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=14)
    v_cache = _randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=15)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    expected_q, expected_k = rope(positions, q, k)
    got_q = rotary.rope_and_write_kv(
        q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache, slots
    )
    assert got_q.shape == (num_tokens, heads, head_dim) and got_q.is_contiguous() and got_q.dtype == dtype
    # Each product and the sum rounded as torch does: bitwise equal (or one step, were the GPU's
    # multiply to round differently, which it does not).
    assert _ulps_apart(got_q, expected_q) <= (0 if not ON_CUDA else 1)
    k_slots, v_slots = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert _ulps_apart(k_slots[slots], expected_k) <= (0 if not ON_CUDA else 1)
    torch.testing.assert_close(v_slots[slots], v, atol=0, rtol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    torch.testing.assert_close(k_slots[untouched], k_before.view(-1, kv_heads, head_dim)[untouched], atol=0, rtol=0)
    torch.testing.assert_close(v_slots[untouched], v_before.view(-1, kv_heads, head_dim)[untouched], atol=0, rtol=0)
    assert torch.equal(q, qkv[:, :q_size].view(num_tokens, heads, head_dim))  # inputs untouched


def test_rope_and_write_kv_layer_method_same_on_both_paths():
    """RotaryEmbedding.rope_and_write_kv: the kernel, or forward + index_copy_, the same results."""
    rope = _rope(32)
    num_tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, seed=16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 1, 2, 100, 7, 7], device=DEVICE)
    slots = torch.tensor([3, 9, 0, 15, 4, 12], device=DEVICE)
    results = []
    for mode in ("off", "force"):
        k_cache = torch.zeros(4, 4, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        with fused_mode(mode):
            assert rope.fuses(q) == (mode == "force")
            q_out = rope.rope_and_write_kv(positions, q, k, v, k_cache, v_cache, slots)
        results.append((q_out, k_cache, v_cache))
    for got, expected in zip(results[1], results[0]):
        assert _ulps_apart(got, expected) <= (0 if not ON_CUDA else 1)


# -- the switch -------------------------------------------------------------------------------


def test_switch_modes():
    previous = fused_kernels.fused_kernels_mode()
    x = torch.zeros(2, 4)
    try:
        assert fused_kernels.set_fused_kernels("off") == previous
        assert fused_kernels.use_fused(x, "norm") is None
        fused_kernels.set_fused_kernels(True)
        assert fused_kernels.fused_kernels_mode() == "auto"
        assert fused_kernels.use_fused(x, "norm") is None  # auto: CUDA tensors only
        fused_kernels.set_fused_kernels("force")
        assert fused_kernels.use_fused(x, "norm") is norm
        assert fused_kernels.use_fused(x, "rotary") is rotary
        with fused_mode(False):
            assert fused_kernels.fused_kernels_mode() == "off"
        assert fused_kernels.fused_kernels_mode() == "force"
        for alias, mode in (("0", "off"), ("1", "auto"), (" Force ", "force"), ("", "auto")):
            fused_kernels.set_fused_kernels(alias)
            assert fused_kernels.fused_kernels_mode() == mode
        with pytest.raises(ValueError, match="not one of"):
            fused_kernels.set_fused_kernels("sometimes")
    finally:
        fused_kernels.set_fused_kernels(previous)
    if ON_CUDA:
        with fused_mode("auto"):
            assert fused_kernels.use_fused(x.cuda(), "activation") is activation


def test_environment_variable_sets_the_initial_mode():
    import subprocess

    code = "from tokenspeed_worker.layers import fused_kernels as f; print(f.fused_kernels_mode())"
    for value, mode in (("0", "off"),):  # the values themselves: test_switch_modes
        env = {k: v for k, v in os.environ.items() if k != fused_kernels.ENV_VAR}
        if value is not None:
            env[fused_kernels.ENV_VAR] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == mode


# -- whole tiny models: fused kernels against the torch path ----------------------------------


MODELS = ["llama-gqa-tied", "qwen3-qknorm", "gemma3"]


@pytest.fixture(scope="module")
def fused_runner_pairs(tiny_model_paths):
    from test_triton_backend import BLOCK_SIZE, NUM_BLOCKS, reference_triton_backend
    from worker_harness import make_runner

    device = "cuda" if ON_CUDA else "cpu"
    pairs = {}
    for name in MODELS:
        runners = []
        for _ in range(2):  # (torch path, fused path), each with its own cache
            backend = "triton" if ON_CUDA else reference_triton_backend()
            runner = make_runner(
                str(tiny_model_paths[name]), dtype="float32", device=device, block_size=BLOCK_SIZE,
                attention_backend=backend,
            )
            runner.allocate_kv_cache(NUM_BLOCKS)
            runners.append(runner)
        pairs[name] = runners
    return pairs


@pytest.mark.parametrize("name", MODELS)
def test_tiny_model_logits_fused_match_torch_path(name, fused_runner_pairs):
    """Prefill (chunked, two requests), then decodes: every step's logits, and the K/V written."""
    from test_triton_backend import Plans, random_seqs

    torch_runner, fused_runner = fused_runner_pairs[name]
    seqs_by_runner = [random_seqs([11, 6], seed=3), random_seqs([11, 6], seed=3)]
    plans_by_runner = [Plans(seed=3), Plans(seed=3)]
    # prefill chunks; a chunk and a decode (extend path); decodes only (decode path)
    schedule = [[(0, 7), (1, 6)], [(0, 4), (1, 1)], [(0, 1), (1, 1)], [(1, 1), (0, 1)]]
    for step in schedule:
        logits = []
        for runner, mode, seqs, plans in zip(
            (torch_runner, fused_runner), ("off", "force"), seqs_by_runner, plans_by_runner
        ):
            for seq in seqs:  # decode tokens: extend both sequences identically
                if seq.num_left == 0:
                    seq.tokens.append(5 + len(seq.tokens))
            plan = plans.plan([(seqs[i], n) for i, n in step])
            with fused_mode(mode):
                logits.append(runner.forward_all_logits(plan))
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_runner.kv_cache, torch_runner.kv_cache, atol=1e-5, rtol=1e-5)
    assert fused_runner.kv_cache.abs().sum() > 0


def test_tiny_model_bfloat16_logits_fused_match_torch_path(tiny_model_paths):
    """In bfloat16 the roundings matter: the fused path rounds where torch does (bitwise equal on
    CPU; on the GPU the norm's rsqrt and the sums' order may move a value by a step)."""
    from test_triton_backend import BLOCK_SIZE, Plans, random_seqs, reference_triton_backend

    from tokenspeed_worker.layers.linear import Linear
    from worker_harness import make_runner

    logits = []
    for mode in ("off", "force"):
        runner = make_runner(
            str(tiny_model_paths["qwen3-qknorm"]), dtype="bfloat16", device=DEVICE.type, block_size=BLOCK_SIZE,
            attention_backend="triton" if ON_CUDA else reference_triton_backend(),
        )
        # Without the small-batch GEMV chooser (whose products sum in another order:
        # tests/test_small_batch_gemv.py) the projections run F.linear.
        for module in runner.model.modules():
            if isinstance(module, Linear):
                module.gemv = None
        runner.allocate_kv_cache(32)
        seqs = random_seqs([20, 9], seed=1)
        plans = Plans(num_blocks=32, seed=1)
        with fused_mode(mode):
            logits.append(runner.forward_all_logits(plans.plan([(s, len(s.tokens)) for s in seqs])))
            for seq in seqs:
                seq.tokens.append(7)
            logits.append(runner.forward_all_logits(plans.plan([(s, 1) for s in seqs])))
    for got, expected in zip(logits[2:], logits[:2]):
        if ON_CUDA:
            torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
        else:
            torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_fused_path_is_taken_with_the_triton_backend(fused_runner_pairs, monkeypatch):
    """With the kernels forced, every norm and activation runs its kernel, and the attention
    layers call rope_and_write_kv and the backend's `attend` (no index_copy_ in forward); with
    them off, none of the kernels, and the backend's forward."""
    from test_triton_backend import Plans, random_seqs

    runner = fused_runner_pairs["llama-gqa-tied"][1]
    calls = {"rope": 0, "attend": 0, "forward": 0, "add_norm": 0, "norm": 0, "silu": 0}
    backend = runner.attention_backend
    real_rope, real_attend, real_forward = rotary.rope_and_write_kv, backend.attend, backend.forward

    def count(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(rotary, "rope_and_write_kv", count("rope", real_rope))
    monkeypatch.setattr(backend, "attend", count("attend", real_attend))
    monkeypatch.setattr(backend, "forward", count("forward", real_forward))
    monkeypatch.setattr(norm, "fused_add_rms_norm", count("add_norm", norm.fused_add_rms_norm))
    monkeypatch.setattr(norm, "rms_norm", count("norm", norm.rms_norm))
    monkeypatch.setattr(activation, "silu_and_mul", count("silu", activation.silu_and_mul))
    seqs = random_seqs([5], seed=8)
    plan = Plans(seed=8).plan([(seqs[0], 5)])
    num_layers = len(runner.model.model.layers)
    with fused_mode("force"):
        runner.forward_all_logits(plan)
    # The first input norm has no residual yet; every later norm (and the final one) adds it.
    fused = {"rope": num_layers, "attend": num_layers, "forward": 0, "add_norm": 2 * num_layers, "norm": 1,
             "silu": num_layers}
    assert calls == fused
    with fused_mode("off"):
        runner.forward_all_logits(plan)
    assert calls == {**fused, "attend": 2 * num_layers, "forward": num_layers}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_8b_shapes_on_gpu(dtype):
    hidden, inter, tokens = 4096, 14336, 256  # Llama-3.1-8B; rotary at its shapes: test_rope_and_write_kv_matches_torch
    x = _randn(tokens, hidden, dtype=dtype, seed=20)
    residual = _randn(tokens, hidden, dtype=dtype, seed=21)
    weight = _randn(hidden, dtype=dtype, seed=22, scale=0.1) + 1
    expected = _rms_norm_reference(x + residual, weight, 1e-5)
    got, new_residual = norm.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    assert _ulps_apart(got, expected) <= 1 and torch.equal(new_residual, x + residual)
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, seed=23, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = activation.silu_and_mul(gate_up)
    assert _ulps_apart(got, expected) <= 1 and (got == expected).float().mean() > 0.999


def test_pending_ids_resolve_like_the_torch_expression():
    # Overlap scheduling's input ids: -1 - i stands for the previous step's sample i.
    from tokenspeed_worker.kernels import pending_ids
    from tokenspeed_worker.model_executor.cuda_graph import resolve_pending_ids

    last = torch.tensor([101, 7, 55, 2**40], dtype=torch.int64, device=DEVICE)
    ids = torch.tensor([5, -1, -4, 0, -2, 12, -3, 9], dtype=torch.int64, device=DEVICE)
    expected = [5, 101, 2**40, 0, 7, 12, 55, 9]
    assert pending_ids.resolve_pending_ids(ids, last).tolist() == expected
    assert ids.tolist() == [5, -1, -4, 0, -2, 12, -3, 9]  # a new tensor, the input untouched
    assert pending_ids.resolve_pending_ids(ids[::2], last).tolist() == expected[::2]  # strided input
    assert pending_ids.resolve_pending_ids(ids[:0], last).numel() == 0
    big = torch.randint(0, 1000, (2500,), device=DEVICE)  # several programs
    big[::7] = -1 - torch.randint(0, 4, big[::7].shape, device=DEVICE)
    for mode in ("off", "force"):  # the switch picks the path; both give the same ids
        with fused_mode(mode):
            assert (fused_kernels.use_fused(big, "pending_ids") is pending_ids) == (mode == "force")
            assert torch.equal(resolve_pending_ids(big, last),
                               torch.where(big < 0, last[(-1 - big).clamp(min=0)], big))
    with pytest.raises(ValueError, match="1-d"):
        pending_ids.resolve_pending_ids(ids.view(2, 4), last)
