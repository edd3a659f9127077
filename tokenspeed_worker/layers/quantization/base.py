"""The typed quantization config every scheme family parses into, and its errors.

Standard library only: the server process builds it (config/engine.py) before torch is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# The `--quantization` values this worker loads; every scheme here is FP8 weights (float8 e4m3).
SUPPORTED_METHODS: tuple[str, ...] = ("fp8", "compressed-tensors", "modelopt")


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization (or `--quantization`) this worker cannot load; the message names
    the field and its value. A ValueError, so startup refuses it with exit status 2."""


@dataclass(frozen=True)
class Fp8LinearScheme:
    """How one linear layer's FP8 weights and activations are scaled.

    weight: "tensor" (one scale per checkpoint matrix), "channel" (one per output row, [out, 1]) or
    "block" (one per `block` = (rows, cols) tile, [ceil(out/rows), ceil(in/cols)]).
    activation: "static" (a per-tensor `input_scale` in the checkpoint) or "dynamic" (computed per
    call); activation_granularity: "tensor" or "token" (dynamic only)."""

    weight: str
    activation: str = "dynamic"
    activation_granularity: str = "tensor"
    block: tuple[int, int] | None = None
    # The checkpoint's name of the weight scale: "weight_scale", or "weight_scale_inv" (block fp8,
    # where the name notwithstanding the stored value multiplies the FP8 weight, as DeepSeek ships it).
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        assert self.weight in ("tensor", "channel", "block"), self.weight
        assert self.activation in ("static", "dynamic"), self.activation
        assert (self.block is not None) == (self.weight == "block")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization: the method it declares, the one FP8 scheme of its linear
    layers, and the layers left unquantized.

    ignore: module names (checkpoint names, e.g. "lm_head", "model.layers.0.mlp.down_proj") or
    "re:<regex>" entries matched in full, as compressed-tensors writes them; ModelOpt's
    `exclude_modules` are fnmatch-style patterns, stored with the "glob:" prefix.
    Embeddings and the LM head are never quantized, whatever the lists say."""

    method: str  # one of SUPPORTED_METHODS
    scheme: Fp8LinearScheme
    ignore: tuple[str, ...] = ()
    # Online FP8 (`--quantization fp8` on a 16-bit checkpoint): the checkpoint's linear weights are
    # quantized per output channel as they load (scheme "channel", dynamic per-token activations;
    # methods.quantize_online).
    online: bool = False
    source: str = "config.json"  # where the config was read (for messages)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def is_ignored(self, name: str) -> bool:
        """Whether the checkpoint module `name` loads unquantized."""
        import fnmatch

        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], name):
                    return True
            elif entry.startswith("glob:"):
                if fnmatch.fnmatchcase(name, entry[5:]):
                    return True
            elif entry == name:
                return True
        return False

    def layer_is_quantized(self, layer_name: str, shard_names: list[str]) -> bool:
        """Whether the (possibly fused) layer `layer_name`, stacked from the checkpoint modules
        `shard_names` (just [layer_name] for an unfused one), is quantized. Its shards must agree:
        one fused weight cannot be half FP8."""
        ignored = [self.is_ignored(name) for name in shard_names]
        if any(ignored) and not all(ignored):
            raise UnsupportedQuantization(
                f"{self.source}: the ignore list leaves only some of {', '.join(shard_names)} unquantized; "
                f"they form one fused layer ({layer_name}), which must be all FP8 or all unquantized")
        return not all(ignored)


def field_error(source: str, field_name: str, value: Any, supported: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{source}: {field_name} {value!r} is not supported (supported: {supported})")
