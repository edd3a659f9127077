"""Decode steps of few rows: the fused skinny kernels (kernels/gemv.py) or the unfused path.

Call sites in a decoder layer:
- `norm_qkv_rope`: (add +) RMSNorm, qkv_proj, rotary and the KV-cache write (all of the attention
  block before attention itself), where the backend attends over K/V written beforehand;
- `norm_linear`: (add +) RMSNorm then a projection (input_layernorm + qkv_proj, where the above
  does not apply or loses);
- `norm_gate_up_silu`: (add +) RMSNorm, gate_up_proj, SiLU·mul (post_attention_layernorm + MLP up half);
- `linear`: a plain projection (o_proj, down_proj), replacing cuBLAS's split-K + reduce pair.

Which path runs is a measured choice, like a GEMM library's tactic selection: the first time a
(site, rows, shape, dtype) is seen outside a CUDA-graph capture, every kernel configuration and
the unfused path are captured into a CUDA graph each and replayed a few times under CUDA events,
L2 flushed before each replay (a decode step's conditions: no Python launch overhead, weights
from memory), and the fastest is kept for the process. The
CUDA-graph warm-up step before each capture is where that happens, so graphs capture the winner.
A shape first seen while capturing takes the unfused path (logged once). At `linear` (one kernel
against one cuBLAS kernel) the fused kernel must beat the unfused path by MARGIN to be chosen, so
timing noise cannot make a step slower. At the sites that fold neighbouring kernels in, FOLD_MARGIN
instead keeps the fused kernel unless it is clearly slower: timed alone, a path's kernel boundaries
cost less than inside a step, where the fused kernels overlap their neighbours (programmatic
dependent launch, kernels/pdl.py) and the unfused path's torch and cuBLAS kernels take no
part in that. On an H200, 1B batch-1 decode ran at 1,077 tok/s where norm_gate_up_silu's timing
went to the unfused path (30.0 µs fused against 31.0 unfused: short of MARGIN) and at 1,115-1,138
where it took the fused kernel (docs/benchmarks.md, sixth pass).

Timed alone, a site cannot see how its kernel overlaps its neighbours inside the step, so the
batch-1 choices are then refined in the step itself (`tune_in_step`, called by
model_executor/cuda_graph.py before the batch-1 graph's capture, on one GPU; IN_STEP_ROWS): for
each site in turn, its choice, its next IN_STEP_TOP fastest configurations alone and the unfused
path are each captured into the whole decode step, and the fastest step keeps its path if it
beats the current one by IN_STEP_MIN_GAIN; the tuned set is kept only if it then beats the
lone-timed set, timed alternately. On an H200 that took Llama-8B's batch-1 step from 4,295 to
4,115 µs and Llama-1B's from 860 to 846 µs, mostly by going back to the unfused q/k/v + rotary and
(8B) gate/up paths (docs/benchmarks.md, seventh pass).
TOKENSPEED_STEP_TUNING=0 turns this refinement off.

Respects layers/fused_kernels.py's switch (TOKENSPEED_FUSED_KERNELS): "off" always takes the
unfused path; "force" takes the fused kernel with its default configuration on any device
(CPU tests, in Triton's interpreter); "auto" decides by timing on CUDA and never fuses on CPU.
On by default; TOKENSPEED_SKINNY_KERNELS=0 (or `set_enabled(False)`) turns these kernels off, and
then every site is the unfused layers' own call (the other fused kernels keep their mode).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tokenspeed_worker import env
from tokenspeed_worker.layers.fused_kernels import fused_kernels_mode, use_fused
from tokenspeed_worker.kernels.timing import l2_flush_buffer, time_us

logger = logging.getLogger(__name__)

ENV_VAR = env.SKINNY_KERNELS.name
# On by default: on an H200 the graph-timed choice takes the kernel at 3 or 4 of the 5 sites at 1 row
# and the unfused path where it loses (4 rows, 1B's down_proj); batch-1 decode went from 225.3 to
# 233.1 tok/s (8B) and 948.5 to 983.7 (1B) (docs/benchmarks.md). TOKENSPEED_SKINNY_KERNELS=0 turns it off.
_enabled = env.SKINNY_KERNELS.get()
MARGIN = 0.97  # at `linear`, a fused configuration is chosen only at <= 97 % of the unfused path's time
FOLD_MARGIN = 1.05  # where the kernel folds neighbours in: chosen unless > 105 % of the unfused path's time
STEP_TUNING_ENV_VAR = env.STEP_TUNING.name
_step_tuning = env.STEP_TUNING.get()
IN_STEP_TOP = 3  # configurations per site tried in the step besides its choice and the unfused path
IN_STEP_MIN_GAIN = 0.003  # a path replaces the current one in-step only if the step gets 0.3 % faster
# Batch sizes refined in-step: batch 1, the latency-bound step. On an H200 tuning 2 and 4 rows too
# changed nothing for either shape and cost two thirds of the time (docs/benchmarks.md, seventh pass).
IN_STEP_ROWS = (1,)
_UNFUSED = "unfused"
_decisions: dict[tuple, Any] = {}  # key -> a config tuple, or _UNFUSED
_timings: dict[tuple, dict[str, float]] = {}  # key -> {path: microseconds per call}
_options: dict[tuple, dict[str, Any]] = {}  # key -> {path name: choice} of every path timed there
_in_step: dict[tuple, dict[str, float]] = {}  # key -> {path: microseconds per decode step} (tune_in_step)
_logged_capture: set[tuple] = set()


def decisions() -> dict[str, dict[str, Any]]:
    """What was chosen where, with the timings (µs per call) behind it: for benchmarks and logs."""
    return {
        "/".join(str(p) for p in key): {"chosen": str(choice), "us": _timings.get(key, {}),
                                        **({"step_us": _in_step[key]} if key in _in_step else {})}
        for key, choice in _decisions.items()
    }


def set_enabled(on: bool) -> bool:
    """Turn the skinny kernels on or off (the other fused kernels keep their mode); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def set_step_tuning(on: bool) -> bool:
    """Turn the in-step refinement (tune_in_step) on or off; returns the previous setting."""
    global _step_tuning
    previous, _step_tuning = _step_tuning, bool(on)
    return previous


