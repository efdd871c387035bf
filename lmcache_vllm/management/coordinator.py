"""`Coordinator`: the fleet coordinator, with the paths, fields, units and codes of LMCache's MP coordinator.

One process per fleet (`lmcache-vllm coordinator`, `cli.py`); its state is in Redis (`fleet.FleetStore`), so a
restart loses nothing. Instances register themselves (`agent.py`) with their key space, so the coordinator turns
token ids into the keys their requests load with the connector's own key builder (`keys.KeySpace`), and asks the
instances (`fleet.FleetClient`) where those keys are and what to do with them:

- membership: `POST|GET /instances`, `DELETE /instances/{id}` (204), `PUT /instances/{id}/heartbeat` (404: register
  again), `GET /healthz`, `GET /instances/usage`, `GET /instances/{id}/usage`;
- the directory: `POST /directory/lookup` (keys form or tokens form; each key with the instances and tiers holding
  it, asked of every instance serving the model), `GET /directory/keys` (their L1 keys), `GET /directory/stats`;
- the cache: `POST|DELETE|GET /cache/pins` (refcounted in Redis per key and salt, and made on every instance
  serving the model: a pin an instance's budget refuses is undone everywhere, 409), `POST /cache/delete`,
  `POST /cache/prefetches` + `GET /cache/prefetches/{instance}/{id}` (relayed), `POST /cache/moves` +
  `GET /cache/moves/{id}` (`moves.py`);
- quotas per cache_salt (`quotas.py`): `GET|PUT /quota/config`, `GET /quota`, `GET|PUT|DELETE /quota/{salt}`:
  kept in Redis and set on every instance (each enforces it on its own L1; a registering instance gets them all).
Writes need the bearer token; reads too, except from loopback. docs/MANAGEMENT.md has the details and where we
differ from LMCache.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Optional

from aiohttp import web

from lmcache_vllm.management.fleet import (
    FleetClient,
    FleetError,
    FleetStore,
    Instance,
    detail_of,
    pin_field,
    summary,
)
from lmcache_vllm.management.http import ApiError, Routes, answer, body, query_int
from lmcache_vllm.management.keys import KeySpace, lmcache_tier
from lmcache_vllm.management.moves import Mover
from lmcache_vllm.management.quotas import QuotaRoutes
from lmcache_vllm.management.schemas import (
    CacheDeleteBody,
    EncodedObjectKey,
    InstanceTokens,
    LookupBody,
    MoveBody,
    RegisterBody,
    TokensForm,
    valid_id,
)

logger = logging.getLogger(__name__)



class Coordinator(QuotaRoutes):
    def __init__(self, store: FleetStore, fleet: FleetClient, token: bytes, *, move_poll_s: float = 0.5,
                 move_timeout_s: float = 600.0):
        self.store = store
        self.fleet = fleet
        self.mover = Mover(store, fleet, poll_s=move_poll_s, timeout_s=move_timeout_s)
        self.routes = r = Routes(token)
        r.add("GET", "/healthz", self.healthz, write=False)
        r.add("POST", "/instances", self.register, write=True)
        r.add("GET", "/instances", self.list_instances, write=False)
        r.add("GET", "/instances/usage", self.usage, write=False)
        r.add("GET", "/instances/{instance_id}/usage", self.usage, write=False)
        r.add("DELETE", "/instances/{instance_id}", self.deregister, write=True)
        r.add("PUT", "/instances/{instance_id}/heartbeat", self.heartbeat, write=True)
        r.add("POST", "/directory/lookup", self.lookup, write=False)
        r.add("GET", "/directory/keys", self.directory_keys, write=False)
        r.add("GET", "/directory/stats", self.directory_stats, write=False)
        r.add("POST", "/cache/pins", self.pin, write=True)
        r.add("DELETE", "/cache/pins", self.unpin, write=True)
        r.add("GET", "/cache/pins", self.list_pins, write=False)
        r.add("POST", "/cache/delete", self.delete, write=True)
        r.add("POST", "/cache/prefetches", self.prefetch, write=True)
        r.add("GET", "/cache/prefetches/{instance_id}/{request_id}", self.prefetch_status, write=False)
        r.add("POST", "/cache/moves", self.move, write=True)
        r.add("GET", "/cache/moves/{move_id}", self.move_status, write=False)
        self.add_quota_routes(r)
        r.app.on_startup.append(self._fail_orphaned_moves)
        r.app.on_cleanup.append(self._close)

    @property
    def app(self) -> web.Application:
        return self.routes.app

    # ------------------------------------------------------------------ helpers
    async def _instance(self, instance_id: str) -> Instance:
        inst = await self.store.instance(instance_id) if valid_id(instance_id) else None
        if inst is None:
            raise ApiError(404, f"unknown instance {instance_id}")
        return inst

    async def _serving(self, model_name: str, world_size: int) -> list[tuple[Instance, KeySpace]]:
        found = []
        for inst in await self.store.instances():
            space = inst.space
            if space is not None and space.accepts(model_name, world_size):
                found.append((inst, space))
        return found

    async def _resolve(self, form: TokensForm, serving: Optional[list[tuple[Instance, KeySpace]]] = None
                       ) -> tuple[KeySpace, list[Any], list[tuple[Instance, KeySpace]]]:
        serving = serving if serving is not None else await self._serving(form.model_name, form.world_size)
        if not serving:
            raise ApiError(404, f"no registered instance serves {form.model_name!r} at world_size {form.world_size}")
        space = serving[0][1]
        keys = await asyncio.get_running_loop().run_in_executor(None, space.resolve, form.token_ids, form.cache_salt)
        return space, keys, [(i, s) for i, s in serving if s.same_keys(space)]

    async def _relay(self, inst: Instance, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        try:
            return await self.fleet.call(inst, method, path, payload)
        except FleetError as exc:
            raise ApiError(502, str(exc)) from None

    # ------------------------------------------------------------------ membership
    async def healthz(self, request: web.Request) -> web.Response:
        try:
            await self.store.client.ping()
        except Exception as exc:
            return answer({"status": "unhealthy", "reason": f"Redis: {type(exc).__name__}"}, 503)
        return answer({"status": "healthy"})

    async def register(self, request: web.Request) -> web.Response:
        form = (await body(request, RegisterBody)).checked()
        instance_id, existed, incarnation = await self.store.register(
            form.instance_id, form.ip.strip(), form.http_port, dict(form.metadata), form.p2p_advertised_url,
            form.mq_port)
        inst = await self.store.instance(instance_id)
        quotas = await self.store.quotas()
        if inst is not None and quotas:  # a (re)started instance enforces the fleet's quotas from now on
            asyncio.get_running_loop().create_task(self._push_quotas(inst, quotas))
        return answer({"instance_id": instance_id, "re_registered": existed, "incarnation": incarnation})

    async def list_instances(self, request: web.Request) -> web.Response:
        return answer({"instances": [i.listing() for i in await self.store.instances()]})

    async def deregister(self, request: web.Request) -> web.Response:
        instance_id = request.match_info["instance_id"]
        if valid_id(instance_id):
            await self.store.deregister(instance_id)
        return web.Response(status=204)

    async def heartbeat(self, request: web.Request) -> web.Response:
        instance_id = request.match_info["instance_id"]
        if not valid_id(instance_id) or not await self.store.heartbeat(instance_id):
            message = f"unknown instance {instance_id}; re-register"
            return answer({"detail": message, "error": message}, 404)
        return answer({"instance_id": instance_id})

    async def usage(self, request: web.Request) -> web.Response:
        wanted = request.match_info.get("instance_id")
        live = [await self._instance(wanted)] if wanted is not None else await self.store.instances()
        statuses = await self.fleet.each(live, "GET", "/status")
        entries, shared = [], {}
        for inst in live:
            status, got = statuses[inst.instance_id]
            modules = []
            if status == 200 and isinstance(got, dict):
                manager = got.get("storage_manager", {})
                l1 = manager.get("l1", {})
                modules.append(_module("l1", "local_cpu", False, l1.get("used_bytes", 0), l1.get("capacity_bytes", 0)))
                for tier in manager.get("lower", []):
                    name, is_shared = lmcache_tier(str(tier.get("tier")))
                    module = _module(name, tier.get("tier"), is_shared, tier.get("used_bytes", 0),
                                     tier.get("capacity_bytes", 0))
                    if is_shared:
                        shared[module["backend"]] = module
                    else:
                        modules.append(module)
            entries.append({"instance_id": inst.instance_id, "registered": True,
                            "declared_capacity": any(m["capacity_bytes"] for m in modules),
                            "modules": sorted(modules, key=lambda m: (m["tier"], m["backend"]))})
        if wanted is not None:
            return answer(entries[0])
        return answer({"instances": entries, "shared_modules": list(shared.values())})

    # ------------------------------------------------------------------ the directory
    async def lookup(self, request: web.Request) -> web.Response:
        form = (await body(request, LookupBody)).checked()
        if form.keys is not None:
            encoded = [k.model_dump() for k in form.keys]
            tokens: list[list[int]] = [[] for _ in encoded]
            chunks = len(encoded)
            targets = [i for i in await self.store.instances() if i.space is not None]
        else:
            tokens_form = TokensForm(model_name=form.model_name or "", world_size=form.world_size,
                                     token_ids=form.token_ids or [], cache_salt=form.cache_salt)
            space, keys, serving = await self._resolve(tokens_form)
            encoded = [space.encode(k, tokens_form.model_name, form.cache_salt) for k in keys]
            cs, ws = space.chunk_size, space.world_size
            tokens = [tokens_form.token_ids[(i // ws) * cs:(i // ws + 1) * cs] for i in range(len(keys))]
            chunks = len(keys) // ws
            targets = [inst for inst, _ in serving]
        results = [{"key": key, "placements": [], "token_ids": toks} for key, toks in zip(encoded, tokens)]
        unreachable = []
        for inst in targets:
            inst_space = inst.space
            if inst_space is None:
                continue
            mine = [i for i, k in enumerate(encoded) if _keyed_by(inst_space, k)]
            if not mine:
                continue
            status, got = (await self.fleet.each([inst], "POST", "/cache/lookup",
                                            {"keys": [encoded[i] for i in mine]}))[inst.instance_id]
            if status != 200 or not isinstance(got, dict) or len(got.get("results", [])) != len(mine):
                unreachable.append(inst.instance_id)
                continue
            for i, result in zip(mine, got["results"]):
                results[i]["placements"] += result.get("placements", [])
        reply: dict[str, Any] = {"chunks": chunks, "results": results}
        if unreachable:
            reply["unreachable"] = unreachable
        return answer(reply)

    async def directory_keys(self, request: web.Request) -> web.Response:
        tier = request.query.get("tier", "all")
        if tier not in ("all", "l1", "l2"):
            raise ApiError(422, [{"loc": ["query", "tier"], "msg": "expected all, l1 or l2", "type": "enum"}])
        offset = query_int(request, "offset", 0, 0, 100_000)
        limit = query_int(request, "limit", 1000, 1, 10_000)
        wanted, backend = request.query.get("instance_id", ""), request.query.get("backend", "")
        live = [i for i in await self.store.instances() if not wanted or i.instance_id == wanted]
        if tier == "l2" or backend not in ("", "local_cpu"):
            live = []  # lmcache-vllm lists L1 only
        pages = await self.fleet.each(live, "GET", f"/cache/objects?tier=l1&page_size={min(5000, offset + limit)}")
        merged: dict[str, dict[str, Any]] = {}
        for inst in live:
            status, got = pages[inst.instance_id]
            space = inst.space
            if status != 200 or not isinstance(got, dict) or space is None:
                continue
            for entry in got.get("entries", []):
                field = pin_field(entry["key"])
                row = merged.setdefault(field, {"key": entry["key"], "placements": [], "num_tokens": space.chunk_size})
                row["placements"].append({"instance_id": inst.instance_id, "incarnation": inst.incarnation,
                                          "tier": "l1", "backend": "local_cpu", "size_bytes": None, "shared": False})
        rows = [merged[f] for f in sorted(merged)]
        return answer({"total": len(rows), "keys": rows[offset:offset + limit]})

    async def directory_stats(self, request: web.Request) -> web.Response:
        live = await self.store.instances()
        statuses = await self.fleet.each(live, "GET", "/status")
        by_instance = {}
        for inst in live:
            status, got = statuses[inst.instance_id]
            if status == 200 and isinstance(got, dict):
                by_instance[inst.instance_id] = int(got.get("storage_manager", {}).get("l1", {}).get("chunks", 0))
        total = sum(by_instance.values())
        return answer({"num_keys": total, "num_placements": total, "l1_keys_by_instance": by_instance,
                       "blend": {"num_contents": 0, "num_chunks": 0, "table_size": 0}})

    # ------------------------------------------------------------------ pins
    async def pin(self, request: web.Request) -> web.Response:
        form = (await body(request, TokensForm)).checked()
        space, keys, serving = await self._resolve(form)
        chunks = len(keys) // space.world_size
        if not keys:
            return answer({"requested": 0, "affected": 0, "status": "pinned"})
        payload = form.model_dump()
        done = await self.fleet.each([i for i, _ in serving], "POST", "/cache/pins", payload)
        refused = {i: got for i, (status, got) in done.items() if status == 409}
        if refused:  # a budget said no: undo it everywhere, and say why
            ok = [inst for inst, _ in serving if done[inst.instance_id][0] == 200]
            await self.fleet.each(ok, "DELETE", "/cache/pins", payload)
            instance_id, got = next(iter(refused.items()))
            raise ApiError(409, f"instance {instance_id}: {got.get('detail') if isinstance(got, dict) else got}")
        await self.store.pin([pin_field(space.encode(k, form.model_name, form.cache_salt)) for k in keys], +1)
        return answer({"requested": chunks, "affected": len(keys), "status": "pinned",
                       "instances": {i: summary(s, got) for i, (s, got) in done.items()}})

    async def unpin(self, request: web.Request) -> web.Response:
        form = (await body(request, TokensForm)).checked()
        space, keys, serving = await self._resolve(form)
        if not keys:
            return answer({"requested": 0, "affected": 0, "status": "unpinned"})
        await self.store.pin([pin_field(space.encode(k, form.model_name, form.cache_salt)) for k in keys], -1)
        done = await self.fleet.each([i for i, _ in serving], "DELETE", "/cache/pins", form.model_dump())
        return answer({"requested": len(keys) // space.world_size, "affected": len(keys), "status": "unpinned",
                       "instances": {i: summary(s, got) for i, (s, got) in done.items()}})

    async def list_pins(self, request: web.Request) -> web.Response:
        offset = query_int(request, "offset", 0, 0, 1 << 62)
        limit = query_int(request, "limit", 1000, 1, 10_000)
        salt, model = request.query.get("cache_salt"), request.query.get("model_name")
        rows = []
        for field, count in sorted((await self.store.pins()).items()):
            try:
                key = json.loads(field)
            except ValueError:
                continue
            if (salt is None or key.get("cache_salt") == salt) and (model is None or key.get("model_name") == model):
                rows.append({"key": key, "pin_count": count})
        return answer({"total": len(rows), "pins": rows[offset:offset + limit]})

    # ------------------------------------------------------------------ delete, prefetch
    async def delete(self, request: web.Request) -> web.Response:
        form = (await body(request, CacheDeleteBody)).checked()
        inst = await self._instance(form.instance_id)
        space = inst.space
        if space is None or not space.accepts(form.model_name, form.world_size):
            raise ApiError(404, f"instance {inst.instance_id} does not serve {form.model_name!r} at world_size "
                                f"{form.world_size}")
        space, keys, _ = await self._resolve(form, [(inst, space)])
        if not keys:
            return answer({"instance_id": inst.instance_id, "requested": 0, "affected": 0, "skipped": 0,
                           "status": "noop"})
        encoded = [space.encode(k, form.model_name, form.cache_salt) for k in keys]
        fields = [pin_field(e) for e in encoded]
        held_back = 0
        if not form.force:  # a fleet pin keeps its keys in every tier
            pinned = await self.store.pinned(fields)
            held_back = sum(pinned)
            encoded = [e for e, p in zip(encoded, pinned) if not p]
        affected = skipped = 0
        if encoded:
            status, got = await self._relay(inst, "DELETE", "/cache/objects",
                                            {"keys": encoded, "tier": form.tier, "force": form.force})
            if status != 200 or not isinstance(got, dict):
                raise ApiError(502, f"instance {inst.instance_id} answered {status}: {detail_of(got)}")
            affected, skipped = int(got.get("deleted", 0)), int(got.get("skipped", 0))
        if form.force:
            await self.store.drop_pins(fields)
        return answer({"instance_id": inst.instance_id, "requested": len(keys) // space.world_size,
                       "affected": affected, "skipped": skipped + held_back, "status": "deleted"})

    async def prefetch(self, request: web.Request) -> web.Response:
        form = (await body(request, InstanceTokens)).checked()
        inst = await self._instance(form.instance_id)
        payload = form.model_dump(exclude={"instance_id"})
        status, got = await self._relay(inst, "POST", "/cache/prefetches", payload)
        if status not in (200, 202) or not isinstance(got, dict):
            raise ApiError(502, f"instance {inst.instance_id} answered {status}: {detail_of(got)}")
        return answer({"instance_id": inst.instance_id, "request_id": got.get("request_id", ""),
                       "chunks": got.get("chunks", 0), "status": got.get("status", "noop")})

    async def prefetch_status(self, request: web.Request) -> web.Response:
        inst = await self._instance(request.match_info["instance_id"])
        request_id = request.match_info["request_id"]
        if not valid_id(request_id):
            raise ApiError(404, f"no prefetch {request_id!r}")
        status, got = await self._relay(inst, "GET", f"/cache/prefetches/{request_id}")
        return answer(got, status if status in (200, 404) else 502)

    # ------------------------------------------------------------------ moves
    async def move(self, request: web.Request) -> web.Response:
        form = (await body(request, MoveBody)).checked()
        source = await self._instance(form.source_instance_id)
        target = await self._instance(form.target_instance_id)
        source_space, target_space = source.space, target.space
        if source_space is None or target_space is None or not source_space.same_keys(target_space) or \
                not source_space.accepts(form.model_name, form.world_size):
            raise ApiError(400, "source and target must both serve this model at this world_size, with the same keys")
        space, keys, _ = await self._resolve(form.tokens(), [(source, source_space)])
        common = {"source_instance_id": source.instance_id, "target_instance_id": target.instance_id,
                  "requested": len(keys) // space.world_size}
        if not keys:
            return answer({"move_id": "", **common, "status": "noop"})
        move_id = uuid.uuid4().hex
        state = {"move_id": move_id, **common, "status": "pending", "phase": "load", "loaded": 0, "missing": 0,
                 "deleted": 0, "skipped": 0, "error": ""}
        await self.store.new_move(move_id, state)
        self.mover.start(move_id, form, source, target, space, keys, state)
        return answer({"move_id": move_id, **common, "status": "submitted"})

    async def move_status(self, request: web.Request) -> web.Response:
        move_id = request.match_info["move_id"]
        state = await self.store.move(move_id) if valid_id(move_id) else None
        if state is None:
            raise ApiError(404, f"unknown move {move_id} (or expired)")
        return answer(state)

    async def _fail_orphaned_moves(self, app: web.Application) -> None:
        try:
            for move_id in await self.store.move_ids():
                state = await self.store.move(move_id)
                if state is not None and state.get("status") == "pending":
                    state.update(status="failed", error="the coordinator restarted during the move")
                    await self.store.save_move(move_id, state)
        except Exception:
            logger.warning("could not check the moves of an earlier run", exc_info=True)

    async def _close(self, app: web.Application) -> None:
        await self.mover.close()
        await self.fleet.close()


def _keyed_by(space: KeySpace, encoded: dict[str, Any]) -> bool:
    """Whether `encoded` can be a key of instances with this key space."""
    try:
        space.key_of(EncodedObjectKey.model_validate(encoded))
    except ValueError:
        return False
    return True


def _module(tier: str, backend: Any, shared: bool, used: int, capacity: int) -> dict[str, Any]:
    return {"tier": tier, "backend": str(backend), "shared": shared, "used_bytes": used, "capacity_bytes": capacity,
            "usage_ratio": used / capacity if capacity else None}


