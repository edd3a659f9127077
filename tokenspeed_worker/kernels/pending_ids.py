"""Triton resolution of pending input ids, one kernel: with overlap scheduling a plan's input id
-1 - i stands for sample i of the previous step, which only the device knows yet
(model_executor/cuda_graph.resolve_pending_ids). The torch expression of the same thing,
`where(ids < 0, last[(-1 - ids).clamp(min=0)], ids)`, is five kernels, each a launch boundary
in a short batch-1 step.

Importable without triton (CPU machines): AVAILABLE says whether the kernel can be used.
"""

from __future__ import annotations

import torch

from tokenspeed_worker.kernels.norm import AVAILABLE

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _resolve_pending_kernel(ids_ptr, last_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        pending = ids < 0
        sampled = tl.load(last_ptr + (-1 - ids), mask=ok & pending, other=0)
        tl.store(out_ptr + offs, tl.where(pending, sampled.to(ids.dtype), ids), mask=ok)


def resolve_pending_ids(input_ids: torch.Tensor, last_sampled: torch.Tensor) -> torch.Tensor:
    """input_ids (1-d, int64) with each -1 - i replaced by last_sampled[i]; a new tensor."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    if input_ids.dim() != 1 or last_sampled.dim() != 1:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and last_sampled {tuple(last_sampled.shape)} must be 1-d")
    ids = input_ids if input_ids.is_contiguous() else input_ids.contiguous()
    out = torch.empty_like(ids)
    n = ids.shape[0]
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _resolve_pending_kernel[(triton.cdiv(n, block),)](ids, last_sampled, out, n, BLOCK=block)
    return out
