#!/usr/bin/env bash
# A real SGLang server on a CUDA GPU with our tiers as its HiCache storage backend (issue #44): a long prompt, its
# pages backed up to our disk tier, SGLang's device and host caches flushed, the same prompt again served from our
# tier. Never run on the CPU-only machines of this project (SGLang's server needs CUDA); run it where a GPU is lent:
#   PY=/path/to/python-with-sglang bash scripts/sglang_gpu_smoke.sh
# PY: an interpreter with SGLang 0.5.23 and its CUDA dependencies (sgl-kernel, flashinfer, ...) installed; this
# repository is put on its PYTHONPATH. MODEL: a local model directory (default: the tiny random-weight Llama
# built here by lmcache_vllm/integration/vllm/testing/local_model.py, no hub). Results in ${OUT:-gpu-results/
# sglang-<UTC date-time>}: server.log, summary.json; the exit status is 0 only when every check passed:
#   1. the server starts with `--hicache-storage-backend dynamic` naming lmcache_vllm.integration.sglang;
#   2. the first request's pages reach our disk tier (lmcache_vllm:sglang_pages_total{op="set",outcome="ok"} in
#      SGLang's /metrics, and chunk files in the directory);
#   3. after POST /flush_cache (device and host copies gone; storage stays) the same request reports cached
#      tokens, and our backend loaded pages (op="get",outcome="ok" grows).
# Whether the greedy output of the second request equals the first's is reported, not required: the first
# prefill ran whole, the second from the cache (another prefill split; see docs/SGLANG.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PORT=${PORT:-30123}
OUT=${OUT:-gpu-results/sglang-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL=${MODEL:-$("$PY" -m lmcache_vllm.integration.vllm.testing.local_model --out "$OUT/model" --size tiny | tail -1)}
L3="$OUT/l3"
EXTRA=$(printf '{"backend_name":"lmcache","module_path":"lmcache_vllm.integration.sglang","class_name":"LMCacheHiCacheStorage","interface_v1":1,"local_cpu":false,"local_disk":"%s","max_local_disk_size":20}' "$L3")

"$PY" -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --page-size 64 --mem-fraction-static 0.5 \
  --enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through \
  --hicache-storage-prefetch-policy wait_complete --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "$EXTRA" --enable-metrics >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT

"$PY" - "$PORT" "$L3" "$OUT/summary.json" <<'EOF'
import json, os, re, sys, time, urllib.request

port, l3, summary_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
summary = {"checks": {}}


def call(path, body=None, timeout=300):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def pages(op):
    text = call("/metrics")
    return sum(float(v) for v in re.findall(
        r'^lmcache_vllm:sglang_pages_total\{[^}]*op="%s"[^}]*outcome="ok"[^}]*\} (\S+)$' % op, text, re.M))


deadline = time.monotonic() + 900
while True:
    try:
        call("/health", timeout=5)
        break
    except Exception:
        if time.monotonic() > deadline:
            sys.exit("server did not answer /health within 900 s (see server.log)")
        time.sleep(2)
summary["checks"]["server_started"] = True
prompt = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
request = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
first = json.loads(call("/generate", request))
deadline = time.monotonic() + 120
while pages("set") < 1 and time.monotonic() < deadline:
    time.sleep(1)
files = [f for f in os.listdir(l3) if f.endswith(".lmc")] if os.path.isdir(l3) else []
summary["stored_pages"], summary["chunk_files"] = pages("set"), len(files)
summary["checks"]["backed_up_to_l3"] = summary["stored_pages"] > 0 and len(files) > 0
loaded_before = pages("get")
call("/flush_cache", {})
time.sleep(2)
second = json.loads(call("/generate", request))
time.sleep(2)
summary["prompt_tokens"] = first["meta_info"].get("prompt_tokens")
summary["cached_tokens_first"] = first["meta_info"].get("cached_tokens")
summary["cached_tokens_second"] = second["meta_info"].get("cached_tokens")
summary["cached_tokens_details_second"] = second["meta_info"].get("cached_tokens_details")
summary["loaded_pages"] = pages("get") - loaded_before
summary["checks"]["served_from_l3"] = (summary["cached_tokens_second"] or 0) > 0 and summary["loaded_pages"] > 0
summary["same_output"] = first["text"] == second["text"]
with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary, indent=2))
sys.exit(0 if all(summary["checks"].values()) else 1)
EOF
rc=$?
echo "sglang smoke: rc=$rc (results in $OUT)"
exit $rc
