"""vLLM's `kv_transfer_params` for disaggregated prefill, as lmcache-vllm writes (prefill side) and reads
(decode side) them. See docs/DISAGGREGATED.md for the protocol.

A request sent to the prefill instance P carries `{"do_remote_decode": true, ...}` (vLLM's toy proxy also
sends `do_remote_prefill: false` and null `remote_*` fields); P answers with `prefill_params(...)`: vLLM's
field names (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
`tp_size`, `remote_num_tokens`) plus ours under `PARAMS_KEY` (protocol version, every TP rank's port, chunk
size; with a chunk MAC key also the scope of its keys, an expiry and a signature over all of them). Beside
another connector of a MultiConnector that may answer kv_transfer_params too (`namespaced`), P puts all of it
under `PARAMS_KEY` only, vLLM's field names included, so no key of the answer is shared (vLLM's MultiConnector
raises on a shared key); D reads either form. The decode instance D gets that dict back from the proxy, i.e.
from a client: `parse_remote_prefill` checks every field before anything is done with it (request id charset
and length, host syntax, port range and count, bounds of every number) and turns it into a `RemotePrefill`,
or says in one `PDRefusal` why it cannot pull (and the request is recomputed): params of another connector, a
broken or malformed dict, another protocol version, TP size or chunk size. Whether D may connect to the host
is `trust.py`'s question. Plain dicts in, plain dicts out: no vLLM import.
"""
from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from lmcache_vllm.config.extra import MAX_RANKS
from lmcache_vllm.config.peers import check_host, check_request_id
from lmcache_vllm.storage.transfer.wire import PROTOCOL_VERSION

if TYPE_CHECKING:
    from lmcache_vllm.storage.codec import ChunkMac

PARAMS_KEY = "lmcache_vllm"
MAX_PROMPT_TOKENS = 1 << 31
MAX_CHUNK_SIZE = 1 << 20
_SIG_CONTEXT = b"lmcache-vllm pd params v1"
_PROXY_CONTEXT = b"lmcache-vllm pd proxy v1"
PROXY_AUTH_S = 60  # how long a proxy's authorization of a request to a prefill instance is valid
_U32 = struct.Struct("<I")


class PDRefusal(ValueError):
    """Why a decode instance does not pull a request's KV: `reason` (a metric label) and a message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefilled KV waits (the decode side's reading of the params). `address`, `trust`
    and `label` are `trust.PeerTrust`'s: the address D connects to (an IP literal), why it may
    ("signed", "listed", "own") and the peer's metric label."""

    engine_id: str
    req_id: str  # the request's id on the prefill instance: the name of its hold
    host: str
    ports: tuple[int, ...]  # one per tensor-parallel rank of the prefill instance
    tp_size: int
    num_tokens: int  # prompt tokens the prefill instance computed
    chunk_size: int
    scope: str = ""  # signed params: the scope of the prefill instance's keys (model fingerprint)
    expires: Optional[int] = None  # signed params: not pulled after this (Unix time)
    sig: Optional[str] = None  # signed params: hex of the MAC over `signed_bytes`
    address: str = ""
    trust: str = ""
    label: str = "other"


