"""Disaggregated prefill (docs/DISAGGREGATED.md): what pulling a prompt's KV from the prefill instance costs.

    python benchmarks/bench_pd.py [--quick] [--json FILE] [--transfer-only]

1. Transfer: a prefill side (`PeerHolds` + `TransferServer`) in a child process holds chunks of the medium
   model's shape (8 layers x 2 x 256 tokens x 256 = 2 MiB of bf16 each); this process pulls them the way a
   decode instance does (`StorageManager.prefetch(keys, peer=PeerTier(...))`: every frame checked — header,
   key, xxh3 checksum — copied into the L1 arena and promoted), and, alternating with it, reads the same
   number of bytes from the same child over a raw loopback TCP socket into a preallocated buffer (the
   floor: one kernel copy, nothing checked). `transfer_<n>_ratio` = our GB/s / raw GB/s (goal >= 0.8), for
   one 3000-token prompt's 12 chunks and for a bulk of 128 chunks (256 MiB). Medians of the repeats.
2. TTFT: two `lmcache-vllm serve` processes with the medium model (P on core 0, D on core 1, kv_both, no
   Redis). For each of several fresh 3000-token prompts: P prefills it (max_tokens 1, do_remote_decode),
   then D is asked with P's kv_transfer_params and its time to first token measured (the pull, the last
   token's compute, the first decode); alternating with prompts D computes itself (no params).
   `ttft_speedup_ratio` = D recomputing / D pulling (medians). --quick: the tiny model, 1400 tokens.
The machine this runs on may be shared: every ratio compares runs of the same invocation, interleaved.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO_ROOT, gbps, parse_args, print_table, pulls_against_raw, write_json

CHUNK_SHAPE = (8, 2, 256, 256)  # the medium model's stored chunk: 2 MiB of bf16
_CHILD = r"""
import sys, torch
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage.transfer.holds import PeerHolds
from lmcache_vllm.storage.transfer.server import TransferServer
n, holds_count, shape = int(sys.argv[1]), int(sys.argv[2]), tuple(int(x) for x in sys.argv[3].split(","))
arena = HostAllocator(n * 2 * torch.Size(shape).numel() + (1 << 22))
objs = []
for i in range(n):
    obj = arena.allocate(shape, torch.bfloat16)
    obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
    objs.append(obj)
keys = [f"bench@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}" for i in range(n)]
holds = PeerHolds(3600.0)
for h in range(holds_count):
    for obj in objs:
        obj.ref_up()
    holds.expect(f"req-{h}")
    holds.fill(f"req-{h}", keys, objs)  # makes the wire headers, as a prefill instance fills its holds
