"""The coordinator's quota endpoints (a mixin of `coordinator.Coordinator`): per-`cache_salt` limits of L1, kept in
Redis (`fleet.FleetStore`) and set on every registered instance (`PUT /quota/{salt}` of its management API), also
on one that registers later; usage is the sum of the instances' own. LMCache's paths and fields: `GET|PUT
/quota/config` (no default quota here: a salt without one is not limited, so a non-null default is 501),
`GET /quota`, `GET|PUT|DELETE /quota/{salt}` (`_default`: the empty salt). Quotas are on L1 only: `tier` defaults
to `l1`, and `l2` is refused (400).
"""
from __future__ import annotations

import logging

from aiohttp import web

from lmcache_vllm.management.fleet import FleetClient, FleetError, FleetStore, Instance, summary
from lmcache_vllm.management.http import ApiError, Routes, answer, body
from lmcache_vllm.management.schemas import QuotaBody, QuotaConfigBody, salt_from_path, salt_to_path

logger = logging.getLogger(__name__)


class QuotaRoutes:
    store: FleetStore
    fleet: FleetClient

    def add_quota_routes(self, r: Routes) -> None:
        r.add("GET", "/quota/config", self.quota_config, write=False)
        r.add("PUT", "/quota/config", self.set_quota_config, write=True)
        r.add("GET", "/quota", self.list_quotas, write=False)
        r.add("GET", "/quota/{salt}", self.get_quota, write=False)
        r.add("PUT", "/quota/{salt}", self.set_quota, write=True)
        r.add("DELETE", "/quota/{salt}", self.delete_quota, write=True)

    async def _push_quotas(self, inst: Instance, quotas: dict[str, float]) -> None:
        for salt, limit in quotas.items():
            try:
                await self.fleet.call(inst, "PUT", f"/quota/{salt_to_path(salt)}", {"limit_gb": limit})
            except FleetError as exc:
                logger.warning("quota of %r not set on %s: %s", salt, inst.instance_id, exc)

    # ------------------------------------------------------------------ quotas
    async def quota_config(self, request: web.Request) -> web.Response:
        return answer({"default_limit_gb": None})

    async def set_quota_config(self, request: web.Request) -> web.Response:
        form = await body(request, QuotaConfigBody)
        if form.default_limit_gb is not None:
            raise ApiError(501, "lmcache-vllm has no default quota: a cache_salt without one is not limited")
        return answer({"default_limit_gb": None})

    async def set_quota(self, request: web.Request) -> web.Response:
        salt = salt_from_path(request.match_info["salt"])
        form = await body(request, QuotaBody)
        _l1_only(form.tier)
        await self.store.set_quota(salt, form.limit_gb)
        done = await self.fleet.each(await self.store.instances(), "PUT", f"/quota/{salt_to_path(salt)}",
                                {"limit_gb": form.limit_gb})
        return answer({"cache_salt": salt_to_path(salt), "limit_gb": form.limit_gb, "status": "ok",
                       "instances": {i: summary(s, got) for i, (s, got) in done.items()}})

    async def delete_quota(self, request: web.Request) -> web.Response:
        salt = salt_from_path(request.match_info["salt"])
        _l1_only(request.query.get("tier", "l1"))
        removed = await self.store.delete_quota(salt)
        await self.fleet.each(await self.store.instances(), "DELETE", f"/quota/{salt_to_path(salt)}")
        return answer({"cache_salt": salt_to_path(salt), "limit_gb": 0.0,
                       "status": "removed" if removed else "not_found"})

    async def _usage(self) -> dict[str, float]:
        """GiB of L1 per salt, over every instance."""
        used: dict[str, float] = {}
        replies = await self.fleet.each(await self.store.instances(), "GET", "/quota")
        for status, got in replies.values():
            if status == 200 and isinstance(got, dict):
                for salt, entry in got.get("users", {}).items():
                    used[salt] = used.get(salt, 0.0) + float(entry.get("current_usage_gb", 0.0))
        return used

    async def get_quota(self, request: web.Request) -> web.Response:
        salt = salt_from_path(request.match_info["salt"])
        _l1_only(request.query.get("tier", "l1"))
        quotas = await self.store.quotas()
        used = await self._usage()
        return answer({"cache_salt": salt_to_path(salt), "quota_limit_gb": quotas.get(salt, 0.0),
                       "quota_exists": salt in quotas, "usage_gb": used.get(salt_to_path(salt), 0.0)})

    async def list_quotas(self, request: web.Request) -> web.Response:
        tier = request.query.get("tier", "l1")
        if tier == "all":
            raise ApiError(400, "tier=all is not a quota tier")
        _l1_only(tier)
        quotas, used = await self.store.quotas(), await self._usage()
        rows = [{"cache_salt": salt_to_path(s), "quota_limit_gb": limit, "quota_exists": True,
                 "usage_gb": used.get(salt_to_path(s), 0.0)} for s, limit in sorted(quotas.items())]
        return answer({"total_gb": sum(r["usage_gb"] for r in rows), "by_cache_salt": rows})



def _l1_only(tier: str) -> None:
    if tier != "l1":
        raise ApiError(400, "lmcache-vllm enforces quotas on its instances' L1: tier must be l1")
