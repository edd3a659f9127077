"""Programmatic dependent launch (PDL) for our Triton kernels, on sm_90 and newer.

A decode step at small batch is a chain of short kernels; between two of them the GPU drains the
first (its last programs finish while the rest of the chip idles) before it launches and ramps up
the second. Launched with PDL (`launch_pdl=True`, CUDA's programmatic stream serialization,
kept by CUDA-graph capture as a programmatic edge), a kernel may start while the previous one
still runs. Each PDL kernel here follows one rule that keeps that safe:

- before `tl.extra.cuda.gdc_wait()` it reads only what no kernel of the step writes (weights,
  rotary tables, positions and slots copied in before the step) and writes nothing;
- right after the wait (every earlier kernel has finished and its writes are visible) it calls
  `gdc_launch_dependents()`, so the next kernel may launch once all of this one's programs got
  that far.

Since every kernel waits before touching anything a neighbour writes, the chain stays ordered
even where a PDL kernel follows a cuBLAS or torch kernel (which simply launches it at its end).
The small-batch GEMV kernels (kernels/gemv.py) load their first weight tile before the wait: the
bytes that dominate a decode step start moving while the previous kernel finishes.
"""

from __future__ import annotations

import torch

from tokenspeed_worker import env

_capable: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability >= 9, not Triton's
    interpreter."""
    if device.type != "cuda" or env.triton_interpreter():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def launch_options(on: bool) -> dict:
    """Extra launch keywords for a Triton kernel (PDL on or off)."""
    return {"launch_pdl": True} if on else {}


__all__ = ["enabled", "launch_options"]
