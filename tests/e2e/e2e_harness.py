"""Helpers for the end-to-end tests: run vLLM jobs in fresh subprocesses, make prompts, find chunk files.

Every vLLM run here uses the same thread binding (`VLLM_CPU_OMP_THREADS_BIND=0`, one compute thread):
with a connector configured vLLM reserves a core and would otherwise run with a different thread count
than the reference, which changes greedy tokens for reasons unrelated to the cache.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256  # chunk_size of every connector config in the e2e tests
BLOCK = 128  # vLLM's CPU block size

CONNECTOR = {
    "kv_connector": "LMCacheConnector",
    "kv_connector_module_path": "lmcache_vllm.integration.vllm",
    "kv_role": "kv_both",
}


def vllm_env(tmp: Path, *, hash_seed: int = 0, multiprocessing: bool = False) -> dict[str, str]:
    """Environment for a vLLM process whose caches, sockets and temp files stay inside `tmp`."""
    env = dict(os.environ)
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH", "TMPDIR"):
        path = tmp / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "PYTHONHASHSEED": str(hash_seed),
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.pop("LMCACHE_CONFIG_FILE", None)
    for name in list(env):
        if name.startswith("LMCACHE_") and name != "LMCACHE_VLLM_MODEL_CACHE":
            env.pop(name)  # the job's own config decides, not the developer's shell
    return env


def llm_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True, "seed": 0,
              "enable_prefix_caching": False, "gpu_memory_utilization": 0.9,
              # Large enough that no prompt (and no concurrent batch) is split into prefill chunks:
              # vLLM's CPU attention gives slightly different numbers for a split prefill, so runs
              # compared token for token must split alike.
              "max_num_batched_tokens": 8192}
    kwargs.update(overrides)
    return kwargs


def connector(extra: dict[str, Any] | None = None, role: str = "kv_both") -> dict[str, Any]:
    return dict(CONNECTOR, kv_role=role, kv_connector_extra_config={"chunk_size": CHUNK, **(extra or {})})


def run_job(tmp: Path, name: str, job: dict[str, Any], *, hash_seed: int = 0,
            timeout: int = 600) -> dict[str, Any]:
    """Runs `job` (see lmcache_vllm.integration.vllm.offline_job) in a new process; returns its output."""
    tmp.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = tmp / f"{name}.job.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    job_path.write_text(json.dumps(job))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "lmcache_vllm.integration.vllm.offline_job", str(job_path), str(out_path)],
            cwd=REPO_ROOT, env=vllm_env(tmp / f"{name}.env", hash_seed=hash_seed), stdout=log,
            stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"vLLM job {name} failed (exit {proc.returncode}); log tail:\n{tail}")
    result = json.loads(out_path.read_text())
    result["log"] = str(log_path)
    return result


def phase(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    for p in result["phases"]:
        if p["name"] == name:
            return p["results"]
    raise KeyError(name)


def random_tokens(seed: int, n: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]  # 0..3 are special tokens


def floor_chunk(n: int) -> int:
    return n - n % CHUNK


def chunk_files(disk_dir: Path, model: str, tokens: list[int]) -> list[Path]:
    """The L2 files holding the whole chunks of `tokens` (rank 0 of 1, bf16), in chunk order."""
    from lmcache_vllm.storage.codec import FORMAT_VERSION
    from lmcache_vllm.storage.local_disk import filename_for
    from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

    keys = KeyBuilder(model=model, world_size=1, rank=0, kv_dtype="bfloat16", fmt_version=FORMAT_VERSION,
                      hasher=ChunkHasher(CHUNK)).keys(tokens)
    return [disk_dir / filename_for(key.to_str()) for key, _, _ in keys]


def flip_payload_bytes(path: Path) -> None:
    """Corrupts a stored chunk the way a bad disk would: payload bytes change, checksum does not."""
    from lmcache_vllm.storage.codec import parse_header

    data = bytearray(path.read_bytes())
    header = parse_header(data)
    middle = header.header_len + header.payload_len // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def replace_payload(path: Path, seed: int = 1) -> None:
    """Rewrites a stored chunk with other, well-formed KV numbers under a valid checksum."""
    import torch

    from lmcache_vllm.storage.codec import encode_header, parse_header

    data = path.read_bytes()
    header = parse_header(data)
    gen = torch.Generator().manual_seed(seed)
    fake = (torch.randn(header.shape, generator=gen) * 2.0).to(header.dtype)
    new_header = encode_header(header.key, fake, align=header.header_len)
    if len(new_header) != header.header_len:
        raise AssertionError("re-encoded header has a different length")
    payload = fake.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(new_header + payload)
