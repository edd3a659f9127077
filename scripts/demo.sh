#!/usr/bin/env bash
# The main job: set up .venv if needed, then worker + smg gateway + one chat answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python scripts/demo.py "$@"
