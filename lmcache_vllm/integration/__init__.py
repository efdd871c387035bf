"""Integrations of lmcache-vllm with serving engines (only vLLM so far)."""
