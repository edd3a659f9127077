"""The quantization method of one linear layer, in the shape vLLM uses: it creates the layer's
weight and scale parameters (`create_weights`), fixes them up once the checkpoint is loaded
(`process_weights_after_loading`) and runs the product (`apply`).

The Linear layers (layers/linear.py) ask `linear_method(name, shard_names)` while they are built
inside `building(quant_config)` (the model runner's); None means unquantized, which keeps the
layer's own path exactly as without quantization.

The FP8 weights (torch.float8_e4m3fn) and their float32 scales load through the layers'
weight_loader path (fused q/k/v and gate/up shards, sharded checkpoints, tensor-parallel splits:
per-channel and block scales split with their weights). Online FP8 (`QuantConfig.online`) is the
per-channel scheme fed by `quantize_online`, which turns each 16-bit checkpoint weight of a
quantized layer into its FP8 values and per-row scales as it streams in (on the model's device),
so the 16-bit model never sits whole in memory. After loading, each weight becomes one of two forms:

- FP8 kept (CUDA, compute capability 9.0+): the FP8 weight with one float32 scale per row
  (`Linear.weight_scale_rows`): a per-tensor scale repeated over its shard's rows, a per-channel
  scale as it is (an online weight's: max |row| / 448). The product quantizes the activations per
  token and runs kernels/fp8.scaled_mm (cuBLASLt FP8 GEMM, both scales in its epilogue), the
  quantization inside the norm kernel where the input is a pending norm (`apply_normed`) and inside
  the activation kernel where it is a pending activation (`apply_activated`); for a
  few rows the small-batch GEMV kernel reads the FP8 weight instead, with 16-bit activations. A
  checkpoint's static input scales are not used: per-token scales cost the same pass and lose less.
- FP8 kept, block-wise (the same devices, with triton, K groups of a power of two >= 32 columns,
  e.g. the usual 128 x 128 tiles): the FP8 weight with its tile scales
  (`weight_scale_blocks`, `weight_block_rows`); the product quantizes the activations per token
  and K group and runs kernels/fp8.block_scaled_mm; for a few rows the small-batch GEMV reads the
  FP8 weight with its tile scales instead, where the tiles are whole rows of tiles.
- Dequantized (elsewhere): weight x scale in the model's dtype, and the product is the layer's
  unquantized one. Correct results at the unquantized speed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_worker import distributed
from tokenspeed_worker.kernels import fp8 as fp8_kernels
from tokenspeed_worker.layers.fused_kernels import use_fused
from tokenspeed_worker.layers.quantization.base import Fp8LinearScheme, QuantConfig, UnsupportedQuantization

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
_current: QuantConfig | None = None


def current_config() -> QuantConfig | None:
    """The quantization config of the model being built (set by `building`); None outside it."""
    return _current


@contextmanager
def building(config: QuantConfig | None) -> Iterator[QuantConfig | None]:
    """Within the block, Linear layers built take their methods from `config` (None: unquantized)."""
    global _current
    previous, _current = _current, config
    try:
        yield config
    finally:
        _current = previous


def linear_method(name: str, shard_names: list[str] | None = None) -> Fp8LinearMethod | None:
    """The method of the linear layer `name` (fused from the checkpoint modules `shard_names`),
    or None when it is unquantized: no config is being built with, or the config ignores it."""
    if _current is None or not name:
        return None
    if not _current.layer_is_quantized(name, shard_names or [name]):
        return None
    return Fp8LinearMethod(_current.scheme)


def _scalar_loader(index_of):
    """A loader of per-shard scalars (per-tensor weight scales, static input scales)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> int:
        if loaded.numel() != 1:
            raise ValueError(f"a per-tensor scale must hold one value, checkpoint has {tuple(loaded.shape)}")
        param.data[index_of(shard_id)] = loaded.reshape(()).to(param.dtype)
        return 1

    return load


