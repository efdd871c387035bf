"""Helpers for the end-to-end tests: run vLLM jobs in fresh subprocesses, make prompts, find chunk files,
and compare greedy tokens like with like.

Every vLLM run here uses the same thread binding (`VLLM_CPU_OMP_THREADS_BIND=0`, one compute thread):
with a connector configured vLLM reserves a core and would otherwise run with a different thread count
than the reference, which changes greedy tokens for reasons unrelated to the cache. Every token comparison
goes through `lmcache_vllm.integration.vllm.testing.reference` (re-exported here): the reference of a cached run is
vLLM's
own prefix cache serving the same split.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcache_vllm.integration.vllm.testing.machine_stalls import MachineStalls  # noqa: F401
from lmcache_vllm.integration.vllm.testing.reference import (  # noqa: F401
    assert_like_with_like,
    hit_splits_agree,
    reference_job,
    replay,
)
from lmcache_vllm.integration.vllm.testing.vllm_jobs import (  # noqa: F401
    CONNECTOR,
    REPO_ROOT,
    connector_config,
    random_tokens,
    run_job,
    vllm_env,
)
from lmcache_vllm.integration.vllm.testing.vllm_jobs import phase_results as phase  # noqa: F401

CHUNK = 256  # chunk_size of every connector config in the e2e tests
BLOCK = 128  # vLLM's CPU block size


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
    return connector_config({"chunk_size": CHUNK, **(extra or {})}, role=role)


def floor_chunk(n: int) -> int:
    return n - n % CHUNK


def assert_repeat_hit(run: dict, ref: dict, cold_phase: str, warm_phase: str, prompt_len: int,
                      expected_hit: int, ref_prefix: str = "") -> None:
    """The cold request loaded nothing, its repeat loaded every whole chunk (`expected_hit` tokens), and
    each gave the tokens of the reference request with the same split (`ref` replays the run's phases,
    named `ref_prefix + phase`: its cold first occurrence and its prefix-cache hit)."""
    cold = phase(run, cold_phase)[0]
    warm = phase(run, warm_phase)[0]
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] == floor_chunk(prompt_len) == expected_hit
    assert_like_with_like(cold, phase(ref, ref_prefix + cold_phase)[0], what=cold_phase)
    assert_like_with_like(warm, phase(ref, ref_prefix + warm_phase)[0], what=warm_phase)


def chunk_keys(stored: list[str], tokens: list[int], rank: int = 0) -> list[str]:
    """The key strings among `stored` that hold the whole chunks of `tokens` (plain text) on TP rank `rank`,
    in chunk order. Matched by digest: the model part of a key is a fingerprint the server computes
    (`integration/vllm/fingerprint.py`), which a test need not recompute."""
    from lmcache_vllm.tokens import CacheKey, ChunkHasher

    by_digest = {}
    for s in stored:
        key = CacheKey.from_str(s)
        if key.rank == rank:
            by_digest[key.digest] = s
    digests = ChunkHasher(CHUNK).digests(tokens)
    missing = [i for i, d in enumerate(digests) if d not in by_digest]
    if missing:
        raise AssertionError(f"chunks {missing} of the prompt are not stored on rank {rank}")
    return [by_digest[d] for d in digests]


def chunk_files(disk_dir: Path, tokens: list[int], rank: int = 0) -> list[Path]:
    """The L2 files holding the whole chunks of `tokens` (TP rank `rank`), in chunk order."""
    from lmcache_vllm.storage.chunk_file import SUFFIX, filename_for, key_from_filename

    stored = [k for k in (key_from_filename(p.name) for p in disk_dir.glob(f"*{SUFFIX}")) if k]
    return [disk_dir / filename_for(key) for key in chunk_keys(stored, tokens, rank)]


def flip_payload_bytes(path: Path) -> None:
    """Corrupts a stored chunk the way a bad disk would: payload bytes change, checksum does not."""
    from lmcache_vllm.storage.codec import parse_header

    data = bytearray(path.read_bytes())
    header = parse_header(data)
    middle = header.header_len + header.payload_len // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def payload_bytes(path: Path) -> bytes:
    """A stored chunk's KV bytes (its header, which carries no KV, left out)."""
    from lmcache_vllm.storage.codec import parse_header

    data = path.read_bytes()
    header = parse_header(data)
    return data[header.header_len:header.header_len + header.payload_len]


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


def server_group(log: str | Path) -> int:
    """The process group of a `lmcache-vllm serve` (its own session: the API server, engine core, workers),
    from the API server's pid in its log ("Started server process [N]")."""
    import os
    import re

    match = re.search(r"Started server process \[(\d+)\]", Path(log).read_text())
    if match is None:
        raise AssertionError(f"no server pid in {log}")
    return os.getpgid(int(match.group(1)))


def thread_cpus(pid: int) -> list[tuple[str, set[int]]]:
    """(OS thread name, CPUs it may run on) of every thread of process `pid`."""
    import os

    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out.append((name, set(os.sched_getaffinity(int(tid)))))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def group_processes(group: int, name: str) -> list[int]:
    """Pids of the processes of process group `group` whose name (comm) is `name`."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == group and Path(f"/proc/{entry}/comm").read_text().strip() == name:
                pids.append(int(entry))
        except (OSError, ProcessLookupError):
            continue
    return pids
