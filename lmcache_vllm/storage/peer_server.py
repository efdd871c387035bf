"""`TransferServer`: a prefill instance's endpoint from which decode instances pull held chunks.

One per worker rank: a pyzmq ROUTER on its own daemon thread, bound to `host` (an address or a name; "*" or
"0.0.0.0": every interface) and `port` (0: one the OS picks; `port` tells which). It answers the requests of
`peer_wire` from the holds of `peer_holds.PeerHolds`:

- PULL(request, keys): the held chunks of the longest prefix of `keys`, one CHUNK message each (the payload
  sent zero-copy from the L1 arena), then END. A request whose saves are not over yet is parked until its
  hold is filled; one unknown here is parked `unknown_grace_s` (a decode instance can in principle ask
  before this rank registered the hold) and then answered ERR unknown; a released or expired one ERR at once.
  A hold that has none of the asked keys is answered ERR keys, naming the first key on each side, so the
  decode instance can say what differs (model fingerprint, TP size or rank, chunk size, format).
- RELEASE(request): ends the hold (no reply).
With a MAC secret, a request without a valid MAC is answered ERR auth (a PULL) or ignored (a RELEASE).
Expired holds are ended by this thread too, so a hold nobody pulls never outlives its lease by more than a
poll interval. Malformed requests are counted and answered ERR bad_request; nothing a peer sends stops the
thread.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage import peer_wire as wire
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.peer_holds import HoldState, PeerHolds

if TYPE_CHECKING:
    from lmcache_vllm.memory import MemoryObj

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # idle poll interval (expiry granularity)
_PARKED_POLL_S = 0.005  # while a pull waits for its hold to be filled


def bind_address(host: str) -> str:
    """The address ZMQ binds for `host`: a name is resolved (ZMQ binds interfaces, not names)."""
    if host in ("*", "0.0.0.0", "::", ""):
        return "*"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


@dataclass
class _Parked:
    identity: bytes
    request: wire.PeerRequest
    since: float


class TransferServer:
    """See the module docstring."""

    def __init__(self, holds: PeerHolds, *, host: str, port: int = 0, mac: ChunkMac | None = None,
                 unknown_grace_s: float = 2.0):
        self.holds = holds
        self.host = host
        self.mac = mac
        self.unknown_grace_s = float(unknown_grace_s)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not a silent drop
        self._socket.setsockopt(zmq.SNDHWM, 0)  # queued sends are references into the arena, not copies
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        address = bind_address(host)
        if port:
            self._socket.bind(f"tcp://{address}:{port}")
            self.port = int(port)
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{address}")
        self._parked: list[_Parked] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-pd-transfer", daemon=True)
        self._thread.start()
        logger.info("KV transfer server listening on %s:%d", host, self.port)

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                timeout = _PARKED_POLL_S if self._parked else _POLL_S
                if dict(poller.poll(int(timeout * 1000))):
                    self._receive()
                if self._parked:
                    self._serve_parked()
                self.holds.expire()
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                logs.warn(logger, "pd_server_error", "KV transfer server error", exc_info=True)
            except Exception:  # nothing a peer sends may stop the thread
                logs.warn(logger, "pd_server_error", "KV transfer server error", exc_info=True)

    def _receive(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                request = wire.parse_request(body)
            except wire.PeerProtocolError as exc:
                logs.warn(logger, "pd_bad_request", "malformed KV transfer request: %s", exc)
                self._reply(identity, wire.error_reply(b"bad_request", str(exc)))
                continue
            if not wire.verify_request(request, self.mac):
                logs.warn(logger, "pd_bad_auth", "KV transfer request for %s without a valid MAC refused",
                          request.req_id)
                if request.op == wire.PULL:
                    self._reply(identity, wire.error_reply(b"auth", "the request's MAC does not verify"))
                continue
            if request.op == wire.RELEASE:
                self.holds.release(request.req_id)
            else:
                self._pull(_Parked(identity, request, time.monotonic()))

    def _serve_parked(self) -> None:
        parked, self._parked = self._parked, []
        for entry in parked:
            self._pull(entry)

    def _pull(self, entry: _Parked) -> None:
        request = entry.request
        checkout = self.holds.checkout(request.req_id, request.keys)
        state = checkout.state
        if state == HoldState.PENDING or (
                state == HoldState.UNKNOWN and time.monotonic() - entry.since < self.unknown_grace_s):
            self._parked.append(entry)
            return
        if state != HoldState.READY:
            code = b"expired" if state == HoldState.EXPIRED else b"unknown"
            self._reply(entry.identity, wire.error_reply(code, f"request {request.req_id}: {state.value}"))
            return
        if not checkout.objs and checkout.held_keys:
            self._reply(entry.identity, wire.error_reply(
                b"keys", f"holds {checkout.held_keys[0]!r}, asked for {request.keys[0]!r}"))
            return
        self._send(entry.identity, request, checkout.objs, checkout.headers)

    def _send(self, identity: bytes, request: wire.PeerRequest, objs: list[MemoryObj],
              headers: tuple[bytes, ...]) -> None:
        sends = []
        sent_bytes = 0
        try:
            for index, obj in enumerate(objs):
                frames = wire.chunk_reply(index, request.keys[index], obj.tensor, self.mac,
                                          headers[index] if headers else None)
                sends.append(self._socket.send_multipart([identity, *frames], copy=False, track=True))
                sent_bytes += obj.nbytes
            self._socket.send_multipart([identity, *wire.end_reply(len(objs))])
            metrics.inc("pd_served_chunks", len(objs))
            metrics.inc("pd_served_bytes", sent_bytes)
        except zmq.ZMQError as exc:  # the peer went away (ROUTER_MANDATORY): it will recompute
            logs.warn(logger, "pd_peer_gone", "request %s: decode instance gone while sending (%s)",
                      request.req_id, exc)
        finally:
            self.holds.sent(objs, sends)

    def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self._socket.send_multipart([identity, *frames])
        except zmq.ZMQError:
            pass  # the peer went away

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
