"""Operations on stored chunks outside vLLM: what the `lmcache-vllm` inspect / clear / ping / stats
subcommands do (`disk.py`, `redis_tier.py`, `scrape.py`), and how they print (`report.py`)."""
