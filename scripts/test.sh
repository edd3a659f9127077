#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole CPU suite
# (unit, engine-vs-transformers, gRPC, and end to end through the real smg gateway).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python scripts/prepare_smollm2.py >/dev/null
# Two test files at a time (a file's tests stay together: they share module fixtures, such as a
# started worker; the few files listed in tests/conftest.py's SPREAD_FILES go test by test);
# TEST_WORKERS=0 runs one test at a time, and a -n in the arguments wins.
exec python -m pytest -q -m "not gpu" -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
