"""`Releases`: RELEASEs to prefill instances (a decode instance is done with a hold), sent from one daemon
thread so that no caller ever waits, fire and forget: a RELEASE that does not arrive costs the prefill
instance its hold's lease, nothing more.

Nothing one destination does delays another's: each destination (an address and a port) has its own queue
of at most `max_queued` RELEASEs (past it the oldest is dropped), and at most one connection at a time, opened
without blocking (a non-blocking connect: a destination that drops SYNs never holds the thread) and closed
`timeout_s` after it was opened, whatever it got through; every RELEASE queued for the destination goes out
on that one connection. At most `max_connections` destinations are connected to at once and at most
`max_destinations` have RELEASEs waiting (past it a new one's are dropped). A RELEASE older than `max_age_s`
is dropped unsent (the hold has expired anyway). Every drop is counted in `pd_releases_dropped{reason}`.
Nothing a peer does ends the thread, and a dead one is started again by the next `put`.
"""
from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.observability import logs, metrics

logger = logging.getLogger(__name__)

Destination = tuple[str, int]  # an IP address (checked: never a name) and a port


@dataclass(eq=False)
class _Connection:
    destination: Destination
    sock: socket.socket
    opened: float
    data: bytearray = field(default_factory=bytearray)
    connected: bool = False


class Releases:
    """See the module docstring. `put(address, port, frame)` queues one RELEASE's bytes."""

    def __init__(self, *, timeout_s: float = 1.0, max_age_s: float = 30.0, max_queued: int = 64,
                 max_connections: int = 32, max_destinations: int = 1024):
        self.timeout_s = float(timeout_s)
        self.max_age_s = float(max_age_s)
        self.max_queued = int(max_queued)
        self.max_connections = int(max_connections)
        self.max_destinations = int(max_destinations)
        self._lock = threading.Lock()
        self._queues: dict[Destination, deque[tuple[float, bytes]]] = {}
        self._thread: Optional[threading.Thread] = None
        self._wake_r: Optional[socket.socket] = None  # made with the thread (a forked process makes its own)
        self._wake_w: Optional[socket.socket] = None

    def put(self, address: str, port: int, frame: bytes) -> None:
        dropped = ""
        with self._lock:
            queue = self._queues.get((address, port))
            if queue is None:
                if len(self._queues) >= self.max_destinations:
                    dropped = "destinations"
                else:
                    queue = self._queues[(address, port)] = deque()
            if queue is not None:
                if len(queue) >= self.max_queued:
                    queue.popleft()
                    dropped = "queue_full"
                queue.append((time.monotonic(), frame))
            if self._thread is None or not self._thread.is_alive():
                for sock in (self._wake_r, self._wake_w):
                    if sock is not None:
                        sock.close()
                self._wake_r, self._wake_w = socket.socketpair()
                self._wake_r.setblocking(False)
                self._wake_w.setblocking(False)
                self._thread = threading.Thread(target=self._run, args=(self._wake_r,), name="lmcache-pd-release",
                                                daemon=True)
                self._thread.start()
            wake = self._wake_w
        if dropped:
            metrics.inc("pd_releases_dropped", reason=dropped)
        try:
            if wake is not None:  # (always: made with the thread, above)
                wake.send(b"\0")
        except OSError:
            pass  # its buffer is full: the thread is awake already

    def pending(self) -> int:
        """RELEASEs queued and not yet on a connection (for tests and gauges)."""
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    # ------------------------------------------------------------------ the thread
    def _run(self, wake: socket.socket) -> None:
        enter_background_cpus()
        selector = selectors.DefaultSelector()
        selector.register(wake, selectors.EVENT_READ, None)
        open_: dict[Destination, _Connection] = {}
        while True:
            try:
                self._open_more(selector, open_)
                for key, _ in selector.select(self._next_wait(open_)):
                    if key.data is None:
                        self._drain_wake(wake)
                    else:
                        self._progress(selector, open_, key.data)
                self._close_late(selector, open_)
            except Exception:  # never a dead thread: a hold expires anyway
                logs.warn(logger, "pd_release_failed", "sending RELEASEs failed", exc_info=True)
                time.sleep(0.1)

    @staticmethod
    def _drain_wake(wake: socket.socket) -> None:
        try:
            while wake.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _next_wait(self, open_: dict[Destination, _Connection]) -> float:
        if not open_:
            return 1.0
        first = min(c.opened for c in open_.values())
        return max(0.0, min(1.0, first + self.timeout_s - time.monotonic()))

    def _open_more(self, selector: selectors.BaseSelector, open_: dict[Destination, _Connection]) -> None:
        """Takes the queued RELEASEs of destinations with none open, and opens their connections."""
        now = time.monotonic()
        taken: list[tuple[Destination, bytearray]] = []
        stale = 0
        with self._lock:
            for destination in list(self._queues):
                if destination in open_:
                    continue
                if len(open_) + len(taken) >= self.max_connections:
                    break
                queue = self._queues.pop(destination)
                data = bytearray()
                for queued, frame in queue:
                    if now - queued > self.max_age_s:
                        stale += 1
                    else:
                        data += frame
                if data:
                    taken.append((destination, data))
        if stale:
            metrics.inc("pd_releases_dropped", stale, reason="stale")
        for destination, data in taken:
            host, port = destination
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            conn = _Connection(destination, sock, time.monotonic(), data)
            code = sock.connect_ex((host, port))  # an address: no name lookup, and never a wait
            if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                sock.close()
                metrics.inc("pd_releases_dropped", reason="unreachable")
                continue
            open_[destination] = conn
            selector.register(sock, selectors.EVENT_WRITE, conn)

    def _progress(self, selector: selectors.BaseSelector, open_: dict[Destination, _Connection],
                  conn: _Connection) -> None:
        try:
            if not conn.connected:
                code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, "connect failed")
                conn.connected = True
            sent = conn.sock.send(conn.data)
            del conn.data[:sent]
            if conn.data:
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            metrics.inc("pd_releases_dropped", reason="unreachable")
        self._close(selector, open_, conn)

    def _close_late(self, selector: selectors.BaseSelector, open_: dict[Destination, _Connection]) -> None:
        now = time.monotonic()
        for conn in [c for c in open_.values() if now - c.opened > self.timeout_s]:
            metrics.inc("pd_releases_dropped", reason="timeout")
            logs.warn(logger, "pd_release_timeout", "RELEASE to %s:%d not sent within %.1fs (a prefill instance "
                      "gone or dropping connections): its hold expires with its lease", conn.destination[0],
                      conn.destination[1], self.timeout_s)
            self._close(selector, open_, conn)

    @staticmethod
    def _close(selector: selectors.BaseSelector, open_: dict[Destination, _Connection], conn: _Connection) -> None:
        open_.pop(conn.destination, None)
        try:
            selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
