"""Where startup goes: each phase of building an engine timed and logged at info as it ends.

    startup: weight load 2.1 s (dummy)
    startup: CUDA graph capture 21.0 s (first runs, mostly kernel compiles, 12.3 s; kernel timing 5.1 s; ...)
    startup phases: model construction 0.3 s, weight load 2.1 s, ... = 27.3 s

`StartupPhases.phase(name)` times a block; `add(name, seconds, detail)` records one timed
elsewhere. Only rank 0 of a tensor-parallel group logs (its ranks run the phases in lockstep).
docs/operations.md lists the phases.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tokenspeed_worker import distributed

logger = logging.getLogger(__name__)


class StartupPhases:
    def __init__(self) -> None:
        self.phases: list[tuple[str, float, str]] = []  # (name, seconds, detail)

    def add(self, name: str, seconds: float, detail: str = "") -> None:
        self.phases.append((name, seconds, detail))
        if distributed.rank() == 0:
            logger.info("startup: %s %.1f s%s", name, seconds, f" ({detail})" if detail else "")

    @contextmanager
    def phase(self, name: str) -> Iterator[dict]:
        """Time the block as phase `name`; the block may set `detail` in the yielded dict."""
        info = {"detail": ""}
        start = time.perf_counter()
        yield info
        self.add(name, time.perf_counter() - start, info["detail"])

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds, _ in self.phases)

    def summary(self) -> str:
        """One line: every phase with its seconds, and their sum."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds, _ in self.phases)
        return f"{parts} = {self.total:.1f} s"


class Progress:
    """A progress line every `every` seconds through a long phase (`tick(done)` after each item)."""

    def __init__(self, what: str, total: int, every: float = 15.0) -> None:
        self.what, self.total, self.every = what, total, every
        self.start = self.last = time.perf_counter()

    def tick(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every and done < self.total and distributed.rank() == 0:
            logger.info("%s: %d of %d done (%.0f s)", self.what, done, self.total, now - self.start)
            self.last = now
