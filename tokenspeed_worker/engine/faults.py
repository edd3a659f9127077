"""Test hook: TOKENSPEED_FAULT_INJECT makes the engine fail at a chosen step.

kind@STEP or hang@STEP:SECONDS; at the STEP-th step that runs on the device (counting from 1):
- oom: raises torch.OutOfMemoryError inside the step (the engine fails that step's requests);
- hang: sleeps SECONDS (an hour when not given) before the step's device work;
- crash: exits the engine process with status 3.
Unset, nothing is installed: the step's path holds no check for it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenspeed_worker import env

logger = logging.getLogger(__name__)

KINDS = ("oom", "hang", "crash")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    seconds: float  # how long a hang lasts

    def wrap(self, run_step: Callable) -> Callable:
        """`run_step` (called once per step that runs on the device), failing at this fault's step."""
        count = 0

        def faulty(*args):
            nonlocal count
            count += 1
            if count == self.step:
                self.strike()
            return run_step(*args)

        return faulty

    def strike(self) -> None:
        if self.kind == "oom":
            import torch

            raise torch.OutOfMemoryError("injected by TOKENSPEED_FAULT_INJECT")
        if self.kind == "hang":
            time.sleep(self.seconds)
        if self.kind == "crash":
            os._exit(3)


def parse(spec: str) -> Fault | None:
    """kind@STEP, or hang@STEP:SECONDS (a stall that ends; hang alone is an hour); "" is None."""
    if not spec:
        return None
    kind, _, when = spec.partition("@")
    step, _, seconds = when.partition(":")
    try:
        duration = float(seconds) if seconds else 3600.0
    except ValueError:
        duration = -1.0
    if kind not in KINDS or not step.isdigit() or duration < 0 or (seconds and kind != "hang"):
        raise ValueError(f"TOKENSPEED_FAULT_INJECT: expected oom|hang|crash@STEP or hang@STEP:SECONDS, got {spec!r}")
    logger.warning("fault injection armed: %s at step %s", kind, when)
    return Fault(kind, int(step), duration)


def from_env() -> Fault | None:
    return parse(env.FAULT_INJECT.get())
