"""The coordinator's state in Redis (`FleetStore`) and its calls to the instances (`FleetClient`).

The state lives in the Redis (one server, a Sentinel master or a Redis Cluster: any `remote_url` form) that P2P
keeps its directory in, beside it under `<prefix>coord:`, so a restarted coordinator loses nothing:

    {p}instances            SET   registered instance ids
    {p}inst:{<id>}          HASH  ip, http_port, metadata (JSON), registration_time, incarnation, p2p_advertised_url,
                                  mq_port; expires with the instance's lease (a heartbeat renews it)
    {p}incarnation:{<id>}   INT   registrations of that id so far (placements name it); kept a day
    {p}pins                 HASH  a pinned key (LMCache's EncodedObjectKey as canonical JSON) -> its pin count
    {p}quota                HASH  cache_salt -> limit in GiB
    {p}move:{<id>}          HASH  a move's state and counts; expires `move_ttl_s` after it was last written
    {p}moves                ZSET  move ids by start time (at most `max_moves` kept)

Nothing here holds KV or a token. Every Redis call is bounded by the client's socket timeout. `FleetClient`
calls an instance's management API with the fleet's bearer token, each call bounded by `timeout_s`; an
unreachable or timing-out instance is a `FleetError`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from lmcache_vllm.management.agent import KEYSPACE_FIELD
from lmcache_vllm.management.keys import KeySpace

INCARNATION_TTL_MS = 86_400_000


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


@dataclass
class Instance:
    instance_id: str
    ip: str
    http_port: int
    registration_time: float
    incarnation: int
    metadata: dict[str, str] = field(default_factory=dict)
    p2p_advertised_url: str = ""
    mq_port: int = 0

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.http_port}"

    @property
    def space(self) -> Optional[KeySpace]:
        text = self.metadata.get(KEYSPACE_FIELD)
        if text is None:
            return None
        try:
            return KeySpace.from_json(text)
        except ValueError:
            return None

    def listing(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "ip": self.ip, "http_port": self.http_port,
                "registration_time": self.registration_time, "metadata": self.metadata,
                "p2p_advertised_url": self.p2p_advertised_url, "mq_port": self.mq_port,
                "incarnation": self.incarnation}

    @classmethod
    def parse(cls, instance_id: str, fields: dict[Any, Any]) -> Optional["Instance"]:
        got = {_text(k): _text(v) for k, v in (fields or {}).items()}
        try:
            metadata = json.loads(got.get("metadata", "{}"))
            return cls(instance_id, got["ip"], int(got["http_port"]), float(got["registration_time"]),
                       int(got.get("incarnation", "0")),
                       {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {},
                       got.get("p2p_advertised_url", ""), int(got.get("mq_port", "0")))
        except (KeyError, ValueError, TypeError):
            return None


def pin_field(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class FleetStore:
    def __init__(self, client: Any, prefix: str, *, lease_s: float = 30.0, move_ttl_s: float = 600.0,
                 max_moves: int = 1000):
        self.client = client
        self.p = f"{prefix}coord:"
        self.lease_ms = max(1000, int(lease_s * 1000))
        self.move_ttl_ms = max(1000, int(move_ttl_s * 1000))
        self.max_moves = max_moves

    def _pipe(self) -> Any:
        return self.client.pipeline(transaction=False)

    # ------------------------------------------------------------------ instances
    async def register(self, instance_id: str, ip: str, http_port: int, metadata: dict[str, str],
                       p2p_advertised_url: str, mq_port: int) -> tuple[str, bool, int]:
        """(id, whether it was registered before, its incarnation)."""
        instance_id = instance_id or f"mp-{uuid.uuid4().hex}"
        key = f"{self.p}inst:{{{instance_id}}}"
        existed = bool(await self.client.exists(key))
        counter = f"{self.p}incarnation:{{{instance_id}}}"
        incarnation = int(await self.client.incr(counter))
        await self.client.pexpire(counter, INCARNATION_TTL_MS)
        pipe = self._pipe()
        pipe.delete(key)
        pipe.hset(key, mapping={"ip": ip, "http_port": str(http_port), "metadata": json.dumps(metadata),
                                "registration_time": repr(time.time()), "incarnation": str(incarnation),
                                "p2p_advertised_url": p2p_advertised_url, "mq_port": str(mq_port)})
        pipe.pexpire(key, self.lease_ms)
        pipe.sadd(f"{self.p}instances", instance_id)
        await pipe.execute()
        return instance_id, existed, incarnation

    async def heartbeat(self, instance_id: str) -> bool:
        return bool(await self.client.pexpire(f"{self.p}inst:{{{instance_id}}}", self.lease_ms))

    async def deregister(self, instance_id: str) -> None:
        pipe = self._pipe()
        pipe.delete(f"{self.p}inst:{{{instance_id}}}")
        pipe.srem(f"{self.p}instances", instance_id)
        await pipe.execute()

    async def instances(self) -> list[Instance]:
        """The live instances, by id; ids whose lease ran out leave the set."""
        ids = sorted(_text(i) for i in await self.client.smembers(f"{self.p}instances"))
        if not ids:
            return []
        pipe = self._pipe()
        for instance_id in ids:
            pipe.hgetall(f"{self.p}inst:{{{instance_id}}}")
        found: list[Instance] = []
        gone: list[str] = []
        for instance_id, fields in zip(ids, await pipe.execute()):
            inst = Instance.parse(instance_id, fields)
            if inst is None:
                gone.append(instance_id)
            else:
                found.append(inst)
        if gone:
            await self.client.srem(f"{self.p}instances", *gone)
        return found

    async def instance(self, instance_id: str) -> Optional[Instance]:
        return Instance.parse(instance_id, await self.client.hgetall(f"{self.p}inst:{{{instance_id}}}"))

    # ------------------------------------------------------------------ pins
    async def pin(self, fields: list[str], delta: int) -> list[int]:
        """Adds `delta` to each pinned key's count (a count at 0 or below is removed); the counts after."""
        if not fields:
            return []
        pipe = self._pipe()
        for f in fields:
            pipe.hincrby(f"{self.p}pins", f, delta)
        counts = [int(c) for c in await pipe.execute()]
        done = [f for f, c in zip(fields, counts) if c <= 0]
        if done:
            await self.client.hdel(f"{self.p}pins", *done)
        return [max(0, c) for c in counts]

    async def drop_pins(self, fields: list[str]) -> None:
        if fields:
            await self.client.hdel(f"{self.p}pins", *fields)

    async def pins(self) -> dict[str, int]:
        raw = await self.client.hgetall(f"{self.p}pins")
        return {_text(k): int(v) for k, v in raw.items()}

    async def pinned(self, fields: list[str]) -> list[bool]:
        if not fields:
            return []
        values = await self.client.hmget(f"{self.p}pins", fields)
        return [v is not None and int(v) > 0 for v in values]

    # ------------------------------------------------------------------ quotas
    async def set_quota(self, salt: str, limit_gb: float) -> None:
        await self.client.hset(f"{self.p}quota", salt, repr(float(limit_gb)))

    async def delete_quota(self, salt: str) -> bool:
        return bool(await self.client.hdel(f"{self.p}quota", salt))

    async def quotas(self) -> dict[str, float]:
        raw = await self.client.hgetall(f"{self.p}quota")
        out = {}
        for k, v in raw.items():
            try:
                out[_text(k)] = float(_text(v))
            except ValueError:
                continue
        return out

    # ------------------------------------------------------------------ moves
    async def save_move(self, move_id: str, state: dict[str, Any]) -> None:
        key = f"{self.p}move:{{{move_id}}}"
        pipe = self._pipe()
        pipe.hset(key, mapping={k: json.dumps(v) for k, v in state.items()})
        pipe.pexpire(key, self.move_ttl_ms)
        await pipe.execute()

    async def new_move(self, move_id: str, state: dict[str, Any]) -> None:
        await self.save_move(move_id, state)
        pipe = self._pipe()
        pipe.zadd(f"{self.p}moves", {move_id: time.time()})
        pipe.zremrangebyrank(f"{self.p}moves", 0, -self.max_moves - 1)
        await pipe.execute()

    async def move(self, move_id: str) -> Optional[dict[str, Any]]:
        raw = await self.client.hgetall(f"{self.p}move:{{{move_id}}}")
        if not raw:
            return None
        try:
            return {_text(k): json.loads(_text(v)) for k, v in raw.items()}
        except ValueError:
            return None

    async def move_ids(self) -> list[str]:
        return [_text(m) for m in await self.client.zrange(f"{self.p}moves", 0, -1)]


