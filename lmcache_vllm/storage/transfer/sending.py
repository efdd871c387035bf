"""How a transfer server answers a pull once it knows what to send (`server.py` decides that): the chunks of a
`holds.Checkout`, each as a CHUNK message straight from the L1 arena, then END (`send_chunks`); or one reply
alone (`send_reply`). Every send is bounded by the server's I/O timeout, and the chunks' sends by the hold's
lease: a peer reading slowly is cut off when the lease ends, so nothing stays pinned past it. The chunks'
references go back (`release`) as soon as their bytes are in the kernel's buffers, or the send failed. The rate
a pull's sends reached feeds `serde.LINK` (what `transfer_serde: auto` decides by).
"""
from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Callable, Sequence

from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.holds import Checkout
from lmcache_vllm.storage.transfer.serde import LINK
from lmcache_vllm.storage.transfer.sockets import LeaseOver, send_message

if TYPE_CHECKING:
    from lmcache_vllm.memory import MemoryObj

logger = logging.getLogger(__name__)


def send_chunks(sock: socket.socket, peer: str, request: wire.PeerRequest, checkout: Checkout, *,
                release: Callable[[Sequence["MemoryObj"]], None], io_timeout_s: float) -> bool:
    """Sends `checkout`'s chunks and END; False when the connection is no good any more (cut off at the
    lease's end, stalled for `io_timeout_s`, or gone)."""
    objs: list[MemoryObj] = checkout.objs
    deadline = time.monotonic() + checkout.expires_in
    sent_bytes = sent = wire_bytes = 0
    payloads = checkout.payloads or (None,) * len(objs)
    start = time.monotonic()
    try:
        for index, (obj, key, header, payload) in enumerate(zip(objs, checkout.keys, checkout.headers, payloads)):
            message = wire.chunk_reply(index, key, obj.tensor, header=header, payload=payload)
            send_message(sock, message, deadline=deadline, io_timeout_s=io_timeout_s)
            sent_bytes += obj.nbytes
            wire_bytes += memoryview(message[-1]).nbytes
            sent += 1
        LINK.observe(wire_bytes, time.monotonic() - start)
        release(objs)  # every byte is in the kernel's buffers: the chunks may go
        objs = []
        send_message(sock, wire.end_reply(sent), io_timeout_s=io_timeout_s)
        if request.op == wire.PULL:  # a FETCH's chunks are P2P's, counted by its source (keyed.py)
            metrics.inc("pd_served_chunks", len(checkout.objs))
            metrics.inc("pd_served_bytes", sent_bytes)
        return True
    except LeaseOver:
        metrics.inc("pd_server_refusals", reason="lease")
        logs.warn(logger, "pd_send_lease", "request %s: %s still reading when the hold's lease ended "
                  "(extra_config.pd_hold_secs); cut off after %d of %d chunks, their references dropped",
                  logs.peer_text(request.req_id), peer, sent, len(checkout.objs))
        return False
    except TimeoutError:
        metrics.inc("pd_server_refusals", reason="stalled")
        logs.warn(logger, "pd_send_stalled", "request %s: %s read nothing for %.0fs; cut off",
                  logs.peer_text(request.req_id), peer, io_timeout_s)
        return False
    except OSError as exc:  # the peer went away or stopped reading: it recomputes what it lacks
        logs.warn(logger, "pd_peer_gone", "request %s: %s gone while sending (%s)",
                  logs.peer_text(request.req_id), peer, exc)
        return False
    finally:
        release(objs)  # sent, cut off or failed: nothing stays pinned for this pull


def send_reply(sock: socket.socket, frames: list[bytes], io_timeout_s: float) -> bool:
    """Sends one reply; False when the peer went away."""
    try:
        send_message(sock, frames, io_timeout_s=io_timeout_s)
        return True
    except OSError:
        return False
