"""Linear layers, with the fused (stacked) projections the models load HF weights into, split for
tensor parallelism.

HF checkpoints store q_proj, k_proj and v_proj (and gate_proj, up_proj) as separate
matrices; one fused matmul is faster, so the loader copies each shard into its rows
of the fused weight through `weight_loader(param, loaded, shard_id)`.

Tensor parallelism (tokenspeed_worker/distributed.py; a group size of 1 changes nothing):
- column-parallel (`MergedLinear`, `QKVLinear`): each rank holds its slice of the output rows of
  every stacked matrix (its attention heads; KV heads are replicated when there are fewer of them
  than ranks) and computes its slice of the output, no communication;
- row-parallel (`RowParallelLinear`: o_proj, down_proj): each rank holds a slice of the input
  columns, matching the column-parallel layer before it; the partial products are summed with one
  all-reduce, then the bias is added once;
- vocabulary-parallel (`VocabParallelEmbedding`, the LM head in models/llama.py): each rank holds a
  slice of the vocabulary rows (padded to a multiple of the group size); lookups outside it give 0
  and one all-reduce completes them; the LM head's logits are gathered across ranks.
Every loader narrows the full checkpoint tensor to this rank's part and returns how many elements
it filled, so a model can check that every parameter was filled exactly once.

Quantized checkpoints (layers/quantization/): a layer built while a model runner builds with a
quantization config takes its method (`quant_method`), which creates its weight and scales
(loaded by the same loaders), processes them after loading and runs the product; layers the
config ignores, and every layer of an unquantized model, keep `quant_method = None` and the
paths below unchanged.

For steps of few rows each projection asks the small-batch GEMV chooser current when it was built
(layers/small_batch_gemv.py; a model runner's) whether a kernel of kernels/gemv.py runs it, with
a pending norm before it (layers/layernorm.PendingNorm) and, for gate_up, SiLU·mul or GELU-tanh·mul folded in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_worker import distributed
from tokenspeed_worker.layers import small_batch_gemv
from tokenspeed_worker.layers.activation import GatedActivation, GeluTanhAndMul, PendingActivation, SiluAndMul
from tokenspeed_worker.layers.layernorm import PendingNorm
from tokenspeed_worker.layers.quantization import methods as quant_methods

if TYPE_CHECKING:
    from tokenspeed_worker.layers.attention.layer import Attention
    from tokenspeed_worker.layers.rotary import RotaryEmbedding


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> int:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)
    return param.numel()


def load_into(param: nn.Parameter, loaded: torch.Tensor) -> int:
    """A non-stacked parameter's loader: its own (sharding) one if it has one, else an exact copy."""
    loader = getattr(param, "shard_loader", None)
    return loader(param, loaded) if loader is not None else default_weight_loader(param, loaded)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts} "
                         f"(--tensor-parallel-size)")
    return total // parts


