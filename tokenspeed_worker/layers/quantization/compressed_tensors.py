"""compressed-tensors checkpoints (llm-compressor's; RedHatAI's FP8 models): `format:
"float-quantized"` with one config group of 8-bit float weights (per-tensor or per-channel) and
activations static per-tensor or dynamic per-token (or none: weight-only), and an `ignore` list
whose "re:" entries are regular expressions."""

from __future__ import annotations

from typing import Any

from tokenspeed_worker.layers.quantization.base import Fp8LinearScheme, QuantConfig, field_error

SOURCE = "config.json quantization_config"
FORMATS = ("float-quantized", "naive-quantized")


def _check_float8(args: dict[str, Any], where: str) -> None:
    if args.get("type", "float") != "float" or args.get("num_bits", 8) != 8:
        raise field_error(SOURCE, f"{where}.type/num_bits", f"{args.get('type')}{args.get('num_bits')}",
                          "float 8 (FP8); int4/int8 and other schemes are not supported")
    if args.get("symmetric", True) is not True:
        raise field_error(SOURCE, f"{where}.symmetric", args.get("symmetric"), "true")


def parse(qc: dict[str, Any]) -> QuantConfig:
    """The QuantConfig of a compressed-tensors quantization_config; UnsupportedQuantization for a
    format, group or scheme this worker cannot load (the message names the field)."""
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise field_error(SOURCE, "format", fmt, "float-quantized (FP8)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise field_error(SOURCE, "config_groups", sorted(groups), "exactly one group")
    (group_name, group), = groups.items()
    where = f"config_groups.{group_name}"
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise field_error(SOURCE, f"{where}.targets", targets, '["Linear"]')
    weights = group.get("weights") or {}
    _check_float8(weights, f"{where}.weights")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise field_error(SOURCE, f"{where}.weights.strategy", strategy, "tensor, channel")
    if weights.get("dynamic", False):
        raise field_error(SOURCE, f"{where}.weights.dynamic", True, "false")
    acts = group.get("input_activations")
    if acts is None:  # weight-only FP8: activations stay in the model's dtype
        activation, granularity = "dynamic", "token"
    else:
        _check_float8(acts, f"{where}.input_activations")
        act_strategy = acts.get("strategy")
        if acts.get("dynamic", False):
            if act_strategy not in ("token", "tensor"):
                raise field_error(SOURCE, f"{where}.input_activations.strategy", act_strategy, "token, tensor (dynamic)")
            activation, granularity = "dynamic", act_strategy
        else:
            if act_strategy != "tensor":
                raise field_error(SOURCE, f"{where}.input_activations.strategy", act_strategy, "tensor (static)")
            activation, granularity = "static", "tensor"
    scheme = Fp8LinearScheme(strategy, activation, granularity)
    return QuantConfig("compressed-tensors", scheme, ignore=tuple(qc.get("ignore") or ()),
                       source=SOURCE, raw=qc)
