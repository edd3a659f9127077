#!/usr/bin/env bash
# On the GPU machine (device tool): install carried wheels, build the native extension,
# run the test suite with the torch backend on CUDA, then the benchmarks.
#   bash scripts/gpu_check.sh [pytest args...]
# Carry .whl (grpcio-health-checking and grpcio-reflection 1.84.0 for Python 3.12: the machine
# lacks them). SmolLM2 and the smg gateway cannot travel (size), so tests that need them and the
# proto-contract test (needs grpcio-tools and registry access) are deselected there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENSPEED_TEST_DEVICE=cuda
# Triton's compiled kernels from an earlier call (TRITON_CACHE_OUT=1 below sends them back; carry
# .cache/triton as pieces triton.tgz.*): a fresh machine otherwise compiles them again (~150 s for
# the 8B engine's capture sizes).
if ls .cache/triton/triton.tgz.* >/dev/null 2>&1; then
  mkdir -p ~/.triton && cat .cache/triton/triton.tgz.* | tar -xzf - -C ~/.triton && echo "triton cache: $(ls ~/.triton/cache | wc -l) entries"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5
echo "native build + install: $(( $(date +%s) - t0 )) s"
python3 -c "import tokenspeed_worker._scheduler_core as m; print('native core:', m.__file__)" || exit 1
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m "not e2e and not smollm2" \
    --ignore=tests/test_proto_contract.py "$@" 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
# Benchmarks, on Llama-3.2-1B-shaped random weights (a config-only folder travels).
if [ "${BENCH_PREFIX:-0}" = 1 ]; then
  python3 scripts/bench_prefix.py --model scripts/model_configs/llama-3.2-1b --conversations 16 --turns 4 \
    --system-len 1024 --user-len 64 --output-len 32 --out "$OUT/gpu_prefix.json" -- --load-format dummy \
    2>&1 | grep -v "^20..-" | tail -8
fi
if [ "${BENCH_SAMPLER:-0}" = 1 ]; then
  python3 scripts/bench_sampler.py --batch 256 --vocab 128256 --out "$OUT/gpu_sampler.json" 2>&1 | grep -v '^{'
fi
# The GPU speed work: self-check of triton backend + CUDA graphs, kernel tests, then benchmarks.
if [ "${BENCH_PERF:-0}" = 1 ] && [ "${SKIP_SELFCHECK:-0}" != 1 ]; then
  timeout 200 python3 scripts/gpu_selfcheck.py --out "$OUT/gpu_selfcheck.json" 2>&1 | grep -v "^20..-" | tail -40
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py \
    tests/test_triton_backend.py tests/test_cuda_graph_logic.py 2>&1 | tail -15
fi
if [ "${BENCH_PERF:-0}" = 1 ]; then
  # Where a decode step's time goes (kernels by device time, busy vs wall), then batch-1 latency
  # with overlap scheduling (the default) and without it.
  for m in llama-3.1-8b llama-3.2-1b; do
    timeout 120 python3 scripts/profile_decode.py --model $m --batch 1 --steps 32 --top 14 \
      --out "$OUT/profile_${m}_b1.json" 2>&1 | grep -v "^20..-\|^STAGE\|Warning\|warn" | tail -17
    timeout 120 python3 scripts/bench_latency.py --model $m --prompt-len 128 --new-tokens 128 \
      --out "$OUT/latency_$m.json" 2>&1 | grep -E "decode:|TB/s|Error|error" | tail -4
  done
  timeout 120 python3 scripts/bench_latency.py --model llama-3.2-1b --prompt-len 128 --new-tokens 128 \
    --engine-arg overlap_schedule=false --out "$OUT/latency_llama-3.2-1b_no_overlap.json" 2>&1 \
    | grep -E "decode:|Error|error" | tail -3
  timeout 150 python3 scripts/bench_offline.py --model llama-3.2-1b --num-requests 1000 --input-len 128 \
    --output-len 128 --out "$OUT/offline_1b_128.json" 2>&1 | grep -E "tokens in|idle|Error|error" | tail -4
  timeout 200 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 128 \
    --output-len 128 --out "$OUT/offline_8b_128.json" 2>&1 | grep -E "tokens in|idle|Error|error" | tail -4
