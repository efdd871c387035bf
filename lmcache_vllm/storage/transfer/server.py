"""`TransferServer`: a prefill instance's endpoint from which decode instances pull held chunks.

One per worker rank: a TCP listener bound to `host` (an address or a name; "*" or "0.0.0.0": every
interface) and `port` (0: one the OS picks; `port` tells which). It answers the requests of `wire` from the
holds of `holds.PeerHolds`:

- PULL(request, keys): the held chunks of the longest prefix of `keys`, one CHUNK message each (the payload
  sent from the L1 arena without a copy in user space), then END. A request whose saves are not over yet
  waits until its hold is filled; one unknown here waits `unknown_grace_s` (a decode instance can in
  principle ask before this rank registered the hold) and is then answered ERR unknown; a released or
  expired one ERR at once, one refused for the cap on held bytes ERR full. A hold that has none of the
  asked keys is answered ERR keys, naming the fields of the keys that differ (never a held key).
- RELEASE(request): ends the hold (no reply).
- FETCH(keys) (P2P): `by_key(keys, peer host)` checks out what L1 holds of the keys' longest prefix
  (`keyed.py`), sent like a PULL's chunks; without `by_key` (P2P off) or for a peer it refuses: ERR auth.
The chunks and replies are sent by `sending.py`. With a MAC secret, a request without a valid MAC is answered
ERR auth (or, a RELEASE, ignored), and its connection closed.

What a peer can make it spend before its request is authenticated is bounded (`wire.RequestReader`): one
thread (`lmcache-pd-transfer`, a `selectors` loop: any file descriptor number) reads every connection's
request, each part's length checked against its bound before a byte of it is kept, the bytes of all
requests being read or not yet answered (a pull parked on its hold keeps its request) within
`max_request_buffer` (the connections reading or parked longest are closed first), each request whole
within `request_timeout_s` of its
first byte or of the connection's last answer (a peer that sends a byte now and then, or nothing, is
dropped). At most `max_connections` connections are open; when they all are, the one waiting longest for
its request (or parked on a request id unknown here) is closed to make room, and only a server whose every
slot is serving a pull refuses a new connection (ERR busy). A PULL is served on a thread of its own; its
sends stop when the hold's lease ends (the chunks' references are dropped, the connection closed) or
when the peer reads nothing for `io_timeout_s`. The loop also ends expired holds, so a hold nobody pulls
never outlives its lease by more than a poll interval. Every refusal is counted in
`pd_server_refusals{reason}`; nothing a peer sends stops a thread.
"""
from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.holds import Checkout, DuplicateKey, HoldState, PeerHolds
from lmcache_vllm.storage.transfer.sending import send_chunks, send_reply
from lmcache_vllm.storage.transfer.sockets import bind_address, peer_name, recv_request, send_message, tune

__all__ = ["TransferServer", "bind_address", "recv_request", "send_message", "tune"]  # the helpers: `sockets`

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # the loop's longest wait (expiry and deadline granularity)
_PARKED_POLL_S = 0.005  # while a pull waits for its hold to be filled
_RECV_BYTES = 1 << 16  # one read of a request at most
_ACCEPTS_PER_TICK = 64
_READING, _PARKED, _PENDING, _SENDING = "reading", "parked", "pending", "sending"
_EVICTABLE = (_READING, _PARKED)  # phases that cost us a slot and nothing else: closed to make room


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    since: float  # monotonic: when its current phase began
    phase: str = _READING
    reader: wire.RequestReader = field(default_factory=wire.RequestReader)
    reserved: int = 0  # bytes of `max_request_buffer` its request holds (being read, or parked on a thread)
    evicted: bool = False

    @property
    def host(self) -> str:
        """The peer's address without its port ("?" when unknown: trusted by nobody)."""
        return self.peer.rsplit(":", 1)[0]


