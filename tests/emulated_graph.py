"""A stand-in for a CUDA graph on CPU: "capture" records the decode step, "replay" re-runs it on
the same static buffers and metadata, so CPU tests exercise the runner's whole graph path
(padding, the dummy block, static buffers). ModelRunner(..., graph_class=EmulatedGraph)."""

from __future__ import annotations

from collections.abc import Callable


class EmulatedGraph:
    def capture(self, step: Callable[[], None], pool) -> None:
        self.step = step

    def replay(self) -> None:
        self.step()
