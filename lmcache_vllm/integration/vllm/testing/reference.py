"""Like-with-like references for comparing greedy tokens: vLLM itself computing the same prefill split.

vLLM's CPU matmuls round differently for differently shaped prefill steps (a 1500-token step against
1280 cached + 220 computed, a one-shot prefill against 256-token chunks), and the greedy tokens of our
random-weight test models flip on that noise, differently on AMD and on Intel AMX machines. A cached run
is therefore never compared with a one-shot prefill. The one rule, used by the e2e tests, the demo and
`benchmarks/bench_e2e_ttft.py`:

- The reference of a run with the connector is vLLM *without* it, replaying the same phases (and,
  for a process that reads what another one stored, the phases that stored it: `replay`) with the same
  model and scheduler settings, with vLLM's own prefix cache on (`reference_job`).
- A request we served N tokens of is compared with the reference request vLLM's prefix cache served the
  same N tokens of (same block-aligned N, KV computed by the same earlier prefill): the greedy tokens must
  be bit-identical, which says the KV we load is exactly the KV vLLM would have kept. A cold request is
  compared with the reference's first, uncached occurrence of the prompt (the same scheduler settings).
- The split is checked before the tokens (`like_with_like` picks the candidate whose `num_cached_tokens`
  equals ours): a comparison across different splits is a test-design error, reported as such.

vLLM's prefix cache works in whole blocks (128 tokens on CPU) and always computes at least the last prompt
token, so it serves `floor((len - 1) / block) * block` tokens of a repeated prompt, where we serve
`floor(len / chunk) * chunk`. Prompts compared this way have lengths where the two agree (`len % 256` in
1..128 with 256-token chunks and 128-token blocks; `len % 128` not 0 with the CPU default, chunks of the block
size; `hit_splits_agree` tells). A full-prompt hit (all but
the last token loaded) has no prefix-cache twin; such runs are compared with another run of ours that
loaded the same bytes with the same split, or with a reference whose writer computed the same split.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def reference_job(job: dict[str, Any], *, prefix_caching: bool = True, name_prefix: str = "") -> dict[str, Any]:
    """The reference of `job` (an offline job, see `offline_job`): no connector, the same model, scheduler
    settings and phases (names prefixed by `name_prefix`), vLLM's own prefix cache on."""
    kwargs = dict(job.get("llm_kwargs", {}), enable_prefix_caching=prefix_caching)
    phases = [dict({k: v for k, v in p.items() if k != "wait_for_file"}, name=name_prefix + p.get("name", ""))
              for p in job["phases"]]  # a pause for the test to act in is not part of what vLLM computes
    return {"model": job["model"], "llm_kwargs": kwargs, "phases": phases}


def replay(*jobs: tuple[str, dict[str, Any]], prefix_caching: bool = True) -> dict[str, Any]:
    """One reference process replaying several jobs' phases in order, each phase named `"<label>/<name>"`.

    For runs that read what earlier processes stored: the earlier jobs' phases put the same KV into vLLM's
    prefix cache that they put into our tiers. All jobs must share the model and scheduler settings."""
    first = jobs[0][1]
    kwargs = {k: v for k, v in first.get("llm_kwargs", {}).items() if k != "enable_prefix_caching"}
    phases = []
    for label, job in jobs:
        if job["model"] != first["model"] or {k: v for k, v in job.get("llm_kwargs", {}).items()
                                               if k != "enable_prefix_caching"} != kwargs:
            raise ValueError(f"replay: job {label!r} runs with other settings than {jobs[0][0]!r}; a reference "
                             f"must compute with the same scheduler settings")
        phases += reference_job(job, name_prefix=f"{label}/")["phases"]
    return {"model": first["model"], "llm_kwargs": dict(kwargs, enable_prefix_caching=prefix_caching),
            "phases": phases}


def hit_splits_agree(prompt_len: int, chunk_size: int | None = None, block_size: int = 128) -> bool:
    """Whether vLLM's prefix cache serves a repeat of a `prompt_len`-token prompt the same number of tokens
    as our connector with whole chunks (so the two can be compared like with like). `chunk_size` None: the
    connector's choice when none is set on vLLM's CPU backend, the block size."""
    chunk_size = block_size if chunk_size is None else chunk_size
    ours = prompt_len - prompt_len % chunk_size
    vllm = (prompt_len - 1) - (prompt_len - 1) % block_size
    return ours == vllm


def like_with_like(ours: dict[str, Any], candidates: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The candidate request result computed with the same prefill split as `ours` (equal
    `num_cached_tokens`), or None. Results are offline-job request results: {"tokens", "num_cached_tokens"}."""
    for candidate in candidates:
        if candidate["num_cached_tokens"] == ours["num_cached_tokens"]:
            return candidate
    return None


def assert_like_with_like(ours: dict[str, Any], *candidates: dict[str, Any], what: str = "") -> None:
    """`ours` gave bit-identical greedy tokens to the reference request that computed the same split.

    `candidates` are reference results for the same prompt (e.g. its cold first occurrence and its
    prefix-cache hit). No candidate with our split means the test compares unlike things: that fails
    with a message saying so, never by comparing tokens across splits."""
    match = like_with_like(ours, candidates)
    label = f"{what}: " if what else ""
    if match is None:
        splits = sorted({c["num_cached_tokens"] for c in candidates})
        raise AssertionError(
            f"{label}no like-with-like reference: this run had {ours['num_cached_tokens']} prompt tokens cached, "
            f"the references {splits}. Tokens are only comparable between runs with the same prefill split "
            f"(see lmcache_vllm/integration/vllm/testing/reference.py).")
    if ours["tokens"] != match["tokens"]:
        raise AssertionError(f"{label}greedy tokens differ from vLLM's at the same split "
                             f"({ours['num_cached_tokens']} tokens cached): {ours['tokens']} != {match['tokens']}")


def same_output(ours: dict[str, Any], candidates: Sequence[dict[str, Any]]) -> str:
    """'yes' / 'NO' against the like-with-like candidate, 'n/a' when no candidate has our split."""
    match = like_with_like(ours, candidates)
    if match is None:
        return "n/a"
    return "yes" if ours["tokens"] == match["tokens"] else "NO"