def reset() -> None:
    _decisions.clear()
    _timings.clear()
    _options.clear()
    _in_step.clear()
    _logged_capture.clear()


_choosing = False  # while timing, nested sites (a norm_linear's own projection) take the unfused path


def _choose(key: tuple, x: torch.Tensor, fused: Callable[[tuple], Any], plain: Callable[[], Any], configs,
            margin: float = MARGIN) -> Any:
    global _choosing
    flush = l2_flush_buffer(x.device)
    _choosing = True
    try:
        timings = {_UNFUSED: time_us(plain, flush)}
        options = _options[key] = {_UNFUSED: _UNFUSED}
        best, best_us = _UNFUSED, timings[_UNFUSED] * margin
        for config in configs:
            try:
                us = time_us(lambda: fused(config), flush)
            except Exception as error:  # a configuration that cannot compile or launch here (shared memory)
                logger.debug("skinny %s: config %s unusable: %s", key, config, error)
                continue
            timings[str(config)] = us
            options[str(config)] = config
            if us < best_us:
                best, best_us = config, us
    finally:
        _choosing = False
        del flush
    _timings[key] = timings
    logger.debug("skinny %s: chose %s from %s", key, best, timings)
    return best


def _name(choice: Any) -> str:
    return choice if choice == _UNFUSED else str(choice)


