"""CUDA graph decisions and plumbing, on CPU.

The size list, padding, dummy-block rows and eager-fallback decisions are pure functions.
The runner's graph path (static buffers, padding to a captured size, the dummy block,
logits of the real rows) runs on CPU with `emulate_cuda_graphs`, where a replay re-runs
the captured step on the same static buffers and metadata; it must give the eager
logits. The `gpu` tests capture real CUDA graphs and assert the same.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from test_triton_backend import BLOCK_SIZE, Plans, random_seqs, reference_triton_backend
from tokenspeed_worker.model_executor.cuda_graph import (
    BATCH_TOO_LARGE,
    NOT_CAPTURED,
    PREFILL_STEP,
    TABLE_TOO_WIDE,
    ROW_BYTES,
    StepInputs,
    capture_sizes,
    decode_graph_size,
    graph_reserve_bytes,
    max_table_width,
    fill_decode_inputs,
    packed_input_bytes,
    padded_batch_size,
    static_buffer_bytes,
    step_input_views,
)
from tokenspeed_worker.model_executor.model_runner import ModelRunner
from worker_harness import make_runner

NUM_BLOCKS = 64
MAX_MODEL_LEN = 64
CUDA = torch.cuda.is_available()


# -- sizes -----------------------------------------------------------------------------------


def test_default_sizes_are_powers_of_two_then_multiples_of_eight_up_to_256():
    sizes = capture_sizes(max_num_seqs=512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert len(sizes) == 4 + 31


def test_sizes_stop_at_max_num_seqs_and_include_it():
    assert capture_sizes(max_num_seqs=100)[-3:] == [88, 96, 100]
    assert capture_sizes(max_num_seqs=3) == [1, 2, 3]
    assert capture_sizes(max_num_seqs=1) == [1]
    assert capture_sizes(max_num_seqs=256, max_capture_size=64)[-1] == 64
    assert capture_sizes(max_num_seqs=256, max_capture_size=20) == [1, 2, 4, 8, 16, 20]


def test_explicit_sizes_are_sorted_deduplicated_and_capped():
    assert capture_sizes(64, explicit=[8, 1, 8, 3, 500]) == [1, 3, 8]
    assert capture_sizes(512, explicit=[8, 1, 300], max_capture_size=128) == [1, 8]
    assert capture_sizes(4, explicit=[]) == []
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(64, explicit=[0, 4])
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(64, max_capture_size=0)


def test_batch_pads_to_the_next_captured_size():
    sizes = capture_sizes(256)
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 24, 25, 256)] == [
        1, 2, 4, 8, 8, 16, 24, 24, 32, 256
    ]
    assert padded_batch_size(257, sizes) is None
    assert padded_batch_size(1, []) is None


# -- when a step replays a graph ---------------------------------------------------------------


def test_graph_decisions():
    sizes = [1, 2, 4, 8]
    ones = np.ones
    assert decode_graph_size(ones(3, np.int32), 5, sizes, 16) == (4, None)
    assert decode_graph_size(ones(8, np.int32), 16, sizes, 16) == (8, None)
    assert decode_graph_size(np.array([1, 5, 1], np.int32), 5, sizes, 16) == (None, PREFILL_STEP)
    assert decode_graph_size(np.array([7], np.int32), 5, sizes, 16) == (None, PREFILL_STEP)
    assert decode_graph_size(np.zeros(0, np.int32), 1, sizes, 16) == (None, PREFILL_STEP)
    assert decode_graph_size(ones(9, np.int32), 5, sizes, 16) == (None, BATCH_TOO_LARGE)
    assert decode_graph_size(ones(3, np.int32), 17, sizes, 16) == (None, TABLE_TOO_WIDE)
    assert decode_graph_size(ones(3, np.int32), 5, [], 16) == (None, NOT_CAPTURED)


def pad_decode_inputs(plan, size: int, dummy_block: int, block_size: int) -> StepInputs:
    """The plan's B rows, then size - B dummy rows (fill_decode_inputs), in fresh host arrays."""
    width = max(1, plan.block_tables.shape[1])
    inputs = StepInputs(np.zeros(size, np.int64), np.zeros(size, np.int64), np.zeros(size, np.int64),
                        np.ones(size, np.int32), np.zeros((size, width), np.int32))
    fill_decode_inputs(plan, inputs, dummy_block, block_size)
    return inputs


def test_padded_rows_write_to_and_read_only_the_dummy_block():
    seqs = random_seqs([9, 14, 3])
    plans = Plans(num_blocks=NUM_BLOCKS)
    plans.plan([(s, len(s.tokens) - 1) for s in seqs])
    plan = plans.plan([(s, 1) for s in seqs])
    dummy = NUM_BLOCKS
    padded = pad_decode_inputs(plan, 8, dummy, BLOCK_SIZE)
    assert padded.input_ids[:3].tolist() == plan.input_ids.tolist()
    assert padded.positions[:3].tolist() == plan.positions.tolist()
    assert padded.slot_mapping[:3].tolist() == plan.slot_mapping.tolist()
    assert padded.seq_lens[:3].tolist() == [9, 14, 3]
    assert (padded.block_tables[:3] == plan.block_tables).all()
    assert padded.slot_mapping[3:].tolist() == [dummy * BLOCK_SIZE] * 5
    assert padded.seq_lens[3:].tolist() == [1] * 5
    assert padded.positions[3:].tolist() == [0] * 5 and padded.input_ids[3:].tolist() == [0] * 5
    assert (padded.block_tables[3:, 0] == dummy).all()
    assert padded.seq_lens.dtype == np.int32 and padded.block_tables.dtype == np.int32
    assert padded.slot_mapping.dtype == np.int64
    with pytest.raises(ValueError):
        pad_decode_inputs(plan, 2, dummy, BLOCK_SIZE)


