"""`PeerTier`: a prefill instance's transfer server as a read-only tier, for one request of a decode instance.

Built per request from the prefill instance's address (`PeerSource`: from the request's kv_transfer_params,
checked and resolved by the scheduler, which pulls only from peers it trusts: integration/vllm/pd/trust.py) and
handed to `StorageManager.prefetch(keys, peer=...)`, which asks it before the disk and Redis tiers: it claims
every key (the prefill instance said it holds the prompt; asking first would cost a round trip) and `get_many`
pulls them in one PULL (`wire`) on a TCP connection of its own, on the storage manager's event loop. Each
chunk's header is checked first — our codec's header with the key *this* instance computed, shape against
length — then its payload is received straight into memory from the caller's allocator (no copy in user
space) and checked like a disk file or a Redis value (checksum, the MAC when a secret is set). What the prefill
instance does not send (it lacks it, answers an error, sends something corrupt, or stays silent for
`timeout_s` between two messages: a dead or frozen instance) is answered None: a miss, which the load reports
to vLLM for recompute. Every outcome is counted (`pd_pull_*`), and the tier always tells the prefill instance
it is done (RELEASE; also when the pull is cancelled before it connected), so its hold ends at once instead
of at its lease. `send_release` does that for callers that never pulled, from a thread of its own
(`releases.py`: a queue per destination, connections opened without blocking): a RELEASE never blocks vLLM's
step, nor waits behind another destination's, and it connects to an address (no name lookup). Text from the
peer (its ERR detail) is escaped before it is logged (`logs.peer_text`); metrics are labelled with the peer's
bounded label.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from lmcache_vllm.config.peers import check_request_id, ip_literal
from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.base import StorageBackend, release_objs
from lmcache_vllm.storage.codec import ChunkMac, CorruptEntry
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.releases import Releases
from lmcache_vllm.storage.transfer.server import tune

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 1.0  # a RELEASE's connect and send; a prefill instance it cannot reach lets its hold expire
RELEASE_MAX_AGE_S = 30.0  # a RELEASE queued longer (behind unreachable peers) is dropped: the hold expires anyway


@dataclass(frozen=True)
class PeerSource:
    """Where one request's KV waits: the transfer server of the prefill instance's rank (an IP literal: names
    are resolved, and checked against what this instance trusts, before a source is made of them), the
    request id it holds the chunks under, and the peer's metric label (a bounded set: `pd/trust.py`).
    ValueError for anything else: nothing unchecked reaches a socket."""

    host: str
    port: int
    req_id: str
    label: str = "other"  # the metrics' peer label: a bounded set (never what a client or directory named)
    op: bytes = wire.PULL  # FETCH: P2P, chunks by key from the peer's L1 (no hold, nothing to release)

    def __post_init__(self) -> None:
        if ip_literal(self.host) is None:
            raise ValueError("a peer's host must be an IP address (resolved and checked by the scheduler)")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError("a peer's port must be from 1 to 65535")
        check_request_id(self.req_id)

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET


_RELEASES = Releases(timeout_s=RELEASE_TIMEOUT_S, max_age_s=RELEASE_MAX_AGE_S)


def send_release(source: PeerSource, mac: Optional[ChunkMac] = None) -> None:
    """Tells a prefill instance it may drop its hold for `source.req_id`, without waiting for it
    (`releases.Releases`: per-destination queues, non-blocking connects)."""
    _RELEASES.put(source.host, source.port,
                  wire.frame_bytes(wire.encode_request(wire.RELEASE, source.req_id, mac=mac)))


def _release_when_done(obj: MemoryObj, fut: asyncio.Future[None]) -> None:
    """Done callback: a decode thread finished with `obj` (its error is nobody's to handle any more)."""
    if not fut.cancelled():
        fut.exception()
    obj.ref_down()


class _Connection:
    """A pull's TCP connection on the event loop: every read and write bounded by `timeout_s`."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock = sock
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()

    async def send(self, parts: Sequence[bytes | memoryview]) -> None:
        async with asyncio.timeout(self.timeout_s):
            await self.loop.sock_sendall(self.sock, wire.frame_bytes(parts))

    async def read_into(self, view: memoryview) -> None:
        """Fills `view`; `TimeoutError` after `timeout_s` without a byte (one timer, moved on by each read:
        no task per read)."""
        got = 0
        async with asyncio.timeout(self.timeout_s) as timer:
            while got < view.nbytes:
                n = await self.loop.sock_recv_into(self.sock, view[got:])
                if not n:  # the prefill instance closed or died: counted as unreachable, not as corrupt data
                    raise ConnectionError(f"connection closed {view.nbytes - got} bytes before the message end")
                got += n
                timer.reschedule(self.loop.time() + self.timeout_s)

    async def read(self, n: int) -> bytes:
        buf = bytearray(n)
        await self.read_into(memoryview(buf))
        return bytes(buf)

    async def read_reply(self) -> tuple[wire.PeerReply, int]:
        """The next reply but a CHUNK's payload, which stays unread: (reply, the payload's length)."""
        count = wire.part_count(await self.read(wire.COUNT_BYTES))
        lengths = wire.parse_lengths(await self.read(8 * count), count, codec.MAX_PAYLOAD_BYTES + (1 << 20))
        parts: list[bytes] = []
        for i, n in enumerate(lengths):
            if i == 4 and count == 5 and parts[1] == wire.CHUNK:
                # The payload: read by the caller, into the chunk's memory (parsed here as empty).
                reply = wire.parse_reply([*parts, b""])
                return reply, lengths[4]
            if n > wire.MAX_SMALL_PART:
                raise wire.PeerProtocolError(f"a reply part of {n} bytes")
            parts.append(await self.read(n))
        reply = wire.parse_reply(parts)
        if reply.kind == wire.CHUNK:  # a CHUNK of another part count never gets here (parse_reply refuses)
            raise wire.PeerProtocolError("a CHUNK without its payload")
        return reply, 0


class PeerTier(StorageBackend):
    """See the module docstring. `timeout_s`: the longest silence between two messages of the pull.
    `metric_prefix` names its metrics (`pd_pulled_chunks`, ...; P2P: `p2p`); `failure` is how the last pull
    ended ("" when it brought every chunk; else the `pull_failures` reason)."""

    name = Tier.PEER

    def __init__(self, source: PeerSource, *, timeout_s: float, mac: Optional[ChunkMac] = None,
                 metric_prefix: str = "pd"):
        self.source = source
        self.timeout_s = float(timeout_s)
        self.mac = mac
        self.metric_prefix = metric_prefix
        self.failure = ""

    def _releases(self) -> bool:
        return self.source.op == wire.PULL  # a FETCH holds nothing on the other side

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [True] * len(keys)  # what the peer lacks comes back as None from get_many

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        return (await self.get_many([key], alloc))[0]

    async def put(self, key: str, obj: MemoryObj) -> bool:
        return False  # read-only

    async def close(self) -> None:
        """Not pulled after all (everything was in this instance's L1): the prefill instance may let go."""
        if self._releases():
            send_release(self.source, self.mac)

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        out: list[Optional[MemoryObj]] = [None] * len(keys)
        if not keys:
            return out
        label = self.source.label  # metrics: a bounded set of labels; logs name the address
        where = f"{self.source.host}:{self.source.port}"
        t0 = time.perf_counter()
        received = 0
        reason = ""
        req_id = logs.peer_text(self.source.req_id)
        sock = socket.socket(self.source.family, socket.SOCK_STREAM)
        sock.setblocking(False)
        conn = _Connection(sock, self.timeout_s)
        connected = cancelled = False
        decodes: list[tuple[int, asyncio.Future[None]]] = []  # coded chunks decoding while the next ones arrive
        try:
            tune(sock)
            async with asyncio.timeout(self.timeout_s):
                await conn.loop.sock_connect(sock, (self.source.host, self.source.port))
            connected = True
            await conn.send(wire.encode_request(self.source.op, self.source.req_id, keys, self.mac))
            while True:
                reply, payload_len = await conn.read_reply()
                if reply.kind == wire.END:
                    reason = "" if received == len(keys) else "missing"
                    break
                if reply.kind == wire.ERR:
                    reason = "refused"
                    known = reply.code.encode() in wire.ERRORS  # the peer's code: a log kind only if ours
                    logs.warn(logger, f"pd_refused_{reply.code if known else 'other'}", "prefill instance %s "
                              "refused request %s: %s (%s); recomputed here", where, req_id,
                              wire.ERRORS.get(reply.code.encode(), logs.peer_text(reply.code)),
                              logs.peer_text(reply.detail))
                    break
                if received >= len(keys):
                    raise wire.PeerProtocolError(f"more chunks than the {len(keys)} asked for")
                obj = await self._receive_chunk(conn, reply, payload_len, received, keys[received], alloc, decodes)
                if obj is None:
                    reason = "no_memory"
                    metrics.inc("read_alloc_failures", tier=self.name)
                    break
                out[received] = obj
                received += 1
                metrics.inc(f"{self.metric_prefix}_pulled_chunks", peer=label)
                metrics.inc(f"{self.metric_prefix}_pulled_bytes", obj.nbytes, peer=label)
            await self._decoded(decodes, out)
        except TimeoutError:  # asyncio.TimeoutError is TimeoutError (3.11)
            reason = "timeout"
            logs.warn(logger, "pd_pull_timeout", "prefill instance %s silent for %.1fs while request %s pulled "
                      "%d of %d chunks; the rest is recomputed", where, self.timeout_s, req_id,
                      received, len(keys))
        except (CorruptEntry, wire.PeerProtocolError) as exc:
            reason = "corrupt"
            metrics.inc("corrupt_chunks", tier=self.name)
            logs.warn(logger, "pd_pull_corrupt", "request %s: chunk %d from %s rejected (%s); the rest is "
                      "recomputed", req_id, received, where, logs.peer_text(exc))
        except OSError as exc:  # refused, reset, closed: the prefill instance is gone
            reason = "unreachable"
            logs.warn(logger, "pd_pull_unreachable", "prefill instance %s unreachable while request %s pulled "
                      "%d of %d chunks (%s); the rest is recomputed", where, req_id, received,
                      len(keys), exc)
        except asyncio.CancelledError:
            self._release_after_decodes(decodes, out)  # the caller gave up: nothing is returned
            cancelled = True
            raise
        finally:
            if decodes and not cancelled:  # a pull that failed midway: the chunks decoding still count
                try:
                    await self._decoded(decodes, out)
                except CorruptEntry:
                    reason = reason or "corrupt"
                except asyncio.CancelledError:
                    self._release_after_decodes(decodes, out)
                    raise
            sock.close()
            if (connected or cancelled) and self._releases():  # (cancelled before it connected too)
                send_release(self.source, self.mac)
            metrics.observe(f"{self.metric_prefix}_pull_seconds", time.perf_counter() - t0, peer=label)
            self.failure = reason
            if reason:
                metrics.inc(f"{self.metric_prefix}_pull_failures", reason=reason)
        return out

    async def _decoded(self, decodes: list[tuple[int, asyncio.Future[None]]], out: list[Optional[MemoryObj]]) -> None:
        """Waits for the coded chunks still decoding. From the first that does not decode on, the chunks are
        released and None (what comes before stays a usable prefix), and its `CorruptEntry` goes up."""
        first_bad, error = len(out), None
        for index, fut in decodes:
            try:
                await asyncio.shield(fut)
            except CorruptEntry as exc:
                if error is None:
                    first_bad, error = index, exc
        decodes.clear()
        if error is None:
            return
        release_objs(obj for obj in out[first_bad:] if obj is not None)
        out[first_bad:] = [None] * (len(out) - first_bad)
        raise error

    @staticmethod
    def _release_after_decodes(decodes: list[tuple[int, asyncio.Future[None]]], out: list[Optional[MemoryObj]]) -> None:
        """Releases every chunk of a cancelled pull; one still decoding once its thread is done with it."""
        decoding = {index: fut for index, fut in decodes}
        for index, obj in enumerate(out):
            if obj is None:
                continue
            fut = decoding.get(index)
            if fut is not None and not fut.done():
                fut.add_done_callback(functools.partial(_release_when_done, obj))
            else:
                obj.ref_down()
            out[index] = None

    async def _receive_coded(self, conn: _Connection, header: codec.ChunkHeader, obj: MemoryObj,
                             index: int, decodes: list[tuple[int, asyncio.Future[None]]]) -> MemoryObj:
        """A coded payload received into a buffer of its own (its length bounded by the chunk: the header was
        checked), then checked and decoded into `obj` on a worker thread while the next chunk arrives (the
        pull waits for `decodes` before it returns)."""
        try:
            stored = codec.payload_buffer(header.payload_len)
            await conn.read_into(stored)
        except BaseException:
            obj.ref_down()
            raise
        decodes.append((index, asyncio.get_running_loop().run_in_executor(
            None, codec.decode_payload_into, stored, header, obj.tensor, self.mac)))
        return obj

    async def _receive_chunk(self, conn: _Connection, reply: wire.PeerReply, payload_len: int, index: int,
                             key: str, alloc: AllocFn, decodes: list[tuple[int, asyncio.Future[None]]]
                             ) -> Optional[MemoryObj]:
        """The chunk of a CHUNK reply whose payload is still on the stream: its header checked (index, this
        instance's key, shape against the payload's length), the payload received into memory from `alloc`
        and checked (checksum, MAC). None without memory (the stream is then left mid-message: the caller
        stops); `CorruptEntry` / `PeerProtocolError` for anything wrong, with nothing left allocated."""
        header = wire.check_chunk(reply, index, key, payload_len)
        obj = codec.allocate(header, alloc)  # the peer's header alone allocates nothing but the expected chunk
        if obj is None:
            return None
        if header.coded:
            return await self._receive_coded(conn, header, obj, index, decodes)
        try:
            view = codec.payload_view(obj.tensor)
            await conn.read_into(view)
            codec.verify_payload(header, view, self.mac)
        except BaseException:
            obj.ref_down()
            raise
        return obj
