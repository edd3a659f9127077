"""The triton attention backend's metadata and dispatch, against the torch backend.

On CPU the backend runs torch stand-ins for the kernels (tests/reference_attention.py, same
signatures as the Triton kernels), so these tests prove the backend logic: decode-only steps take the decode path,
every other step the extend path over all rows, with the right sequence lengths, query
starts and slots. The `gpu` tests run the real kernels on CUDA against the torch backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tokenspeed_worker.layers.attention import (
    AttentionInputs,
    TorchAttentionBackend,
    TritonAttentionBackend,
    get_attention_backend,
    resolve_attention_backend_name,
)
import reference_attention
from reference_attention import reference_kernels, reference_paged_decode_attention, reference_paged_extend_attention
from tokenspeed_worker.kernels import compile_ahead
from tokenspeed_worker.kernels import attention as triton_kernels
from tokenspeed_worker.layers.attention.triton_backend import TUNE_CALLS
from tokenspeed_worker.model_executor.model_runner import ModelRunner
from tokenspeed_worker.scheduler.plan import SchedulePlan
from worker_harness import make_runner

MODELS = ["llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"]
BLOCK_SIZE = 4
NUM_BLOCKS = 96
# Where the tests that run the real kernels put their tensors: compiled kernels on a GPU machine,
# Triton's interpreter (CPU tensors) elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = torch.cuda.is_available()


# -- a small hand-driven scheduler (shared with test_cuda_graph_logic.py) -------------------


@dataclass
class Seq:
    tokens: list[int]  # the whole sequence, known ahead
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_left(self) -> int:
        return len(self.tokens) - self.num_computed


class Plans:
    """Hands out blocks in shuffled order and turns (sequence, num_tokens) work into SchedulePlans."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, seed: int = 0) -> None:
        self.block_size = block_size
        self.free_blocks = np.random.default_rng(seed).permutation(num_blocks).tolist()

    def plan(self, work: list[tuple[Seq, int]], advance: bool = True) -> SchedulePlan:
        bs = self.block_size
        for seq, n in work:
            while len(seq.blocks) < math.ceil((seq.num_computed + n) / bs):
                seq.blocks.append(self.free_blocks.pop())
        width = max(len(seq.blocks) for seq, _ in work)
        tables = np.zeros((len(work), width), dtype=np.int32)
        ids, positions, slots = [], [], []
        for row, (seq, n) in enumerate(work):
            tables[row, : len(seq.blocks)] = seq.blocks
            pos = np.arange(seq.num_computed, seq.num_computed + n)
            positions.append(pos)
            ids.append(np.asarray(seq.tokens[seq.num_computed : seq.num_computed + n]))
            slots.append(np.asarray(seq.blocks)[pos // bs] * bs + pos % bs)
        plan = SchedulePlan(
            req_ids=np.arange(len(work), dtype=np.int64),
            query_lens=np.array([n for _, n in work], dtype=np.int32),
            context_lens=np.array([seq.num_computed for seq, _ in work], dtype=np.int32),
            input_ids=np.concatenate(ids).astype(np.int64),
            positions=np.concatenate(positions).astype(np.int64),
            slot_mapping=np.concatenate(slots).astype(np.int64),
            block_tables=tables,
            sample_rows=np.arange(len(work), dtype=np.int32),
        )
        if advance:
            for seq, n in work:
                seq.num_computed += n
        return plan


def random_seqs(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[Seq]:
    rng = np.random.default_rng(seed)
    return [Seq(rng.integers(3, vocab, size=n).tolist()) for n in lengths]


def mixed_schedule(seqs: list[Seq], prompt_lens: list[int], arrive_at: list[int], budget: int, seed: int = 0):
    """Yield work lists: decodes first, then prefill chunks under the budget, rows shuffled."""
    rng = np.random.default_rng(seed)
    for step in range(200):
        active = [s for s, t in zip(seqs, arrive_at) if t <= step and s.num_left]
        if not active and step > max(arrive_at):
            return
        work, left = [], budget
        for seq, prompt_len in zip(seqs, prompt_lens):
            if seq not in active:
                continue
            prompt_left = prompt_len - seq.num_computed
            n = 1 if prompt_left <= 0 else min(prompt_left, left)
            if n and left >= n:
                work.append((seq, n))
                left -= n
        if work:
            yield [work[i] for i in rng.permutation(len(work))]


def mixed_plans():
    """The schedule the backend comparisons share: chunked prefills, decodes and both in one step,
    rows shuffled, blocks scattered; its plans in order."""
    seqs = random_seqs([30, 45, 9, 26, 14, 3], seed=11)
    plans = Plans(seed=11)
    for work in mixed_schedule(seqs, [22, 37, 5, 20, 2, 3], arrive_at=[0, 1, 1, 3, 6, 6], budget=24, seed=5):
        yield plans.plan(work)


def assert_runners_agree(runners: list, atol: float, rtol: float) -> None:
    """runners[1] gives runners[0]'s logits at every step of `mixed_plans`."""
    for plan in mixed_plans():
        expected, got = (runner.forward_all_logits(plan) for runner in runners)
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def reference_triton_backend(device: str = "cpu") -> TritonAttentionBackend:
    backend = reference_attention.reference_triton_backend(device)
    assert backend.uses_reference == (device == "cpu" or not backend_kernels_available())
    return backend


def backend_kernels_available() -> bool:
    from tokenspeed_worker.layers.attention.triton_backend import triton_attention_kernels

    return triton_attention_kernels()[0] is not None


# -- the backend against the torch backend on whole models ---------------------------------


@pytest.fixture(scope="module")
def runner_pairs(tiny_model_paths):
    pairs = {}
    for name in MODELS:
        path = str(tiny_model_paths[name])
        torch_runner = make_runner(path, dtype="float32", block_size=BLOCK_SIZE)
        triton_runner = make_runner(
            path, dtype="float32", block_size=BLOCK_SIZE, attention_backend=reference_triton_backend()
        )
        for runner in (torch_runner, triton_runner):
            runner.allocate_kv_cache(NUM_BLOCKS)
        pairs[name] = (torch_runner, triton_runner)
    return pairs


@pytest.mark.parametrize("name", MODELS)
def test_mixed_batches_match_torch_backend(name, runner_pairs):
    """Chunked prefills, decodes and both in one step, rows shuffled, blocks scattered."""
    torch_runner, triton_runner = runner_pairs[name]
    kinds = set()
    for plan in mixed_plans():
        is_decode = plan.query_lens == 1
        kinds.add("decode" if is_decode.all() else ("mixed" if is_decode.any() else "prefill"))
        expected = torch_runner.forward_all_logits(plan)
        got = triton_runner.forward_all_logits(plan)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(triton_runner.forward(plan), got[plan.sample_token_index], atol=1e-5, rtol=1e-5)
    assert kinds == {"decode", "mixed", "prefill"}
    for runner in (torch_runner, triton_runner):  # both wrote the same K/V at the same slots
        assert runner.kv_cache.abs().sum() > 0
    torch.testing.assert_close(triton_runner.kv_cache, torch_runner.kv_cache, atol=1e-5, rtol=1e-5)


def test_greedy_decode_tokens_match_torch_backend(runner_pairs):
    torch_runner, triton_runner = runner_pairs["llama-gqa-tied"]
    outputs = []
    for runner in (torch_runner, triton_runner):
        seqs = random_seqs([7, 19, 1], seed=21)
        plans = Plans(seed=21)
        logits = runner.forward(plans.plan([(s, len(s.tokens)) for s in seqs]))
        for _ in range(10):
            for seq, token in zip(seqs, logits.argmax(-1).tolist()):
                seq.tokens.append(token)
            logits = runner.forward(plans.plan([(s, 1) for s in seqs]))
        outputs.append([s.tokens for s in seqs])
    assert outputs[0] == outputs[1]


# -- metadata and dispatch -----------------------------------------------------------------


def _inputs(plan: SchedulePlan) -> AttentionInputs:
    def dev(array, dtype):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))

    return AttentionInputs(
        plan=plan,
        query_lens=dev(plan.query_lens, np.int32),
        context_lens=dev(plan.context_lens, np.int32),
        slot_mapping=dev(plan.slot_mapping, np.int64),
        block_tables=dev(plan.block_tables, np.int32),
        block_size=BLOCK_SIZE,
    )


def _backend() -> TritonAttentionBackend:
    """Reference attention, with the kernels module's own split choice and workspace (plain torch)."""
    kernels = reference_kernels()
    kernels.choose_num_splits = triton_kernels.choose_num_splits
    kernels.decode_workspace = triton_kernels.decode_workspace
    backend = TritonAttentionBackend("cpu", kernels=kernels)
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    return backend


def test_decode_only_step_takes_the_decode_path():
    seqs = random_seqs([9, 14, 3])
    plans = Plans()
    plans.plan([(s, len(s.tokens) - 1) for s in seqs])
    plan = plans.plan([(s, 1) for s in seqs])
    metadata = _backend().build_metadata(_inputs(plan))
    assert metadata.decode_only and metadata.query_start_loc is None and metadata.max_query_len == 1
    assert metadata.seq_lens.dtype == torch.int32 and metadata.seq_lens.tolist() == [9, 14, 3]
    assert metadata.num_splits == triton_kernels.choose_num_splits(3, 2, 14, "cpu")  # longest sequence: 14
    if metadata.num_splits > 1:
        partial_out, partial_lse, counter = metadata.workspace
        assert partial_out.shape == (3, 4, metadata.num_splits, 16) and partial_lse.shape == (3, 4, metadata.num_splits)
        assert counter.shape == (3, 2) and not counter.any()
    assert metadata.block_tables.dtype == torch.int32 and metadata.block_tables.is_contiguous()


def test_mixed_step_sends_its_leading_decode_rows_to_the_decode_kernel():
    """Decodes first (as the scheduler orders them): those rows take the decode path, the rest
    extend; a decode row after a prefill row stays in the extend part."""
    seqs = random_seqs([30, 40, 9, 14, 3])
    plans = Plans()
    plans.plan([(seqs[0], 29), (seqs[1], 39), (seqs[2], 8), (seqs[4], 2)])
    plan = plans.plan([(seqs[0], 1), (seqs[1], 1), (seqs[3], 9), (seqs[4], 1), (seqs[2], 1)])
    metadata = _backend().build_metadata(_inputs(plan))
    decode = metadata.decode
    assert not metadata.decode_only and decode is not None and decode.decode_only
    assert decode.seq_lens.tolist() == [30, 40] and decode.block_tables.shape[0] == 2
    assert decode.num_splits == triton_kernels.choose_num_splits(2, 2, 40, "cpu")
    if decode.num_splits > 1:
        assert decode.workspace[0].shape == (2, 4, decode.num_splits, 16)
    assert metadata.seq_lens.tolist() == [9, 3, 9] and metadata.block_tables.shape[0] == 3
    assert metadata.query_start_loc.tolist() == [0, 9, 10, 11] and metadata.max_query_len == 9
    assert metadata.slot_mapping.tolist() == plan.slot_mapping.tolist()  # every row's K/V is written


def test_split_mixed_step_attends_like_one_extend_call():
    """The same rows through decode + extend and through extend alone give the same output."""
    torch.manual_seed(0)
    seqs = random_seqs([30, 40, 9, 14, 3])
    plans = Plans()
    plans.plan([(seqs[0], 29), (seqs[1], 39), (seqs[2], 8), (seqs[4], 2)])
    plan = plans.plan([(seqs[0], 1), (seqs[1], 1), (seqs[3], 9), (seqs[4], 1), (seqs[2], 1)])
    backend = _backend()
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16)
    q = torch.randn(plan.num_tokens, 4, 16)
    split = backend.attend(q, k_cache, v_cache, backend.build_metadata(_inputs(plan)), 0.25)
    inputs = _inputs(plan)  # every row through the extend kernel in one call
    seq_lens = (inputs.context_lens + inputs.query_lens).to(torch.int32)
    query_start_loc = torch.zeros(plan.num_reqs + 1, dtype=torch.int32)
    torch.cumsum(inputs.query_lens, 0, out=query_start_loc[1:])
    whole = torch.empty_like(q)
    backend.kernels.paged_extend_attention(q, k_cache, v_cache, inputs.block_tables, query_start_loc, seq_lens, 0.25,
                                           whole, max_query_len=int(plan.query_lens.max()))
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_decode_graph_metadata_uses_the_static_buffers():
    backend = _backend()
    slots = torch.zeros(8, dtype=torch.int64)
    tables = torch.zeros((8, 256), dtype=torch.int32)
    seq_lens = torch.ones(8, dtype=torch.int32)
    metadata = backend.decode_graph_metadata(slots[:4], tables[:4], seq_lens[:4])
    assert metadata.decode_only
    assert metadata.slot_mapping.data_ptr() == slots.data_ptr()
    assert metadata.block_tables.data_ptr() == tables.data_ptr()
    assert metadata.seq_lens.data_ptr() == seq_lens.data_ptr()
    # Fixed for the graph: sized for the longest sequence the static table can hold, with its
    # workspace allocated now (before capture), not per replay.
    assert metadata.num_splits == triton_kernels.choose_num_splits(4, 2, 256 * BLOCK_SIZE, "cpu") > 1
    assert metadata.workspace[0].shape == (4, 4, metadata.num_splits, 16)