def tune_in_step(rows: int, step_us: Callable[[], float], top: int = IN_STEP_TOP,
                 min_gain: float = IN_STEP_MIN_GAIN) -> dict[str, Any]:
    """Refine the timed choices of the sites seen at `rows` rows inside the whole decode step.

    step_us: the device microseconds of one decode step of `rows` rows run with the sites' current
    choices (model_executor/cuda_graph.py captures the step afresh on each call). Site by site, in
    the order they were first timed (one first timed on a path tried here comes after the others):
    the current choice, the `top` next fastest configurations alone and the unfused path each time
    a step; the fastest is kept if it beats the current choice by `min_gain` (a fraction of the
    step). The changed set is then timed against the lone-timed set twice, alternately, and kept
    only if its best step beats theirs by `min_gain` too. Returns
    {"before_us", "after_us", "changed": {site: [old, new]}}; {} where nothing was timed here (rows
    not in IN_STEP_ROWS, no site at these rows not tuned before, or TOKENSPEED_STEP_TUNING=0)."""
    if not _step_tuning or rows not in IN_STEP_ROWS:
        return {}
    original: dict[tuple, Any] = {}
    while True:  # a path tried here can time a site of its own (an unfused path's projection): tune it too
        key = next((k for k in _decisions if k[1] == rows and k in _options and k not in original
                    and k not in _in_step), None)  # tuned before in this process (another capture): as it is
        if key is None:
            break
        original[key] = _decisions[key]
        options, alone = _options[key], _timings.get(key, {})
        current = _name(_decisions[key])
        ranked = [n for n in sorted(alone, key=alone.get) if n in options and n not in (current, _UNFUSED)]
        names = [current, *ranked[:top], *([_UNFUSED] if current != _UNFUSED else [])]
        times = {}
        for name in names:
            _decisions[key] = options[name]
            times[name] = step_us()
        best = min(times, key=times.get)
        _decisions[key] = options[best if times[best] < times[current] * (1 - min_gain) else current]
        _in_step[key] = times
    keys = list(original)
    if not keys:
        return {}
    tuned = {key: _decisions[key] for key in keys}
    changed = {"/".join(str(p) for p in key): [str(original[key]), str(tuned[key])]
               for key in keys if tuned[key] != original[key]}
    if not changed:
        step = min(_in_step[keys[-1]].values())
        return {"before_us": step, "after_us": step, "changed": {}}
    before, after = [], []
    for _ in range(2):
        _decisions.update(original)
        before.append(step_us())
        _decisions.update(tuned)
        after.append(step_us())
    if min(after) >= min(before) * (1 - min_gain):  # not confirmed: the lone-timed choices stay
        _decisions.update(original)
        return {"before_us": min(before), "after_us": min(before), "changed": {}, "unconfirmed": changed,
                "unconfirmed_us": min(after)}
    return {"before_us": min(before), "after_us": min(after), "changed": changed}


def _kernels(x: torch.Tensor, weight: torch.Tensor):
    """kernels.gemv when the skinny kernel may run on x (few rows, 16-bit, switched on), else None."""
    if not _enabled or _choosing or x.dim() == 0 or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    kernels = use_fused(x, "gemv")
    if kernels is None or weight.dtype != x.dtype or x.numel() // max(1, x.shape[-1]) > kernels.MAX_ROWS:
        return None
    return kernels


def _key(site: str, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    rows = x.numel() // x.shape[-1]
    return (site, rows, *weight.shape, str(x.dtype).replace("torch.", ""), x.device.index)


def _run(site: str, x: torch.Tensor, weight: torch.Tensor, kernels, fused: Callable[[tuple], Any],
         plain: Callable[[], Any], configs=None, margin: float = MARGIN):
    """The chosen path for this site (kernels: from _kernels, not None; configs: the kernel
    configurations to time, kernels.CONFIGS by default; margin: MARGIN, or FOLD_MARGIN where the
    fused kernel replaces several)."""
    configs = kernels.CONFIGS if configs is None else configs
    if fused_kernels_mode() == "force" or not x.is_cuda:
        return fused(configs[0])
    key = _key(site, x, weight)
    choice = _decisions.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            if key not in _logged_capture:
                _logged_capture.add(key)
                logger.info("skinny %s first seen while capturing a CUDA graph: unfused path", key)
            return plain()
        choice = _decisions[key] = _choose(key, x, fused, plain, configs, margin)
    return plain() if choice == _UNFUSED else fused(choice)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), by the skinny kernel when that is faster for these few rows."""
    kernels = _kernels(x, weight)
    if kernels is None:  # the common case (off, or many rows): no closures on the eager path
        return F.linear(x, weight, bias)
    return _run("linear", x, weight, kernels, lambda config: kernels.skinny_linear(x, weight, bias, config=config)[0],
                lambda: F.linear(x, weight, bias))


def norm_linear(norm, proj, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual); without a residual (proj(norm(x)), x).

    norm: an RMSNorm; proj: a Linear whose forward is x @ weight^T (+ bias) on this rank."""

    def plain():
        if residual is None:
            return proj(norm(x)), x
        hidden, new_residual = norm(x, residual)
        return proj(hidden), new_residual

    kernels = _kernels(x, proj.weight)
    if kernels is None:
        return plain()

    def fused(config):
        return kernels.skinny_linear(x, proj.weight, proj.bias, norm_weight=norm.weight, residual=residual,
                                     eps=norm.eps, config=config)

    return _run("norm_linear" if residual is None else "add_norm_linear", x, proj.weight, kernels, fused, plain,
                kernels.NORM_CONFIGS, FOLD_MARGIN)


