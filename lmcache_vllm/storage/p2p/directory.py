"""`Directory`: the P2P directory on Redis — which serving rank of which instance holds which chunk.

Keys and addresses only, never KV. One layout for one server, a Sentinel master or a Redis Cluster
(`prefix` is `extra_config.remote_key_prefix` + "p2p:"):

    {prefix}servers          SET   the id of every registered server (one per TP rank of each instance)
    {prefix}{<sid>}:info     HASH  host, port, instance, rank, tp, spaces: where server <sid> serves and the key
                                   spaces (a key without its digest: model, TP size and rank, format) it holds;
                                   with a chunk MAC key also sig and expires (Unix time): a signature that
                                   ends, renewed with the lease, so an entry copied from a dead server dies
    {prefix}{<sid>}:chunks   SET   8-byte ids (xxh3_64 of the key string) of the chunks server <sid> holds

A server's two keys share a hash tag, so a cluster keeps them on one node; the servers' sets spread over the
nodes. Both carry the server's lease (`lease_s`): `refresh` renews it for every entry at once (two EXPIREs),
so a dead instance's entries expire with its lease, whatever their number. An 8-byte id costs the set about
one pointer and a small string per chunk (docs/P2P.md gives `MEMORY USAGE` per chunk); two keys with the same
id would only make a wrong hint, which the pull's check of each chunk's key turns into a miss.

A lookup reads the servers (cached for `servers_ttl_s`) and asks each candidate's chunk set about every id in
one SMISMEMBER, all in one pipeline (redis-py's cluster pipeline sends each node its share). Whoever can write
that Redis can write the directory, so what a lookup reads of it is bounded: at most `MAX_SERVERS` ids of the
set of servers (SSCAN), and of each info hash only its known fields, read by a script that answers nothing
when they hold more than `MAX_INFO_BYTES` (a server whose info is gone is dropped from the set; one too large
or malformed is skipped). Every call is bounded by the caller's timeout; redis-py's errors reach the caller
(the tier counts them as misses).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import xxhash

SPACE_SEP = "\n"
BATCH = 1000  # ids per SADD / SREM / SMISMEMBER
MAX_SERVERS = 1024  # server ids a lookup reads from the set of servers
MAX_INFO_BYTES = 1 << 16  # bytes of one server's info fields a lookup reads
INFO_FIELDS = ("host", "port", "instance", "rank", "tp", "spaces", "sig", "expires")
# The known fields of an info hash, or nil when they hold more than ARGV[#ARGV] bytes (atomic: no value
# can grow between the check and the read).
_READ_INFO = """
local total = 0
for i = 1, #ARGV - 1 do total = total + redis.call('HSTRLEN', KEYS[1], ARGV[i]) end
if total > tonumber(ARGV[#ARGV]) then return false end
return redis.call('HMGET', KEYS[1], unpack(ARGV, 1, #ARGV - 1))
"""


def chunk_id(key: str) -> bytes:
    """A chunk's id in the directory: 8 bytes of the key string's xxh3_64."""
    return xxhash.xxh3_64_digest(key.encode("utf-8"))


def key_space(key: str) -> str:
    """The key without its digest: which model, TP size and rank, PP stage, dtype and format it belongs to."""
    return key.rsplit("@", 1)[0]


def servers_key(prefix: str) -> str:
    return f"{prefix}servers"


def info_key(prefix: str, sid: str) -> str:
    return f"{prefix}{{{sid}}}:info"


def chunks_key(prefix: str, sid: str) -> str:
    return f"{prefix}{{{sid}}}:chunks"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


@dataclass(frozen=True)
class ServerInfo:
    """One registered server: a TP rank's transfer server of one instance."""

    sid: str
    host: str
    port: int
    instance: str
    rank: int
    tp: int
    spaces: frozenset[str] = frozenset()
    sig: str = ""  # with a chunk MAC key: hex of the MAC over `signed_bytes` (the tier signs and checks it)
    expires: int = 0  # with a chunk MAC key: the signature's end (Unix time)

    def mapping(self) -> dict[str, str]:
        fields = {"host": self.host, "port": str(self.port), "instance": self.instance, "rank": str(self.rank),
                  "tp": str(self.tp), "spaces": SPACE_SEP.join(sorted(self.spaces))}
        return {**fields, "sig": self.sig, "expires": str(self.expires)} if self.sig else fields

    def signed_bytes(self) -> bytes:
        """What a signature covers: every field a puller acts on and the signature's end, each
        length-prefixed (no separator to forge)."""
        out = bytearray(b"lmcache-vllm p2p server v2")
        for field in (self.sid, self.host, str(self.port), self.instance, str(self.rank), str(self.tp),
                      SPACE_SEP.join(sorted(self.spaces)), str(self.expires)):
            data = field.encode("utf-8")
            out += len(data).to_bytes(4, "little") + data
        return bytes(out)

    @classmethod
    def parse(cls, sid: str, fields: dict[Any, Any]) -> Optional[ServerInfo]:
        """The info of `sid` as stored, or None when it is gone or malformed (a hint: never trusted further)."""
        got = {_text(k): _text(v) for k, v in (fields or {}).items() if v is not None}
        try:
            port, rank, tp = int(got["port"]), int(got["rank"]), int(got["tp"])
            expires = int(got.get("expires", "0"))
        except (KeyError, ValueError):
            return None
        if not got.get("host") or not 0 < port < 65536 or not 0 <= rank < tp or not 0 <= expires < 1 << 40:
            return None
        spaces = frozenset(s for s in got.get("spaces", "").split(SPACE_SEP) if s)
        return cls(sid, got["host"], port, got.get("instance", ""), rank, tp, spaces, got.get("sig", ""), expires)


class Directory:
    """See the module docstring. `client`: a redis-py asyncio client (`redis/client.py`'s `async_client`)."""

    def __init__(self, client: Any, prefix: str, *, lease_s: float, servers_ttl_s: float = 1.0):
        self.client = client
        self.prefix = prefix
        self.lease_ms = max(1000, int(lease_s * 1000))
        self.servers_ttl_s = servers_ttl_s
        self._servers: list[ServerInfo] = []
        self._servers_at = -1e9

    def _pipe(self) -> Any:
        return self.client.pipeline(transaction=False)

    # ------------------------------------------------------------------ a server's own entries
    async def register(self, info: ServerInfo) -> None:
        """Writes `info` (and the server into the set of servers) under a fresh lease."""
        pipe = self._pipe()
        pipe.hset(info_key(self.prefix, info.sid), mapping=info.mapping())
        pipe.pexpire(info_key(self.prefix, info.sid), self.lease_ms)
        pipe.sadd(servers_key(self.prefix), info.sid)
        await pipe.execute()

    async def refresh(self, sid: str) -> tuple[bool, bool]:
        """Renews the lease of every entry of `sid`: (its info still existed, its chunk set still existed).
        A False means the directory lost them (lease run out while it was unreachable, a restart): the
        caller registers and advertises again."""
        pipe = self._pipe()
        pipe.pexpire(info_key(self.prefix, sid), self.lease_ms)
        pipe.pexpire(chunks_key(self.prefix, sid), self.lease_ms)
        pipe.sadd(servers_key(self.prefix), sid)
        info, chunks, _ = await pipe.execute()
        return bool(info), bool(chunks)

    async def update(self, sid: str, add: Sequence[bytes], remove: Sequence[bytes], *,
                     replace: bool = False) -> None:
        """Adds and withdraws chunk ids of `sid` in batches (`replace`: the set becomes `add` exactly)."""
        key = chunks_key(self.prefix, sid)
        pipe = self._pipe()
        if replace:
            pipe.delete(key)
        for i in range(0, len(remove), BATCH):
            pipe.srem(key, *remove[i:i + BATCH])
        for i in range(0, len(add), BATCH):
            pipe.sadd(key, *add[i:i + BATCH])
        if add:
            pipe.pexpire(key, self.lease_ms)
        await pipe.execute()

    async def withdraw(self, sid: str) -> None:
        """Removes every entry of `sid` (a clean shutdown; a dead server's expire with its lease)."""
        pipe = self._pipe()
        pipe.delete(chunks_key(self.prefix, sid))
        pipe.delete(info_key(self.prefix, sid))
        pipe.srem(servers_key(self.prefix), sid)
        await pipe.execute()

    # ------------------------------------------------------------------ lookups
    async def server_ids(self) -> list[str]:
        """At most `MAX_SERVERS` ids of the set of servers (SSCAN: never the whole of a set someone filled)."""
        sids: set[str] = set()
        cursor = 0
        while True:
            cursor, batch = await self.client.sscan(servers_key(self.prefix), cursor, count=256)
            sids.update(_text(s) for s in batch)
            if not cursor or len(sids) >= MAX_SERVERS:
                break
        return sorted(sids)[:MAX_SERVERS]

    async def servers(self, *, fresh: bool = False) -> list[ServerInfo]:
        """Every live server (cached for `servers_ttl_s`; see the module docstring for the bounds); ids whose
        info expired are dropped from the set, infos too large or malformed skipped."""
        if not fresh and time.monotonic() - self._servers_at < self.servers_ttl_s:
            return self._servers
        sids = await self.server_ids()
        found: list[ServerInfo] = []
        if sids:
            pipe = self._pipe()
            for sid in sids:
                pipe.eval(_READ_INFO, 1, info_key(self.prefix, sid), *INFO_FIELDS, MAX_INFO_BYTES)
            infos = await pipe.execute()
            gone = []
            for sid, values in zip(sids, infos):
                if values is None:  # too large: skipped (not ours to delete)
                    continue
                fields = dict(zip(INFO_FIELDS, values)) if isinstance(values, list) else {}
                info = ServerInfo.parse(sid, fields)
                if info is None and all(v is None for v in fields.values()):
                    gone.append(sid)
                elif info is not None:
                    found.append(info)
            if gone:
                await self.client.srem(servers_key(self.prefix), *gone)
        self._servers, self._servers_at = found, time.monotonic()
        return found

    async def holders(self, ids: Sequence[bytes], candidates: Iterable[ServerInfo]) -> list[list[str]]:
        """For each id, the ids of the `candidates` whose chunk set has it (one pipeline)."""
        servers = list(candidates)
        out: list[list[str]] = [[] for _ in ids]
        if not ids or not servers:
            return out
        pipe = self._pipe()
        for server in servers:
            for i in range(0, len(ids), BATCH):
                pipe.smismember(chunks_key(self.prefix, server.sid), list(ids[i:i + BATCH]))
        replies = await pipe.execute()
        per_server = -(-len(ids) // BATCH)
        for s, server in enumerate(servers):
            flags = [f for reply in replies[s * per_server:(s + 1) * per_server] for f in reply]
            for i, flag in enumerate(flags[:len(ids)]):
                if flag:
                    out[i].append(server.sid)
        return out

    async def counts(self, sids: Sequence[str]) -> list[tuple[int, int]]:
        """(entries, bytes Redis uses for them: MEMORY USAGE of the chunk set) of each server."""
        if not sids:
            return []
        pipe = self._pipe()
        for sid in sids:
            pipe.scard(chunks_key(self.prefix, sid))
            pipe.memory_usage(chunks_key(self.prefix, sid), samples=0)
        replies = await pipe.execute()
        return [(int(replies[2 * i] or 0), int(replies[2 * i + 1] or 0)) for i in range(len(sids))]

    async def close(self) -> None:
        await self.client.aclose()
        pool = getattr(self.client, "connection_pool", None)
        if pool is not None:
            await pool.disconnect()

