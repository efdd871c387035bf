#!/usr/bin/env bash
# Everything a session with a CUDA GPU runs, first thing (issue #19), in one command; no vLLM needed:
#   bash scripts/gpu_session.sh
# Results go to one folder, ${OUT:-gpu-results/<UTC date-time>}: log.txt (every step's output), summary.txt
# (each step's exit status and its last line), gpu.txt (device, driver, CPU, torch), and the JSON files of
# the kernel comparison, the self-check and the benchmarks.
#
# Host recipe (../shared/GPU_FACTS.md: Python 3.12, torch 2.11+cu130, no network, test dependencies carried
# as wheel files): WHEELS=/path/to/wheels installs every *.whl there with pip --no-index into $OUT/site
# first (redis, hiredis, pyzmq, blake3, pytest-asyncio, hypothesis, ...). PY picks the interpreter
# (default python3), LMCACHE_VLLM_CUDA_ARCHS the archs (default 90: H100/H200; add 80 for A100).
#
# Steps: build both extensions in place; C++ exceptions across the extension; the torch-free kernel
# self-test and the host run (scripts/check_cuda.sh); the real kernel against the torch path on every case
# of the host check (scripts/check_cuda_kernels.py --device cuda); the device self-check on every layout
# (--self-check --device cuda); every CUDA test; the pinned arena check; the benchmarks (kernel vs
# device-to-device and pinned copies, engine through pinned L1 vs raw pinned copies, staged torch path vs
# kernel). A failing step is recorded and the next one runs. STEPS="check_cuda tests" runs only those steps;
# STEP_TIMEOUT=SECONDS stops any step but the build after that long (rc 124), so a short lease reaches the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu-results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install --no-index --no-deps --target "$OUT/site" "$WHEELS"/*.whl >"$OUT/pip.txt" 2>&1 \
    || echo "pip install of $WHEELS failed (see $OUT/pip.txt)"
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PY
# The last GPU host had its compiler in /opt/gcc, and nvcc only in /usr/local/cuda/bin.
command -v g++ >/dev/null 2>&1 || { [ -x /opt/gcc/bin/g++ ] && export PATH="/opt/gcc/bin:$PATH"; }
command -v nvcc >/dev/null 2>&1 || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"; }

step() {  # step NAME COMMAND...: output to log.txt and the screen, status and last line to summary.txt
  local name=$1; shift
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  local limit=${STEP_TIMEOUT:-0}
  [ "$name" = build ] && limit=0
  timeout "$limit" "$@" > >(tee "$OUT/$name.txt" | tee -a "$OUT/log.txt") 2>&1
  local rc=$?
  sleep 0.2  # let tee finish writing
  printf '%-22s rc=%-3s %s\n' "$name" "$rc" "$(grep -v '^\s*$' "$OUT/$name.txt" | tail -1)" | tee -a "$OUT/summary.txt"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  lscpu | grep 'Model name'
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  git log -1 --format='commit %h %cs %s' 2>/dev/null
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

step build env LMCACHE_VLLM_CUDA_ARCHS="${LMCACHE_VLLM_CUDA_ARCHS:-90}" MAX_JOBS="${MAX_JOBS:-16}" \
  "$PY" setup.py build_ext --inplace
step ops "$PY" -c "from lmcache_vllm import ops; print(ops.describe())"
# C++ exceptions across the extension on this toolchain (the old segfault): must print 'caught True'.
step exceptions "$PY" -c "from lmcache_vllm import ops
try:
    ops.cpu_ext().throw_for_diagnosis()
except RuntimeError as e:
    print('caught', 'diagnostic' in str(e))"
# nvcc compile, the torch-free self-test on this GPU, the binding's syntax, the kernel source on the host.
step check_cuda bash scripts/check_cuda.sh
step kernel_cases "$PY" scripts/check_cuda_kernels.py --device cuda --json "$OUT/kernel_cases.json"
step self_check "$PY" scripts/check_cuda_kernels.py --device cuda --self-check --json "$OUT/self_check.json"
# Every test that runs CUDA code (the rest of these skip their GPU parts nowhere: they also run on CPU).
step tests "$PY" -m pytest -q -rs --continue-on-collection-errors -p no:cacheprovider \
  tests/test_ops.py tests/test_layouts.py tests/test_kv_views.py tests/test_streams.py tests/test_cuda_host.py \
  tests/test_engine.py tests/test_memory.py
step pinned_arena "$PY" scripts/check_pinned_arena.py --gib 5
step bench_ops "$PY" benchmarks/bench_ops.py --json "$OUT/bench_ops.json"
step bench_memory_tier "$PY" benchmarks/bench_memory_tier.py --json "$OUT/bench_memory_tier.json"
step bench_cuda_paths "$PY" benchmarks/bench_cuda_paths.py --json "$OUT/bench_cuda_paths.json"
echo "results in $OUT/ (summary.txt first)"