def wants_remote_decode(params: Any) -> bool:
    """The prefill side: this request's KV goes to a decode instance."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def proxy_params(mac: ChunkMac, now: float | None = None) -> dict[str, Any]:
    """The kv_transfer_params a proxy holding the chunk MAC key sends a prefill instance: `do_remote_decode`
    with an authorization valid for `PROXY_AUTH_S`, so that an instance where disaggregated prefill is not
    configured explicitly holds the request for its decode instance (`proxy_authorized`)."""
    expires = int((time.time() if now is None else now) + PROXY_AUTH_S)
    return {"do_remote_decode": True, PARAMS_KEY: {"proxy_expires": expires,
                                                   "proxy_sig": mac.compute(_proxy_bytes(expires), b"").hex()}}


def _proxy_bytes(expires: int) -> bytes:
    data = str(expires).encode()
    return _U32.pack(len(_PROXY_CONTEXT)) + _PROXY_CONTEXT + _U32.pack(len(data)) + data


def proxy_authorized(params: Any, mac: Optional[ChunkMac], now: float | None = None) -> Optional[bool]:
    """Whether a request's `do_remote_decode` comes from a proxy holding the chunk MAC key (`proxy_params`):
    None when it carries no authorization, False when one that does not verify (another key, expired, or
    valid for longer than a proxy gives)."""
    ours = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
    if not isinstance(ours, Mapping) or "proxy_sig" not in ours:
        return None
    expires, sig = ours.get("proxy_expires"), ours.get("proxy_sig")
    now = time.time() if now is None else now
    if mac is None or isinstance(expires, bool) or not isinstance(expires, int) or not isinstance(sig, str):
        return False
    if not now - 30 <= expires <= now + PROXY_AUTH_S + 30:  # 30 s of clock skew
        return False
    try:
        tag = bytes.fromhex(sig)
    except ValueError:
        return False
    return mac.verify(_proxy_bytes(expires), b"", tag)


def _namespaced(params: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Our params when they came in the namespaced form (everything under `PARAMS_KEY`), else None."""
    ours = params.get(PARAMS_KEY)
    return ours if isinstance(ours, Mapping) and ours.get("do_remote_prefill") else None


def wants_remote_prefill(params: Any) -> bool:
    """The decode side: this request's KV was computed by a prefill instance (either form of the params)."""
    if not isinstance(params, Mapping):
        return False
    return bool(params.get("do_remote_prefill")) or _namespaced(params) is not None


def signed_bytes(remote: RemotePrefill) -> bytes:
    """What the params' signature covers: every field D uses, each length-prefixed (no separator to forge)."""
    fields = (_SIG_CONTEXT, remote.engine_id, remote.req_id, remote.host, ",".join(map(str, remote.ports)),
              str(remote.tp_size), str(remote.num_tokens), str(remote.chunk_size), remote.scope, str(remote.expires))
    out = bytearray()
    for f in fields:
        data = f if isinstance(f, bytes) else f.encode("utf-8")
        out += _U32.pack(len(data)) + data
    return bytes(out)


def sign(remote: RemotePrefill, mac: ChunkMac) -> str:
    return mac.compute(signed_bytes(remote), b"").hex()


def prefill_params(*, engine_id: str, req_id: str, host: str, ports: list[int], num_tokens: int,
                   chunk_size: int, mac: Optional[ChunkMac] = None, scope: str = "",
                   expires: Optional[int] = None, namespaced: bool = False) -> dict[str, Any]:
    """What the prefill instance returns from `request_finished` for vLLM to put into its answer; with `mac`
    (the chunk MAC key) signed for `scope` until `expires`; `namespaced`: all of it under `PARAMS_KEY`."""
    ours: dict[str, Any] = {"version": PROTOCOL_VERSION, "ports": list(ports), "chunk_size": chunk_size}
    if mac is not None:
        remote = RemotePrefill(engine_id, req_id, host, tuple(ports), len(ports), num_tokens, chunk_size,
                               scope, expires)
        ours.update(scope=scope, expires=expires, sig=sign(remote, mac))
    vllm_fields = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": engine_id, "remote_request_id": req_id,
        "remote_host": host, "remote_port": ports[0], "tp_size": len(ports),
        "remote_num_tokens": num_tokens, "remote_block_ids": None,
    }
    return {PARAMS_KEY: {**vllm_fields, **ours}} if namespaced else {**vllm_fields, PARAMS_KEY: ours}


