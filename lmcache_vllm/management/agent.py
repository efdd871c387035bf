"""`CoordinatorAgent`: an instance's registration with the fleet coordinator (LMCache's MP-server protocol).

On a daemon thread: once the ranks answer (the engine exists, so the key space is known), `POST /instances` with
the management API's address and, in `metadata`, the key space (`lmcache_vllm_keyspace`: what the coordinator
resolves token ids with); then `PUT /instances/{id}/heartbeat` every `heartbeat_s`. A 404 (the coordinator
dropped it after its lease, or restarted with another store) registers again, and the coordinator's answer gives
the incarnation placements name. Every call is bounded (`timeout_s`); an unreachable coordinator is retried,
with a warning once per outage, never an error in the instance. `close` deregisters (`DELETE /instances/{id}`).
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Optional

from lmcache_vllm.management.client import request
from lmcache_vllm.management.control import ControlUnavailable
from lmcache_vllm.management.keys import KeySpace

if TYPE_CHECKING:
    from lmcache_vllm.management.instance import InstanceApi

logger = logging.getLogger(__name__)

KEYSPACE_FIELD = "lmcache_vllm_keyspace"


class CoordinatorAgent:
    def __init__(self, url: str, token: bytes, api: InstanceApi, host: str, port: int, *,
                 heartbeat_s: float = 5.0, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self.token = token
        self.api = api
        self.host = host
        self.port = port
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._reachable = True
        self._thread = threading.Thread(target=self._run, name="lmcache-coordinator-agent", daemon=True)
        self._thread.start()

    def _space(self) -> Optional[KeySpace]:
        try:
            info = self.api.control.call("info", {}, 5.0)
        except ControlUnavailable:
            return None
        if not info or "space" not in info[0]:
            return None
        return KeySpace.from_json(str(info[0]["space"])).with_names(self.api.model_names)

    def register(self, space: KeySpace) -> bool:
        body = {"ip": self.host, "http_port": self.port, "instance_id": self.api.instance_id,
                "metadata": {KEYSPACE_FIELD: space.to_json()}}
        status, got = request(f"{self.url}/instances", "POST", self.token, body, self.timeout_s)
        if status != 200 or not isinstance(got, dict):
            logger.warning("the coordinator %s refused this instance's registration (%d): %s", self.url, status,
                           got.get("detail") if isinstance(got, dict) else got)
            return False
        self.api.incarnation = int(got.get("incarnation", 0))
        logger.info("registered with the coordinator %s as %s (incarnation %d)", self.url, self.api.instance_id,
                    self.api.incarnation)
        self.registered.set()
        return True

    def _run(self) -> None:
        space: Optional[KeySpace] = None
        while not self._stop.is_set():
            try:
                if space is None:
                    space = self._space()
                if space is not None:
                    self._beat(space)
                self._reachable = True
            except OSError as exc:
                self.registered.clear()
                if self._reachable:
                    logger.warning("the coordinator %s is not reachable (%s); trying again every %gs", self.url,
                                   exc, self.heartbeat_s)
                self._reachable = False
            except Exception:  # never a dead thread: the next beat tries again
                logger.warning("coordinator registration failed", exc_info=True)
            self._stop.wait(self.heartbeat_s if self.registered.is_set() else min(1.0, self.heartbeat_s))

    def _beat(self, space: KeySpace) -> None:
        if not self.registered.is_set():
            self.register(space)
            return
        status, _ = request(f"{self.url}/instances/{self.api.instance_id}/heartbeat", "PUT", self.token,
                            None, self.timeout_s)
        if status == 404:
            self.registered.clear()
            self.register(space)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)
        if self.registered.is_set():
            try:
                request(f"{self.url}/instances/{self.api.instance_id}", "DELETE", self.token, None, self.timeout_s)
            except OSError:
                pass
