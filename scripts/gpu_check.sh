#!/usr/bin/env bash
# The GPU machine's one entry point (device tool): set up, then run the named suites.
#   bash scripts/gpu_check.sh [SUITE...] [PYTEST_ARGS...]       (no suite: tests)
# Suites:
#   tests      the test suite on CUDA, without the SmolLM2 and smg gateway tests (neither can travel)
#              and the proto-contract test (needs grpcio-tools and a registry); PYTEST_ARGS go here;
#              TESTS_SHARD=I/N runs the I-th of N slices of the test files, by name's checksum (a suite longer than a call:
#              with -n 12-14 --dist loadfile on one H100 the whole suite takes about 700 s, so N=2 at TESTS_TIMEOUT=540)
#   kernels    the kernel, backend and CUDA-graph GPU tests, then bench_kernels.py (KERNELS_ARGS)
#   selfcheck  scripts/gpu_selfcheck.py
#   latency    batch-1 decode of the engine alone, 8B and 1B shapes (LATENCY_MODELS), bench_latency.py
#   offline    bench_offline.py, OFFLINE_CASES of SHAPE_LEN (1000 requests x LEN in / LEN out): 8b_1000 1b_128;
#              70b_LEN (Llama-3.1-70B: with QUANTS=fp8, on an H200);
#              also q30b_LEN (Qwen3-30B-A3B), mixtral_LEN (Mixtral-8x7B), mistral_LEN (Mistral-7B) and
#              gemma12_LEN (Gemma-3-12B text); LATENCY_MODELS takes their
#              names (qwen3-30b-a3b, mixtral-8x7b, mistral-7b, gemma-3-12b) and llama-3.1-8b-fp8-block
#   serving    bench_serving.py through the CLI and gRPC, 1B shape (SERVING_MODEL), C=1 64 256 (SERVING_C)
#              from 8 client processes, a SubscribeKvEvents stream held open (SERVING_SUBSCRIBE=0: none);
#              the JSON has the launch-to-healthy startup_s; SERVING_CLOSED=1: each of the C streams runs
#              SERVING_ROUNDS requests back to back (closed loop) instead of waves of C; SERVING_STEPS=1:
#              the worker with metrics on, the engine's steps per second and tokens per step per level
#   prefix     bench_prefix.py, 1B shape (SERVING_MODEL), prefix cache on and off
#   sampler    bench_sampler.py, batch 256 x vocab 128,256
#   graphmem   bench_graph_memory.py: the device memory of each decode and piecewise capture, the graphs' pool
#              apart from the ordinary cache, for GRAPHMEM_MODELS (llama-3.1-8b llama-3.2-1b)
#   startup    startup_probe.py: an engine process's first steps (torch, the CUDA driver and context, triton,
#              transformers and its config) one by one in fresh processes, SERVING_MODEL's config; then
#              bench_startup.py: launch to healthy through the CLI, cold (an empty --cache-dir) then warm
#              (the same folder again), for STARTUP_MODELS (llama-3.1-8b llama-3.2-1b), each for QUANTS
#              (fp8: --quantization fp8); STARTUP_PROBE=0: not the probe; STARTUP_WARM_REPEATS=N: N warm starts (median)
#   moe        the MoE tests on CUDA, bench_moe.py (MOE_BENCH_ARGS), MOE_TUNE=1: bench_moe.py --tune (the grouped
#              GEMMs' tiles per shape, kept in the cache folder), then bench_latency.py at MOE_MODELS
#              (qwen3-30b-a3b; also mixtral-8x7b)
#   speculative bench_speculative.py: NGRAM through the CLI and gRPC with the oracle drafter at forced
#              acceptance (SPEC_ACCEPT), batch sizes (SPEC_BATCH) and verify widths (SPEC_DRAFT_TOKENS), 8B and
#              1B shapes (SPEC_MODELS); the real-text part where SmolLM2 is carried (SPEC_TEXT_MODEL=DIR);
#              then the speculative tests on CUDA (SPEC_TESTS=0: not them)
#   tp         several GPUs (nvidia-h200-x2/-x4): the all-reduce and tensor-parallel tests on CUDA,
#              bench_allreduce.py (NCCL against the one-shot path by message size, TP_GPUS), then
#              batch-1 decode at TP_MODELS (llama-3.1-8b) for each of TP_SIZES (1 2), the TP>1 ones also
#              with every all-reduce on NCCL (custom_all_reduce=false); TP_OFFLINE=LEN adds offline
#              1000 x LEN/LEN at each size; TP_SERVING=1 adds batch 1 through the CLI and gRPC (--tp N);
#              TP_EP=1 adds expert parallelism over the N ranks (MoE models: qwen3-30b-a3b)
#   window     bench_window.py through the CLI and gRPC: a model shape (WINDOW_MODEL, mistral-7b) with every layer
#              windowed (WINDOW, 4096) and with full attention, one request at each of WINDOW_CONTEXTS (4096 8192
#              16384 32768) tokens: KV held (GetLoads) and decode rate by context (issue 26)
#   fp8        the FP8 GPU tests (scaled GEMM, activation quantization, GEMV on FP8 weights), the FP8
#              checkpoint and KV-scale tests on CUDA (block-scaled GEMM, kept-FP8 folds), then
#              fp8_accuracy.py (FP8 against bf16 on the same weights) for FP8_MODELS (llama-3.1-8b)
# QUANTS (latency, offline, startup): "none" (default), "fp8" (online FP8: --engine-arg quantization=fp8) or both;
# a case quantized gets the suffix _fp8.
# SERVING_PYSPY=SECONDS (serving): py-spy stacks of the worker's processes, logs/pyspy_serving_*.txt.gz.
# BENCH_ARGS: more flags for latency and offline (e.g. "--engine-arg kv_cache_dtype=fp8"); SERVING_ARGS:
# more worker flags for serving and prefix (e.g. "--dp 2"); *_TIMEOUT: each run's limit in seconds.
# A/B of two trees: AB_TREE=DIR runs each bench suite (latency offline serving prefix sampler; the others
# run once, for this tree) for this tree ("new") and DIR ("old"), alternating for AB_ROUNDS (2) rounds (round 2 runs old first),
# each tree with its own scripts and its own editable install, then prints the table of both. DIR is
# another checkout, e.g. `git archive COMMIT | tar -x -C .cache/ab_old` (carry .cache/ab_old). A device
# call lasts at most 600 s: one 8b_1000 run takes about 130 s, a latency run about 30 s, so give each
# call what fits (e.g. `AB_TREE=.cache/ab_old bash scripts/gpu_check.sh latency`, then the same with
# `OFFLINE_CASES=8b_1000 ... offline`).
# Results: $OUT/SUITE_CASE[_TREE_rROUND].json, their logs in $OUT/logs (with the startup lines of each
# worker a bench started, logs/SUITE_CASE_startup.txt), an index in $OUT/results.tsv
# (`python3 scripts/bench_summary.py OUT` prints the table again). The device tool sends back at most
# 8 files of $OUT, so the run ends by packing: logs/ into logs.tgz, and the JSON files into
# results.tgz where $OUT would still hold more than 8 (`tar -xzf` them where they land). Run several
# gpu_check.sh in one call with one OUT each ($OUT/a, $OUT/b: two folders down still come back), and
# count their files together. DRY_RUN=1 prints what would run and checks that each script, test file
# and option exists in its tree.
# A folder too large for one call (a real model) travels in pieces over several calls of one warm lease:
# scripts/carry_pieces.sh.
# Carry .whl (grpcio-health-checking and grpcio-reflection 1.84.0 for Python 3.12: the machine lacks
# them; .whl/*/ for more, e.g. flashinfer) and .cache/triton (below).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs" && OUT=$(cd "$OUT" && pwd)
DRY_RUN=${DRY_RUN:-0}
SERVING_MODEL=${SERVING_MODEL:-$REPO/scripts/model_configs/llama-3.2-1b}
BENCH_SUITES=" latency offline serving prefix sampler startup "
OTHER_SUITES=" tests kernels selfcheck fp8 moe speculative tp window graphmem "
suites=()
while [ $# -gt 0 ] && [[ $1 != -* ]]; do
  case "$OTHER_SUITES$BENCH_SUITES" in
    *" $1 "*) suites+=("$1") ;;
    *) echo "unknown suite: $1 ($OTHER_SUITES$BENCH_SUITES)"; exit 2 ;;
  esac
  shift
