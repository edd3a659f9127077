"""NVIDIA ModelOpt FP8 checkpoints: `hf_quant_config.json` ({"quantization": {"quant_algo": "FP8",
"kv_cache_quant_algo": ..., "exclude_modules": [...]}}) or the same fields in config.json's
quantization_config (`quant_method: "modelopt"`). Weights per-tensor (`weight_scale`), activations
static per-tensor (`input_scale`); k/v cache scales (`k_proj.k_scale`, `v_proj.v_scale`) apply to
an FP8 KV cache (kv_scales.py)."""

from __future__ import annotations

from typing import Any

from tokenspeed_worker.layers.quantization.base import Fp8LinearScheme, QuantConfig, field_error

HF_QUANT_CONFIG = "hf_quant_config.json"


def parse(qc: dict[str, Any], source: str) -> QuantConfig:
    """The QuantConfig of ModelOpt's quantization section `qc` (read from `source`)."""
    algo = qc.get("quant_algo")
    if algo != "FP8":
        raise field_error(source, "quant_algo", algo, "FP8 (NVFP4, W4A8 and INT schemes are not supported)")
    kv_algo = qc.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise field_error(source, "kv_cache_quant_algo", kv_algo, "FP8 or none")
    patterns = tuple(f"glob:{p}" for p in qc.get("exclude_modules") or qc.get("ignore") or ())
    return QuantConfig("modelopt", Fp8LinearScheme("tensor", "static", "tensor"), ignore=patterns,
                       source=source, raw=qc)
