"""Per-layer scales of an FP8 KV cache: where they come from, and how they are applied.

A scale s is a dequantization factor: the cache holds k / s_k (and v / s_v) in float8 e4m3, so a
layer whose keys reach |k| = 448 * s_k still fits the format's range and small keys keep their
mantissa bits. Scales are used only with `--kv-cache-dtype fp8_e4m3`; with none, every scale is
1.0 (the cache holds the values themselves, saturating at +-448).

Sources, the first that has them:
- `--quantization-param-path FILE`: the JSON file vLLM and SGLang take, one scale per layer used
  for both k and v (`{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp rank>":
  {"<layer>": s, ...}}}}`; a file with rank "0" only applies to every rank).
- the checkpoint: ModelOpt's `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`,
  compressed-tensors' `self_attn.k_scale` / `self_attn.v_scale`, and the older single
  `self_attn.kv_scale` (both), one scalar per layer (`checkpoint_scale` names them).

Applied by folding them into the weights once after loading (LlamaAttention.fold_kv_cache_scales),
so no attention kernel or backend changes: q's projection rows (or q's norm) take s_k, k's take
1 / s_k, v's take 1 / s_v, and the output projection takes s_v. Then q . (k / s_k) * s_k = q . k
and o(s_v * sum p v / s_v) = o(sum p v): the model computes what it did, while the cache holds the
scaled k and v. A weight kept in FP8 takes the factor in its per-row scales (exact); a 16-bit
weight or norm is rounded to its dtype once (relative 2^-9 for bf16, far below e4m3's 2^-4).

Standard library only: the server validates the file before torch is loaded.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

FILE_DTYPE = "float8_e4m3fn"
_CHECKPOINT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k|v|kv)_scale$")


def checkpoint_scale(name: str) -> tuple[int, str] | None:
    """(layer index, "k" | "v" | "kv") when the checkpoint tensor `name` is a KV-cache scale, else None."""
    m = _CHECKPOINT_NAME.search(name)
    return (int(m.group(1)), m.group(2)) if m else None


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a positive finite number, got {value!r}")
    return float(value)


def read_scales_file(path: str, num_layers: int, tp_rank: int = 0, tp_size: int = 1) -> dict[int, float]:
    """Layer index -> scale (for both k and v) of rank `tp_rank` from the JSON file at `path`
    (module docstring). Raises ValueError naming --quantization-param-path and the field at fault:
    an unreadable file, another dtype, a rank count that is neither 1 nor tp_size, a layer missing
    or beyond num_layers, a scale that is not a positive finite number."""
    flag = "--quantization-param-path"
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{flag}: {path!r} is not JSON: {e}") from None
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    if not isinstance(kv, dict) or not isinstance(kv.get("scaling_factor"), dict):
        raise ValueError(f"{flag}: {path!r} has no kv_cache.scaling_factor object")
    dtype = kv.get("dtype", FILE_DTYPE)
    if dtype != FILE_DTYPE:
        raise ValueError(f"{flag}: kv_cache.dtype {dtype!r} is not supported (supported: {FILE_DTYPE})")
    ranks = kv["scaling_factor"]
    if len(ranks) not in (1, tp_size):
        raise ValueError(f"{flag}: kv_cache.scaling_factor has {len(ranks)} tensor-parallel ranks; "
                         f"expected 1 (for every rank) or {tp_size}")
    key = str(tp_rank) if len(ranks) == tp_size else "0"
    layers = ranks.get(key)
    if not isinstance(layers, dict):
        raise ValueError(f"{flag}: kv_cache.scaling_factor has no rank {key!r} object")
    scales: dict[int, float] = {}
    for name, value in layers.items():
        if not str(name).isdigit() or int(name) >= num_layers:
            raise ValueError(f"{flag}: kv_cache.scaling_factor.{key}.{name}: the model has layers 0-{num_layers - 1}")
        scales[int(name)] = _positive(value, f"{flag}: kv_cache.scaling_factor.{key}.{name}")
    missing = [i for i in range(num_layers) if i not in scales]
    if missing:
        raise ValueError(f"{flag}: kv_cache.scaling_factor.{key} lacks layer {missing[0]} "
                         f"({len(missing)} of {num_layers} layers missing)")
    return scales


def model_num_layers(model_path: str) -> int | None:
    """num_hidden_layers of the model's config.json (or its text_config), None when unreadable."""
    try:
        with open(f"{model_path}/config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return (cfg.get("text_config") or cfg).get("num_hidden_layers")


def resolve(file_path: str | None, checkpoint: dict[int, dict[str, float]], num_layers: int,
            tp_rank: int = 0, tp_size: int = 1) -> tuple[dict[int, tuple[float, float]], str]:
    """({layer: (k_scale, v_scale)} for every layer, where they came from: "file", "checkpoint"
    or "none" (all 1.0)). `checkpoint`: layer -> {"k"/"v"/"kv": scale} as load_weights found them;
    a layer or a side the checkpoint lacks takes 1.0."""
    if file_path is not None:
        per_layer = read_scales_file(file_path, num_layers, tp_rank, tp_size)
        return {i: (s, s) for i, s in per_layer.items()}, "file"
    if not checkpoint:
        return {i: (1.0, 1.0) for i in range(num_layers)}, "none"
    scales = {}
    for i in range(num_layers):
        found = checkpoint.get(i, {})
        k = found.get("k", found.get("kv", 1.0))
        v = found.get("v", found.get("kv", 1.0))
        scales[i] = (_positive(k, f"layer {i}'s checkpoint k_scale"), _positive(v, f"layer {i}'s checkpoint v_scale"))
    return scales, "checkpoint"
