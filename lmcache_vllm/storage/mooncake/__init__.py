"""L3 in a Mooncake Store (`MooncakeBackend`), selected by LMCache's `remote_url: mooncakestore://host:port`:
`backend` (the tier: chunks in our format, zero-copy batches into and out of the L1 arena) and `client` (the
store and every call to it: on our threads, under deadlines and a breaker)."""

from lmcache_vllm.storage.mooncake.backend import MooncakeBackend

__all__ = ["MooncakeBackend"]
