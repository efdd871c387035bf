"""The scheduler half's part of disaggregated prefill (docs/DISAGGREGATED.md), per request:

- Prefill side (`do_remote_decode`): the request holds (`should_hold`: a saving role, keys for it, and a
  request this instance holds for: any client's where disaggregated prefill is configured explicitly
  (`hold_for_any_client`: `pd: on` with a chunk MAC key, or `pd_peers`), else only a proxy's that holds the
  key (`params.proxy_authorized`); any other is answered without kv_transfer_params, so a plain client can
  neither pin L1 for a lease nor learn this instance's transfer ports); in the step its prompt completes the
  scheduler half emits a `PeerHoldSpec`; `finished` gives the params vLLM puts into the answer (P's address,
  every TP rank's transfer port, asked from the workers once; all under our own key with
  `namespaced_params`, beside another connector of a MultiConnector) or, for an aborted request, drops the
  hold. A ledger of the holds emitted (tokens each, until the workers report the hold ended or its lease is
  over) keeps them under the workers' cap (`extra_config.pd_max_held_bytes`, reported in tokens: `heard`): a
  request that would go over it is not held (`admit_hold`) and answered without params, so its decode
  instance recomputes at once, with no pull. The workers still refuse a hold over the cap when it is filled
  (the ledger hears of ended holds a step late, and counts a partial L1 prefix as whole).
- Decode side (`do_remote_prefill`): `remote_prefill` reads the params and says whether this instance pulls:
  params checked field by field (`params.py`), a prefill instance this instance may connect to (`trust.py`:
  signed params with a chunk MAC key, else the ports `pd_peers` lists or this instance's own), a loading
  role, keys for the request, the same TP and chunk size, a model of one KV cache group. A host name is
  resolved off this thread: until it is, `remote_prefill` answers `PENDING` (vLLM asks again next step), and
  past the trust's `resolve_timeout_s` the request is refused as unresolved. A refusal is logged once per
  reason with what to change, counted in `pd_pull_failures{reason}`, and an admitted prefill instance of the
  same TP and chunk size is told at once (RELEASE) so its hold does not wait for its lease; anything else is
  sent nothing. `done_with` tells it when this instance will not pull after all (nothing left to pull, the
  request ended first).
The releases and dropped holds reach the workers with the next step's metadata (`take_into`).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from lmcache_vllm.integration.vllm.events import HoldReport
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, PeerSpec
from lmcache_vllm.integration.vllm.pd.params import (
    PDRefusal,
    RemotePrefill,
    check_compatible,
    parse_remote_prefill,
    prefill_params,
    proxy_authorized,
    wants_remote_decode,
    wants_remote_prefill,
)
from lmcache_vllm.integration.vllm.pd.trust import PENDING, PeerTrust, Pending
from lmcache_vllm.observability import logs, metrics

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_ANSWERED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # statuses of a prefill that produced its token
_LEDGER_SLACK_S = 5.0  # a ledger entry outlives its hold's lease by this (the workers' clock runs apart)
_OWN_PORTS_ASK_S = 30.0  # the workers are asked for this instance's own ports at most this often (decode side)
MAX_PENDING = 4096  # requests waiting for their prefill instance's name to resolve; past it: refused


def peer_spec(remote: RemotePrefill) -> PeerSpec:
    """The workers' spec of an admitted `remote` (`PeerTrust.admit`): its checked address, not its name."""
    return PeerSpec(remote.req_id, remote.address, remote.ports, remote.label)


