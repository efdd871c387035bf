"""The management API inside vLLM: its control channel to every worker rank, and its start in the scheduler half.

vLLM's engine-core process owns the connector's scheduler half; the cache lives beside each worker rank (another
process with tensor parallelism). The management API (`management/instance.py`) runs in the engine-core process
on a thread of its own and reaches each rank's `RankOps` over a control socket per rank, beside the lookup
socket and in the same private directory (`lookup.private_socket_dir`): `ControlServer` on the worker (its own
daemon thread: a slow call, a delete from Redis, never delays a lookup or vLLM's step), `ControlClient` on the
scheduler side (its own sockets and lock: never the lookup client's). Where a rank's server lives in the
client's process (one worker, the common case), the client calls it directly.

Wire (no pickle): request [seq u64, op, JSON object], reply [seq, JSON object]; messages larger than
`MAX_MESSAGE` are dropped by ZMQ, a body that is not a JSON object is answered with an error. `start_management`
(the connector's scheduler half) reads the token, binds the HTTP port (a port in use fails the start, with the
reason) and, with `coordinator_url`, registers the instance (`management/agent.py`).
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import zmq

from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.integration.vllm.lookup import bind_private_router, close_private_router
from lmcache_vllm.management.control import Bodies, CacheControl, ControlUnavailable, per_rank
from lmcache_vllm.observability import logs

if TYPE_CHECKING:
    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.management.agent import CoordinatorAgent
    from lmcache_vllm.management.http import ServerThread
    from lmcache_vllm.management.instance import InstanceApi

logger = logging.getLogger(__name__)

MAX_MESSAGE = 32 << 20  # a call with a million token ids is ~8 MB of JSON
_U64 = struct.Struct("<Q")
Handler = Callable[[str, dict[str, Any]], dict[str, Any]]

_local: dict[str, "ControlServer"] = {}
_local_lock = threading.Lock()


def control_address(lookup_address: str) -> str:
    """A rank's control socket: beside its lookup socket."""
    head, _, name = lookup_address.rpartition("/")
    return f"{head}/{name.replace('lookup-', 'control-', 1)}"


def management_enabled(config: LMCacheConfig) -> bool:
    return bool(config.extra_config.management_port)


class ControlServer:
    """A worker rank's end: answers calls with `handler(op, body)` (which must not raise) on its own thread."""

    def __init__(self, address: str, handler: Handler):
        self.address = address
        self.handler = handler
        self._socket, self._path = bind_private_router(address, MAX_MESSAGE)
        with _local_lock:
            _local[address] = self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-control", daemon=True)
        self._thread.start()

    def answer(self, op: str, raw: bytes) -> bytes:
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as exc:
            reply: dict[str, Any] = {"error": "bad_call", "detail": f"malformed call: {type(exc).__name__}"}
        else:
            reply = self.handler(op, body)
        return json.dumps(reply, separators=(",", ":")).encode()

    def _serve(self) -> None:
        enter_background_cpus()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(100)):
                    continue
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 4 or len(frames[1]) != _U64.size:
                    continue  # not a call: nobody to answer
                identity, seq, op, raw = frames
                self._socket.send_multipart([identity, seq, self.answer(op.decode("utf-8", "replace"), raw)])
            except zmq.Again:
                continue
            except Exception:  # a ZMQ error: counted in the log, and serving goes on
                if self._stop.is_set():
                    break
                logs.warn(logger, "control_server_error", "management control server failed; serving again",
                          exc_info=True)
                self._stop.wait(0.01)

    def close(self) -> None:
        with _local_lock:
            if _local.get(self.address) is self:
                del _local[self.address]
        self._stop.set()
        self._thread.join(timeout=5)
        close_private_router(self._socket, self._path)


class ControlClient(CacheControl):
    """The management API's end: one call to every rank, each answer or `ControlUnavailable`."""

    def __init__(self, addresses: Sequence[str], *, direct: bool = True):
        self.addresses = list(addresses)
        self.direct = direct  # False: always the sockets (tests of the wire path)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sockets = []
        for address in self.addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            sock.connect(address)
            self._sockets.append(sock)
        self._lock = threading.Lock()
        self._seq = 0

    def call(self, op: str, bodies: Bodies, timeout: float) -> list[dict[str, Any]]:
        payloads = [json.dumps(b, separators=(",", ":")).encode() for b in per_rank(bodies, len(self.addresses))]
        with _local_lock:
            local = [_local.get(a) for a in self.addresses]
        if self.direct and all(server is not None for server in local):
            return [json.loads(s.answer(op, p)) for s, p in zip(local, payloads) if s is not None]
        with self._lock:
            self._seq += 1
            seq = _U64.pack(self._seq)
            for sock, payload in zip(self._sockets, payloads):
                sock.send_multipart([seq, op.encode(), payload])
            return self._collect(seq, timeout)

    def _collect(self, seq: bytes, timeout: float) -> list[dict[str, Any]]:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(self._sockets):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlUnavailable(f"{len(self._sockets) - len(answers)} of {len(self._sockets)} worker "
                                         f"ranks did not answer in {timeout:g}s")
            ready = dict(poller.poll(max(1, int(left * 1000))))
            for index, sock in enumerate(self._sockets):
                while sock in ready:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) == 2 and frames[0] == seq:  # older answers (timed out) are skipped
                        try:
                            reply = json.loads(frames[1])
                        except ValueError:
                            reply = {"error": "failed", "detail": "a worker answered garbage"}
                        answers[index] = reply if isinstance(reply, dict) else {"error": "failed"}
        return [answers[i] for i in range(len(self._sockets))]

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []


@dataclass
class Management:
    """What `start_management` started (stopped by `close`)."""

    api: InstanceApi
    server: ServerThread
    agent: Optional[CoordinatorAgent] = None

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.server.stop()
        self.api.close()


def advertised(host: str) -> str:
    """The address the coordinator reaches a management API bound to `host` at."""
    if host in ("0.0.0.0", "::", "*", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return host


def start_management(config: LMCacheConfig, *, lookup_addresses: Sequence[str], instance_id: str,
                     world_size: int, model_names: Sequence[str]) -> Management:
    """Starts this instance's management API (and its registration with the coordinator); raises with the reason
    when it cannot (an unreadable token file, a port in use)."""
    from lmcache_vllm.management.agent import CoordinatorAgent
    from lmcache_vllm.management.auth import read_token
    from lmcache_vllm.management.http import ServerThread
    from lmcache_vllm.management.instance import InstanceApi

    extra = config.extra_config
    assert extra.management_token_file is not None  # the configuration requires it with management_port
    token = read_token(extra.management_token_file)
    control = ControlClient([control_address(a) for a in lookup_addresses])
    api = InstanceApi(control, world_size=world_size, token=token, instance_id=instance_id, model_names=model_names)
    server = ServerThread(api.app, extra.management_host, extra.management_port, "lmcache-management")
    try:
        port = server.start()
    except Exception as exc:
        api.close()
        raise RuntimeError(f"the management API cannot listen on {extra.management_host}:"
                           f"{extra.management_port}: {exc}") from exc
    logger.info("LMCache management API of instance %s on http://%s:%d (docs/MANAGEMENT.md)", instance_id,
                extra.management_host, port)
    agent = None
    if extra.coordinator_url:
        agent = CoordinatorAgent(extra.coordinator_url, token, api, advertised(extra.management_host), port,
                                 heartbeat_s=extra.coordinator_heartbeat_secs)
    return Management(api, server, agent)
