"""Compile-ahead mode: the Triton kernels a block of code would launch compile side by side.

Triton compiles a kernel variant at its first launch, one after another. Within `compiling()`,
the kernels launched through `launch` are handed to Triton's asynchronous compilation instead
(triton.runtime._async_compile.AsyncCompileMode: `warmup` submits the compile to an executor and
launches nothing), on a pool of threads; on leaving the block every compile has finished and the
real launches after it find their kernels compiled. Triton ships the mode but no pool: hence this
module. Used where a start compiles many variants at once: the small-batch GEMV configurations a
site is about to time (kernels/gemv.py), the attention variants warmed up before serving
(layers/attention/triton_backend.py). What the kernels would compute is never computed in the
mode: callers discard those outputs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tokenspeed_worker.kernels.norm import AVAILABLE, interpreting

COMPILE_THREADS = 8  # at most os.cpu_count(); ptxas runs as its own process, so compiles overlap at least there
_active = False
_pool = None


def available() -> bool:
    """Whether the mode does anything here (Triton installed and compiling, not interpreting)."""
    return AVAILABLE and not interpreting()


def active() -> bool:
    """Whether launches are compile-only now (inside `compiling`)."""
    return _active


@contextmanager
def compiling() -> Iterator[None]:
    """Within the block, `launch` compiles what it would launch and launches nothing; on leaving,
    every compile submitted has finished (one that failed is left for the real launch to compile
    and report). A no-op where the mode is not `available`, or inside another such block."""
    global _active, _pool
    if not available() or _active:
        yield
        return
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, min(COMPILE_THREADS, os.cpu_count() or 1)), thread_name_prefix="compile")
    _active = True
    try:
        with AsyncCompileMode(_pool, ignore_errors=True):
            yield
    finally:
        _active = False


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """kernel[grid](*args, **meta), or (inside `compiling`) its compile submitted."""
    if _active:
        kernel.warmup(*args, grid=grid, **meta)
    else:
        kernel[grid](*args, **meta)


__all__ = ["COMPILE_THREADS", "active", "available", "compiling", "launch"]
