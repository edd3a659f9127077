"""Weight quantization: which scheme a checkpoint declares (one module per scheme family) and the
per-layer methods the Linear layers consult (`methods.py`, which needs torch).

    resolve_quantization(model_path, requested)  ->  QuantConfig | None

reads config.json's `quantization_config` (and ModelOpt's `hf_quant_config.json`); `requested`,
`--quantization`, forces or confirms it. Standard library only (this module and the parsers):
the server resolves the config before torch is loaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenspeed_worker.layers.quantization import compressed_tensors, fp8, modelopt
from tokenspeed_worker.layers.quantization.base import (
    SUPPORTED_METHODS,
    Fp8LinearScheme,
    QuantConfig,
    UnsupportedQuantization,
)

__all__ = ["SUPPORTED_METHODS", "Fp8LinearScheme", "QuantConfig", "UnsupportedQuantization", "resolve_quantization"]


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # unreadable: the model facts report a missing config.json
        return None


def detect(model_path: str) -> QuantConfig | None:
    """The checkpoint's declared quantization, or None for an unquantized one. Raises
    UnsupportedQuantization (naming the field and value) for a scheme this worker cannot load."""
    cfg = _read_json(os.path.join(model_path, "config.json")) or {}
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if qc is None:
        hf_quant = _read_json(os.path.join(model_path, modelopt.HF_QUANT_CONFIG))
        if hf_quant is None:
            return None
        return modelopt.parse(hf_quant.get("quantization") or {}, f"{modelopt.HF_QUANT_CONFIG} quantization")
    method = qc.get("quant_method")
    if method == "fp8":
        return fp8.parse(qc)
    if method == "compressed-tensors":
        return compressed_tensors.parse(qc)
    if method == "modelopt":
        return modelopt.parse(qc, "config.json quantization_config")
    raise UnsupportedQuantization(
        f"config.json quantization_config: quant_method {method!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_METHODS)}; FP8 checkpoints only)")


def resolve_quantization(model_path: str, requested: str | None) -> QuantConfig | None:
    """The quantization the model at `model_path` loads with: the checkpoint's, which `requested`
    (a --quantization value, or None) must name when given; `fp8` on an unquantized checkpoint is
    online FP8 (every linear layer quantized per output channel at load). Raises
    UnsupportedQuantization for a mismatch or an unsupported scheme."""
    if requested is not None and requested not in SUPPORTED_METHODS:
        raise UnsupportedQuantization(
            f"--quantization {requested} is not supported yet (supported: {', '.join(SUPPORTED_METHODS)})")
    found = detect(model_path)
    if found is None:
        if requested == "fp8":
            return QuantConfig("fp8", Fp8LinearScheme("channel", "dynamic", "token"), online=True,
                               ignore=("lm_head",), source="--quantization fp8")
        if requested is not None:
            raise UnsupportedQuantization(
                f"--quantization {requested} does not match the checkpoint: its config.json has no "
                "quantization_config (an unquantized checkpoint)")
        return None
    if requested is not None and requested != found.method:
        raise UnsupportedQuantization(
            f"--quantization {requested} does not match the checkpoint's quantization "
            f"({found.source} declares {found.method!r})")
    return found
