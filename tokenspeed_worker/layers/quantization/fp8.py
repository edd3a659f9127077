"""`quant_method: "fp8"` checkpoints (vLLM's and transformers' FP8 format): per-tensor
(`weight_scale`, optional static `input_scale`) or block-wise (`weight_block_size`, e.g. [128, 128]
as Qwen3-*-FP8 and DeepSeek ship, scales named `weight_scale_inv`)."""

from __future__ import annotations

from typing import Any

from tokenspeed_worker.layers.quantization.base import Fp8LinearScheme, QuantConfig, field_error

SOURCE = "config.json quantization_config"


def parse(qc: dict[str, Any]) -> QuantConfig:
    """The QuantConfig of a `quant_method: "fp8"` quantization_config; UnsupportedQuantization
    for a field this worker cannot load."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise field_error(SOURCE, "fmt", fmt, "e4m3")
    activation = qc.get("activation_scheme", "dynamic")
    if activation not in ("static", "dynamic"):
        raise field_error(SOURCE, "activation_scheme", activation, "static, dynamic")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise field_error(SOURCE, "weight_block_size", block, "two positive integers, e.g. [128, 128]")
        if activation != "dynamic":
            raise field_error(SOURCE, "activation_scheme", activation, "dynamic with weight_block_size")
        scheme = Fp8LinearScheme("block", "dynamic", "token", block=(block[0], block[1]), scale_name="weight_scale_inv")
    else:
        scheme = Fp8LinearScheme("tensor", activation, "tensor")
    ignore = [*(qc.get("ignored_layers") or ()), *(qc.get("modules_to_not_convert") or ())]
    return QuantConfig("fp8", scheme, ignore=tuple(ignore), source=SOURCE, raw=qc)
