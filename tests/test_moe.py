"""Mixtures of experts (layers/moe.py; models/qwen3_moe.py, models/mixtral.py) against transformers:
the router's choice, the kernels against the loop, tensor and expert parallelism through the CLI,
and what is refused. (Staggered mixed batches with chunked prefill: tests/test_engine_vs_hf.py;
prefix hits and forced preemption: tests/test_dense_families.py; both run the MoE tiny models
beside the dense ones.)"""

from __future__ import annotations

import json

import pytest
import torch

from tokenspeed_worker.layers.moe import select_experts
from worker_harness import REPO, Worker, needs_devices, tiny_models

MOE_MODELS = ["qwen3-moe", "qwen2-moe", "mixtral"]


def test_routing_equals_transformers_routers():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(11, 16)
    for router, renormalize in ((Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                                                   norm_topk_prob=False)), False),
                                (Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=4,
                                                                   norm_topk_prob=False)), False),
                                (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8,
                                                                 num_experts_per_tok=2)), True)):
        torch.nn.init.normal_(router.weight)
        logits, expected_weights, expected_ids = router(x)
        weights, ids = select_experts(logits, router.top_k, renormalize)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights.float())


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_MODELS)
def test_tp2_through_the_cli_equals_transformers(name):
    """Each rank holds half of every expert's intermediate rows; the outputs sum over the ranks."""
    from test_tensor_parallel import FLAGS, check_against_transformers

    needs_devices(2)
    model_dir = tiny_models()[name]
    worker = Worker(model_dir, *FLAGS, "--tensor-parallel-size", "2")
    try:
        assert "tensor-parallel rank 1 of 2 ready" in worker.log()
        check_against_transformers(worker, model_dir)
    finally:
        assert worker.stop() == 0, worker.log()


@pytest.mark.parametrize("ep,world", [(2, 2), (4, 4), (2, 4)], ids=["ep2", "ep4", "ep2-moe_tp2"])
@pytest.mark.parametrize("kernels,tokens", [("loop", 13), ("force", 2), ("force", 13)],
                         ids=["loop", "force-decode", "force-grouped"])
