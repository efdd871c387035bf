"""Peer-to-peer sharing (`enable_p2p`, docs/P2P.md): chunks stay in the L1 of the instance that computed them;
a directory on Redis (`directory`) says which instance holds which chunk, and `tier.P2PTier` (one lower tier of
the registry) lists this instance's chunks there, looks misses up and pulls hits over the transfer protocol of
disaggregated prefill."""
from lmcache_vllm.storage.p2p.tier import P2PTier

__all__ = ["P2PTier"]
