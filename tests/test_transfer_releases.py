"""RELEASEs to prefill instances (storage/transfer/releases.py), with real sockets: a destination that drops
SYNs (a listener whose accept queue is full) delays only its own RELEASEs, never another destination's, and
queues stay bounded (issue 39 #3: before, one thread sent every RELEASE in turn with a 1 s connect timeout,
so 256 RELEASEs to one such address made every honest RELEASE arrive 20-30 s late, and the queue had no
bound)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.client import PeerSource, send_release
from lmcache_vllm.storage.transfer.releases import Releases
from lmcache_vllm.storage.transfer.sockets import recv_request


@pytest.fixture
def syn_dropper():
    """A listener that never accepts, its accept queue full: every further connect waits for a SYN-ACK."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    time.sleep(0.2)
    yield port
    for s in fillers:
        s.close()
    listener.close()


class Receiver:
    """A destination that accepts and records the request ids of the RELEASEs it is sent."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.got: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    while True:
                        parts = recv_request(conn)
                        self.got.append((time.monotonic(), wire.parse_request(parts).req_id))
                except (ConnectionError, OSError, wire.PeerProtocolError):
                    pass

    def close(self) -> None:
        self.listener.close()


def test_a_destination_that_drops_syns_never_delays_another(syn_dropper):
    receiver = Receiver()
    try:
        for i in range(300):  # a forger's fan-out to one address that drops SYNs
            send_release(PeerSource("127.0.0.1", syn_dropper, f"forged-{i}"))
        t0 = time.monotonic()
        send_release(PeerSource("127.0.0.1", receiver.port, "honest"))
        deadline = time.monotonic() + 5
        while not receiver.got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r for _, r in receiver.got] == ["honest"]
        assert receiver.got[0][0] - t0 < 0.5  # at once: not behind the other destination's connects
    finally:
        receiver.close()


def test_queues_are_bounded_per_destination_and_in_number(syn_dropper):
    releases = Releases(timeout_s=0.5, max_queued=8, max_destinations=4)
    frame = wire.frame_bytes(wire.encode_request(wire.RELEASE, "r"))
    for _ in range(100):
        releases.put("127.0.0.1", syn_dropper, frame)
    assert releases.pending() <= 8 + 0  # the connection in flight took some; the queue never grows past 8
    assert metrics.value("pd_releases_dropped", reason="queue_full") >= 100 - 8 - 8
    for port in range(1, 10):  # more destinations than it keeps queues for
        releases.put("192.0.2.1", port, frame)
    assert metrics.value("pd_releases_dropped", reason="destinations") >= 9 - 4
    deadline = time.monotonic() + 5
    while metrics.value("pd_releases_dropped", reason="timeout") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics.value("pd_releases_dropped", reason="timeout") >= 1  # the SYN dropper's connection gave up


def test_every_queued_release_of_a_destination_goes_out_on_one_connection():
    receiver = Receiver()
    releases = Releases()
    try:
        for i in range(20):
            releases.put("127.0.0.1", receiver.port, wire.frame_bytes(wire.encode_request(wire.RELEASE, f"r{i}")))
        deadline = time.monotonic() + 5
        while len(receiver.got) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(r for _, r in receiver.got) == sorted(f"r{i}" for i in range(20))
        assert releases.pending() == 0
    finally:
        receiver.close()
