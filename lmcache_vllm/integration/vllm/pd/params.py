"""vLLM's `kv_transfer_params` for disaggregated prefill, as lmcache-vllm writes (prefill side) and reads
(decode side) them. See docs/DISAGGREGATED.md for the protocol.

A request sent to the prefill instance P carries `{"do_remote_decode": true, ...}` (vLLM's toy proxy also
sends `do_remote_prefill: false` and null `remote_*` fields); P answers with `prefill_params(...)`: vLLM's
field names (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
`tp_size`, `remote_num_tokens`) plus ours under `PARAMS_KEY` (protocol version, every TP rank's port, chunk
size). Beside another connector of a MultiConnector that may answer kv_transfer_params too (`namespaced`), P
puts all of it under `PARAMS_KEY` only, vLLM's field names included, so no key of the answer is shared (vLLM's
MultiConnector raises on a shared key); D reads either form. The decode instance D gets that dict back from the
proxy and `parse_remote_prefill` turns it into a
`RemotePrefill`, or says in one `PDRefusal` why it cannot pull (and the request is recomputed): params of
another connector, a broken dict, another protocol version, TP size or chunk size. Plain dicts in, plain
dicts out: no vLLM import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from lmcache_vllm.storage.transfer.wire import PROTOCOL_VERSION

PARAMS_KEY = "lmcache_vllm"
_MAX_PORTS = 256


class PDRefusal(ValueError):
    """Why a decode instance does not pull a request's KV: `reason` (a metric label) and a message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefilled KV waits (the decode side's reading of the params)."""

    engine_id: str
    req_id: str  # the request's id on the prefill instance: the name of its hold
    host: str
    ports: tuple[int, ...]  # one per tensor-parallel rank of the prefill instance
    tp_size: int
    num_tokens: int  # prompt tokens the prefill instance computed
    chunk_size: int


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The prefill side: this request's KV goes to a decode instance."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


def _namespaced(params: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Our params when they came in the namespaced form (everything under `PARAMS_KEY`), else None."""
    ours = params.get(PARAMS_KEY)
    return ours if isinstance(ours, Mapping) and ours.get("do_remote_prefill") else None


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The decode side: this request's KV was computed by a prefill instance (either form of the params)."""
    if not params:
        return False
    return bool(params.get("do_remote_prefill")) or _namespaced(params) is not None


def prefill_params(*, engine_id: str, req_id: str, host: str, ports: list[int], num_tokens: int,
                   chunk_size: int, namespaced: bool = False) -> dict[str, Any]:
    """What the prefill instance returns from `request_finished` for vLLM to put into its answer (`namespaced`:
    all of it under `PARAMS_KEY`)."""
    vllm_fields = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": engine_id, "remote_request_id": req_id,
        "remote_host": host, "remote_port": ports[0], "tp_size": len(ports),
        "remote_num_tokens": num_tokens, "remote_block_ids": None,
    }
    ours = {"version": PROTOCOL_VERSION, "ports": list(ports), "chunk_size": chunk_size}
    return {PARAMS_KEY: {**vllm_fields, **ours}} if namespaced else {**vllm_fields, PARAMS_KEY: ours}


def _int(value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(value)
    return value


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """The decode side's `RemotePrefill` of `params` (which ask for a remote prefill), or `PDRefusal`."""
    namespaced = _namespaced(params)
    if namespaced is not None:  # vLLM's fields and ours side by side under our key
        params = namespaced
    ours = namespaced if namespaced is not None else params.get(PARAMS_KEY)
    if not isinstance(ours, Mapping):
        raise PDRefusal("bad_params", "kv_transfer_params name no lmcache-vllm prefill instance (another "
                                      "connector's params?)")
    if ours.get("version") != PROTOCOL_VERSION:
        raise PDRefusal("bad_params", f"the prefill instance speaks transfer protocol version "
                                      f"{ours.get('version')!r}, this one {PROTOCOL_VERSION}")
    try:
        ports = tuple(_int(p, 1, 65535) for p in ours["ports"])
        remote = RemotePrefill(
            engine_id=str(params.get("remote_engine_id") or ""), req_id=str(params["remote_request_id"]),
            host=str(params["remote_host"]), ports=ports, tp_size=_int(params["tp_size"], 1, _MAX_PORTS),
            num_tokens=_int(params.get("remote_num_tokens"), 0, 1 << 40),
            chunk_size=_int(ours["chunk_size"], 1, 1 << 30))
    except (KeyError, TypeError, ValueError) as exc:
        raise PDRefusal("bad_params", f"malformed lmcache-vllm kv_transfer_params ({type(exc).__name__}: "
                                      f"{exc})") from None
    if not remote.host or not remote.req_id or len(remote.ports) != remote.tp_size:
        raise PDRefusal("bad_params", "malformed lmcache-vllm kv_transfer_params (host, request id or one "
                                      "port per TP rank missing)")
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
