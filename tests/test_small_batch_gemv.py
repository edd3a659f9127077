"""The small-batch GEMV kernels (kernels/gemv.py: norm / residual prologue, SiLU·mul and rotary
epilogues; bf16 and fp8 weights) against the torch code they replace, and the choice between them
(layers/small_batch_gemv.py).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on small, ragged shapes; on
CUDA the same tests run compiled, plus Llama-8B shapes and the timed choice.
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
from triton.runtime.errors import OutOfResources  # noqa: E402

from tokenspeed_worker.kernels import gemv  # noqa: E402
from tokenspeed_worker.kernels.fp8 import quantize_rows_reference  # noqa: E402
from tokenspeed_worker.layers import small_batch_gemv  # noqa: E402
from tokenspeed_worker.layers.activation import SiluAndMul  # noqa: E402
from tokenspeed_worker.layers.fused_kernels import fused_kernels as fused_mode  # noqa: E402
from tokenspeed_worker.layers.layernorm import RMSNorm  # noqa: E402
from tokenspeed_worker.layers.linear import Linear  # noqa: E402
from tokenspeed_worker.layers.small_batch_gemv import SmallBatchGemv  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPE = torch.bfloat16


def _randn(*shape, seed: int, scale: float = 1.0, dtype=DTYPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def _matmul_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T in float64 from the same (rounded) inputs: what any correct kernel approximates."""
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _close(got: torch.Tensor, expected64: torch.Tensor) -> None:
    # bf16 output: one rounding of the float32 sum (whose order differs from the reference's).
    torch.testing.assert_close(got.double(), expected64, atol=2e-2, rtol=1.6e-2)


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE, DTYPE)
    with torch.no_grad():
        norm.weight.copy_(_randn(hidden, seed=seed, scale=0.1) + 1)
    return norm


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("config", [gemv.CONFIGS[0], gemv.CONFIGS[2], gemv.Persistent(2, 4, 4),
                                    gemv.Persistent(4, 8, 2)])
def test_plain_product_with_ragged_shapes_and_bias(rows, config):
    k, n = 300, 40  # neither a multiple of the blocks
    x, w, b = _randn(rows, k, seed=1), _randn(n, k, seed=2, scale=0.05), _randn(n, seed=3)
    out, residual_out = gemv.small_batch_linear(x, w, b, config=config)
    assert out.shape == (rows, n) and out.dtype == DTYPE and residual_out is None
    _close(out, _matmul_reference(x, w, b))


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_prologue_rounds_like_the_norm_layer(with_residual):
    rows, k, n = 3, 264, 48
    norm = _norm(k, seed=4)
    x, residual = _randn(rows, k, seed=5, scale=2.0), _randn(rows, k, seed=6)
    w = _randn(n, k, seed=7, scale=0.05)
    out, residual_out = gemv.small_batch_linear(x, w, norm_weight=norm.weight, residual=residual if with_residual else None,
                                           eps=norm.eps, config=(16, 128, 4))
    with fused_mode("off"):
        if with_residual:
            normed, expected_residual = norm(x, residual)
        else:
            normed, expected_residual = norm(x), x
    assert torch.equal(residual_out, expected_residual)  # the sum is rounded to bf16 exactly as torch does
    _close(out, _matmul_reference(normed, w))


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("with_residual", [True, False])
def test_one_pass_norm_prologue(rows, with_residual):
    # The one-pass configurations scale the finished sum by 1 / RMS instead of normalizing first:
    # the same residual bits, the product within a bfloat16 step of the two-pass kernel's.
    k, n = 264, 48
    norm = _norm(k, seed=30)
    x, residual = _randn(rows, k, seed=31, scale=2.0), _randn(rows, k, seed=32)
    w = _randn(n, k, seed=33, scale=0.05)
    kwargs = dict(norm_weight=norm.weight, residual=residual if with_residual else None, eps=norm.eps)
    one_pass, one_pass_residual = gemv.small_batch_linear(x, w, **kwargs, config=(16, 128, 4, True))
    two_pass, two_pass_residual = gemv.small_batch_linear(x, w, **kwargs, config=(16, 128, 4))
    with fused_mode("off"):
        normed = norm(x, residual)[0] if with_residual else norm(x)
    assert torch.equal(one_pass_residual, two_pass_residual)
    _close(one_pass, _matmul_reference(normed, w))
    _close(one_pass, two_pass.double())
    gate_up = _randn(2 * n, k, seed=34, scale=0.05)
    torch.testing.assert_close(
        gemv.small_batch_linear(x, gate_up, **kwargs, silu=True, config=(16, 128, 4, True))[0].double(),
        gemv.small_batch_linear(x, gate_up, **kwargs, silu=True, config=(16, 128, 4))[0].double(), atol=2e-2, rtol=2e-2)


