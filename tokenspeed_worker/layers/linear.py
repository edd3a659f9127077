"""Linear layers, with the fused (stacked) projections the models load HF weights into.

HF checkpoints store q_proj, k_proj and v_proj (and gate_proj, up_proj) as separate
matrices; one fused matmul is faster, so the loader copies each shard into its rows
of the fused weight through `weight_loader(param, loaded, shard_id)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), weights in HF's [out_features, in_features] layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears sharing one input, stacked along the output dimension."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        # The loader finds the shard-aware copy on the parameter itself (as vLLM does).
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str) -> None:
        index = self.shard_index(shard_id)
        offset, size = self.shard_offsets[index], self.output_sizes[index]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: {tuple(target.shape)} vs {tuple(loaded.shape)}")
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards are named "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id]
