"""`InstanceApi`: one instance's management API, with the paths, fields, units and codes of LMCache's MP server.

Served by the connector's scheduler side (vLLM's engine-core process) on `extra_config.management_port`; each
call goes to every tensor-parallel rank (`control.py`) and the answers are summed. docs/MANAGEMENT.md lists every
endpoint with curl examples and where we differ from LMCache; in short:

- LMCache's: `GET /`, `/healthcheck`, `/status`, `POST /cache/clear` (tier l1, or all), `DELETE /cache/objects`,
  `GET /cache/objects` (L1's keys), `POST /cache/prefetches` + `GET /cache/prefetches/{id}` (read once), the
  quota endpoints `GET /quota`, `GET|PUT|DELETE /quota/{salt}` (`_default`: the empty salt), and the older
  paths `/api/healthcheck`, `/api/status`, `/clear-cache`, `/api/clear-cache`, `/api/quota...`.
- Ours (the coordinator calls them; LMCache's server has none): `POST /cache/lookup` (the coordinator's lookup
  body, answered for this instance: where each key is), `POST|DELETE|GET /cache/pins` (the pin ledger).
Counting units as LMCache: `chunks` / `requested` count chunks, the others per-rank keys. Token ids resolve
with the ranks' own key builders. Writes need the bearer token; reads too, except from loopback (`auth.py`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import secrets
import time
from typing import Any, Optional, Sequence

from aiohttp import web

from lmcache_vllm.management.control import CacheControl, ControlUnavailable
from lmcache_vllm.management.http import ApiError, Routes, answer, body, query_int
from lmcache_vllm.management.keys import KeySpace, lmcache_tier
from lmcache_vllm.management.schemas import (
    ClearBody,
    DeleteObjectsBody,
    EncodedObjectKey,
    InstanceQuotaBody,
    LookupBody,
    PrefetchBody,
    TokensForm,
    check_keys,
    gib,
    gib_to_bytes,
    salt_from_path,
    salt_to_path,
)

MAX_PREFETCHES = 256
PREFETCH_TTL_S = 600.0
MAX_WAITING_CALLS = 16
_STATUS = {"busy": 503, "not_found": 404, "off": 409, "tenant_budget": 409, "total_budget": 409,
           "bad_call": 400, "bad_tier": 400, "unknown_op": 400}


@dataclasses.dataclass
class _Prefetch:
    jobs: list[Optional[str]]  # each rank's warm-up (None: answered)
    brought: list[Optional[list[bool]]]
    chunks: int
    started: float


class InstanceApi:
    """See the module docstring. `instance_id`: the name the coordinator and placements use."""

    def __init__(self, control: CacheControl, *, world_size: int, token: bytes, instance_id: str,
                 model_names: Sequence[str] = (), call_timeout_s: float = 30.0):
        self.control = control
        self.world_size = world_size
        self.instance_id = instance_id
        self.incarnation = 0  # the coordinator's count of this instance's registrations (placements name it)
        self.model_names = tuple(model_names)
        self.call_timeout_s = call_timeout_s
        self._space: Optional[KeySpace] = None
        self._prefetches: dict[str, _Prefetch] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmcache-mgmt")
        self._waiting = 0
        self._ids = itertools.count(1)
        self.routes = routes = Routes(token)
        for path in ("/healthcheck", "/api/healthcheck"):
            routes.add("GET", path, self.healthcheck, write=False)
        for path in ("/status", "/api/status"):
            routes.add("GET", path, self.status, write=False)
        routes.add("GET", "/", self.root, write=False)
        for path in ("/cache/clear", "/clear-cache", "/api/clear-cache"):
            routes.add("POST", path, self.clear, write=True)
        routes.add("DELETE", "/cache/objects", self.delete_objects, write=True)
        routes.add("GET", "/cache/objects", self.list_objects, write=False)
        routes.add("POST", "/cache/lookup", self.lookup, write=False)
        routes.add("POST", "/cache/prefetches", self.prefetch, write=True)
        routes.add("GET", "/cache/prefetches/{request_id}", self.prefetch_status, write=False)
        routes.add("POST", "/cache/pins", self.pin, write=True)
        routes.add("DELETE", "/cache/pins", self.unpin, write=True)
        routes.add("GET", "/cache/pins", self.list_pins, write=False)
        for base in ("/quota", "/api/quota"):
            routes.add("GET", base, self.list_quotas, write=False)
            routes.add("GET", base + "/{salt}", self.get_quota, write=False)
            routes.add("PUT", base + "/{salt}", self.set_quota, write=True)
            routes.add("DELETE", base + "/{salt}", self.delete_quota, write=True)

    @property
    def app(self) -> web.Application:
        return self.routes.app

    # ------------------------------------------------------------------ calls to the ranks
    async def _call(self, op: str, bodies: Any, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """Every rank's answer; a rank's refusal becomes the status of its reason."""
        if self._waiting >= MAX_WAITING_CALLS:
            raise ApiError(503, "busy: too many management calls waiting")
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            answers = await loop.run_in_executor(self._pool, self.control.call, op, bodies,
                                                 timeout or self.call_timeout_s)
        except ControlUnavailable as exc:
            raise ApiError(503, f"the cache is not reachable: {exc}") from None
        finally:
            self._waiting -= 1
        for reply in answers:
            if "error" in reply:
                raise ApiError(_STATUS.get(str(reply["error"]), 500), str(reply.get("detail", reply["error"])))
        return answers

    async def space(self) -> KeySpace:
        if self._space is None:
            info = await self._call("info", {}, timeout=5.0)
            self._space = KeySpace.from_json(str(info[0]["space"])).with_names(self.model_names)
        return self._space

    async def _tokens_space(self, form: TokensForm) -> KeySpace:
        space = await self.space()
        if not space.accepts(form.model_name, form.world_size):
            raise ApiError(409, f"this instance serves {space.display_name!r} at world_size {space.world_size}, "
                                f"not {form.model_name!r} at {form.world_size}")
        return space

    def _by_rank(self, space: KeySpace, keys: Sequence[EncodedObjectKey]) -> list[dict[str, Any]]:
        digests: list[list[str]] = [[] for _ in range(self.world_size)]
        for encoded in keys:
            key = space.key_of(encoded)
            digests[key.rank].append(key.digest.hex())
        return [{"digests": d} for d in digests]

    # ------------------------------------------------------------------ health
    async def root(self, request: web.Request) -> web.Response:
        return answer({"status": "ok", "service": "lmcache-vllm management API"})

    async def healthcheck(self, request: web.Request) -> web.Response:
        try:
            await self._call("info", {}, timeout=5.0)
        except ApiError as exc:
            return answer({"status": "unhealthy", "reason": str(exc.detail)}, 503)
        return answer({"status": "healthy"})

    async def status(self, request: web.Request) -> web.Response:
        try:
            infos = await self._call("info", {}, timeout=5.0)
            space = await self.space()
        except ApiError as exc:
            return answer({"error": str(exc.detail), "is_healthy": False}, 503)
        lower: dict[str, dict[str, Any]] = {}
        for info in infos:
            for tier in info["lower"]:
                entry = lower.setdefault(tier["tier"], {"tier": tier["tier"], "shared": tier["shared"]})
                for name in ("used_bytes", "capacity_bytes", "resident_chunks"):
                    if name in tier:
                        entry[name] = entry.get(name, 0) + tier[name]
        return answer({
            "is_healthy": True, "engine_type": "lmcache-vllm", "instance_id": self.instance_id,
            "model_names": list(space.model_names), "world_size": space.world_size,
            "chunk_size": space.chunk_size, "hash_algorithm": space.hash_algorithm,
            "active_prefetch_jobs": len(self._prefetches),
            "storage_manager": {
                "is_healthy": True,
                "l1": {name: sum(i["l1"][name] for i in infos)
                       for name in ("used_bytes", "capacity_bytes", "chunks", "held_chunks")},
                "lower": list(lower.values())},
            "pins": {"enabled": all(i["pins_enabled"] for i in infos), "count": sum(i["pins"] for i in infos),
                     "bytes": sum(i["pinned_bytes"] for i in infos)},
            "ranks": [{"rank": i["rank"], "l1": i["l1"]} for i in infos]})

    # ------------------------------------------------------------------ delete, clear
    async def clear(self, request: web.Request) -> web.Response:
        form = await body(request, ClearBody, optional=True)
        if form.tier == "l2":
            raise ApiError(400, "a clear empties tier l1, or all tiers (LMCache's server: l1 only)")
        answers = await self._call("clear", {"tier": form.tier}, timeout=60.0)
        if not all(a["ok"] for a in answers):
            raise ApiError(502, "a lower tier did not finish clearing")
        return answer({"status": "ok", "cleared": {"tier": form.tier}})

    async def delete_objects(self, request: web.Request) -> web.Response:
        form = await body(request, DeleteObjectsBody)
        check_keys(form.keys)
        if form.adapter is not None:
            raise ApiError(404, f"unknown adapter {form.adapter!r}: lmcache-vllm deletes from every lower tier")
        bodies = [dict(b, tier=form.tier, force=form.force) for b in self._by_rank(await self.space(), form.keys)]
        answers = await self._call("delete", bodies, timeout=60.0)
        return answer({"deleted": sum(a["deleted"] for a in answers), "skipped": sum(a["skipped"] for a in answers),
                       "ok": True})

    async def list_objects(self, request: web.Request) -> web.Response:
        tier = request.query.get("tier", "l1")
        if tier != "l1":
            raise ApiError(501, "only tier=l1 is listed (LMCache lists l2)")
        size = query_int(request, "page_size", 500, 1, 5000)
        offset = query_int(request, "page_token", 0, 0, 1 << 62)
        space = await self.space()
        answers = await self._call("keys", {"offset": 0, "limit": offset + size})
        entries: list[dict[str, Any]] = []
        for rank, reply in enumerate(answers):
            template = space.builder(rank).template
            for digest in reply["digests"]:
                key = dataclasses.replace(template, digest=bytes.fromhex(digest))
                entries.append({"key": space.encode(key), "size_bytes": None})
        page = entries[offset:offset + size]
        total = sum(a["total"] for a in answers)
        following = offset + size if offset + size < total else None
        return answer({"adapter": "local_cpu", "shared": False, "entries": page,
                       "next_page_token": None if following is None else str(following)})

    # ------------------------------------------------------------------ lookup
    async def lookup(self, request: web.Request) -> web.Response:
        form = (await body(request, LookupBody)).checked()
        return answer(await self.placements(form))

    async def placements(self, form: LookupBody) -> dict[str, Any]:
        """LMCache's lookup answer for this instance: each key with where it is here."""
        space = await self.space()
        if form.keys is not None:
            keys = [space.key_of(k) for k in form.keys]
            tokens: list[list[int]] = [[] for _ in keys]
            names = [(k.model_name, k.cache_salt) for k in form.keys]
            chunks = len(keys)
        else:
            tokens_form = TokensForm(model_name=form.model_name or "", world_size=form.world_size,
                                     token_ids=form.token_ids or [], cache_salt=form.cache_salt)
            await self._tokens_space(tokens_form)
            keys = space.resolve(tokens_form.token_ids, form.cache_salt)
            cs = space.chunk_size
            tokens = [tokens_form.token_ids[(i // space.world_size) * cs:(i // space.world_size + 1) * cs]
                      for i in range(len(keys))]
            names = [(tokens_form.model_name, form.cache_salt)] * len(keys)
            chunks = len(keys) // space.world_size
        bodies: list[dict[str, Any]] = [{"digests": []} for _ in range(self.world_size)]
        for key in keys:
            bodies[key.rank]["digests"].append(key.digest.hex())
        answers = await self._call("where", bodies)
        cursor = [0] * self.world_size
        results = []
        for key, toks, (name, salt) in zip(keys, tokens, names):
            reply = answers[key.rank]
            tiers = reply["tiers"][cursor[key.rank]]
            cursor[key.rank] += 1
            placements = [{"instance_id": self.instance_id, "incarnation": self.incarnation,
                           "tier": lmcache_tier(t)[0], "backend": t, "size_bytes": reply["chunk_bytes"],
                           "shared": lmcache_tier(t)[1]} for t in tiers]
            results.append({"key": space.encode(key, name, salt), "placements": placements, "token_ids": toks})
        return {"chunks": chunks, "results": results}

    # ------------------------------------------------------------------ prefetch (warm-up)
    async def prefetch(self, request: web.Request) -> web.Response:
        form = (await body(request, PrefetchBody)).checked()
        if form.source_tier != "l2" or form.target_tier != "l1":
            raise ApiError(400, "a prefetch goes from l2 (every lower tier, other instances' L1 through P2P "
                                "included) to l1")
        await self._tokens_space(form)
        self._expire_prefetches()
        if len(self._prefetches) >= MAX_PREFETCHES:
            raise ApiError(503, f"{MAX_PREFETCHES} prefetches are waiting to be read")
        answers = await self._call("warm", {"token_ids": form.token_ids, "cache_salt": form.cache_salt})
        chunks = answers[0]["keys"]
        if chunks == 0:
            return answer({"chunks": 0, "status": "noop"})
        request_id = f"pf-{next(self._ids)}-{secrets.token_hex(4)}"
        self._prefetches[request_id] = _Prefetch([a["job"] for a in answers], [None] * len(answers), chunks,
                                                 time.monotonic())
        return answer({"request_id": request_id, "chunks": chunks, "status": "submitted"}, 202)

    async def prefetch_status(self, request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        job = self._prefetches.get(request_id)
        if job is None:
            raise ApiError(404, f"no prefetch {request_id!r} (a completed one is answered once)")
        # Each rank answers its own job (a finished one once); a rank already answered is sent no job.
        answers = await self._call("warm_status", [{"job": j or ""} for j in job.jobs])
        for rank, reply in enumerate(answers):
            if reply["status"] == "completed":
                job.brought[rank] = list(reply["brought"])
                job.jobs[rank] = None
        if any(j is not None for j in job.jobs):
            return answer({"request_id": request_id, "status": "pending"})
        del self._prefetches[request_id]
        flags = [bool(b[c]) for c in range(job.chunks) for b in job.brought if b is not None]
        return answer({"request_id": request_id, "status": "completed", "found_keys": sum(flags),
                       "total_keys": len(flags), "missing_key_indices": [i for i, f in enumerate(flags) if not f]})

    def _expire_prefetches(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, job in self._prefetches.items() if now - job.started > PREFETCH_TTL_S]:
            del self._prefetches[request_id]

    # ------------------------------------------------------------------ pins
    async def pin(self, request: web.Request) -> web.Response:
        form = (await body(request, TokensForm)).checked()
        space = await self._tokens_space(form)
        answers = await self._call("pin", {"token_ids": form.token_ids, "cache_salt": form.cache_salt})
        return answer({"requested": len(form.token_ids) // space.chunk_size,
                       "affected": sum(a["pinned"] for a in answers), "missing": sum(a["missing"] for a in answers),
                       "pin_count": min(a["count"] for a in answers), "status": "pinned"})

    async def unpin(self, request: web.Request) -> web.Response:
        form = (await body(request, TokensForm)).checked()
        space = await self._tokens_space(form)
        answers = await self._call("unpin", {"token_ids": form.token_ids, "cache_salt": form.cache_salt})
        counts = [a["count"] for a in answers if a["count"] is not None]
        return answer({"requested": len(form.token_ids) // space.chunk_size,
                       "affected": sum(a["unpinned"] for a in answers),
                       "pin_count": min(counts) if counts else 0, "status": "unpinned"})

    async def list_pins(self, request: web.Request) -> web.Response:
        offset = query_int(request, "offset", 0, 0, 1 << 62)
        limit = query_int(request, "limit", 1000, 1, 10_000)
        salt = request.query.get("cache_salt")
        space = await self.space()
        answers = await self._call("pins", {} if salt is None else {"cache_salt": salt_from_path(salt)})
        pins: list[dict[str, Any]] = []
        for rank, reply in enumerate(answers):
            template = space.builder(rank).template
            for entry in reply["pins"]:
                for digest in entry["digests"]:
                    key = dataclasses.replace(template, digest=bytes.fromhex(digest))
                    pins.append({"key": space.encode(key, salt=entry["cache_salt"]),
                                 "pin_count": max(1, entry["count"]), "hint": entry["hint"]})
        return answer({"total": len(pins), "pins": pins[offset:offset + limit]})

    # ------------------------------------------------------------------ quotas (L1, per cache_salt)
    async def set_quota(self, request: web.Request) -> web.Response:
        salt = salt_from_path(request.match_info["salt"])
        form = await body(request, InstanceQuotaBody)
        limit = gib_to_bytes(form.limit_gb)
        await self._call("quota_set", {"cache_salt": salt, "limit_bytes": -(-limit // self.world_size)})
        return answer({"cache_salt": salt_to_path(salt), "limit_gb": form.limit_gb, "status": "ok"})

    async def get_quota(self, request: web.Request) -> web.Response:
        salt = salt_from_path(request.match_info["salt"])
        answers = await self._call("quotas", {})
        limits = [a["limits"].get(salt) for a in answers]
        usage = sum(a["usage"].get(salt, 0) for a in answers)
        exists = all(v is not None for v in limits)
        return answer({"cache_salt": salt_to_path(salt), "limit_gb": gib(sum(v or 0 for v in limits)),
                       "current_usage_gb": gib(usage), "exists": exists})

    async def delete_quota(self, request: web.Request) -> web.Response:
        salt = salt_from_path(request.match_info["salt"])
        answers = await self._call("quota_delete", {"cache_salt": salt})
        removed = any(a["removed"] for a in answers)
        return answer({"cache_salt": salt_to_path(salt), "status": "removed" if removed else "not_found"})

    async def list_quotas(self, request: web.Request) -> web.Response:
        answers = await self._call("quotas", {})
        users: dict[str, dict[str, float]] = {}
        for salt in sorted({s for a in answers for s in a["limits"]}):
            users[salt_to_path(salt)] = {"limit_gb": gib(sum(a["limits"].get(salt, 0) for a in answers)),
                                         "current_usage_gb": gib(sum(a["usage"].get(salt, 0) for a in answers))}
        return answer({"users": users})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.control.close()
