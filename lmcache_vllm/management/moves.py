"""`Mover`: the coordinator's moves (LMCache's open proposal, RFC #5083): a prompt's chunks from one instance's L1
to another's, without losing them on the way.

1. The target warms the prompt (`POST /cache/prefetches`): each of its ranks reads the chunks its L1 lacks from
   its lower tiers — the source's L1 among them, through the P2P directory and the verified peer transfer — and
   keeps them in L1, listed as its own.
2. The coordinator polls the target (`GET /cache/prefetches/{id}`, every `poll_s`, at most `timeout_s`), then
   asks it where each key is (`POST /cache/lookup`): every key must be in the target's L1 now, whether this warm-up
   brought it (`loaded`) or it was there before.
3. Unless `keep_source`, the source deletes those keys from its L1 (`DELETE /cache/objects`, tier l1, not forced:
   a chunk pinned or in use there stays), in batches of at most 10,000 keys.

A move that cannot show every key at the target ends `failed` before anything is deleted: a source or target that
died (SIGKILL) midway, a pull that did not verify, a timeout. The source then still holds everything it held, and
no hold is left anywhere (a warm-up's reads are bounded and release what they read; a source's sends end with the
connection). Keys already at the target count as `missing` (not loaded by this move), as in LMCache, but are
deleted at the source like the loaded ones (both are safe at the target). A move's state is in Redis
(`FleetStore`), kept `move_ttl_s`; a coordinator that restarts marks the moves it was running `failed`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from lmcache_vllm.management.fleet import FleetClient, FleetError, FleetStore, Instance
from lmcache_vllm.management.keys import KeySpace
from lmcache_vllm.management.schemas import MAX_KEYS, MoveBody
from lmcache_vllm.tokens import CacheKey

logger = logging.getLogger(__name__)


class MoveFailed(Exception):
    def __init__(self, phase: str, detail: str):
        super().__init__(detail)
        self.phase = phase


class Mover:
    def __init__(self, store: FleetStore, fleet: FleetClient, *, poll_s: float = 0.5, timeout_s: float = 600.0):
        self.store = store
        self.fleet = fleet
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, move_id: str, body: MoveBody, source: Instance, target: Instance, space: KeySpace,
              keys: list[CacheKey], state: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(move_id, body, source, target, space, keys, state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, move_id: str, body: MoveBody, source: Instance, target: Instance, space: KeySpace,
                   keys: list[CacheKey], state: dict[str, Any]) -> None:
        try:
            await self._move(move_id, body, source, target, space, keys, state)
            state.update(status="completed")
        except MoveFailed as exc:
            state.update(status="failed", phase=exc.phase, error=str(exc))
            logger.warning("move %s failed in phase %s: %s", move_id, exc.phase, exc)
        except asyncio.CancelledError:
            state.update(status="failed", error="the coordinator stopped during the move")
            await self._save(move_id, state)
            raise
        except Exception as exc:
            logger.exception("move %s failed", move_id)
            state.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        await self._save(move_id, state)

    async def _save(self, move_id: str, state: dict[str, Any]) -> None:
        try:
            await self.store.save_move(move_id, state)
        except Exception:
            logger.warning("move %s: its state could not be written", move_id, exc_info=True)

    async def _call(self, inst: Instance, phase: str, method: str, path: str, body: Any = None) -> Any:
        try:
            status, got = await self.fleet.call(inst, method, path, body)
        except FleetError as exc:
            raise MoveFailed(phase, str(exc)) from None
        if status >= 300 or not isinstance(got, dict):
            detail = got.get("detail") if isinstance(got, dict) else got
            raise MoveFailed(phase, f"instance {inst.instance_id} answered {status}: {detail}")
        return got

    async def _move(self, move_id: str, body: MoveBody, source: Instance, target: Instance, space: KeySpace,
                    keys: list[CacheKey], state: dict[str, Any]) -> None:
        form = body.tokens().model_dump()
        started = await self._call(target, "load", "POST", "/cache/prefetches",
                                   dict(form, source_tier="l2", target_tier="l1"))
        loaded_flags = [False] * len(keys)
        if started.get("status") == "submitted":
            request_id = str(started.get("request_id", ""))
            if not request_id:
                raise MoveFailed("load", "the target answered no request_id")
            done = await self._poll(target, request_id)
            if done.get("total_keys") != len(keys):
                raise MoveFailed("load", f"the target resolved {done.get('total_keys')} keys, the coordinator "
                                         f"{len(keys)}: the instances do not key this model alike")
            missing = done.get("missing_key_indices")
            if not isinstance(missing, list) or len(set(missing)) != len(missing) or \
                    not all(isinstance(i, int) and 0 <= i < len(keys) for i in missing):
                raise MoveFailed("load", "the target's missing_key_indices are not usable")
            loaded_flags = [i not in set(missing) for i in range(len(keys))]
        encoded = [space.encode(k, body.model_name, body.cache_salt) for k in keys]
        at_target = await self._at_target(target, encoded)
        state.update(loaded=sum(loaded_flags), missing=len(keys) - sum(loaded_flags))
        absent = len(keys) - sum(at_target)
        if absent:
            raise MoveFailed("load", f"{absent} of {len(keys)} keys are not in the target's L1 after the load: "
                                     "nothing was deleted at the source")
        if body.keep_source:
            return
        state.update(phase="delete")
        await self._save(move_id, state)
        for start in range(0, len(encoded), MAX_KEYS):
            got = await self._call(source, "delete", "DELETE", "/cache/objects",
                                   {"keys": encoded[start:start + MAX_KEYS], "tier": "l1", "force": False})
            state["deleted"] += int(got.get("deleted", 0))
            state["skipped"] += int(got.get("skipped", 0))

    async def _poll(self, target: Instance, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            got = await self._call(target, "load", "GET", f"/cache/prefetches/{request_id}")
            if got.get("status") == "completed":
                return dict(got)
            if time.monotonic() > deadline:
                raise MoveFailed("load", f"the target's load did not finish in {self.timeout_s:g}s")
            await asyncio.sleep(self.poll_s)

    async def _at_target(self, target: Instance, encoded: list[dict[str, Any]]) -> list[bool]:
        present: list[bool] = []
        for start in range(0, len(encoded), MAX_KEYS):
            got = await self._call(target, "load", "POST", "/cache/lookup", {"keys": encoded[start:start + MAX_KEYS]})
            for result in got.get("results", []):
                present.append(any(p.get("tier") == "l1" for p in result.get("placements", [])))
        if len(present) != len(encoded):
            raise MoveFailed("load", "the target's lookup answered another number of keys")
        return present

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
