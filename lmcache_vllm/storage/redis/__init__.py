"""L3: the Redis tier (`RedisBackend`) on one server, a Redis Cluster or behind Sentinel, through redis-py:
`backend` (the tier), `topology` (which node each key goes to), `guard` (per-node breaker and in-flight
limit), `client` (the redis-py client of each URL form, TLS, the start-up check)."""

from lmcache_vllm.storage.redis.backend import RedisBackend, glob_escape

__all__ = ["RedisBackend", "glob_escape"]