done
[ ${#suites[@]} = 0 ] && suites=(tests)
pytest_args=("$@")
rc=0
[ "$DRY_RUN" = 1 ] || : >"$OUT/results.tsv"

dry() { [ "$DRY_RUN" = 1 ]; }

# check DIR CMD...: (dry run) CMD's files exist in DIR and its --options appear in its script's source.
check() {
  local dir=$1 script="" a prev=""
  shift
  for a in "$@"; do
    [ "$a" = -- ] && break  # worker flags follow
    [ "$prev" = --out ] && a=""  # written by the run
    prev=$a
    case $a in
      --*) [ -n "$script" ] && ! grep -q -- "\"${a%%=*}\"" "$dir/$script" "$dir/scripts/bench_common.py" 2>/dev/null \
        && { echo "  NOT AN OPTION of $dir/$script: $a"; rc=1; } ;;
      *.py | *.toml | */*) a=${a%%::*}  # a test's node id names its file
        [ -e "$a" ] || [ -e "$dir/$a" ] || { echo "  MISSING: $dir/$a"; rc=1; }
        [ -z "$script" ] && [[ $a == scripts/*.py ]] && script=$a ;;
    esac
  done
}

# step NAME SECONDS DIR CMD...: CMD run in DIR under a time limit, its output in $OUT/logs/NAME.log.
step() {
  local name=$1 seconds=$2 dir=$3
  shift 3
  if dry; then
    local shown=() a
    for a in "$@"; do [[ $a == *" "* ]] && shown+=("'$a'") || shown+=("$a"); done
    echo "[$dir] timeout $seconds ${shown[*]}"
    check "$dir" "$@"
    return 0
  fi
  (cd "$dir" && timeout "$seconds" "$@") >"$OUT/logs/$name.log" 2>&1
}

failed() {  # NAME EXIT: one line, and the log's last error lines
  rc=1
  [ "$2" = 124 ] && echo "$1: timed out" || echo "$1: FAILED (exit $2)"
  grep -E "Error|error|Traceback" "$OUT/logs/$1.log" | tail -3 | cut -c1-300
}

# bench SUITE CASE SECONDS SCRIPT ARGS...: one bench script of the tree under test ($tree, $tag), its
# JSON indexed in results.tsv and reported in one line.
bench() {
  local suite=$1 case=$2 seconds=$3 script=$4
  shift 4
  local name=${suite}_$case${tag:+_$tag} mark
  mark=$(mktemp)
  step "$name" "$seconds" "$tree" python3 "$script" --out "$OUT/$name.json" "$@"
  local status=$?
  dry && { rm -f "$mark"; return 0; }
  startup_phases "$name" "$mark"
  if [ $status != 0 ] || [ ! -s "$OUT/$name.json" ]; then
    failed "$name" $status
    return
  fi
  printf "%s\t%s\t%s\t%s\t%s\n" "$suite" "$case" "${side:-this}" "${round:-1}" "$name.json" >>"$OUT/results.tsv"
  python3 "$REPO/scripts/bench_summary.py" --line "$suite" "$OUT/$name.json" "$suite $case${tag:+ [$side r$round]}"
}

# startup_phases NAME MARK: the startup lines of the workers a bench started (their logs newer than MARK,
# under the tree's .cache/logs) into $OUT/logs/NAME_startup.txt; each worker's phase sum and launch to
# serving printed (issue 27's breakdown of every start, cold or warm).
startup_phases() {
  local logs
  logs=$(find "$tree/.cache/logs" -name 'worker-*.log' -newer "$2" 2>/dev/null)
  rm -f "$2"
  [ -n "$logs" ] || return 0
  # shellcheck disable=SC2086
  grep -h "startup\|ready .* after launch\|CUDA graphs\|small-batch" $logs | cut -c1-600 >"$OUT/logs/$1_startup.txt"
  grep -h "startup phases:\|after launch" "$OUT/logs/$1_startup.txt" | sed 's/^.*INFO //' | cut -c1-400
}

pytest_run() {  # NAME SECONDS PYTEST_ARGS...: in this tree, with pytest's summary lines
  local name=$1 seconds=$2
  shift 2
  # -rfE names the failures in the summary; -v names each as it happens (a run cut by its limit
  # prints no summary, but its log still says which tests failed).
  # Each failure's traceback goes to logs/NAME_failures.txt as it happens (tests/conftest.py).
  TOKENSPEED_TEST_FAILURE_LOG=$OUT/logs/${name}_failures.txt \
    step "$name" "$seconds" "$REPO" python3 -m pytest -v -rfE -p no:cacheprovider --durations=30 "$@"
  local status=$?
  dry && return 0
  grep -E " passed| failed|FAILED|ERROR" "$OUT/logs/$name.log" | grep -v "PASSED" | tail -40 | cut -c1-300
  # The slowest tests (a run that finished), to balance the shards: logs/NAME_durations.txt.
  sed -n '/slowest .* durations/,/^=\+ .*\(passed\|failed\)/p' "$OUT/logs/$name.log" >"$OUT/logs/${name}_durations.txt"
  [ $status = 0 ] || failed "$name" $status
}

# install DIR: DIR's package (its native core built there) as the editable install, if not already.
installed=""
install() {
  [ "$installed" = "$1" ] && return 0
  installed=$1
  if dry; then
    echo "[$1] python3 -m pip install -q --no-build-isolation --no-deps -e ."
    check "$1" pyproject.toml tokenspeed_worker/__init__.py
    return 0
  fi
  local t0
  t0=$(date +%s)
  (cd "$1" && timeout "${INSTALL_TIMEOUT:-300}" python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5)
  # From / so that no folder on sys.path shadows the install; the package must be DIR's.
  if ! (cd / && python3 -c "
import os, sys, tokenspeed_worker as p, tokenspeed_worker._scheduler_core as m
print('package:', p.__file__, 'native core:', m.__file__)
sys.exit(not os.path.realpath(p.__file__).startswith(os.path.realpath(sys.argv[1]) + '/'))" "$1"); then
    echo "install of $1 failed"
    installed="" rc=1
    return 1
  fi
  echo "native build + install of $1: $(( $(date +%s) - t0 )) s"
}

suite_tests() {
  # TESTS_SHARD=I/N: the I-th of N slices of the test files, so that a suite longer than one call runs
  # whole over N calls. A file's slice is its name's checksum modulo N: a test file added or removed
  # moves no other file to another slice (by position it would, and a shard run before the change
  # and the other shard run after it would leave files out).
  local files=()
  if [ -n "${TESTS_SHARD:-}" ]; then
    local i=${TESTS_SHARD%/*} n=${TESTS_SHARD#*/} f h
    for f in tests/test_*.py; do
      [ "$f" = tests/test_proto_contract.py ] && continue
      h=$(printf %s "$f" | cksum | cut -d' ' -f1)
      [ $((h % n)) = $((i - 1)) ] && files+=("$f")
    done
  fi
  # One torch thread per test process (12-14 of them share 16 cores; each would take all 16 and thrash).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  pytest_run tests${TESTS_SHARD:+_${TESTS_SHARD%/*}of${TESTS_SHARD#*/}} "${TESTS_TIMEOUT:-540}" -m "not e2e and not smollm2" \
    --ignore=tests/test_proto_contract.py ${files[@]+"${files[@]}"} ${pytest_args[@]+"${pytest_args[@]}"}
}

