"""Tiered chunk storage behind the synchronous `manager.StorageManager`: L1 host memory (`local_cpu`),
L2 local disk (`local_disk`), other instances' L1 (`p2p/`), L3 Redis (`redis/`), built from the configuration
by `registry`; the transfer between instances is `transfer/`;
`tier.Tier` names them, `codec` is the byte format of a chunk outside memory.

Import the modules themselves: this package's face stays empty so that naming a tier (`storage.tier`)
does not load the tiers (vLLM's API server imports the connector and must stay light)."""
