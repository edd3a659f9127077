"""StartProfile / StopProfile: torch.profiler traces of the engine process.

The trace is a Chrome-trace JSON file (`<output_dir>/tokenspeed-engine-<time>-<pid>-<n>.trace.json`,
n counting this process's traces: two in one second never share a name);
open it in https://ui.perfetto.dev or chrome://tracing. CPU activity is always recorded, GPU
kernels too on a CUDA device. With `num_steps`, the profile stops by itself after that many
engine steps and writes the file then.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)


class EngineProfiler:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._profile = None
        self._output_dir = ""
        self._steps_left: int | None = None
        self._traces = 0  # written by this process
        # A profile that ended by itself (num_steps) and whose file no StopProfile has reported yet:
        # the next StopProfile answers with it; after that, StopProfile has nothing to stop.
        self._unreported: str | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str, num_steps: int | None, activities, with_stack: bool, record_shapes: bool):
        if self._profile is not None:
            return False, "a profile is already running (StopProfile it first)"
        wanted = {a.upper() for a in (activities or ("CPU", "GPU"))}
        unknown = wanted - {"CPU", "GPU", "CUDA", "MEM"}
        if unknown:
            return False, f"activities: unknown {sorted(unknown)} (use CPU, GPU)"
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if wanted & {"GPU", "CUDA"} and self._device.type == "cuda":
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as exc:
            return False, f"output_dir: cannot create {output_dir!r}: {exc}"
        self._profile = torch.profiler.profile(activities=kinds, with_stack=with_stack, record_shapes=record_shapes,
                                               profile_memory="MEM" in wanted)
        self._profile.__enter__()
        self._output_dir = output_dir
        self._steps_left = num_steps if num_steps and num_steps > 0 else None
        logger.info("profiling started (%s) into %s", ", ".join(k.name for k in kinds), output_dir)
        return True, f"profiling started; the trace goes to {output_dir}"

    def step_done(self) -> None:
        """Called after each engine step: ends a profile that was given a number of steps."""
        if self._profile is None or self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop(by_itself=True)

    def stop(self, by_itself: bool = False):
        if self._profile is None:
            if self._unreported:
                path, self._unreported = self._unreported, None
                return True, f"profile already finished after its num_steps: {path}"
            return False, "no profile is running (StartProfile first)"
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self._traces += 1
        path = os.path.join(self._output_dir, f"tokenspeed-engine-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
                                              f"{self._traces}.trace.json")
        profile.export_chrome_trace(path)
        self._unreported = path if by_itself else None
        logger.info("profile written to %s", path)
        return True, f"trace written to {path} (open it in https://ui.perfetto.dev)"
