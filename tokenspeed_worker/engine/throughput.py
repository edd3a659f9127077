"""The engine's output throughput: tokens per second over a sliding window (Loads.gen_throughput)."""

from __future__ import annotations

import collections
import time

THROUGHPUT_WINDOW_S = 10.0


class ThroughputWindow:
    """Output tokens of the steps of the last `window_s` seconds and their sum. Adding a step and
    reading the rate are O(1) amortized: loads are read after every step that has KV events."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._steps: collections.deque[tuple[float, int]] = collections.deque()  # (time.monotonic(), tokens)
        self._tokens = 0

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        self._steps.append((now, tokens))
        self._tokens += tokens
        self._trim(now)

    def rate(self) -> float:
        """Tokens per second between the oldest step in the window and now (0 with fewer than two)."""
        now = time.monotonic()
        self._trim(now)
        steps = self._steps
        span = (now - steps[0][0]) if len(steps) > 1 else 0.0
        return self._tokens / span if span > 0 else 0.0

    def _trim(self, now: float) -> None:
        steps = self._steps
        while steps and now - steps[0][0] >= self.window_s:
            self._tokens -= steps.popleft()[1]