suite_kernels() {
  pytest_run kernel_tests "${KERNEL_TESTS_TIMEOUT:-420}" -m gpu ${KERNEL_TESTS:-tests/test_triton_kernels.py \
    tests/test_triton_backend.py tests/test_cuda_graph_logic.py tests/test_piecewise_graph.py tests/test_small_batch_gemv.py \
    tests/test_fused_kernels.py tests/test_flashinfer_backend.py}
  step kernels "${KERNELS_TIMEOUT:-150}" "$REPO" python3 scripts/bench_kernels.py --out "$OUT/kernels.json" \
    ${KERNELS_ARGS:---only gemv --gemv-rows 1 4}
  local status=$?
  dry && return 0
  grep -E "^gemv|^decode|^extend|^fused|copy" "$OUT/logs/kernels.log" | tail -40 | cut -c1-200
  [ $status = 0 ] || failed kernels $status
}

suite_selfcheck() {
  step selfcheck "${SELFCHECK_TIMEOUT:-200}" "$REPO" python3 scripts/gpu_selfcheck.py --out "$OUT/selfcheck.json"
  local status=$?
  dry && return 0
  grep -E "^FAIL|^batch|passed, " "$OUT/logs/selfcheck.log" | tail -20 | cut -c1-200
  [ $status = 0 ] || failed selfcheck $status
}