class PDScheduler:
    """See the module docstring. `ask_ports()` asks the workers for their transfer ports (None: no answer).
    `trust`: which prefill instances this one pulls from (default: none but its own ports, no key); with its
    MAC key this instance signs its own params for `trust.scope`, valid for `hold_s`. `grouped`: a model of
    several KV cache groups (no PD on the decode side). `hold_for_any_client`: disaggregated prefill is
    configured explicitly, so any client's `do_remote_decode` is held for (else only a key-holding proxy's)."""

    def __init__(self, *, engine_id: str, host: str, chunk_size: int, tp_size: int,
                 ask_ports: Callable[[], list[int] | None], can_load: bool, can_save: bool,
                 trust: PeerTrust | None = None, hold_s: float = 30.0, grouped: bool = False,
                 namespaced_params: bool = False, hold_for_any_client: bool = False):
        self.engine_id = engine_id
        self.host = host
        self.chunk_size = chunk_size
        self.tp_size = tp_size
        self._ask_ports = ask_ports
        self.can_load = can_load
        self.can_save = can_save
        self.trust = trust if trust is not None else PeerTrust()
        self.hold_s = hold_s
        self.grouped = grouped
        self.namespaced_params = namespaced_params
        self.hold_for_any_client = hold_for_any_client
        self._ports: list[int] | None = None
        self._next_own_ask = 0.0
        self._pending: dict[str, float] = {}  # request id -> when its prefill instance's name began to resolve
        if can_save:
            self.trust.own_ports = self._own_ports
        self._warned: set[str] = set()
        self._releases: list[PeerSpec] = []
        self._unholds: list[str] = []
        self._cap_tokens = 0  # the prefill ranks' cap on held KV, in tokens (0: none, or not heard yet)
        self._held: dict[str, tuple[int, float]] = {}  # request id -> (tokens, when its ledger entry ends)

    def _warn_once(self, reason: str, message: str, *args: object) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning(message + " (logged once per reason; counted in pd_pull_failures)", *args)

    # ------------------------------------------------------------------ prefill side
    def should_hold(self, request: "Request", cacheable: bool) -> bool:
        params = request.kv_transfer_params
        if not wants_remote_decode(params):
            return False
        if not self.hold_for_any_client:
            authorized = proxy_authorized(params, self.trust.mac)
            if not authorized:
                reason = "not_configured" if authorized is None else "bad_proxy_auth"
                metrics.inc("pd_remote_decode_refused", reason=reason)
                logs.warn(logger, f"pd_remote_decode_{reason}", "request %s asks for a remote decode, which this "
                          "instance holds only where disaggregated prefill is configured explicitly "
                          "(extra_config.pd: on with a chunk MAC key, or extra_config.pd_peers) or for a proxy "
                          "holding the chunk MAC key%s: answered without kv_transfer_params, its decode instance "
                          "recomputes (counted in pd_remote_decode_refused)", logs.peer_text(request.request_id),
                          "" if authorized is None else " (its proxy authorization does not verify)")
                return False
        if not self.can_save or not cacheable:
            self._warn_once("cannot_hold", "request %s asks for a remote decode, but this instance %s: it "
                            "answers without kv_transfer_params and the decode instance recomputes the prompt",
                            logs.peer_text(request.request_id), "does not save (kv_consumer)" if not self.can_save else
                            "cannot name its KV in keys (see uncacheable_requests)")
            return False
        return True

    def ports(self) -> list[int] | None:
        """Every rank's transfer port, asked from the workers once (again after a failed ask)."""
        if self._ports is None:
            ports = self._ask_ports()
            if ports and all(0 < p < 65536 for p in ports):
                self._ports = list(ports)
        return self._ports

    def _own_ports(self) -> list[int] | None:
        """This instance's ports for the trust's "own" check: asked at most every `_OWN_PORTS_ASK_S`."""
        if self._ports is None and time.monotonic() >= self._next_own_ask:
            self._next_own_ask = time.monotonic() + _OWN_PORTS_ASK_S
            self.ports()
        return self._ports

    def finished(self, request: "Request", hold_emitted: bool) -> dict[str, Any] | None:
        """The params of a finished request that holds (None: no hold to name; it is dropped)."""
        if not hold_emitted:
            return None
        ports = self.ports() if request.status.name in _ANSWERED else None
        if ports is None:
            self._unholds.append(request.request_id)
            if request.status.name in _ANSWERED:
                self._warn_once("no_ports", "request %s: the workers did not say their KV transfer ports; "
                                "answered without kv_transfer_params", logs.peer_text(request.request_id))
            return None
        metrics.inc("pd_prefill_requests")
        mac = self.trust.mac
        return prefill_params(engine_id=self.engine_id, req_id=request.request_id, host=self.host, ports=ports,
                              num_tokens=request.num_prompt_tokens, chunk_size=self.chunk_size, mac=mac,
                              scope=self.trust.scope, expires=int(time.time() + self.hold_s) if mac else None,
                              namespaced=self.namespaced_params)

    def heard(self, report: HoldReport) -> None:
        """The workers' report of their holds (events.py)."""
        self._cap_tokens = report.cap_tokens
        for req_id in report.ended:
            self._held.pop(req_id, None)

    def admit_hold(self, req_id: str, tokens: int) -> bool:
        """Whether the KV held for decode instances stays under the workers' cap with a hold of `tokens`
        (then it enters the ledger); False: the request is not held, and answered without params."""
        now = time.monotonic()
        for done in [r for r, (_, end) in self._held.items() if end <= now]:
            del self._held[done]
        self._held.pop(req_id, None)  # held again (its prompt was recomputed): counted once
        held = sum(t for t, _ in self._held.values())
        if self._cap_tokens > 0 and held + tokens > self._cap_tokens:
            metrics.inc("pd_holds_refused")
            logs.warn(logger, "pd_holds_full", "request %s answered without kv_transfer_params (its decode "
                      "instance recomputes the prompt): the KV of %d tokens is held for decode instances, %d more "
                      "would pass the cap of %d (extra_config.pd_max_held_bytes; counted in pd_holds_refused)",
                      logs.peer_text(req_id), held, tokens, self._cap_tokens)
            return False
        self._held[req_id] = (tokens, now + self.hold_s + _LEDGER_SLACK_S)
        return True

    # ------------------------------------------------------------------ decode side
    def remote_prefill(self, request: "Request", cacheable: bool) -> RemotePrefill | Pending | None:
        """Where to pull `request`'s KV from; None when not asked for, or refused (then recomputed here);
        `PENDING` while the prefill instance's name is resolved (ask again next step). Never waits."""
        params = request.kv_transfer_params
        if params is None or not wants_remote_prefill(params):
            return None
        try:
            remote = self._admit(request.request_id, parse_remote_prefill(params))
            if remote is None:
                return PENDING
        except PDRefusal as refusal:
            self._refused(request, refusal)  # nothing is sent to a peer not admitted, not even a RELEASE
            return None
        try:
            check_compatible(remote, tp_size=self.tp_size, chunk_size=self.chunk_size)
        except PDRefusal as refusal:
            self._refused(request, refusal)  # RELEASEs only to ports of a prefill instance of our own TP size
            return None
        try:
            if not self.can_load:
                raise PDRefusal("role", "this instance does not load (kv_producer)")
            if self.grouped:
                raise PDRefusal("hybrid", "this model has several KV cache groups (a hybrid model): "
                                          "lmcache-vllm pulls only models of one group from a prefill instance")
            if not cacheable:
                raise PDRefusal("uncacheable", "the request's KV cannot be named in keys here (see "
                                               "uncacheable_requests)")
        except PDRefusal as refusal:
            self._refused(request, refusal)
            self.done_with(remote)
            return None
        return remote

    def _admit(self, req_id: str, remote: RemotePrefill) -> RemotePrefill | None:
        """`trust.admit`, with the bound on a name being resolved: None while pending."""
        admitted = self.trust.admit(remote)
        if admitted is not None:
            self._pending.pop(req_id, None)
            return admitted
        now = time.monotonic()
        started = self._pending.setdefault(req_id, now)
        if now - started > self.trust.resolve_timeout_s or len(self._pending) > MAX_PENDING:
            self._pending.pop(req_id, None)
            raise PDRefusal("unresolved", f"the prefill instance's host {remote.host} did not resolve within "
                                          f"{self.trust.resolve_timeout_s:g}s")
        return None

    def forget(self, req_id: str) -> None:
        """The request ended: no name is being resolved for it any more."""
        self._pending.pop(req_id, None)

    def _refused(self, request: "Request", refusal: PDRefusal) -> None:
        metrics.inc("pd_pull_failures", reason=refusal.reason)
        self._warn_once(refusal.reason, "request %s: KV of its remote prefill not pulled, the prompt is "
                        "recomputed here: %s", logs.peer_text(request.request_id), refusal)

    def abandoned(self, request: "Request") -> None:
        """A request that asked for a remote prefill ended before it was looked at (vLLM's API server
        refused it): the prefill instance may drop its hold, if it is one this instance trusts, whose address
        is known already (nothing is resolved for it), of this instance's TP and chunk size."""
        params = request.kv_transfer_params
        self.forget(request.request_id)
        if params is not None and wants_remote_prefill(params):
            try:
                remote = self.trust.admit(parse_remote_prefill(params))
                if remote is not None:
                    check_compatible(remote, tp_size=self.tp_size, chunk_size=self.chunk_size)
                    self.done_with(remote)
            except PDRefusal:
                pass  # no address to tell, or not one to send anything to

    def done_with(self, remote: RemotePrefill) -> None:
        """This instance will not pull `remote` after all: the prefill instance may drop its hold."""
        self._releases.append(peer_spec(remote))

    def take_into(self, meta: LMCacheConnectorMetadata) -> None:
        meta.peer_releases, self._releases = self._releases, []
        meta.peer_unholds, self._unholds = self._unholds, []
