"""Which path runs a projection of a few rows: a small-batch GEMV kernel (kernels/gemv.py) or the unfused layers.

A decode step of at most kernels.gemv.MMA_MAX_ROWS rows asks, at each projection (a "site"):
- `linear`: x @ W^T (+ b) (o_proj, down_proj, any Linear);
- `norm_linear`: (add +) RMSNorm, then the projection (a PendingNorm given to qkv_proj);
- `norm_gate_up_silu` / `norm_gate_up_gelu`: (add +) RMSNorm, gate_up_proj, SiLU·mul or GELU-tanh·mul
  (a PendingNorm given to the MLP);
- Gemma's norms fold in too (sites suffixed `_unit`; `_after` where a sublayer's post norm comes
  first: PendingNorm.x_norm), by the configurations that take those forms;
- `norm_qkv_rope`: (add +) RMSNorm, q/k/v, rotary and the KV-cache write, for backends that attend
  over K/V written beforehand and do not rotate in their attention kernel;
- `experts` (site "moe_experts"): a mixture-of-experts layer's experts, by the decode kernels of
  kernels/moe.py in one of their strip configurations or by the grouped GEMMs (its "unfused" path).

The weight is x's dtype, or FP8 e4m3 with one float32 scale per row (`Linear.weight_scale_rows`) or
per tile (`Linear.weight_scale_blocks`, block-wise checkpoints: the one-shot configurations whose
strips fit the tile rows); the kernel reads half the bytes and applies the scales in-register,
activations 16-bit on the CUDA cores, or quantized per row in the kernel for the tensor-core
configurations (Fp8Mma, per-row scales only). Past kernels.gemv.MAX_ROWS rows (5 to MMA_MAX_ROWS: a
speculative verify step, a mid-sized decode batch) only the tensor-core configurations are timed
(Mma for 16-bit weights, Fp8Mma), without the rotary epilogue or Gemma's forms.

A `SmallBatchGemv` holds the choices of one model runner: the first time a (site, rows, weight
shape, dtype, device) is seen outside a CUDA-graph capture, the unfused path and each kernel
configuration are timed alone (kernels/timing.time_us) and the fastest is kept, within the site's
margin (MARGIN, FOLD_MARGIN); a configuration whose output disagrees with the unfused path's
(AGREEMENT) is refused before it is timed. A shape first seen while capturing takes the unfused
path. Choices an earlier start kept (`stored`, --cache-dir: kernel_cache.py) are taken untimed
where they still apply, and are not refined in-step again. The batch-1 choices are then refined inside the whole decode step (`tune_in_step`, before the batch-1
graph's capture); with speculative decoding, also those of the graph a batch-1 verify step replays
(`refine_verify_step`: its choice against the unfused path only). The runner makes its chooser `current()` while it builds the model; each Linear
keeps the chooser current at its construction (None: always the unfused path).

layers/fused_kernels.py's mode applies: "off" takes the unfused path; "force" takes the kernel with
its first configuration on any device (CPU tests, in Triton's interpreter); "auto" times on CUDA
and never takes the kernel on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tokenspeed_worker.kernels import compile_ahead
from tokenspeed_worker.kernels.timing import l2_flush_buffer, time_us
from tokenspeed_worker.layers.fused_kernels import fused_kernels_mode, use_fused

if TYPE_CHECKING:
    from tokenspeed_worker.layers.activation import GatedActivation
    from tokenspeed_worker.layers.attention.layer import Attention
    from tokenspeed_worker.layers.layernorm import PendingNorm
    from tokenspeed_worker.layers.linear import Linear, QKVLinear
    from tokenspeed_worker.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# At `linear` (one kernel against one cuBLAS kernel) the kernel must win by MARGIN, so timing noise
# cannot make a step slower. Where the kernel folds neighbouring kernels in, it is kept unless
# slower than FOLD_MARGIN times the unfused path: timed alone, the unfused path's kernel boundaries
# cost less than inside a step, where the fused kernel overlaps its neighbours (kernels/pdl.py).
MARGIN = 0.97
FOLD_MARGIN = 1.05
IN_STEP_TOP = 3  # configurations per site tried in the step besides its choice and the unfused path
IN_STEP_MIN_GAIN = 0.003  # a path replaces the current one in-step only if the step gets 0.3 % faster
IN_STEP_ROWS = (1,)  # batch sizes refined in-step: the latency-bound step
# Configurations per site tried in-step at a speculative verify step's graph size (refine_verify_step):
# none besides the choice and the unfused path (the lone timing's one question there: the tensor
# cores or cuBLAS), which keeps the added startup to about two timed steps per site.
IN_STEP_VERIFY_TOP = 0
# A configuration whose output differs from the unfused path's by more than this (relative norm) when
# first timed is refused: roundings differ by far less (FP8 weights: the scaled GEMM's per-token
# activation rounding, a few percent), a miscompiled or mis-indexed kernel by far more.
AGREEMENT = 0.1
UNFUSED = "unfused"


def _name(choice: Any) -> str:
    return choice if choice == UNFUSED else str(choice)


def stored_key(key: tuple) -> str:
    """A choice's key as kept between starts: site, rows, weight shape and dtypes (not the device
    index: the file is per GPU model already)."""
    return "/".join(str(p) for p in key[:-1])


def _key(site: str, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    rows = x.numel() // x.shape[-1]
    dtype = str(x.dtype).replace("torch.", "")
    if weight.dtype != x.dtype:  # FP8 weights: their own choices
        dtype += "/" + str(weight.dtype).replace("torch.", "")
    return (site, rows, *weight.shape, dtype, x.device.index)


class SmallBatchGemv:
    """The small-batch GEMV choices of one model runner, per (site, rows, weight shape, dtype, device).

    decisions: key -> a kernel configuration, or UNFUSED; timings: key -> {path: µs per call, timed
    alone}; options: key -> {path name: choice} of every path timed there; in_step: key -> {path: µs
    per decode step} (tune_in_step)."""

    def __init__(self, stored: dict[str, str] | None = None) -> None:
        """stored: choices an earlier start kept ({stored_key: choice name}, kernel_cache.py): a site
        takes its stored choice, untimed, where it is still one of its configurations and agrees
        with the unfused path."""
        self.stored = dict(stored or {})
        self.reused = 0  # sites that took a stored choice
        self.decisions: dict[tuple, Any] = {}
        self.timings: dict[tuple, dict[str, float]] = {}
        self.options: dict[tuple, dict[str, Any]] = {}
        self.in_step: dict[tuple, dict[str, float]] = {}
        self._logged_capture: set[tuple] = set()
        self.in_step_tops: dict[int, int] = dict.fromkeys(IN_STEP_ROWS, IN_STEP_TOP)  # rows refined in-step: top
        self._choosing = False  # while timing, nested sites (a norm_linear's own projection) take the unfused path

    def to_store(self) -> dict[str, str]:
        """The choices to keep for the next start ({stored_key: choice name})."""
        return {stored_key(key): _name(choice) for key, choice in self.decisions.items()}

    def _stored_choice(self, key: tuple, fused: Callable[[Any], Any], plain: Callable[[], Any], configs) -> Any:
        """The stored choice for key if it is still usable here (one of `configs`, or UNFUSED; a
        configuration whose output agrees with the unfused path's), else None."""
        name = self.stored.get(stored_key(key))
        if name is None:
            return None
        if name == UNFUSED:
            return UNFUSED
        config = next((c for c in configs if str(c) == name), None)
        if config is None:
            logger.info("small-batch GEMV %s: the kept choice %s is not a configuration of this version: timed",
                        key, name)
            return None
        self._choosing = True
        try:
            agrees = _agrees(fused(config), plain())
        except Exception as error:  # a configuration that cannot run here any more: time the site
            logger.info("small-batch GEMV %s: the kept choice %s fails here (%s): timed", key, name, error)
            return None
        finally:
            self._choosing = False
        if not agrees:
            logger.info("small-batch GEMV %s: the kept choice %s disagrees with the unfused path: timed", key, name)
        return config if agrees else None

    def report(self) -> dict[str, dict[str, Any]]:
        """What was chosen where, with the timings (µs per call) behind it: for benchmarks and logs."""
        return {
            "/".join(str(p) for p in key): {"chosen": str(choice), "us": self.timings.get(key, {}),
                                            **({"step_us": self.in_step[key]} if key in self.in_step else {})}
            for key, choice in self.decisions.items()
        }

    # -- the sites ----------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, proj: Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ proj's weight^T (+ bias), by the kernel when that is faster for these few rows than
        the layer's own product (`proj.dense_product`: F.linear, or its quantization method's)."""
        kernels = self._kernels(x, proj)
        if kernels is None:  # the common case (many rows): no closures on the eager path
            return proj.dense_product(x, bias)
        scales = _scale_args(kernels, proj)
        configs = _configs(kernels, proj, rows=_rows_of(x))
        if not configs:
            return proj.dense_product(x, bias)
        return self._run("linear", x, proj.weight, kernels,
                         lambda config: kernels.small_batch_linear(x, proj.weight, bias, config=config, **scales)[0],
                         lambda: proj.dense_product(x, bias), configs)

    def norm_linear(self, pending: PendingNorm, proj: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm(x + residual)), x + residual) of a pending norm; without a residual (proj(norm(x)), x).

        proj: a Linear whose forward is x @ weight^T (+ bias) on this rank."""
        x = pending.x

        def plain():
            hidden, new_residual = pending.normalize()
            return proj(hidden), new_residual

        kernels = self._kernels(x, proj)
        if kernels is None:  # many rows: the layer's own product (FP8: the norm in its quantization)
            return proj.norm_product(pending)
        configs = _configs(kernels, proj, norm=True, pending=pending, rows=_rows_of(x))
        if not configs:  # past MAX_ROWS as for many rows
            return plain() if _rows_of(x) <= kernels.MAX_ROWS else proj.norm_product(pending)

        def fused(config):
            return kernels.small_batch_linear(x, proj.weight, proj.bias, config=config, **_norm_args(pending),
                                              **_scale_args(kernels, proj))

        return self._run(_norm_site("norm_linear", pending), x, proj.weight, kernels, fused, plain, configs, FOLD_MARGIN)

    def norm_gate_up_act(self, pending: PendingNorm, gate_up: Linear,
                         act: GatedActivation) -> tuple[torch.Tensor, torch.Tensor]:
        """(act(gate_up(norm(x + residual))), x + residual) with act = SiLU·mul or GELU-tanh·mul over
        [gate | up]."""
        x = pending.x

        def plain():
            hidden, new_residual = pending.normalize()
            return act(gate_up(hidden)), new_residual

        kernels = self._kernels(x, gate_up)
        if kernels is None or gate_up.bias is not None:
            out, new_residual = gate_up.norm_product(pending)
            return act(out), new_residual
        gelu = bool(act.GELU_TANH)
        configs = _configs(kernels, gate_up, norm=True, pending=pending, gelu=gelu, rows=_rows_of(x))
        if not configs:
            if _rows_of(x) <= kernels.MAX_ROWS:
                return plain()
            out, new_residual = gate_up.norm_product(pending)
            return act(out), new_residual

        def fused(config):
            return kernels.small_batch_linear(x, gate_up.weight, silu=not gelu, gelu=gelu, config=config,
                                              **_norm_args(pending), **_scale_args(kernels, gate_up))

        return self._run(_norm_site("norm_gate_up_gelu" if gelu else "norm_gate_up_silu", pending, add=False), x,
                         gate_up.weight, kernels, fused, plain, configs, FOLD_MARGIN)

    def norm_qkv_rope(self, pending: PendingNorm, proj: QKVLinear, rope: RotaryEmbedding, attn: Attention,
                      positions: torch.Tensor, attn_metadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rotated q [T, H, D], x + residual) with the rotated k and the v written into attn's KV
        cache: (add +) RMSNorm, the q/k/v projection `proj`, rotary and the cache write in one kernel
        (gemv's RotaryKV epilogue), when timing finds that faster than `norm_linear` followed by the
        rotary + KV-write kernel (the choice is made with norm_linear's own choice in place). None
        where it cannot apply, or where the attention kernel rotates and writes the cache itself
        (Attention.fuses_rope): the caller then projects and rotates itself."""
        x = pending.x
        kernels = self._kernels(x, proj)
        if (kernels is None or rope.rotary_dim != attn.head_dim or attn.head_dim % 2
                or attn.backend is None or not attn.backend.supports_prewritten_kv or not rope.fuses(x)
                or attn.fuses_rope(rope, x, attn_metadata)):  # the attention kernel rotates: nothing to fold
            return None
        half = attn.head_dim // 2
        configs = tuple(c for c in _configs(kernels, proj, norm=True, pending=pending, rows=_rows_of(x))
                        if kernels.supports_rotary(c) and half % c[0] == 0)
        if not configs:
            return None
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        rotary = kernels.RotaryKV(heads, kv_heads, head_dim, positions, rope.cos_cache, rope.sin_cache, attn.k_cache,
                                  attn.v_cache, attn_metadata.slot_mapping)

        def plain():
            was, self._choosing = self._choosing, False  # while timing, this path is norm_linear's chosen one
            try:
                qkv, new_residual = self.norm_linear(pending, proj)
            finally:
                self._choosing = was
            q, k, v = qkv.split([proj.q_size, proj.kv_size, proj.kv_size], dim=-1)
            q = attn.rope_and_write_kv(positions, q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v,
                                       rope, attn_metadata)
            return q, new_residual

        def fused(config):
            return kernels.small_batch_linear(x, proj.weight, proj.bias, rotary=rotary, config=config,
                                              **_norm_args(pending), **_scale_args(kernels, proj))

        site = _norm_site("norm_qkv_rope", pending)
        if (x.is_cuda and fused_kernels_mode() != "force" and _key(site, x, proj.weight) not in self.decisions
                and not torch.cuda.is_current_stream_capturing()):
            self.norm_linear(pending, proj)  # norm_linear chooses first, so `plain` is timed as it will run
        return self._run(site, x, proj.weight, kernels, fused, plain, configs, FOLD_MARGIN)

    # -- the in-step refinement -------------------------------------------------------------

    def experts(self, x: torch.Tensor, w13: torch.Tensor, decode: Callable[[Any], torch.Tensor],
                grouped: Callable[[], torch.Tensor], configs: tuple) -> torch.Tensor:
        """A mixture-of-experts layer's experts for a decode step's few tokens x: by the decode
        kernels in one of `configs` (decode(config)), or by the grouped GEMMs (`grouped`, this
        site's unfused path), whichever was timed faster for this token count and expert shape
        (w13: the stacked gate/up weights, layers/moe.FusedMoE)."""
        return self._run("moe_experts", x, w13, None, decode, grouped, configs)

    def refine_verify_step(self, rows: int) -> None:
        """Refine in-step, too, the choices of the `rows`-row step a speculative verify step replays
        (the model runner's batch-1 verify graph), with IN_STEP_VERIFY_TOP configurations per site."""
        self.in_step_tops.setdefault(rows, IN_STEP_VERIFY_TOP)

    def tune_in_step(self, rows: int, step_us: Callable[[], float],
                     min_gain: float = IN_STEP_MIN_GAIN) -> dict[str, Any]:
        """Refine the timed choices of the sites seen at `rows` rows inside the whole decode step.

        step_us: the device microseconds of one decode step of `rows` rows run with the sites' current
        choices (model_executor/cuda_graph.py captures the step afresh on each call). Site by site, in
        the order they were first timed (one first timed on a path tried here comes after the others):
        the current choice, the rows' `in_step_tops` next fastest configurations alone (IN_STEP_TOP at
        IN_STEP_ROWS, IN_STEP_VERIFY_TOP at a verify step's size) and the unfused path each time
        a step; the fastest is kept if it beats the current choice by `min_gain` (a fraction of the
        step). The changed set is then timed against the lone-timed set twice, alternately, and kept
        only if its best step beats theirs by `min_gain` too. Returns
        {"before_us", "after_us", "changed": {site: [old, new]}}; {} where nothing was timed here (rows
        not refined in-step, or no site at these rows not tuned before)."""
        if rows not in self.in_step_tops:
            return {}
        top = self.in_step_tops[rows]
        decisions = self.decisions
        original: dict[tuple, Any] = {}
        while True:  # a path tried here can time a site of its own (an unfused path's projection): tune it too
            key = next((k for k in decisions if k[1] == rows and k in self.options and k not in original
                        and k not in self.in_step), None)  # tuned before (another capture): as it is
            if key is None:
                break
            original[key] = decisions[key]
            options, alone = self.options[key], self.timings.get(key, {})
            current = _name(decisions[key])
            ranked = [n for n in sorted(alone, key=alone.get) if n in options and n not in (current, UNFUSED)]
            names = [current, *ranked[:top], *([UNFUSED] if current != UNFUSED else [])]
            times = {}
            for name in names:
                decisions[key] = options[name]
                times[name] = step_us()
            best = min(times, key=times.get)
            decisions[key] = options[best if times[best] < times[current] * (1 - min_gain) else current]
            self.in_step[key] = times
        keys = list(original)
        if not keys:
            return {}
        tuned = {key: decisions[key] for key in keys}
        changed = {"/".join(str(p) for p in key): [str(original[key]), str(tuned[key])]
                   for key in keys if tuned[key] != original[key]}
        if not changed:
            step = min(self.in_step[keys[-1]].values())
            return {"before_us": step, "after_us": step, "changed": {}}
        before, after = [], []
        for _ in range(2):
            decisions.update(original)
            before.append(step_us())
            decisions.update(tuned)
            after.append(step_us())
        if min(after) >= min(before) * (1 - min_gain):  # not confirmed: the lone-timed choices stay
            decisions.update(original)
            return {"before_us": min(before), "after_us": min(before), "changed": {}, "unconfirmed": changed,
                    "unconfirmed_us": min(after)}
        return {"before_us": min(before), "after_us": min(after), "changed": changed}

    # -- choosing -----------------------------------------------------------------------------

    def takes(self, x: torch.Tensor, proj: Linear) -> bool:
        """Whether the small-batch kernels may run these rows of x through proj (few 16-bit rows,
        a weight they read, the fused kernels on): the sites above then choose; else the layer's own
        product runs."""
        return self._kernels(x, proj) is not None

    def _kernels(self, x: torch.Tensor, proj: Linear):
        """kernels.gemv when the kernel may run x through proj (few 16-bit rows, a weight of x's dtype
        or FP8 with its per-row scales or block scales some configuration takes, not timing), else None."""
        if self._choosing or x.dim() == 0 or x.dtype not in (torch.bfloat16, torch.float16):
            return None
        kernels = use_fused(x, "gemv")
        if kernels is None or x.numel() // max(1, x.shape[-1]) > kernels.MMA_MAX_ROWS:
            return None
        weight = proj.weight
        if weight.dtype != x.dtype and not (weight.dtype == torch.float8_e4m3fn
                                            and (proj.weight_scale_rows is not None or _configs(kernels, proj))):
            return None
        return kernels

    def _run(self, site: str, x: torch.Tensor, weight: torch.Tensor, kernels, fused: Callable[[tuple], Any],
             plain: Callable[[], Any], configs=None, margin: float = MARGIN):
        """The chosen path for this site (kernels: from _kernels; configs: the kernel
        configurations to time, kernels.CONFIGS by default, the first taken untimed; margin: MARGIN,
        or FOLD_MARGIN where the kernel replaces several)."""
        configs = kernels.CONFIGS if configs is None else configs
        if fused_kernels_mode() == "force" or not x.is_cuda:
            return fused(configs[0])
        key = _key(site, x, weight)
        choice = self.decisions.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                if key not in self._logged_capture:
                    self._logged_capture.add(key)
                    logger.info("small-batch GEMV %s first seen while capturing a CUDA graph: unfused path", key)
                return plain()
            choice = self._stored_choice(key, fused, plain, configs)
            if choice is not None:
                self.reused += 1
            else:
                choice = self._choose(key, x, fused, plain, configs, margin, kernels)
            self.decisions[key] = choice
        return plain() if choice == UNFUSED else fused(choice)

    def _choose(self, key: tuple, x: torch.Tensor, fused: Callable[[tuple], Any], plain: Callable[[], Any], configs,
                margin: float = MARGIN, kernels=None) -> Any:
        flush = l2_flush_buffer(x.device)
        self._choosing = True
        try:
            if kernels is not None:  # every configuration's kernel compiled side by side, then each timed
                with compile_ahead.compiling():
                    for config in configs:
                        try:
                            fused(config)
                        except Exception:  # noqa: S112 (refused here; the timing loop below says why)
                            continue
            timings = {UNFUSED: time_us(plain, flush)}
            options = self.options[key] = {UNFUSED: UNFUSED}
            best, best_us = UNFUSED, timings[UNFUSED] * margin
            reference = plain()
            for config in configs:
                try:
                    if not _agrees(fused(config), reference):  # a miscompiled configuration never runs a step
                        logger.warning("small-batch GEMV %s: config %s disagrees with the unfused path: refused",
                                       key, config)
                        continue
                    us = time_us(lambda: fused(config), flush)  # noqa: B023 (called here, inside the loop)
                except Exception as error:  # a configuration that cannot compile or launch here (shared memory)
                    logger.debug("small-batch GEMV %s: config %s unusable: %s", key, config, error)
                    continue
                timings[str(config)] = us
                options[str(config)] = config
                if us < best_us:
                    best, best_us = config, us
        finally:
            self._choosing = False
            del flush
        self.timings[key] = timings
        logger.debug("small-batch GEMV %s: chose %s from %s", key, best, timings)
        return best


def _scale_args(kernels, proj: Linear) -> dict[str, Any]:
    """small_batch_linear's scale arguments for proj's weight: its block scales or its row scales."""
    if proj.weight_scale_blocks is not None:
        return {"weight_block_scales": kernels.BlockScales(proj.weight_scale_blocks, proj.weight_block_rows,
                                                           proj.weight_block_cols)}
    return {"weight_scale": proj.weight_scale_rows}


def _configs(kernels, proj: Linear, norm: bool = False, pending: PendingNorm | None = None, gelu: bool = False,
             rows: int = 1) -> tuple:
    """The configurations to time for proj's weight at `rows` rows (those that read its block scales,
    if it has them, those with Gemma's forms where the pending norm or the activation is Gemma's,
    the tensor-core ones past kernels.MAX_ROWS)."""
    block_rows = proj.weight_block_rows if proj.weight_scale_blocks is not None else None
    return kernels.configs_for(proj.weight.dtype, norm=norm, block_rows=block_rows,
                               gemma=gelu or (pending is not None and _gemma_form(pending)), rows=rows)


def _rows_of(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def _gemma_form(pending: PendingNorm) -> bool:
    return pending.norm.unit_offset or pending.x_norm is not None


def _norm_args(pending: PendingNorm) -> dict[str, Any]:
    """small_batch_linear's prologue arguments for a pending norm (Llama's or Gemma's forms)."""
    norm = pending.norm
    args: dict[str, Any] = dict(norm_weight=norm.weight, residual=pending.residual_in, eps=norm.eps)
    if _gemma_form(pending):
        args.update(unit_offset=norm.unit_offset,
                    x_norm_weight=pending.x_norm.weight if pending.x_norm is not None else None)
    return args


def _norm_site(site: str, pending: PendingNorm, add: bool = True) -> str:
    """The site's name: "add_" with a residual (add); "_unit" for Gemma's norm, "_after" with a
    sublayer's norm."""
    name = site if pending.residual_in is None or not add else f"add_{site}"
    if pending.norm.unit_offset:
        name += "_unit"
    return name + ("_after" if pending.x_norm is not None else "")


def _agrees(got: Any, reference: Any, tolerance: float = AGREEMENT) -> bool:
    """Whether a path's output (the first tensor of a tuple) is finite and within `tolerance` of the
    reference's, relative to its norm; outputs that are not tensors (tests' stand-ins) agree."""
    got = got[0] if isinstance(got, tuple) else got
    reference = reference[0] if isinstance(reference, tuple) else reference
    if not isinstance(got, torch.Tensor) or not isinstance(reference, torch.Tensor):
        return True
    got, reference = got.float(), reference.float()
    if got.shape != reference.shape or not bool(torch.isfinite(got).all()):
        return False
    return bool((got - reference).norm() <= tolerance * reference.norm() + 1e-6)


_current: SmallBatchGemv | None = None


def current() -> SmallBatchGemv | None:
    """The chooser that layers built now consult (set by `building`); None outside it."""
    return _current


@contextmanager
def building(chooser: SmallBatchGemv | None) -> Iterator[SmallBatchGemv | None]:
    """Within the block, layers built consult `chooser` (a model runner's, while it builds its model)."""
    global _current
    previous, _current = _current, chooser
    try:
        yield chooser
    finally:
        _current = previous


__all__ = ["AGREEMENT", "FOLD_MARGIN", "IN_STEP_MIN_GAIN", "IN_STEP_ROWS", "IN_STEP_TOP", "IN_STEP_VERIFY_TOP", "MARGIN", "SmallBatchGemv", "UNFUSED",
           "building", "current"]