# quant_args Q: the bench flags of quantization Q ("none" or "fp8") in $qargs, the worker's (CLI) flags in
# $wargs, and its case suffix in $suffix.
quant_args() {
  case $1 in
    none) suffix="" qargs="" wargs="" ;;
    fp8) suffix=_fp8 qargs="--engine-arg quantization=fp8" wargs="--quantization fp8" ;;
    *) echo "QUANTS: unknown $1 (none fp8)"; rc=1; return 1 ;;
  esac
}

suite_latency() {
  local m q
  for q in ${QUANTS:-none}; do
    quant_args "$q" || continue
    for m in ${LATENCY_MODELS:-llama-3.1-8b llama-3.2-1b}; do
      bench latency "${m##*/}$suffix" "${LATENCY_TIMEOUT:-150}" scripts/bench_latency.py --model "$m" --prompt-len 128 \
        --new-tokens 128 $qargs ${BENCH_ARGS:-}
    done
  done
}

suite_offline() {
  local c len q
  for q in ${QUANTS:-none}; do
    quant_args "$q" || continue
    for c in ${OFFLINE_CASES:-8b_1000 1b_128}; do
      len=${c#*_}
      case ${c%%_*} in
        # The 8B runs as docs/benchmarks.md's: 512 sequences, graphs up to 512 rows.
        8b) bench offline "$c$suffix" "${OFFLINE_TIMEOUT:-330}" scripts/bench_offline.py --model llama-3.1-8b \
              --num-requests 1000 --input-len "$len" --output-len "$len" --max-num-seqs 512 \
              --engine-arg max_cudagraph_capture_size=512 $qargs ${BENCH_ARGS:-} ;;
        1b) bench offline "$c$suffix" "${OFFLINE_TIMEOUT:-330}" scripts/bench_offline.py --model llama-3.2-1b \
              --num-requests 1000 --input-len "$len" --output-len "$len" $qargs ${BENCH_ARGS:-} ;;
        # Llama-3.1-70B fits one H200 only as FP8 (QUANTS=fp8; issue 24).
        70b) bench offline "$c$suffix" "${OFFLINE_TIMEOUT:-480}" scripts/bench_offline.py --model llama-3.1-70b \
              --num-requests 1000 --input-len "$len" --output-len "$len" $qargs ${BENCH_ARGS:-} ;;
        # The MoE shapes (issue 25): Qwen3-30B-A3B (61 GB bf16) and Mixtral-8x7B (93 GB bf16); the
        # other dense families (issue 26): Mistral-7B, Gemma-3-12B (text; sliding-window layers).
        q30b|mixtral|mistral|gemma12)
          local shape
          case ${c%%_*} in q30b) shape=qwen3-30b-a3b ;; mixtral) shape=mixtral-8x7b ;; mistral) shape=mistral-7b ;;
            gemma12) shape=gemma-3-12b ;; esac
          bench offline "$c$suffix" "${OFFLINE_TIMEOUT:-330}" scripts/bench_offline.py --model "$shape" \
              --num-requests 1000 --input-len "$len" --output-len "$len" $qargs ${BENCH_ARGS:-} ;;
        *) echo "offline: unknown case $c (8b_LEN, 1b_LEN, 70b_LEN, q30b_LEN, mixtral_LEN, mistral_LEN or gemma12_LEN)"
           rc=1 ;;
      esac
    done
  done
}