def test_expert_parallel_ranks_sum_to_the_whole_layer(monkeypatch, ep, world, kernels, tokens):
    """Each rank of `world` built under expert_parallel(ep) holds E / ep whole experts (split over
    world / ep ranks by intermediate rows) and computes only the pairs routed to them; the ranks'
    partial outputs sum to the one-rank layer's (the all-reduce FusedMoE.forward does). The kernels
    (on CUDA where there is one, else the interpreter) at a decode step's few pairs and a prefill's."""
    from tokenspeed_worker import distributed
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.moe import FusedMoE, expert_parallel

    experts, hidden, inter, top_k = 8, 32, 48, 3
    torch.manual_seed(0)
    whole = FusedMoE(experts, hidden, inter)
    checkpoint = {(e, part): torch.randn(*((hidden, inter) if part == "down" else (inter, hidden))) * 0.2
                  for e in range(experts) for part in ("gate", "up", "down")}
    for (e, part), matrix in checkpoint.items():
        whole.load_expert(whole.w2_weight if part == "down" else whole.w13_weight, matrix, e, part)
    x = torch.randn(tokens, hidden)
    weights, ids = select_experts(torch.randn(tokens, experts), top_k, True)
    mode = "force" if kernels == "force" else "off"
    device = "cuda" if torch.cuda.is_available() and kernels == "force" else "cpu"
    with fused_kernels("off"):
        expected = whole._experts(x, weights, ids)
    x, weights, ids = x.to(device), weights.to(device), ids.to(device)
    with fused_kernels(mode):
        total, held = torch.zeros_like(expected), []
        for rank in range(world):
            monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
            monkeypatch.setattr(distributed, "size", lambda: world)
            with expert_parallel(ep):
                layer = FusedMoE(experts, hidden, inter)
            filled = sum(layer.load_expert(layer.w2_weight if part == "down" else layer.w13_weight, matrix, e, part)
                         for (e, part), matrix in checkpoint.items())
            assert filled == layer.w13_weight.numel() + layer.w2_weight.numel()
            assert layer.w13_weight.shape == (experts // ep, 2 * inter * ep // world, hidden)
            held.append((layer.first_expert, layer.moe_tp_rank))
            total += layer.to(device)._experts(x, weights, ids).cpu()
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-5)
    moe_tp = world // ep
    assert held == [((r // moe_tp) * (experts // ep), r % moe_tp) for r in range(world)]


def test_a_shared_expert_layer_all_reduces_once(monkeypatch):
    """Qwen2-MoE's layer under tensor parallelism: the routed experts' partial sum and the gated
    shared expert's go through one all-reduce together, not one each (the per-token gate is
    replicated, so it scales a partial sum as well as the whole). The layer is built on one rank
    and run as if on two, the all-reduce counted and passed through: the output must be the
    one-rank layer's."""
    from transformers import Qwen2MoeConfig

    from tokenspeed_worker import distributed
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.models.qwen2_moe import Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=48,
                            shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    _, block = Qwen2MoeForCausalLM.make_mlp(config, 0, "model.layers.0", bias=False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(7, 32)
    with fused_kernels("off"):
        expected = block(x)
        calls = []
        monkeypatch.setattr(distributed, "size", lambda: 2)
        monkeypatch.setattr(distributed, "all_reduce", lambda t: calls.append(t.shape) or t)
        got = block(x)
    assert calls == [torch.Size([7, 32])]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("ep,world", [(1, 1), (1, 2), (2, 2)], ids=["one-rank", "tp2", "ep2"])
@pytest.mark.parametrize("inter", [64, 56], ids=["tile-aligned", "unaligned"])
@pytest.mark.parametrize("kernels,tokens", [("loop", 9), ("force", 2), ("force", 9)],
                         ids=["loop", "force-decode", "force-grouped"])
def test_fp8_experts_on_every_rank_split(monkeypatch, ep, world, inter, kernels, tokens):
    """Block-wise FP8 experts (16 x 16 tiles): each rank loads the whole scale tensors, then keeps
    its FP8 rows with their tiles for the kernels (forced: CUDA where there is one, else the
    interpreter; a decode step's few pairs and a prefill's) where its down columns start on a
    column group, else dequantizes its rows; the ranks' outputs sum to the float layer's either way."""
    from tokenspeed_worker import distributed
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.moe import FusedMoE, expert_parallel
    from tokenspeed_worker.layers.quantization import Fp8LinearScheme, QuantConfig
    from tokenspeed_worker.layers.quantization import methods as quant_methods
    from worker_harness import _load_script

    quantize = _load_script("make_fp8_models").quantize
    experts, hidden, top_k = 4, 40, 2
    config = QuantConfig("fp8", Fp8LinearScheme("block", block=(16, 16), scale_name="weight_scale_inv"))
    torch.manual_seed(1)
    checkpoint, dequantized = {}, {}
    for e in range(experts):
        for part in ("gate", "up", "down"):
            w = torch.randn(*((hidden, inter) if part == "down" else (inter, hidden))) * 0.2
            checkpoint[e, part] = quantize(w, "block", block=16)[:2]
            dequantized[e, part] = quantize(w, "block", block=16)[2]
    whole = FusedMoE(experts, hidden, inter)
    for (e, part), matrix in dequantized.items():
        whole.load_expert(whole.w2_weight if part == "down" else whole.w13_weight, matrix, e, part)
    x = torch.randn(tokens, hidden)
    weights, ids = select_experts(torch.randn(tokens, experts), top_k, True)
    with fused_kernels("off"):
        expected, total = whole._experts(x, weights, ids), torch.zeros(tokens, hidden)
    device = "cuda" if torch.cuda.is_available() and kernels == "force" else "cpu"
    x, weights, ids = x.to(device), weights.to(device), ids.to(device)
    with fused_kernels("force" if kernels == "force" else "off"):
        for rank in range(world):
            monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
            monkeypatch.setattr(distributed, "size", lambda: world)
            with expert_parallel(ep), quant_methods.building(config):
                layer = FusedMoE(experts, hidden, inter, prefix="model.layers.0.mlp")
            assert layer.w13_weight.dtype == torch.float8_e4m3fn
            for (e, part), (q, scale) in checkpoint.items():
                layer.load_expert(layer.w2_weight if part == "down" else layer.w13_weight, q, e, part)
                layer.load_expert_scale(layer.w2_scale if part == "down" else layer.w13_scale, scale, e, part)
            layer.to(device).process_weights_after_loading()
            n = inter * ep // world  # this rank's rows of each expert; its down columns start at offset
            kept = kernels == "force" and (rank % (world // ep)) * n % 16 == 0
            assert (layer.w13_weight.dtype == torch.float8_e4m3fn) == kept and not hasattr(layer, "w13_scale")
            if kept:
                rows = 16 if n % 16 == 0 else 1
                assert (layer.w13_scales.rows, layer.w13_scales.cols) == (rows, 16)
                assert layer.kernels_agree(top_k)
            total += layer._experts(x, weights, ids).cpu()
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-4)


def test_experts_that_cannot_be_dealt_evenly_are_refused(monkeypatch):
    from tokenspeed_worker import distributed
    from tokenspeed_worker.layers.moe import FusedMoE, expert_parallel

    monkeypatch.setattr(distributed, "size", lambda: 3)
    with expert_parallel(3), pytest.raises(ValueError, match="8 experts cannot be dealt evenly to 3"):
        FusedMoE(8, 16, 24)


@pytest.mark.slow
@pytest.mark.parametrize("name,flags", [("qwen3-moe", ("--enable-expert-parallel",)), ("qwen3-moe", ("--ep-size", "2")),
                                        ("qwen2-moe", ("--enable-expert-parallel",))],
                         ids=["enable", "ep-size", "qwen2-moe-shared-expert"])
def test_expert_parallel_through_the_cli_equals_transformers(name, flags):
    """Two ranks, each with half of the experts whole (the dense layers, and Qwen2-MoE's shared
    expert, tensor parallel: its partial sum shares the experts' all-reduce)."""
    from test_tensor_parallel import FLAGS, check_against_transformers

    needs_devices(2)
    model_dir = tiny_models()[name]
    worker = Worker(model_dir, *FLAGS, "--tensor-parallel-size", "2", *flags)
    try:
        assert "expert parallel: 2 groups of 1 rank(s), 4 of the 8 experts each" in worker.log()
        check_against_transformers(worker, model_dir)
    finally:
        assert worker.stop() == 0, worker.log()


def test_cuda_graphs_are_off_for_experts_with_the_reason():
    from worker_harness import make_runner

    runner = make_runner(tiny_models()["qwen3-moe"], dtype="float32", device="cpu", emulate_cuda_graphs=True,
                         max_model_len=64)
    assert not runner.use_cuda_graphs and "experts" in runner.cuda_graphs_off_reason


def _loop(x, w13, w2, weights, ids):
    """The experts as the reference loop computes them (FusedMoE without kernels)."""
    from tokenspeed_worker.layers.moe import FusedMoE

    layer = FusedMoE(w13.shape[0], w13.shape[2], w2.shape[2]).to(x.device, x.dtype)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.use_kernels = False
    return layer._experts(x, weights, ids)


def test_grouped_gemm_programs_in_groups_cover_every_tile():
    """The grouped GEMM's program order (kernels/moe.GROUP_M blocks at a time through their column
    tiles): with more blocks than a group (the last group short) and many column tiles, every
    (block, column tile) is computed once: the layer equals the loop."""
    from tokenspeed_worker.kernels.moe import GROUP_M, GroupedConfig, align_by_expert, fused_experts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    tokens, experts, top_k, hidden, inter = 45, 6, 2, 80, 72
    x = torch.randn(tokens, hidden, device=device)
    w13 = 0.1 * torch.randn(experts, 2 * inter, hidden, device=device)
    w2 = 0.1 * torch.randn(experts, hidden, inter, device=device)
    weights, ids = select_experts(torch.randn(tokens, experts, device=device), top_k, True)
    config = GroupedConfig(16, 16, 16, 2, 2)
    blocks = align_by_expert(ids.to(torch.int32), experts, 16)[1]
    # more blocks than a group, the last group short, several blocks holding pairs
    assert blocks.numel() > GROUP_M and blocks.numel() % GROUP_M and int((blocks >= 0).sum()) > 1
    got = fused_experts(x, w13, w2, weights, ids.to(torch.int32), config=config, decode=False)
    torch.testing.assert_close(got, _loop(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 8, 2), (40, 4, 2), (70, 16, 3), (700, 16, 3),
                                                 (300, 128, 8)])
def test_align_by_expert_sorts_and_pads_each_experts_pairs(tokens, experts, top_k):
    """Also past one chunk of 1024 pairs (several histogram steps, several scatter programs)."""
    from tokenspeed_worker.kernels.moe import align_by_expert

    torch.manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    block = 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sorted_ids, block_experts = (t.cpu() for t in align_by_expert(ids.to(device), experts, block))
    pairs = tokens * top_k
    assert sorted_ids.numel() % block == 0 and sorted_ids.numel() >= pairs + experts * (block - 1)
    assert block_experts.numel() == sorted_ids.numel() // block
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_experts.tolist()):
        slots = sorted_ids[b * block:(b + 1) * block]
        mine = slots[slots < pairs]
        if expert < 0:
            assert mine.numel() == 0
        else:
            assert mine.numel() > 0 and (flat[mine.long()] == expert).all()
    used = (block_experts >= 0).sum().item()
    assert used == sum(-(-int((flat == e).sum()) // block) for e in range(experts))


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (5, 8, 2, 64, 32),
                                                                (40, 4, 2, 48, 24), (70, 16, 3, 64, 40)])
def test_grouped_gemm_experts_equal_the_loop(tokens, experts, top_k, hidden, inter):
    """The kernels (Triton's interpreter on CPU) against the loop, in float32 (and bfloat16 on CUDA)."""
    from tokenspeed_worker.kernels.moe import GroupedConfig, fused_experts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        torch.manual_seed(tokens + experts)
        x = torch.randn(tokens, hidden).to(device, dtype)
        w13 = (0.1 * torch.randn(experts, 2 * inter, hidden)).to(device, dtype)
        w2 = (0.1 * torch.randn(experts, hidden, inter)).to(device, dtype)
        weights, ids = select_experts(torch.randn(tokens, experts, device=device), top_k, True)
        expected = _loop(x, w13, w2, weights, ids)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for config in (None, GroupedConfig(32, 32, 32, 4, 2)):  # the default tiles, and others (bench_moe.py)
            got = fused_experts(x, w13, w2, weights, ids, config=config)
            torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 128, 8), (3, 60, 4), (5, 8, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routing_kernel_chooses_as_select_experts(tokens, experts, top_k, renormalize):
    from tokenspeed_worker.kernels.moe import route

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(experts + tokens)
    logits = torch.randn(tokens, experts, device=device, dtype=torch.bfloat16)
    weights, ids = route(logits, top_k, renormalize)
    expected_weights, expected_ids = select_experts(logits, top_k, renormalize)
    # bfloat16 logits tie often: the same probabilities in the same order, ids differing only among equals
    probs = torch.softmax(logits.float(), dim=-1)
    assert ids.dtype == torch.int32
    assert torch.equal(torch.gather(probs, 1, ids.long()), torch.gather(probs, 1, expected_ids))
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-6)
    logits = logits.float() + 1e-3 * torch.randn_like(logits, dtype=torch.float32)  # no ties: the same ids
    assert torch.equal(route(logits, top_k, renormalize)[1].long(), select_experts(logits, top_k, renormalize)[1])


def _fp8_experts(w, mode):
    """(FP8 weights [E, N, K], ExpertScales, the dequantized float weights) of float w: "channel"
    (one scale per row, spanning K) or "block" (16 x 16 tiles)."""
    from tokenspeed_worker.kernels.moe import ExpertScales

    rows, cols = (1, w.shape[2]) if mode == "channel" else (16, 16)
    e, n, k = w.shape
    tiles = w.reshape(e, n // rows, rows, k // cols, cols)
    scales = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-6) / 448.0
    q = (tiles / scales[:, :, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (q.float() * scales[:, :, None, :, None]).reshape(e, n, k)
    return q.reshape(e, n, k), ExpertScales(scales.contiguous(), rows, min(cols, k)), dequantized


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (3, 16, 4, 96, 48), (2, 16, 3, 64, 48),
                                                                (8, 8, 2, 64, 80)])
@pytest.mark.parametrize("weights_kind", ["float", "fp8-channel", "fp8-block"])
def test_decode_kernels_equal_the_loop(tokens, experts, top_k, hidden, inter, weights_kind):
    """The decode kernels (small_experts; Triton's interpreter on CPU) against the loop, with a
    foreign expert among the choices (expert parallelism: adds nothing) and FP8 weights with row
    or block scales against the loop on the dequantized weights."""
    from tokenspeed_worker.kernels.moe import GemvConfig, small_experts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, device=device)
    w13 = 0.1 * torch.randn(experts, 2 * inter, hidden, device=device)
    w2 = 0.1 * torch.randn(experts, hidden, inter, device=device)
    weights, ids = select_experts(torch.randn(tokens, experts, device=device), top_k, True)
    ids[0, -1] = experts  # another rank's expert
    scales = (None, None)
    if weights_kind != "float":
        mode = weights_kind.removeprefix("fp8-")
        w13, s13, dense13 = _fp8_experts(w13, mode)
        w2, s2, dense2 = _fp8_experts(w2, mode)
        scales = (s13, s2)
    else:
        dense13, dense2 = w13, w2
    expected = _loop(x, dense13, dense2, weights, ids)
    for config in (None, GemvConfig(16, 32, 2)):  # a K loop of several steps, in a strip within a scale block
        got = small_experts(x, w13, w2, weights, ids, *scales, gate_up_config=config, down_config=config)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_decode_kernels_hand_strips_across_scale_blocks_to_the_grouped_gemm():
    """A strip of block_n rows that would straddle two rows of block scales is refused (None), so
    fused_experts takes the grouped GEMM."""
    from tokenspeed_worker.kernels.moe import GemvConfig, small_experts

    w = torch.randn(2, 32, 32)
    q13, s13, _ = _fp8_experts(torch.randn(2, 64, 32), "block")
    q2, s2, _ = _fp8_experts(w, "block")
    weights, ids = select_experts(torch.randn(1, 2), 1, True)
    assert small_experts(torch.randn(1, 32), q13, q2, weights, ids, s13, s2,
                         gate_up_config=GemvConfig(32, 32, 4), down_config=GemvConfig(32, 32, 4)) is None


@pytest.mark.parametrize("name", [*MOE_MODELS, "fp8-block-moe"])
def test_a_model_on_the_kernels_equals_the_loop(name):
    """The whole model with the experts' kernels forced (the interpreter on CPU) gives the loop's
    logits, on CUDA too; the runner's startup check takes them, and a step with them can be captured.
    FP8 experts (fp8-block-moe) stay FP8 under the kernels, dequantized under the loop on CPU."""
    from test_fp8_kv_scales import _steps

    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.moe import FusedMoE
    from worker_harness import CACHE, _load_script, make_runner

    if name in MOE_MODELS:
        model = tiny_models()[name]
    else:
        model = _load_script("make_fp8_models").make_all(CACHE / "fp8_models", tiny_models())[name][0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expected = _steps(make_runner(model, dtype="float32", device=device, block_size=4, max_model_len=64))
    with fused_kernels("force"):
        runner = make_runner(model, dtype="float32", device=device, block_size=4, max_model_len=64)
        layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
        assert layers and all(m.use_kernels and m.supports_cuda_graphs for m in layers)
        assert all((m.w13_weight.dtype == torch.float8_e4m3fn) == (name == "fp8-block-moe") for m in layers)
        got = _steps(runner)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_decode_steps_experts_take_the_timed_path(monkeypatch):
    """A layer built with a small-batch chooser (a model runner's) asks it at a decode step's few
    pairs on CUDA: the decode kernels in their first configuration when forced, else the faster of
    the grouped GEMMs and each decode configuration, timed once per token count and reported; past
    SMALL_PAIRS the grouped GEMMs, unasked. On CPU (the interpreter) fused_experts' own rule."""
    from tokenspeed_worker.kernels import moe as moe_kernels
    from tokenspeed_worker.layers import small_batch_gemv
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.moe import FusedMoE

    device = "cuda" if torch.cuda.is_available() else "cpu"
    chooser = small_batch_gemv.SmallBatchGemv()
    with small_batch_gemv.building(chooser):
        layer = FusedMoE(8, 64, 32).to(device)
    torch.nn.init.normal_(layer.w13_weight, std=0.1)
    torch.nn.init.normal_(layer.w2_weight, std=0.1)
    calls = []
    real = moe_kernels.small_experts
    monkeypatch.setattr(moe_kernels, "small_experts", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for tokens in (2, 70):
        x = torch.randn(tokens, 64, device=device)
        weights, ids = select_experts(torch.randn(tokens, 8, device=device), 2, True)
        expected = _loop(x, layer.w13_weight, layer.w2_weight, weights, ids)
        calls.clear()
        with fused_kernels("force"):
            got = layer._experts(x, weights, ids)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert calls == ([tokens] if tokens * 2 <= moe_kernels.SMALL_PAIRS else [])
    if device == "cuda":
        x = torch.randn(2, 64, device=device)
        weights, ids = select_experts(torch.randn(2, 8, device=device), 2, True)
        with fused_kernels("auto"):
            got = layer._experts(x, weights, ids)
        torch.testing.assert_close(got, _loop(x, layer.w13_weight, layer.w2_weight, weights, ids), rtol=1e-4, atol=1e-4)
        (key, entry), = [(k, v) for k, v in chooser.report().items() if k.startswith("moe_experts/2/")]
        assert set(entry["us"]) == {"unfused", *(str(c) for c in moe_kernels.decode_configs(layer.w13_weight))}


def test_kernels_that_disagree_with_the_loop_are_refused(monkeypatch, caplog):
    from tokenspeed_worker.kernels import moe as moe_kernels
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.moe import FusedMoE

    layer = FusedMoE(4, 32, 16).to("cuda" if torch.cuda.is_available() else "cpu")
    torch.nn.init.normal_(layer.w13_weight)
    torch.nn.init.normal_(layer.w2_weight)
    real = moe_kernels.fused_experts
    monkeypatch.setattr(moe_kernels, "fused_experts", lambda *args, **kwargs: real(*args, **kwargs) * 1.5)
    with fused_kernels("force"):
        assert layer.supports_cuda_graphs
        assert not layer.kernels_agree(top_k=2)
        assert not layer.supports_cuda_graphs
    assert "disagree with the reference loop" in caplog.text


def test_tuned_tiles_are_read_back_and_taken_at_the_nearest_pair_count():
    from tokenspeed_worker.kernels.moe import GROUPED_CANDIDATES, GroupedConfig, nearest_tiles, parse_tiles, tiles_text

    for config in GROUPED_CANDIDATES:
        assert parse_tiles(tiles_text(config)) == config
    for text in ("", "64,64,64,4", "64,64,64,4,3,1", "48,64,64,4,3", "8,64,64,4,3", "256,64,64,4,3", "a,b,c,d,e",
                 "64,64,64,4,0"):
        assert parse_tiles(text) is None, text
    tuned = {32: GroupedConfig(16), 256: GroupedConfig(32), 4096: GroupedConfig(64)}
    assert nearest_tiles({}, 100) is None
    assert [nearest_tiles(tuned, p).block_m for p in (1, 32, 90, 91, 256, 1000, 1025, 100_000)] == \
        [16, 16, 16, 32, 32, 32, 64, 64]  # by ratio: 90 is nearer 32 (2.8x) than 256 (2.8x+), 1025 nearer 4096


def test_a_layer_takes_the_tiles_tuned_for_its_own_shape_and_runs_with_them(monkeypatch):
    """FusedMoE.take_tuned_tiles keeps the stored tiles of its shape (experts, hidden, intermediate on this
    rank, weight dtype) only, and a grouped step passes the nearest ones to the kernels."""
    from tokenspeed_worker.kernels import moe as kernels
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.moe import FusedMoE

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs triton on CPU only
    layer = FusedMoE(4, 32, 16).to(device)
    for param in (layer.w13_weight, layer.w2_weight):
        param.data.normal_(0, 0.1)
    mine = kernels.tiles_key(4, 32, 16, torch.float32)
    stored = {f"{mine}/64": "32,32,32,4,2", f"{mine}/1024": "64,64,64,4,3", f"{mine}/bad": "16,64,64,4,3",
              f"{mine}/512": "not tiles", f"{kernels.tiles_key(4, 32, 16, torch.bfloat16)}/64": "16,64,64,4,3",
              f"{kernels.tiles_key(8, 32, 16, torch.float32)}/64": "16,64,64,4,3"}
    assert layer.take_tuned_tiles(stored) == 2
    assert layer.tuned_tiles == {64: kernels.GroupedConfig(32, 32, 32, 4, 2), 1024: kernels.GroupedConfig(64)}
    seen = []
    real = kernels.fused_experts
    monkeypatch.setattr(kernels, "fused_experts", lambda *a, **k: seen.append(k["config"]) or real(*a, **k))
    x = torch.randn(40, 32, device=device)
    weights, ids = select_experts(torch.randn(40, 4, device=device), 2, True)
    with fused_kernels("off"):
        expected = layer._experts(x, weights, ids)
    with fused_kernels("force"):
        got = layer._experts(x, weights, ids)
    assert seen == [kernels.GroupedConfig(32, 32, 32, 4, 2)]  # 80 pairs: nearest 64
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_tuning_keeps_the_fastest_candidate_that_launches_and_agrees(monkeypatch):
    """scripts/bench_moe.py --tune's loop, on CPU (the interpreter) with a stand-in timer: a candidate that
    fails to launch or whose output differs from the default tiles' is refused, the fastest of the rest
    kept under the layer's tiles key and pair count."""
    from tokenspeed_worker.kernels import moe as kernels
    from worker_harness import _load_script

    bench = _load_script("bench_moe")
    fast, broken, wrong, slow = (kernels.GroupedConfig(32, 32, 32, 4, 2), kernels.GroupedConfig(16, 32, 32, 4, 2),
                                 kernels.GroupedConfig(64, 32, 32, 4, 2), kernels.GroupedConfig(16))
    real = kernels.fused_experts

    def fused_experts(*a, config=None, **k):
        if config == broken:
            raise RuntimeError("out of resources")
        out = real(*a, config=config, **k)
        return out * 1.5 if config == wrong else out

    monkeypatch.setattr(bench.moe, "fused_experts", fused_experts)
    costs = {fast: 3.0, slow: 5.0, wrong: 1.0}
    timing = []

    def time_us(fn):
        fn()
        timing.append(1)
        return costs[order[len(timing) - 1]]

    order = [slow, fast] * 2  # the candidates that reach the timer, in order, per pair count
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs triton on CPU only
    w13, w2 = 0.1 * torch.randn(4, 32, 32, device=device), 0.1 * torch.randn(4, 32, 16, device=device)
    entries, rows = bench.tune_tiles(w13, w2, 2, time_us, pairs_counts=(32, 64), candidates=(slow, broken, wrong, fast))
    key = kernels.tiles_key(4, 32, 16, torch.float32)
    assert entries == {f"{key}/32": "32,32,32,4,2", f"{key}/64": "32,32,32,4,2"}
    assert rows[0]["us"] == {"16,64,64,4,3": 5.0, "16,32,32,4,2": None, "64,32,32,4,2": None, "32,32,32,4,2": 3.0}
    assert [r["default"] for r in rows] == ["16,64,64,4,3", "16,64,64,4,3"] and rows[1]["default_us"] == 5.0


def test_tuning_reads_each_moe_family_shape_from_its_config(tiny_model_paths):
    from worker_harness import _load_script

    model_shape = _load_script("bench_moe").model_shape
    for name in ("qwen3-moe", "qwen2-moe", "mixtral"):
        config = json.loads((tiny_model_paths[name] / "config.json").read_text())
        experts, top_k, hidden, inter, _ = model_shape(str(tiny_model_paths[name]))
        assert (experts, top_k, hidden) == (config.get("num_experts") or config["num_local_experts"],
                                            config["num_experts_per_tok"], config["hidden_size"])
        assert inter == config.get("moe_intermediate_size", config["intermediate_size"])
    assert model_shape(str(REPO / "scripts" / "model_configs" / "qwen3-30b-a3b"))[:4] == (128, 8, 2048, 768)
