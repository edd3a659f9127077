"""The machine's physical limits, measured in the same run as a benchmark.

- copy bandwidth: bytes read + written per second by a large device-to-device copy;
- matmul throughput: dense FLOP/s of a large square matmul in the model's dtype, and of the FP8
  GEMM the FP8 linear layers run (row-wise scaled cuBLASLt, CUDA 9.0+ only).
Benchmarks report their results as fractions of these.
"""

from __future__ import annotations

import time

import torch


def _timed(fn, device: torch.device, iters: int) -> float:
    """Best time of `iters` runs (after one warm-up), synchronizing on a GPU."""
    fn()
    best = float("inf")
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: str | torch.device = "cpu", nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Bytes moved per second (read + write) by copying a `nbytes` tensor."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / t


def matmul_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, n: int = 8192,
                 iters: int = 5) -> float:
    """Dense matmul FLOP/s at n x n x n (smaller on a CPU, where 8192^3 takes too long)."""
    device = torch.device(device)
    if device.type == "cpu":
        n, dtype = min(n, 1024), torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _timed(lambda: a @ b, device, iters)
    return 2 * n**3 / t


def fp8_matmul_flops(device: str | torch.device = "cuda", n: int = 8192, iters: int = 5) -> float | None:
    """FLOP/s of the FP8 linear layers' GEMM (kernels/fp8.scaled_mm: e4m3 operands, row-wise
    scales, bf16 output) at n x n x n; None where it does not run (a CPU, a GPU before Hopper)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    from tokenspeed_worker.kernels import fp8

    a, s_a = fp8.quantize_rows(torch.randn(n, n, device=device, dtype=torch.bfloat16))
    b, s_b = fp8.quantize_weight_rows(torch.randn(n, n, device=device, dtype=torch.bfloat16))
    t = _timed(lambda: fp8.scaled_mm(a, s_a, b, s_b), device, iters)
    return 2 * n**3 / t