class Linear(nn.Module):
    """y = x W^T (+ b), weights in HF's [out_features, in_features] layout (replicated on every rank).

    prefix: the layer's module name ("model.layers.0.mlp.down_proj"), fused from the checkpoint
    modules `shard_names` (default [prefix]); used to pick its quantization method (ignore lists).
    `output_sizes`: this rank's rows of each stacked matrix (subclasses; default [out_features])."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prefix: str = "",
                 shard_names: list[str] | None = None, output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # None: unquantized (also every layer a quantization config ignores).
        self.quant_method = quant_methods.linear_method(prefix, shard_names)
        self.checkpoint_modules = shard_names or [prefix]  # the checkpoint's modules this layer loads
        # Set by an FP8 method that keeps its weight in FP8 (CUDA): float32 [out_features], one
        # scale per weight row; None while the weight holds the values themselves.
        self.weight_scale_rows: torch.Tensor | None
        self.register_buffer("weight_scale_rows", None, persistent=False)
        # Or, for block-wise FP8 kept as it is: float32 [ceil(N / rows), ceil(K / cols)], one scale
        # per weight_block_rows x weight_block_cols tile.
        self.weight_scale_blocks: torch.Tensor | None
        self.register_buffer("weight_scale_blocks", None, persistent=False)
        self.weight_block_rows = 1
        self.weight_block_cols = 0
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
        else:
            self.quant_method.create_weights(self, in_features, output_sizes or [out_features])
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # A plain attribute (not a submodule): None runs every product with dense_product. The
        # small-batch GEMV kernels read 16-bit weights, or FP8 ones with their row or block scales.
        self.gemv: small_batch_gemv.SmallBatchGemv | None = small_batch_gemv.current()

    def forward(self, x: torch.Tensor | PendingNorm | PendingActivation) -> torch.Tensor:
        """x W^T (+ b); x may be a pending norm or activation, folded into the product where that is
        faster."""
        if isinstance(x, PendingNorm):
            if self.gemv is None:
                out, residual = self.norm_product(x)
            else:
                out, residual = self.gemv.norm_linear(x, self)
            x.folded(residual)
            return out
        return self._product(x, self.bias)

    def norm_product(self, pending: PendingNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(this product of the pending norm's output, its residual stream) without the small-batch
        kernels: the quantization method may take the norm into its activation quantization (FP8:
        one kernel normalizes and quantizes each row); else the norm, then `forward`."""
        if self.quant_method is not None:
            fused = self.quant_method.apply_normed(self, pending, self.bias)
            if fused is not None:
                return fused
        hidden, residual = pending.normalize()
        return self._product(hidden, self.bias), residual  # forward's plain-tensor path, without a second module call

    def dense_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) without the small-batch kernels: the quantization method's product, or F.linear."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return F.linear(x, self.weight, bias)

    def _product(self, x: torch.Tensor | PendingActivation, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): dense_product, or a small-batch GEMV kernel for few rows where the chooser
        takes it. A pending activation is applied first, or, where the quantization method takes
        it (FP8, rows past the small-batch kernels), folded into its input quantization."""
        if isinstance(x, PendingActivation):
            if self.quant_method is not None and (self.gemv is None or not self.gemv.takes(x.gate_up, self)):
                out = self.quant_method.apply_activated(self, x, bias)
                if out is not None:
                    return out
            x = x.apply()
        if self.gemv is None:
            return self.dense_product(x, bias)
        return self.gemv.linear(x, self, bias)

    @torch.no_grad()
    def scale_output_rows(self, factor: float, rows: slice = slice(None), bias: bool = True) -> None:
        """Make output rows `rows` (this rank's) `factor` times what they were: W[rows], and b[rows]
        when `bias`. A weight kept in FP8 takes it in its row scales (exact); a 16-bit one is
        rounded to its dtype once. Called once after loading (kv_scales' fold), never while serving."""
        if self.weight.dtype == torch.float8_e4m3fn:  # kept FP8: its scales take the factor
            self.quant_method.scale_output_rows(self, factor, rows)
        else:
            self.weight.data[rows] = (self.weight.data[rows].float() * factor).to(self.weight.dtype)
        if bias and self.bias is not None:
            self.bias.data[rows] = (self.bias.data[rows].float() * factor).to(self.bias.dtype)


class MergedLinear(Linear):
    """Several linears sharing one input, stacked along the output dimension; column-parallel: each
    rank holds rows [rank * size / tp, (rank + 1) * size / tp) of every stacked matrix."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, prefix: str = "",
                 shard_names: list[str] | None = None) -> None:
        tp = distributed.size()
        self.full_sizes = list(output_sizes)
        local = [_divide(size, tp, "an output size") for size in output_sizes]
        super().__init__(in_features, sum(local), bias, prefix, shard_names, local)
        self.output_sizes = local
        self.shard_offsets = [sum(local[:i]) for i in range(len(local))]
        # The loader finds the shard-aware copy on the parameter itself (as vLLM does).
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor | PendingNorm,
                activation: GatedActivation | None = None) -> torch.Tensor | PendingActivation:
        """activation(x W^T (+ b)). With a pending norm, few rows and SiLU·mul or GELU-tanh·mul over
        [gate | up] (gate_up_proj), norm, product and activation may run as one kernel; otherwise the
        activation is returned pending (PendingActivation) for the down projection to apply or fold
        into its FP8 input quantization."""
        if activation is None:
            return super().forward(x)
        if (isinstance(x, PendingNorm) and self.gemv is not None and isinstance(activation, (SiluAndMul, GeluTanhAndMul))
                and self.gemv.takes(x.x, self)):
            out, residual = self.gemv.norm_gate_up_act(x, self, activation)
            x.folded(residual)
            return out
        return PendingActivation(super().forward(x), activation)

    def shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    def source_rows(self, index: int) -> tuple[int, int]:
        """(start, count) of the checkpoint matrix `index`'s rows this rank holds."""
        count = self.output_sizes[index]
        return distributed.rank() * count, count

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str) -> int:
        index = self.shard_index(shard_id)
        offset, size = self.shard_offsets[index], self.output_sizes[index]
        target = param.data.narrow(0, offset, size)
        if loaded.shape[0] != self.full_sizes[index] or loaded.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: expected {(self.full_sizes[index], *target.shape[1:])}, "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        start, count = self.source_rows(index)
        target.copy_(loaded.narrow(0, start, count))
        return target.numel()


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards are named "q", "k", "v". Each rank holds
    num_heads / tp query heads and num_kv_heads / tp KV heads, or, with fewer KV heads than ranks,
    the one KV head its query heads use (replicated across the ranks sharing it)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 prefix: str = "", shard_names: list[str] | None = None) -> None:
        tp = distributed.size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = distributed.rank() * self.num_kv_heads
        else:
            if tp % num_kv_heads:
                raise ValueError(
                    f"num_key_value_heads ({num_kv_heads}) must divide the tensor-parallel size {tp} when smaller")
            self.num_kv_heads = 1
            self.kv_head_start = distributed.rank() * num_kv_heads // tp
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # Build with the full sizes scaled to what this rank holds (MergedLinear divides by tp).
        Linear.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, prefix, shard_names,
                        [self.q_size, self.kv_size, self.kv_size])
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.output_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.shard_offsets = [0, self.q_size, self.q_size + self.kv_size]
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def forward_rotary(self, x: torch.Tensor | PendingNorm, positions: torch.Tensor, rotary_emb: RotaryEmbedding,
                       attn: Attention, attn_metadata: object) -> torch.Tensor | None:
        """Rotated q [T, H, D], with the rotated k and the v written into attn's KV cache, where one
        small-batch GEMV kernel does the pending norm, this projection, rotary and the write faster;
        else None (nothing ran: project, then rotate)."""
        if self.gemv is None or not isinstance(x, PendingNorm):
            return None
        fused = self.gemv.norm_qkv_rope(x, self, rotary_emb, attn, positions, attn_metadata)
        if fused is None:
            return None
        q, residual = fused
        x.folded(residual)
        return q

    def shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id]

    def source_rows(self, index: int) -> tuple[int, int]:
        if index == 0:
            return distributed.rank() * self.q_size, self.q_size
        return self.kv_head_start * self.head_dim, self.kv_size


