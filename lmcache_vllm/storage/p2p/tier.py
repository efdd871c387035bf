"""`P2PTier`: other instances' L1 as one lower tier (between the disk and Redis), through a directory on Redis.

- `put(key)` (the write-through of a chunk this instance stored in L1) lists it in the directory; L1's removal
  listener withdraws it. The changes are written in batches by a task on the storage loop (an addition wakes it
  at once, so a peer finds a chunk right after it was stored; withdrawals wait for the next `TICK_S`), and
  every entry's lease is renewed each third of `extra_config.p2p_lease_secs` (`directory.py`); when the
  directory lost them (it was unreachable past the lease, or restarted), everything is written again.
- `contains(keys)`: one batched directory query, bounded by `extra_config.p2p_lookup_timeout_secs`; a slow or
  dead directory is a counted miss (`p2p_lookup_failures`), never a stalled step. Candidates are the servers
  of other instances (never this one) holding the same key space (model, TP size and rank, format), that are
  trusted (`peers.PeerTrust`) and not backing off after a failed pull. Where each key was found is kept for
  the `get_many` that follows.
- `get_many(keys)`: the run of keys is cut into stretches one server holds (the longest first), each pulled
  with one FETCH over the transfer protocol of disaggregated prefill (`transfer/client.py`'s `PeerTier`: every
  chunk's header checked against this instance's key, its payload's checksum and MAC), all at once. A dead,
  slow, refusing or lying peer gives misses (recomputed) and is skipped for `p2p_peer_backoff_secs`. What is
  pulled goes to the request's load only: it stays where it was computed, so the fleet's L1s hold each chunk
  once (with `extra_config.p2p_keep_pulled` it is promoted into L1 too, not listed); nothing from a peer is
  written through to a shared tier.
- `attach(l1, identity, tiers)` (once the worker knows its instance and rank) starts this rank's transfer
  server, which serves FETCHes from L1 (`transfer/keyed.py`), on `p2p_host` and `p2p_init_ports[rank]` (a
  single port: port + rank; none: one the OS picks). Before it, the tier finds and lists nothing. With
  `extra_config.p2p_serve_disk`, a chunk L1 evicts stays listed while the disk tier holds it, and is read from
  there for a peer; the disk's own evictions are not seen: such an entry is withdrawn when a peer asks for it. A
  clear of every tier (vLLM's `/reset_prefix_cache?reset_external=true` with `reset_lower_tiers`) withdraws them
  all (a management delete removes the disk copy before L1's, so L1's listener withdraws it).
TP: keys carry the TP size and rank, so rank r pulls from rank r of instances with the same TP size; an
instance of the same model at another TP size is named once in a warning (its chunks are recomputed here).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lmcache_vllm.config.peers import ip_literal
from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.config.schema import p2p_directory_url
from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.base import InstanceIdentity, StorageBackend, gather_owned
from lmcache_vllm.storage.local_disk import LocalDiskBackend
from lmcache_vllm.storage.p2p.adverts import Adverts
from lmcache_vllm.storage.p2p.directory import Directory, ServerInfo, chunk_id, key_space
from lmcache_vllm.storage.p2p.peers import Backoff, PeerLabels, PeerTrust, plan_pulls
from lmcache_vllm.storage.redis.client import ClientSettings, async_client, pool_state
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier
from lmcache_vllm.storage.transfer.holds import PeerHolds
from lmcache_vllm.storage.transfer.keyed import KeyedChunks
from lmcache_vllm.storage.transfer.server import TransferServer

if TYPE_CHECKING:
    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.storage.codec import ChunkMac
    from lmcache_vllm.storage.local_cpu import LocalCPUBackend

logger = logging.getLogger(__name__)

TICK_S = 0.1  # withdrawals are written at least this often; additions at once (batched while one is written)
MAX_REMEMBERED = 8192  # keys whose holders a lookup found, kept for the pull that follows
BACKED_OFF = ("timeout", "unreachable", "corrupt", "refused")  # pull failures that are the peer's
SIGNATURE_SKEW_S = 30.0  # a directory entry's signature is taken this long past its end (clocks differ)


def _waiting_in(task: "asyncio.Future[Any]") -> str:
    """Where a pending task's coroutine waits: our innermost call and the calls it awaits below it (at most
    ten in all): a stalled lookup's log line says which of our calls stood, and where in redis-py."""
    calls: list[tuple[str, str]] = []
    awaited: object = task.get_coro() if isinstance(task, asyncio.Task) else None
    while awaited is not None and len(calls) < 64:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is not None:
            path = frame.f_code.co_filename
            calls.append((path, f"{os.path.basename(path)}:{frame.f_lineno} {frame.f_code.co_name}"))
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    ours = [i for i, (path, _) in enumerate(calls) if f"{os.sep}lmcache_vllm{os.sep}" in path]
    first = ours[-1] if ours else 0
    shown = list(range(first, len(calls)))
    if len(shown) > 10:  # our innermost call, then the library's last nine
        shown = shown[:1] + shown[-9:]
    return " > ".join(calls[i][1] for i in shown) or "?"


