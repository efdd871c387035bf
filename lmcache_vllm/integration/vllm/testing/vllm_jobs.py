"""Runs scripted vLLM jobs (see `lmcache_vllm.integration.vllm.offline_job`) in fresh subprocesses.

Used by the e2e tests, the demo and the end-to-end benchmark. Every run gets the same CPU thread binding
(`VLLM_CPU_OMP_THREADS_BIND=0`, one compute thread): with a connector configured vLLM reserves a core and
would otherwise compute with a different thread count than a run without one, which changes greedy tokens
for reasons unrelated to the cache. vLLM's caches, sockets and temp files stay inside the job's directory.

vLLM 0.32 applies that binding only in the worker processes of its multiprocess engine (as OpenMP variables
set before it starts them: `vllm.utils.ompmultiprocessing`). An engine in the job's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what offline jobs use) ignored it and computed on an OpenMP team over
every CPU of the host, our background threads' CPU included: on 2 cores a save then slowed the model's
parallel regions by more than the save's own CPU time. So `vllm_env` gives an in-process engine the same
OpenMP variables the multiprocess engine gives its worker (`_omp_binding`): both compute alike.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lmcache_vllm.cpu_affinity import openmp_binding, parse_cpu_list

REPO_ROOT = Path(__file__).resolve().parents[4]
_MAX_RPC_DIR_LEN = 60  # + "/" + a 36-character uuid stays well inside a Unix socket path

CONNECTOR = {
    "kv_connector": "LMCacheConnector",
    "kv_connector_module_path": "lmcache_vllm.integration.vllm",
    "kv_role": "kv_both",
}


def connector_config(extra: dict[str, Any] | None = None, role: str = "kv_both") -> dict[str, Any]:
    """A `kv_transfer_config` dict for our connector with `extra` as `kv_connector_extra_config`."""
    return dict(CONNECTOR, kv_role=role, kv_connector_extra_config=dict(extra or {}))


def random_tokens(seed: int, n: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]  # 0..3 are special tokens


def vllm_env(tmp: Path, *, hash_seed: int = 0, multiprocessing: bool = False,
             kv_cache_gib: int = 1, threads_bind: str = "0") -> dict[str, str]:
    """Environment for a vLLM process whose caches, sockets and temp files stay inside `tmp`."""
    env = dict(os.environ)
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH", "TMPDIR"):
        path = tmp / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    if len(env["VLLM_RPC_BASE_PATH"]) > _MAX_RPC_DIR_LEN:
        # vLLM puts ZMQ ipc sockets (dir + "/" + uuid4) there; a Unix socket path holds 107 bytes.
        env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="lmv-rpc-")
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "PYTHONHASHSEED": str(hash_seed),
        "TOKENIZERS_PARALLELISM": "false",
    })
    if not multiprocessing:
        env.update(_omp_binding(threads_bind))
    env.pop("LMCACHE_CONFIG_FILE", None)
    for name in list(env):
        if name.startswith("LMCACHE_") and name != "LMCACHE_VLLM_MODEL_CACHE":
            env.pop(name)  # the job's own config decides, not the caller's shell
    return env


def _omp_binding(threads_bind: str) -> dict[str, str]:
    """The OpenMP variables vLLM's multiprocess engine sets for a worker bound to `threads_bind` (one rank's
    CPU list, e.g. "0" or "0-3"; `auto`, `nobind` or several ranks: none)."""
    if threads_bind in ("auto", "nobind") or "|" in threads_bind:
        return {}
    return openmp_binding(parse_cpu_list(threads_bind))


def run_job(tmp: Path, name: str, job: dict[str, Any], *, hash_seed: int = 0, timeout: int = 1800,
            kv_cache_gib: int = 1, multiprocessing: bool = False, threads_bind: str = "0") -> dict[str, Any]:
    """Runs `job` in a new process and returns its output (with "log": the path of its log).

    Tensor parallelism needs `multiprocessing=True` and one bound core per rank (`threads_bind="0|1"`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = tmp / f"{name}.job.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    job_path.write_text(json.dumps(job))
    env = vllm_env(tmp / f"{name}.env", hash_seed=hash_seed, kv_cache_gib=kv_cache_gib,
                   multiprocessing=multiprocessing, threads_bind=threads_bind)
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "lmcache_vllm.integration.vllm.offline_job", str(job_path), str(out_path)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-6000:]
        raise RuntimeError(f"vLLM job {name} failed (exit {proc.returncode}); log tail:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = str(log_path)
    return result


def phase_results(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The per-prompt results of the phase called `name`."""
    for p in result["phases"]:
        if p["name"] == name:
            results: list[dict[str, Any]] = p["results"]
            return results
    raise KeyError(name)
