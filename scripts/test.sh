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
# Each test process (and each worker a test starts) would run torch on every core: two of them on a
# two-core machine then spin four threads and thrash (the CPU-heavy files took twice as long). Each
# gets its share of the cores unless OMP_NUM_THREADS says otherwise.
workers=${TEST_WORKERS:-2}
if [ -z "${OMP_NUM_THREADS:-}" ] && [ "$workers" -gt 1 ]; then
  threads=$(( $(nproc) / workers ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
exec python -m pytest -q -m "not gpu" -n "$workers" --dist loadfile "$@"
