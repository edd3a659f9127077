"""Fill a model's parameters: from safetensors (one file or an indexed set of shards) or at random (dummy).

`dummy` needs only config.json: random weights at the real shapes, for speed work
where values do not matter. It is deterministic for a given seed and device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from tokenspeed_worker.config import ModelConfig
from tokenspeed_worker.model_executor.checkpoint_files import check_weights_present, safetensors_files
from tokenspeed_worker.layers.moe import FusedMoE
from tokenspeed_worker.layers.quantization import methods as quant_methods

logger = logging.getLogger(__name__)

DUMMY_STD = 0.02


def resolve_load_format(model_path: str | Path, load_format: str) -> str:
    """"safetensors" or "dummy": what `load_format` (a ModelConfig one) loads from `model_path`."""
    if load_format == "auto":
        check_weights_present(model_path, load_format)
        return "safetensors"
    return load_format


def iter_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = safetensors_files(model_path)
    if not files:
        raise ValueError(f"no safetensors weights in {model_path}")
    for path in files:
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors' own error type differs by version: name the file either way
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, online_fp8: bool = False) -> None:
    """Norm weights 1, biases 0, everything else N(0, DUMMY_STD^2): activations stay in a sane range.
    FP8 scales are 1 (an FP8 checkpoint's weights are drawn in FP8 directly). online_fp8: each
    quantized layer's FP8 weight and per-row scales are those of the 16-bit weight the unquantized
    model draws for the same seed (online FP8 of the same dummy model)."""
    scales = [(name, param) for name, param in model.named_parameters() if name.endswith(("_scale", "_scale_inv"))]
    for _, param in scales:  # first: online FP8 below overwrites a weight's scales after this
        param.fill_(1.0)
    index = 0  # a weight's seed is seed + its index among the non-scale parameters, the same with or without FP8
    for name, param in model.named_parameters():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            generator = torch.Generator(device=param.device).manual_seed(seed + index)
            if param.dtype == torch.float8_e4m3fn:
                module = model.get_submodule(name.rsplit(".", 1)[0])
                draw = torch.empty(param.shape, device=param.device, dtype=module.params_dtype if online_fp8 else None)
                draw.normal_(0.0, DUMMY_STD, generator=generator)
                if online_fp8:
                    q, scale = quant_methods.fp8_kernels.quantize_weight_rows(draw)
                    param.copy_(q)
                    module.weight_scale.copy_(scale.view_as(module.weight_scale))
                else:
                    param.copy_(draw)  # normal_ has no FP8 kernel
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)
        index += 1


@torch.no_grad()
def load_model_weights(model: nn.Module, config: ModelConfig) -> str:
    """Fill the model's weights as `config` says (its path, load_format and seed; online FP8
    quantizes the 16-bit weights as they load); returns the format used ("safetensors" or "dummy")."""
    load_format = resolve_load_format(config.path, config.load_format)
    online = config.quant_config is not None and config.quant_config.online
    if load_format == "dummy":
        init_dummy_weights(model, config.seed, online_fp8=online)
    else:
        weights = iter_safetensors(config.path)
        if online:
            weights = quant_methods.quantize_online(model, weights, next(model.parameters()).device)
        model.load_weights(weights)
    quant_methods.process_weights_after_loading(model)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE) and m.scheme is not None]
    for m in experts:
        m.process_weights_after_loading()
    kept = sum(1 for m in experts if m.w13_scales is not None)
    if kept:
        logger.info("FP8: the experts of %d MoE layers stay FP8 (the grouped GEMM scales them in-register)", kept)
    if kept < len(experts):
        logger.info("FP8: the experts of %d MoE layers dequantized to %s at load (no FP8 grouped GEMM here, or a "
                    "rank's columns start inside a scale group)", len(experts) - kept, experts[0].params_dtype)
    return load_format
