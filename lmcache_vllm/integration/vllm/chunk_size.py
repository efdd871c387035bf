"""The chunk size when the configuration sets none: what vLLM's own prefix cache serves.

A lookup hits whole chunks, vLLM's prefix cache whole blocks. A chunk larger than vLLM's block leaves up to
`chunk_size - block_size` tokens of every repeat to recompute that vLLM's cache would have served, so with no
`chunk_size` set (`LMCacheConfig.chunk_size` is None) the connector takes:
- on vLLM's CPU backend: vLLM's block size (128 by default). Measured with `bench_serving.py` (AMD EPYC Zen 4,
  docs/CONFIG.md): our warm L1 served 0.98 of vLLM's own device hits with 128-token chunks, 0.80 with 256.
- on a GPU: the multiple of vLLM's block size nearest `GPU_TARGET_TOKENS` (LMCache's chunk size; blocks there
  are 16 tokens, and a 16-token chunk would cost a key, an L1 entry and a disk file per 16 tokens). Not
  measured on a GPU.
An explicit `chunk_size` is always honoured. Both halves of the connector (scheduler and workers) resolve it
from the same vLLM configuration, so they agree; instances sharing a cache (disk, Redis, disaggregated
prefill) need the same chunk size, which they get from the same block size and platform or by setting it.
"""
from __future__ import annotations

import dataclasses
import logging

from lmcache_vllm.config import LMCacheConfig

logger = logging.getLogger(__name__)

GPU_TARGET_TOKENS = 256


def default_chunk_size(block_size: int, on_cpu: bool) -> tuple[int, str]:
    """The chunk size for vLLM's `block_size` on its CPU backend (`on_cpu`) or a GPU, and why."""
    if block_size <= 0:
        raise ValueError(f"block_size ({block_size}) must be positive")
    if on_cpu:
        return block_size, ("vLLM's block size on its CPU backend: a repeat loads what vLLM's own prefix cache "
                            "would serve")
    size = max(1, round(GPU_TARGET_TOKENS / block_size)) * block_size
    return size, (f"the multiple of vLLM's {block_size}-token blocks nearest {GPU_TARGET_TOKENS} tokens (a repeat "
                  f"recomputes up to {size - 1} tokens, vLLM's own prefix cache up to {block_size - 1}; not "
                  f"measured on a GPU)")


def with_chunk_size(config: LMCacheConfig, block_size: int, on_cpu: bool, *, log: bool) -> LMCacheConfig:
    """`config` with its chunk size resolved: as set, or `default_chunk_size` (logged once when `log`)."""
    if config.chunk_size is not None:
        return config
    size, reason = default_chunk_size(block_size, on_cpu)
    if log:
        logger.info("lmcache-vllm chunk_size %d (not set): %s. Set chunk_size to keep another size; every "
                    "instance sharing a cache needs the same one", size, reason)
    return dataclasses.replace(config, chunk_size=size)
