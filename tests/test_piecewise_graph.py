"""Piecewise CUDA graphs for prefill and mixed steps (model_executor/piecewise_graph.py).

On CPU the runner emulates them (ModelRunner(graph_class=EmulatedGraph)): a replay re-runs the
model's Python over the static inputs, each attention call going through the hole into the static
output buffer, on the padded plan with its dummy request. What CPU tests prove: the sizes, the
padding (the dummy request touches only the dummy block), the holes' plumbing in every model family
(an attention output read before the next attention call), the wanted/deferred captures and the
engine's use of them; greedy output and logits equal the eager runner's. The capture itself is
CUDA's: tests marked gpu compare real piecewise replays with eager steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_triton_backend import BLOCK_SIZE, Plans, random_seqs, reference_triton_backend
from tokenspeed_worker.model_executor.piecewise_graph import (
    DEFAULT_MAX_TOKENS,
    SIZE_LADDER,
    graph_memory_estimate,
    pad_plan,
    piecewise_sizes,
)
from tokenspeed_worker.scheduler.plan import SchedulePlan
from worker_harness import make_runner

NUM_BLOCKS = 96
MAX_MODEL_LEN = 128
CUDA = torch.cuda.is_available()


# -- sizes and padding ---------------------------------------------------------------------------


def test_sizes_follow_the_ladder_up_to_the_limit_and_include_it():
    assert piecewise_sizes(8192) == [s for s in SIZE_LADDER if s <= DEFAULT_MAX_TOKENS]
    assert piecewise_sizes(8192, 1000) == [s for s in SIZE_LADDER if s <= 1000] + [1000]
    # The step's token budget caps them (a larger count never happens).
    assert piecewise_sizes(300) == [s for s in SIZE_LADDER if s <= 300] + [300]
    assert piecewise_sizes(8, None) == [8]
    # Chunked prefill off (budget <= 0): the flag alone limits.
    assert piecewise_sizes(0, 64)[-1] == 64


def test_zero_turns_them_off_and_explicit_lists_are_cleaned():
    assert piecewise_sizes(8192, 0) == []
    assert piecewise_sizes(8192, 100, [64, 16, 16, 512]) == [16, 64]
    with pytest.raises(ValueError, match="piecewise_cuda_graph_tokens"):
        piecewise_sizes(8192, None, [0, 16])
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
        piecewise_sizes(8192, -1)


def test_memory_estimate_scales_the_profiled_step():
    assert graph_memory_estimate(8 << 20, 8192, 4096) == 4 << 20
    assert graph_memory_estimate(8 << 20, 1024, 4096) == 8 << 20  # never more than the profiled step
    assert graph_memory_estimate(8 << 20, 0, 4096) == 0


def _plan(query_lens, context_lens, seed=0) -> SchedulePlan:
    seqs = random_seqs([c + q for q, c in zip(query_lens, context_lens)], seed=seed)
    plans = Plans(num_blocks=NUM_BLOCKS, seed=seed)
    for seq, c in zip(seqs, context_lens):
        if c:
            plans.plan([(seq, c)])
    return plans.plan([(seq, q) for seq, q in zip(seqs, query_lens)])


def test_the_dummy_request_pads_the_step_and_touches_only_the_dummy_block():
    plan = _plan([1, 1, 7], [5, 9, 0])
    dummy = NUM_BLOCKS
    padded = pad_plan(plan, 32, dummy, BLOCK_SIZE)
    pad = 32 - plan.num_tokens
    assert padded.num_tokens == 32 and padded.num_reqs == plan.num_reqs + 1
    assert padded.query_lens[-1] == pad and padded.context_lens[-1] == 0
    # The real requests are unchanged, in order; only they sample.
    np.testing.assert_array_equal(padded.input_ids[: plan.num_tokens], plan.input_ids)
    np.testing.assert_array_equal(padded.slot_mapping[: plan.num_tokens], plan.slot_mapping)
    np.testing.assert_array_equal(padded.block_tables[: plan.num_reqs, : plan.block_tables.shape[1]],
                                  plan.block_tables)
    np.testing.assert_array_equal(padded.sample_token_index, plan.sample_token_index)
    # The dummy: token 0 at position 0, writing and reading the dummy block's slots only.
    assert (padded.input_ids[plan.num_tokens:] == 0).all() and (padded.positions[plan.num_tokens:] == 0).all()
    assert (padded.slot_mapping[plan.num_tokens:] // BLOCK_SIZE == dummy).all()
    width = -(-pad // BLOCK_SIZE)
    assert (padded.block_tables[-1, :width] == dummy).all()
    assert pad_plan(plan, plan.num_tokens, dummy, BLOCK_SIZE) is plan
    with pytest.raises(ValueError, match="cannot pad"):
        pad_plan(plan, plan.num_tokens - 1, dummy, BLOCK_SIZE)


# -- the emulated runner against the eager one --------------------------------------------------


def _runner(path, **kwargs):
    kwargs.setdefault("attention_backend", reference_triton_backend())
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("enable_piecewise_cuda_graph", True)
    kwargs.setdefault("piecewise_cuda_graph_max_tokens", 64)  # the steps here have at most 25 tokens
    runner = make_runner(str(path), dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, **kwargs)
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


def _mixed_run(runner, capture: bool = True) -> list[torch.Tensor]:
    """Prefills, prompt chunks beside decodes, a prefix-hit suffix: logits of each step (copies)."""
    if capture and runner.piecewise is not None:
        runner.capture_all_graphs()
    seqs = random_seqs([9, 14, 30, 5, 21], seed=3)
    plans = Plans(num_blocks=NUM_BLOCKS, seed=3)
    steps = [
        [(seqs[0], 9), (seqs[1], 6)],  # two prefills, one a chunk
        [(seqs[0], 1), (seqs[1], 8), (seqs[2], 12)],  # a decode, the chunk's rest, a new chunk
        [(seqs[0], 1), (seqs[1], 1), (seqs[2], 18), (seqs[3], 5)],
        [(seqs[0], 1), (seqs[1], 1), (seqs[2], 1), (seqs[3], 1), (seqs[4], 21)],
    ]
    outputs = []
    rng = np.random.default_rng(0)
    for work in steps:
        for seq, n in work:  # decodes extend their sequence by a token
            while len(seq.tokens) < seq.num_computed + n:
                seq.tokens.append(int(rng.integers(3, 500)))
        outputs.append(runner.forward(plans.plan(work)).clone())
    return outputs


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen3-qknorm", "gemma3", "gemma2", "phi3", "mistral",
                                  "qwen2-bias"])
def test_emulated_piecewise_steps_give_the_eager_logits(tiny_model_paths, name):
    path = tiny_model_paths[name]
    eager = _runner(path, enforce_eager=True)
    graphs = _runner(path, emulate_cuda_graphs=True)
    graphs.capture_cuda_graphs()
    assert graphs.piecewise is not None and graphs.piecewise.emulate
    expected, got = _mixed_run(eager), _mixed_run(graphs)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert graphs.piecewise.num_replays == len(expected) and graphs.piecewise.num_uncaptured == 0
    # Real blocks hold the same K/V; the padding wrote into the dummy block only.
    torch.testing.assert_close(graphs.kv_cache[:, :, :NUM_BLOCKS], eager.kv_cache, atol=1e-5, rtol=1e-5)


def test_a_step_past_the_largest_count_runs_eagerly(tiny_model_paths):
    graphs = _runner(tiny_model_paths["llama-gqa-tied"], emulate_cuda_graphs=True,
                     piecewise_cuda_graph_tokens=[16, 32])
    graphs.capture_cuda_graphs()
    graphs.capture_all_graphs()
    assert graphs.piecewise.sizes == [16, 32]
    graphs.forward(_plan([40], [0]))
    assert graphs.piecewise.num_replays == 0 and not graphs.piecewise.wanted
    graphs.forward(_plan([20, 3], [0, 0], seed=1))
    assert graphs.piecewise.num_replays == 1


def test_a_step_wanting_an_uncaptured_count_runs_eagerly_and_it_is_captured_next(tiny_model_paths):
    graphs = _runner(tiny_model_paths["llama-gqa-tied"], emulate_cuda_graphs=True,
                     piecewise_cuda_graph_tokens=[16, 32, 64])
    graphs.capture_cuda_graphs()
    while graphs.cuda_graphs.deferred:  # the decode sizes first, as an idle engine captures them
        graphs.capture_deferred_graph()
    assert graphs.piecewise.deferred == [16, 32, 64] and graphs.deferred_graphs and not graphs.graphs_wanted
    graphs.forward(_plan([12], [0]))
    assert graphs.piecewise.wanted == {16} and graphs.graphs_wanted and graphs.piecewise.num_uncaptured == 1
    graphs.capture_deferred_graph()  # the wanted one, before the larger ones left
    assert sorted(graphs.piecewise.captured) == [16] and not graphs.graphs_wanted
    graphs.forward(_plan([12], [0], seed=2))
    assert graphs.piecewise.num_replays == 1
    graphs.capture_all_graphs()
    assert not graphs.deferred_graphs and sorted(graphs.piecewise.captured) == [16, 32, 64]


@pytest.mark.parametrize("kwargs", [{"enforce_eager": True}, {"enable_piecewise_cuda_graph": False}],
                         ids=["enforce-eager", "not-enabled"])
def test_piecewise_graphs_off(tiny_model_paths, kwargs):
    runner = _runner(tiny_model_paths["llama-gqa-tied"], emulate_cuda_graphs=True, **kwargs)
    runner.capture_cuda_graphs()
    assert runner.piecewise is None and runner.piecewise_sizes == []


def test_the_reserve_counts_the_piecewise_buffers_and_activations(tiny_model_paths):
    on = _runner(tiny_model_paths["llama-gqa-tied"], emulate_cuda_graphs=True, piecewise_cuda_graph_tokens=[64])
    off = _runner(tiny_model_paths["llama-gqa-tied"], emulate_cuda_graphs=True, enable_piecewise_cuda_graph=False)
    row = on._attention_row_width() * 4  # float32
    assert on.cuda_graph_reserve_bytes() - off.cuda_graph_reserve_bytes() == 64 * (24 + row)
    assert on.cuda_graph_reserve_bytes(1 << 20, 128) - on.cuda_graph_reserve_bytes() == 1 << 19


def test_a_replay_that_disagrees_with_the_eager_step_turns_them_all_off(tiny_model_paths, monkeypatch, caplog):
    """The capture's check: a replay that reads a wrong attention output (here the static buffer
    zeroed after each hole) differs from the eager step, and every size is turned off: steps run
    eagerly with the eager logits, nothing is captured again."""
    from tokenspeed_worker.model_executor.piecewise_graph import PiecewiseStep

    path = tiny_model_paths["llama-gqa-tied"]
    eager = _runner(path, enforce_eager=True)
    graphs = _runner(path, emulate_cuda_graphs=True, piecewise_cuda_graph_tokens=[16, 32])
    graphs.capture_cuda_graphs()
    real = PiecewiseStep.hole
    monkeypatch.setattr(PiecewiseStep, "hole", lambda self, *args, **kwargs: real(self, *args, **kwargs).zero_())
    graphs.capture_all_graphs()
    assert graphs.piecewise.off_reason and "differs from the eager step" in caplog.text
    assert not graphs.deferred_graphs and graphs.piecewise.sizes == [] and not graphs.piecewise.captured
    for expected, got in zip(_mixed_run(eager), _mixed_run(graphs)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert graphs.piecewise.num_replays == 0 and not graphs.graphs_wanted


def test_the_triton_backend_attends_straight_into_the_static_buffer(tiny_model_paths, monkeypatch):
    """With the triton backend (attends_into) every hole's output is the static buffer itself: the
    attention writes it, no copy per layer."""
    from tokenspeed_worker.model_executor.piecewise_graph import PiecewiseStep

    graphs = _runner(tiny_model_paths["qwen3-qknorm"], emulate_cuda_graphs=True, piecewise_cuda_graph_tokens=[32])
    graphs.capture_cuda_graphs()
    graphs.capture_all_graphs()
    seen, real = [], PiecewiseStep.hole

    def hole(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        seen.append((kwargs.get("into") is not None, result.data_ptr() == self.owner._out.data_ptr()))
        return result

    monkeypatch.setattr(PiecewiseStep, "hole", hole)
    graphs.forward(_plan([9, 1, 6], [0, 4, 3]))
    assert graphs.piecewise.num_replays == 1
    assert len(seen) == graphs.num_layers and all(into and same for into, same in seen)


def test_the_check_passes_for_a_faithful_replay(tiny_model_paths):
    graphs = _runner(tiny_model_paths["qwen3-qknorm"], emulate_cuda_graphs=True, piecewise_cuda_graph_tokens=[16])
    graphs.capture_cuda_graphs()
    graphs.capture_all_graphs()
    piecewise = graphs.piecewise
    assert piecewise.off_reason is None and piecewise.check(16, piecewise.captured[16]) < 1e-6


@pytest.mark.parametrize("size", [16, 24, 32, 33, 48])
def test_the_check_step_is_new_prompts_never_a_decode_only_step(tiny_model_paths, size):
    """The check's step must run the same kernels eagerly and in the pieces: a decode-only step of
    few rows would rotate and write K/V inside the decode kernel (attend_rotary), where rows race on
    the slots they share (on the GPU its first check measured a relative error of 1.37 at 32 tokens)."""
    graphs = _runner(tiny_model_paths["llama-gqa-tied"], emulate_cuda_graphs=True, piecewise_cuda_graph_tokens=[size])
    graphs.capture_cuda_graphs()
    piecewise = graphs.piecewise
    plan = piecewise._check_plan(size)
    assert plan.num_tokens == size and plan.query_lens[0] == min(size, BLOCK_SIZE) > 1
    assert (plan.context_lens == 0).all() and (plan.block_tables == piecewise.dummy_block).all()
    np.testing.assert_array_equal(plan.slot_mapping, piecewise.dummy_block * BLOCK_SIZE + plan.positions)
    assert plan.positions.max() < BLOCK_SIZE and len(set(plan.input_ids.tolist())) > 1  # rows differ
    backend = reference_triton_backend()
    from tokenspeed_worker.layers.attention import AttentionInputs
    metadata = backend.build_metadata(AttentionInputs.of(plan, torch.device("cpu"), BLOCK_SIZE))
    assert not metadata.decode_only and not backend.fuses_rope(metadata)


def test_eagle3_states_come_back_from_a_piecewise_step(tiny_model_paths):
    path = tiny_model_paths["llama-gqa-tied"]
    eager = _runner(path, enforce_eager=True)
    graphs = _runner(path, emulate_cuda_graphs=True)
    for runner in (eager, graphs):
        runner.model.model.aux_layers = (0, 1, 1)
    graphs.capture_cuda_graphs()
    plan_e, plan_g = _plan([9, 4], [0, 0], seed=4), _plan([9, 4], [0, 0], seed=4)
    eager.forward(plan_e)
    graphs.capture_all_graphs()
    graphs.forward(plan_g)
    assert graphs.piecewise.num_replays == 1
    assert graphs.model.model.aux_hidden.shape[0] == plan_g.num_tokens
    torch.testing.assert_close(graphs.model.model.aux_hidden, eager.model.model.aux_hidden, atol=1e-5, rtol=1e-5)


# -- the real capture ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,dtype", [("llama-gqa-tied", "float32"), ("llama-gqa-tied", "bfloat16"),
                                        ("qwen3-qknorm", "bfloat16"), ("gemma3", "bfloat16"),
                                        ("qwen3-moe", "bfloat16")])
def test_piecewise_cuda_graphs_give_the_eager_logits(tiny_model_paths, name, dtype):
    from test_cuda_graph_logic import share_small_batch_gemv

    def runner(enforce_eager):
        r = make_runner(str(tiny_model_paths[name]), dtype=dtype, device="cuda", block_size=BLOCK_SIZE,
                        attention_backend="triton", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                        enforce_eager=enforce_eager, enable_piecewise_cuda_graph=True,
                        piecewise_cuda_graph_max_tokens=64)
        r.allocate_kv_cache(NUM_BLOCKS)
        r.capture_cuda_graphs()
        return r

    eager, graphs = runner(True), runner(False)
    share_small_batch_gemv(eager, graphs)
    assert graphs.piecewise is not None and not graphs.piecewise.emulate
    replayed = _mixed_run(graphs)
    atol, rtol = (1e-4, 1e-3) if dtype == "float32" else (3e-2, 3e-2)
    for expected, got in zip(_mixed_run(eager), replayed):
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    assert graphs.piecewise.num_replays == len(replayed)
    torch.testing.assert_close(graphs.kv_cache[:, :, :NUM_BLOCKS].float(), eager.kv_cache.float(), atol=atol,
                               rtol=rtol)


@pytest.mark.parametrize("overlap", ["1", "0"], ids=["overlap", "sync"])
def test_the_engine_serves_prompts_through_piecewise_steps_with_the_eager_tokens(tiny_model_paths, monkeypatch,
                                                                                  overlap):
    """Through EngineCore (emulated graphs on CPU): concurrent greedy requests of staggered prompts
    (chunked: prompt chunks beside decodes) give the tokens of an engine without graphs; the steps
    that want a token count not captured yet run eagerly and the engine captures it between steps;
    idle, it captures the rest one per call."""
    from emulated_graph import EmulatedGraph
    from test_engine_scheduling import random_tokens, request, run

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.engine_core import EngineCore
    from tokenspeed_worker.model_executor import model_runner
    from tokenspeed_worker.model_executor.model_runner import ModelRunner

    monkeypatch.setenv("TOKENSPEED_OVERLAP_SCHEDULE", overlap)
    path = tiny_model_paths["llama-gqa-tied"]

    def core(**settings):
        return EngineCore(EngineConfig.build(str(path), dtype="float32", block_size=BLOCK_SIZE, max_model_len=128,
                                             max_num_seqs=8, max_total_tokens=2048, attention_backend="torch",
                                             chunked_prefill_size=48, enable_piecewise_cuda_graph=True,
                                             piecewise_cuda_graph_tokens=[16, 32, 48],
                                             **settings))

    rng = np.random.default_rng(6)
    prompts = [random_tokens(rng, 9 + 7 * i) for i in range(6)]
    requests = [request(i + 1, p, 10) for i, p in enumerate(prompts)]
    expected, _, _ = run(core(enforce_eager=True), requests)

    def graphed_runner(cfg, **kwargs):  # what a CUDA engine runs: graphs (emulated) and a capturable backend
        return ModelRunner(cfg, attention_backend=reference_triton_backend(), graph_class=EmulatedGraph, **kwargs)

    monkeypatch.setattr(model_runner, "ModelRunner", graphed_runner)
    engine = core()
    piecewise = engine.runner.piecewise
    assert piecewise.deferred == [16, 32, 48]
    got, _, _ = run(engine, [request(i + 1, p, 10) for i, p in enumerate(prompts)])
    assert got == expected
    assert piecewise.num_uncaptured >= 1 and piecewise.num_replays > 0 and piecewise.captured
    while engine.capture_deferred_graph():
        pass
    assert not engine.runner.deferred_graphs and sorted(piecewise.captured) == [16, 32, 48]
    again, _, _ = run(engine, [request(i + 11, p, 10) for i, p in enumerate(prompts)])
    assert list(again.values()) == list(expected.values())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("overlap", ["1", "0"], ids=["overlap", "sync"])
def test_a_cuda_engine_serves_through_real_piecewise_graphs_with_the_eager_tokens(tiny_model_paths, monkeypatch,
                                                                                   overlap):
    """The engine on the GPU, real captures sharing the decode graphs' pool: piecewise counts wanted
    mid-run and captured between steps, decode sizes and the other counts captured while idle in
    between (each capture's memory reused by the next), with and without overlap; the greedy tokens
    (float32) equal an eager engine's, before and after."""
    from test_engine_scheduling import random_tokens, request, run

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.engine_core import EngineCore

    monkeypatch.setenv("TOKENSPEED_OVERLAP_SCHEDULE", overlap)
    path = tiny_model_paths["llama-gqa-tied"]

    def core(**settings):
        return EngineCore(EngineConfig.build(str(path), dtype="float32", device="cuda", block_size=BLOCK_SIZE,
                                             max_model_len=128, max_num_seqs=8, max_total_tokens=2048,
                                             attention_backend="triton", chunked_prefill_size=48,
                                             enable_piecewise_cuda_graph=True,
                                             piecewise_cuda_graph_tokens=[16, 32, 48], **settings))

    rng = np.random.default_rng(6)
    prompts = [random_tokens(rng, 9 + 7 * i) for i in range(6)]
    expected, _, _ = run(core(enforce_eager=True), [request(i + 1, p, 10) for i, p in enumerate(prompts)])
    engine = core()
    piecewise = engine.runner.piecewise
    got, _, _ = run(engine, [request(i + 1, p, 10) for i, p in enumerate(prompts)])
    assert got == expected
    assert piecewise.off_reason is None and piecewise.num_replays > 0
    while engine.capture_deferred_graph():
        pass
    assert sorted(piecewise.captured) == [16, 32, 48] and piecewise.off_reason is None
    for round_ in range(2):
        again, _, _ = run(engine, [request(100 * (round_ + 1) + i, p, 10) for i, p in enumerate(prompts)])
        assert list(again.values()) == list(expected.values())


def _graph_pool_bytes() -> int:
    """Bytes of the segments of private (graph) pools in the caching allocator."""
    return sum(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"]
               if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_counts_after_the_largest_reuse_its_pool_memory(tiny_model_paths):
    """Each count is captured on the decode graphs' stream, so it takes the pool memory the larger
    ones freed: the twelve counts below 1,024 tokens add little to the pool. (On a stream of its own,
    each count kept its activations and a cuBLAS workspace, 32 MiB on Hopper, in the pool.)"""
    r = make_runner(str(tiny_model_paths["llama-gqa-tied"]), dtype="bfloat16", device="cuda", block_size=BLOCK_SIZE,
                    attention_backend="triton", max_model_len=1024, max_num_seqs=8, enforce_eager=False,
                    enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=1024)
    r.allocate_kv_cache(NUM_BLOCKS)
    r.capture_cuda_graphs()
    while r.cuda_graphs.deferred:
        r.cuda_graphs.capture_next()
    piecewise = r.piecewise
    assert piecewise.sizes[-1] == 1024 and len(piecewise.sizes) == 13
    assert piecewise.capture_next() == 1024
    after_largest = _graph_pool_bytes()
    while piecewise.capture_next() is not None:
        pass
    assert sorted(piecewise.captured) == piecewise.sizes and piecewise.off_reason is None
    grown = _graph_pool_bytes() - after_largest
    assert grown <= 8 << 20, f"the pool grew by {grown / 2**20:.1f} MiB for the twelve smaller counts"


def test_emulated_piecewise_steps_with_the_flashinfer_backend_give_the_eager_logits(tiny_model_paths):
    """The flashinfer backend (its stand-in kernels on CPU) plans each step on the host: the piecewise
    replay's holes attend with the step's own plan, copying into the static buffer."""
    from test_flashinfer_backend import _stand_in_backend

    path = tiny_model_paths["llama-gqa-tied"]
    eager = _runner(path, enforce_eager=True, attention_backend=_stand_in_backend())
    graphs = _runner(path, emulate_cuda_graphs=True, attention_backend=_stand_in_backend())
    graphs.capture_cuda_graphs()
    assert not graphs.attention_backend.attends_into
    for expected, got in zip(_mixed_run(eager), _mixed_run(graphs)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert graphs.piecewise.num_replays == 4 and graphs.piecewise.off_reason is None
