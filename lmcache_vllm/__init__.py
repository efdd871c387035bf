"""lmcache-vllm: saves the KV cache vLLM computed into tiered storage and loads it back for any later
request that starts with the same tokens, so that their prefill is skipped."""

__version__ = "0.1.0"
