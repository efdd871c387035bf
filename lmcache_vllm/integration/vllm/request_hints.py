"""Per-request hints a client puts in vLLM's `kv_transfer_params` (docs/CONFIG.md, "Per-request hints").

LMCache's convention names them `lmcache.<hint>` (vLLM's LMCache connector takes every such key of a request's
kv_transfer_params as that request's configuration); we follow two of them:

- `"lmcache.skip_save": true` (LMCache's name): nothing of this request is stored; it still loads what is cached.
  For one-off prompts that would only push reusable chunks out of L1.
- `"lmcache.pin_tokens": N`: keep the whole chunks of the prompt's first N tokens (N larger than the prompt: all
  of its whole chunks) in L1, e.g. a long system prompt. Once the request's saves of that prefix are over, the
  workers pin its L1 chunks in the instance's pin ledger (`storage/pins.py`), owned by the request's
  `cache_salt`: within that salt's budget (`extra_config.max_pinned_fraction_per_salt`) and everyone's
  (`max_pinned_fraction`, 0 by default: pins off), for `pin_ttl_secs` after the last request that pinned it. A
  pin past a budget is refused (counted), never made by letting another tenant's pin go.

kv_transfer_params come from any client of vLLM's API, so every hint is checked like any input: a value of the
wrong type or out of range, a `lmcache.` key we do not follow (LMCache's others, e.g. `lmcache.tag.*`), or params
that are not a mapping are ignored and counted (`refused_request_hints{reason}`; logged once per reason), never
an exception. Keys without the `lmcache.` prefix belong to others (vLLM's disaggregated prefill, max_load_tokens)
and are not looked at here.

`SchedulerHints` is the scheduler half's: it reads each request's hints once, answers `skip_save`, and puts a
`PinSpec` into the step's metadata when the pinned prefix's KV exists. `WorkerPins` is each worker's: it pins
those prefixes when the request's saves are over.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.extra_keys import tenant_of
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, PinSpec
from lmcache_vllm.integration.vllm.request_tracker import RequestTracker, floor_to
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.pins import PinLedger, PinRefused

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.integration.vllm.saves import SaveQueue

logger = logging.getLogger(__name__)

PREFIX = "lmcache."
SKIP_SAVE = "lmcache.skip_save"
PIN_TOKENS = "lmcache.pin_tokens"
MAX_PIN_TOKENS = 1 << 31  # more than any model's context: larger values are garbage
HINT_PIN = "hint:"  # a hint's pin name (its prefix's last key follows): apart from the management API's pins


@dataclass(frozen=True)
class RequestHints:
    """What a request asked for (the defaults: nothing)."""

    skip_save: bool = False
    pin_tokens: int = 0


NO_HINTS = RequestHints()


def parse_hints(params: Any, pins_enabled: bool = True) -> tuple[RequestHints, list[str]]:
    """(the hints of a request's kv_transfer_params, the reason of each hint ignored). Never raises."""
    if params is None:
        return NO_HINTS, []
    if not isinstance(params, Mapping):
        return NO_HINTS, ["malformed"]
    skip_save, pin_tokens, refused = False, 0, []
    for key, value in params.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue  # another party's key (vLLM's disaggregated prefill, max_load_tokens, ...)
        if key == SKIP_SAVE:
            if isinstance(value, bool):
                skip_save = value
            else:
                refused.append("bad_skip_save")
        elif key == PIN_TOKENS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PIN_TOKENS:
                refused.append("bad_pin_tokens")
            elif value and not pins_enabled:
                refused.append("pins_disabled")
            else:
                pin_tokens = value
        else:
            refused.append("unknown")
    return RequestHints(skip_save, pin_tokens), refused


class SchedulerHints:
    """The hints of the requests the scheduler tracks (read once per request, forgotten when it ends)."""

    def __init__(self, config: LMCacheConfig, chunk_size: int, can_pin: bool = True):
        """`chunk_size`: the scheduler's; `can_pin`: False where the workers cannot pin (a model with several
        KV cache groups), which makes pin hints refused like with no L1 or max_pinned_fraction 0."""
        self.chunk_size = chunk_size
        self.pins_enabled = can_pin and config.local_cpu and config.extra_config.max_pinned_fraction > 0
        self._hints: dict[str, RequestHints] = {}
        self._pinned: set[str] = set()
        self._warned: set[str] = set()

    def of(self, request: "Request") -> RequestHints:
        hints = self._hints.get(request.request_id)
        if hints is None:
            hints, refused = parse_hints(getattr(request, "kv_transfer_params", None), self.pins_enabled)
            self._hints[request.request_id] = hints
            for reason in refused:
                metrics.inc("refused_request_hints", reason=reason)
                if reason not in self._warned:  # once per reason: a client may send many such requests
                    self._warned.add(reason)
                    logger.warning("request %s: a hint in kv_transfer_params is ignored (%s); further such hints "
                                   "are only counted (refused_request_hints)", request.request_id, reason)
            if hints.skip_save:
                metrics.inc("request_hints", hint="skip_save")
        return hints

    def skip_save(self, tracker: RequestTracker) -> bool:
        """The request asked not to be stored (a prefill instance stores for its decode instance regardless)."""
        return self.of(tracker.request).skip_save and not tracker.holds_for_peer

    def emit_pin(self, tracker: RequestTracker, kv_end: int, meta: LMCacheConnectorMetadata) -> None:
        """Once the KV of the request's pinned prefix exists (this step), the workers pin it after its saves."""
        if tracker.req_id in self._pinned or tracker.extra is None:
            return
        hints = self.of(tracker.request)
        end = floor_to(min(hints.pin_tokens, tracker.prompt_len), self.chunk_size)
        if end <= 0 or kv_end < end:
            return
        self._pinned.add(tracker.req_id)
        meta.pins.append(PinSpec(tracker.req_id, tracker.token_ids(end), tracker.extra))
        metrics.inc("request_hints", hint="pin")

    def forget(self, req_id: str) -> None:
        self._hints.pop(req_id, None)
        self._pinned.discard(req_id)


class WorkerPins:
    """A worker's pins from request hints: `pin` registers them, made in the instance's `PinLedger` when each
    request's saves are over."""

    def __init__(self, engine: "CacheEngine", ledger: PinLedger):
        self.engine = engine
        self.ledger = ledger

    def pin(self, specs: Iterable[PinSpec], saves: "SaveQueue", failed: set[str]) -> None:
        for spec in specs:
            if spec.req_id not in failed:  # a failed load: its KV is recomputed, and pinned if asked again
                saves.when_done([spec.req_id], functools.partial(self._fill, spec))

    def _fill(self, spec: PinSpec) -> None:
        try:
            keys, objs = self.engine.hold_prefix(spec.token_ids, spec.extra)
            if not objs:
                return  # nothing of the prefix in L1 (a full arena dropped its stores): nothing to pin
            # The prefix's last key names it (the same prefix again renews it); what L1 lacks is not pinned.
            self.ledger.pin(tenant_of(spec.extra), HINT_PIN + keys[-1], keys, objs, counted=False)
        except PinRefused as exc:
            logs.warn(logger, f"pin_refused_{exc.reason}", "request %s: its prefix is not pinned: %s",
                      spec.req_id, exc)
        except Exception:  # never a dead save thread: the prefix is just not pinned
            logs.warn(logger, "pin_failed", "request %s: pinning its prefix failed", spec.req_id, exc_info=True)
