"""Runs a scripted sequence of `LLM.generate` calls in this process and writes the results as JSON.

Tests and benchmarks start it in a fresh subprocess (`python -m lmcache_vllm.integration.vllm.offline_job
JOB.json OUT.json`) so that each vLLM engine, and so each cache instance, lives and dies with its
process. The job file:

    {"model": DIR, "llm_kwargs": {...}, "kv_transfer_config": {...} | null,
     "phases": [{"name": "warm", "prompts": [[token ids], ...], "max_tokens": 8}, ...]}

A prompt may also be {"embeds_seed": S, "len": N}: N prompt embeddings drawn from a generator seeded with S
(bf16, the model's hidden size; needs "enable_prompt_embeds": true in llm_kwargs).

A phase with "wait_for_file": PATH first creates PATH + ".ready" and waits (at most 300 s) until PATH
exists: a test does something to the world at that point of the run (e.g. kills a Redis node), then
creates PATH.

A phase with "flush_writes": true first waits (at most 60 s) until the connector's queued writes to its
lower tiers are done: a phase after it reads from disk or Redis what the phases before it stored.

A phase with "logprobs": K also returns, per prompt and generated token, the log-probabilities of the K most
likely tokens (-1: the whole vocabulary; needs "max_logprobs": -1 in llm_kwargs) as {token id: logprob}.

Prompts of one phase go to vLLM in one `generate` call (they run as one concurrent batch); phases run
one after another. The output holds per prompt the greedy output token ids and `num_cached_tokens`, per
phase its wall time and process CPU time, under `kv_cache` whether vLLM kept its hybrid KV cache manager
on and (in-process engines) the kinds of its KV cache groups, under `threads` the CPU seconds of its threads
by OS thread name and allowed CPUs, and under `stats` this process's metrics (`metrics.flat`:
`{"loaded_tokens": ..., "chunk_hits.redis": ..., "load_seconds.sum": ...}`; the scheduler and a single
worker share this process, the workers of a TP>1 engine do not).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _connector_stats() -> dict[str, Any]:
    """This process's metrics, after the background saves handed out so far have finished."""
    from lmcache_vllm.observability import metrics

    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = getattr(get_kv_transfer_group(), "_worker", None)
            if worker is not None:
                worker.drain_saves()
    except Exception as exc:  # stats are best effort: the job's results matter more
        return {"error": repr(exc), **metrics.flat(metrics.snapshot())}
    return metrics.flat(metrics.snapshot())


def thread_cpu() -> dict[str, dict[str, Any]]:
    """CPU seconds of this process's threads so far, by OS thread name and allowed CPUs ("name@0,1"; Linux,
    else {}): which threads took the time, and whether ours stayed off the model's compute cores."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, dict[str, Any]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            cpus = sorted(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        utime, stime = (int(v) for v in stat[stat.rindex(")") + 2:].split()[11:13])
        entry = out.setdefault(f"{name}@{','.join(map(str, cpus))}", {"threads": 0, "cpu_s": 0.0})
        entry["threads"] += 1
        entry["cpu_s"] = round(entry["cpu_s"] + (utime + stime) / ticks, 2)
    return out


def connector_thread_cpu(threads: dict[str, dict[str, Any]]) -> float:
    """CPU seconds of the connector's own threads (named `lmcache-*`: `cpu_affinity`) in a `thread_cpu()` answer."""
    return float(sum(t["cpu_s"] for name, t in threads.items() if name.startswith("lmcache")))


def _first_token_latency(output) -> float | None:
    """vLLM's own time-to-first-token of a request (needs `disable_log_stats=False`), else None."""
    latency = getattr(getattr(output, "metrics", None), "first_token_latency", None)
    return float(latency) if latency else None


def flush_writes(timeout_s: float = 60.0) -> None:
    """Waits until the connector's background saves and its queued lower-tier writes are done."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "_worker", None)
    if worker is None or worker.engine is None:
        raise RuntimeError("flush_writes: no connector worker in this process (an in-process engine is needed)")
    worker.drain_saves()
    if not worker.engine.storage.flush(timeout_s):  # (a grouped engine's groups share one storage)
        raise RuntimeError(f"flush_writes: writes still queued after {timeout_s:.0f}s")


def _logprobs(output) -> list[dict[str, float]]:
    """Per generated token, {token id: logprob} of the tokens vLLM returned."""
    return [{str(token): float(lp.logprob) for token, lp in position.items()}
            for position in output.outputs[0].logprobs or []]


def _prompt(prompt, llm):
    """vLLM's prompt for a token-id list or an {"embeds_seed", "len"} description (see the docstring)."""
    from vllm.inputs import TokensPrompt

    if not isinstance(prompt, dict):
        return TokensPrompt(prompt_token_ids=list(prompt))
    import torch

    hidden = llm.llm_engine.model_config.get_hidden_size()
    gen = torch.Generator().manual_seed(int(prompt["embeds_seed"]))
    return {"prompt_embeds": (torch.randn(int(prompt["len"]), hidden, generator=gen) * 0.05).to(torch.bfloat16)}


def _wait_for_file(path: str, timeout_s: float = 300.0) -> None:
    with open(path + ".ready", "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nobody created {path} within {timeout_s:.0f}s")
        time.sleep(0.05)


def _kv_cache(llm) -> dict[str, Any]:
    """Whether vLLM runs its hybrid KV cache manager, and its KV cache groups when the engine core lives in
    this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    out: dict[str, Any] = {"hybrid_manager": not llm.llm_engine.vllm_config.scheduler_config.
                           disable_hybrid_kv_cache_manager}
    try:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        out["groups"] = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
        out["num_blocks"] = config.num_blocks
    except AttributeError:  # the engine core runs in another process
        pass
    return out


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(job.get("llm_kwargs", {}))
    if job.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv_transfer_config"])
    llm = LLM(model=job["model"], **kwargs)
    startup_s = time.perf_counter() - started
    phases = []
    for phase in job["phases"]:
        if phase.get("wait_for_file"):
            _wait_for_file(phase["wait_for_file"])
        if phase.get("flush_writes"):
            flush_writes()
        logprobs = phase.get("logprobs")
        params = SamplingParams(temperature=0.0, max_tokens=int(phase.get("max_tokens", 8)),
                                ignore_eos=True, logprobs=None if logprobs is None else int(logprobs))
        prompts = [_prompt(p, llm) for p in phase["prompts"]]
        t0, cpu0 = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        phases.append({
            "name": phase.get("name", ""),
            "wall_s": wall_s,
            "cpu_s": time.process_time() - cpu0,  # all threads of this process
            "results": [{"tokens": list(o.outputs[0].token_ids),
                         "num_cached_tokens": int(o.num_cached_tokens or 0),
                         "ttft_s": _first_token_latency(o),
                         **({"logprobs": _logprobs(o)} if logprobs is not None else {})} for o in outputs],
        })
    result = {"startup_s": startup_s, "phases": phases, "kv_cache": _kv_cache(llm), "stats": _connector_stats(),
              "threads": thread_cpu()}
    # Shut the engine down explicitly: the connector then drains its queued disk/Redis writes, so a
    # process started after this one finds everything this one stored.
    t0 = time.perf_counter()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        result["shutdown_error"] = repr(exc)
    result["shutdown_s"] = time.perf_counter() - t0
    del llm
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m lmcache_vllm.integration.vllm.offline_job JOB.json OUT.json",
              file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run_job(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