def test_each_size_lays_its_inputs_out_from_byte_zero():
    # One packed buffer: ids, positions, slots (int64), lengths (int32), padding, then the table.
    width = 5
    buffer = torch.zeros(packed_input_bytes(8, width), dtype=torch.uint8)
    for size in (1, 3, 8):
        views = step_input_views(buffer, size, width)
        base = buffer.data_ptr()
        assert views.input_ids.data_ptr() == base and views.input_ids.dtype == torch.int64
        assert views.positions.data_ptr() == base + 8 * size and views.positions.shape == (size,)
        assert views.slot_mapping.data_ptr() == base + 16 * size
        assert views.seq_lens.data_ptr() == base + 24 * size and views.seq_lens.dtype == torch.int32
        assert views.block_tables.data_ptr() == base + ROW_BYTES * size
        assert views.block_tables.shape == (size, width) and views.block_tables.stride() == (width, 1)
    views = step_input_views(buffer, 8, width)
    views.block_tables[7, width - 1] = 11  # the last byte a size-8 step owns
    assert int(buffer[-4:].view(torch.int32)) == 11


def test_graph_reserve_counts_the_static_buffers():
    static = static_buffer_bytes(256, 8192, 128256, 2)
    assert static > 256 * 128256 * 2
    assert graph_reserve_bytes(256, 8192, 128256, 2) == static + (1 << 30)


# -- the runner's graph path, emulated on CPU ----------------------------------------------------


def share_small_batch_gemv(runner: ModelRunner, source: ModelRunner) -> None:
    """Let runner's projections consult source's small-batch GEMV choices (layers/small_batch_gemv.py):
    two runners of one test then differ only in what the test compares, not in kernel choices each
    timed on its own."""
    from tokenspeed_worker.layers.linear import Linear

    runner.small_batch_gemv = source.small_batch_gemv
    for module in runner.model.modules():
        if isinstance(module, Linear):
            module.gemv = source.small_batch_gemv


def _runner(path, **kwargs) -> ModelRunner:
    """The decode graphs alone (tests/test_piecewise_graph.py covers the piecewise ones)."""
    kwargs.setdefault("attention_backend", reference_triton_backend())
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("enable_piecewise_cuda_graph", False)
    runner = make_runner(str(path), dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, **kwargs)
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


@pytest.fixture(scope="module")
def llama_path(tiny_model_paths):
    return tiny_model_paths["llama-gqa-tied"]


def _decode_run(runner: ModelRunner, batch_sizes: list[int], seed: int = 0, sample_subset: bool = False,
                greedy: list | None = None):
    """Prefill len(batch_sizes) steps' worth of sequences, then decode steps of the given batch sizes
    (each decode step's runner.greedy_tokens, copied, appended to `greedy` when given)."""
    num_seqs = max(batch_sizes)
    seqs = random_seqs([int(n) for n in np.random.default_rng(seed).integers(3, 20, size=num_seqs)], seed=seed)
    plans = Plans(num_blocks=NUM_BLOCKS, seed=seed)
    # Logits may be a view of the graphs' static buffer, valid until the next forward: keep copies.
    outputs = [runner.forward(plans.plan([(s, len(s.tokens)) for s in seqs])).clone()]
    for step, batch in enumerate(batch_sizes):
        work = [(s, 1) for s in seqs[:batch]]
        for seq, _ in work:
            seq.tokens.append(int(np.random.default_rng(step).integers(3, 500)))
        plan = plans.plan(work)
        if sample_subset:
            plan.sample_rows = np.arange(plan.num_reqs, dtype=np.int32)[::-2].copy()
        outputs.append(runner.forward(plan).clone())
        if greedy is not None:
            greedy.append(None if runner.greedy_tokens is None else runner.greedy_tokens.clone())
    return outputs