suite_fp8() {
  pytest_run fp8_tests "${FP8_TESTS_TIMEOUT:-300}" -m gpu ${FP8_TESTS:-tests/test_fp8_gemm.py tests/test_small_batch_gemv.py} \
    -k fp8
  # The checkpoint formats, the block-scaled GEMM and the KV-cache scales on CUDA (kept FP8, Triton).
  pytest_run fp8_checkpoint_tests "${FP8_TESTS_TIMEOUT:-300}" ${FP8_CHECKPOINT_TESTS:-tests/test_fp8_checkpoints.py \
    tests/test_fp8_kv_scales.py}
  local m
  for m in ${FP8_MODELS:-llama-3.1-8b}; do
    step "fp8_accuracy_${m##*/}" "${FP8_ACCURACY_TIMEOUT:-240}" "$REPO" python3 scripts/fp8_accuracy.py --model "$m" \
      --out "$OUT/fp8_accuracy_${m##*/}.json"
    local status=$?
    dry && continue
    grep -E "^batch|runners built" "$OUT/logs/fp8_accuracy_${m##*/}.log" | cut -c1-200
    [ $status = 0 ] || failed "fp8_accuracy_${m##*/}" $status
  done
}

suite_moe() {
  # The MoE tests on CUDA (grouped-GEMM kernels against the loop, whole models against transformers,
  # expert parallelism's partial sums), then batch-1 decode at the MoE shapes (MOE_MODELS).
  pytest_run moe_tests "${MOE_TESTS_TIMEOUT:-300}" tests/test_moe.py tests/test_engine_vs_hf.py -k "moe or mixtral or expert"
  # One layer's experts at decode batch sizes: the decode kernels against the grouped GEMMs (MOE_BENCH_ARGS,
  # e.g. --configs to time every strip configuration).
  step moe_kernels "${MOE_BENCH_TIMEOUT:-300}" "$REPO" python3 scripts/bench_moe.py --out "$OUT/moe_kernels.json" \
    ${MOE_BENCH_ARGS:-}
  local status=$?
  dry || { grep -E "^(copy|qwen|mixtral)" "$OUT/logs/moe_kernels.log" | cut -c1-300; [ $status = 0 ] || failed moe_kernels $status; }
  # MOE_TUNE=1: the grouped GEMMs' tiles tuned for the MoE shapes (bench_moe.py --tune), kept in this
  # machine's cache folder (so the latency runs below start with them; sent back in $OUT/kernel_choices.tgz).
  if [ "${MOE_TUNE:-0}" = 1 ]; then
    step moe_tune "${MOE_TUNE_TIMEOUT:-420}" "$REPO" python3 scripts/bench_moe.py --tune --out "$OUT/moe_tune.json"
    status=$?
    dry || { grep -E "^[0-9]+/.* pairs|tuned tiles" "$OUT/logs/moe_tune.log" | cut -c1-200; [ $status = 0 ] || failed moe_tune $status; }
  fi
  local m
  for m in ${MOE_MODELS:-qwen3-30b-a3b}; do
    bench latency "$m" "${LATENCY_TIMEOUT:-150}" scripts/bench_latency.py --model "$m" --prompt-len 128 --new-tokens 128 \
      ${BENCH_ARGS:-}
  done
}