fi
# Decode-step kernels (BENCH_DECODE=1): the skinny kernels' and fused kernels' GPU tests, batch-1
# latency for both shapes (the JSON records which skinny path each site chose, with its timings),
# and the skinny kernels against the unfused path per site and row count.
if [ "${BENCH_DECODE:-0}" = 1 ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_skinny_kernels.py tests/test_fused_kernels.py \
    2>&1 | tail -4
  # Each shape with the skinny kernels off (the default) and on (their per-site choice, timed from
  # CUDA graphs, is recorded in the JSON as skinny_kernels).
  for m in llama-3.1-8b llama-3.2-1b; do
    for skinny in 0 1; do
      TOKENSPEED_SKINNY_KERNELS=$skinny timeout ${LATENCY_TIMEOUT:-100} python3 scripts/bench_latency.py --model $m \
        --prompt-len 128 --new-tokens 128 --out "$OUT/latency_${m}_skinny$skinny.json" 2>&1 \
        | grep -E "decode:|rror" | sed "s/^/skinny=$skinny /" | tail -3
    done
  done
  timeout 60 python3 scripts/bench_kernels.py --only skinny --skinny-rows 1 4 --out "$OUT/kernels_skinny.json" \
    2>&1 | grep -E "^skinny|copy|rror" | tail -30
fi
# Programmatic dependent launch (BENCH_PDL=1): the kernel and graph tests on CUDA (PDL on and off
# give the same bits), batch-1 latency for both shapes with PDL on (the default) and off
# (TOKENSPEED_PDL=0; PDL_MODES=1 measures only "on"), and the skinny kernels against the unfused path.
if [ "${BENCH_PDL:-0}" = 1 ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graph_logic.py tests/test_skinny_kernels.py \
    tests/test_fused_kernels.py tests/test_triton_kernels.py tests/test_triton_backend.py tests/test_fp8_kv_cache.py \
    2>&1 | tail -4
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py -k pending_ids 2>&1 | tail -1
  for m in llama-3.2-1b llama-3.1-8b; do
    for p in ${PDL_MODES:-1 0}; do
      TOKENSPEED_PDL=$p timeout ${LATENCY_TIMEOUT:-100} python3 scripts/bench_latency.py --model $m \
        --prompt-len 128 --new-tokens 128 --out "$OUT/latency_${m}_pdl$p.json" 2>&1 \
        | grep -E "decode:|rror|one program" | cut -c1-300 | sed "s/^/pdl=$p /" | tail -4
    done
  done
  # Which path each skinny site chose for the 1B shape, with the timings.
  BENCH_LOG_LEVEL=DEBUG timeout 100 python3 scripts/bench_latency.py --model llama-3.2-1b --prompt-len 128 \
    --new-tokens 16 --out "$OUT/latency_1b_choices.json" 2>&1 | grep -E "chose|rror" | cut -c1-400 | tail -12
  timeout 90 python3 scripts/bench_kernels.py --only skinny --skinny-rows 1 --out "$OUT/kernels_skinny_pdl.json" \
    2>&1 | grep -E "^skinny|rror" | tail -10
fi
# A/B of one change, batch-1 latency, alternating rounds on one machine: ab_latency MODEL LABEL PATCH
# runs bench_latency.py after the Python statement PATCH (empty: the defaults).
# run_patched SECONDS PATCH SCRIPT ARGS...: scripts/SCRIPT after the Python statement PATCH.
run_patched() {
  local seconds=$1 patch=$2 script=$3
  shift 3
  PATCH="$patch" timeout "$seconds" python3 -c "
import os, runpy, sys
sys.path.insert(0, 'scripts')
exec(os.environ['PATCH'])
sys.argv = ['$script'] + sys.argv[1:]
runpy.run_path('scripts/$script', run_name='__main__')" "$@"
}
ab_latency() {
  run_patched ${LATENCY_TIMEOUT:-100} "$3" bench_latency.py --model "$1" --prompt-len 128 --new-tokens 128 \
    --out "$OUT/latency_${1}_$2.json" 2>&1 | grep -E "decode:|rror|one program" | cut -c1-240 | sed "s/^/$1 $2: /" | tail -3
}
# ab_on_off LABEL PATCH: AB_ROUNDS (2) rounds of AB_MODELS (1B then 8B), each the defaults (LABEL_on_N) then PATCH (LABEL_off_N).
ab_on_off() {
  for round in $(seq ${AB_ROUNDS:-2}); do
    for m in ${AB_MODELS:-llama-3.2-1b llama-3.1-8b}; do
      ab_latency $m "$1_on_$round" ""
      ab_latency $m "$1_off_$round" "$2"
    done
  done
}
# This tree against another (AB_TREE=DIR holding an older tokenspeed_worker/ package, e.g.
# `git archive REV tokenspeed_worker | tar -x -C DIR`), batch-1 latency, alternating rounds
# (AB_ROUNDS, AB_MODELS). The older package runs from DIR (with this tree's scripts, which put
# their own parent first on sys.path, and this build's native core). Also prints each run's
# graph-capture line (the startup cost of the in-step refinement).
if [ -n "${AB_TREE:-}" ]; then
  cp "$(python3 -c 'import tokenspeed_worker._scheduler_core as m; print(m.__file__)')" "$AB_TREE/tokenspeed_worker/"
  rm -rf "$AB_TREE/scripts" && cp -r scripts "$AB_TREE/scripts"
  # The editable install's import finder outranks sys.path: the old tree's runs drop it first.
  RUN_TREE='
import runpy, sys
if sys.argv[1] == "old":
    sys.meta_path[:] = [f for f in sys.meta_path if not any(k in repr(f).lower() for k in ("editable", "redirect", "scikit"))]
    sys.path.insert(0, ".")
sys.argv = sys.argv[2:]
sys.path.insert(0, "scripts")
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    import tokenspeed_worker
    print("package:", tokenspeed_worker.__file__)'
  for round in $(seq ${AB_ROUNDS:-2}); do
    for m in ${AB_MODELS:-llama-3.2-1b llama-3.1-8b}; do
      for tree in new old; do
        dir=.; [ $tree = old ] && dir="$AB_TREE"
        (cd "$dir" && BENCH_LOG_LEVEL=info timeout ${LATENCY_TIMEOUT:-150} python3 -c "$RUN_TREE" $tree scripts/bench_latency.py \
          --model $m --prompt-len 128 --new-tokens 128 --out "$OUT/latency_${m}_${tree}_$round.json" 2>&1 \
          | grep -E "decode:|rror|CUDA graphs: captured|refined in-step|package:" | cut -c1-300 | sed "s/^/$m $tree $round: /")
      done
    done
  done
fi
# The fused q/k/v + rotary + KV-write site on and off (AB_ROPE=1), 1B (off: llama's decoder finds
# skinny.norm_qkv_rope declining and takes norm_linear + the rotary kernel).
if [ "${AB_ROPE:-0}" = 1 ]; then
  for round in 1 2; do
    ab_latency llama-3.2-1b rope_on_$round ""
    ab_latency llama-3.2-1b rope_off_$round "from tokenspeed_worker.layers import skinny; skinny.norm_qkv_rope = lambda *a, **k: None"
  done
fi
# The decode kernel's own rotary + KV write on and off (AB_ATTN_ROPE=1; off: the rotary kernel runs
# before the attention, as before), after the kernel and backend tests on CUDA (the fused path
# against the two kernels it replaces, bit for bit); batch-1 latency, AB_ROUNDS x AB_MODELS.
if [ "${AB_ATTN_ROPE:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_triton_kernels.py \
    tests/test_triton_backend.py tests/test_cuda_graph_logic.py -k "${AB_ATTN_ROPE_TESTS:-rope or rotate or gpu or graph}" \
    2>&1 | tail -12
  ab_on_off attn_rope "from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend as B
B.fuse_decode_rope = False"
fi
# The decode graphs' tail, the float32 widening of the logits and their argmax in one kernel, on and
# off (AB_LOGITS=1; off: the copy and the two argmax kernels, as before), after its kernel test and
# the graph tests on CUDA; batch-1 latency, AB_ROUNDS x AB_MODELS.
if [ "${AB_LOGITS:-0}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_triton_kernels.py \
    tests/test_cuda_graph_logic.py tests/test_model_runner.py -k "widen or argmax or graph or gpu" 2>&1 | tail -8
  ab_on_off logits "from tokenspeed_worker.model_executor.cuda_graph import DecodeGraphs
DecodeGraphs.fuse_logits_argmax = False"
fi
# Persistent skinny programs (AB_PERSISTENT=1): the skinny kernel tests on CUDA, every
# configuration of every 1B and 8B site alone at one row (bench_kernels' config_us), then batch-1
# latency, AB_ROUNDS x AB_MODELS, with the Persistent configurations offered (on) and not (off).
if [ "${AB_PERSISTENT:-0}" = 1 ]; then
  if [ "${AB_PERSISTENT_TESTS:-1}" = 1 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_skinny_kernels.py 2>&1 | tail -8
    timeout 150 python3 scripts/bench_kernels.py --only skinny --skinny-rows 1 --out "$OUT/kernels_skinny_persistent.json" \
      2>&1 | grep -E "^skinny|copy|rror" | tail -14
  fi
  ab_on_off persistent "import os; os.environ['TOKENSPEED_SKINNY_PERSISTENT'] = '0'"
fi
# The decode attention's timed single-split threshold on and off (AB_SINGLE_SPLIT=1), 1B and 8B
# (off: tune_decode times nothing, so every request splits as before).
if [ "${AB_SINGLE_SPLIT:-0}" = 1 ]; then
  # The kernel alone at the 1B shape's heads: split (default) against one program per kv head.
  timeout 90 python3 scripts/bench_kernels.py --only attention --batches 1 4 16 --contexts 128 256 512 1024 2048 \
    --heads 32 --kv-heads 8 --head-dim 64 --single-split --prefill-lens 128 --no-reference \
    --out "$OUT/kernels_decode_single_split.json" 2>&1 | grep -E "^decode|rror" | tail -30
  ab_on_off single "from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend as B; B.tune_decode = lambda self, *a, **k: {}"
fi
# Skinny kernel configurations forced at every site against the timed choice (AB_SKINNY_CONFIGS=1),
# 1B batch 1: the timing runs each site alone, while in a step each kernel overlaps its neighbour
# (PDL), so a configuration that loads more before its wait may win there and not alone.
# SKINNY_FORCE: the configurations, e.g. "4,2048,4 4,2048,8".
if [ "${AB_SKINNY_CONFIGS:-0}" = 1 ]; then
  ab_latency llama-3.2-1b timed ""
  for c in ${SKINNY_FORCE:-4,2048,4 4,2048,8 2,2048,4}; do
    ab_latency llama-3.2-1b "force_${c//,/_}" "from tokenspeed_worker.layers import skinny
c = ($c,)
skinny._choose = lambda key, x, fused, plain, configs, *rest: c if c in configs else configs[0]"
  done
  ab_latency llama-3.2-1b timed_2 ""
fi
# The in-step refinement of the skinny sites' choices on and off (AB_STEP_TUNING=1), batch 1, 1B and
# 8B (off: the lone-timed choices, as before; layers/skinny.py's tune_in_step).
if [ "${AB_STEP_TUNING:-0}" = 1 ]; then
  ab_on_off step_tuning "from tokenspeed_worker.layers import skinny; skinny.set_step_tuning(False)"
fi
# Startup time with the in-step refinement on and off (STARTUP_TIME=1): the engine built with its
# defaults (capture sizes 1, 2, 4, 8, ... 256: the refinement runs at 1, 2 and 4 rows), and its log
# of what was refined.
if [ "${STARTUP_TIME:-0}" = 1 ]; then
  for m in ${STARTUP_MODELS:-llama-3.2-1b llama-3.1-8b}; do
    for tuning in ${STARTUP_TUNING:-1 0}; do
      TOKENSPEED_SKINNY_PERSISTENT=${STARTUP_PERSISTENT:-1} TOKENSPEED_STEP_TUNING=$tuning timeout 200 python3 -c '
import logging, sys, time
sys.path.insert(0, "scripts")
logging.basicConfig(level=logging.INFO, format="%(message)s")
from bench_common import add_engine_args, build_engine
import argparse
ap = argparse.ArgumentParser(); add_engine_args(ap); args = ap.parse_args(sys.argv[1:])
t0 = time.perf_counter(); core = build_engine(args)
print(f"engine built in {time.perf_counter() - t0:.1f} s")' --model $m 2>&1 \
        | grep -E "refined in-step|CUDA graphs: captured|engine built|rror" | cut -c1-400 | sed "s/^/$m tuning=$tuning: /"
    done
  done
fi
# The folding sites' margin on and off (AB_FOLD_MARGIN=1), batch 1, 1B and 8B (off: those sites
# take the fused kernel only where it wins by MARGIN, as before; layers/skinny.py says why).
if [ "${AB_FOLD_MARGIN:-0}" = 1 ]; then
  ab_on_off fold_margin "from tokenspeed_worker.layers import skinny; skinny.FOLD_MARGIN = skinny.MARGIN"
fi
# In-step timing of the skinny sites' choices (TUNE_STEP=1): each site's lone-timed choice against
# its other configurations, timed inside the captured decode step (scripts/tune_step.py).
if [ "${TUNE_STEP:-0}" = 1 ]; then
  for spec in ${TUNE_STEP_SPECS:-llama-3.2-1b:1 llama-3.1-8b:1}; do
    m=${spec%%:*}; b=${spec##*:}
    timeout ${TUNE_STEP_TIMEOUT:-200} python3 scripts/tune_step.py --model $m --batch $b ${TUNE_STEP_ARGS:-} \
      --out "$OUT/tune_step_${m}_b$b.json" 2>&1 | grep -v "^20..-\|^STAGE\|Warning\|warn\|^{" | tail -12
  done
fi
# Attention beside the matrix products on two streams (BENCH_OVERLAP=1; scripts/bench_overlap.py).
if [ "${BENCH_OVERLAP:-0}" = 1 ]; then
  timeout 200 python3 scripts/bench_overlap.py --rows ${OVERLAP_ROWS:-128 256} --out "$OUT/overlap.json" 2>&1 \
    | grep -v "^{" | tail -6
fi
# Where a 1B batch-1 step's time goes (PROFILE_SMALL=1), PDL on and off (with PDL on, a kernel's
# time includes its wait for the previous one, so the "off" table gives the kernels' own times),
# and what the device does between one step's graph and the next (--boundary).
if [ "${PROFILE_SMALL:-0}" = 1 ]; then
  # Is the batch-1 step host-bound? The GPU's idle time between steps of one 1B request.
  timeout 100 python3 scripts/bench_offline.py --model llama-3.2-1b --num-requests 1 --input-len 128 --output-len 512 \
    --max-num-seqs 1 --out "$OUT/offline_1b_one_request.json" 2>&1 | grep -E "tokens in|idle|rror" | tail -3
  for p in 1 0; do
    TOKENSPEED_PDL=$p timeout 100 python3 scripts/profile_decode.py --model llama-3.2-1b --batch 1 --prompt-len 128 \
      --positions _skinny_kernel=4 --positions _decode_split_kernel=1 --boundary _argmax_over_chunks,_resolve_pending_kernel \
      --steps 16 --top 8 --out "$OUT/profile_1b_b1_pdl$p.json" 2>&1 | grep -v "^20..-\|^STAGE\|Warning\|warn\|^{" | tail -28
  done
fi
# Where a large decode step's time goes (PROFILE_LARGE=1): 8B, 256 requests of 1024 prompt tokens,
# bf16 and fp8 KV caches.
if [ "${PROFILE_LARGE:-0}" = 1 ]; then
  for kv in auto fp8; do
    timeout 150 python3 scripts/profile_decode.py --model llama-3.1-8b --batch 256 --prompt-len 1024 --steps 8 \
      --top 16 --engine-arg kv_cache_dtype=$kv --engine-arg max_cudagraph_capture_size=256 \
      --out "$OUT/profile_8b_b256_$kv.json" 2>&1 | grep -v "^20..-\|^STAGE\|Warning\|warn" | tail -18
  done
fi
# The fp8 KV cache (BENCH_FP8=1): its kernel and model tests on CUDA, batch-1 latency and the
# 1000/1000 offline run with --kv-cache-dtype fp8 (compare with BENCH_LONG's bf16 figures).
if [ "${BENCH_FP8:-0}" = 1 ]; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv_cache.py 2>&1 | tail -3
  timeout 100 python3 scripts/bench_latency.py --model llama-3.1-8b --prompt-len 128 --new-tokens 128 \
    --engine-arg kv_cache_dtype=fp8 --out "$OUT/latency_8b_fp8.json" 2>&1 | grep -E "decode:|rror" | tail -2
  timeout 240 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 1000 \
    --output-len 1000 --max-num-seqs 512 --engine-arg max_cudagraph_capture_size=512 --engine-arg kv_cache_dtype=fp8 \
    --out "$OUT/offline_8b_1000_s512_fp8.json" 2>&1 | grep -E "tokens in|idle|rror" | tail -3
fi
# Admission with and without room for the outputs (BENCH_ADMISSION=1): 1000/1000 on the 8B shape at
# --max-num-seqs 512 (a pool of ~873k tokens holds 436 requests at full length), for each
# --schedule-conservativeness in ADMISSION_C (default 1 = the default, 0 = admit whenever a prompt
# fits, as before session 8). scripts/sim_admission.py predicts 0 and 118 preemptions.
if [ "${BENCH_ADMISSION:-0}" = 1 ]; then
  for c in ${ADMISSION_C:-1 0}; do
    timeout 240 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 1000 \
      --output-len 1000 --max-num-seqs 512 --engine-arg max_cudagraph_capture_size=512 \
      --engine-arg schedule_conservativeness=$c --out "$OUT/offline_8b_1000_s512_c$c.json" 2>&1 \
      | grep -E "tokens in|idle|rror" | sed "s/^/conservativeness $c: /" | tail -3
  done
fi
# Mixed steps' decode rows on the decode kernel (BENCH_MIXED=1): 1000/1000 on the 8B shape at 512
# sequences with the defaults (the JSON's by_step_kind says where the wall time goes), then
# (MIXED_AB=1) the same with every row of a mixed step through the extend kernel, as before.
if [ "${BENCH_MIXED:-0}" = 1 ]; then
  for split in 1 ${MIXED_AB:+0}; do
    run_patched ${MIXED_TIMEOUT:-330} \
      "from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend as B; B.split_mixed = $split == 1" \
      bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 1000 \
      --output-len 1000 --max-num-seqs 512 --engine-arg max_cudagraph_capture_size=512 \
      --out "$OUT/offline_8b_1000_s512_split$split.json" 2>&1 | grep -E "tokens in|idle|steps, |rror" | grep -v "tok/s$" \
      | sed "s/^/split_mixed=$split: /"
  done
fi
# Long offline runs and serving through gRPC (8B shape): BENCH_LONG=1.
if [ "${BENCH_LONG:-0}" = 1 ]; then
  for seqs in ${LONG_SEQS:-256 512}; do
    timeout 240 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 1000 \
      --output-len 1000 --max-num-seqs $seqs --engine-arg max_cudagraph_capture_size=$seqs \
      --out "$OUT/offline_8b_1000_s$seqs.json" 2>&1 | grep -E "tokens in|idle|Error|error" | tail -4
  done
  # Engine alone at concurrency 64 (waves of 64, as bench_serving sends them), then through gRPC.
  timeout 120 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 128 --input-len 128 \
    --output-len 128 --max-num-seqs 64 --out "$OUT/offline_8b_128_c64.json" 2>&1 \
    | grep -E "tokens in|idle|Error|error" | tail -3
  timeout 300 python3 scripts/bench_serving.py --model scripts/model_configs/llama-3.1-8b \
    --concurrency ${SERVING_C:-1 16 64 256} --prompt-len 128 --output-len 128 --rounds 2 \
    --plot "$OUT/plots" --out "$OUT/serving_8b.json" -- --load-format dummy 2>&1 \
    | grep -E "^C=|plots in|Error|error" | tail -10
fi
# Structured output: per-step cost of grammar masks at batch 64, half constrained (1B shape). The
# grammar needs a tokenizer: carry one as .cache/grammar_tokenizer, e.g.
#   mkdir -p .cache/grammar_tokenizer && cp ~/.cache/tokenspeed_worker/models/SmolLM2-135M-Instruct/tokenizer* \
#     .cache/grammar_tokenizer/   (and carry .whl with xgrammar, apache-tvm-ffi and pydantic wheels)
if [ "${BENCH_GRAMMAR:-0}" = 1 ]; then
  timeout ${GRAMMAR_TIMEOUT:-200} python3 scripts/bench_grammar.py --model llama-3.2-1b --tokenizer .cache/grammar_tokenizer \
    --batch 64 --steps 32 --out "$OUT/grammar_1b.json" 2>&1 | grep -E "^step|^constrained|rror|note" | tail -5
fi
# The flashinfer backend (BENCH_FLASHINFER=1): carry .whl/flashinfer (flashinfer-python 0.5.3 and its
# small pure-Python dependencies; it JIT-compiles its kernels with the machine's nvcc on first use).
# Its GPU tests against the torch backend (bf16 and fp8 caches, CUDA graphs), then batch-1 latency and
# offline 128/128 with --attention-backend flashinfer beside the triton default. FI_MODELS (default
# both shapes; "none" skips), FI_OFFLINE=0, FI_TEST_TIMEOUT, FI_LATENCY_TIMEOUT trim it. Its first
# use JIT-compiles FlashInfer's kernels: about 80 s for the tests on a fresh machine.
if [ "${BENCH_FLASHINFER:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fi \
    .whl/flashinfer/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site_fi:$PYTHONPATH PATH=/tmp/site_fi/bin:$PATH
  timeout ${FI_TEST_TIMEOUT:-400} python3 -m pytest -q -rs --durations=5 -p no:cacheprovider -m gpu \
    tests/test_flashinfer_backend.py 2>&1 | tail -14
  for m in ${FI_MODELS:-llama-3.2-1b llama-3.1-8b}; do
    timeout ${FI_LATENCY_TIMEOUT:-150} python3 scripts/bench_latency.py --model $m --prompt-len 128 --new-tokens 128 \
      --engine-arg attention_backend=flashinfer --out "$OUT/latency_${m}_flashinfer.json" 2>&1 \
      | grep -E "decode:|rror" | sed "s/^/flashinfer /" | tail -3
  done
  [ "${FI_OFFLINE:-1}" = 1 ] && timeout 200 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 128 \
    --output-len 128 --engine-arg attention_backend=flashinfer --out "$OUT/offline_8b_128_flashinfer.json" 2>&1 \
    | grep -E "tokens in|rror" | tail -2
fi
# Host cost of the grammar work alone (BENCH_GRAMMAR_HOST=1; the same tokenizer): the previous
# per-step code against engine/grammar.py's.
if [ "${BENCH_GRAMMAR_HOST:-0}" = 1 ]; then
  timeout 60 python3 scripts/bench_grammar_host.py --tokenizer .cache/grammar_tokenizer --rows 32 --steps 64 \
    --repeat 3 --out "$OUT/grammar_host.json" 2>&1 | grep -E "^old|^new|rror" | tail -4
fi
# Data-parallel replicas and two "nodes" on one host (kind nvidia-h200-x2), and DP=2 serving: DP_CHECK=1.
if [ "${DP_CHECK:-0}" = 1 ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_data_parallel.py \
    tests/test_tensor_parallel.py::test_two_nodes_over_loopback_serve_requests 2>&1 | tail -6
  timeout 90 python3 scripts/bench_serving.py --model scripts/model_configs/llama-3.2-1b --concurrency 64 256 \
    --prompt-len 128 --output-len 128 --rounds 2 --client-procs 8 --out "$OUT/serving_1b_dp2.json" \
    -- --load-format dummy --dp 2 2>&1 | grep -E "^C=|rror" | tail -3
fi
# Past one GPU (kind nvidia-h200-x2): TP=2 equality tests on CUDA, TP=2 vs TP=1 latency and offline
# throughput for the 8B shape, DP=2 vs DP=1 serving throughput.
if [ "${BENCH_TP:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py tests/test_data_parallel.py \
    2>&1 | tail -4
  for tp in 1 2; do
    timeout 150 python3 scripts/bench_latency.py --model llama-3.1-8b --prompt-len 128 --new-tokens 128 \
      --engine-arg tensor_parallel_size=$tp --out "$OUT/latency_8b_tp$tp.json" 2>&1 | grep -E "decode:|rror" | tail -2
    timeout 200 python3 scripts/bench_offline.py --model llama-3.1-8b --num-requests 1000 --input-len 128 \
      --output-len 128 --engine-arg tensor_parallel_size=$tp --out "$OUT/offline_8b_128_tp$tp.json" 2>&1 \
      | grep -E "tokens in|rror" | tail -2
  done
  for dp in 1 2; do
    timeout 200 python3 scripts/bench_serving.py --model scripts/model_configs/llama-3.2-1b --concurrency 64 256 \
      --prompt-len 128 --output-len 128 --rounds 2 --client-procs 8 --out "$OUT/serving_1b_dp$dp.json" \
      -- --load-format dummy --dp $dp 2>&1 | grep -E "^C=|rror" | tail -3
  done
fi
# Serving through gRPC on the 1B shape (BENCH_SERVING=1): batch 1 and 64/256 streams from 8 client
# processes, with a SubscribeKvEvents stream held open as the smg gateway holds one (SERVING_SUBSCRIBE=0:
# none), launch-to-healthy time in the JSON. SERVING_TREE=DIR runs another checkout's worker (an A/B
# against an older commit: `git archive COMMIT | tar -x -C .cache/ab_old`, carry it; its native
# extension is built there first, after which the editable install points at it).
if [ "${BENCH_SERVING:-0}" = 1 ]; then
  tree=${SERVING_TREE:-.}
  tag=${SERVING_TAG:-head}
  if [ "$tree" != . ]; then
    cp scripts/bench_serving.py "$tree/scripts/" && cp tests/worker_harness.py "$tree/tests/"
    (cd "$tree" && python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3)
  fi
  sub=""; [ "${SERVING_SUBSCRIBE:-1}" = 1 ] && sub="--subscribe"
  (cd "$tree" && timeout ${SERVING_TIMEOUT:-300} python3 scripts/bench_serving.py --model "$PWD/scripts/model_configs/llama-3.2-1b" \
    --concurrency ${SERVING_C:-1 64 256} --prompt-len 128 --output-len 128 --rounds ${SERVING_ROUNDS:-2} --client-procs 8 $sub \
    --out "$OUT/serving_1b_$tag.json" -- --load-format dummy 2>&1 | grep -E "^C=|healthy|rror" | sed "s/^/$tag: /" | tail -6)
  grep -hE "CUDA graphs: captured|engine ready|warm-up|serving .* on" "$tree"/.cache/logs/worker-*.log 2>/dev/null | tail -4 | cut -c1-220
fi
if [ "${CHECK_LIFETIME:-0}" = 1 ]; then
  python3 scripts/check_lifetime.py
fi
# Send Triton's compiled kernels back (TRITON_CACHE_OUT=1), in pieces under the 16 MiB a file may be.
if [ "${TRITON_CACHE_OUT:-0}" = 1 ] && [ -d ~/.triton/cache ]; then
  tar -czf - -C ~/.triton cache | split -b 15m -d - "$OUT/triton.tgz."
  ls -la "$OUT"/triton.tgz.*
fi
exit "$rc"
