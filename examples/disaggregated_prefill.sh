#!/usr/bin/env bash
# Disaggregated prefill/decode with vLLM's protocol (docs/DISAGGREGATED.md): a prefill instance, a decode
# instance and examples/pd_proxy.py in front of them, all on this host; then one prompt through the proxy.
#   bash examples/disaggregated_prefill.sh [MODEL_DIR]
# Both instances run our connector as kv_both (no Redis needed); D pulls each prompt's KV from P's transfer
# server. PD is configured explicitly, as docs/DISAGGREGATED.md shows first: extra_config.pd "on" and one chunk
# MAC key in every instance's environment (P signs its params, D pulls only what they sign). On a 2-core
# machine P computes on core 0 and D on core 1. Any proxy that drives vLLM's NIXL connector (vLLM's toy proxy,
# vllm-router, llm-d) can take pd_proxy.py's place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${1:-$($PY -m lmcache_vllm.integration.vllm.testing.local_model --size tiny)}
P_PORT=${P_PORT:-8100}; D_PORT=${D_PORT:-8200}; PROXY_PORT=${PROXY_PORT:-8000}
CONNECTOR='{"kv_connector":"LMCacheConnector","kv_connector_module_path":"lmcache_vllm.integration.vllm",'
CONNECTOR+='"kv_role":"kv_both","kv_connector_extra_config":{"extra_config":{"pd":"on","pd_host":"127.0.0.1"}}}'
# The fleet's key: the same on every instance (and the proxy), in the environment (vLLM logs extra_config).
export LMCACHE_VLLM_CHUNK_MAC_KEY=${LMCACHE_VLLM_CHUNK_MAC_KEY:-$($PY -m lmcache_vllm.cli keygen)}
ARGS=(--host 127.0.0.1 --dtype bfloat16 --max-model-len 4096 --enforce-eager --kv-transfer-config "$CONNECTOR")

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
VLLM_CPU_OMP_THREADS_BIND=0 $PY -m lmcache_vllm.cli serve "$MODEL" --port "$P_PORT" "${ARGS[@]}" > /tmp/pd-prefill.log 2>&1 &
PIDS+=($!)
VLLM_CPU_OMP_THREADS_BIND=1 $PY -m lmcache_vllm.cli serve "$MODEL" --port "$D_PORT" "${ARGS[@]}" > /tmp/pd-decode.log 2>&1 &
PIDS+=($!)
$PY examples/pd_proxy.py --port "$PROXY_PORT" --prefiller-ports "$P_PORT" --decoder-ports "$D_PORT" &
PIDS+=($!)
for port in "$P_PORT" "$D_PORT"; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a process exited (logs: /tmp/pd-*.log)"; exit 1; }; done
    sleep 1
  done
done
PROMPT=$($PY -c "import random; r=random.Random(0); print([r.randrange(4, 4000) for _ in range(1500)])")
curl -s "http://127.0.0.1:$PROXY_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0}" \
  | $PY -c "import json,sys; r=json.load(sys.stdin); print('decode instance answered:', repr(r['choices'][0]['text']))"
curl -s "http://127.0.0.1:$D_PORT/metrics" | grep -E '^lmcache_vllm:(pd_pulled_chunks|pd_pulled_bytes)_total' || true