def test_reference_kernels_need_no_splits_or_workspace():
    backend = reference_triton_backend()
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    assert backend.uses_reference and backend.decode_num_splits(1, 10**6) == 1
    assert backend.decode_graph_metadata(
        torch.zeros(2, dtype=torch.int64), torch.zeros((2, 8), dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    ).workspace is None


# -- the reference functions against a naive per-request loop -------------------------------


def _naive_attention(q, k_cache, v_cache, block_tables, query_lens, seq_lens, scale):
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out, start = [], 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(seq_len)
        slots = block_tables[row, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3])[slots].repeat_interleave(group, 1)
        v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3])[slots].repeat_interleave(group, 1)
        for i in range(query_len):
            visible = seq_len - query_len + i + 1
            scores = torch.einsum("hd,khd->hk", q[start + i], k[:visible]) * scale
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[:visible]))
        start += query_len
    return torch.stack(out)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_the_torch_backend_gathers_only_what_a_window_reaches(softcap):
    """A sliding-window layer in the torch backend (the CPU path) gathers each request's last
    Lq + window - 1 keys, not its whole context, and attends exactly as the per-token reference does,
    for decodes past the window, a prefill chunk crossing it, a sequence shorter than it, and a
    window wider than every sequence."""
    torch.manual_seed(0)
    seqs = random_seqs([70, 45, 5, 30])
    plans = Plans()
    plans.plan([(seqs[0], 69), (seqs[1], 44), (seqs[2], 4), (seqs[3], 12)])
    plan = plans.plan([(seqs[0], 1), (seqs[1], 1), (seqs[2], 1), (seqs[3], 9)])  # three decodes, a 9-token chunk
    inputs = _inputs(plan)
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    tokens = int(plan.query_lens.sum())
    q, k, v = torch.randn(tokens, num_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim), torch.randn(
        tokens, num_kv_heads, head_dim)
    backend = TorchAttentionBackend()
    starts = torch.tensor(np.concatenate([[0], np.cumsum(plan.query_lens)]), dtype=torch.int32)
    seq_lens = torch.tensor(plan.context_lens + plan.query_lens, dtype=torch.int32)
    for window in (3, 8, 200):
        metadata = backend.build_metadata(inputs)
        out = backend.forward(q, k, v, k_cache, v_cache, metadata, 0.3, window=window, softcap=softcap or None)
        expected = torch.empty_like(q)
        reference_paged_extend_attention(q, k_cache, v_cache, inputs.block_tables, starts, seq_lens, 0.3, expected,
                                         max_query_len=9, window=window, softcap=softcap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        decodes, chunk = metadata.groups  # decodes first
        assert decodes.keys_for(window)[0].shape == (3, min(window, 70))  # the window, not the 70-token context
        assert chunk.keys_for(window)[0].shape == (1, min(9 + window - 1, 21))  # 12 cached + 9


def test_reference_functions_match_a_naive_loop():
    torch.manual_seed(0)
    num_blocks, num_heads, num_kv_heads, head_dim = 40, 6, 2, 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    query_lens, seq_lens = [1, 7, 3, 1], [5, 7, 13, 1]
    tables = torch.from_numpy(np.random.default_rng(1).permutation(num_blocks)[:16].reshape(4, 4).astype(np.int32))
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    expected = _naive_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, 0.3)
    out = torch.empty_like(q)
    starts = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    reference_paged_extend_attention(
        q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), 0.3, out, max_query_len=7
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    decode_q = torch.randn(4, num_heads, head_dim)
    decode_out = torch.empty_like(decode_q)
    reference_paged_decode_attention(
        decode_q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.3, decode_out, num_splits=3
    )
    expected = _naive_attention(decode_q, k_cache, v_cache, tables, [1] * 4, seq_lens, 0.3)
    torch.testing.assert_close(decode_out, expected, atol=1e-5, rtol=1e-5)


