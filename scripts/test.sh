#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole CPU suite
# (unit, engine-vs-transformers, gRPC, and end to end through the real smg gateway).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python scripts/prepare_smollm2.py >/dev/null
exec python -m pytest -q -m "not gpu" "$@"