server = TransferServer(holds, host="127.0.0.1", port=0)
sys.path.insert(0, sys.argv[4])
from _common import serve_raw
raw_port = serve_raw([obj.tensor.view(torch.uint8).numpy() for obj in objs])
print(server.port, raw_port, flush=True)
sys.stdin.read()
"""


def _transfer(num_chunks: int, repeats: int) -> dict:
    import numpy as np
    import torch

    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.storage.manager import StorageManager
    from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier

    nbytes = num_chunks * torch.Size(CHUNK_SHAPE).numel() * 2
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(num_chunks), str(repeats + 1),
                              ",".join(map(str, CHUNK_SHAPE)), os.path.dirname(os.path.abspath(__file__))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    try:
        peer_port, raw_port = map(int, child.stdout.readline().split())
        keys = [f"bench@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}" for i in range(num_chunks)]
        buffer = np.empty(nbytes, dtype=np.uint8)
        buffer.fill(0)  # pages faulted in before timing
        config = LMCacheConfig(max_local_cpu_size=(nbytes * 1.2 + (64 << 20)) / (1 << 30),
                               extra_config={"prefault_local_cpu": "sync"})
        with StorageManager(config) as mgr:
            def pull(rep: int):
                return mgr.prefetch(keys, peer=PeerTier(PeerSource("127.0.0.1", peer_port, f"req-{rep}"), timeout_s=30))

            ours, raw = pulls_against_raw(mgr, keys, pull, raw_port, buffer, repeats)
    finally:
        child.stdin.close()
        child.wait(30)
    ours_gbps, raw_gbps = gbps(nbytes, statistics.median(ours)), gbps(nbytes, statistics.median(raw))
    return {"bytes": nbytes, "ours_gbps": ours_gbps, "raw_gbps": raw_gbps, "ratio": ours_gbps / raw_gbps}


def _ttft(quick: bool, repeats: int) -> dict:
    sys.path.insert(0, str(Path(REPO_ROOT) / "tests" / "e2e"))
    from lmcache_vllm.integration.vllm.testing.local_model import build_model
    from lmcache_vllm.integration.vllm.testing.openai_server import post, serve, stream
    from lmcache_vllm.integration.vllm.testing.vllm_jobs import connector_config, random_tokens, vllm_env

    model = str(build_model("tiny" if quick else "medium"))
    prompt_len = 1400 if quick else 3000
    # PD configured explicitly (docs/DISAGGREGATED.md): fixed transfer ports, each listed in both pd_peers.
    from lmcache_vllm.integration.vllm.testing.openai_server import free_port

    ports = {"p": free_port(), "d": free_port()}

    def args_for(side: str) -> list[str]:
        extra = {"chunk_size": 256, "extra_config": {"pd_host": "127.0.0.1", "pd_port": ports[side],
                                                     "pd_peers": [f"127.0.0.1:{p}" for p in ports.values()]}}
        return ["--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
                "--no-enable-prefix-caching", "--max-num-batched-tokens", "4096",
                "--kv-transfer-config", json.dumps(connector_config(extra))]
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    (tmp / "p").mkdir()
    (tmp / "d").mkdir()
    pulled, recomputed = [], []
    with serve(model, args_for("p"), tmp / "p", vllm_env(tmp / "p", multiprocessing=True, threads_bind="0",
                                                         kv_cache_gib=2)) as (p_base, _), \
            serve(model, args_for("d"), tmp / "d", vllm_env(tmp / "d", multiprocessing=True, threads_bind="1",
                                                            kv_cache_gib=2)) as (d_base, _):

        def body(prompt, **kw):
            return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                    **kw}

        def ttft(prompt, params=None) -> float:
            times: list[float] = []
            t0 = time.monotonic()
            stream(f"{d_base}/v1/completions", body(prompt, **({"kv_transfer_params": params} if params else {})),
                   timeout=600, times=times)
            return times[0] - t0

        for rep in range(repeats + 1):  # the first round warms both servers up
            prompt = random_tokens(9000 + rep, prompt_len)
            params = post(f"{p_base}/v1/completions", body(prompt, kv_transfer_params={"do_remote_decode": True}),
                          timeout=600)["kv_transfer_params"]
            pulled_s = ttft(prompt, params)
            recomputed_s = ttft(random_tokens(9500 + rep, prompt_len))
            if rep:
                pulled.append(pulled_s)
                recomputed.append(recomputed_s)
    p, r = statistics.median(pulled), statistics.median(recomputed)
    return {"model": "tiny" if quick else "medium", "prompt_len": prompt_len, "pulled_s": p, "recomputed_s": r,
            "ratio": r / p}


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], lambda p: p.add_argument(
        "--transfer-only", action="store_true", help="skip the TTFT part (no vLLM servers)"))
    repeats = 3 if args.quick else 7
    results: dict = {}
    rows = []
    for n in ((12,) if args.quick else (12, 128)):
        t = _transfer(n, repeats)
        rows.append((n, t["bytes"] / 2**20, t["ours_gbps"], t["raw_gbps"], t["ratio"]))
        results.update({f"transfer_{n}_ours_gbps": t["ours_gbps"], f"transfer_{n}_raw_gbps": t["raw_gbps"],
                        f"transfer_{n}_ratio": t["ratio"]})
    print_table("pull from a prefill instance vs a raw loopback socket (medians)", rows,
                ("chunks", "MiB", "pull GB/s", "raw socket GB/s", "ratio"))
    if not args.transfer_only:
        t = _ttft(args.quick, 3 if args.quick else 5)
        print_table(f"D's TTFT, {t['prompt_len']}-token prompts, {t['model']} model (medians)",
                    [(t["pulled_s"], t["recomputed_s"], t["ratio"])],
                    ("pulled from P (s)", "recomputed on D (s)", "speedup"))
        results.update({"ttft_pulled_s": t["pulled_s"], "ttft_recomputed_s": t["recomputed_s"],
                        "ttft_speedup_ratio": t["ratio"], "ttft_prompt_len": t["prompt_len"]})
    write_json(args.json, results)


if __name__ == "__main__":
    main()