class FleetError(Exception):
    """An instance that could not be reached, or answered in time."""


class FleetClient:
    """Calls to the instances' management APIs (see the module docstring)."""

    def __init__(self, token: bytes, timeout_s: float = 10.0):
        self.token = token
        self.timeout_s = timeout_s
        self._session: Optional[aiohttp.ClientSession] = None

    async def call(self, inst: Instance, method: str, path: str, body: Optional[dict[str, Any]] = None,
                   timeout_s: Optional[float] = None) -> tuple[int, Any]:
        """(status, JSON answer or None); FleetError when the instance cannot be reached in time."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"Authorization": "Bearer " + self.token.decode("ascii")}
        try:
            async with self._session.request(method, inst.base_url + path, json=body, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s),
                                             allow_redirects=False) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise FleetError(f"instance {inst.instance_id} at {inst.base_url}: {type(exc).__name__}: {exc}") from None
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, None

    async def each(self, targets: list[Instance], method: str, path: str, payload: Any = None
                   ) -> dict[str, tuple[int, Any]]:
        """Every instance's (status, answer), all at once; an unreachable one is (0, its error)."""
        async def one(inst: Instance) -> tuple[int, Any]:
            try:
                return await self.call(inst, method, path, payload)
            except FleetError as exc:
                return 0, {"detail": str(exc)}
        results = await asyncio.gather(*(one(i) for i in targets))
        return {inst.instance_id: result for inst, result in zip(targets, results)}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def detail_of(got: Any) -> Any:
    return got.get("detail") if isinstance(got, dict) else got


def summary(status: int, got: Any) -> dict[str, Any]:
    """What the coordinator's answer says of one instance's: its counts, or its error."""
    if status in (200, 202) and isinstance(got, dict):
        return {k: v for k, v in got.items() if k in ("affected", "missing", "pin_count", "status", "evicted")}
    return {"error": status or "unreachable", "detail": detail_of(got)}