def norm_gate_up_silu(norm, gate_up, act, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(gate_up(norm(x + residual))), x + residual) with act = SiLU·mul over [gate | up]."""

    def plain():
        hidden, new_residual = norm(x, residual)
        return act(gate_up(hidden)), new_residual

    kernels = _kernels(x, gate_up.weight)
    if kernels is None or gate_up.bias is not None:
        return plain()

    def fused(config):
        return kernels.skinny_linear(x, gate_up.weight, norm_weight=norm.weight, residual=residual, eps=norm.eps,
                                     silu=True, config=config)

    return _run("norm_gate_up_silu", x, gate_up.weight, kernels, fused, plain, kernels.NORM_CONFIGS, FOLD_MARGIN)


def norm_qkv_rope(norm, attention, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                  attn_metadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rotated q [T, H, D], x + residual) with the rotated k and the v written into the layer's KV
    cache: (add +) RMSNorm, q/k/v projection, rotary and the cache write in one kernel (gemv's
    RotaryKV epilogue), when timing finds that faster than `norm_linear` followed by the rotary +
    KV-write kernel (the path `plain` runs, with norm_linear's own choice). None where it cannot
    apply, or where the attention kernel rotates and writes the cache itself (decode steps of the
    triton backend: Attention.fuses_rope): the caller then takes that path itself.

    attention: a LlamaAttention (qkv_proj, rotary_emb, attn, qk_norm, q_size, kv_size)."""
    proj, rope, attn = attention.qkv_proj, attention.rotary_emb, attention.attn
    kernels = _kernels(x, proj.weight)
    if (kernels is None or attention.qk_norm or rope.rotary_dim != attn.head_dim or attn.head_dim % 2
            or attn.backend is None or not attn.backend.supports_prewritten_kv or not rope.fuses(x)
            or attn.fuses_rope(rope, x, attn_metadata)):  # the attention kernel rotates: nothing to fold
        return None
    half = attn.head_dim // 2
    configs = tuple(c for c in kernels.NORM_CONFIGS if not isinstance(c, kernels.Persistent) and half % c[0] == 0)
    if not configs:
        return None
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rotary = kernels.RotaryKV(heads, kv_heads, head_dim, positions, rope.cos_cache, rope.sin_cache, attn.k_cache,
                              attn.v_cache, attn_metadata.slot_mapping)

    def plain():
        global _choosing
        was, _choosing = _choosing, False  # while timing, this path is norm_linear's chosen one
        try:
            qkv, new_residual = norm_linear(norm, proj, x, residual)
        finally:
            _choosing = was
        q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        q = attn.rope_and_write_kv(positions, q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v, rope,
                                   attn_metadata)
        return q, new_residual

    def fused(config):
        return kernels.skinny_linear(x, proj.weight, proj.bias, norm_weight=norm.weight, residual=residual,
                                     eps=norm.eps, rotary=rotary, config=config)

    site = "norm_qkv_rope" if residual is None else "add_norm_qkv_rope"
    if (x.is_cuda and fused_kernels_mode() != "force" and _key(site, x, proj.weight) not in _decisions
            and not torch.cuda.is_current_stream_capturing()):
        norm_linear(norm, proj, x, residual)  # norm_linear chooses first, so `plain` is timed as it will run
    return _run(site, x, proj.weight, kernels, fused, plain, configs, FOLD_MARGIN)


__all__ = ["ENV_VAR", "STEP_TUNING_ENV_VAR", "decisions", "linear", "norm_gate_up_silu", "norm_linear",
           "norm_qkv_rope", "reset", "set_enabled", "set_step_tuning", "tune_in_step"]