class Fp8LinearMethod:
    """FP8 e4m3 weights with float32 scales, as `scheme` says (see the module docstring)."""

    def __init__(self, scheme: Fp8LinearScheme) -> None:
        self.scheme = scheme

    # ---- parameters

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int]) -> None:
        """Register on `layer` its FP8 `weight` [sum(output_sizes), in_features] and its scales;
        `output_sizes`: this rank's rows of each stacked checkpoint matrix (one entry unfused)."""
        scheme = self.scheme
        layer.params_dtype = torch.get_default_dtype()
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), in_features, dtype=FP8_DTYPE), requires_grad=False)
        fused = hasattr(layer, "shard_index")

        def index_of(shard_id):
            return layer.shard_index(shard_id) if fused else 0

        if scheme.weight == "tensor":
            scale = torch.empty(len(output_sizes), dtype=torch.float32)
        elif scheme.weight == "channel":
            scale = torch.empty(sum(output_sizes), 1, dtype=torch.float32)
        else:
            rows, cols = scheme.block
            if distributed.size() > 1:
                self._check_block_split(layer, in_features, output_sizes)
            scale = torch.empty(sum(math.ceil(s / rows) for s in output_sizes), math.ceil(in_features / cols),
                                dtype=torch.float32)
        scale = nn.Parameter(scale, requires_grad=False)
        if scheme.weight == "tensor":
            loader = _scalar_loader(index_of)
        else:
            loader = self._rows_loader(layer, output_sizes)
        if fused:
            scale.weight_loader = loader
        else:
            scale.shard_loader = loader
        setattr(layer, scheme.scale_name, scale)
        layer.fp8_scale_name = scheme.scale_name
        if scheme.activation == "static":
            input_scale = nn.Parameter(torch.empty(len(output_sizes), dtype=torch.float32), requires_grad=False)
            if fused:
                input_scale.weight_loader = _scalar_loader(index_of)
            else:
                input_scale.shard_loader = _scalar_loader(index_of)
            layer.input_scale = input_scale

    def _check_block_split(self, layer: nn.Module, in_features: int, output_sizes: list[int]) -> None:
        rows, cols = self.scheme.block
        if getattr(layer, "full_in_features", None) is not None and in_features % cols:
            raise UnsupportedQuantization(
                f"weight_block_size {list(self.scheme.block)}: this rank's {in_features} input columns are not "
                "whole blocks; use a tensor-parallel size that splits the blocks evenly")
        if any(size % rows for size in output_sizes):
            raise UnsupportedQuantization(
                f"weight_block_size {list(self.scheme.block)}: this rank's output rows {output_sizes} are not "
                "whole blocks; use a tensor-parallel size that splits the blocks evenly")

    def _rows_loader(self, layer: nn.Module, output_sizes: list[int]):
        """The loader of per-channel or block scales: the rows (and, row-parallel, the block
        columns) of this rank's part, as the weight's own loader narrows the weight."""
        block = self.scheme.block
        row_unit = block[0] if block else 1

        def local_rows(index: int) -> tuple[int, int]:  # (offset, count) in the scale parameter
            counts = [math.ceil(s / row_unit) for s in output_sizes]
            return sum(counts[:index]), counts[index]

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> int:
            index = layer.shard_index(shard_id) if shard_id is not None else 0
            if block is None:
                loaded = loaded.reshape(-1, 1)
            offset, count = local_rows(index)
            target = param.data.narrow(0, offset, count)
            if hasattr(layer, "source_rows"):
                start, rows = layer.source_rows(index)
            else:
                start, rows = 0, output_sizes[0]
            if start % row_unit:
                raise ValueError(f"scale rows of shard {shard_id!r} start inside a block ({start} % {row_unit})")
            source = loaded.narrow(0, start // row_unit, count)
            full_in = getattr(layer, "full_in_features", None)
            if block is not None and full_in is not None and distributed.size() > 1:  # row-parallel: split columns
                source = source.narrow(1, distributed.rank() * layer.in_features // block[1], target.shape[1])
            if source.shape != target.shape:
                raise ValueError(f"scale shape mismatch for shard {shard_id!r}: expected {tuple(target.shape)}, "
                                 f"checkpoint gives {tuple(source.shape)} (of {tuple(loaded.shape)})")
            target.copy_(source)
            return target.numel()

        return load

    # ---- after loading, and the product

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module, keep_fp8: bool) -> None:
        """Turn the loaded weight into one of the two forms of the module docstring: FP8 with
        `weight_scale_rows` when keep_fp8 (and the scheme is not block-wise), else dequantized to
        the model's dtype. The checkpoint's scale parameters are dropped either way."""
        scheme = self.scheme
        weight, scale = layer.weight.data, getattr(layer, scheme.scale_name).data
        rows = self._row_scales(layer, scale)
        delattr(layer, scheme.scale_name)
        if scheme.activation == "static":
            delattr(layer, "input_scale")  # per-token scales instead (module docstring)
        if keep_fp8 and rows is not None:
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale_rows = rows.contiguous()  # a buffer (Linear): moves with .to()
            return
        if keep_fp8 and fp8_kernels.AVAILABLE and fp8_kernels.block_gemm_supports(scheme.block[1]):
            # block-wise: the block-scaled GEMM (K groups it cannot take are dequantized below)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale_blocks, layer.weight_block_rows = self._tile_scales(layer, scale)
            layer.weight_block_cols = scheme.block[1]
            return
        if rows is not None:
            dense = weight.to(torch.float32) * rows.unsqueeze(1)
        else:
            dense = self._dequantize_blocks(layer, weight, scale)
        layer.weight = nn.Parameter(dense.to(layer.params_dtype), requires_grad=False)

    def _row_scales(self, layer: nn.Module, scale: torch.Tensor) -> torch.Tensor | None:
        """The checkpoint's weight scales `scale` as one float32 per weight row; None for block-wise ones."""
        if self.scheme.weight == "channel":
            return scale.reshape(-1).to(torch.float32)
        if self.scheme.weight == "tensor":
            sizes = getattr(layer, "output_sizes", None) or [layer.weight.shape[0]]
            return torch.repeat_interleave(scale.to(torch.float32), torch.tensor(sizes, device=scale.device))
        return None

    def _tile_scales(self, layer: nn.Module, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the block scales as kernels/fp8.block_scaled_mm reads them, its block_rows): the
        checkpoint's tiles when every stacked shard is whole tiles, else one row per weight row."""
        rows = self.scheme.block[0]
        sizes = getattr(layer, "output_sizes", None) or [layer.weight.shape[0]]
        if all(size % rows == 0 for size in sizes):
            return scale.contiguous(), rows
        parts, offset = [], 0
        for size in sizes:
            count = math.ceil(size / rows)
            tiles = scale[offset:offset + count]
            parts.append(fp8_kernels.expand_scales(tiles, rows, 1, (size, tiles.shape[1])))
            offset += count
        return torch.cat(parts).contiguous(), 1

    @torch.no_grad()
    def scale_output_rows(self, layer: nn.Module, factor: float, rows: slice) -> None:
        """Multiply the kept-FP8 weight's output rows `rows` by `factor` through its scales (exact)."""
        if layer.weight_scale_rows is not None:
            layer.weight_scale_rows[rows] *= factor
            return
        start, stop, _ = rows.indices(layer.weight.shape[0])
        tile = layer.weight_block_rows
        if start % tile or (stop % tile and stop != layer.weight.shape[0]):  # not whole tiles: per-row scales
            blocks = layer.weight_scale_blocks
            blocks = fp8_kernels.expand_scales(blocks, tile, 1, (layer.weight.shape[0], blocks.shape[1]))
            layer.weight_scale_blocks, layer.weight_block_rows, tile = blocks.contiguous(), 1, 1
        layer.weight_scale_blocks[start // tile:-(-stop // tile)] *= factor

    def _dequantize_blocks(self, layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """weight x its block-wise scales `scale`, float32: each shard's [rows, cols] tiles by their scale."""
        rows, cols = self.scheme.block
        weight = weight.to(torch.float32)
        sizes = getattr(layer, "output_sizes", None) or [weight.shape[0]]
        offset, block_offset = 0, 0
        for size in sizes:
            count = math.ceil(size / rows)
            tiles = scale[block_offset:block_offset + count]
            weight[offset:offset + size] *= fp8_kernels.expand_scales(tiles, rows, cols, (size, weight.shape[1]))
            offset, block_offset = offset + size, block_offset + count
        return weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): the FP8 GEMM over per-token quantized x where the weight is FP8, else F.linear."""
        if layer.weight.dtype != FP8_DTYPE:
            return F.linear(x, layer.weight, bias)
        if layer.weight_scale_blocks is not None:
            group = self.scheme.block[1]
            q, scale = fp8_kernels.quantize_groups(x, group)
            out = fp8_kernels.block_scaled_mm(q, scale, layer.weight, layer.weight_scale_blocks,
                                              layer.weight_block_rows, group, bias, x.dtype)
            return out.view(*x.shape[:-1], out.shape[-1])
        q, scale = fp8_kernels.quantize_rows(x)
        out = fp8_kernels.scaled_mm(q, scale, layer.weight, layer.weight_scale_rows, bias, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply_activated(self, layer: nn.Module, pending, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`apply` of a pending activation's output (layers/activation.PendingActivation: a down
        projection's input) with the activation and the per-token quantization in one kernel (the
        same bits as the activation, then quantize_rows), where the weight is FP8 with row scales;
        else None (the caller applies the activation, then `apply`)."""
        if layer.weight.dtype != FP8_DTYPE or layer.weight_scale_blocks is not None:
            return None
        quantized = pending.quantized()
        if quantized is None:
            return None
        x = pending.gate_up
        out = fp8_kernels.scaled_mm(*quantized, layer.weight, layer.weight_scale_rows, bias, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply_normed(self, layer: nn.Module, pending, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`apply` of the pending norm's output, its residual stream) with the norm and the per-token
        quantization in one kernel (kernels/norm.add_rms_norm_quantized: the same bits as the norm,
        then quantize_rows), where the weight is FP8 with row scales and the norm kernel takes the
        norm (Llama's form, the fused kernels on); else None (the caller normalizes, then `apply`)."""
        x, norm = pending.x, pending.norm
        if (layer.weight.dtype != FP8_DTYPE or layer.weight_scale_blocks is not None or norm.unit_offset
                or pending.x_norm is not None):
            return None
        kernels = use_fused(x, "norm")
        if kernels is None or norm.weight.dtype != x.dtype or not norm._fusable(x, pending.residual_in, kernels.MAX_HIDDEN):
            return None
        q, scale, residual = kernels.add_rms_norm_quantized(x, pending.residual_in, norm.weight, norm.eps)
        out = fp8_kernels.scaled_mm(q, scale, layer.weight, layer.weight_scale_rows, bias, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1]), residual


def online_modules(model: nn.Module) -> set[str]:
    """The checkpoint module names ("model.layers.0.self_attn.q_proj") whose weights online FP8
    quantizes: those of every quantized Linear layer (its `checkpoint_modules`)."""
    return {name for m in model.modules() if getattr(m, "quant_method", None) is not None
            for name in m.checkpoint_modules}


def quantize_online(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream `weights` with each 16-bit weight of a quantized layer replaced by its
    FP8 values and per-row scales (`<module>.weight`, `<module>.weight_scale`), quantized on
    `device` as they stream in; every other tensor passes through."""
    quantized = online_modules(model)
    for name, tensor in weights:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module not in quantized:
            yield name, tensor
            continue
        q, scale = fp8_kernels.quantize_weight_rows(tensor.to(device))
        yield name, q
        yield f"{module}.weight_scale", scale


def keeps_fp8(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on `device` (FP8 tensor-core GEMMs with row-wise scales:
    CUDA compute capability 9.0+); elsewhere they are dequantized at load."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@torch.no_grad()
def _check_block_gemm(layers: list[nn.Module]) -> None:
    """Run the first block-wise layer's GEMM once on a few random rows against its torch reference;
    should the two disagree (a kernel this GPU, driver or Triton miscompiles), log it and run every
    block-wise layer dequantized instead: slower, never wrong."""
    if not layers:
        return
    layer = layers[0]
    group = layer.quant_method.scheme.block[1]
    x = torch.randn(5, layer.weight.shape[1], device=layer.weight.device, dtype=layer.params_dtype)
    q, scale = fp8_kernels.quantize_groups(x, group)
    args = (q, scale, layer.weight, layer.weight_scale_blocks, layer.weight_block_rows, group)
    got = fp8_kernels.block_scaled_mm(*args, out_dtype=torch.float32)
    expected = fp8_kernels.block_scaled_mm_reference(*args, out_dtype=torch.float32)
    error = ((got - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    if error < 1e-3:  # float32 output: only the order of the sums differs
        return
    logger.error("FP8: the block-scaled GEMM disagrees with its reference on this device (relative error %.3g); "
                 "the %d block-wise layers run dequantized to %s instead", error, len(layers), layer.params_dtype)
    for layer in layers:
        scales = fp8_kernels.expand_scales(layer.weight_scale_blocks, layer.weight_block_rows,
                                           layer.quant_method.scheme.block[1], layer.weight.shape)
        dense = (layer.weight.to(torch.float32) * scales).to(layer.params_dtype)
        layer.weight_scale_blocks = None
        layer.weight = nn.Parameter(dense, requires_grad=False)


def process_weights_after_loading(model: nn.Module) -> int:
    """Run every quantized layer's `process_weights_after_loading`; returns how many there were,
    logging which form the weights took."""
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    if not layers:
        return 0
    keep = keeps_fp8(layers[0].weight.device)
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer, keep)
    _check_block_gemm([layer for layer in layers if layer.weight_scale_blocks is not None])
    kept = sum(1 for layer in layers if layer.weight.dtype == FP8_DTYPE)
    if kept:
        logger.info("FP8: %d of %d quantized linear layers run FP8 GEMMs", kept, len(layers))
    if kept < len(layers):  # said on every device: an operator who asked for FP8 learns what runs
        reason = ("the block-scaled GEMM needs triton and K groups of a power of two >= 32 columns" if keep
                  else "no FP8 GEMMs on this device")
        logger.info("FP8: %d quantized linear layers dequantized to %s at load (%s)", len(layers) - kept,
                    layers[0].params_dtype, reason)
    return len(layers)
