"""GPU self-check of the triton attention backend and the decode CUDA graphs, in one short run.

    python scripts/gpu_selfcheck.py [--out selfcheck.json] [--skip-bench] [--batches 1,8,32,64,128,256]

Prints PASS/FAIL per check (with the measured error, and a traceback on an exception), then
a summary; exit status 1 if any check failed. Checks, cheapest and most local first, so a
failure points at its layer:
  kernels_import          tokenspeed_worker.kernels.attention imports, AVAILABLE is true
  decode_kernel_*         paged_decode_attention vs the torch reference (fp32/bf16, GQA, several
                          head dims, num_splits None/1/4/16, with a preallocated workspace)
  extend_kernel_*         paged_extend_attention vs the torch reference (mixed query lengths incl. 1)
  decode_kernel_graph     the decode kernel captured in a CUDA graph, replayed on new lengths
  tiny_triton_vs_torch    tiny Llama/Qwen3 (fp32): triton backend eager = torch backend eager,
                          mixed prefill/decode steps, every token's logits
  tiny_graphs_vs_torch    tiny Llama (fp32): triton + CUDA graphs = torch eager over decode
                          batches of 1..8 rows (padded), graph replays counted
  tiny_graph_tokens       tiny Llama (fp32): greedy tokens with graphs = torch eager
  engine_auto             EngineCore on Llama-3.2-1B-shaped dummy weights with --attention-backend
                          auto: memory profiling + sizing log, graph capture, a short generation
  bench_1b_bs{B}          Llama-3.2-1B-shaped dummy weights (bf16), context --context tokens:
                          ms per decode step for torch eager, triton eager, triton + graphs, and
                          the logits agreement of the three on the same step
--dry-run-cpu runs the same code on CPU (reference kernels, emulated graphs, small bench) to
check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.emulated_graph import EmulatedGraph  # noqa: E402
from tests.reference_attention import (  # noqa: E402
    reference_paged_decode_attention as _reference_paged_decode_attention,
    reference_paged_extend_attention as _reference_paged_extend_attention,
    reference_triton_backend,
)
from tokenspeed_worker.layers.attention import TorchAttentionBackend, TritonAttentionBackend  # noqa: E402
from tokenspeed_worker.layers.attention.triton_backend import triton_attention_kernels  # noqa: E402
from tokenspeed_worker.config import EngineConfig  # noqa: E402
from tokenspeed_worker.model_executor.model_runner import ModelRunner  # noqa: E402
from tokenspeed_worker.scheduler.plan import SchedulePlan  # noqa: E402

LLAMA_1B = REPO / "scripts" / "model_configs" / "llama-3.2-1b"
RESULTS: list[dict] = []


# -- harness ------------------------------------------------------------------------------------


def check(name: str, fn, *args, **kwargs) -> dict | None:
    """Run one check: PASS when fn returns, FAIL on AssertionError (message) or any exception (traceback)."""
    print(f"\n=== {name}", flush=True)
    start = time.perf_counter()
    try:
        details = fn(*args, **kwargs) or {}
        status = "PASS"
    except AssertionError as error:
        details, status = {"error": str(error)}, "FAIL"
    except Exception as error:  # noqa: BLE001 - report and keep going
        details, status = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}, "FAIL"
        print(details["traceback"], flush=True)
    seconds = time.perf_counter() - start
    RESULTS.append({"check": name, "status": status, "seconds": round(seconds, 2), **details})
    shown = {k: v for k, v in details.items() if k != "traceback"}
    print(f"{status} {name} ({seconds:.1f} s) {json.dumps(shown, default=str)}", flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return details if status == "PASS" else None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
    diff = max_diff(got, expected)
    bound = atol + rtol * float(expected.float().abs().max())
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert diff <= bound, f"{name}: max abs diff {diff:.3g} > {bound:.3g} (atol {atol} + rtol {rtol} x max|ref|)"
    return diff


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- kernels alone --------------------------------------------------------------------------------


def random_paged_case(device, dtype, num_heads, num_kv_heads, head_dim, query_lens, context_lens, block_size=16,
                      seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    width = max(math.ceil(s / block_size) for s in seq_lens) + 2
    num_blocks = width * len(seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: width * len(seq_lens)].view(len(seq_lens), width)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    starts = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(device, torch.int32),
                query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


def tolerance(dtype) -> tuple[float, float]:
    return (3e-3, 3e-3) if dtype == torch.float32 else (3e-2, 2e-2)


def check_decode_kernel(kernels, device, dtype, num_heads, num_kv_heads, head_dim) -> dict:
    case = random_paged_case(device, dtype, num_heads, num_kv_heads, head_dim, query_lens=[1] * 6,
                             context_lens=[0, 15, 16, 200, 1000, 37])
    scale = head_dim**-0.5
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], scale)
    expected = torch.empty_like(case["q"])
    _reference_paged_decode_attention(*args, expected)
    diffs = {}
    make_workspace = getattr(kernels, "decode_workspace", None)
    for num_splits in (None, 1, 4, 16):
        out = torch.full_like(case["q"], float("nan"))
        workspace = None
        if num_splits is not None and make_workspace is not None:
            workspace = make_workspace(6, num_heads, head_dim, num_splits, device)
        kernels.paged_decode_attention(*args, out, num_splits=num_splits, workspace=workspace)
        diffs[f"splits={num_splits}"] = assert_close(f"num_splits={num_splits}", out, expected, *tolerance(dtype))
    return {"max_abs_diff": diffs, "workspace_fn": make_workspace is not None}


def check_extend_kernel(kernels, device, dtype, num_heads, num_kv_heads, head_dim) -> dict:
    query_lens, context_lens = [1, 7, 33, 1, 130, 16], [0, 20, 5, 60, 0, 300]
    case = random_paged_case(device, dtype, num_heads, num_kv_heads, head_dim, query_lens, context_lens, seed=1)
    scale = head_dim**-0.5
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["query_start_loc"],
            case["seq_lens"], scale)
    expected = torch.empty_like(case["q"])
    _reference_paged_extend_attention(*args, expected, max_query_len=max(query_lens))
    out = torch.full_like(case["q"], float("nan"))
    kernels.paged_extend_attention(*args, out, max_query_len=max(query_lens))
    return {"max_abs_diff": assert_close("extend", out, expected, *tolerance(dtype))}


def check_decode_kernel_graph(kernels, device) -> dict:
    """Capture the decode kernel with fixed splits and workspace; replay after changing lengths and tables."""
    dtype, num_heads, num_kv_heads, head_dim, num_splits = torch.bfloat16, 32, 8, 64, 8
    case = random_paged_case(device, dtype, num_heads, num_kv_heads, head_dim, [1] * 4, [10, 300, 0, 90])
    scale = head_dim**-0.5
    workspace = kernels.decode_workspace(4, num_heads, head_dim, num_splits, device) if hasattr(
        kernels, "decode_workspace") else None
    out = torch.empty_like(case["q"])

    def run():
        kernels.paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                       case["seq_lens"], scale, out, num_splits=num_splits, workspace=workspace)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    diffs = []
    for new_lens in ([11, 301, 1, 91], [1, 1, 1, 1], [40, 17, 250, 300]):
        case["seq_lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
        case["block_tables"].copy_(case["block_tables"].roll(1, 0))
        case["q"].normal_()
        graph.replay()
        expected = torch.empty_like(out)
        _reference_paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                          case["seq_lens"], scale, expected)
        diffs.append(assert_close(f"replay lens={new_lens}", out, expected, *tolerance(dtype)))
    return {"max_abs_diff": diffs}


# -- tiny models through the runner ----------------------------------------------------------------


class Seqs:
    """Sequences with blocks handed out in shuffled order, turned into plans."""

    def __init__(self, lengths: list[int], num_blocks: int, block_size: int, seed: int = 0, vocab: int = 500):
        rng = np.random.default_rng(seed)
        self.tokens = [rng.integers(3, vocab, size=n).tolist() for n in lengths]
        self.computed = [0] * len(lengths)
        self.blocks: list[list[int]] = [[] for _ in lengths]
        self.free = rng.permutation(num_blocks).tolist()
        self.block_size = block_size

    def plan(self, work: list[tuple[int, int]], advance: bool = True) -> SchedulePlan:
        bs = self.block_size
        for i, n in work:
            while len(self.blocks[i]) < math.ceil((self.computed[i] + n) / bs):
                self.blocks[i].append(self.free.pop())
        width = max(len(self.blocks[i]) for i, _ in work)
        tables = np.zeros((len(work), width), dtype=np.int32)
        ids, positions, slots = [], [], []
        for row, (i, n) in enumerate(work):
            tables[row, : len(self.blocks[i])] = self.blocks[i]
            pos = np.arange(self.computed[i], self.computed[i] + n)
            positions.append(pos)
            ids.append(np.asarray(self.tokens[i][self.computed[i] : self.computed[i] + n]))
            slots.append(np.asarray(self.blocks[i])[pos // bs] * bs + pos % bs)
        plan = SchedulePlan(
            req_ids=np.array([i for i, _ in work], dtype=np.int64),
            query_lens=np.array([n for _, n in work], dtype=np.int32),
            context_lens=np.array([self.computed[i] for i, _ in work], dtype=np.int32),
            input_ids=np.concatenate(ids).astype(np.int64),
            positions=np.concatenate(positions).astype(np.int64),
            slot_mapping=np.concatenate(slots).astype(np.int64),
            block_tables=tables,
            sample_rows=np.arange(len(work), dtype=np.int32),
        )
        if advance:
            for i, n in work:
                self.computed[i] += n
        return plan


def make_runner(path, ctx, backend: str, *, eager: bool, dtype="float32", load_format="auto", **kwargs) -> ModelRunner:
    if backend == "triton":
        attention = reference_triton_backend(ctx.device) if ctx.allow_reference else TritonAttentionBackend(ctx.device)
    else:
        attention = TorchAttentionBackend()
    cfg = EngineConfig.build(str(path), dtype=dtype, device=str(ctx.device), block_size=ctx.block_size,
                             enforce_eager=eager, load_format=load_format, **kwargs)
    return ModelRunner(cfg, attention_backend=attention, graph_class=EmulatedGraph if ctx.dry_run and not eager else None)


def check_tiny_triton_vs_torch(ctx, path) -> dict:
    runners = [make_runner(path, ctx, b, eager=True) for b in ("torch", "triton")]
    for runner in runners:
        runner.allocate_kv_cache(256)
    seqs = Seqs([30, 45, 9, 26, 14, 3, 70], num_blocks=256, block_size=ctx.block_size, seed=3)
    prompt_lens = [22, 37, 5, 20, 2, 3, 64]
    worst, steps = 0.0, 0
    for step in range(40):
        work, left = [], 48
        for i, prompt_len in enumerate(prompt_lens):
            if step < i // 2 or seqs.computed[i] >= len(seqs.tokens[i]):
                continue
            n = 1 if seqs.computed[i] >= prompt_len else min(prompt_len - seqs.computed[i], left)
            if n and left >= n:
                work.append((i, n))
                left -= n
        if not work:
            break
        plan = seqs.plan(work)
        expected, got = (r.forward_all_logits(plan) for r in runners)
        worst = max(worst, assert_close(f"step {step} (query lens {plan.query_lens.tolist()})", got, expected,
                                        2e-4, 1e-3))
        steps += 1
    return {"steps": steps, "max_abs_diff": worst}


def decode_batches(runner: ModelRunner, batch_sizes: list[int], seed: int, block_size: int, greedy: bool = False):
    """Prefill 8 sequences, then decode steps of the given sizes; logits per step (greedy: feed argmax back)."""
    seqs = Seqs([5, 19, 3, 40, 11, 27, 8, 16], num_blocks=250, block_size=block_size, seed=seed)
    out = [runner.forward(seqs.plan([(i, len(t)) for i, t in enumerate(seqs.tokens)])).clone()]
    for step, batch in enumerate(batch_sizes):
        for i in range(batch):
            token = int(out[-1][i].argmax()) if greedy and out[-1].shape[0] > i else 3 + (7 * step + i) % 400
            seqs.tokens[i].append(token)
        out.append(runner.forward(seqs.plan([(i, 1) for i in range(batch)])).clone())
    return out, seqs


def check_tiny_graphs_vs_torch(ctx, path) -> dict:
    eager = make_runner(path, ctx, "torch", eager=True, max_num_seqs=8, max_model_len=256)
    graphs = make_runner(path, ctx, "triton", eager=False, max_num_seqs=8, max_model_len=256)
    for runner in (eager, graphs):
        runner.allocate_kv_cache(250)
        runner.capture_cuda_graphs()
    assert graphs.cuda_graphs is not None, f"graphs not captured: {graphs.cuda_graphs_off_reason}"
    batch_sizes = [3, 5, 8, 1, 2, 7, 6, 4, 8, 3]
    worst = 0.0
    for step, (expected, got) in enumerate(zip(decode_batches(eager, batch_sizes, 1, ctx.block_size)[0],
                                               decode_batches(graphs, batch_sizes, 1, ctx.block_size)[0])):
        worst = max(worst, assert_close(f"step {step}", got, expected, 2e-4, 1e-3))
    stats = graphs.cuda_graphs
    assert stats.num_replays == len(batch_sizes), f"{stats.num_replays} replays for {len(batch_sizes)} decode steps"
    assert stats.num_eager_decodes == 0
    return {"max_abs_diff": worst, "replays": stats.num_replays, "sizes": sorted(stats.graphs)}


def check_tiny_graph_tokens(ctx, path) -> dict:
    """Greedy tokens with graphs = torch eager; a divergence counts only where the reference's top two
    logits were not a near tie (random tiny weights make ties, and then any rounding may flip them)."""
    runs = []
    for backend, eager in (("torch", True), ("triton", False)):
        runner = make_runner(path, ctx, backend, eager=eager, max_num_seqs=8, max_model_len=256)
        runner.allocate_kv_cache(250)
        runner.capture_cuda_graphs()
        runs.append(decode_batches(runner, [8] * 12 + [5] * 4, 2, ctx.block_size, greedy=True))
    (ref_logits, ref_seqs), (_, seqs) = runs
    prompt_lens = [5, 19, 3, 40, 11, 27, 8, 16]
    diverged, near_ties = [], 0
    for i, (expected, got) in enumerate(zip(ref_seqs.tokens, seqs.tokens)):
        if expected == got:
            continue
        step = next(k for k, (a, b) in enumerate(zip(expected, got)) if a != b) - prompt_lens[i]
        top2 = ref_logits[step][i].topk(2).values
        if float(top2[0] - top2[1]) < 1e-3:
            near_ties += 1
        else:
            diverged.append((i, step, float(top2[0] - top2[1])))
    assert not diverged, f"greedy tokens diverge (sequence, decode step, top-2 margin): {diverged}"
    return {"sequences": len(seqs.tokens), "near_tie_divergences": near_ties}


# -- the engine, with auto backend and memory sizing -----------------------------------------------


def check_engine_auto(ctx, model, load_format) -> dict:
    from tokenspeed_worker.engine.engine_core import EngineCore
    from tokenspeed_worker.engine.messages import AddRequest
    from tokenspeed_worker.sampling.params import SamplingParams

    cfg = EngineConfig.build(
        str(model), dtype="bfloat16" if ctx.device.type == "cuda" else "float32",
        device=str(ctx.device), load_format=load_format, attention_backend="auto", max_model_len=ctx.max_model_len,
        max_num_seqs=64, gpu_memory_utilization=ctx.engine_memory_utilization,
        max_total_tokens=None if ctx.device.type == "cuda" else 4096,
    )
    start = time.perf_counter()
    core = EngineCore(cfg)
    startup = time.perf_counter() - start
    core.runner.capture_all_graphs()  # the sizes a serving engine captures once idle: none left for the timings
    runner = core.runner
    expected_backend = "triton" if ctx.device.type == "cuda" else "torch"
    assert runner.attention_backend.name == expected_backend, f"auto picked {runner.attention_backend.name}"
    if ctx.device.type == "cuda":
        assert runner.cuda_graphs is not None, f"no CUDA graphs: {runner.cuda_graphs_off_reason}"
    rng = np.random.default_rng(0)
    for i in range(12):
        prompt = rng.integers(0, min(1000, runner.vocab_size), size=int(rng.integers(5, 300))).astype(np.int32)
        core.add_request(AddRequest(i, prompt, 16, SamplingParams(temperature=0.0, seed=i)))
    produced, steps, start = {}, 0, time.perf_counter()
    while core.has_work() and steps < 500:
        out = core.step()
        steps += 1
        if out is not None:
            for rid in out.req_ids.tolist():
                produced[rid] = produced.get(rid, 0) + 1
    gen_seconds = time.perf_counter() - start
    assert produced == {i: 16 for i in range(12)}, f"tokens per request: {produced}"
    replays = runner.cuda_graphs.num_replays if runner.cuda_graphs is not None else 0
    if ctx.device.type == "cuda":
        assert replays > 0, "decode steps never replayed a graph"
    details = {"startup_s": round(startup, 1), "kv_blocks": core.num_blocks, "kv_gib": round(core.kv_cache_bytes / 2**30, 2),
               "steps": steps, "graph_replays": replays, "generate_s": round(gen_seconds, 2)}
    del core, runner
    return details


# -- Llama-3.2-1B-shaped decode timing --------------------------------------------------------------


def use_backend(runner: ModelRunner, backend) -> None:
    """Point every layer at another backend (same KV layout); used to compare backends on one KV state."""
    backend.setup(runner.hf_config.num_attention_heads, runner.num_kv_heads, runner.head_dim, runner.block_size)
    runner.attention_backend = backend
    for attn in runner.attention_layers:
        attn.backend = backend


def time_steps(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1000


def bench_1b(ctx, model, load_format, batches: list[int]) -> None:
    max_batch = max(batches)
    runner = make_runner(model, ctx, "triton", eager=False, dtype=ctx.bench_dtype, load_format=load_format,
                         max_num_seqs=max_batch, max_model_len=ctx.max_model_len)
    context = ctx.context
    blocks_per_seq = math.ceil((context + 1) / ctx.block_size)
    runner.allocate_kv_cache(blocks_per_seq * max_batch + 1)
    start = time.perf_counter()
    runner.capture_cuda_graphs()  # logs sizes, seconds and memory
    capture_s = time.perf_counter() - start
    triton_backend = runner.attention_backend
    graphs = runner.cuda_graphs
    seqs = Seqs([context + 1] * max_batch, num_blocks=blocks_per_seq * max_batch + 1, block_size=ctx.block_size,
                seed=5, vocab=runner.vocab_size)
    start = time.perf_counter()
    per_step = max(1, ctx.prefill_tokens // context)
    for first in range(0, max_batch, per_step):  # prefill the contexts (triton extend path, eager)
        runner.forward(seqs.plan([(i, context) for i in range(first, min(max_batch, first + per_step))]))
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    print(f"prefilled {max_batch} x {context} tokens in {time.perf_counter() - start:.1f} s; graphs captured in "
          f"{capture_s:.1f} s", flush=True)
    torch_backend = TorchAttentionBackend()
    for batch in batches:
        plan = seqs.plan([(i, 1) for i in range(batch)], advance=False)  # the same step, repeated

        def bench_one(batch=batch, plan=plan) -> dict:
            timings, logits = {}, {}
            for mode in ("torch_eager", "triton_eager", "triton_graphs"):
                use_backend(runner, torch_backend if mode == "torch_eager" else triton_backend)
                runner.cuda_graphs = graphs if mode == "triton_graphs" else None
                logits[mode] = runner.forward(plan).clone()
                timings[mode] = round(time_steps(lambda: runner.forward(plan), ctx.device, ctx.iters), 3)
            runner.cuda_graphs = graphs
            use_backend(runner, triton_backend)
            replays_before = graphs.num_replays
            runner.forward(plan)
            assert graphs.num_replays == replays_before + 1, "the graph path did not replay"
            ref = logits["torch_eager"]
            agree = {m: round(float((logits[m].argmax(-1) == ref.argmax(-1)).float().mean()), 3)
                     for m in ("triton_eager", "triton_graphs")}
            diffs = {m: round(max_diff(logits[m], ref), 4) for m in ("triton_eager", "triton_graphs")}
            diffs["graphs_vs_triton_eager"] = round(max_diff(logits["triton_graphs"], logits["triton_eager"]), 4)
            scale = float(ref.abs().max())
            print(f"batch {batch:4d}, context {context}: ms/step " + ", ".join(f"{m} {t:.3f}" for m, t in timings.items())
                  + f"; graphs speedup x{timings['triton_eager'] / timings['triton_graphs']:.2f} over triton eager",
                  flush=True)
            details = {"batch": batch, "context": context, "ms_per_step": timings, "argmax_agreement": agree,
                       "max_abs_diff_vs_torch": diffs, "max_abs_logit": round(scale, 3)}
            assert all(d <= 0.05 * scale + 0.05 for d in diffs.values()), f"logits disagree: {diffs} (max |logit| {scale:.3g})"
            assert all(a >= 0.9 for a in agree.values()), f"argmax agreement too low: {agree}"
            return details

        check(f"bench_1b_bs{batch}", bench_one)


# -- main --------------------------------------------------------------------------------------------


class Ctx:
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", str(REPO / ".cache")), "gpu_selfcheck.json"))
    ap.add_argument("--batches", default="1,8,32,64,128,256", help="decode batch sizes to time on the 1B shape")
    ap.add_argument("--context", type=int, default=1024, help="context tokens per sequence in the 1B timing")
    ap.add_argument("--iters", type=int, default=30, help="timed decode steps per batch size and mode")
    ap.add_argument("--skip-bench", action="store_true", help="correctness checks only")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--reference-kernels", action="store_true", help="when the triton kernels are unavailable, "
                    "run the triton backend on its torch reference functions (checks the graph logic alone)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="check this script on CPU (reference kernels, "
                    "emulated graphs, a tiny bench model)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    ctx = Ctx()
    ctx.dry_run = args.dry_run_cpu
    ctx.allow_reference = ctx.dry_run or args.reference_kernels
    ctx.device = torch.device("cpu" if ctx.dry_run else "cuda")
    ctx.block_size = 16
    ctx.max_model_len = 2048
    ctx.context = args.context if not ctx.dry_run else 40
    ctx.iters = args.iters if not ctx.dry_run else 2
    ctx.prefill_tokens = 8192
    ctx.bench_dtype = "bfloat16" if not ctx.dry_run else "float32"
    ctx.engine_memory_utilization = 0.35
    if not ctx.dry_run and not torch.cuda.is_available():
        print("FAIL: no CUDA device (use --dry-run-cpu to check the script on CPU)")
        return 1
    batches = [int(b) for b in args.batches.split(",")] if not ctx.dry_run else [1, 3, 8]

    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if ctx.device.type == "cuda":
        versions["gpu"] = torch.cuda.get_device_name()
    print(f"versions: {versions}", flush=True)

    kernels, why = triton_attention_kernels()

    def kernels_import():
        assert kernels is not None, why
        return {"module": kernels.__file__, "decode_workspace": hasattr(kernels, "decode_workspace")}

    if not ctx.dry_run:
        check("kernels_import", kernels_import)
    if ctx.dry_run:  # exercise the kernel checks' code on the reference functions
        from types import SimpleNamespace

        kernels = SimpleNamespace(paged_decode_attention=_reference_paged_decode_attention,
                                  paged_extend_attention=_reference_paged_extend_attention)
    if kernels is not None:
        for dtype in (torch.float32, torch.bfloat16):
            for heads, kv_heads, head_dim in ((32, 8, 64), (4, 2, 16), (16, 4, 128), (8, 8, 64)):
                tag = f"{str(dtype)[6:]}_h{heads}_kv{kv_heads}_d{head_dim}"
                check(f"decode_kernel_{tag}", check_decode_kernel, kernels, ctx.device, dtype, heads, kv_heads, head_dim)
                check(f"extend_kernel_{tag}", check_extend_kernel, kernels, ctx.device, dtype, heads, kv_heads, head_dim)
        if not ctx.dry_run:
            check("decode_kernel_graph", check_decode_kernel_graph, kernels, ctx.device)
    else:
        print("kernel checks skipped: the kernels module is unavailable" + (
            "; --reference-kernels: the runner checks below run the torch reference functions" if ctx.allow_reference
            else "; the triton runner checks below FAIL (rerun with --reference-kernels to check the graphs alone)"),
            flush=True)

    tiny = load_script("make_tiny_models").make_all(REPO / ".cache" / "tiny_models")
    for name in ("llama-gqa-tied", "qwen3-qknorm"):
        check(f"tiny_triton_vs_torch_{name}", check_tiny_triton_vs_torch, ctx, tiny[name])
    check("tiny_graphs_vs_torch", check_tiny_graphs_vs_torch, ctx, tiny["llama-gqa-tied"])
    check("tiny_graph_tokens", check_tiny_graph_tokens, ctx, tiny["llama-gqa-tied"])

    bench_model, bench_format = (LLAMA_1B, "dummy") if not ctx.dry_run else (tiny["llama-gqa-tied"], "auto")
    if not args.skip_engine:
        check("engine_auto", check_engine_auto, ctx, bench_model, bench_format)
    if not args.skip_bench:
        try:
            bench_1b(ctx, bench_model, bench_format, batches)
        except Exception as error:  # noqa: BLE001 - setup failed: one FAIL line, not a crash
            RESULTS.append({"check": "bench_1b_setup", "status": "FAIL", "error": f"{type(error).__name__}: {error}",
                            "traceback": traceback.format_exc()})
            print(traceback.format_exc(), flush=True)
            print(f"FAIL bench_1b_setup {type(error).__name__}: {error}", flush=True)

    print("\n=== summary", flush=True)
    for result in RESULTS:
        extra = result.get("error") or result.get("ms_per_step") or ""
        print(f"{result['status']} {result['check']} {extra}", flush=True)
    failed = [r["check"] for r in RESULTS if r["status"] != "PASS"]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"versions": versions, "results": RESULTS}, indent=1, default=str))
    print(f"results: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
