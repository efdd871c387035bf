"""Steering the cache of a running fleet: each instance's management API and the fleet coordinator
(docs/MANAGEMENT.md).

LMCache's multiprocess server and its MP coordinator define the HTTP surface (paths, JSON fields, units,
status codes); this package serves it for lmcache-vllm, with a bearer token on every write:

- `schemas` the request bodies and their bounds, `keys` token ids and LMCache's object keys to our chunk keys
  (with the connector's own key builder), `auth` the token, `http` the aiohttp server and client parts;
- `ops` what one tensor-parallel rank does for a call (beside its `CacheEngine`), `control` how the instance API
  reaches every rank, `instance` the instance API, `agent` its registration with the coordinator;
- `coordinator` the fleet coordinator (its state in the Redis directory P2P uses), `moves` its moves, `quotas` its
  quotas, `fleet` its Redis state and its calls to the instances, `client` one JSON call (the agent, the CLI),
  `cli` the `lmcache-vllm coordinator` and `lmcache-vllm cache` commands.

It uses engine, storage and config; never vLLM (the connector starts the instance API).
"""
