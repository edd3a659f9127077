"""Device time of a piece of a decode step, measured the way a step runs it: for the choices made
at startup by timing (layers/small_batch_gemv.py's kernel configurations, the decode attention's
single-split threshold in layers/attention/triton_backend.py), and of the whole step
(back_to_back_us, for SmallBatchGemv.tune_in_step through DecodeGraphs.step_timer).

The piece is captured into a CUDA graph (no Python launch overhead, as inside a captured decode
step) and replayed REPS times under CUDA events, with L2 flushed before each replay (weights and KV
come from memory, as they do when every layer runs in turn); the median is the result. Written
here rather than taken from triton.testing: its do_bench flushes L2 but times eager launches (the
launch overhead a graph removes), and its do_bench_cudagraph times a graph of many calls with no
flush between them (weights and KV then come from L2, which a decode step never gets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WARMUP, REPS = 2, 10
ROUND_SECONDS = 0.05  # back_to_back_us: replays per timing round, about this long


def l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer twice the size of the device's L2: zeroing it evicts whatever L2 held."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
    return torch.empty(2 * l2, dtype=torch.int8, device=device)


def time_us(fn: Callable[[], Any], flush: torch.Tensor, warmup: int = WARMUP, reps: int = REPS) -> float:
    """Median device microseconds of one replay of `fn` captured into a CUDA graph, L2 flushed
    before each replay (`flush` from l2_flush_buffer)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    del graph
    return 1000.0 * times[len(times) // 2]


def back_to_back_us(fn: Callable[[], Any], round_seconds: float = ROUND_SECONDS) -> float:
    """Device microseconds of one replay of `fn` captured into a CUDA graph and replayed back to back,
    as a steady decode replays its step (no flush: a whole step streams more than L2 holds): the
    best of two rounds of about `round_seconds` each, after a short round that sizes them. `fn` has
    been run once already (compiled, its choices made); the graph is freed before returning."""
    torch.cuda.synchronize()
    # A private pool per graph: one shared pool cannot outlive the graph that made it (PyTorch 2.11
    # asserts in capture_begin once that graph is gone).
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    reps, best = 3, float("inf")
    for round_ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        us = 1000.0 * start.elapsed_time(end) / reps
        if round_:
            best = min(best, us)
        else:
            reps = max(3, min(500, int(round_seconds * 1e6 / max(us, 1.0))))
    del graph
    return best
