#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build fmha for that GPU's architecture only,
# run the CUDA tests, then the CUDA benchmarks, and keep every log and result.
#
#   tools/gpu_check.sh [OUT_DIR]        default OUT_DIR: build/gpu_check/<gpu name>/
#
# Needs, preinstalled (no network is used): nvcc, a CUDA build of torch, pybind11,
# scikit-build-core, numpy, pytest, cmake and ninja. PYTHON=/path/to/python picks the
# interpreter (default: python3).
#
# Phases, each with its own time limit, all within GPU_CHECK_BUDGET_S (default 530 s, so the
# whole script stays under 9 minutes): environment, build, tests, tests-sm80 (the GPU cases with
# FMHA_CUDA_KERNEL=sm80: the sm_80 forward where the Hopper one would run), serving (Hugging Face
# generate() / generate_batch() on the CUDA kernels, ~30 s), benchmark (fmha vs torch
# SDPA's flash backend; with --peers sm80,cudnn also fmha's sm_80 forward forced and SDPA's
# cuDNN backend), decode (KV caches vs the measured HBM read bandwidth), predictions (the
# benchmark's and decode's rows against benchmarks/gpu/predictions.json, the speeds predicted
# before any GPU ran the kernels: tools/gpu_predictions.py), bwd-ab (the previous backward
# design, built from git, against this one: tools/bwd_ab.sh), fmha-bench --cuda. A failing
# phase is recorded and the next one runs; the exit status is non-zero when any phase failed.
# The phases do not all fit one budget: GPU_CHECK_PHASES=bwd-ab,fmha-bench (a comma list) runs
# only those, after the build and import (incremental in the same checkout), so that a second
# call picks up what the first one's budget left out; the others are recorded as not run.
# Without a GPU the script still builds (for FMHA_CUDA_ARCHS, default 80) and stops with a
# message at the first phase that needs the GPU.
#
# OUT_DIR gets: environment.txt, build.log, tests.log (+ tests.xml), serving.log (+
# serving.xml), bench.log, bench.json,
# bench.csv, bench.md, predictions.md (+ .log), decode.log, decode.json, bwd-ab.log (+ bwd-ab/),
# fmha-bench-cuda.txt
# and summary.txt (phase, status, seconds). The benchmark and decode phases also --save their
# rows into the GPU's results file, benchmarks/results/<gpu class>.json (sections "cuda" and
# "decode"), the file to commit; OUT_DIR is a scratch folder (build/ is not tracked).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-530}"
T0=$(date +%s)

# ---- which GPU (nvidia-smi first: it needs no torch; torch as the fallback) ----
gpu_name="" arch="" why_no_gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
  if line=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>&1 | head -n1) &&
     [[ "$line" == *,* ]]; then
    gpu_name="${line%,*}"
    cap="${line##*,}"
    arch="${cap//[. ]/}"
  else
    why_no_gpu="nvidia-smi: $line"
  fi
else
  why_no_gpu="nvidia-smi not found"
fi
if [[ -z "$arch" ]]; then
  if line=$("$PY" -c 'import torch
if not torch.cuda.is_available(): raise SystemExit("torch.cuda.is_available() is False")
p = torch.cuda.get_device_properties(0); print(f"{p.name},{p.major}{p.minor}")' 2>&1) &&
     [[ "$line" == *,* ]]; then
    gpu_name="${line%,*}"
    arch="${line##*,}"
  else
    why_no_gpu="$why_no_gpu; torch: ${line##*$'\n'}"
  fi
fi
if [[ -n "$arch" ]]; then
  build_archs="$arch"
else
  build_archs="${FMHA_CUDA_ARCHS:-80}"
fi
slug="$(echo "${gpu_name:-no-gpu}" | tr -cs 'A-Za-z0-9._-' '-' | sed 's/^-*//; s/-*$//')"
OUT="${1:-$ROOT/build/gpu_check/$slug}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/summary.txt"
failed=0

# run_phase NAME LIMIT_S LOG CMD...: runs CMD under a time limit (capped by what is left of
# the budget), output to the terminal and LOG; records the outcome in summary.txt.
run_phase() {
  local name="$1" limit="$2" log="$3"; shift 3
  if [[ -n "${GPU_CHECK_PHASES:-}" && "$name" != build && "$name" != import &&
        ",${GPU_CHECK_PHASES}," != *",$name,"* ]]; then
    printf '%-16s %-28s %4s   %s\n' "$name" "not run" "-" "not in GPU_CHECK_PHASES" |
      tee -a "$OUT/summary.txt"
    return 1
  fi
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    echo "gpu_check: [$name] not run: the ${BUDGET}s budget is spent" | tee -a "$OUT/summary.txt"
    failed=1
    return 1
  fi
  echo "== gpu_check: [$name] (limit ${limit}s): $*"
  local s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]} secs=$(( $(date +%s) - s )) status=ok
  if (( rc == 124 || rc == 137 )); then status="TIMED OUT after ${limit}s"
  elif (( rc != 0 )); then status="FAILED (exit $rc)"; fi
  printf '%-16s %-28s %4ds  %s\n' "$name" "$status" "$secs" "$log" | tee -a "$OUT/summary.txt"
  [[ $status == ok ]] || failed=1
  [[ $status == ok ]]
}

