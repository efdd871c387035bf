"""`KeyedChunks`: what a transfer server sends for a FETCH (P2P): the chunks of L1 named by key.

`checkout(keys, peer_host)` (the server's `by_key`) takes one reference on each L1 chunk of the longest prefix
of `keys` this instance holds: the pin that keeps L1 from evicting a chunk while its bytes are on the way. The
pins last for the send only (the server hands them back once its sends returned, or the peer was dropped after
the server's I/O timeout, `extra_config.p2p_pull_timeout_secs`): a short lease, never a hold. Each chunk's wire
header (a checksum pass, and the MAC with a secret) is made on its first send and kept while the chunk stays
in L1 (`forget` drops it; bounded by `max_headers`). A chunk sent coded (`serde`, `transfer/serde.py`) is coded
for each send on the server's thread, header and payload, and nothing of it is kept (a kept copy of every
served chunk would double L1).

Who is served: with a MAC secret, every peer (the server has checked the request's MAC: only holders of the
secret ask, and they verify every chunk); without one, `trusted(host)` peers only (loopback and
`extra_config.pd_peers`). A key asked for and not held (L1 evicted it since it was advertised) is reported to
`on_missing`, so the directory stops naming this instance for it.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, Iterable, Optional

from lmcache_vllm.memory import MemoryObj
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.codec import ChunkBytes, ChunkMac
from lmcache_vllm.storage.coders import NAIVE
from lmcache_vllm.storage.transfer.holds import Checkout, DuplicateKey, HoldState
from lmcache_vllm.storage.transfer.serde import wire_coder
from lmcache_vllm.storage.transfer.wire import chunk_header, chunk_parts

logger = logging.getLogger(__name__)

GetFn = Callable[[str], Optional[MemoryObj]]  # a key -> its L1 chunk with a reference for the caller, or None


class KeyedChunks:
    """See the module docstring. `get` is L1's `get_sync`."""

    def __init__(self, get: GetFn, *, mac: Optional[ChunkMac], trusted: Callable[[str], bool],
                 on_missing: Callable[[list[str]], None] = lambda keys: None, max_headers: int = 16384,
                 send_lease_s: float = 30.0, serde: str = NAIVE):
        self._get = get
        self.serde = serde
        self.send_lease_s = float(send_lease_s)
        self.mac = mac
        self._trusted = trusted
        self._on_missing = on_missing
        self._max_headers = max_headers
        self._lock = threading.Lock()
        self._headers: OrderedDict[str, bytes] = OrderedDict()

    def checkout(self, keys: Iterable[str], peer_host: str) -> Checkout:
        """`keys` is consumed lazily: an untrusted peer's request never becomes strings, and the walk stops
        at the first key L1 lacks (reported to `on_missing`, alone). `DuplicateKey` (nothing kept) for a key
        named twice: each repeat would be sent again (and, with p2p_serve_disk, read from disk again)."""
        if self.mac is None and not self._trusted(peer_host):
            logs.warn(logger, "p2p_untrusted_fetch", "P2P: refused chunks to %s: not a trusted peer ("
                      "extra_config.pd_peers) and no chunk MAC key is set", logs.peer_text(peer_host))
            metrics.inc("p2p_refused_fetches")
            return Checkout(HoldState.UNKNOWN, [])
        objs: list[MemoryObj] = []
        found: list[str] = []
        seen: set[str] = set()
        for key in keys:
            if key in seen:
                for taken in objs:
                    taken.ref_down()
                raise DuplicateKey(f"key {len(found)} of the FETCH repeats an earlier one")
            seen.add(key)
            obj = self._get(key)
            if obj is None:
                # Only this key is known to be gone: a peer that names a key we never held before keys we hold
                # must not make us withdraw those.
                self._on_missing([key])
                break
            objs.append(obj)
            found.append(key)
        try:
            coder = wire_coder(self.serde)
            parts = [(self._header(key, obj), None) if coder == NAIVE else chunk_parts(key, obj.tensor, self.mac, coder)
                     for key, obj in zip(found, objs)]
        except BaseException:
            for obj in objs:
                obj.ref_down()
            raise
        metrics.inc("p2p_served_chunks", len(objs))
        metrics.inc("p2p_served_bytes", sum(obj.nbytes for obj in objs))
        payloads: tuple[Optional[ChunkBytes], ...] = tuple(p for _, p in parts)
        return Checkout(HoldState.READY, objs, headers=tuple(h for h, _ in parts), payloads=payloads,
                        keys=tuple(found), expires_in=self.send_lease_s)

    def _header(self, key: str, obj: MemoryObj) -> bytes:
        with self._lock:
            header = self._headers.get(key)
            if header is not None:
                self._headers.move_to_end(key)
                return header
        header = chunk_header(key, obj.tensor, self.mac)
        with self._lock:
            self._headers[key] = header
            while len(self._headers) > self._max_headers:
                self._headers.popitem(last=False)
        return header

    def forget(self, key: str) -> None:
        """`key` left L1: its header goes too."""
        with self._lock:
            self._headers.pop(key, None)
