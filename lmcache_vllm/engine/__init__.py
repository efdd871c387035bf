"""The cache engine: tokens -> chunk keys, vLLM's paged KV <-> stored chunks, over one `StorageManager`.

`CacheEngine` (`cache_engine.py`) stores, looks up and loads the KV of one set of attention layers (a lookup's
answer and holds: `holds.py`);
`GroupedEngine` (`grouped.py`) puts the KV cache groups of a hybrid model (`kv_groups.py`) over one storage,
with a `StateEngine` (`state.py`) for each Mamba / linear-attention group. No vLLM imports.

The engine's names load on first access: `kv_groups` alone is light, and vLLM's API server, which imports
it through the connector, must not load the storage and the memory arena.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_vllm.engine.cache_engine import CacheEngine
    from lmcache_vllm.engine.holds import HeldPrefix, PrefixHit

__all__ = ["CacheEngine", "HeldPrefix", "PrefixHit"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmcache_vllm.engine import cache_engine

        return getattr(cache_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