skip_phase() {
  printf '%-16s %-28s %4s   %s\n' "$1" "not run" "-" "$2" | tee -a "$OUT/summary.txt"
  failed=1
}

finish() {
  echo "gpu_check: total $(( $(date +%s) - T0 ))s; results in $OUT" | tee -a "$OUT/summary.txt"
  if (( failed )); then echo "gpu_check: FAILED (see summary.txt)"; exit 1; fi
  echo "gpu_check: all phases passed"
  exit 0
}

# ---- environment (each query time-limited: a wedged driver must not hang the script) ----
environment() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "host: $(hostname)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo 'not a git checkout')"
  git status --short 2>/dev/null | sed 's/^/git status: /'
  echo "gpu: ${gpu_name:-none} (arch ${arch:-none})${why_no_gpu:+; $why_no_gpu}"
  echo "build archs: $build_archs"
  echo "python: $("$PY" --version 2>&1) ($(command -v "$PY"))"
  timeout 60 "$PY" -c 'import torch; print("torch:", torch.__version__, "| torch CUDA:",
torch.version.cuda, "| cuda available:", torch.cuda.is_available())' 2>&1
  echo "nvcc: $( (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -n2 | tr '\n' ' ')"
  echo "cmake: $(cmake --version 2>&1 | head -n1)"
  echo "cpu: $(nproc) cores"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "--- nvidia-smi"
    timeout 20 nvidia-smi 2>&1
    echo "--- nvidia-smi -q -d CLOCK,POWER"
    timeout 20 nvidia-smi -q -d CLOCK,POWER 2>&1 | head -n 60
  else
    echo "nvidia-smi: not found"
  fi
}
echo "== gpu_check: [environment]"
s=$(date +%s)
environment 2>&1 | tee "$OUT/environment.txt"
printf '%-16s %-28s %4ds  %s\n' environment ok "$(( $(date +%s) - s ))" "$OUT/environment.txt" |
  tee -a "$OUT/summary.txt"

# ---- build for this GPU's arch only, without the emulator module ----
built=1
run_phase build 300 "$OUT/build.log" env FMHA_CUDA_ARCHS="$build_archs" FMHA_BUILD_EMULATOR=0 \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps \
  --no-index -v . -Cbuild-dir="build/gpu-check-sm${build_archs//;/-}" || built=0
if (( built )); then
  run_phase import 30 "$OUT/import.log" "$PY" -c 'import fmha
print("fmha", fmha.__version__, "| backends:", fmha.backends(), "| cuda_status:", fmha.cuda_status())' ||
    built=0
fi

# ---- everything below needs the GPU ----
if [[ -z "$arch" ]]; then
  echo "gpu_check: no NVIDIA GPU found (${why_no_gpu#; }). The build phase ran and is logged" \
       "in $OUT; the tests and benchmarks need a GPU: stopping here." | tee -a "$OUT/summary.txt"
  failed=1
  finish
fi
if (( ! built )); then
  skip_phase tests "the build or import failed"
  skip_phase serving "the build or import failed"
  skip_phase bench "the build or import failed"
  skip_phase bwd-ab "the build or import failed"
  skip_phase fmha-bench "the build or import failed"
  finish
fi

# ---- tests: the GPU suite, plus the build/benchmark checks (fmha-bench --cuda on the GPU) ----
tests=()
for t in ${GPU_CHECK_TESTS:-tests/kernels/test_cuda_gpu.py tests/kvcache/test_kvcache_cuda.py tests/kvcache/test_kvquant_cuda.py tests/kernels/test_cuda_emu_cases.py tests/kernels/test_fp8.py tests/api/test_empty.py tests/native/test_build.py}; do
  if [[ -f $t ]]; then tests+=("$t"); else echo "gpu_check: $t not found" | tee -a "$OUT/summary.txt"; failed=1; fi
