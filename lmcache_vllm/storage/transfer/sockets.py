"""Socket helpers of the transfer between instances: where a transfer server binds (`bind_address`), how a
transfer connection is tuned (`tune`), one framed message sent whole from where its parts are, within an I/O
timeout and a deadline (`send_message`), one request received on a blocking socket (`recv_request`)."""
from __future__ import annotations

import socket
import time
from typing import Optional, Sequence

from lmcache_vllm.storage.transfer import wire

_SOCKET_BUFFER = 4 << 20  # bytes: whole chunks in flight per connection
_RECV_BYTES = 1 << 16  # one read of a request at most


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


class LeaseOver(Exception):
    """A send still running when the hold's lease ended."""


def send_message(sock: socket.socket, parts: Sequence[bytes | memoryview], *, deadline: Optional[float] = None,
                 io_timeout_s: Optional[float] = None) -> None:
    """Sends one framed message, every byte (sendmsg: the parts leave from where they are); `TimeoutError`
    when the peer reads nothing for `io_timeout_s`, `LeaseOver` past `deadline` (monotonic)."""
    views = [memoryview(p).cast("B") for p in wire.frame(parts)]
    while views:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LeaseOver()
            sock.settimeout(left if io_timeout_s is None else min(left, io_timeout_s))
        elif io_timeout_s is not None:
            sock.settimeout(io_timeout_s)
        try:
            sent = sock.sendmsg(views)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise LeaseOver() from None
            raise
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def recv_request(sock: socket.socket) -> list[bytes]:
    """The parts of one request from a blocking socket (a peer in tests); `PeerProtocolError` for a prefix
    out of bounds, `ConnectionError` when the peer closes first."""
    reader = wire.RequestReader()
    while True:
        n = sock.recv_into(reader.buffer()[:_RECV_BYTES])
        if not n:
            raise ConnectionError("peer closed the connection")
        parts = reader.advance(n)
        if parts is not None:
            return [bytes(p) for p in parts]


def peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
