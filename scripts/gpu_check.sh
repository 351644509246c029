#!/usr/bin/env bash
# One GPU session's checks, prepared on CPU: install this copy of the project without network, run the
# GPU tests, then the bench (scripts/README.md, bench_gpu.py). Run from the repository root on the device
# machine; every log and the bench's JSON go to $OUT (default /tmp/gpu-out).
#
#   bash scripts/gpu_check.sh [WHEELS_DIR]      # WHEELS_DIR: wheels the machine lacks (e.g. transformers)
#
# The wheels, made where there is a package index and carried along (a git-ignored folder, e.g. dist/):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d dist/wheels transformers==5.24.0
#
# STEPS (default "tests bench attn") picks the steps after the install, which always runs (~20 s):
#   tests  the GPU tests (TESTS_S, 180 s)
#   bench  bf16 and int8 weights at batch 1 and 64, decode products on XLA's dots and on the Pallas kernel
#          (eight rows, each a load and a compile of ~30 s on an H200; BENCH_S, 400 s; BENCH_ARGS replaces
#          the arguments)
#   attn   bf16 at batch 1 and 64 with both Pallas kernels, the products' and the attention's (ATTN_S, 150 s;
#          ATTN_ARGS replaces the arguments)
#   fp8    fp8 weights and products (quant="fp8") at batch 1 and 64, on cuBLASLt's fp8 GEMMs and with decode
#          rows on the Pallas kernel (four rows; FP8_S, 200 s; FP8_ARGS replaces the arguments)
#   serve  aotlm serve on the bench's 1B checkpoint at 1 / 16 / 64 clients (SERVE_S, 300 s)
#   profile  a trace of batch-1 bf16 decode on XLA's ops and on both Pallas kernels, the device ops by time
#          in the log (PROFILE_S, 150 s; PROFILE_ARGS; the trace itself stays in /tmp/gpu-prof)
# A device command may run 10 minutes, the session's device time is 15 with the machine's start: run
# STEPS="tests bench" first, then at once (the machine stays warm ~30 s) STEPS="attn" (and "fp8", "serve"
# or "profile" if time is left). Each step runs even if the one before failed; the exit status is the first failure's.
set -u
OUT=${OUT:-/tmp/gpu-out}
WHEELS=${1:-}
mkdir -p "$OUT"
rc=0
step() {  # name, command...: run one step, keep its log, remember the first failure
  local name=$1
  shift
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local s=$?
  echo "   exit $s; last lines:"
  tail -n 15 "$OUT/$name.log"
  if [ "$rc" -eq 0 ] && [ "$s" -ne 0 ]; then rc=$s; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
wheels=()
if [ -n "$WHEELS" ]; then wheels=("$WHEELS"/*.whl); fi
step install pip install --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site "${wheels[@]}" .
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test workers share the GPU
step devices python -c "import jax, aotlm; print(jax.devices(), jax.__version__)"
want() { [[ " ${STEPS:-tests bench attn} " == *" $1 "* ]]; }
# the kernels (compiled here, not interpreted), exact f32 (HIGHEST precision), every family's conformance
# to transformers, sampling, the decode loop's step groups
if want tests; then
  step tests timeout "${TESTS_S:-180}" python -m pytest -q --maxfail=10 -n 4 -p no:cacheprovider \
    tests/kernels/test_gpu_matmul.py tests/kernels/test_gpu_attention.py tests/core/test_precision_matmul.py \
    tests/core/test_backend.py tests/families/test_conformance_llama_style.py \
    tests/families/test_conformance_gpt_style.py tests/core/test_sampling.py tests/models/test_quant_fp8.py
fi
# bf16 and int8 weights, their decode products on XLA's dots and on the Pallas kernel, one run
read -r -a bench_args <<<"${BENCH_ARGS:---batch 1 64 --modes bf16 int8 --variants default g8-pallas --peers --long-prompt 0 --runs 3}"
if want bench; then
  step bench timeout "${BENCH_S:-400}" python scripts/bench_gpu.py "${bench_args[@]}" --json "$OUT/bench.json"
fi
# both Pallas kernels (the decode products' and the attention's), against the rows above
if want attn; then
  read -r -a attn_args <<<"${ATTN_ARGS:---batch 1 64 --modes bf16 --variants g8-pallas-all --peers --long-prompt 0 --runs 3}"
  step attn timeout "${ATTN_S:-150}" python scripts/bench_gpu.py "${attn_args[@]}" --json "$OUT/attn.json"
fi
# fp8 weights and products against the bf16 and int8 rows above
if want fp8; then
  read -r -a fp8_args <<<"${FP8_ARGS:---batch 1 64 --modes fp8 --variants default g8-pallas --peers --long-prompt 0 --runs 3}"
  step fp8 timeout "${FP8_S:-200}" python scripts/bench_gpu.py "${fp8_args[@]}" --json "$OUT/fp8.json"
fi
# serving on the GPU: aotlm serve on the bench's 1B checkpoint at 1 / 16 / 64 clients
if want serve; then
  step serve timeout "${SERVE_S:-300}" python scripts/bench_serve.py --checkpoint /tmp/aotlm-bench-gpu/llama-1b \
    --engines aotlm-bf16 aotlm-bf16-int8 --clients 1 16 64 --batch-size 64 --requests-per-client 1 \
    --work /tmp/aotlm-bench-serve --json "$OUT/serve.json"
fi
# where a batch-1 step's time goes (bench_gpu.py --profile: gpu_trace.py's summary in the log)
if want profile; then
  read -r -a prof_args <<<"${PROFILE_ARGS:---batch 1 --modes bf16 --variants default g8-pallas-all --peers --long-prompt 0 --runs 1 --new 32}"
  step profile timeout "${PROFILE_S:-150}" python scripts/bench_gpu.py "${prof_args[@]}" --profile /tmp/gpu-prof
fi
exit "$rc"