def _safe(name: str) -> str:
    text = "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:64]
    return text or "instance"


def _advertised(host: str) -> str:
    """The address others reach `host` at: an IP (no DNS when they pull); this host's for a wildcard."""
    if host in ("*", "0.0.0.0", "", "::"):
        host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


class P2PTier(StorageBackend):
    """See the module docstring."""

    name = Tier.P2P
    holds_payloads = False

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Optional[Callable[[str], bool]] = None,
                    mac: Optional[ChunkMac] = None) -> Optional[StorageBackend]:
        return cls(config, mac=mac) if config.enable_p2p else None

    @classmethod
    def writable_by_others(cls, config: LMCacheConfig) -> Optional[str]:
        return ("every instance trusted as a peer (extra_config.pd_peers) serves chunks this one loads"
                if config.enable_p2p else None)

    def __init__(self, config: LMCacheConfig, *, mac: Optional[ChunkMac] = None,
                 clock: Callable[[], float] = time.monotonic):
        extra = config.extra_config
        url = p2p_directory_url(config)
        if url is None:  # the configuration refuses enable_p2p without one
            raise ValueError("enable_p2p needs extra_config.p2p_directory_url or remote_url")
        self.target = parse_remote_url(url)
        settings = ClientSettings.from_extra(extra)
        self.directory = Directory(async_client(self.target, settings), f"{extra.remote_key_prefix}p2p:",
                                   lease_s=extra.p2p_lease_secs)
        self.mac = mac
        self.host = config.p2p_host or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost"
        self.ports = list(config.p2p_init_ports or [])
        self.lookup_timeout_s = extra.p2p_lookup_timeout_secs
        self.pull_timeout_s = extra.p2p_pull_timeout_secs
        self.write_timeout_s = extra.remote_timeout_secs
        self.lease_s = extra.p2p_lease_secs
        self.refresh_s = extra.p2p_lease_secs / 3
        self.trust = PeerTrust(extra.pd_peers)
        self.backoff = Backoff(extra.p2p_peer_backoff_secs, clock=clock)
        self.labels = PeerLabels()
        self.adverts = Adverts()
        self.info: Optional[ServerInfo] = None
        self.server: Optional[TransferServer] = None
        self._l1: Optional[LocalCPUBackend] = None
        self.serve_disk = extra.p2p_serve_disk
        self.serde = extra.transfer_serde  # the codec of the chunks it serves (it reads every codec)
        self.promotes = extra.p2p_keep_pulled
        self._disk: Optional[LocalDiskBackend] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._spaces: set[str] = set()
        self._registered: frozenset[str] | None = None  # the spaces last written into the directory
        self._dirty = True  # the directory's copy of this rank's entries may be incomplete: rewrite them all
        self._task: Optional[asyncio.Task[None]] = None
        self._wake = asyncio.Event()  # set (on the storage loop) when there is something to list
        self._where: dict[str, tuple[ServerInfo, ...]] = {}
        self._warned: set[str] = set()
        self._unregister = metrics.register_gauges(self._gauge_values)

    # ------------------------------------------------------------------ serving side
    def attach(self, l1: LocalCPUBackend, identity: InstanceIdentity, tiers: Sequence[StorageBackend]) -> None:
        if self.info is not None:
            return
        if self.serve_disk:
            self._disk = next((t for t in tiers if isinstance(t, LocalDiskBackend)), None)
        keyed = KeyedChunks(self._chunk_for_peer, mac=self.mac, trusted=self.trust.serves,
                            on_missing=self.adverts.discard_many, send_lease_s=self.pull_timeout_s,
                            serde=self.serde)
        port = 0
        if self.ports:
            rank = identity.tp_rank
            port = self.ports[rank] if rank < len(self.ports) else self.ports[0] + rank
        self.server = TransferServer(PeerHolds(self.pull_timeout_s), host=self.host, port=port, mac=self.mac,
                                     io_timeout_s=self.pull_timeout_s, by_key=keyed.checkout)

        def removed(key: str) -> None:
            keyed.forget(key)
            if self._disk is None or not self._disk.holds(key):
                self.adverts.discard(key)  # with p2p_serve_disk, a chunk on disk stays listed

        l1.on_removed(removed)
        self._l1 = l1
        sid = f"{_safe(identity.instance)}.r{identity.tp_rank}.{secrets.token_hex(3)}"
        self.info = ServerInfo(sid, _advertised(self.host), self.server.port, identity.instance,
                               identity.tp_rank, identity.tp_size)
        logger.info("P2P: rank %d serves its L1 on %s:%d, listed in the directory %s as %s", identity.tp_rank,
                    self.info.host, self.info.port, self.target.display(), sid)

    def _chunk_for_peer(self, key: str) -> Optional[MemoryObj]:
        """A chunk to send a peer (on a transfer server's thread): from L1, else (p2p_serve_disk) read from the
        disk into memory of the L1 arena for the time of the send, bounded by the pull timeout."""
        assert self._l1 is not None
        obj = self._l1.get_sync(key)
        if obj is not None or self._disk is None or self._loop is None or not self._disk.holds(key):
            return obj
        read = asyncio.run_coroutine_threadsafe(self._disk.get(key, self._l1.try_allocate), self._loop)
        try:
            return read.result(self.pull_timeout_s)
        except Exception:  # slow or failed: the peer gets what came before it
            read.cancel()
            return None

    async def put(self, key: str, obj: MemoryObj) -> bool:
        if self.info is None or self._l1 is None or not self._l1.contains_sync(key):
            return True  # nothing to list: not attached, or L1 does not hold it (any more)
        space = key_space(key)
        if space not in self._spaces:
            self._spaces.add(space)
        self.adverts.add(key)
        self._ensure_task()
        self._wake.set()
        return True

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()  # the storage loop, where disk reads for peers run
            self._task = self._loop.create_task(self._maintain())

    async def _maintain(self) -> None:
        """Writes this rank's entries: registration, batched changes, lease renewals, rewrites."""
        assert self.info is not None
        next_refresh = 0.0
        while True:
            try:
                # A rewrite of many entries takes longer: the bound grows with them (4 calls' worth per 100k).
                bound = self.write_timeout_s * 4 * (1 + len(self.adverts) // 100_000)
                await asyncio.wait_for(self._sync(next_refresh <= time.monotonic()), bound)
                if next_refresh <= time.monotonic():
                    next_refresh = time.monotonic() + self.refresh_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the directory is down or slow: retried, everything rewritten
                self._dirty = True
                self._registered = None
                metrics.inc("p2p_directory_failures", op="advertise")
                logs.warn(logger, "p2p_advertise_failed", "P2P: writing this instance's entries into the "
                          "directory %s failed (%r); retried", self.target.display(), exc)
                await asyncio.sleep(min(1.0, self.refresh_s))
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _sync(self, renew: bool) -> None:
        assert self.info is not None
        sid = self.info.sid
        spaces = frozenset(self._spaces)
        if self._registered != spaces:
            self.info = ServerInfo(sid, self.info.host, self.info.port, self.info.instance, self.info.rank,
                                   self.info.tp, spaces)
            await self.directory.register(self._signed(self.info))
            self._registered = spaces
        elif renew:
            info_kept, chunks_kept = await self.directory.refresh(sid)
            if not info_kept or self.mac is not None:  # signed: a fresh signature, its end pushed on
                await self.directory.register(self._signed(self.info))
            if not chunks_kept and len(self.adverts):
                self._dirty = True
        if self._dirty:
            await self.directory.update(sid, self.adverts.ids(), [], replace=True)
            self._dirty = False
            return
        add, remove = self.adverts.take()
        if add or remove:
            try:
                await self.directory.update(sid, add, remove)
            except BaseException:
                self._dirty = True  # what was taken is lost: the next round rewrites everything
                raise

    # ------------------------------------------------------------------ reading side
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        if self.info is None or not keys:
            return [False] * len(keys)
        t0 = time.perf_counter()
        reason = ""
        lookup = asyncio.ensure_future(self._holders(keys))
        try:
            done, _ = await asyncio.wait((lookup,), timeout=self.lookup_timeout_s)
            if not done:
                reason = "timeout"
                logs.warn(logger, "p2p_lookup_timeout", "P2P: a directory lookup in %s took longer than its bound "
                          "(%.1f s): a miss; it was waiting in %s; %s", self.target.display(),
                          self.lookup_timeout_s, _waiting_in(lookup), pool_state(self.directory.client))
                lookup.cancel()
            else:
                found = lookup.result()
        except asyncio.CancelledError:
            lookup.cancel()
            raise
        except Exception as exc:
            reason = "error"
            logs.warn(logger, "p2p_lookup_failed", "P2P: directory lookup failed (%r): a miss", exc)
        finally:
            metrics.observe("p2p_lookup_seconds", time.perf_counter() - t0)
            metrics.inc("p2p_lookups")
        if reason:
            metrics.inc("p2p_lookup_failures", reason=reason)
            return [False] * len(keys)
        for key, holders in zip(keys, found):
            if holders:
                self._remember(key, holders)
        return [bool(h) for h in found]

    def _remember(self, key: str, holders: tuple[ServerInfo, ...]) -> None:
        if len(self._where) >= MAX_REMEMBERED:
            for old in list(self._where)[:MAX_REMEMBERED // 4]:
                del self._where[old]
        self._where[key] = holders

    async def _holders(self, keys: Sequence[str]) -> list[tuple[ServerInfo, ...]]:
        """The candidate servers holding each key (see the module docstring)."""
        assert self.info is not None
        servers = await self.directory.servers()
        by_sid = {s.sid: s for s in servers}
        spaces = {key_space(k) for k in keys}
        candidates = [s for s in servers if s.spaces & spaces and self._usable(s)]
        if not candidates:
            self._note_other_tp(servers, spaces)
            return [()] * len(keys)
        sids = await self.directory.holders([chunk_id(k) for k in keys], candidates)
        return [tuple(by_sid[s] for s in held if key_space(k) in by_sid[s].spaces) for k, held in zip(keys, sids)]

    def _signed(self, info: ServerInfo) -> ServerInfo:
        """`info` with its signature when a chunk MAC key is set (peers connect only to signed entries), valid
        for two leases (renewed every third of one)."""
        if self.mac is None:
            return info
        info = replace(info, expires=int(time.time() + 2 * self.lease_s))
        return replace(info, sig=self.mac.compute(info.signed_bytes(), b"").hex())

    def _signature_verifies(self, server: ServerInfo) -> bool:
        """Whether `server`'s entry carries a signature of a key this instance verifies with, not expired.
        Compared as bytes: whatever a writer put into `sig` (not hex, not ASCII) is a bad entry, skipped."""
        assert self.mac is not None
        try:
            tag = bytes.fromhex(server.sig)
        except ValueError:
            return False
        if time.time() > server.expires + SIGNATURE_SKEW_S:
            return False
        return self.mac.verify(replace(server, sig="").signed_bytes(), b"", tag)

    def _usable(self, server: ServerInfo) -> bool:
        """Whether to pull from `server`: never this instance, nor a peer backing off; and, since whoever can
        write the directory's Redis names the addresses, only an address entry signed with the chunk MAC key,
        or without a key an address and port extra_config.pd_peers lists: no connection we did not mean."""
        assert self.info is not None
        if server.instance == self.info.instance:
            return False  # never pull from this instance
        if self.backoff.skipped(server.sid):
            metrics.inc("p2p_skipped_peers", reason="backoff")
            return False
        if ip_literal(server.host) is None:
            return self._skip(server, "untrusted", "its directory entry names no IP address")
        if self.mac is not None and not self._signature_verifies(server):
            return self._skip(server, "unsigned", "its directory entry is not signed with this instance's chunk "
                              "MAC key (another key, or written by someone without one), or its signature expired")
        if self.mac is None and not self.trust.pulls(server.host, server.port):
            return self._skip(server, "untrusted", "without a chunk MAC key only the addresses and ports "
                              "extra_config.pd_peers lists are trusted")
        return True

    def _skip(self, server: ServerInfo, reason: str, why: str) -> bool:
        metrics.inc("p2p_skipped_peers", reason=reason)
        self._warn_once(reason, "P2P: not pulling from %s (instance %s): %s (logged once per reason)",
                        logs.peer_text(server.host), logs.peer_text(server.instance), why)
        return False

    def _note_other_tp(self, servers: list[ServerInfo], spaces: set[str]) -> None:
        """Names once an instance of the same model at another TP size: its chunks cannot be used here."""
        def model(space: str) -> tuple[str, ...]:
            parts = space.split("@")
            return tuple(parts[:2] + parts[3:])

        ours = {model(s) for s in spaces}
        for server in servers:
            if server.tp != (self.info.tp if self.info else server.tp) and any(model(s) in ours
                                                                              for s in server.spaces):
                metrics.inc("p2p_skipped_peers", reason="tp_mismatch")
                self._warn_once("tp_mismatch", "P2P: instance %s serves this model at "
                                "tensor_parallel_size=%d, this one runs %d: chunks are shared rank to rank between "
                                "equal TP sizes only, so its chunks are recomputed here",
                                logs.peer_text(server.instance), server.tp, self.info.tp if self.info else 0)

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned and len(self._warned) < 1024:
            self._warned.add(what)
            logger.warning(message, *args)

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        return (await self.get_many([key], alloc))[0]

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        out: list[Optional[MemoryObj]] = [None] * len(keys)
        if self.info is None or not keys:
            return out
        if any(k not in self._where for k in keys):
            await self.contains([k for k in keys if k not in self._where])
        plan = plan_pulls([self._where.pop(k, ()) for k in keys])
        results = await gather_owned(self._pull(server, list(keys[start:end]), alloc)
                                     for server, start, end in plan)
        for (_, start, _end), objs in zip(plan, results):
            out[start:start + len(objs)] = objs
        return out

    async def _pull(self, server: ServerInfo, keys: list[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        assert self.info is not None
        source = PeerSource(server.host, server.port, self.info.sid, op=wire.FETCH,
                            label=self.labels(server.sid, server.host, server.port))
        puller = PeerTier(source, timeout_s=self.pull_timeout_s, mac=self.mac, metric_prefix="p2p")
        puller.name = Tier.P2P  # its corrupt and no-memory counts are this tier's
        objs = await puller.get_many(keys, alloc)
        if puller.failure in BACKED_OFF:
            self.backoff.failed(server.sid)
            logs.warn(logger, f"p2p_pull_{puller.failure}", "P2P: pull from %s:%d (instance %s) failed (%s): "
                      "recomputed, and the peer skipped for %.0fs", server.host, server.port, server.instance,
                      puller.failure, self.backoff.secs)
        return objs

    # ------------------------------------------------------------------ the rest of StorageBackend
    async def clear(self) -> bool:
        if self._disk is not None:
            # L1 was emptied first, and its removal listener kept listed what the disk held then; the disk is
            # emptied beside this tier: withdraw everything (a chunk stored since is listed again by its next store).
            self.adverts.clear()
            self._dirty = True
            self._wake.set()
        return True  # without p2p_serve_disk, L1's removal listener withdrew every entry

    async def close(self) -> None:
        self._unregister()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.info is not None:
            try:
                await asyncio.wait_for(self.directory.withdraw(self.info.sid), self.write_timeout_s)
            except Exception:  # unreachable: the entries expire with the lease
                logger.info("P2P: could not withdraw this rank's directory entries; they expire with the lease")
        await self.directory.close()
        if self.server is not None:
            self.server.close()

    def _gauge_values(self) -> list[tuple[str, dict[str, str], float]]:
        return [("p2p_directory_entries", {}, float(len(self.adverts)))]