done
if (( ${#tests[@]} )); then
  run_phase tests 150 "$OUT/tests.log" "$PY" -m pytest -q -rs --junitxml="$OUT/tests.xml" \
    "${tests[@]}"
else
  skip_phase tests "no test file found"
fi
# The same GPU cases with the sm_80 forward forced: on an H100/H200 the tests above run the
# Hopper forward (csrc/cuda/flash_fwd_sm90.cuh) for every call it claims, so this is where the
# sm_80 kernel's forward is checked on the GPU. Elsewhere both runs take the sm_80 kernel.
run_phase tests-sm80 60 "$OUT/tests-sm80.log" env FMHA_CUDA_KERNEL=sm80 "$PY" -m pytest -q -rs \
  --junitxml="$OUT/tests-sm80.xml" tests/kernels/test_cuda_gpu.py

# ---- serving: the cuda cases of tests/integrations/test_serving.py (transformers'
# generate_batch() and generate() on a PagedCache, bfloat16 and 8-bit pools, the kernel
# entries seen with CUDA tensors; ~30 s). A skipped case means the CUDA path was not
# verified, so a skip fails the phase too.
if timeout 60 "$PY" -c 'import transformers' >/dev/null 2>&1; then
  if run_phase serving 60 "$OUT/serving.log" "$PY" -m pytest -q -rs -k cuda \
       --junitxml="$OUT/serving.xml" tests/integrations/test_serving.py &&
     grep -q '<skipped' "$OUT/serving.xml"; then
    echo "gpu_check: [serving] cases were skipped (serving.log says why): the CUDA serving" \
         "path is not verified" | tee -a "$OUT/summary.txt"
    failed=1
  fi
else
  skip_phase serving "transformers is not installed (tests/integrations/test_serving.py needs it)"
fi

# ---- benchmarks: fmha (its own choice of kernel: the Hopper forward on sm_90), fmha's sm_80
# kernel forced, torch SDPA's flash and cuDNN backends side by side (each row's max |diff|
# against SDPA flash first; float8_e4m3fn rows: the Hopper forward's e4m3 path against the
# peers in bfloat16, forward only), then the C++ fmha-bench --cuda ----
rm -f "$OUT/bench.json" "$OUT/decode.json"  # the predictions read this run's rows only
run_phase bench 180 "$OUT/bench.log" "$PY" -m fmha.bench --cuda --peers sm80,cudnn \
  --dtypes float16,bfloat16,float8_e4m3fn --out "$OUT/bench.json" --save
# decode leaves 30 s of the budget to the predictions after it
decode_limit=$(( BUDGET - ($(date +%s) - T0) - 30 ))
(( decode_limit > 90 )) && decode_limit=90
if (( decode_limit >= 10 )); then
  run_phase decode "$decode_limit" "$OUT/decode.log" "$PY" -m fmha.bench --cuda --decode \
    --kv-dtypes int8,float8_e4m3fn,float8_e5m2 --out "$OUT/decode.json" --save
else
  skip_phase decode "under 40 s of the ${BUDGET}s budget left: kept for the predictions"
fi
if [[ -f "$OUT/bench.json" ]]; then
  decode_json=()
  [[ -f "$OUT/decode.json" ]] && decode_json=(--decode "$OUT/decode.json")
  run_phase predictions 20 "$OUT/predictions.log" "$PY" tools/gpu_predictions.py \
    "$OUT/bench.json" ${decode_json[@]+"${decode_json[@]}"} --out "$OUT/predictions.md"
else
  skip_phase predictions "no bench.json"
fi
# ---- the backward, old against new: tools/bwd_ab.sh builds the previous backward design from
# git beside this tree's (the d = 64 and 128 tiles, this GPU's arch) and times both ----
run_phase bwd-ab 150 "$OUT/bwd-ab.log" tools/bwd_ab.sh "$arch" "$OUT/bwd-ab"
scripts="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
if [[ -x "$scripts/fmha-bench" ]]; then
  run_phase fmha-bench 60 "$OUT/fmha-bench-cuda.txt" "$scripts/fmha-bench" --cuda --reps 10
else
  skip_phase fmha-bench "fmha-bench not found in $scripts"
fi
finish