class RowParallelLinear(Linear):
    """y = all_reduce(x_local W_local^T) (+ b): each rank holds in_features / tp input columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prefix: str = "") -> None:
        self.full_in_features = in_features
        super().__init__(_divide(in_features, distributed.size(), "an input size"), out_features, bias, prefix)
        self.weight.shard_loader = self._load_weight

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> int:
        if tuple(loaded.shape) != (self.out_features, self.full_in_features):
            raise ValueError(f"shape mismatch: expected {(self.out_features, self.full_in_features)}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(1, distributed.rank() * self.in_features, self.in_features))
        return param.numel()

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial product, to be summed with others' by one all-reduce the
        caller makes (a layer's sum of several row-parallel outputs); only without a bias."""
        if distributed.size() == 1:
            return self._product(x, self.bias)
        if not reduce:
            if self.bias is not None:
                raise ValueError("a row-parallel layer with a bias cannot leave its all-reduce to the caller")
            return self._product(x, None)
        y = distributed.all_reduce(self._product(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embeddings; each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = distributed.size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp)
        self.start = distributed.rank() * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        self.weight.shard_loader = self._load_weight

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> int:
        if tuple(loaded.shape) != (self.num_embeddings, param.shape[1]):
            raise ValueError(f"shape mismatch: expected {(self.num_embeddings, param.shape[1])}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        count = max(0, min(self.rows_per_rank, self.num_embeddings - self.start))
        param.data.zero_()
        param.data[:count].copy_(loaded.narrow(0, self.start, count))
        return param.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if distributed.size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return distributed.all_reduce(out)


class ParallelLMHead(nn.Module):
    """logits = x W^T over the vocabulary; each rank computes its vocabulary rows, then they are
    gathered (and the padding dropped). May share its weight with a VocabParallelEmbedding (tied)."""

    def __init__(self, embedding_dim: int, num_embeddings: int, embedding: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        if embedding is not None:
            self.weight = embedding.weight
        else:
            shard = VocabParallelEmbedding(num_embeddings, embedding_dim)
            self.weight = shard.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if distributed.size() == 1:
            return logits
        return distributed.all_gather_last_dim(logits)[..., : self.num_embeddings]
