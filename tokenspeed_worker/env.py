"""Every environment variable the worker reads, typed, in one place.

Command-line flags configure a deployment; these are the few process-level switches beneath
them (a test hook, a debugging fallback, a default directory). Each is read where it is used:
FUSED_KERNELS and DIST_TIMEOUT_S once, when their modules are imported; the others when the
code that needs them runs. docs/operations.md lists them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_FALSE = ("0", "off", "false", "no")
_TRUE = ("1", "on", "true", "yes")


def _flag(value: str) -> bool:
    value = value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}, got {value!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: its name, its value when unset or empty, how its text is read."""

    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        text = os.environ.get(self.name, "")
        if not text.strip():
            return self.default
        try:
            return self.parse(text)
        except ValueError as error:
            raise ValueError(f"{self.name}: {error}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())


FUSED_KERNELS = EnvVar(
    "TOKENSPEED_FUSED_KERNELS", "auto", str,
    "auto | off | force (1 is auto, 0 off): the layers' fused Triton kernels on CUDA (auto), never "
    "(off: the torch reference path), or on any device (force: CPU tests in Triton's interpreter).")
OVERLAP_SCHEDULE = EnvVar[bool | None](
    "TOKENSPEED_OVERLAP_SCHEDULE", None, _flag,
    "Overlap scheduling where the engine configuration leaves it unset (default: on for CUDA).")
FAULT_INJECT = EnvVar(
    "TOKENSPEED_FAULT_INJECT", "", str,
    "Test hook: oom|hang|crash@STEP or hang@STEP:SECONDS makes the engine fail at that step.")
PROFILE_DIR = EnvVar(
    "TOKENSPEED_PROFILE_DIR", "/tmp/tokenspeed_profiles", str,
    "Where StartProfile writes traces when the request names no output_dir.")
DIST_TIMEOUT_S = EnvVar(
    "TOKENSPEED_DIST_TIMEOUT_S", 120.0, float,
    "Seconds a tensor-parallel collective waits for a peer before the rank gives up.")


def triton_interpreter() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's own TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


SPECULATIVE_ORACLE = EnvVar[str | None](
    "TOKENSPEED_SPECULATIVE_ORACLE", None, str,
    "Benchmarks only: a JSON file of token sequences (prompt + the model's greedy output, recorded "
    "in a first pass); with --speculative-algorithm set, a request whose prompt begins one of them "
    "is drafted that sequence's continuation by position, and the verification keeps the right "
    "draft tokens whatever the model draws (forced acceptance; engine/speculative.OracleDrafter).")
SPECULATIVE_ORACLE_ACCEPT = EnvVar(
    "TOKENSPEED_SPECULATIVE_ORACLE_ACCEPT", 1.0, float,
    "Benchmarks only: the fraction of the oracle's draft tokens right (kept; the rest are changed "
    "and rejected, by a hash of their position), for an acceptance curve below 100%.")
PYCACHE = EnvVar(
    "TOKENSPEED_WORKER_PYCACHE", "", str,
    "Not a setting: the worker sets it, beside PYTHONPYCACHEPREFIX, for its own processes when it keeps "
    "Python's bytecode in the cache folder (bytecode.py), so that they write there too.")
ALL = (FUSED_KERNELS, OVERLAP_SCHEDULE, FAULT_INJECT, PROFILE_DIR, DIST_TIMEOUT_S, SPECULATIVE_ORACLE,
       SPECULATIVE_ORACLE_ACCEPT, PYCACHE)
