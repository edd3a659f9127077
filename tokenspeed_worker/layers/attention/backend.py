"""The one interface every attention backend implements.

Per step the runner calls `build_metadata` once (index math shared by all layers);
per layer, `Attention` calls `forward`, which writes the step's K/V into the paged
cache at the slot mapping and attends each request's query tokens over its whole
sequence (context + query) through its block table. A backend with
`supports_prewritten_kv` also offers `attend`, the same without the write, for callers
that wrote K/V already (the fused rotary + KV-write kernel).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_worker.scheduler.plan import SchedulePlan


@dataclass
class AttentionInputs:
    """A step's attention inputs: the host plan, and its arrays already on the device."""

    plan: SchedulePlan  # host arrays, for backends that plan on the host (and for max lengths)
    query_lens: torch.Tensor  # int32 [B]
    context_lens: torch.Tensor  # int32 [B]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, W]
    block_size: int

    @classmethod
    def of(cls, plan: SchedulePlan, device: torch.device, block_size: int,
           slot_mapping: torch.Tensor | None = None) -> "AttentionInputs":
        """The plan's arrays copied to `device` (non-blocking); `slot_mapping` where the slots are on
        the device already (a CUDA graph's static buffer)."""

        def to_device(array, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device, non_blocking=True)

        return cls(plan=plan, query_lens=to_device(plan.query_lens, np.int32),
                   context_lens=to_device(plan.context_lens, np.int32),
                   slot_mapping=to_device(plan.slot_mapping, np.int64) if slot_mapping is None else slot_mapping,
                   block_tables=to_device(plan.block_tables, np.int32), block_size=block_size)


class GraphHoles:
    """The metadata a model's attention calls receive while a piecewise CUDA graph is captured
    (model_executor/piecewise_graph.py): `Attention` hands each call's work to `hole` instead of
    running it, and kernels before attention that write K/V themselves take `slot_mapping`."""

    slot_mapping: torch.Tensor  # int64 [T] the step's static slots

    def hole(self, attend, *tensors: torch.Tensor, into=None) -> torch.Tensor:
        """attend(metadata, *tensors) -> the attention output; run outside the graphs. With `into`
        (shape, dtype): attend(metadata, out, *tensors) writes it into `out`, a buffer of that shape."""
        raise NotImplementedError


class AttentionBackend(ABC):
    name: str
    # Whether decode steps can be captured as CUDA graphs: `decode_graph_metadata` must then
    # build metadata from device tensors alone (no host values that change between steps).
    supports_cuda_graphs: bool = False
    # Whether `attend` can run over K/V the caller already wrote into the cache at the metadata's
    # `slot_mapping` (the fused rotary + KV-write kernel, Attention.forward_with_rotary), in
    # place of `forward`, which writes them itself.
    supports_prewritten_kv: bool = False
    # Whether `forward` (and `attend`, `attend_rotary` where offered) takes `window` (attend to the
    # last `window` positions) and `softcap` (tanh-capped scores), for layers that have them
    # (Attention.sliding_window, .logit_softcap).
    supports_windows_and_softcap: bool = False
    # Whether `attend` takes `out` (a [T, num_heads, head_dim] buffer it writes and returns).
    attends_into: bool = False
    # The model's attention shape, told once by the runner (`setup`).
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    block_size: int = 0

    def setup(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = num_heads, num_kv_heads, head_dim, block_size

    def configure(self, dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """The model's activation dtype, the cache's dtype and the attention scale, told once by the
        runner; for backends that plan ahead of the layers (flashinfer). Default: nothing."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K cache (and of its V cache)."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> object:
        """Everything the step's attention calls share; called once per step."""

    def decode_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> object:
        """Metadata of a decode-only batch (one query token per row) whose inputs live in a CUDA
        graph's static buffers: slot_mapping int64 [B], block_tables int32 [B, W], seq_lens int32 [B]."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run under CUDA graphs")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        """Store k, v at the step's slots, then return attention output [T, num_heads, head_dim]."""

    # Whether attend_rotary takes q_norm / k_norm (RMSNorm layers over each head, applied before
    # the rotary); backends without it get q and k normalized.
    fuses_head_norms: bool = False

    def fuses_rope(self, metadata: object) -> bool:
        """Whether `attend_rotary` serves this step: the rotary and the KV write done inside the
        attention kernel (Attention.forward_with_rotary). Default: never."""
        return False

    def attend_rotary(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], unrotated
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], unrotated
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        positions: torch.Tensor,  # [T]
        cos_cache: torch.Tensor,  # float32 [max_position, head_dim]: rotary over the whole head
        sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary on q and k, k and v written at the step's slots, and attention -> [T, num_heads,
        head_dim], in the attention kernel itself (steps where `fuses_rope`)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not fuse the rotary")

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        """Attention output [T, num_heads, head_dim] over the cache, whose slots at
        `metadata.slot_mapping` already hold the step's K/V (backends with supports_prewritten_kv)."""
        raise NotImplementedError(f"attention backend {self.name!r} writes K/V itself: call forward")