@pytest.mark.parametrize("one_copy_table_bytes", [None, 0], ids=["one copy", "table apart"])
def test_emulated_graphs_give_the_eager_logits(llama_path, monkeypatch, one_copy_table_bytes):
    # The step's inputs reach the packed buffer in one copy, or (a wide table) with the table apart.
    from tokenspeed_worker.model_executor import cuda_graph

    if one_copy_table_bytes is not None:
        monkeypatch.setattr(cuda_graph, "ONE_COPY_TABLE_BYTES", one_copy_table_bytes)
    eager = _runner(llama_path, enforce_eager=True)
    graphs = _runner(llama_path, emulate_cuda_graphs=True)
    assert eager.kv_cache.shape[2] == NUM_BLOCKS and eager.dummy_block is None
    assert graphs.kv_cache.shape[2] == NUM_BLOCKS + 1 and graphs.dummy_block == NUM_BLOCKS
    graphs.capture_cuda_graphs()
    assert sorted(graphs.cuda_graphs.graphs) == [1, 2, 4, 8]
    batch_sizes = [3, 5, 8, 1, 2, 7, 6]
    for expected, got in zip(_decode_run(eager, batch_sizes), _decode_run(graphs, batch_sizes)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert graphs.cuda_graphs.num_replays == len(batch_sizes)
    assert graphs.cuda_graphs.num_eager_decodes == 0
    # Real blocks hold the same K/V; padded rows wrote only into the dummy block.
    torch.testing.assert_close(graphs.kv_cache[:, :, :NUM_BLOCKS], eager.kv_cache, atol=1e-5, rtol=1e-5)
    assert graphs.kv_cache[:, :, NUM_BLOCKS].abs().sum() > 0


def test_emulated_graphs_return_sampling_rows_in_order(llama_path):
    eager = _runner(llama_path, enforce_eager=True)
    graphs = _runner(llama_path, emulate_cuda_graphs=True)
    graphs.capture_cuda_graphs()
    for expected, got in zip(
        _decode_run(eager, [5, 3], sample_subset=True), _decode_run(graphs, [5, 3], sample_subset=True)
    ):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert graphs.cuda_graphs.num_replays == 2


def test_replayed_logits_are_the_static_buffer_and_a_subset_is_a_copy(llama_path):
    # Leading rows come back as a view of the static float32 logits (no copy per step; the
    # sampler reads it before the next replay, in stream order); other rows as a gathered copy.
    runner = _runner(llama_path, emulate_cuda_graphs=True)
    runner.capture_cuda_graphs()
    seqs = random_seqs([5, 6])
    plans = Plans(num_blocks=NUM_BLOCKS)
    runner.forward(plans.plan([(s, len(s.tokens) - 2) for s in seqs]))
    first = runner.forward(plans.plan([(s, 1) for s in seqs]))
    assert first.dtype == torch.float32
    assert first.data_ptr() == runner.cuda_graphs.logits.data_ptr()
    for s in seqs:
        s.tokens.extend([7, 8])
    plan = plans.plan([(s, 1) for s in seqs])
    plan.sample_rows = np.array([1], dtype=np.int32)
    subset = runner.forward(plan)
    kept = subset.clone()
    runner.forward(plans.plan([(s, 1) for s in seqs]))
    assert torch.equal(subset, kept)


def test_replay_takes_the_greedy_tokens_into_last_sampled(llama_path):
    # Each replay writes its rows' argmax into the runner's last_sampled; forward exposes them as
    # greedy_tokens when the sampling rows are the leading rows, else (a subset, an eager step) None.
    runner = _runner(llama_path, emulate_cuda_graphs=True)
    runner.capture_cuda_graphs()
    seqs = random_seqs([5, 6, 9])
    plans = Plans(num_blocks=NUM_BLOCKS)
    runner.forward(plans.plan([(s, len(s.tokens) - 2) for s in seqs]))
    assert runner.greedy_tokens is None  # a prefill step runs eagerly
    logits = runner.forward(plans.plan([(s, 1) for s in seqs]))
    greedy = runner.greedy_tokens
    assert greedy is not None and greedy.data_ptr() == runner.last_sampled.data_ptr()
    assert greedy.tolist() == logits.argmax(dim=-1).tolist()
    runner.record_sampled(greedy)  # already there: no copy, nothing changes
    assert runner.last_sampled[:3].tolist() == logits.argmax(dim=-1).tolist()
    for s in seqs:
        s.tokens.extend([7, 8])
    plan = plans.plan([(s, 1) for s in seqs])
    plan.sample_rows = np.array([2, 0], dtype=np.int32)
    runner.forward(plan)
    assert runner.greedy_tokens is None
    # Tokens the sampler drew (not the argmax) replace the graph's in last_sampled.
    runner.record_sampled(torch.tensor([4, 3]))
    assert runner.last_sampled[:2].tolist() == [4, 3]


def test_larger_batches_run_eagerly_and_say_so_once(llama_path, caplog):
    runner = _runner(llama_path, emulate_cuda_graphs=True, cudagraph_capture_sizes=[1, 2])
    runner.capture_cuda_graphs()
    eager = _runner(llama_path, enforce_eager=True)
    with caplog.at_level(logging.INFO, logger="tokenspeed_worker"):
        got = _decode_run(runner, [3, 4, 2])
    for expected, logits in zip(_decode_run(eager, [3, 4, 2]), got):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert runner.cuda_graphs.num_eager_decodes == 2 and runner.cuda_graphs.num_replays == 1
    messages = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(messages) == 1 and BATCH_TOO_LARGE in messages[0]  # once, and not for the prefill step


def test_wider_block_table_runs_eagerly(llama_path, caplog):
    runner = _runner(llama_path, emulate_cuda_graphs=True)
    runner.capture_cuda_graphs()
    seqs = random_seqs([MAX_MODEL_LEN + 3])  # longer than max_model_len: wider than the static table
    plans = Plans(num_blocks=NUM_BLOCKS)
    runner.forward(plans.plan([(seqs[0], MAX_MODEL_LEN + 2)]))
    with caplog.at_level(logging.WARNING, logger="tokenspeed_worker"):
        runner.forward(plans.plan([(seqs[0], 1)]))
    assert runner.cuda_graphs.num_eager_decodes == 1
    assert any(TABLE_TOO_WIDE in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(enforce_eager=True, emulate_cuda_graphs=True), "--enforce-eager"),
        (dict(), "device is cpu"),
        (dict(attention_backend="torch", emulate_cuda_graphs=True), "cannot be captured"),
        (dict(emulate_cuda_graphs=True, cudagraph_capture_sizes=[64]), "no capture sizes"),
    ],
)
def test_graphs_off_says_why(llama_path, caplog, kwargs, reason):
    runner = _runner(llama_path, **kwargs)
    assert not runner.use_cuda_graphs and reason in runner.cuda_graphs_off_reason
    assert runner.dummy_block is None and runner.kv_cache.shape[2] == NUM_BLOCKS
    assert runner.cuda_graph_reserve_bytes() == 0
    with caplog.at_level(logging.INFO, logger="tokenspeed_worker"):
        runner.capture_cuda_graphs()
    assert runner.cuda_graphs is None
    assert any("CUDA graphs off" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_capture_needs_the_kv_cache_and_freezes_it(llama_path):
    runner = make_runner(
        str(llama_path), block_size=BLOCK_SIZE, max_num_seqs=4, emulate_cuda_graphs=True,
        attention_backend=reference_triton_backend(),
    )
    with pytest.raises(RuntimeError, match="KV cache"):
        runner.capture_cuda_graphs()
    runner.allocate_kv_cache(16)
    runner.capture_cuda_graphs()
    assert runner.cuda_graph_reserve_bytes() > 0
    with pytest.raises(RuntimeError, match="after CUDA graphs"):
        runner.allocate_kv_cache(32)


def test_tuned_decode_choices_reach_each_captured_graph(llama_path, monkeypatch):
    # ModelRunner.tune_attention runs the backend's tune_decode over the capture sizes with the
    # static table's longest context, before capture; each graph's metadata carries its size's value.
    backend = reference_triton_backend()
    seen = {}

    def tune_decode(k_cache, v_cache, dtype, batch_sizes, max_seq_len, timer=None):
        seen.update(sizes=list(batch_sizes), max_seq_len=max_seq_len, layer0=k_cache.data_ptr())
        backend.single_split_tokens = {size: 128 * size for size in batch_sizes}
        return dict(backend.single_split_tokens)

    monkeypatch.setattr(backend, "tune_decode", tune_decode)
    runner = _runner(llama_path, emulate_cuda_graphs=True, attention_backend=backend)
    assert runner.tune_attention() == {size: 128 * size for size in runner.cudagraph_sizes}
    assert seen == dict(sizes=runner.cudagraph_sizes, layer0=runner.kv_cache[0, 0].data_ptr(),
                        max_seq_len=max_table_width(MAX_MODEL_LEN, BLOCK_SIZE) * BLOCK_SIZE)
    runner.capture_cuda_graphs()
    assert {size: m.single_split_tokens for size, m in runner.cuda_graphs.metadata.items()} == {
        size: 128 * size for size in runner.cudagraph_sizes}
    eager = _runner(llama_path, enforce_eager=True, attention_backend=backend)
    eager.tune_attention()
    assert seen["sizes"] == [1, 2, 4, 8]  # without graphs: powers of two up to max_num_seqs (8)


def test_decode_attention_thresholds_are_kept_for_the_next_start(llama_path, monkeypatch, tmp_path):
    """A start times the decode attention's thresholds and keeps them in the cache dir's
    decode_attention.json; the next start of the same shape takes them untimed; a start that
    captures a size not kept, or finds a value the backend would not choose, times them all again."""
    from tokenspeed_worker import kernel_cache

    backend = reference_triton_backend()
    backend.uses_reference = False  # the reference kernels time nothing; this stand-in does
    timed = []

    def tune_decode(k_cache, v_cache, dtype, batch_sizes, max_seq_len, timer=None):
        timed.append(list(batch_sizes))
        backend.single_split_tokens = {size: 256 if size < 4 else 0 for size in batch_sizes}
        return dict(backend.single_split_tokens)

    monkeypatch.setattr(backend, "tune_decode", tune_decode)
    monkeypatch.setattr(kernel_cache, "choices_path", lambda cache_dir, device, name=kernel_cache.CHOICES_FILE:
                        None if cache_dir is None else Path(cache_dir) / "gpu" / name)

    def start(cache_dir=str(tmp_path), **kwargs):
        runner = _runner(llama_path, emulate_cuda_graphs=True, attention_backend=backend, cache_dir=cache_dir,
                         **kwargs)
        backend.single_split_tokens = {}
        return runner.tune_attention()

    expected = {1: 256, 2: 256, 4: 0, 8: 0}
    assert start() == expected and timed == [[1, 2, 4, 8]]
    path = tmp_path / "gpu" / kernel_cache.ATTENTION_FILE
    stored = json.loads(path.read_text())
    assert sorted(stored.values()) == ["0", "0", "256", "256"]
    assert start() == expected and len(timed) == 1  # the second start: taken, untimed
    assert backend.single_split_tokens == expected
    assert start(max_num_seqs=16)[16] == 0 and timed[-1] == [1, 2, 4, 8, 16]  # a size not kept: all timed
    key = next(k for k in stored if k.endswith("/1"))
    path.write_text(json.dumps({**stored, key: "300"}))  # not a threshold the backend times
    assert start() == expected and len(timed) == 3
    assert start(cache_dir=None) == expected and len(timed) == 4  # no cache dir: always timed


def test_failed_decode_timing_leaves_the_split_path(llama_path, monkeypatch, caplog):
    backend = reference_triton_backend()

    def tune_decode(*args, **kwargs):  # the backend's contract: a failed timing leaves no choice
        backend.single_split_tokens = {}
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(backend, "tune_decode", tune_decode)
    runner = _runner(llama_path, emulate_cuda_graphs=True, attention_backend=backend)
    with caplog.at_level(logging.WARNING):
        assert runner.tune_attention() == {}
    assert backend.single_split_tokens == {} and "decode attention timing failed" in caplog.text


def test_step_tuning_runs_on_one_gpu_only(monkeypatch):
    from tokenspeed_worker import distributed
    from tokenspeed_worker.layers.small_batch_gemv import SmallBatchGemv
    from tokenspeed_worker.model_executor.model_runner import step_tuner

    gemv = SmallBatchGemv()
    assert step_tuner(gemv, torch.device("cuda", 0)) == gemv.tune_in_step  # a bound method: == not is
    assert step_tuner(gemv, torch.device("cpu")) is None
    monkeypatch.setattr(distributed, "size", lambda: 2)  # tensor parallelism: timed steps all-reduce
    assert step_tuner(gemv, torch.device("cuda", 0)) is None


def test_engine_passes_graph_config_to_the_runner(llama_path):
    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.engine_core import EngineCore

    core = EngineCore(EngineConfig.build(
        str(llama_path), dtype="float32", block_size=BLOCK_SIZE, max_model_len=128, max_num_seqs=16,
        max_total_tokens=512, attention_backend="auto", enforce_eager=True, cudagraph_capture_sizes=[1, 4],
    ))
    runner = core.runner
    assert runner.attention_backend.name == "torch"  # auto on CPU
    assert runner.max_model_len == 128 and runner.cudagraph_sizes == [1, 4]
    assert runner.cuda_graphs_off_reason == "--enforce-eager" and core.num_blocks == 512 // BLOCK_SIZE


# -- GPU: real CUDA graphs -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_logits(llama_path, dtype, monkeypatch):
    # bfloat16 also sends the block table in a copy of its own (the wide-table path).
    from tokenspeed_worker.model_executor import cuda_graph

    if dtype == "bfloat16":
        monkeypatch.setattr(cuda_graph, "ONE_COPY_TABLE_BYTES", 0)

    def runner(enforce_eager):
        r = make_runner(
            str(llama_path), dtype=dtype, device="cuda", block_size=BLOCK_SIZE, attention_backend="triton",
            max_model_len=MAX_MODEL_LEN, max_num_seqs=8, enforce_eager=enforce_eager,
        )
        r.allocate_kv_cache(NUM_BLOCKS)
        r.capture_cuda_graphs()
        return r

    eager, graphs = runner(True), runner(False)
    share_small_batch_gemv(eager, graphs)
    assert graphs.cuda_graphs is not None and sorted(graphs.cuda_graphs.graphs) == [1, 2, 4, 8]
    batch_sizes = [3, 5, 8, 1, 2, 7, 6]
    atol = 1e-4 if dtype == "float32" else 3e-2
    greedy = []
    replayed = _decode_run(graphs, batch_sizes, greedy=greedy)
    for expected, got in zip(_decode_run(eager, batch_sizes), replayed):
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-3 if dtype == "float32" else 3e-2)
    # The graph's in-graph argmax (Triton) is torch's argmax of the logits it returned.
    assert len(greedy) == len(batch_sizes)
    assert all(tokens.tolist() == logits.argmax(dim=-1).tolist() for tokens, logits in zip(greedy, replayed[1:]))
    assert graphs.cuda_graphs.num_replays == len(batch_sizes) and graphs.cuda_graphs.num_eager_decodes == 0
    torch.testing.assert_close(
        graphs.kv_cache[:, :, :NUM_BLOCKS].float(), eager.kv_cache.float(), atol=atol,
        rtol=1e-3 if dtype == "float32" else 3e-2,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_each_graph_is_tuned_in_step_before_its_capture(llama_path, monkeypatch):
    # The runner hands its SmallBatchGemv's tune_in_step a timer of each size's whole step, after the
    # warm-up step and before the capture; the timer captures and replays a graph of its own.
    from tokenspeed_worker.layers.small_batch_gemv import SmallBatchGemv

    calls = []

    def tuner(size, step_us):
        calls.append((size, step_us(), step_us()))
        return {"before_us": 2.0, "after_us": 1.0, "changed": {f"site/{size}": ["a", "b"]}}

    monkeypatch.setattr(SmallBatchGemv, "tune_in_step", lambda self, size, step_us: tuner(size, step_us))
    runner = make_runner(
        str(llama_path), dtype="bfloat16", device="cuda", block_size=BLOCK_SIZE, attention_backend="triton",
        max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
    )
    runner.allocate_kv_cache(NUM_BLOCKS)
    runner.capture_cuda_graphs()
    assert [size for size, *_ in calls] == [8, 4, 2, 1]  # largest first, as captured
    assert all(us > 0 for _, *times in calls for us in times)
    assert sorted(runner.cuda_graphs.tuning) == [1, 2, 4, 8]
    assert runner.cuda_graphs.timed_steps == 8 and runner.cuda_graphs.tuning[1]["timed_steps"] == 2
    graphs = runner.cuda_graphs  # the static buffers hold dummy rows again for the capture
    inputs = graphs.inputs[1]
    assert bool((inputs.seq_lens == 1).all()) and bool((inputs.block_tables[:, 0] == runner.dummy_block).all())


# -- speculative verify steps through the decode graphs ------------------------------------------


def test_verify_steps_replay_the_decode_graphs_as_one_row_per_token(llama_path):
    """A verify step (each row's last token and its draft) replays the decode graphs flattened to one
    row per token, with the decode kernel's own rotary off: the same logits as the eager extend
    path, at every drafted position; a step with a prefill row still runs eagerly."""
    from tokenspeed_worker.model_executor.model_runner import flatten_verify

    eager = _runner(llama_path, enforce_eager=True, speculative_algorithm="NGRAM")
    graphs = _runner(llama_path, emulate_cuda_graphs=True, speculative_algorithm="NGRAM")
    assert graphs.attention_backend.fuse_rope_max_rows == 0
    graphs.capture_cuda_graphs()
    outputs = []
    for runner in (eager, graphs):
        seqs = random_seqs([9, 14, 5], seed=3)
        plans = Plans(num_blocks=NUM_BLOCKS, seed=3)
        runner.forward(plans.plan([(s, len(s.tokens)) for s in seqs]))
        drafts = [3, 0, 2]
        for seq, d in zip(seqs, drafts):
            seq.tokens.extend(np.random.default_rng(d).integers(3, 500, 1 + d).tolist())
        plan = plans.plan([(s, 1 + d) for s, d in zip(seqs, drafts)])
        plan.draft_lens = np.asarray(drafts, dtype=np.int32)
        assert flatten_verify(plan) is not None
        outputs.append(runner.forward(plan).clone())
        if runner is graphs:
            assert runner.cuda_graphs.num_replays == 1 and runner.greedy_tokens is not None
            torch.testing.assert_close(runner.greedy_tokens, outputs[-1].argmax(-1))
    assert outputs[0].shape[0] == 4 + 1 + 3
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


def test_the_graph_a_batch_1_verify_step_replays_is_refined_in_step_too(llama_path):
    """With speculation, the runner has its small-batch chooser refine in-step the sites of the graph a
    batch-1 verify step (1 + num_speculative_tokens rows) replays, besides batch 1; without, batch 1 only."""
    from tokenspeed_worker.layers.small_batch_gemv import IN_STEP_TOP, IN_STEP_VERIFY_TOP

    plain = _runner(llama_path, emulate_cuda_graphs=True)
    assert plain.small_batch_gemv.in_step_tops == {1: IN_STEP_TOP}
    for drafts, size in ((4, 8), (1, 2), (8, 16)):  # graphs of 1, 2, 4, 8, 16 rows at max_num_seqs 16
        runner = _runner(llama_path, emulate_cuda_graphs=True, speculative_algorithm="NGRAM",
                         num_speculative_tokens=drafts, max_num_seqs=16)
        assert runner.small_batch_gemv.in_step_tops == {1: IN_STEP_TOP, size: IN_STEP_VERIFY_TOP}
        assert size in runner.first_capture_sizes  # captured before serving, like batch 1's


def test_flatten_verify_refuses_steps_that_are_not_only_verify_rows():
    from tokenspeed_worker.model_executor.model_runner import flatten_verify
    from tokenspeed_worker.scheduler.plan import SchedulePlan

    def plan(context_lens, query_lens, draft_lens, sample_rows=None):
        n = int(sum(query_lens))
        return SchedulePlan(np.arange(len(query_lens)), np.asarray(query_lens, np.int32),
                            np.asarray(context_lens, np.int32), np.arange(n), np.arange(n), np.arange(n),
                            np.zeros((len(query_lens), 2), np.int32),
                            np.arange(len(query_lens), dtype=np.int32) if sample_rows is None else sample_rows,
                            np.asarray(draft_lens, np.int32))

    flat = flatten_verify(plan([5, 7], [3, 1], [2, 0]))
    assert flat.query_lens.tolist() == [1, 1, 1, 1] and flat.context_lens.tolist() == [5, 6, 7, 7]
    assert flat.req_ids.tolist() == [0, 0, 0, 1] and flat.sample_rows.tolist() == [0, 1, 2, 3]
    assert flatten_verify(plan([0, 7], [3, 1], [0, 0])) is None  # a prefill
    assert flatten_verify(plan([5, 7], [4, 1], [2, 0])) is None  # a chunk, not a draft
    assert flatten_verify(plan([5, 7], [3, 1], [2, 0], np.array([0], np.int32))) is None


def test_decode_graphs_hand_eagle3_the_states_the_model_kept(llama_path):
    """With EAGLE3, every forward keeps the residual streams entering three layers; a decode graph's
    replay copies them into a static buffer and hands the replayed rows back as the model's
    aux_hidden, equal to the eager forward's."""
    eager_e3 = _runner(llama_path, enforce_eager=True, speculative_algorithm="EAGLE3", draft_model_path="/unused")
    graphs = _runner(llama_path, emulate_cuda_graphs=True, speculative_algorithm="EAGLE3", draft_model_path="/unused")
    assert graphs.model.model.aux_layers == (0, 1, 2)  # 2, L/2, L-3 of 3 layers, clamped
    graphs.capture_cuda_graphs()
    states = []
    for runner in (eager_e3, graphs):
        seqs = random_seqs([9, 14, 5], seed=4)
        plans = Plans(num_blocks=NUM_BLOCKS, seed=4)
        runner.forward(plans.plan([(s, len(s.tokens)) for s in seqs]))
        for s in seqs:
            s.tokens.append(7)
        runner.forward(plans.plan([(s, 1) for s in seqs]))
        states.append(runner.model.model.aux_hidden.clone())
    assert graphs.cuda_graphs.num_replays == 1 and states[1].shape == (3, 3 * 64)
    torch.testing.assert_close(states[1], states[0], atol=1e-5, rtol=1e-5)


# -- decode graphs captured after startup ------------------------------------------------------------


def test_the_first_capture_holds_the_few_row_sizes_the_largest_and_the_verify_size():
    from tokenspeed_worker.model_executor.model_runner import first_capture_sizes

    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert first_capture_sizes(sizes, None, 1) == [1, 2, 4, 8, 64]
    assert first_capture_sizes(sizes, 16, 1) == [1, 2, 4, 8, 16, 64]  # a batch-1 verify step of 9-16 rows
    assert first_capture_sizes(sizes, None, 2) == sizes  # tensor parallel: every rank captures all first
    assert first_capture_sizes([1, 2, 4], None, 1) == [1, 2, 4] and first_capture_sizes([], None, 1) == []


def test_a_size_left_for_later_runs_eagerly_until_captured_with_the_eager_logits(llama_path, caplog):
    """Sizes past the first capture: a decode step that would replay one runs eagerly (wanted), the
    next capture takes it (wanted first), and from then on it replays, all with the eager logits.
    The log says so in the lines the benchmarks wait on (Worker.wait_graphs_captured)."""
    from worker_harness import GRAPHS_DONE_LINE, GRAPHS_LEFT_LINE

    caplog.set_level(logging.INFO, logger="tokenspeed_worker")
    eager = _runner(llama_path, enforce_eager=True, max_num_seqs=16)
    graphs = _runner(llama_path, emulate_cuda_graphs=True, max_num_seqs=16, cudagraph_capture_sizes=[1, 2, 4, 8, 12, 16])
    graphs.capture_cuda_graphs()
    assert GRAPHS_LEFT_LINE in caplog.text and GRAPHS_DONE_LINE not in caplog.text
    cg = graphs.cuda_graphs
    assert sorted(cg.graphs) == [1, 2, 4, 8, 16] and cg.deferred == [12] and graphs.deferred_graphs
    first = _decode_run(graphs, [10, 3])  # 10 rows: the 12-row graph, not captured yet
    for expected, got in zip(_decode_run(eager, [10, 3]), first):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cg.num_uncaptured_decodes == 1 and cg.wanted == {12} and graphs.graphs_wanted
    assert cg.num_replays == 1 and cg.num_eager_decodes == 0  # the 3-row step replayed; no warning counted
    graphs.capture_deferred_graph()
    assert cg.deferred == [] and cg.wanted == set() and not graphs.deferred_graphs and not graphs.graphs_wanted
    assert GRAPHS_DONE_LINE in caplog.text
    for expected, got in zip(_decode_run(eager, [11, 9], seed=1), _decode_run(graphs, [11, 9], seed=1)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cg.num_replays == 3 and cg.num_uncaptured_decodes == 1
    graphs.capture_deferred_graph()  # nothing left: nothing happens
    assert sorted(cg.graphs) == [1, 2, 4, 8, 12, 16]


@pytest.mark.parametrize("overlap", ["1", "0"], ids=["overlap", "sync"])
def test_the_engine_captures_a_wanted_size_between_steps_and_the_rest_when_idle(llama_path, monkeypatch, overlap):
    """Through EngineCore (emulated graphs on CPU): ten concurrent greedy requests decode at 10 rows,
    whose graph the startup left; the first such step runs eagerly, the engine then completes the step
    in flight and captures it, and every token equals an engine without graphs. Idle, the engine
    captures what is left one size per call."""
    from emulated_graph import EmulatedGraph
    from test_engine_scheduling import random_tokens, request, run

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.engine_core import EngineCore
    from tokenspeed_worker.model_executor import model_runner

    monkeypatch.setenv("TOKENSPEED_OVERLAP_SCHEDULE", overlap)

    def core(**settings):
        return EngineCore(EngineConfig.build(str(llama_path), dtype="float32", block_size=BLOCK_SIZE, max_model_len=128,
                                             max_num_seqs=16, max_total_tokens=2048, attention_backend="torch",
                                             cudagraph_capture_sizes=[1, 2, 4, 8, 12, 14, 16],
                                             enable_piecewise_cuda_graph=False, **settings))

    rng = np.random.default_rng(5)
    prompts = [random_tokens(rng, 5 + i) for i in range(10)]
    expected, _, _ = run(core(enforce_eager=True), [request(i + 1, p, 12) for i, p in enumerate(prompts)])
    def graphed_runner(cfg, **kwargs):  # what a CUDA engine runs: graphs (emulated) and a capturable backend
        return ModelRunner(cfg, attention_backend=reference_triton_backend(), graph_class=EmulatedGraph, **kwargs)

    monkeypatch.setattr(model_runner, "ModelRunner", graphed_runner)
    engine = core()
    cg = engine.runner.cuda_graphs
    assert cg.deferred == [12, 14]
    got, _, _ = run(engine, [request(i + 1, p, 12) for i, p in enumerate(prompts)])
    assert got == expected
    assert 12 in cg.graphs and cg.num_uncaptured_decodes >= 1 and cg.num_replays > 0 and cg.deferred == [14]
    assert engine.capture_deferred_graph() and cg.deferred == []
    assert not engine.capture_deferred_graph()  # nothing left
    busy = core()
    busy.add_request(request(99, prompts[0], 4))
    assert not busy.capture_deferred_graph() and busy.runner.cuda_graphs.deferred == [12, 14]  # not while work waits
    busy.runner.capture_all_graphs()  # as the benchmarks do before timing
    assert busy.runner.cuda_graphs.deferred == []


def _fake_core(capture_deferred_graph):
    import types

    return types.SimpleNamespace(
        has_work=lambda: False, capture_deferred_graph=capture_deferred_graph,
        pipeline_step=lambda pending: ([], None, None, False), take_kv_events=lambda: None,
        take_failures=lambda: [], waiting_for_grammar=False, scheduler=types.SimpleNamespace(has_work=lambda: False))


def test_the_engine_loop_captures_left_sizes_only_while_idle_and_nothing_waits():
    """engine/process._loop: once the worker serves, idle with sizes left, it captures one per turn,
    checking the pipe between them, and blocks on the pipe once none is left (here the last call
    queues the Shutdown)."""
    import multiprocessing

    from tokenspeed_worker.engine import process
    from tokenspeed_worker.engine.messages import Serving, Shutdown

    ours, theirs = multiprocessing.Pipe()
    calls = []

    def capture_deferred_graph():
        calls.append(ours.poll(0))  # nothing waiting on the pipe when a capture starts
        if len(calls) == 3:
            theirs.send(Shutdown())
            return False
        return True

    theirs.send(Serving())
    process._loop(_fake_core(capture_deferred_graph), ours)  # returns on the Shutdown
    assert calls == [False, False, False]


def test_the_engine_captures_nothing_left_before_the_worker_serves():
    """A capture begun as the engine became ready would hold the warm-up generation (and the port)
    behind it: the loop only waits on the pipe until Serving comes, answering what comes meanwhile."""
    import multiprocessing
    import threading

    from tokenspeed_worker.engine import process
    from tokenspeed_worker.engine.messages import Probe, ProbeReply, Serving, Shutdown

    ours, theirs = multiprocessing.Pipe()
    calls = []

    def capture_deferred_graph():
        calls.append(True)
        theirs.send(Shutdown())
        return False

    core = _fake_core(capture_deferred_graph)
    core.loads = lambda: "loads"
    loop = threading.Thread(target=process._loop, args=(core, ours), daemon=True)
    loop.start()
    theirs.send(Probe(7))  # as the warm-up's request would be: served with no capture before it
    assert theirs.poll(10) and theirs.recv() == ProbeReply(7, "loads")
    loop.join(0.5)
    assert calls == [] and loop.is_alive()
    theirs.send(Serving())
    loop.join(10)
    assert calls == [True] and not loop.is_alive()


def test_a_size_that_fails_to_capture_while_serving_is_dropped_and_serving_goes_on(llama_path, monkeypatch, caplog):
    eager = _runner(llama_path, enforce_eager=True, max_num_seqs=16)
    graphs = _runner(llama_path, emulate_cuda_graphs=True, max_num_seqs=16, cudagraph_capture_sizes=[1, 2, 4, 8, 12, 16])
    graphs.capture_cuda_graphs()
    cg = graphs.cuda_graphs
    real = cg.capture

    def capture(sizes=None):
        if sizes == [12]:
            raise RuntimeError("out of memory")
        return real(sizes)

    monkeypatch.setattr(cg, "capture", capture)
    caplog.set_level(logging.WARNING)
    _decode_run(graphs, [10])  # wanted: 12
    graphs.capture_deferred_graph()
    assert cg.deferred == [] and cg.sizes == [1, 2, 4, 8, 16] and cg.wanted == set()
    assert "decode batch size 12 not captured (RuntimeError: out of memory)" in caplog.text
    for expected, got in zip(_decode_run(eager, [10]), _decode_run(graphs, [10])):  # now the 16-row graph
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cg.num_replays == 1 and cg.num_uncaptured_decodes == 1
