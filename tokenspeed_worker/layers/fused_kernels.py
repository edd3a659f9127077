"""The one switch between the layers' fused Triton kernels and their torch code.

Four fusions share it: add + RMSNorm (layers/layernorm.RMSNorm, kernels/norm.py),
silu(gate) * up (layers/activation.SiluAndMul, kernels/activation.py), rotary + the
KV-cache write (layers/attention/layer.Attention.forward_with_rotary with a backend that attends
over K/V written beforehand, kernels/rotary.py), and the resolution of overlap
scheduling's pending input ids (model_executor/cuda_graph.resolve_pending_ids,
kernels/pending_ids.py). Each computes the same values, with the
same roundings, as the torch code it replaces, which stays the reference path. The small-batch
GEMV kernels (layers/small_batch_gemv.py) follow the same mode.

Modes:
- "auto" (default): the fused kernels on CUDA tensors when triton imports; torch code otherwise.
- "off": the torch code everywhere.
- "force": the fused kernels on any device. On CPU they run in Triton's interpreter, so
  TRITON_INTERPRET=1 must be set before triton is first imported (tests only: slow).

The mode comes from the environment variable TOKENSPEED_FUSED_KERNELS (auto | off | force; 1 is
auto, 0 is off), read once when this module is imported, and can be changed at run time with
`set_fused_kernels(mode)` or, scoped, `with fused_kernels(mode):`. The layers read it at every
call, so a CUDA graph keeps the path it was captured with.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from types import ModuleType

import torch

from tokenspeed_worker import env

ENV_VAR = env.FUSED_KERNELS.name
MODES = ("auto", "off", "force")
# The activation dtypes the kernels compute like torch (in float32, rounded to the dtype); others take the torch path.
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIASES = {"": "auto", "1": "auto", "on": "auto", "true": "auto", "0": "off", "false": "off"}


def _parse(mode: str | bool) -> str:
    if mode is True or mode is False:
        return "auto" if mode else "off"
    value = str(mode).strip().lower()
    value = _ALIASES.get(value, value)
    if value not in MODES:
        raise ValueError(f"fused kernels mode {mode!r} is not one of {', '.join(MODES)} (or 0/1)")
    return value


_mode = _parse(env.FUSED_KERNELS.get())
_modules: dict[str, ModuleType | None] = {}


def fused_kernels_mode() -> str:
    return _mode


def set_fused_kernels(mode: str | bool) -> str:
    """Set the mode ("auto", "off", "force"; True is "auto", False "off"); returns the previous one."""
    global _mode
    previous, _mode = _mode, _parse(mode)
    return previous


@contextmanager
def fused_kernels(mode: str | bool):
    """The mode within a with-block, restored after."""
    previous = set_fused_kernels(mode)
    try:
        yield
    finally:
        set_fused_kernels(previous)


def kernels(name: str) -> ModuleType | None:
    """tokenspeed_worker.kernels.<name> when its kernels are usable (triton imports), else None.

    Imported on first use, not with the layers: importing triton must wait until the process has
    chosen TRITON_INTERPRET (tests and scripts set it late)."""
    if name not in _modules:
        try:
            module = importlib.import_module(f"tokenspeed_worker.kernels.{name}")
        except ImportError:  # pragma: no cover - depends on the machine
            module = None
        _modules[name] = module if module is not None and getattr(module, "AVAILABLE", False) else None
    return _modules[name]


def use_fused(x: torch.Tensor, name: str) -> ModuleType | None:
    """The kernels module `name` when the fused path should run on x under the current mode, else None."""
    if _mode == "off" or (_mode == "auto" and not x.is_cuda):
        return None
    module = kernels(name)
    if module is None and _mode == "force":
        raise RuntimeError(f"{ENV_VAR}=force, but tokenspeed_worker.kernels.{name} cannot run (no triton)")
    return module


__all__ = ["ENV_VAR", "FUSED_DTYPES", "MODES", "fused_kernels", "fused_kernels_mode", "kernels", "set_fused_kernels", "use_fused"]