class TransferServer:
    """See the module docstring."""

    def __init__(self, holds: PeerHolds, *, host: str, port: int = 0, mac: ChunkMac | None = None,
                 unknown_grace_s: float = 2.0, io_timeout_s: float = 30.0, request_timeout_s: float = 10.0,
                 max_connections: int = 64, max_request_buffer: int = 2 * wire.MAX_REQUEST_BYTES,
                 by_key: Callable[[Iterable[str], str], Checkout] | None = None):
        self.holds = holds
        self.by_key = by_key
        self.host = host
        self.mac = mac
        self.unknown_grace_s = float(unknown_grace_s)
        self.io_timeout_s = float(io_timeout_s)
        self.request_timeout_s = float(request_timeout_s)
        self.max_connections = int(max_connections)
        self.max_request_buffer = max(int(max_request_buffer), wire.MAX_REQUEST_BYTES)
        address = bind_address(host)
        self._listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((address, int(port)))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()  # epoll on Linux: no fd limit, unlike select.select
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._connections: set[_Connection] = set()
        self._buffered = 0  # bytes reserved by requests being read or parked (under `_lock`)
        self._returned: queue.SimpleQueue[_Connection] = queue.SimpleQueue()  # served, reading again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._unregister = metrics.register_gauges(self._gauges)
        self._thread = threading.Thread(target=self._serve, name="lmcache-pd-transfer", daemon=True)
        self._thread.start()
        logger.info("KV transfer server listening on %s:%d", host, self.port)

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> None:
        enter_background_cpus()
        while not self._stop.is_set():
            try:
                for key, _ in self._selector.select(_POLL_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._woken()
                    else:
                        self._read(key.data)
                self._drop_late()
            except Exception:  # nothing a peer does may stop the thread
                logs.warn(logger, "pd_server_error", "KV transfer server error", exc_info=True)
                self._stop.wait(_POLL_S)  # never a busy loop on a failure that repeats
            try:
                self.holds.expire()  # whatever happened above
            except Exception:
                logs.warn(logger, "pd_server_error", "KV transfer server error", exc_info=True)
        self._close_all()

    def _woken(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                alive = conn in self._connections and not conn.evicted
            if alive:
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            else:
                self._forget(conn)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # its buffer is full: the loop is awake already

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TICK):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            conn = _Connection(sock, peer_name(sock), time.monotonic())
            if not self._make_room():
                self._refuse(conn, "busy", b"busy", f"all {self.max_connections} connections are serving pulls")
                continue
            tune(sock)
            with self._lock:
                self._connections.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _make_room(self) -> bool:
        """Whether a new connection may open: a slot is free, or the connection waiting longest for its
        request (or parked on an unknown request id) was closed for it."""
        with self._lock:
            if len(self._connections) < self.max_connections:
                return True
            idle = [c for c in self._connections if c.phase in _EVICTABLE]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.since)
            victim.evicted = True
            self._connections.discard(victim)
        logs.warn(logger, "pd_evicted", "KV transfer server: all %d connection slots in use; %s (%s for %.1fs) "
                  "closed to make room (counted in pd_server_refusals{reason=\"evicted\"})", self.max_connections,
                  victim.peer, victim.phase, time.monotonic() - victim.since)
        metrics.inc("pd_server_refusals", reason="evicted")
        if victim.phase == _READING:  # ours (the loop's): closed now
            self._forget(victim)
        else:  # a pull's thread parks on it: it sees `evicted` and closes it
            self._shutdown(victim.sock)
        return True

    def _read(self, conn: _Connection) -> None:
        try:
            n = conn.sock.recv_into(conn.reader.buffer()[:_RECV_BYTES])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:  # closed or reset: nothing to answer
            if conn.reader.started:
                metrics.inc("pd_server_refusals", reason="incomplete")
            self._forget(conn)
            return
        try:
            declared = conn.reader.declared
            parts = conn.reader.advance(n)
            if conn.reader.declared != declared:
                self._reserve(conn, conn.reader.declared)
            if parts is None:
                return
            request = wire.parse_request(parts)
        except wire.PeerProtocolError as exc:
            self._refuse(conn, "bad_request", b"bad_request", str(exc))
            return
        conn.reader = wire.RequestReader()
        if not wire.verify_request(request, self.mac):
            self._refuse(conn, "auth", b"auth" if request.op != wire.RELEASE else None,
                         "the request's MAC does not verify", request.req_id)
            return
        if request.op == wire.RELEASE:
            self._unreserve(conn)
            self.holds.release(request.req_id)
            with self._lock:
                conn.since = time.monotonic()
            return
        # A PULL or FETCH keeps its bytes reserved until it is answered: a pull parked on its hold (or on a
        # request id unknown here) holds its request's memory like one being read.
        self._selector.unregister(conn.sock)
        with self._lock:
            conn.phase, conn.since = _PENDING, time.monotonic()
        threading.Thread(target=self._serve_pull, args=(conn, request), name="lmcache-pd-pull",
                         daemon=True).start()

    def _reserve(self, conn: _Connection, nbytes: int) -> None:
        """Sets what `conn`'s request being read holds of `max_request_buffer`; over it, the connections
        reading or parked longest are closed first."""
        while True:
            with self._lock:
                self._buffered += nbytes - conn.reserved
                conn.reserved = nbytes
                nbytes = conn.reserved
                if self._buffered <= self.max_request_buffer:
                    return
                others = [c for c in self._connections
                          if c.phase in _EVICTABLE and c.reserved and c is not conn and not c.evicted]
                if not others:
                    return
                victim = min(others, key=lambda c: c.since)
                victim.evicted = True
                self._connections.discard(victim)
                buffered = self._buffered
            metrics.inc("pd_server_refusals", reason="evicted")
            logs.warn(logger, "pd_evicted", "KV transfer server: requests being read or parked hold %d bytes; %s "
                      "(%s) closed to make room", buffered, victim.peer, victim.phase)
            if victim.phase == _READING:  # ours (the loop's): closed now
                self._forget(victim)
            else:  # a pull's thread parks on it: its bytes go back now, the thread sees `evicted` and closes it
                self._unreserve(victim)
                self._shutdown(victim.sock)

    def _unreserve(self, conn: _Connection) -> None:
        """`conn`'s request holds nothing of `max_request_buffer` any more (any thread)."""
        with self._lock:
            self._buffered -= conn.reserved
            conn.reserved = 0

    def _drop_late(self) -> None:
        """Closes the connections whose request is not whole `request_timeout_s` after they began waiting."""
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._connections if c.phase == _READING and now - c.since > self.request_timeout_s]
        for conn in late:
            reason = "timeout" if conn.reader.started else "idle"
            metrics.inc("pd_server_refusals", reason=reason)
            logs.warn(logger, f"pd_{reason}", "KV transfer server: %s sent %s in %.1fs; closed (counted in "
                      "pd_server_refusals{reason=\"%s\"})", conn.peer, "no whole request" if conn.reader.started
                      else "nothing", self.request_timeout_s, reason)
            self._forget(conn)

    def _refuse(self, conn: _Connection, reason: str, code: Optional[bytes], detail: str, req_id: str = "") -> None:
        """Counts a refusal, answers it when `code` says so (at most what the socket takes at once: the loop
        never waits on a peer) and closes the connection."""
        metrics.inc("pd_server_refusals", reason=reason)
        logs.warn(logger, f"pd_refused_{reason}", "KV transfer server: refused %s%s: %s (counted in "
                  "pd_server_refusals)", conn.peer, f" (request {logs.peer_text(req_id)})" if req_id else "",
                  logs.peer_text(detail))
        if code is not None:
            try:
                conn.sock.send(wire.frame_bytes(wire.error_reply(code, detail)))
            except OSError:
                pass
        self._forget(conn)

    def _forget(self, conn: _Connection) -> None:
        """Closes a connection of the loop (its slot and reserved bytes go back)."""
        with self._lock:
            self._connections.discard(conn)
        self._unreserve(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._shutdown(conn.sock)
        conn.sock.close()

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------------ one PULL, on its own thread
    def _serve_pull(self, conn: _Connection, request: wire.PeerRequest) -> None:
        enter_background_cpus()
        keep = False
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(self.io_timeout_s)
            keep = self._fetch(conn, request) if request.op == wire.FETCH else self._pull(conn, request)
        except Exception:  # a bug here must not leak the connection or kill the server
            logs.warn(logger, "pd_server_error", "KV transfer connection error", exc_info=True)
        self._unreserve(conn)
        with self._lock:
            keep = keep and not conn.evicted and not self._stop.is_set() and conn in self._connections
            if keep:
                conn.phase, conn.since = _READING, time.monotonic()
            else:
                self._connections.discard(conn)
        if keep:  # the peer may send another request: the loop reads it
            conn.sock.setblocking(False)
            self._returned.put(conn)
            self._wake()
        else:
            self._shutdown(conn.sock)
            conn.sock.close()

    def _pull(self, conn: _Connection, request: wire.PeerRequest) -> bool:
        """Answers one PULL; False when the connection is no good any more."""
        since = time.monotonic()
        while True:
            try:
                checkout = self.holds.checkout(request.req_id, request.iter_keys())
            except DuplicateKey as exc:
                metrics.inc("pd_server_refusals", reason="bad_request")
                self._reply(conn, wire.error_reply(b"bad_request", str(exc)))
                return False
            state = checkout.state
            unknown = state == HoldState.UNKNOWN and time.monotonic() - since < self.unknown_grace_s
            if state != HoldState.PENDING and not unknown:
                break
            with self._lock:  # parked on an id unknown here: as idle as a peer that sends nothing
                conn.phase = _PARKED if unknown else _PENDING
            if conn.evicted or self._stop.wait(_PARKED_POLL_S):
                return False
        with self._lock:
            conn.phase = _SENDING
        if state != HoldState.READY:
            code = {HoldState.EXPIRED: b"expired", HoldState.FULL: b"full"}.get(state, b"unknown")
            return self._reply(conn, wire.error_reply(code, f"the hold is {state.value}"))
        if not checkout.objs and checkout.first_held_key:
            return self._reply(conn, wire.error_reply(
                b"keys", f"held under {wire.key_mismatch(checkout.first_held_key, request.first_key)}"))
        return self._send(conn, request, checkout)

    def _fetch(self, conn: _Connection, request: wire.PeerRequest) -> bool:
        """Answers one FETCH (P2P) from `by_key`; False when the connection is no good any more."""
        with self._lock:
            conn.phase = _SENDING
        try:
            checkout = self.by_key(request.iter_keys(), conn.host) if self.by_key is not None else None
        except DuplicateKey as exc:
            metrics.inc("pd_server_refusals", reason="bad_request")
            self._reply(conn, wire.error_reply(b"bad_request", str(exc)))
            return False
        if checkout is None or checkout.state != HoldState.READY:
            return self._reply(conn, wire.error_reply(b"auth", "this instance serves no P2P chunks to this peer"))
        return self._send(conn, request, checkout)

    def _send(self, conn: _Connection, request: wire.PeerRequest, checkout: Checkout) -> bool:
        return send_chunks(conn.sock, conn.peer, request, checkout, release=self.holds.sent,
                           io_timeout_s=self.io_timeout_s)

    def _reply(self, conn: _Connection, frames: list[bytes]) -> bool:
        return send_reply(conn.sock, frames, self.io_timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        with self._lock:
            count = len(self._connections)
        yield "pd_server_connections", {}, count

    def _close_all(self) -> None:
        """On the loop's way out: the listener and every connection it reads are closed."""
        with self._lock:
            reading = [c for c in self._connections if c.phase == _READING]
        for conn in reading:
            self._forget(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    def close(self) -> None:
        self._unregister()
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        with self._lock:
            serving = list(self._connections)
        for conn in serving:
            self._shutdown(conn.sock)  # wakes its thread; the thread closes it