# -- selection ------------------------------------------------------------------------------


def test_triton_needs_cuda_and_triton():
    if not (CUDA and backend_kernels_available()):
        with pytest.raises(ValueError, match="triton attention needs a CUDA device and the triton package"):
            get_attention_backend("triton", "cuda" if CUDA else "cpu")
    with pytest.raises(ValueError, match="triton attention needs a CUDA device and the triton package"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope")


def test_auto_picks_triton_only_on_cuda_with_kernels():
    assert resolve_attention_backend_name("auto", "cpu") == "torch"
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert resolve_attention_backend_name("torch", "cuda") == "torch"
    expected = "triton" if CUDA and backend_kernels_available() else "torch"
    assert resolve_attention_backend_name("auto", "cuda") == expected


def test_runner_accepts_auto(tiny_model_paths):
    runner = make_runner(str(tiny_model_paths["llama-gqa-tied"]), attention_backend="auto", block_size=BLOCK_SIZE)
    assert runner.attention_backend.name == "torch"


# -- GPU: the real kernels -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_triton_kernels_match_torch_backend(name, tiny_model_paths):
    assert backend_kernels_available(), "tokenspeed_worker.kernels.attention must import on the GPU machine"
    path = str(tiny_model_paths[name])
    runners = [
        make_runner(path, dtype="float32", device="cuda", block_size=BLOCK_SIZE, attention_backend=backend)
        for backend in ("torch", "triton")
    ]
    for runner in runners:
        runner.allocate_kv_cache(NUM_BLOCKS)
    assert_runners_agree(runners, atol=2e-4, rtol=1e-3)


def test_warm_up_runs_each_attention_variant_and_leaves_the_cache_alone(monkeypatch):
    # Startup compiles the extend kernel's short-query variants (ModelRunner.warm_up_kernels), so
    # the first prefix-cache hit with a short suffix does not wait for Triton. Here the real kernels
    # run in Triton's interpreter, through a recorder.
    from types import SimpleNamespace

    seen = []

    def extend(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, max_query_len):
        if compile_ahead.active():  # a GPU's first pass compiles each variant, runs none: not recorded
            return triton_kernels.paged_extend_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                         seq_lens, scale, out, max_query_len=max_query_len)
        seen.append(max_query_len)
        assert q.shape[0] == max_query_len and block_tables.shape == (1, -(-max_query_len // BLOCK_SIZE))
        assert int(seq_lens[0]) == max_query_len and query_start_loc.tolist() == [0, max_query_len]
        triton_kernels.paged_extend_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                              out, max_query_len=max_query_len)
        assert torch.isfinite(out).all()

    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, workspace, rope):
        if compile_ahead.active():
            return triton_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                                                         num_splits=num_splits, workspace=workspace, rope=rope)
        seen.append(("decode", num_splits, rope is not None))
        triton_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                                              num_splits=num_splits, workspace=workspace, rope=rope)
        assert torch.isfinite(out).all()

    kernels = SimpleNamespace(paged_extend_attention=extend, paged_decode_attention=decode,
                              choose_num_splits=triton_kernels.choose_num_splits,
                              decode_workspace=triton_kernels.decode_workspace)
    backend = TritonAttentionBackend(DEVICE, kernels=kernels)
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    monkeypatch.setattr(TritonAttentionBackend, "WARM_UP_QUERY_LENS", (1, 3, 2 * BLOCK_SIZE + 1))
    k_cache = torch.randn(backend.kv_cache_shape(4, BLOCK_SIZE, 2, 16), device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    assert backend.warm_up(k_cache, v_cache, torch.float32) == 7
    # ... and the decode kernel both ways: output written directly (one split) and through the
    # workspace, each without and with its own rotary + KV write (whose slot is put back)
    assert seen == [1, 3, 2 * BLOCK_SIZE + 1, ("decode", 1, False), ("decode", 2, False), ("decode", 1, True),
                    ("decode", 2, True)]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    assert _backend().warm_up(k_cache, v_cache, torch.float32) == 0  # the reference compiles nothing


def test_warm_up_compiles_every_variant_side_by_side_before_running_each(monkeypatch):
    """Where Triton compiles (a GPU), warm_up first hands every variant to compile-ahead mode (each
    launch only submits its compile: kernels/compile_ahead.py), then runs each once, compiled."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    passes = []

    @contextmanager
    def compiling():
        monkeypatch.setattr(compile_ahead, "_active", True)
        try:
            yield
        finally:
            monkeypatch.setattr(compile_ahead, "_active", False)

    monkeypatch.setattr(compile_ahead, "available", lambda: True)
    monkeypatch.setattr(compile_ahead, "compiling", compiling)
    kernels = SimpleNamespace(
        paged_extend_attention=lambda *args, **kwargs: passes.append(("extend", compile_ahead.active())),
        paged_decode_attention=lambda *args, **kwargs: passes.append(("decode", compile_ahead.active())),
        choose_num_splits=triton_kernels.choose_num_splits, decode_workspace=triton_kernels.decode_workspace)
    backend = TritonAttentionBackend(DEVICE, kernels=kernels)
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    k_cache = torch.randn(backend.kv_cache_shape(4, BLOCK_SIZE, 2, 16), device=DEVICE)
    variants = len(TritonAttentionBackend.WARM_UP_QUERY_LENS) + 4
    assert backend.warm_up(k_cache, torch.randn_like(k_cache), torch.float32) == variants
    assert [active for _, active in passes] == [True] * variants + [False] * variants
    names = [name for name, _ in passes]
    assert names[:variants] == names[variants:] and not compile_ahead.active()


# -- the decode kernel's single-split threshold, timed at startup ---------------------------


def test_tune_decode_keeps_the_longest_context_where_one_program_wins():
    # Fake device times: at batch 1 one program per kv head wins at 128 and 256 keys and loses at
    # 512 (so 1024 is not tried); at batch 2 it loses at once; batch 512 has enough programs
    # without splitting, so nothing is timed for it.
    from types import SimpleNamespace

    calls = []

    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits=None, workspace=None,
               single_split_tokens=0):
        calls.append((q.shape[0], int(seq_lens[0]), single_split_tokens, num_splits, block_tables.data_ptr()))
        assert block_tables.shape == (q.shape[0], -(-int(seq_lens[0]) // BLOCK_SIZE))
        assert int(block_tables.max()) < k_cache.shape[0] and workspace is not None

    split_us = {(1, 128): 10.0, (1, 256): 12.0, (1, 512): 14.0, (2, 128): 10.0}
    single_us = {(1, 128): 6.0, (1, 256): 9.0, (1, 512): 13.9, (2, 128): 9.8}

    def timer(fn):
        fn()
        batch, tokens, single = calls[-1][:3]
        return (single_us if single else split_us)[(batch, tokens)]

    kernels = SimpleNamespace(paged_decode_attention=decode, paged_extend_attention=None,
                              choose_num_splits=triton_kernels.choose_num_splits,
                              decode_workspace=triton_kernels.decode_workspace)
    backend = TritonAttentionBackend("cpu", kernels=kernels)
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    k_cache = torch.zeros(backend.kv_cache_shape(64, BLOCK_SIZE, 2, 16))
    chosen = backend.tune_decode(k_cache, torch.zeros_like(k_cache), torch.float32, [2, 1, 512, 1], 4096, timer=timer)
    assert chosen == {1: 256, 2: 0, 512: 0}
    assert backend.tuning == {1: {128: (10.0, 6.0), 256: (12.0, 9.0), 512: (14.0, 13.9)}, 2: {128: (10.0, 9.8)}}
    assert {c[0] for c in calls} == {1, 2}
    # Each timed graph is TUNE_CALLS calls over tables of their own; the split path runs with
    # single_split_tokens 0, the single path with the context itself.
    runs = [calls[i:i + TUNE_CALLS] for i in range(0, len(calls), TUNE_CALLS)]
    assert all(len({c[4] for c in run}) == TUNE_CALLS for run in runs)
    assert [(run[0][0], run[0][1], run[0][2]) for run in runs] == [
        (1, 128, 0), (1, 128, 128), (1, 256, 0), (1, 256, 256), (1, 512, 0), (1, 512, 512), (2, 128, 0), (2, 128, 128)]
    # The thresholds reach the metadata: a graph's batch size takes its own, an eager batch the
    # smallest tuned size at or above it, and a batch past every tuned size none.
    tables, slots, lens = torch.zeros((4, 8), dtype=torch.int32), torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32)
    assert backend.decode_graph_metadata(slots[:1], tables[:1], lens[:1]).single_split_tokens == 256
    assert backend.decode_graph_metadata(slots[:2], tables[:2], lens[:2]).single_split_tokens == 0
    assert [backend.single_split_for(b) for b in (1, 2, 3, 600)] == [256, 0, 0, 0]
    # A timing that fails part-way (out of memory, say) leaves no threshold, not a stale one.

    def failing(fn):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        backend.tune_decode(k_cache, torch.zeros_like(k_cache), torch.float32, [1], 4096, timer=failing)
    assert backend.single_split_tokens == {} and backend.single_split_for(1) == 0


def test_tune_decode_needs_cuda_or_a_timer_and_real_kernels():
    backend = _backend()  # reference kernels: nothing to tune
    k_cache = torch.zeros(backend.kv_cache_shape(4, BLOCK_SIZE, 2, 16))
    assert backend.tune_decode(k_cache, k_cache, torch.float32, [1], 1024, timer=lambda fn: 1.0) == {}
    assert backend.single_split_for(1) == 0
    from types import SimpleNamespace

    kernels = SimpleNamespace(paged_decode_attention=triton_kernels.paged_decode_attention, paged_extend_attention=None,
                              choose_num_splits=triton_kernels.choose_num_splits,
                              decode_workspace=triton_kernels.decode_workspace)
    backend = TritonAttentionBackend("cpu", kernels=kernels)
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    assert backend.tune_decode(k_cache, k_cache, torch.float32, [1], 1024) == {}  # CPU, no timer: no timing


def _torch_and_real_kernel_runners(path: str, decode) -> tuple[TritonAttentionBackend, list[ModelRunner]]:
    """A float32 runner on the torch backend and one on the triton backend whose decode calls go
    through `decode` (which calls the real kernel: Triton's interpreter on CPU), caches allocated."""
    from types import SimpleNamespace

    kernels = SimpleNamespace(paged_decode_attention=decode, paged_extend_attention=triton_kernels.paged_extend_attention,
                              choose_num_splits=triton_kernels.choose_num_splits,
                              decode_workspace=triton_kernels.decode_workspace)
    backend = TritonAttentionBackend(DEVICE, kernels=kernels)
    runners = [make_runner(path, dtype="float32", device=DEVICE, block_size=BLOCK_SIZE),
               make_runner(path, dtype="float32", device=DEVICE, block_size=BLOCK_SIZE, attention_backend=backend)]
    for runner in runners:
        runner.allocate_kv_cache(NUM_BLOCKS)
    return backend, runners


def test_a_tuned_threshold_decodes_like_the_torch_backend(tiny_model_paths):
    # The real kernels (Triton's interpreter on CPU) with a threshold above every context: the
    # decode step runs one program per kv head, and its logits still match the torch backend's.
    path = str(tiny_model_paths["llama-gqa-tied"])
    thresholds = []

    def decode(*args, **kwargs):
        thresholds.append(kwargs["single_split_tokens"])
        triton_kernels.paged_decode_attention(*args, **kwargs)

    backend, runners = _torch_and_real_kernel_runners(path, decode)
    backend.single_split_tokens = {4: 1024}
    seqs = random_seqs([40, 90, 130], seed=3)
    plans = Plans(seed=3)
    prefill = plans.plan([(s, len(s.tokens) - 1) for s in seqs])
    decode = plans.plan([(s, 1) for s in seqs])
    assert backend.build_metadata(_inputs(decode)).single_split_tokens == 1024
    for plan in (prefill, decode):
        expected, got = (runner.forward_all_logits(plan) for runner in runners)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
    assert thresholds and set(thresholds) == {1024}  # every layer's decode call got it


def test_decode_steps_rotate_inside_the_decode_kernel_and_match_the_torch_backend(tiny_model_paths, monkeypatch):
    # The real kernels (Triton's interpreter on CPU) with the fused kernels forced: a decode step's
    # layers each make one decode call that rotates q and k and writes the cache (no rotary kernel
    # before it), a prefill's do not; the logits match the torch backend's, and the cache the
    # decode steps wrote serves the next step as the rotary kernel's would.
    from tokenspeed_worker.kernels import rotary
    from tokenspeed_worker.layers.fused_kernels import fused_kernels

    path = str(tiny_model_paths["llama-gqa-tied"])
    calls = []

    def decode(*args, **kwargs):
        calls.append(kwargs.get("rope") is not None)
        triton_kernels.paged_decode_attention(*args, **kwargs)

    rotary_calls = []
    real_rotary = rotary.rope_and_write_kv
    monkeypatch.setattr(rotary, "rope_and_write_kv", lambda *a, **kw: rotary_calls.append(a[0].shape[0])
                        or real_rotary(*a, **kw))
    backend, runners = _torch_and_real_kernel_runners(path, decode)
    layers = len(runners[1].attention_layers)
    seqs = random_seqs([40, 90, 17], seed=5)
    plans = Plans(seed=5)
    steps = [plans.plan([(s, len(s.tokens) - 2) for s in seqs])]
    with fused_kernels("force"):
        for step in range(2):
            if step:
                for s in seqs:
                    s.tokens.append(11)
            steps.append(plans.plan([(s, 1) for s in seqs]))
            for plan in steps[-2 if step == 0 else -1:]:
                expected, got = (runner.forward_all_logits(plan) for runner in runners)
                torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
    assert calls == [True] * (2 * layers)  # both decode steps, every layer: rotated in the kernel
    assert rotary_calls == [sum(len(s.tokens) - 3 for s in seqs)] * layers  # the prefill's rotary kernel only


def test_only_small_decode_steps_rotate_inside_the_decode_kernel():
    backend = _backend()
    seqs = random_seqs([5] * 40, seed=2)
    plans = Plans(seed=2)
    prefill = backend.build_metadata(_inputs(plans.plan([(s, len(s.tokens) - 1) for s in seqs[:3]])))
    assert not backend.fuses_rope(prefill)  # the extend kernel has no rotary of its own
    for rows, fuses in ((1, True), (TritonAttentionBackend.fuse_rope_max_rows, True),
                        (TritonAttentionBackend.fuse_rope_max_rows + 1, False)):
        decode = backend.build_metadata(_inputs(plans.plan([(s, 1) for s in seqs[:rows]], advance=False)))
        assert decode.decode_only and backend.fuses_rope(decode) is fuses
    with pytest.raises(ValueError, match="decode-only"):  # the last, larger decode step does not fuse
        backend.attend_rotary(None, None, None, None, None, decode, 1.0, None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tune_decode_on_cuda_picks_a_candidate_for_each_split_batch():
    # The real timing (CUDA graphs, L2 flushed) at the 1B shape's heads: every batch size gets 0 or
    # one of the candidates, with both paths timed up to the first loss.
    from tokenspeed_worker.layers.attention.triton_backend import SINGLE_SPLIT_CANDIDATES

    backend = TritonAttentionBackend("cuda")
    backend.setup(num_heads=32, num_kv_heads=8, head_dim=64, block_size=16)
    k_cache = torch.zeros(backend.kv_cache_shape(4096, 16, 8, 64), dtype=torch.bfloat16, device="cuda")
    chosen = backend.tune_decode(k_cache, torch.zeros_like(k_cache), torch.bfloat16, [1, 4, 128], 8192)
    assert set(chosen) == {1, 4, 128} and chosen[128] == 0 and 128 not in backend.tuning  # 128 x 8 heads: no split
    for batch in (1, 4):
        assert chosen[batch] in (0, *SINGLE_SPLIT_CANDIDATES)
        assert all(split > 0 and single > 0 for split, single in backend.tuning[batch].values())


def test_verify_steps_flattened_to_decode_rows_match_the_torch_backend(tiny_model_paths):
    # Speculative decoding's verify step (each row's last token and its draft) run as one decode row
    # per token (model_runner.flatten_verify) through the real kernels (Triton's interpreter on CPU),
    # the fused kernels forced and the decode kernel's own rotary off, as while speculating: the
    # logits at every drafted position equal the torch backend's extend of the same step.
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.model_executor.model_runner import flatten_verify

    path = str(tiny_model_paths["llama-gqa-tied"])
    backend, runners = _torch_and_real_kernel_runners(path, triton_kernels.paged_decode_attention)
    backend.fuse_rope_max_rows = 0
    seqs = random_seqs([40, 23, 61], seed=7)
    plans = Plans(seed=7)
    drafts = [3, 0, 4]
    with fused_kernels("force"):
        prefill = plans.plan([(s, len(s.tokens)) for s in seqs])
        for runner in runners:
            runner.forward(prefill)
        for s, d in zip(seqs, drafts):
            s.tokens.extend(np.random.default_rng(d).integers(3, 500, 1 + d).tolist())
        verify = plans.plan([(s, 1 + d) for s, d in zip(seqs, drafts)])
        verify.draft_lens = np.asarray(drafts, dtype=np.int32)
        expected = runners[0].forward(verify)
        flat = flatten_verify(verify)
        assert flat.num_reqs == verify.num_tokens and backend.build_metadata(_inputs(flat)).decode_only
        got = runners[1].forward(flat)
    assert got.shape[0] == sum(1 + d for d in drafts)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