def test_silu_epilogue_over_gate_up_rows():
    rows, k, inter = 2, 192, 40
    norm = _norm(k, seed=8)
    x, residual = _randn(rows, k, seed=9), _randn(rows, k, seed=10)
    w = _randn(2 * inter, k, seed=11, scale=0.1)
    out, residual_out = gemv.small_batch_linear(x, w, norm_weight=norm.weight, residual=residual, eps=norm.eps, silu=True,
                                           config=(16, 64, 4))
    with fused_mode("off"):
        normed, expected_residual = norm(x, residual)
        gate_up = F.linear(normed.double(), w.double()).to(DTYPE)  # one rounding, as cuBLAS's bf16 output
        expected = SiluAndMul()(gate_up)
    assert out.shape == (rows, inter) and torch.equal(residual_out, expected_residual)
    torch.testing.assert_close(out.double(), expected.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("config", [gemv.Persistent(1, 4, 4), gemv.Persistent(4, 8, 2)])
def test_persistent_programs_match_the_one_shot_kernel(rows, with_residual, config):
    # 52 strips of 1 or 13 of 4 rows over 2 (interpreter) or #SM x per_sm programs: each program
    # loops over several strips (CPU) and the last strip is ragged. The input rows are normalized
    # once per program with the one-shot kernel's roundings: the same residual bits and, the sums'
    # order aside, the same products.
    k, n = 264, 52
    norm = _norm(k, seed=40)
    x, residual = _randn(rows, k, seed=41, scale=2.0), _randn(rows, k, seed=42)
    w, b = _randn(n, k, seed=43, scale=0.05), _randn(n, seed=44)
    kwargs = dict(norm_weight=norm.weight, residual=residual if with_residual else None, eps=norm.eps)
    got, got_residual = gemv.small_batch_linear(x, w, b, **kwargs, config=config)
    one_shot, one_shot_residual = gemv.small_batch_linear(x, w, b, **kwargs, config=(16, 128, 4))
    with fused_mode("off"):
        normed = norm(x, residual)[0] if with_residual else norm(x)
    assert torch.equal(got_residual, one_shot_residual)
    _close(got, _matmul_reference(normed, w, b))
    torch.testing.assert_close(got, one_shot, atol=1e-2, rtol=1e-2)
    gate_up = _randn(2 * n, k, seed=45, scale=0.1)
    act = gemv.small_batch_linear(x, gate_up, **kwargs, silu=True, config=config)[0]
    assert act.shape == (rows, n)
    torch.testing.assert_close(act, gemv.small_batch_linear(x, gate_up, **kwargs, silu=True, config=(16, 64, 4))[0],
                               atol=1e-2, rtol=1e-2)


def test_persistent_configurations_that_spill_are_refused(monkeypatch):
    x, w = _randn(1, 64, seed=16), _randn(8, 64, seed=17)
    monkeypatch.setattr(gemv, "spilled_registers", lambda *a: 12)
    with pytest.raises(ValueError, match="spills 12 registers"):
        gemv.small_batch_linear(x, w, config=gemv.Persistent(2, 4, 4))
    gemv.small_batch_linear(x, w, config=gemv.CONFIGS[0])  # one-shot configurations are not checked


def test_refusals():
    x = _randn(5, 64, seed=12)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv.small_batch_linear(x, _randn(8, 64, seed=13))
    with pytest.raises(ValueError, match="does not fit"):
        gemv.small_batch_linear(x[:2], _randn(8, 32, seed=13))
    with pytest.raises(ValueError, match="silu"):
        gemv.small_batch_linear(x[:2], _randn(9, 64, seed=13), silu=True)
    wide = _randn(4, 16384, seed=14)  # 4 rows x 16384 held in registers: more than a persistent program takes
    with pytest.raises(ValueError, match="input elements"):
        gemv.small_batch_linear(wide, _randn(8, 16384, seed=15), config=gemv.Persistent(2, 4, 4))


def test_the_layers_take_the_kernel_only_when_told_and_for_few_rows(monkeypatch):
    calls = []
    real = gemv.small_batch_linear
    monkeypatch.setattr(gemv, "small_batch_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    chooser = SmallBatchGemv()
    with small_batch_gemv.building(chooser):
        layer = Linear(64, 32).to(DEVICE, DTYPE)
    unchosen = Linear(64, 32).to(DEVICE, DTYPE)  # built with no chooser current: F.linear always
    with torch.no_grad():
        layer.weight.copy_(_randn(32, 64, seed=14, scale=0.1))
        unchosen.weight.copy_(layer.weight)
    few, more, many = _randn(4, 64, seed=15), _randn(5, 64, seed=16), _randn(17, 64, seed=17)
    with fused_mode("off"):
        layer(few)
    assert calls == []
    with fused_mode("force"):
        _close(layer(few), _matmul_reference(few, layer.weight))
        _close(layer(more), _matmul_reference(more, layer.weight))  # a tensor-core configuration
        layer(many)  # more rows than any configuration takes: F.linear
        unchosen(few)
    assert calls == [few.shape, more.shape]
    if not ON_CUDA:  # "auto" never fuses on a CPU
        layer(few)
        assert calls == [few.shape, more.shape] and chooser.report() == {}


@pytest.mark.parametrize("fused_over_unfused, margin, chosen", [
    (0.96, small_batch_gemv.MARGIN, "fused"),  # a plain product: the kernel must win by MARGIN
    (0.98, small_batch_gemv.MARGIN, "unfused"),
    (0.98, small_batch_gemv.FOLD_MARGIN, "fused"),  # a folding site: kept unless clearly slower
    (1.04, small_batch_gemv.FOLD_MARGIN, "fused"),
    (1.06, small_batch_gemv.FOLD_MARGIN, "unfused"),
])
def test_the_timed_choice_applies_the_sites_margin(monkeypatch, fused_over_unfused, margin, chosen):
    times = {"unfused": 30.0, "slow": 40.0, "fast": 30.0 * fused_over_unfused}
    monkeypatch.setattr(small_batch_gemv, "l2_flush_buffer", lambda device: None)
    monkeypatch.setattr(small_batch_gemv, "time_us", lambda fn, flush: times[fn()])
    configs = ("slow", "fast")
    chooser = SmallBatchGemv()
    got = chooser._choose(("site",), torch.zeros(1), lambda config: config, lambda: "unfused", configs, margin)
    assert got == ("fast" if chosen == "fused" else "unfused")
    assert not chooser._choosing
    # the sites' margins as the module explains them
    assert small_batch_gemv.FOLD_MARGIN > 1 > small_batch_gemv.MARGIN


def test_a_configuration_that_disagrees_with_the_unfused_path_is_refused(monkeypatch, caplog):
    """However fast: a miscompiled or mis-indexed kernel (here, one that returns garbage, one that
    returns a NaN) never becomes a site's choice."""
    monkeypatch.setattr(small_batch_gemv, "l2_flush_buffer", lambda device: None)
    times = {"garbage": 1.0, "nan": 1.0, "close": 20.0, "unfused": 30.0}
    reference = torch.linspace(-1, 1, 64)
    outputs = {"garbage": reference.flip(0), "nan": reference.clone().index_fill_(0, torch.tensor([3]), float("nan")),
               "close": reference * 1.01, "unfused": reference}
    monkeypatch.setattr(small_batch_gemv, "time_us", lambda fn, flush: times[next(k for k, v in outputs.items()
                                                                                  if v is fn())])
    chooser = SmallBatchGemv()
    got = chooser._choose(("site",), torch.zeros(1), lambda config: outputs[config], lambda: outputs["unfused"],
                          ("garbage", "nan", "close"), small_batch_gemv.MARGIN)
    assert got == "close" and set(chooser.timings[("site",)]) == {"unfused", "close"}
    assert sum("disagrees with the unfused path" in r.message for r in caplog.records) == 2


@pytest.fixture
def chooser():
    return SmallBatchGemv()


def _decide(chooser, key, chosen, alone: dict[str, float]) -> None:
    """A site as _choose leaves it: its lone timings, the paths timed, the choice."""
    chooser.timings[key] = dict(alone)
    chooser.options[key] = {name: name for name in alone}
    chooser.decisions[key] = chosen


def test_in_step_tuning_keeps_the_faster_step_per_site(chooser):
    qkv, down, other_rows = ("qkv", 1), ("down", 1), ("qkv", 2)
    # Alone, "a" wins at qkv; in the step, the unfused path does. "z" is ranked past the top 2.
    _decide(chooser, qkv, "a", {"a": 10.0, "b": 11.0, "c": 12.0, "z": 13.0, "unfused": 12.5})
    _decide(chooser, down, "d", {"d": 20.0, "e": 20.5, "unfused": 25.0})
    _decide(chooser, other_rows, "a", {"a": 10.0, "unfused": 12.0})
    in_step = {qkv: {"a": 100.0, "b": 101.0, "c": 99.9, "z": 10.0, "unfused": 95.0},
               down: {"d": 0.0, "e": -0.1, "unfused": 3.0}}  # e's gain is under IN_STEP_MIN_GAIN
    proj = ("proj", 1)  # the unfused qkv path's own projection: first timed when that path first runs
    in_step[proj] = {"unfused": 0.0, "p": -4.0}
    timed = []

    def step_us():
        if chooser.decisions[qkv] == "unfused" and proj not in chooser.decisions:
            _decide(chooser, proj, "unfused", {"unfused": 5.0, "p": 5.1})
        timed.append({k: chooser.decisions[k] for k in (qkv, down)})
        cost = in_step[proj][chooser.decisions[proj]] if chooser.decisions[qkv] == "unfused" else 0.0
        return 800.0 + cost + sum(in_step[k][chooser.decisions[k]] for k in (qkv, down))

    chooser.in_step_tops[1] = 2
    report = chooser.tune_in_step(1, step_us)
    assert chooser.decisions == {qkv: "unfused", down: "d", other_rows: "a", proj: "p"}
    assert report == {"before_us": 900.0, "after_us": 891.0,
                      "changed": {"qkv/1": ["a", "unfused"], "proj/1": ["unfused", "p"]}}
    assert "z" not in {d[qkv] for d in timed}  # only the top 2 configurations alone, besides the choice
    assert set(chooser.in_step[qkv]) == {"a", "b", "c", "unfused"}
    assert chooser.report()["qkv/1"]["step_us"]["unfused"] == 895.0
    assert "step_us" not in chooser.report()["qkv/2"]
    # Tuned once per chooser (one per runner): a later capture keeps what was found.
    assert chooser.tune_in_step(1, lambda: pytest.fail("already tuned")) == {}


def test_in_step_tuning_keeps_the_lone_choices_unless_confirmed(chooser):
    _decide(chooser, ("qkv", 1), "a", {"a": 10.0, "unfused": 12.0})
    calls = iter([900.0, 890.0] + [890.0, 892.0] * 2)  # site: a, unfused; then confirm (before, after) x 2
    report = chooser.tune_in_step(1, lambda: next(calls))
    assert chooser.decisions[("qkv", 1)] == "a"
    assert report["changed"] == {} and report["unconfirmed"] == {"qkv/1": ["a", "unfused"]}


def test_in_step_tuning_with_nothing_to_tune(chooser):
    assert chooser.tune_in_step(1, lambda: pytest.fail("no site at 1 row: nothing to time")) == {}
    _decide(chooser, ("qkv", 2), "a", {"a": 10.0, "unfused": 12.0})
    assert small_batch_gemv.IN_STEP_ROWS == (1,)
    assert chooser.tune_in_step(2, lambda: pytest.fail("batch 1 only")) == {}


def test_a_verify_steps_graph_is_refined_in_step_against_the_unfused_path_only(chooser):
    """With speculative decoding the runner names the graph size a batch-1 verify step replays
    (refine_verify_step): its sites are refined in-step too, trying only their choice and the unfused
    path (IN_STEP_VERIFY_TOP = 0), so the tensor cores stay only where the step confirms them."""
    gate_up, down, plain = ("gate_up", 8), ("down", 8), ("gate_up", 16)
    _decide(chooser, gate_up, "mma", {"mma": 10.0, "mma2": 10.5, "unfused": 11.0})
    _decide(chooser, down, "mma", {"mma": 10.0, "unfused": 10.5})
    _decide(chooser, plain, "mma", {"mma": 10.0, "unfused": 12.0})
    chooser.refine_verify_step(8)
    assert small_batch_gemv.IN_STEP_VERIFY_TOP == 0 and chooser.in_step_tops == {1: small_batch_gemv.IN_STEP_TOP, 8: 0}
    in_step = {gate_up: {"mma": 30.0, "unfused": 0.0}, down: {"mma": 0.0, "unfused": 1.0}}
    timed = []

    def step_us():
        timed.append(dict(chooser.decisions))
        return 6000.0 + sum(in_step[k][chooser.decisions[k]] for k in (gate_up, down))

    report = chooser.tune_in_step(8, step_us)
    assert chooser.decisions == {gate_up: "unfused", down: "mma", plain: "mma"}
    assert report["changed"] == {"gate_up/8": ["mma", "unfused"]}
    assert "mma2" not in {d[gate_up] for d in timed}  # no configuration besides the choice
    assert chooser.tune_in_step(16, lambda: pytest.fail("not a verify size")) == {}


@pytest.mark.parametrize("model, attention_rotates, persistent", [
    ("qwen2-bias", False, False), ("qwen2-bias", True, False), ("qwen2-bias", True, True),
    ("mistral-window-8", False, False),  # a window shorter than the prompts: the epilogue's K/V, a windowed attend
    ("gemma3", True, False), ("gemma2", True, False),  # Gemma's norm forms in the prologue, GELU in gate_up's epilogue
])
def test_tiny_bf16_model_decode_logits_match_the_unfused_path(tiny_model_paths, monkeypatch, tmp_path, model,
                                                               attention_rotates, persistent):
    """A whole bf16 model: prefill (more than 4 rows: unfused either way), then two decode steps
    of two rows, which take the small-batch GEMV kernels when forced: q/k/v with the rotary +
    KV-write epilogue included where the triton backend attends over K/V written beforehand (decode
    steps of more than fuse_rope_max_rows rows), or without it where the decode attention rotates
    and writes the cache itself (at most fuse_rope_max_rows rows); with `persistent`, every site but
    the rotary epilogue's runs a Persistent configuration."""
    from test_triton_backend import BLOCK_SIZE, Plans, random_seqs, reference_triton_backend
    from worker_harness import make_runner

    from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend

    if not attention_rotates:  # the two-row steps are "large": the rotary stays out of the attention kernel
        monkeypatch.setattr(TritonAttentionBackend, "fuse_rope_max_rows", 0)
    if persistent:  # forced mode runs each site's first configuration
        monkeypatch.setattr(gemv, "CONFIGS", (gemv.Persistent(2, 4, 4), *gemv.CONFIGS))
        monkeypatch.setattr(gemv, "NORM_CONFIGS", (gemv.Persistent(4, 8, 2), *gemv.NORM_CONFIGS))
    epilogues, configs, forms = [], [], []
    real = gemv.small_batch_linear
    monkeypatch.setattr(gemv, "small_batch_linear", lambda *a, **kw: epilogues.append(kw.get("rotary") is not None)
                        or configs.append(kw.get("config"))
                        or forms.append((kw.get("unit_offset", False), kw.get("x_norm_weight") is not None,
                                         kw.get("gelu", False)))
                        or real(*a, **kw))
    model_dir = tiny_model_paths.get(model)
    if model == "mistral-window-8":
        from test_dense_families import _copy_with

        model_dir = _copy_with(tmp_path, "mistral", sliding_window=8)
    logits = []
    for mode in ("off", "force"):
        runner = make_runner(
            str(model_dir), dtype="bfloat16", device=DEVICE.type, block_size=BLOCK_SIZE,
            attention_backend="triton" if ON_CUDA else reference_triton_backend(),
        )
        runner.allocate_kv_cache(32)
        seqs = random_seqs([20, 9], seed=1)
        plans = Plans(num_blocks=32, seed=1)
        with fused_mode(mode):
            runner.forward_all_logits(plans.plan([(s, len(s.tokens)) for s in seqs]))
            for token in (7, 9):
                for seq in seqs:
                    seq.tokens.append(token)
                logits.append(runner.forward_all_logits(plans.plan([(s, 1) for s in seqs])))
    for got, expected in zip(logits[2:], logits[:2]):
        torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)
    layers = len(runner.attention_layers)
    assert model != "mistral-window-8" or all(layer.sliding_window == 8 for layer in runner.attention_layers)
    # each decode step's q/k/v took the rotary epilogue, unless the attention rotates
    assert epilogues.count(True) == (0 if attention_rotates else 2 * layers)
    assert len(epilogues) > 2 * layers  # the small-batch GEMV kernels ran
    assert all(isinstance(c, gemv.Persistent) == persistent for c in configs)
    if model.startswith("gemma"):  # q/k/v after the first layer's and the sandwich's norms; gate_up with GELU
        assert (True, False, False) in forms and (True, True, False) in forms and (True, True, True) in forms


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", ["1b", "8b"])
@pytest.mark.parametrize("rows", [1, 2])
def test_persistent_configurations_at_llama_shapes(shape, rows):
    # Every site of Llama-3.2-1B and -3.1-8B at its real size (down_proj's K = 8192 and 14336: not a
    # power of two at 8B, so the tile is masked), each Persistent configuration against float64.
    hidden, qkv_out, inter = {"1b": (2048, 3072, 8192), "8b": (4096, 6144, 14336)}[shape]
    norm = _norm(hidden, seed=50)
    x, residual = _randn(rows, hidden, seed=51), _randn(rows, hidden, seed=52)
    w_qkv, w_o = _randn(qkv_out, hidden, seed=53, scale=0.02), _randn(hidden, hidden, seed=54, scale=0.02)
    w_gate_up, w_down = _randn(2 * inter, hidden, seed=55, scale=0.02), _randn(hidden, inter, seed=56, scale=0.02)
    h = _randn(rows, inter, seed=57)
    normed, expected_residual = norm(x, residual)
    gate_up = F.linear(normed.double(), w_gate_up.double()).to(DTYPE)
    ran, refused = 0, []

    def run(config, fn):  # a configuration that would spill registers is refused, never run
        nonlocal ran
        try:
            result = fn(config)
        except ValueError as error:
            assert "spills" in str(error)
            refused.append(config)
            return None
        ran += 1
        return result

    for config in (c for c in gemv.CONFIGS if isinstance(c, gemv.Persistent)):
        got = run(config, lambda c: gemv.small_batch_linear(x, w_qkv, norm_weight=norm.weight, residual=residual,
                                                       eps=norm.eps, config=c))
        if got is not None:
            assert torch.equal(got[1], expected_residual)
            _close(got[0], _matmul_reference(normed, w_qkv))
        if (got := run(config, lambda c: gemv.small_batch_linear(x, w_o, config=c))) is not None:
            _close(got[0], _matmul_reference(x, w_o))
        if (got := run(config, lambda c: gemv.small_batch_linear(h, w_down, config=c))) is not None:
            _close(got[0], _matmul_reference(h, w_down))
        got = run(config, lambda c: gemv.small_batch_linear(x, w_gate_up, norm_weight=norm.weight, residual=residual,
                                                       eps=norm.eps, silu=True, config=c))
        if got is not None:
            torch.testing.assert_close(got[0], SiluAndMul()(gate_up), atol=3e-2, rtol=3e-2)
    print(f"{shape} rows {rows}: {ran} ran, refused for spilling: {refused}")
    assert ran >= len(refused)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_llama_8b_shapes_and_the_timed_choice(rows):
    hidden, inter = 4096, 14336
    norm = _norm(hidden, seed=20)
    x, residual = _randn(rows, hidden, seed=21), _randn(rows, hidden, seed=22)
    w_qkv = _randn(6144, hidden, seed=23, scale=0.02)
    w_gate_up = _randn(2 * inter, hidden, seed=24, scale=0.02)
    w_down = _randn(hidden, inter, seed=25, scale=0.02)
    for config in (c for c in gemv.NORM_CONFIGS if not isinstance(c, gemv.Persistent)):  # those: the test above
        out, new_residual = gemv.small_batch_linear(x, w_qkv, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                               config=config)
        normed, expected_residual = norm(x, residual)
        assert torch.equal(new_residual, expected_residual)
        _close(out, _matmul_reference(normed, w_qkv))
        _close(gemv.small_batch_linear(normed, w_down[:, :hidden], config=config)[0],
               _matmul_reference(normed, w_down[:, :hidden]))
        act = gemv.small_batch_linear(x, w_gate_up, norm_weight=norm.weight, residual=residual, eps=norm.eps, silu=True,
                                 config=config)[0]
        torch.testing.assert_close(act, SiluAndMul()(F.linear(normed, w_gate_up)), atol=3e-2, rtol=3e-2)
    chooser = SmallBatchGemv()
    with small_batch_gemv.building(chooser):
        layer = Linear(inter, hidden).to(DEVICE, DTYPE)
    with torch.no_grad():
        layer.weight.copy_(w_down)
    h = _randn(rows, inter, seed=26)
    _close(layer(h), _matmul_reference(h, w_down))
    (key, chosen), = chooser.report().items()
    assert key.startswith(f"linear/{rows}/{hidden}/{inter}") and "unfused" in chosen["us"]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cache_dtype", [DTYPE, torch.float8_e4m3fn])
@pytest.mark.parametrize("config", [(4, 64, 4), (8, 128, 4, True)])
def test_rotary_epilogue_writes_q_and_the_caches_like_the_unfused_path(rows, cache_dtype, config):
    # Epilogue RotaryKV: the q/k/v product's q heads come back rotated, the rotated k heads and the
    # v heads go into the caches at the rows' slots, as norm -> qkv_proj -> rope_and_write_kv.
    _check_rotary_epilogue(rows, cache_dtype, config, fp8_weight=False)


def _check_rotary_epilogue(rows, cache_dtype, config, fp8_weight: bool, block: tuple[int, int] | None = None) -> None:
    """The rotary epilogue against norm -> qkv_proj (one rounding of the float64 product) ->
    rope_and_write_kv; with fp8_weight, the q/k/v weight is fp8 with per-row scales, or with
    block scales of `block` (rows, cols) tiles."""
    from tokenspeed_worker.layers.kv_cache import to_cache_dtype, write_kv_cache
    from tokenspeed_worker.layers.rotary import rope_from_parameters

    heads, kv_heads, head_dim, hidden = 4, 2, 32, 96
    rope = rope_from_parameters(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    norm = _norm(hidden, seed=40)
    x, residual = _randn(rows, hidden, seed=41), _randn(rows, hidden, seed=42)
    scales = {}
    if block is not None:
        w, blocks, w_ref = _fp8_block_weight((heads + 2 * kv_heads) * head_dim, hidden, *block, seed=43)
        scales = {"weight_block_scales": blocks}
    elif fp8_weight:
        w, w_scale, w_ref = _fp8_weight((heads + 2 * kv_heads) * head_dim, hidden, seed=43, scale=0.05)
        scales = {"weight_scale": w_scale}
    else:
        w = w_ref = _randn((heads + 2 * kv_heads) * head_dim, hidden, seed=43, scale=0.1)
        w_scale = None
    bias = _randn(w.shape[0], seed=44, scale=0.1)
    positions = torch.tensor([5, 17, 63][:rows], device=DEVICE)
    slots = torch.tensor([9, 2, 14][:rows], device=DEVICE)
    caches = [torch.zeros((4, 4, kv_heads, head_dim), dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    rotary = gemv.RotaryKV(heads, kv_heads, head_dim, positions, rope.cos_cache, rope.sin_cache, caches[0], caches[1],
                           slots)
    q, new_residual = gemv.small_batch_linear(x, w, bias, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                              rotary=rotary, config=config, **scales)
    with fused_mode("off"):
        normed, expected_residual = norm(x, residual)
        qkv = _matmul_reference(normed, w_ref, bias).to(DTYPE)  # one rounding of the product, as cuBLAS
        q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q_ref, k_ref = rope(positions, q_ref.reshape(rows, heads, head_dim), k_ref.reshape(rows, kv_heads, head_dim))
        write_kv_cache(caches[2], caches[3], slots, k_ref, v_ref.reshape(rows, kv_heads, head_dim))
    assert q.shape == (rows, heads, head_dim) and torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(q.double(), q_ref.double(), atol=3e-2, rtol=3e-2)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got.double(), expected.double(), atol=6e-2, rtol=6e-2)
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert (got.view(16, -1)[untouched.to(DEVICE)].float() == 0).all()  # only the rows' slots
    assert to_cache_dtype(torch.tensor([1000.0]), cache_dtype).float().abs().item() <= 448 or cache_dtype == DTYPE


def test_rotary_epilogue_refuses_shapes_it_cannot_pair():
    rows, heads, kv_heads, head_dim, hidden = 1, 2, 1, 8, 32
    x, w = _randn(rows, hidden, seed=45), _randn((heads + 2 * kv_heads) * head_dim, hidden, seed=46)
    cache = torch.zeros((2, 4, kv_heads, head_dim), dtype=DTYPE, device=DEVICE)
    table = torch.zeros((8, head_dim), device=DEVICE)
    zero = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    rotary = gemv.RotaryKV(heads, kv_heads, head_dim, zero, table, table, cache, cache, zero)
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        gemv.small_batch_linear(x, w, rotary=rotary, config=(8, 32, 4))  # half a head (4) is not a multiple of 8
    with pytest.raises(ValueError, match="q/k/v rows"):
        gemv.small_batch_linear(x, w[:-head_dim], rotary=rotary, config=(4, 32, 4))
    with pytest.raises(ValueError, match="no rotary epilogue"):
        gemv.small_batch_linear(x, w, rotary=rotary, config=gemv.Persistent(2, 4, 4))


# FP8 weights: e4m3 with one float32 scale per weight row (weight_scale). The kernel sums exact
# products (a 16-bit input times an e4m3 value) in float32 and multiplies each sum once by its row's
# scale, so the references are the bf16 weights' references with the dequantized weight in float64,
# w.double() * scale[:, None], and the same tolerances (_close: the bf16 output's one rounding).

FP8 = torch.float8_e4m3fn


def _fp8_weight(n: int, k: int, seed: int, scale: float = 0.05) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, weight_scale, the dequantized weight in float64) as an fp8 checkpoint ships them:
    random rows of magnitudes spread over 16x (so a scale applied to another row's sum shows),
    quantized to e4m3 with one scale per row, amax / 448."""
    g = torch.Generator().manual_seed(seed)
    w = scale * torch.randn(n, k, generator=g) * 2.0 ** (4 * torch.rand(n, 1, generator=g) - 2)
    w_scale = w.abs().amax(dim=1) / 448
    q, w_scale = (w / w_scale[:, None]).to(FP8).to(DEVICE), w_scale.to(DEVICE)
    return q, w_scale, q.double() * w_scale.double()[:, None]


def _fp8_block_weight(n: int, k: int, rows: int, cols: int, seed: int, scale: float = 0.05):
    """(weight, BlockScales, the dequantized weight in float64) as a block-wise FP8 checkpoint ships
    them: tiles of rows x cols with magnitudes spread over 16x (a tile's scale applied to another's
    columns or rows shows), each quantized with its own amax / 448; the edge tiles cut."""
    from tokenspeed_worker.kernels.fp8 import expand_scales

    g = torch.Generator().manual_seed(seed)
    tiles = (-(-n // rows), -(-k // cols))
    spread = 2.0 ** (4 * torch.rand(*tiles, generator=g) - 2)
    w = scale * torch.randn(n, k, generator=g) * expand_scales(spread, rows, cols, (n, k))
    padded = torch.zeros(tiles[0] * rows, tiles[1] * cols)
    padded[:n, :k] = w
    tile_scales = padded.view(tiles[0], rows, tiles[1], cols).abs().amax(dim=(1, 3)) / 448
    full = expand_scales(tile_scales, rows, cols, (n, k))
    q = (w / full).to(FP8)
    return q.to(DEVICE), gemv.BlockScales(tile_scales.to(DEVICE), rows, cols), (q.double() * full.double()).to(DEVICE)


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x's rows as an Fp8Mma configuration multiplies them (W8A8), in float64: each quantized to
    e4m3 with its own scale, kernels/fp8.quantize_rows's, but times the scale's float32 reciprocal
    (the kernel's way; a division can round one value to the next e4m3 step)."""
    _, s = quantize_rows_reference(x)
    rows = x.reshape(-1, x.shape[-1]).float()
    q = (rows * (1.0 / s)).clamp(-448.0, 448.0).to(FP8)
    return (q.double() * s.double()).reshape(x.shape)


def _input_of(config, x: torch.Tensor) -> torch.Tensor:
    return _quantized(x) if isinstance(config, gemv.Fp8Mma) else x


def test_every_finite_fp8_value_widens_exactly():
    # The 254 finite e4m3 values as a [127, 2] weight of scale 1, times the one-hot rows of a float32
    # x: out is the weight itself, bit for bit. (Triton's interpreter widens the two NaN encodings,
    # 0x7f and 0xff, to +-480; no weight holds one.)
    values = torch.arange(256).to(torch.uint8).view(FP8)
    w = values[values.float().isfinite()].reshape(-1, 2).to(DEVICE)
    x = torch.eye(2, device=DEVICE)
    out = gemv.small_batch_linear(x, w, weight_scale=torch.ones(w.shape[0], device=DEVICE), config=(16, 128, 4))[0]
    assert torch.equal(out, w.float().T)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("config", [(16, 128, 4), gemv.Persistent(4, 8, 2), gemv.Fp8Mma(16, 64, 4, 2)])
def test_fp8_weight_plain_product_with_ragged_shapes_and_bias(rows, config):
    k, n = 300, 42  # K over 128 and N over 16 and 4: all ragged
    x, b = _randn(rows, k, seed=60), _randn(n, seed=61)
    w, w_scale, w_ref = _fp8_weight(n, k, seed=62)
    out, residual_out = gemv.small_batch_linear(x, w, b, weight_scale=w_scale, config=config)
    assert out.shape == (rows, n) and out.dtype == DTYPE and residual_out is None
    _close(out, _matmul_reference(_input_of(config, x), w_ref, b))


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("config", [(16, 128, 4), (16, 128, 4, True), gemv.Persistent(4, 8, 2),
                                    gemv.Fp8Mma(32, 64, 4, 2)])
def test_fp8_weight_under_the_norm_prologue(with_residual, config):
    # Two-pass, one-pass (1 / RMS and the scales both multiply the finished sum), persistent, and
    # tensor cores (the normalized rows quantized to e4m3 per row).
    rows, k, n = 3, 264, 48
    norm = _norm(k, seed=63)
    x, residual = _randn(rows, k, seed=64, scale=2.0), _randn(rows, k, seed=65)
    w, w_scale, w_ref = _fp8_weight(n, k, seed=66)
    out, residual_out = gemv.small_batch_linear(x, w, norm_weight=norm.weight,
                                                residual=residual if with_residual else None, eps=norm.eps,
                                                weight_scale=w_scale, config=config)
    with fused_mode("off"):
        normed, expected_residual = norm(x, residual) if with_residual else (norm(x), x)
    assert torch.equal(residual_out, expected_residual)
    _close(out, _matmul_reference(_input_of(config, normed), w_ref))


@pytest.mark.parametrize("config", [(16, 64, 4), (16, 64, 4, True), gemv.Persistent(2, 4, 4), gemv.Fp8Mma(16, 64, 4, 2)])
def test_fp8_weight_silu_epilogue_over_gate_up_rows(config):
    # The gate columns take the first I scales, the up columns the last I.
    rows, k, inter = 2, 192, 40
    norm = _norm(k, seed=67)
    x, residual = _randn(rows, k, seed=68), _randn(rows, k, seed=69)
    w, w_scale, w_ref = _fp8_weight(2 * inter, k, seed=70, scale=0.1)
    out, residual_out = gemv.small_batch_linear(x, w, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                                silu=True, weight_scale=w_scale, config=config)
    with fused_mode("off"):
        normed, expected_residual = norm(x, residual)
        expected = SiluAndMul()(F.linear(_input_of(config, normed).double(), w_ref).to(DTYPE))
    assert out.shape == (rows, inter) and torch.equal(residual_out, expected_residual)
    torch.testing.assert_close(out.double(), expected.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype, config", [(DTYPE, (8, 128, 4, True)), (FP8, (4, 64, 4))])
def test_fp8_weight_under_the_rotary_epilogue(cache_dtype, config):
    # Each pair's columns d and d + head_dim / 2 take their own rows' scales. The fp8 cache with the
    # two-pass prologue: the one-pass one's bfloat16 step can move a value across an e4m3 rounding
    # boundary, one e4m3 step (up to 1/8) off the reference.
    _check_rotary_epilogue(3, cache_dtype, config, fp8_weight=True)


@pytest.mark.parametrize("config", [(16, 128, 4), gemv.Persistent(4, 8, 2)])
def test_a_weight_scale_also_scales_a_weight_of_xs_dtype(config):
    rows, k, n = 2, 300, 42
    x, w, b = _randn(rows, k, seed=71), _randn(n, k, seed=72, scale=0.05), _randn(n, seed=73)
    w_scale = (torch.rand(n, generator=torch.Generator().manual_seed(74)) * 4 + 0.25).to(DEVICE)
    out = gemv.small_batch_linear(x, w, b, weight_scale=w_scale, config=config)[0]
    _close(out, _matmul_reference(x, w.double() * w_scale.double()[:, None], b))


def test_fp8_weight_refusals():
    x = _randn(2, 64, seed=75)
    w, w_scale, _ = _fp8_weight(8, 64, seed=76)
    with pytest.raises(ValueError, match="needs weight_scale"):
        gemv.small_batch_linear(x, w)
    for wrong in (w_scale[:-1], w_scale.double(), w_scale[None], torch.stack([w_scale, w_scale], dim=1)[:, 0]):
        with pytest.raises(ValueError, match="weight_scale must be"):
            gemv.small_batch_linear(x, w, weight_scale=wrong)
    for other in (w.float().to(torch.float8_e5m2), w.to(torch.float16)):
        with pytest.raises(ValueError, match="weight dtype"):
            gemv.small_batch_linear(x, other, weight_scale=w_scale)
    mma = gemv.Fp8Mma(16, 64, 4, 2)
    with pytest.raises(ValueError, match="takes FP8 weights"):
        gemv.small_batch_linear(x, _randn(8, 64, seed=77), config=mma)
    assert not gemv.supports_rotary(mma) and not gemv.supports_rotary(gemv.Persistent(2, 4, 4))
    assert gemv.supports_rotary((16, 128, 4)) and set(gemv.FP8_MMA_CONFIGS) <= set(gemv.FP8_CONFIGS)
    # Configurations are tuples: one equal to another of another kind would be one key in a set.
    for configs in (gemv.FP8_CONFIGS, gemv.FP8_NORM_CONFIGS, gemv.NORM_CONFIGS, gemv.MMA_CONFIGS):
        assert len(set(configs)) == len(configs)


# Block-wise FP8 weights (weight_block_scales: a scale per rows x cols tile, as Qwen3-*-FP8 and
# DeepSeek ship 128 x 128): each strip of weight rows lies in one tile row, so the kernel scales the
# input slice of each K step by its columns' tile scales; the references are the dequantized weights.
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("config", [(16, 128, 4), (32, 64, 4), (8, 256, 4)])
def test_block_fp8_weight_plain_product_with_ragged_shapes_and_bias(rows, config):
    k, n = 300, 90  # K over three 128-column groups (the last partial), N over 32-row tiles (partial)
    x, b = _randn(rows, k, seed=160), _randn(n, seed=161)
    w, blocks, w_ref = _fp8_block_weight(n, k, 32, 128, seed=162)
    out = gemv.small_batch_linear(x, w, b, weight_block_scales=blocks, config=config)[0]
    _close(out, _matmul_reference(x, w_ref, b))


@pytest.mark.parametrize("config", [(16, 64, 4), (16, 64, 4, True)])
def test_block_fp8_weight_under_the_norm_prologue_and_silu(config):
    # Gate and up strips each take their own tile rows' scales (I a multiple of the tile height).
    # The one-pass prologue (1 / RMS after the sum) rounds its input a bfloat16 step apart from the
    # norm layer, which SiLU·mul can carry past the tolerance: it is checked without the epilogue.
    rows, k, inter = 3, 192, 64
    norm = _norm(k, seed=163)
    x, residual = _randn(rows, k, seed=164), _randn(rows, k, seed=165)
    w, blocks, w_ref = _fp8_block_weight(2 * inter, k, 32, 64, seed=166, scale=0.1)
    if len(config) == 3:
        out, residual_out = gemv.small_batch_linear(x, w, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                                    silu=True, weight_block_scales=blocks, config=config)
        with fused_mode("off"):
            normed, expected_residual = norm(x, residual)
            expected = SiluAndMul()(F.linear(normed.double(), w_ref).to(DTYPE))
        assert torch.equal(residual_out, expected_residual)
        torch.testing.assert_close(out.double(), expected.double(), atol=2e-2, rtol=2e-2)
    plain = gemv.small_batch_linear(x, w[:inter], norm_weight=norm.weight, eps=norm.eps, config=config,
                                    weight_block_scales=gemv.BlockScales(blocks.scales[:2].contiguous(), 32, 64))[0]
    _close(plain, _matmul_reference(norm(x), w_ref[:inter]))


def test_block_fp8_weight_under_the_rotary_epilogue():
    _check_rotary_epilogue(3, DTYPE, (16, 64, 4), fp8_weight=True, block=(32, 32))


def test_block_fp8_weight_refusals():
    x = _randn(2, 64, seed=167)
    w, blocks, _ = _fp8_block_weight(64, 64, 32, 32, seed=168)
    for config in (gemv.Persistent(2, 4, 4), gemv.Fp8Mma(16, 64, 4, 2), (64, 64, 4)):  # 64-row strips: two tiles
        with pytest.raises(ValueError, match="cannot read block scales"):
            gemv.small_batch_linear(x, w, weight_block_scales=blocks, config=config)
    with pytest.raises(ValueError, match="weight_block_scales must be"):
        gemv.small_batch_linear(x, w, weight_block_scales=gemv.BlockScales(blocks.scales[:1], 32, 32), config=(16, 64, 4))
    with pytest.raises(ValueError, match="no weight_scale"):
        gemv.small_batch_linear(x, w, weight_scale=torch.ones(64, device=DEVICE), weight_block_scales=blocks,
                                config=(16, 64, 4))
    assert all(gemv.takes_block_scales(c, 128) for c in gemv.configs_for(FP8, norm=True, block_rows=128))
    assert not gemv.configs_for(FP8, block_rows=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_fp8_weights_at_llama_8b_shapes(rows):
    # Llama-3.1-8B's q/k/v (norm prologue), gate_up (norm, SiLU) and down_proj sites with fp8 weights,
    # every one-shot, Persistent and tensor-core configuration against float64; Persistent ones that would spill
    # registers or hold more than PERSISTENT_MAX_ELEMENTS inputs (down_proj's K at 3 and 4 rows) are refused.
    # Row magnitudes up to 0.02, as the bf16 tests' weights: the one-pass configurations' bfloat16 step
    # per input element adds up over K = 4096 to more than _close allows at larger weights (bf16 too).
    hidden, qkv_out, inter = 4096, 6144, 14336
    norm = _norm(hidden, seed=80)
    x, residual, h = _randn(rows, hidden, seed=81), _randn(rows, hidden, seed=82), _randn(rows, inter, seed=83)
    w_qkv, s_qkv, ref_qkv = _fp8_weight(qkv_out, hidden, seed=84, scale=0.005)
    w_gate_up, s_gate_up, ref_gate_up = _fp8_weight(2 * inter, hidden, seed=85, scale=0.005)
    w_down, s_down, ref_down = _fp8_weight(hidden, inter, seed=86, scale=0.005)
    normed, expected_residual = norm(x, residual)
    expected = {}  # by input rounding: as they are, or quantized per row (the tensor-core configurations)
    for mma, rounded in ((False, lambda t: t), (True, _quantized)):
        expected[mma] = (_matmul_reference(rounded(normed), ref_qkv), _matmul_reference(rounded(h), ref_down),
                         SiluAndMul()(F.linear(rounded(normed).double(), ref_gate_up).to(DTYPE)))
    del ref_gate_up
    ran, refused = 0, []

    def run(config, fn):
        nonlocal ran
        try:
            result = fn(config)
        except ValueError as error:
            assert isinstance(config, gemv.Persistent) and ("spills" in str(error) or "input elements" in str(error))
            refused.append(config)
            return None
        except OutOfResources:  # the chooser skips it there: gate_up's two weight tiles overflow shared memory
            assert isinstance(config, gemv.Fp8Mma)
            refused.append(config)
            return None
        ran += 1
        return result

    for config in dict.fromkeys(gemv.NORM_CONFIGS + gemv.FP8_NORM_CONFIGS):  # the bf16 and the FP8 sets
        expected_qkv, _, expected_act = expected[isinstance(config, gemv.Fp8Mma)]
        got = run(config, lambda c: gemv.small_batch_linear(x, w_qkv, norm_weight=norm.weight, residual=residual,
                                                            eps=norm.eps, weight_scale=s_qkv, config=c))
        if got is not None:
            assert torch.equal(got[1], expected_residual)
            _close(got[0], expected_qkv)
        got = run(config, lambda c: gemv.small_batch_linear(x, w_gate_up, norm_weight=norm.weight, residual=residual,
                                                            eps=norm.eps, silu=True, weight_scale=s_gate_up, config=c))
        if got is not None:
            torch.testing.assert_close(got[0], expected_act, atol=3e-2, rtol=3e-2)
    for config in dict.fromkeys(gemv.CONFIGS + gemv.FP8_CONFIGS):
        got = run(config, lambda c: gemv.small_batch_linear(h, w_down, weight_scale=s_down, config=c))
        if got is not None:
            _close(got[0], expected[isinstance(config, gemv.Fp8Mma)][1])
    print(f"fp8 rows {rows}: {ran} ran, refused: {refused}")
    assert ran >= 2 * len(gemv.NORM_CONFIGS)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_block_fp8_weights_at_llama_8b_shapes(rows):
    # The same three sites with 128 x 128 block scales (Qwen3-*-FP8's and DeepSeek's tiles), every
    # configuration that takes them, against float64.
    hidden, qkv_out, inter = 4096, 6144, 14336
    norm = _norm(hidden, seed=90)
    x, residual, h = _randn(rows, hidden, seed=91), _randn(rows, hidden, seed=92), _randn(rows, inter, seed=93)
    w_qkv, s_qkv, ref_qkv = _fp8_block_weight(qkv_out, hidden, 128, 128, seed=94, scale=0.005)
    w_gate_up, s_gate_up, ref_gate_up = _fp8_block_weight(2 * inter, hidden, 128, 128, seed=95, scale=0.005)
    w_down, s_down, ref_down = _fp8_block_weight(hidden, inter, 128, 128, seed=96, scale=0.005)
    normed, expected_residual = norm(x, residual)
    expected_qkv, expected_down = _matmul_reference(normed, ref_qkv), _matmul_reference(h, ref_down)
    expected_act = SiluAndMul()(F.linear(normed.double(), ref_gate_up).to(DTYPE))
    del ref_gate_up
    norm_configs = gemv.configs_for(FP8, norm=True, block_rows=128)
    assert norm_configs and not any(isinstance(c, (gemv.Persistent, gemv.Fp8Mma)) for c in norm_configs)
    for config in norm_configs:
        out, new_residual = gemv.small_batch_linear(x, w_qkv, norm_weight=norm.weight, residual=residual,
                                                    eps=norm.eps, weight_block_scales=s_qkv, config=config)
        assert torch.equal(new_residual, expected_residual)
        _close(out, expected_qkv)
        out = gemv.small_batch_linear(x, w_gate_up, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                      silu=True, weight_block_scales=s_gate_up, config=config)[0]
        torch.testing.assert_close(out, expected_act, atol=3e-2, rtol=3e-2)
    for config in gemv.configs_for(FP8, block_rows=128):
        _close(gemv.small_batch_linear(h, w_down, weight_block_scales=s_down, config=config)[0], expected_down)


# Gemma's forms (one-shot two-pass and Persistent configurations): the (1 + w) norm, a sublayer's post
# norm before the residual add (RMSNorm.forward_after), and gelu_tanh(gate) * up; against the torch path.
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_gemma_forms_of_the_norm_prologue_and_the_gelu_epilogue(rows, after, fp8):
    from tokenspeed_worker.layers.activation import GeluTanhAndMul
    from tokenspeed_worker.layers.layernorm import GemmaRMSNorm

    k, n, inter = 160, 40, 24
    pre, post = GemmaRMSNorm(k, eps=1e-6).to(DEVICE, DTYPE), GemmaRMSNorm(k, eps=1e-6).to(DEVICE, DTYPE)
    with torch.no_grad():
        pre.weight.copy_(_randn(k, seed=170, scale=0.3))
        post.weight.copy_(_randn(k, seed=171, scale=0.3))
    x, residual = _randn(rows, k, seed=172, scale=3.0), _randn(rows, k, seed=173)
    if fp8:
        w, w_scale, w_ref = _fp8_weight(n, k, seed=174)
        w_gu, gu_scale, gu_ref = _fp8_weight(2 * inter, k, seed=175, scale=0.1)
        scales, gu_scales = {"weight_scale": w_scale}, {"weight_scale": gu_scale}
    else:
        w, w_gu = _randn(n, k, seed=174, scale=0.05), _randn(2 * inter, k, seed=175, scale=0.1)
        w_ref, gu_ref, scales, gu_scales = w, w_gu, {}, {}
    with fused_mode("off"):
        normed, expected_residual = pre.forward_after(post, x, residual) if after else pre(x, residual)
        expected_act = GeluTanhAndMul()(F.linear(normed.double(), gu_ref.double()).to(DTYPE))
    forms = dict(norm_weight=pre.weight, residual=residual, eps=pre.eps, unit_offset=True,
                 x_norm_weight=post.weight if after else None)
    one_shot = [c for c in gemv.configs_for(w.dtype, norm=True) if gemv.takes_gemma_forms(c)][:2] + [(16, 64, 4)]
    for config in one_shot + [gemv.Persistent(2, 4, 4), gemv.Persistent(4, 8, 2)]:
        out, residual_out = gemv.small_batch_linear(x, w, config=config, **forms, **scales)
        torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=1e-2)  # one bf16 step at most
        _close(out, _matmul_reference(normed, w_ref))
        act = gemv.small_batch_linear(x, w_gu, gelu=True, config=config, **forms, **gu_scales)[0]
        assert act.shape == (rows, inter)
        torch.testing.assert_close(act.double(), expected_act.double(), atol=2e-2, rtol=2e-2)


def test_gemma_forms_refusals():
    x, r, w = _randn(2, 64, seed=176), _randn(2, 64, seed=177), _randn(8, 64, seed=178)
    nw = _randn(64, seed=179)
    for config in (gemv.Mma(64, 128, 4, 4), (16, 64, 4, True)):
        with pytest.raises(ValueError, match="no Gemma forms"):
            gemv.small_batch_linear(x, w, norm_weight=nw, residual=r, unit_offset=True, config=config)
    with pytest.raises(ValueError, match="go with norm_weight"):
        gemv.small_batch_linear(x, w, unit_offset=True, config=(16, 64, 4))
    with pytest.raises(ValueError, match="needs a residual"):
        gemv.small_batch_linear(x, w, norm_weight=nw, x_norm_weight=nw, config=(16, 64, 4))
    with pytest.raises(ValueError, match="pass one"):
        gemv.small_batch_linear(x, w, silu=True, gelu=True, config=(16, 64, 4))
    gemma_configs = gemv.configs_for(torch.bfloat16, norm=True, gemma=True)
    assert all(gemv.takes_gemma_forms(c) for c in gemma_configs)
    assert any(isinstance(c, gemv.Persistent) for c in gemma_configs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_gemma_forms_at_gemma_3_12b_shapes(rows):
    # Gemma-3-12B's q/k/v (hidden 3840 -> 16 + 2 x 8 heads of 256) and gate_up (2 x 15360) after the
    # sandwich (post norm, residual add, (1 + w) norm), GELU in gate_up's epilogue: every
    # configuration with Gemma's forms against float64 from the torch path's normalized rows.
    from tokenspeed_worker.layers.activation import GeluTanhAndMul
    from tokenspeed_worker.layers.layernorm import GemmaRMSNorm

    hidden, qkv_out, inter = 3840, 8192, 15360
    pre, post = GemmaRMSNorm(hidden).to(DEVICE, DTYPE), GemmaRMSNorm(hidden).to(DEVICE, DTYPE)
    with torch.no_grad():
        pre.weight.copy_(_randn(hidden, seed=180, scale=0.3))
        post.weight.copy_(_randn(hidden, seed=181, scale=0.3))
    x, residual = _randn(rows, hidden, seed=182, scale=3.0), _randn(rows, hidden, seed=183)
    w_qkv, w_gu = _randn(qkv_out, hidden, seed=184, scale=0.005), _randn(2 * inter, hidden, seed=185, scale=0.005)
    with fused_mode("off"):
        normed, expected_residual = pre.forward_after(post, x, residual)
        expected_act = GeluTanhAndMul()(F.linear(normed.double(), w_gu.double()).to(DTYPE))
    expected_qkv = _matmul_reference(normed, w_qkv)
    forms = dict(norm_weight=pre.weight, residual=residual, eps=pre.eps, unit_offset=True, x_norm_weight=post.weight)
    configs = gemv.configs_for(DTYPE, norm=True, gemma=True)
    assert any(isinstance(c, gemv.Persistent) for c in configs)
    ran, refused = 0, []
    for config in configs:
        try:  # a Persistent configuration that would spill registers (at 4 rows) is refused, never run
            out, residual_out = gemv.small_batch_linear(x, w_qkv, config=config, **forms)
            torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=1e-2)
            _close(out, expected_qkv)
            act = gemv.small_batch_linear(x, w_gu, gelu=True, config=config, **forms)[0]
        except ValueError as error:
            assert isinstance(config, gemv.Persistent) and "spills" in str(error)
            refused.append(config)
            continue
        torch.testing.assert_close(act, expected_act, atol=3e-2, rtol=3e-2)
        ran += 1
    print(f"rows {rows}: {ran} ran, refused for spilling: {refused}")
    assert ran > len(refused) and (rows > 1 or not refused)


# -- compile-only mode: the configurations a site times compile side by side ----------------------


def test_compile_only_mode_submits_compiles_and_launches_nothing(monkeypatch):
    """compile_ahead.launch (small_batch_linear's launches) launches a kernel, or in compile-only mode
    hands it to Triton's warmup (which AsyncCompileMode turns into a compile on the pool); compiling() is a
    no-op in the interpreter."""
    from tokenspeed_worker.kernels import compile_ahead

    calls = []

    class Kernel:
        def warmup(self, *args, grid, **meta):
            calls.append(("warmup", grid, args, meta))

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("launch", grid, args, meta))

    kernel = Kernel()
    compile_ahead.launch(kernel, (3,), 1, 2, ROWS=4)
    monkeypatch.setattr(compile_ahead, "_active", True)
    compile_ahead.launch(kernel, (3,), 1, 2, ROWS=4)
    assert calls == [("launch", (3,), (1, 2), {"ROWS": 4}), ("warmup", (3,), (1, 2), {"ROWS": 4})]
    monkeypatch.setattr(compile_ahead, "_active", False)
    if not ON_CUDA:  # the interpreter compiles nothing: the mode stays off and kernels run
        assert not compile_ahead.available()
        with compile_ahead.compiling():
            assert not compile_ahead.active()
            x, w = _randn(2, 64, seed=1), _randn(32, 64, seed=2)
            _close(gemv.small_batch_linear(x, w, config=gemv.CONFIGS[0])[0], _matmul_reference(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_compiling_fills_the_kernel_cache_before_the_first_launch():
    """Under compiling(), small_batch_linear's kernels for several configurations compile on the pool
    and land in Triton's cache: the launches after it compile nothing and compute the product."""
    from tokenspeed_worker.kernels import compile_ahead

    x, w = _randn(3, 320, seed=5, dtype=torch.float16), _randn(96, 320, seed=6, scale=0.05, dtype=torch.float16)
    norm = RMSNorm(320, eps=1e-5).to(DEVICE, torch.float16)
    configs = [c for c in gemv.NORM_CONFIGS if not isinstance(c, gemv.Persistent)][:4]
    cache = gemv._gemv_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    with compile_ahead.compiling():
        for config in configs:
            gemv.small_batch_linear(x, w, norm_weight=norm.weight, eps=norm.eps, config=config)
        assert compile_ahead.active()
    assert not compile_ahead.active()
    compiled = len(cache) - before
    assert compiled == len(configs), (before, len(cache))
    expected = _matmul_reference(norm(x), w)
    for config in configs:
        out = gemv.small_batch_linear(x, w, norm_weight=norm.weight, eps=norm.eps, config=config)[0]
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=1.6e-2)
    assert len(cache) - before == compiled


# -- past MAX_ROWS: the tensor-core configurations up to MMA_MAX_ROWS rows ---------------------------


@pytest.mark.parametrize("rows", [1, 5, 8, 16])
@pytest.mark.parametrize("config", [gemv.Mma(16, 64, 4, 2), gemv.Mma(32, 128, 4, 2)])
def test_mma_plain_product_with_ragged_shapes_and_bias(rows, config):
    # A 16-bit weight on the tensor cores: the rows in the weight's dtype, float32 sums.
    k, n = 300, 90
    x, b = _randn(rows, k, seed=180), _randn(n, seed=181)
    w = _randn(n, k, seed=182, scale=0.05)
    out, residual_out = gemv.small_batch_linear(x, w, b, config=config)
    assert out.shape == (rows, n) and out.dtype == DTYPE and residual_out is None
    _close(out, _matmul_reference(x, w, b))


@pytest.mark.parametrize("rows", [5, 12])
@pytest.mark.parametrize("with_residual", [True, False])
def test_mma_under_the_norm_prologue_and_silu(rows, with_residual):
    k, inter = 264, 48
    norm = _norm(k, seed=183)
    x, residual = _randn(rows, k, seed=184, scale=2.0), _randn(rows, k, seed=185)
    w = _randn(2 * inter, k, seed=186, scale=0.05)
    config = gemv.Mma(16, 64, 4, 2)
    out, residual_out = gemv.small_batch_linear(x, w, norm_weight=norm.weight,
                                                residual=residual if with_residual else None, eps=norm.eps,
                                                config=config)
    with fused_mode("off"):
        normed, expected_residual = norm(x, residual) if with_residual else (norm(x), x)
    assert torch.equal(residual_out, expected_residual)
    _close(out, _matmul_reference(normed, w))
    act, _ = gemv.small_batch_linear(x, w, norm_weight=norm.weight, residual=residual if with_residual else None,
                                     eps=norm.eps, silu=True, config=config)
    expected = SiluAndMul()(F.linear(normed.double(), w.double()).to(DTYPE))
    torch.testing.assert_close(act.double(), expected.double(), atol=2e-2, rtol=2e-2)


def test_fp8_mma_at_more_rows_than_the_cuda_core_configurations():
    rows, k, n = 9, 300, 42
    x, b = _randn(rows, k, seed=187), _randn(n, seed=188)
    w, w_scale, w_ref = _fp8_weight(n, k, seed=189)
    config = gemv.Fp8Mma(16, 64, 4, 2)
    out = gemv.small_batch_linear(x, w, b, weight_scale=w_scale, config=config)[0]
    _close(out, _matmul_reference(_quantized(x), w_ref, b))


def test_rows_past_the_cuda_core_limit_take_only_tensor_core_configurations():
    x, w = _randn(5, 64, seed=190), _randn(32, 64, seed=191)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv.small_batch_linear(x, w, config=gemv.CONFIGS[0])
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv.small_batch_linear(_randn(17, 64, seed=192), w, config=gemv.Mma(16, 64, 4, 2))
    fp8_w, fp8_scale, _ = _fp8_weight(32, 64, seed=193)
    with pytest.raises(ValueError, match="weights of x's dtype"):
        gemv.small_batch_linear(x, fp8_w, weight_scale=fp8_scale, config=gemv.Mma(16, 64, 4, 2))
    assert gemv.configs_for(torch.bfloat16, rows=5) == gemv.MMA_CONFIGS
    assert gemv.configs_for(torch.bfloat16, norm=True, rows=16) == gemv.MMA_CONFIGS
    assert gemv.configs_for(FP8, rows=8) == gemv.FP8_MMA_CONFIGS
    assert gemv.configs_for(FP8, rows=8, block_rows=128) == () and gemv.configs_for(torch.bfloat16, rows=17) == ()
    assert gemv.configs_for(torch.bfloat16, rows=8, gemma=True) == ()
    assert gemv.configs_for(torch.bfloat16, rows=4) == gemv.CONFIGS
    assert not any(gemv.supports_rotary(c) or gemv.takes_gemma_forms(c) for c in gemv.MMA_CONFIGS)


def test_a_chooser_runs_eight_rows_through_a_tensor_core_configuration():
    # Forced fused kernels (the interpreter): a site at 8 rows takes its first configuration, an Mma one.
    torch.manual_seed(0)
    with fused_mode("force"), small_batch_gemv.building(SmallBatchGemv()) as chooser:
        proj = Linear(64, 48, bias=False).to(DEVICE, DTYPE)
    with torch.no_grad():  # a Linear's weight is empty until loaded
        proj.weight.copy_(_randn(48, 64, seed=195, scale=0.1))
    x = _randn(8, 64, seed=194)
    with fused_mode("force"):
        out = chooser.linear(x, proj)
    _close(out, _matmul_reference(x, proj.weight))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [5, 8, 16])
def test_mma_at_llama_8b_shapes(rows):
    # A speculative verify step's or a mid-sized batch's rows through Llama-3.1-8B's q/k/v (norm
    # prologue), gate_up (norm, SiLU) and down_proj sites on the tensor cores, against float64.
    hidden, qkv_out, inter = 4096, 6144, 14336
    norm = _norm(hidden, seed=195)
    x, residual, h = _randn(rows, hidden, seed=196), _randn(rows, hidden, seed=197), _randn(rows, inter, seed=198)
    w_qkv = _randn(qkv_out, hidden, seed=199, scale=0.02)
    w_gate_up = _randn(2 * inter, hidden, seed=200, scale=0.02)
    w_down = _randn(hidden, inter, seed=201, scale=0.02)
    normed, expected_residual = norm(x, residual)
    expected_qkv, expected_down = _matmul_reference(normed, w_qkv), _matmul_reference(h, w_down)
    expected_act = SiluAndMul()(F.linear(normed.double(), w_gate_up.double()).to(DTYPE))
    gated = []
    for config in gemv.configs_for(DTYPE, norm=True, rows=rows):
        out, new_residual = gemv.small_batch_linear(x, w_qkv, norm_weight=norm.weight, residual=residual,
                                                    eps=norm.eps, config=config)
        assert torch.equal(new_residual, expected_residual)
        _close(out, expected_qkv)
        try:
            out = gemv.small_batch_linear(x, w_gate_up, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                          silu=True, config=config)[0]
        except OutOfResources:  # the chooser skips it there: two weight tiles per stage overflow shared memory
            continue
        gated.append(config)
        torch.testing.assert_close(out, expected_act, atol=3e-2, rtol=3e-2)
    assert gated, "no tensor-core configuration fits the gate_up site"
    for config in gemv.configs_for(DTYPE, rows=rows):
        _close(gemv.small_batch_linear(h, w_down, config=config)[0], expected_down)
