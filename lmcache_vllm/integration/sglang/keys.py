"""SGLang page hashes -> our key strings (`tokens.CacheKey`), namespaced by what decides a page's bytes.

SGLang names a page by a 64-character hex SHA-256 chained over the prefix's token ids (`get_storage_hash_str`;
`cache_salt` and `extra_key` seed the chain, so a salted request never shares a page with another salt). It
says nothing of the model, the rank or the layout: that is ours to add. A page's key is
`model@fingerprint@tp<size>.<rank>@pp<size>.<rank>@dtype@v<format>@g-sglang.<pool>.<layout>[.cp<r>-<n>]@<hash>`:
- `model`: the last part of SGLang's model name (prefixed by `extra_config.cache_namespace` when set);
- `fingerprint` (`page_identity`): sha256 of the canonical JSON ("sglang-page/v1") of SGLang's model name, the
  weights signature of its files when the name is a local path or a model in the local hub cache
  (`lmcache_vllm/identity.py`, as the vLLM side does), the pool, its layout, page shape and dtype,
  `extra_config.cache_namespace` and the id of the chunk MAC secret;
- TP size and rank, except for rank-replicated pools (MLA: SGLang's `is_mla_model`), whose every rank reads
  the one copy rank 0 writes (`tp1.0`); PP size and rank; the attention context-parallel rank when there are
  several (each holds a slice of the page);
- the pool and its layout in the group tag, readable in `lmcache-vllm inspect`;
- the hash itself as the digest (`CacheKey`'s last part), so prefix order is SGLang's.
A hash that is not lowercase hex of even length (never one of SGLang's) has no key: `key()` gives None and the
page counts as refused.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.identity import ModelIdentity, canonical_json, plain, weight_files, weights_signature
from lmcache_vllm.integration.sglang.pages import HostPages
from lmcache_vllm.storage.codec import FORMAT_VERSION
from lmcache_vllm.storage.registry import chunk_mac
from lmcache_vllm.tokens import CacheKey, dtype_name

logger = logging.getLogger(__name__)

PAGE_KEY_SCHEME = "sglang-page/v1"
_HASH_RE = re.compile(r"^(?:[0-9a-f]{2}){1,64}$")


@dataclass(frozen=True)
class Parallelism:
    """The ranks SGLang's `HiCacheStorageConfig` names that decide which slice of a page a process holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    replicated: bool = False  # every TP rank holds the same page (MLA)

    @classmethod
    def of(cls, storage_config: Any) -> "Parallelism":
        return cls(int(storage_config.tp_rank), int(storage_config.tp_size), int(storage_config.pp_rank),
                   int(storage_config.pp_size), int(getattr(storage_config, "attn_cp_rank", 0)),
                   int(getattr(storage_config, "attn_cp_size", 1)), bool(storage_config.is_mla_model))


def model_inputs(model_name: Optional[str], config: LMCacheConfig) -> dict[str, Any]:
    """What the fingerprint sees of the model, the same for every pool (computed once: reads weight files)."""
    name = model_name or ""
    files = weight_files(name) if name else []
    if name and not files:
        logger.info("lmcache-vllm (SGLang): no weight files found for model name %r; its page keys rely on "
                    "the name (set extra_config.cache_namespace to tell versions apart)", name)
    mac = chunk_mac(config)
    return {"scheme": PAGE_KEY_SCHEME, "model": name, "weights": weights_signature(files),
            "namespace": config.extra_config.cache_namespace or "", "chunk_mac": "keyed" if mac else ""}


def readable_name(model_name: Optional[str], namespace: Optional[str]) -> str:
    base = os.path.basename((model_name or "").rstrip("/")) or "model"
    return f"{namespace}.{base}" if namespace else base


def page_identity(inputs: dict[str, Any], pages: HostPages, namespace: Optional[str]) -> ModelIdentity:
    """The identity of one pool's pages: the model's inputs plus the pool, its layout, page shape and dtype."""
    full = plain({**inputs, "pool": pages.name, "layout": pages.layout, "page_shape": list(pages.shape),
                  "dtype": dtype_name(pages.dtype)})
    fingerprint = hashlib.sha256(canonical_json(full).encode()).hexdigest()[:32]
    return ModelIdentity(readable_name(inputs.get("model"), namespace), fingerprint, full)


def _tag(text: str) -> str:
    return re.sub(r"[^a-z0-9.-]", "-", text.lower())


class PageKeys:
    """Key strings of one pool's pages (`key(hash)`), built once per pool."""

    def __init__(self, identity: ModelIdentity, pages: HostPages, parallel: Parallelism):
        group = f"sglang.{_tag(pages.name)}.{_tag(pages.layout)}"
        if parallel.cp_size > 1:
            group += f".cp{parallel.cp_rank}-{parallel.cp_size}"
        tp_size, tp_rank = (1, 0) if parallel.replicated else (parallel.tp_size, parallel.tp_rank)
        template = CacheKey(identity.name, tp_size, tp_rank, dtype_name(pages.dtype), FORMAT_VERSION, b"\0",
                            fingerprint=identity.fingerprint, pp_size=parallel.pp_size, pp_rank=parallel.pp_rank,
                            group=group)
        self.template = template
        self.prefix = template.to_str()[:-2]  # everything but the digest's hex

    def key(self, page_hash: object) -> Optional[str]:
        if not isinstance(page_hash, str) or not _HASH_RE.match(page_hash):
            return None
        return self.prefix + page_hash