suite_tp() {
  pytest_run tp_tests "${TP_TESTS_TIMEOUT:-300}" tests/test_peer_all_reduce.py tests/test_tensor_parallel.py
  step tp_allreduce "${TP_BENCH_TIMEOUT:-300}" "$REPO" python3 scripts/bench_allreduce.py --gpus "${TP_GPUS:-2}" \
    --out "$OUT/tp_allreduce.json"
  local status=$?
  dry || { grep -E "^ +[0-9]+ x|path chosen" "$OUT/logs/tp_allreduce.log" | cut -c1-200; [ $status = 0 ] || failed tp_allreduce $status; }
  local m n variant
  for m in ${TP_MODELS:-llama-3.1-8b}; do
    for n in ${TP_SIZES:-1 2}; do
      for variant in one-shot nccl ep; do
        [ "$n" = 1 ] && [ $variant != one-shot ] && continue
        [ $variant = ep ] && [ "${TP_EP:-0}" != 1 ] && continue
        local flags=(--engine-arg tensor_parallel_size="$n") case=${m}_tp$n
        [ $variant = nccl ] && { flags+=(--engine-arg custom_all_reduce=false); case=${case}_nccl; }
        [ $variant = ep ] && { flags+=(--engine-arg expert_parallel_size="$n"); case=${case}_ep$n; }
        bench latency "$case" "${LATENCY_TIMEOUT:-300}" scripts/bench_latency.py --model "$m" --prompt-len 128 \
          --new-tokens 128 "${flags[@]}" ${BENCH_ARGS:-}
        [ "${TP_SERVING:-0}" = 1 ] && bench serving "$case" "${SERVING_TIMEOUT:-400}" scripts/bench_serving.py \
          --model "scripts/model_configs/$m" --concurrency 1 --prompt-len 128 --output-len 128 --rounds 4 -- \
          --load-format dummy --tp "$n" $([ $variant = nccl ] && echo --disable-custom-all-reduce) \
          $([ $variant = ep ] && echo --ep-size "$n") ${SERVING_ARGS:-}
        [ -n "${TP_OFFLINE:-}" ] && bench offline "$case" "${OFFLINE_TIMEOUT:-400}" scripts/bench_offline.py --model "$m" \
          --num-requests 1000 --input-len "$TP_OFFLINE" --output-len "$TP_OFFLINE" "${flags[@]}" ${BENCH_ARGS:-}
      done
    done
  done
}

