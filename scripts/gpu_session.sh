#!/usr/bin/env bash
# What a session with a CUDA GPU runs for issue #11 (this checkout, no vLLM needed; see GPU_FACTS.md for
# installing the test dependencies offline). Results go to ${OUT:-gpu-results}/.
#   bash scripts/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { echo "== $*"; "$@" 2>&1 | tee -a "$OUT/log.txt"; echo "rc=${PIPESTATUS[0]} $*" | tee -a "$OUT/log.txt"; }

nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
lscpu | grep 'Model name' | tee -a "$OUT/gpu.txt"
# Build both extensions in place (arch: 90 = H100/H200; add 80 for A100).
step env LMCACHE_VLLM_CUDA_ARCHS=${LMCACHE_VLLM_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace
step $PY -c "from lmcache_vllm import ops; print(ops.describe())"
# Torch-free kernel self-test (every path against a CPU reference) and the compile checks.
step bash scripts/check_cuda.sh
# C++ exceptions across the extension on this toolchain (the old segfault): must print 'caught True'.
step $PY -c "from lmcache_vllm import ops
try:
    ops.cpu_ext().throw_for_diagnosis()
except RuntimeError as e:
    print('caught', 'diagnostic' in str(e))"
# Tests: layouts and ops on CPU and GPU, streams/events, the pinned arena, engine, memory.
step $PY -m pytest -q -rs tests/test_ops.py tests/test_layouts.py tests/test_kv_views.py tests/test_streams.py \
    tests/test_engine.py tests/test_memory.py tests/test_integration_worker.py
step $PY scripts/check_pinned_arena.py --gib 5
# Benchmarks: kernels vs device/pinned copies; engine through pinned L1 vs raw pinned copies (GB/s, ratios).
step $PY benchmarks/bench_ops.py --json "$OUT/bench_ops.json"
step $PY benchmarks/bench_memory_tier.py --json "$OUT/bench_memory_tier.json"
echo "results in $OUT/"
