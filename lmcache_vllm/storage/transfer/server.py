"""`TransferServer`: a prefill instance's endpoint from which decode instances pull held chunks.

One per worker rank: a TCP listener on its own daemon thread, bound to `host` (an address or a name; "*" or
"0.0.0.0": every interface) and `port` (0: one the OS picks; `port` tells which); each connection a decode
instance opens is served by a thread of its own (at most `max_connections` at once; more are closed at once).
It answers the requests of `wire` from the holds of `holds.PeerHolds`:

- PULL(request, keys): the held chunks of the longest prefix of `keys`, one CHUNK message each (the payload
  sent from the L1 arena without a copy in user space), then END. A request whose saves are not over yet
  waits until its hold is filled; one unknown here waits `unknown_grace_s` (a decode instance can in
  principle ask before this rank registered the hold) and is then answered ERR unknown; a released or
  expired one ERR at once. A hold that has none of the asked keys is answered ERR keys, naming the first key
  on each side, so the decode instance can say what differs (model fingerprint, TP size or rank, chunk size,
  format).
- RELEASE(request): ends the hold (no reply).
- FETCH(keys) (P2P): `by_key(keys, peer host)` checks out what L1 holds of the keys' longest prefix
  (`keyed.py`), sent like a PULL's chunks; without `by_key` (P2P off) or for a peer it refuses: ERR.
With a MAC secret, a request without a valid MAC is answered ERR auth (a PULL) or ignored (a RELEASE).
Expired holds are ended by the listener thread, so a hold nobody pulls never outlives its lease by more than a
poll interval. A malformed message is answered ERR bad_request and its connection closed (the stream cannot be
trusted after it); a peer silent or not reading for `io_timeout_s` is dropped. Nothing a peer sends stops a
thread.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.holds import Checkout, HoldState, PeerHolds

if TYPE_CHECKING:
    from lmcache_vllm.memory import MemoryObj

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # the listener's idle poll (expiry granularity)
_PARKED_POLL_S = 0.005  # while a pull waits for its hold to be filled
_SOCKET_BUFFER = 4 << 20  # bytes: whole chunks in flight per connection


def bind_address(host: str) -> str:
    """The address to bind for `host`: every interface for the wildcards, a name resolved."""
    if host in ("*", "0.0.0.0", ""):
        return "0.0.0.0"
    if host == "::" or ":" in host:
        return host
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def tune(sock: socket.socket) -> None:
    """Large socket buffers and no Nagle delay: a pull is a request and then a stream of large messages."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        except OSError:
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_message(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Sends one framed message, every byte (sendmsg: the parts leave from where they are)."""
    views = [memoryview(p).cast("B") for p in wire.frame(parts)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """n bytes from `sock` (blocking, its timeout per call); `ConnectionError` when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def recv_request(sock: socket.socket) -> list[bytes]:
    """The parts of one request message; `PeerProtocolError` for a prefix out of bounds."""
    count = wire.part_count(recv_exact(sock, wire.COUNT_BYTES))
    lengths = wire.parse_lengths(recv_exact(sock, 8 * count), count, wire.MAX_REQUEST_BYTES)
    return [recv_exact(sock, n) for n in lengths]


class TransferServer:
    """See the module docstring."""

    def __init__(self, holds: PeerHolds, *, host: str, port: int = 0, mac: ChunkMac | None = None,
                 unknown_grace_s: float = 2.0, io_timeout_s: float = 30.0, max_connections: int = 64,
                 by_key: Callable[[Sequence[str], str], Checkout] | None = None):
        self.holds = holds
        self.by_key = by_key
        self.host = host
        self.mac = mac
        self.unknown_grace_s = float(unknown_grace_s)
        self.io_timeout_s = float(io_timeout_s)
        self.max_connections = int(max_connections)
        address = bind_address(host)
        self._listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((address, int(port)))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-pd-transfer", daemon=True)
        self._thread.start()
        logger.info("KV transfer server listening on %s:%d", host, self.port)

    # ------------------------------------------------------------------ the listener
    def _serve(self) -> None:
        enter_background_cpus()
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], _POLL_S)
                if ready:
                    self._accept()
                self.holds.expire()
            except OSError:
                if self._stop.is_set():
                    break
                logs.warn(logger, "pd_server_error", "KV transfer server error", exc_info=True)
            except Exception:  # nothing a peer does may stop the thread
                logs.warn(logger, "pd_server_error", "KV transfer server error", exc_info=True)

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        with self._lock:
            if len(self._connections) >= self.max_connections:
                logs.warn(logger, "pd_too_many_peers", "KV transfer server: %d connections open; one refused",
                          len(self._connections))
                conn.close()
                return
            self._connections.add(conn)
        tune(conn)
        conn.settimeout(self.io_timeout_s)
        threading.Thread(target=self._connection, args=(conn,), name="lmcache-pd-conn", daemon=True).start()

    # ------------------------------------------------------------------ one connection
    def _connection(self, conn: socket.socket) -> None:
        enter_background_cpus()
        try:
            while not self._stop.is_set():
                try:
                    parts = recv_request(conn)
                    request = wire.parse_request(parts)
                except (ConnectionError, TimeoutError, OSError):
                    return  # closed, silent or gone: nothing to answer
                except wire.PeerProtocolError as exc:
                    logs.warn(logger, "pd_bad_request", "malformed KV transfer request: %s", exc)
                    self._reply(conn, wire.error_reply(b"bad_request", str(exc)))
                    return
                if not wire.verify_request(request, self.mac):
                    logs.warn(logger, "pd_bad_auth", "KV transfer request for %s without a valid MAC refused",
                              request.req_id)
                    if request.op != wire.RELEASE:
                        self._reply(conn, wire.error_reply(b"auth", "the request's MAC does not verify"))
                    continue
                if request.op == wire.RELEASE:
                    self.holds.release(request.req_id)
                elif request.op == wire.FETCH and not self._fetch(conn, request):
                    return
                elif request.op == wire.PULL and not self._pull(conn, request):
                    return
        except Exception:  # a bug here must not leak the connection or kill the server
            logs.warn(logger, "pd_server_error", "KV transfer connection error", exc_info=True)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _pull(self, conn: socket.socket, request: wire.PeerRequest) -> bool:
        """Answers one PULL; False when the connection is no good any more."""
        since = time.monotonic()
        while True:
            checkout = self.holds.checkout(request.req_id, request.keys)
            state = checkout.state
            waiting = state == HoldState.PENDING or (
                state == HoldState.UNKNOWN and time.monotonic() - since < self.unknown_grace_s)
            if not waiting or self._stop.wait(_PARKED_POLL_S):
                break
        if state != HoldState.READY:
            code = b"expired" if state == HoldState.EXPIRED else b"unknown"
            return self._reply(conn, wire.error_reply(code, f"request {request.req_id}: {state.value}"))
        if not checkout.objs and checkout.held_keys:
            return self._reply(conn, wire.error_reply(
                b"keys", f"holds {checkout.held_keys[0]!r}, asked for {request.keys[0]!r}"))
        return self._send(conn, request, checkout.objs, checkout.headers)

    def _fetch(self, conn: socket.socket, request: wire.PeerRequest) -> bool:
        """Answers one FETCH (P2P) from `by_key`; False when the connection is no good any more."""
        checkout = self.by_key(request.keys, conn.getpeername()[0]) if self.by_key is not None else None
        if checkout is None or checkout.state != HoldState.READY:
            return self._reply(conn, wire.error_reply(b"auth", "this instance serves no P2P chunks to this peer"))
        return self._send(conn, request, checkout.objs, checkout.headers)

    def _send(self, conn: socket.socket, request: wire.PeerRequest, objs: list[MemoryObj],
              headers: tuple[bytes, ...]) -> bool:
        sent_bytes = 0
        try:
            for index, obj in enumerate(objs):
                send_message(conn, wire.chunk_reply(index, request.keys[index], obj.tensor, self.mac,
                                                    headers[index] if headers else None))
                sent_bytes += obj.nbytes
            send_message(conn, wire.end_reply(len(objs)))
            if request.op == wire.PULL:  # a FETCH's chunks are P2P's, counted by its source (keyed.py)
                metrics.inc("pd_served_chunks", len(objs))
                metrics.inc("pd_served_bytes", sent_bytes)
            return True
        except OSError as exc:  # the peer went away or stopped reading: it recomputes what it lacks
            logs.warn(logger, "pd_peer_gone", "request %s: decode instance gone while sending (%s)",
                      request.req_id, exc)
            return False
        finally:
            self.holds.sent(objs)  # every byte is in the kernel's buffers, or the send failed

    def _reply(self, conn: socket.socket, frames: list[bytes]) -> bool:
        try:
            send_message(conn, frames)
            return True
        except OSError:
            return False  # the peer went away

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread; the thread closes it
            except OSError:
                pass
