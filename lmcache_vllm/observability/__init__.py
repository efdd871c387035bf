"""What lmcache-vllm tells its operators: the one metrics model and its recorder (`metrics`), the metric
table's generator (`metrics_doc`), KV cache events per chunk (`kv_events`), and rate-limited warnings and
redaction for logs (`logs`). Nothing here imports vLLM, torch or the storage tiers."""