suite_serving() {
  local sub=--subscribe case=${SERVING_MODEL##*/}_sub
  [ "${SERVING_SUBSCRIBE:-1}" = 1 ] || { sub=""; case=${SERVING_MODEL##*/}_nosub; }
  [ -n "${SERVING_PYSPY:-}" ] && ! dry && pyspy_worker "$OUT/logs/pyspy_serving_${case}${tag:+_$tag}.txt"
  bench serving "$case" "${SERVING_TIMEOUT:-300}" scripts/bench_serving.py --model "$SERVING_MODEL" \
    --concurrency ${SERVING_C:-1 64 256} --prompt-len 128 --output-len 128 --rounds "${SERVING_ROUNDS:-2}" \
    --client-procs 8 $sub $([ "${SERVING_CLOSED:-0}" = 1 ] && echo --closed-loop) \
    $([ "${SERVING_STEPS:-0}" = 1 ] && echo --engine-steps) -- --load-format dummy ${SERVING_ARGS:-}
  # Where the startup went: the worker's own log lines of its phases (its log stays on the machine).
  dry || grep -hE "startup|CUDA graphs: captured|KV pool sizing|engine ready|warm-up|serving .* on|first seen while" \
    "$(ls -t "$tree"/.cache/logs/worker-*.log 2>/dev/null | head -1)" 2>/dev/null | cut -c1-300 \
    > "$OUT/logs/serving_${case}${tag:+_$tag}_startup.log"
  # With SERVING_ARGS=--enable-log-request-stats: where each request's first token went, server side
  # (queue: received -> first scheduled by the engine; prefill: -> first token back at the server).
  dry || grep -h "Finish!" "$(ls -t "$tree"/.cache/logs/worker-*.log 2>/dev/null | head -1)" 2>/dev/null \
    | python3 -c "
import re, statistics, sys
rows = [dict((k, float(v)) for k, v in re.findall(r'(queue_ms|prefill_ms|ttft_ms|total_ms)=([0-9.]+)', line)) for line in sys.stdin]
rows = [r for r in rows if r]
if rows:
    print('  request stats, server side (${case} ${tag}): %d requests; p50 ' % len(rows) + ', '.join(
        '%s %.2f' % (k, statistics.median(r[k] for r in rows)) for k in ('queue_ms', 'prefill_ms', 'ttft_ms', 'total_ms')))"
}

# SERVING_PYSPY=SECONDS: sample the worker's processes (server, engine) with py-spy (carry its wheel in
# .whl/) for SECONDS, in the background, as collapsed stacks into FILE (one "process PID:..." root per
# process; compare the trees' server and engine stacks at the same load). Sampling starts once the
# worker serves with every decode graph captured (what the bench waits for), plus SERVING_PYSPY_AFTER
# seconds (default 1: the bench's warm-up request), so the stacks are the load's, not the start's.
# Idle frames are kept (--idle): a blocked pipe write or poll shows where a process waits.
pyspy_worker() {
  command -v py-spy >/dev/null || { echo "SERVING_PYSPY: py-spy is not installed (carry its wheel in .whl/)"; return; }
  (
    for _ in $(seq 120); do  # this tree's worker (the harness starts it in the tree)
      for pid in $(pgrep -f -- "-m tokenspeed_worker"); do
        [ "$(readlink "/proc/$pid/cwd")" = "$(cd "$tree" && pwd -P)" ] && break 2
      done
      pid=""
      sleep 0.5
    done
    [ -n "$pid" ] || return
    port=$(tr '\0' ' ' < "/proc/$pid/cmdline" | sed -n 's/.*--grpc-port \([0-9]*\).*/\1/p')
    log="$tree/.cache/logs/worker-$port.log"
    for _ in $(seq 3000); do  # at most 600 s
      if [ -f "$log" ] && grep -q "), ready" "$log"; then
        grep -q "while the engine idles or needs them" "$log" && ! grep -q "captured after startup" "$log" || break
      fi
      kill -0 "$pid" 2>/dev/null || return
      sleep 0.2
    done
    sleep "${SERVING_PYSPY_AFTER:-1}"
    py-spy record --pid "$pid" --subprocesses --nonblocking --idle --rate 100 --format raw \
      -d "$SERVING_PYSPY" -o "$1" >"$1.log" 2>&1 && gzip -f "$1"  # ~0.15 MB/s of stacks before gzip
  ) &
}

suite_speculative() {
  local m
  for m in ${SPEC_MODELS:-llama-3.1-8b llama-3.2-1b}; do
    # Verify widths (tokens per verify step: the last one + drafts), each against the one plain run.
    bench speculative "$m" "${SPEC_TIMEOUT:-420}" scripts/bench_speculative.py --parts oracle \
      --model "$REPO/scripts/model_configs/$m" --batch ${SPEC_BATCH:-1 16 64} --accept ${SPEC_ACCEPT:-1.0 0.8 0.5 0} \
      --draft-tokens ${SPEC_DRAFT_TOKENS:-4 5} --prompt-len 128 --output-len 256 -- --load-format dummy ${SERVING_ARGS:-}
  done
  [ -n "${SPEC_TEXT_MODEL:-}" ] && bench speculative text "${SPEC_TIMEOUT:-420}" scripts/bench_speculative.py \
    --parts text --text-model "$SPEC_TEXT_MODEL" --draft-tokens ${SPEC_DRAFT_TOKENS:-4 5} -- ${SERVING_ARGS:-}
  # SPEC_TESTS=0: the benches only (the tests suite runs tests/test_speculative.py too).
  [ "${SPEC_TESTS:-1}" = 0 ] || pytest_run speculative_tests "${SPEC_TESTS_TIMEOUT:-240}" tests/test_speculative.py
}

suite_window() {
  local m=${WINDOW_MODEL:-mistral-7b}
  bench window "$m" "${WINDOW_TIMEOUT:-540}" scripts/bench_window.py --model "$REPO/scripts/model_configs/$m" \
    --window "${WINDOW:-4096}" --contexts ${WINDOW_CONTEXTS:-4096 8192 16384 32768} --output-len 128 -- ${SERVING_ARGS:-}
}

suite_prefix() {
  bench prefix "${SERVING_MODEL##*/}" "${PREFIX_TIMEOUT:-300}" scripts/bench_prefix.py --model "$SERVING_MODEL" \
    --conversations 16 --turns 4 --system-len 1024 --user-len 64 --output-len 32 -- --load-format dummy ${SERVING_ARGS:-}
}

suite_startup() {
  [ "${STARTUP_PROBE:-1}" = 0 ] || bench startup probe "${STARTUP_TIMEOUT:-240}" scripts/startup_probe.py \
    --model "$SERVING_MODEL" --repeats 3
  local m q
  for q in ${QUANTS:-none}; do
    quant_args "$q" || continue
    for m in ${STARTUP_MODELS:-llama-3.1-8b llama-3.2-1b}; do
      bench startup "$m$suffix" "${STARTUP_BENCH_TIMEOUT:-420}" scripts/bench_startup.py \
        --model "$REPO/scripts/model_configs/$m" --warm-repeats "${STARTUP_WARM_REPEATS:-1}" -- $wargs ${SERVING_ARGS:-}
    done
  done
}

suite_graphmem() {
  local m
  for m in ${GRAPHMEM_MODELS:-llama-3.1-8b llama-3.2-1b}; do
    bench graphmem "$m" "${GRAPHMEM_TIMEOUT:-150}" scripts/bench_graph_memory.py --model "$m" ${BENCH_ARGS:-}
  done
}

suite_sampler() {
  bench sampler b256 "${SAMPLER_TIMEOUT:-120}" scripts/bench_sampler.py --batch 256 --vocab 128256
}

# Set up: carried wheels, the environment, Triton's cache, this tree's native build.
if dry; then
  echo "(dry run: nothing below runs)"
else
  wheels=$(compgen -G ".whl/*.whl"; compgen -G ".whl/*/*.whl")  # `ls` of a glob with no match fails the test
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  fi
  # Triton's compiled kernels from an earlier call (carry .cache/triton as pieces triton.tgz.*; TRITON_CACHE_OUT=1
  # sends them back): a fresh machine otherwise compiles them again (~150 s for the 8B engine's capture sizes).
  if ls .cache/triton/triton.tgz.* >/dev/null 2>&1; then
    mkdir -p ~/.triton && cat .cache/triton/triton.tgz.* | tar -xzf - -C ~/.triton && echo "triton cache: $(ls ~/.triton/cache | wc -l) entries"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
  # The worker serves health and reflection from packages the machine lacks: without the carried wheels
  # every test and bench that starts a worker fails after minutes, so stop before spending the call.
  python3 -c "import grpc_health.v1.health, grpc_reflection.v1alpha.reflection" 2>/dev/null || {
    echo "gpu_check: grpc_health / grpc_reflection do not import: carry .whl (pip download --no-deps" \
         "--only-binary=:all: --python-version 3.12 -d .whl grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0)"
    exit 3
  }
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENSPEED_TEST_DEVICE=cuda
install "$REPO" || exit 1

tree=$REPO tag="" side="" round=""
if [ -z "${AB_TREE:-}" ]; then
  for s in "${suites[@]}"; do "suite_$s"; done
else
  AB_TREE=$(cd "$AB_TREE" && pwd) || exit 2
  ab_suites=()
  for s in "${suites[@]}"; do
    case $BENCH_SUITES in *" $s "*) ab_suites+=("$s") ;; *) "suite_$s" ;; esac
  done
  # Rounds alternate which tree goes first (new old, old new, ...): the first run of a lease also pays
  # the Triton compiles of kernels the carried cache lacks, which must not land on one tree only.
  for round in $(seq "${AB_ROUNDS:-2}"); do
    order="new old"; [ $((round % 2)) = 0 ] && order="old new"
    for side in $order; do
      tree=$REPO
      [ $side = old ] && tree=$AB_TREE
      tag=${side}_r$round
      install "$tree" || continue
      for s in ${ab_suites[@]+"${ab_suites[@]}"}; do "suite_$s"; done
    done
  done
  dry || python3 scripts/bench_summary.py "$OUT"
fi

# The kernel choices this machine's starts kept (scripts/ship_kernel_choices.py ships them with the package),
# as one tar: the folders' names (device keys such as ...-torch2.11.0+cu130-...) hold characters the
# device tool does not send back.
if ! dry && compgen -G ~/.cache/tokenspeed-worker/"*"/"*.json" >/dev/null; then
  (cd ~/.cache/tokenspeed-worker && find . -mindepth 2 -maxdepth 2 -name '*.json' -print0 \
     | tar -czf "$OUT/kernel_choices.tgz" --null -T -)
fi

# Send Triton's compiled kernels back (TRITON_CACHE_OUT=1), in pieces under the 16 MiB a file may be.
if [ "${TRITON_CACHE_OUT:-0}" = 1 ] && [ -d ~/.triton/cache ] && ! dry; then
  tar -czf - -C ~/.triton cache | split -b 15m -d - "$OUT/triton.tgz."
  ls -la "$OUT"/triton.tgz.*
fi
# The device tool returns at most 8 files from $OUT (more are left behind, logs first, as happened to a
# failing test's traceback): the logs as one tar, then the JSON results as one where still too many.
if ! dry; then
  (cd "$OUT" && [ -d logs ] && tar -czf logs.tgz logs && rm -rf logs)
  if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && find . -maxdepth 1 -name '*.json' -printf '%P\n' | tar -czf results.tgz -T - \
      && find . -maxdepth 1 -name '*.json' -delete)
  fi
  n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  [ "$n" -le 8 ] || echo "warning: $n files in $OUT; the device tool returns 8"
fi
exit "$rc"
