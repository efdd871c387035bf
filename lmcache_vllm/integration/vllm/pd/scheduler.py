"""The scheduler half's part of disaggregated prefill (docs/DISAGGREGATED.md), per request:

- Prefill side (`do_remote_decode`): the request holds (`should_hold`: a saving role and keys for it); in the
  step its prompt completes the scheduler half emits a `PeerHoldSpec`; `finished` gives the params vLLM puts
  into the answer (P's address, every TP rank's transfer port, asked from the workers once; all under our own
  key with `namespaced_params`, beside another connector of a MultiConnector) or, for an aborted request,
  drops the hold. A ledger of the holds emitted (tokens each, until the workers report the hold ended or its
  lease is over) keeps them under the workers' cap (`extra_config.pd_max_held_bytes`, reported in tokens:
  `heard`): a request that would go over it is not held (`admit_hold`) and answered without params, so its
  decode instance recomputes at once, with no pull. The workers still refuse a hold over the cap when it is
  filled (the ledger hears of ended holds a step late, and counts a partial L1 prefix as whole).
- Decode side (`do_remote_prefill`): `remote_prefill` reads the params once and says whether this instance
  pulls: params checked field by field (`params.py`), a prefill instance this instance may connect to
  (`trust.py`: signed params with a chunk MAC key, else loopback or `pd_peers`), a loading role, keys for the
  request, the same TP and chunk size, a model of one KV cache group. A refusal is logged once per reason
  with what to change, counted in `pd_pull_failures{reason}`, and a trusted prefill instance is told at once
  (RELEASE) so its hold does not wait for its lease; an untrusted or malformed one is sent nothing. `done_with`
  tells it when this instance will not pull after all (nothing left to pull, the request ended first).
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
    wants_remote_decode,
    wants_remote_prefill,
)
from lmcache_vllm.integration.vllm.pd.trust import PeerTrust
from lmcache_vllm.observability import logs, metrics

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_ANSWERED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # statuses of a prefill that produced its token
_LEDGER_SLACK_S = 5.0  # a ledger entry outlives its hold's lease by this (the workers' clock runs apart)


def peer_spec(remote: RemotePrefill) -> PeerSpec:
    """The workers' spec of an admitted `remote` (`PeerTrust.admit`): its checked address, not its name."""
    return PeerSpec(remote.req_id, remote.address, remote.ports, remote.label)


class PDScheduler:
    """See the module docstring. `ask_ports()` asks the workers for their transfer ports (None: no answer).
    `trust`: which prefill instances this one pulls from (default: loopback only, no key); with its MAC key
    this instance signs its own params for `trust.scope`, valid for `hold_s`. `grouped`: a model of several
    KV cache groups (no PD on the decode side)."""

    def __init__(self, *, engine_id: str, host: str, chunk_size: int, tp_size: int,
                 ask_ports: Callable[[], list[int] | None], can_load: bool, can_save: bool,
                 trust: PeerTrust | None = None, hold_s: float = 30.0, grouped: bool = False,
                 namespaced_params: bool = False):
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
        self._ports: list[int] | None = None
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
        if not wants_remote_decode(request.kv_transfer_params):
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
    def remote_prefill(self, request: "Request", cacheable: bool) -> RemotePrefill | None:
        """Where to pull `request`'s KV from, or None (not asked for, or refused: then recomputed here)."""
        params = request.kv_transfer_params
        if params is None or not wants_remote_prefill(params):
            return None
        try:
            remote = self.trust.admit(parse_remote_prefill(params))
        except PDRefusal as refusal:
            self._refused(request, refusal)  # nothing is sent to a peer not admitted, not even a RELEASE
            return None
        try:
            check_compatible(remote, tp_size=self.tp_size, chunk_size=self.chunk_size)
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

    def _refused(self, request: "Request", refusal: PDRefusal) -> None:
        metrics.inc("pd_pull_failures", reason=refusal.reason)
        self._warn_once(refusal.reason, "request %s: KV of its remote prefill not pulled, the prompt is "
                        "recomputed here: %s", logs.peer_text(request.request_id), refusal)

    def abandoned(self, request: "Request") -> None:
        """A request that asked for a remote prefill ended before it was looked at (vLLM's API server
        refused it): the prefill instance may drop its hold, if it is one this instance trusts."""
        params = request.kv_transfer_params
        if params is not None and wants_remote_prefill(params):
            try:
                self.done_with(self.trust.admit(parse_remote_prefill(params)))
            except PDRefusal:
                pass  # no address to tell, or not one to send anything to

    def done_with(self, remote: RemotePrefill) -> None:
        """This instance will not pull `remote` after all: the prefill instance may drop its hold."""
        self._releases.append(peer_spec(remote))

    def take_into(self, meta: LMCacheConnectorMetadata) -> None:
        meta.peer_releases, self._releases = self._releases, []
        meta.peer_unholds, self._unholds = self._unholds, []
