"""vLLM integration: `LMCacheConnector`, loaded by vLLM through
`kv_connector_module_path="lmcache_vllm.integration.vllm"`. The only package that imports vLLM.

The connector is imported on first access, so the vLLM-free parts (lookup sockets, scheduler logic)
can be used and tested without paying for `import vllm`.
"""

__all__ = ["LMCacheConnector"]


def __getattr__(name: str) -> type:
    if name == "LMCacheConnector":
        from lmcache_vllm.integration.vllm.connector import LMCacheConnector

        return LMCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
