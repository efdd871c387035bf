"""`PeerTier`: a prefill instance's transfer server as a read-only tier, for one request of a decode instance.

Built per request from the prefill instance's address (`PeerSource`, from the request's kv_transfer_params) and
handed to `StorageManager.prefetch(keys, peer=...)`, which asks it before the disk and Redis tiers: it claims
every key (the prefill instance said it holds the prompt; asking first would cost a round trip) and `get_many`
pulls them in one PULL (`peer_wire`), on the storage manager's event loop. Each chunk is checked like a disk
file or a Redis value — our codec's header with the key *this* instance computed, shape against length,
checksums, the MAC when a secret is set — and lands in memory from the caller's allocator. What the prefill
instance does not send (it lacks it, answers an error, sends something corrupt, or stays silent for
`timeout_s` between two messages: a dead or frozen instance) is answered None: a miss, which the load reports
to vLLM for recompute. Every outcome is counted (`pd_pull_*`), and the tier always tells the prefill instance
it is done (RELEASE), so its hold ends at once instead of at its lease.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import zmq
import zmq.asyncio

from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage import peer_wire as wire
from lmcache_vllm.storage.base import StorageBackend, release_objs
from lmcache_vllm.storage.codec import ChunkMac, CorruptEntry
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

RELEASE_LINGER_MS = 1000  # how long ZMQ keeps trying to deliver a RELEASE after the pull's socket closed


@dataclass(frozen=True)
class PeerSource:
    """Where one request's KV waits: the transfer server of the prefill instance's rank, and the request id
    it holds the chunks under."""

    host: str
    port: int
    req_id: str

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"


def send_release(source: PeerSource, mac: Optional[ChunkMac] = None) -> None:
    """Tells a prefill instance it may drop its hold for `source.req_id` (fire and forget: a dead instance
    loses nothing, its hold expires)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, RELEASE_LINGER_MS)
        sock.connect(source.endpoint)
        sock.send_multipart(wire.encode_request(wire.RELEASE, source.req_id, mac=mac), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    finally:
        sock.close()


def _release_on(sock: zmq.asyncio.Socket, source: PeerSource, mac: Optional[ChunkMac]) -> None:
    """Queues a RELEASE on the pull's own socket (delivered within the linger after it closes)."""
    try:
        sent = sock.send_multipart(wire.encode_request(wire.RELEASE, source.req_id, mac=mac), zmq.NOBLOCK)
    except zmq.ZMQError:
        return
    if isinstance(sent, asyncio.Future):  # a failure of this best-effort send is nobody's business
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())


class PeerTier(StorageBackend):
    """See the module docstring. `timeout_s`: the longest silence between two messages of the pull."""

    name = Tier.PEER

    def __init__(self, source: PeerSource, *, timeout_s: float, mac: Optional[ChunkMac] = None):
        self.source = source
        self.timeout_s = float(timeout_s)
        self.mac = mac

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [True] * len(keys)  # what the peer lacks comes back as None from get_many

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        return (await self.get_many([key], alloc))[0]

    async def put(self, key: str, obj: MemoryObj) -> bool:
        return False  # read-only

    async def close(self) -> None:
        """Not pulled after all (everything was in this instance's L1): the prefill instance may let go."""
        send_release(self.source, self.mac)

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        out: list[Optional[MemoryObj]] = [None] * len(keys)
        if not keys:
            return out
        sock: zmq.asyncio.Socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, RELEASE_LINGER_MS)
        label = self.source.label
        t0 = time.perf_counter()
        received = 0
        reason = ""
        try:
            sock.connect(self.source.endpoint)
            await sock.send_multipart(wire.encode_request(wire.PULL, self.source.req_id, keys, self.mac))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(copy=False), self.timeout_s)
                reply = wire.parse_reply(frames)
                if reply.kind == wire.END:
                    reason = "" if received == len(keys) else "missing"
                    break
                if reply.kind == wire.ERR:
                    reason = "refused"
                    logs.warn(logger, f"pd_refused_{reply.code}", "prefill instance %s refused request %s: "
                              "%s (%s); recomputed here", label, self.source.req_id,
                              wire.ERRORS.get(reply.code.encode(), reply.code), reply.detail)
                    break
                if received >= len(keys):
                    raise wire.PeerProtocolError(f"more chunks than the {len(keys)} asked for")
                obj = wire.decode_chunk(reply, received, keys[received], alloc, self.mac)
                if obj is None:
                    reason = "no_memory"
                    metrics.inc("read_alloc_failures", tier=self.name)
                    break
                out[received] = obj
                received += 1
                metrics.inc("pd_pulled_chunks", peer=label)
                metrics.inc("pd_pulled_bytes", obj.nbytes, peer=label)
        except asyncio.TimeoutError:
            reason = "timeout"
            logs.warn(logger, "pd_pull_timeout", "prefill instance %s silent for %.1fs while request %s pulled "
                      "%d of %d chunks; the rest is recomputed", label, self.timeout_s, self.source.req_id,
                      received, len(keys))
        except (CorruptEntry, wire.PeerProtocolError) as exc:
            reason = "corrupt"
            metrics.inc("corrupt_chunks", tier=self.name)
            logs.warn(logger, "pd_pull_corrupt", "request %s: chunk %d from %s rejected (%s); the rest is "
                      "recomputed", self.source.req_id, received, label, exc)
        except asyncio.CancelledError:
            release_objs(out)  # the caller gave up (request aborted, load timed out): nothing is returned
            raise
        finally:
            _release_on(sock, self.source, self.mac)
            sock.close()
            metrics.observe("pd_pull_seconds", time.perf_counter() - t0, peer=label)
            if reason:
                metrics.inc("pd_pull_failures", reason=reason)
        return out