def _int(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer from {low} to {high}")
    return value


def _engine_id(value: Any) -> str:
    """vLLM's engine id of the prefill instance (any name its operator gave; never sent anywhere, only signed)."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 256 or not value.isprintable():
        raise ValueError("remote_engine_id must be at most 256 printable characters")
    return value


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """The decode side's `RemotePrefill` of `params` (which ask for a remote prefill), every field checked,
    or `PDRefusal`."""
    namespaced = _namespaced(params)
    if namespaced is not None:  # vLLM's fields and ours side by side under our key
        params = namespaced
    ours = namespaced if namespaced is not None else params.get(PARAMS_KEY)
    if not isinstance(ours, Mapping):
        raise PDRefusal("bad_params", "kv_transfer_params name no lmcache-vllm prefill instance (another "
                                      "connector's params?)")
    if ours.get("version") != PROTOCOL_VERSION:
        version = ours.get("version")
        shown = version if isinstance(version, int) and not isinstance(version, bool) else "another"
        raise PDRefusal("bad_params", f"the prefill instance speaks transfer protocol version {shown}, this "
                                      f"one {PROTOCOL_VERSION}")
    try:
        tp_size = _int(params.get("tp_size"), 1, MAX_RANKS, "tp_size")
        raw_ports = ours.get("ports")
        if not isinstance(raw_ports, (list, tuple)) or len(raw_ports) != tp_size:
            raise ValueError("one port per TP rank of the prefill instance (tp_size of them)")
        ports = tuple(_int(p, 1, 65535, "a port") for p in raw_ports)
        if len(set(ports)) != len(ports):
            raise ValueError("a port named twice (each TP rank of the prefill instance has its own)")
        if params.get("remote_port") is not None and params.get("remote_port") != ports[0]:
            raise ValueError("remote_port must be rank 0's port")
        engine_id = params.get("remote_engine_id")
        sig, expires = ours.get("sig"), ours.get("expires")
        remote = RemotePrefill(
            engine_id=_engine_id(engine_id),
            req_id=check_request_id(params.get("remote_request_id"), "remote_request_id"),
            host=check_host(params.get("remote_host")), ports=ports, tp_size=tp_size,
            num_tokens=_int(params.get("remote_num_tokens"), 0, MAX_PROMPT_TOKENS, "remote_num_tokens"),
            chunk_size=_int(ours.get("chunk_size"), 1, MAX_CHUNK_SIZE, "chunk_size"),
            scope=check_request_id(ours["scope"], "scope") if ours.get("scope") is not None else "",
            expires=_int(expires, 0, 1 << 40, "expires") if expires is not None else None,
            sig=check_request_id(sig, "sig", 128) if sig is not None else None)
    except ValueError as exc:
        raise PDRefusal("bad_params", f"malformed lmcache-vllm kv_transfer_params: {exc}") from None
    return remote


def check_compatible(remote: RemotePrefill, *, tp_size: int, chunk_size: int) -> None:
    """`PDRefusal` when this decode instance cannot use what `remote` holds (TP size, chunk size)."""
    if remote.tp_size != tp_size:
        raise PDRefusal("tp_mismatch", f"the prefill instance runs tensor_parallel_size={remote.tp_size}, this "
                                       f"decode instance {tp_size}: each rank holds its own heads' KV, and "
                                       f"lmcache-vllm does not reshard it between TP sizes; run both with the "
                                       f"same TP size")
    if remote.chunk_size != chunk_size:
        raise PDRefusal("bad_params", f"the prefill instance stores {remote.chunk_size}-token chunks, this "
                                      f"one {chunk_size}: set the same chunk_size on both")


def bind_host(pd_host: str | None) -> str:
    """Where the transfer servers listen: `pd_host`, else as vLLM's NIXL connector finds its side channel."""
    return pd_host or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost"


def advertised_host(pd_host: str | None) -> str:
    """The host a prefill instance names in its params (an every-interface bind names vLLM's host IP)."""
    host = bind_host(pd_host)
    if host in ("0.0.0.0", "*", "::"):
        from vllm.utils.network_utils import get_ip

        return get_ip()
    return host
