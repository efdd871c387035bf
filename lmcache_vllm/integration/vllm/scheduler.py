"""The scheduler half of `LMCacheConnector`: which prefix tokens to load and which KV to save.

It runs inside vLLM's scheduler (EngineCore process) and never touches KV tensors. Per request it keeps
a `RequestTracker` (live `Request`, its token ids as one int64 array converted once and shared by
every lookup, load and save, block ids as vLLM allocates them, how far saves have reached, a pending
load) and turns vLLM's scheduling decisions into `LoadSpec` / `SaveSpec`s for the worker half.

Rules:
- Hits come from the workers' `LookupServer`s; a lookup that times out is 0 hits. Only chunks from
  vLLM's own prefix-cache hit (`num_computed_tokens`) on are looked up and loaded. A lookup whose
  slower tiers have not answered yet is `None` to vLLM (it tries the request again next step and runs
  the others meanwhile). vLLM asks again every step while a request waits for blocks: the answer is
  reused until its blocks are allocated (the workers hold the chunks it promised until then).
- A hit all in L1 is loaded synchronously inside the step (a copy). A hit that needs a slower tier is
  loaded asynchronously (`enable_async_loading`): vLLM keeps the request in WAITING_FOR_REMOTE_KVS
  while the workers read its chunks into L1 and runs the other requests meanwhile.
- Keys cover what besides token ids decides the KV (LoRA, multimodal items, cache salt, prompt
  embeddings: `request_keys.py`); the request's `ExtraKeys` go with every lookup, load and save. A
  request whose extra keys cannot be derived is neither looked up nor saved (`uncacheable_requests`).
- Only tokens beyond vLLM's own prefix-cache hit (`num_computed_tokens`) are loaded; a request's own
  `max_load_tokens` (kv_transfer_params, vLLM's OffloadingConnector convention) caps them in whole chunks
  (0: no lookup, no load), for that request only.
- A hit covering the whole sequence leaves its last token to vLLM, which needs that token's logits.
- Saves cover whole chunks as soon as their KV is computed (chunked prefill saves step by step); a
  partial last chunk of the prompt only with `save_unfull_chunk`; KV of generated tokens only with
  `save_decode_cache`.
- Saves run in the background on the workers: a finished request that saved anything keeps its blocks
  (`request_finished` returns True) until every worker reports its saves over (finished_sending).
- Preemption: the request's blocks are replaced on resume; what was saved stays saved. When vLLM rolls
  a request back (a failed load), saving restarts from the rolled-back position.
- Disaggregated prefill (`pd/`, docs/DISAGGREGATED.md): a request with `do_remote_decode` also saves its
  partial last chunk, has its prompt's chunks held for the decode instance from the step its prompt
  completes (`PeerHoldSpec`) and is answered with P's kv_transfer_params; a request with
  `do_remote_prefill` is answered (prompt tokens beyond vLLM's own hit, load_async) without a lookup and
  loaded asynchronously from the prefill instance first.
- A model with several KV cache groups (hybrid: sliding window, Mamba; `groups.SchedulerGroups`): its
  specs carry every group's block table as vLLM holds it this step, saves also the states vLLM offers at
  chunk boundaries, and every load is asynchronous (vLLM 0.32 can report a failed load of such a model
  only as a failed asynchronous receive; it then recomputes the request).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.integration.vllm.groups import SchedulerGroups
from lmcache_vllm.integration.vllm.lookup import LookupAnswer, LookupClient, LookupQuery
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, PeerHoldSpec, SaveSpec
from lmcache_vllm.integration.vllm.pd.params import RemotePrefill, wants_remote_prefill
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler, peer_spec
from lmcache_vllm.integration.vllm.request_hints import SchedulerHints
from lmcache_vllm.integration.vllm.request_keys import RequestKeys, UncacheableRequest
from lmcache_vllm.integration.vllm.request_tracker import (
    PendingLoad,
    RequestLookup,
    RequestTracker,
    ceil_to,
    floor_to,
    max_load_tokens_of,
)
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.tier import Tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerHalf:
    """Implements the scheduler-side methods of `KVConnectorBase_V1` for `LMCacheConnector`."""

    def __init__(self, config: LMCacheConfig, *, block_size: int, lookup_client: LookupClient, can_load: bool,
                 can_save: bool, request_keys: RequestKeys | None = None, pd: PDScheduler | None = None,
                 groups: SchedulerGroups | None = None):
        """`config` gives chunk_size, save_unfull_chunk, save_decode_cache, enable_async_loading and
        min_retrieve_tokens; `can_load` / `can_save` come from vLLM's kv_role; `pd` answers vLLM's
        kv_transfer_params (None: they are ignored); `groups`: a model with several KV cache groups."""
        if block_size <= 0:
            raise ValueError(f"block_size ({block_size}) must be positive")
        self.chunk_size = chunk_size = config.resolved_chunk_size
        self.block_size = block_size
        self.lookup_client = lookup_client
        self.can_load = can_load
        self.can_save = can_save
        self.save_unfull_chunk = config.save_unfull_chunk
        self.save_decode_cache = config.save_decode_cache
        self.min_retrieve_tokens = config.min_retrieve_tokens
        self.request_keys = request_keys or RequestKeys(chunk_size)
        self.groups = groups
        self._trackers: dict[str, RequestTracker] = {}
        self._lookups: dict[str, RequestLookup] = {}
        self._warned_reasons: set[str] = set()
        self.async_loading = config.enable_async_loading
        self._async_loads: list[tuple[RequestTracker, PendingLoad]] = []
        self._unheld: list[str] = []  # looked up, allocated without a load: the workers let go
        self._delayed_free: list[str] = []  # finished with saves: vLLM frees them on finished_sending
        self.pd = pd  # disaggregated prefill (None: kv_transfer_params are ignored)
        self.hints = SchedulerHints(config, chunk_size, can_pin=groups is None)  # lmcache.* kv_transfer_params

    # ------------------------------------------------------------------ vLLM hooks
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.pd is not None and wants_remote_prefill(request.kv_transfer_params):
            tracker = self._tracker(request)
            if tracker.remote_pending and not self._resolve_remote(tracker, request):
                return None, False  # its prefill instance's name is being resolved: vLLM asks again next step
            if tracker.remote_open and tracker.remote is not None:
                # Everything the prefill instance computed beyond vLLM's own hit, pulled asynchronously.
                tracker.remote_computed = num_computed_tokens
                n = min(tracker.remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
                return (n, True) if n > 0 else (0, False)
        if not self.can_load:
            return 0, False
        num_tokens = request.num_tokens
        if num_tokens < self.chunk_size and not self.save_unfull_chunk:
            return 0, False  # nothing this short is ever stored
        tracker = self._tracker(request)
        if tracker.extra is None or tracker.max_load_tokens == 0:
            return 0, False
        lookup = self._lookups.get(request.request_id)
        if lookup is None or lookup.answer.pending or num_computed_tokens < lookup.answer.start:
            # First ask, an answer still pending, or vLLM's own hit shrank below the cached run.
            query = LookupQuery(request.request_id, tracker.token_array(), num_computed_tokens, tracker.extra)
            with metrics.timed("lookup_seconds"):
                answer = LookupAnswer.of(self.lookup_client.lookup(query))
            lookup = self._lookups[request.request_id] = RequestLookup(answer)
            metrics.inc("lookups")
        answer = lookup.answer
        if answer.pending:
            metrics.inc("pending_lookups")
            return None, False
        lookup.num_computed_tokens = num_computed_tokens
        hit = min(answer.hit_tokens, num_tokens)
        usable = hit - 1 if hit == num_tokens else hit
        if tracker.max_load_tokens is not None:
            usable = min(usable, floor_to(num_computed_tokens + tracker.max_load_tokens, self.chunk_size))
        lookup.load_async = False
        if usable <= num_computed_tokens:
            return 0, False
        if usable - num_computed_tokens < self.min_retrieve_tokens:
            # LMCache's min_retrieve_tokens: a hit this short is not worth a load; the lookup's hold is
            # let go in update_state_after_alloc, and storing the prompt skips the chunks we hold.
            metrics.inc("retrieves_below_minimum")
            return 0, False
        lookup.load_async = (self.async_loading and not answer.loads_now) or self.groups is not None
        return usable - num_computed_tokens, lookup.load_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        tracker = self._tracker(request)
        lookup = self._lookups.pop(request.request_id, None)
        tracker.pending_load = None
        tracker.hit_sources = {}
        if tracker.remote_open:
            self._plan_pull(tracker, blocks, num_external_tokens)
            return
        if num_external_tokens <= 0 or lookup is None:
            if lookup is not None and lookup.answer.hit_tokens:
                self._unheld.append(request.request_id)
            if num_external_tokens > 0:
                logger.warning("request %s: vLLM asks to load %d tokens without a lookup; ignored",
                               request.request_id, num_external_tokens)
            return
        load_end = lookup.num_computed_tokens + num_external_tokens
        fetch_len = min(lookup.answer.hit_tokens, ceil_to(load_end, self.chunk_size))
        load = PendingLoad(fetch_len, lookup.num_computed_tokens, load_end)
        tracker.hit_sources = self._sources(lookup, load_end)
        for tier, n in tracker.hit_sources.items():
            metrics.inc("hit_tokens", n, tier=tier)
        if lookup.load_async:
            # The request waits in WAITING_FOR_REMOTE_KVS: it is in no scheduled list, so the load
            # goes out with this step's metadata, into the blocks vLLM just allocated.
            tracker.block_ids = list(blocks.get_block_ids()[0])
            if self.groups is not None:
                tracker.group_tables = tuple(list(table) for table in blocks.get_block_ids())
            self._async_loads.append((tracker, load))
        else:
            tracker.pending_load = load

    def _plan_pull(self, tracker: RequestTracker, blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """A remote prefill: load what vLLM allocated for from the prefill instance (once per request)."""
        remote = tracker.remote
        tracker.remote_open = False
        if remote is None or self.pd is None:
            return
        if num_external_tokens <= 0:  # vLLM's own prefix cache had it all, or it chose not to load
            self.pd.done_with(remote)
            return
        start = tracker.remote_computed
        load = PendingLoad(min(remote.num_tokens, tracker.prompt_len), start, start + num_external_tokens)
        tracker.peer_load = peer_spec(remote)
        tracker.hit_sources = {Tier.PEER: num_external_tokens}
        metrics.inc("hit_tokens", num_external_tokens, tier=Tier.PEER)
        tracker.block_ids = list(blocks.get_block_ids()[0])
        self._async_loads.append((tracker, load))

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """Tokens of the request's planned load by tier name (`unknown` where the lookup did not say)."""
        tracker = self._trackers.get(request_id)
        return dict(tracker.hit_sources) if tracker is not None else {}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata(release_req_ids=self._unheld,
                                        idle=scheduler_output.total_num_scheduled_tokens == 0,
                                        delayed_free_req_ids=self._delayed_free,
                                        preempted_req_ids=sorted(scheduler_output.preempted_req_ids or ()))
        self._unheld, self._delayed_free = [], []
        if self.pd is not None:
            self.pd.take_into(meta)
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for tracker, load in self._async_loads:
            tracker.pending_load = load
            self._emit_load(tracker, meta, is_async=True)
        self._async_loads = []
        num_scheduled = scheduler_output.num_scheduled_tokens

        for new_req in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new_req.req_id)
            if tracker is None:  # update_state_after_alloc always runs first; be safe anyway
                continue
            tracker.block_ids = list(new_req.block_ids[0])
            self._refresh_tables(tracker, scheduler_output)
            self._emit_load(tracker, meta)
            kv_end = new_req.num_computed_tokens + num_scheduled.get(new_req.req_id, 0)
            self._emit_save(tracker, new_req.num_computed_tokens, kv_end, meta)
            self._emit_hold(tracker, kv_end, meta)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # After preemption vLLM hands the request a whole new block list.
                tracker.block_ids = list(new_blocks[0]) if new_blocks is not None else []
                self._refresh_tables(tracker, scheduler_output)
                self._emit_load(tracker, meta)
            elif new_blocks is not None:
                tracker.block_ids.extend(new_blocks[0])
            self._refresh_tables(tracker, scheduler_output)
            computed = cached.num_computed_tokens[i]
            self._emit_save(tracker, computed, computed + num_scheduled.get(req_id, 0), meta)
            self._emit_hold(tracker, computed + num_scheduled.get(req_id, 0), meta)
        if self.groups is not None:
            self._emit_states(scheduler_output, meta)
        return meta

    def request_finished(self, request: "Request", block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        tracker = self._trackers.get(request.request_id)
        self._forget(request.request_id)
        params = None
        if self.pd is not None:
            self.pd.forget(request.request_id)
            if tracker is None:  # e.g. refused by the API server before it was ever scheduled
                self.pd.abandoned(request)
            elif tracker.remote_open and tracker.remote is not None:
                self.pd.done_with(tracker.remote)  # ended before its pull was planned
            elif tracker.holds_for_peer:
                params = self.pd.finished(request, tracker.hold_emitted)
        if tracker is None or not tracker.saves_emitted:
            return False, params
        # A save of it may still be copying from its blocks on a worker's save thread: vLLM keeps them
        # until every worker reports it in finished_sending (saves.py).
        self._delayed_free.append(request.request_id)
        return True, params

    # ------------------------------------------------------------------ helpers
    def _refresh_tables(self, tracker: RequestTracker, scheduler_output: "SchedulerOutput") -> None:
        """A multi-group model: every group's table as vLLM holds it this step (blocks that left a window
        read as the null block, so a save never copies from a block vLLM handed elsewhere)."""
        if self.groups is None:
            return
        tables = self.groups.tables(scheduler_output, tracker.req_id)
        if tables is not None:
            tracker.group_tables = tables
            tracker.block_ids = list(tables[0])

    def _blocks(self, tracker: RequestTracker, num_tokens: int) -> tuple[list[int], tuple[list[int], ...]]:
        """(block_ids, group_block_ids) of a spec for the request's first `num_tokens` tokens."""
        if self.groups is not None:
            return [], tracker.group_tables
        return tracker.block_ids[:ceil_to(num_tokens, self.block_size) // self.block_size], ()

    def _emit_states(self, scheduler_output: "SchedulerOutput", meta: LMCacheConnectorMetadata) -> None:
        """The states vLLM offers this step (a multi-group model with a state group) go with the request's
        save, or with a save of their own."""
        assert self.groups is not None
        for req_id, states in self.groups.states(scheduler_output).items():
            tracker = self._trackers.get(req_id)
            if tracker is None or not self.can_save or tracker.extra is None or self.hints.skip_save(tracker):
                continue
            limit = len(tracker.request.all_token_ids) if self.save_decode_cache else tracker.prompt_len
            states = [s for s in states if s[2] <= limit]
            if not states:
                continue
            end = max(s[2] for s in states)
            spec = next((s for s in meta.saves if s.req_id == req_id and s.num_tokens >= end), None)
            if spec is None:
                spec = SaveSpec(req_id=req_id, token_ids=tracker.token_ids(end), extra=tracker.extra, block_ids=[],
                                skip_leading=end, group_block_ids=tracker.group_tables)
                meta.saves.append(spec)
                tracker.saves_emitted += 1
            spec.states.extend(states)

    def _tracker(self, request: "Request") -> RequestTracker:
        # Created at the first lookup (before vLLM allocates), so its token array serves every later
        # lookup, load and save of the request; dropped when the request finishes.
        tracker = self._trackers.get(request.request_id)
        if tracker is None or tracker.request is not request:
            tracker = self._trackers[request.request_id] = self._new_tracker(request)
            tracker.max_load_tokens = max_load_tokens_of(request.request_id, request.kv_transfer_params)
            if self.pd is not None:
                tracker.holds_for_peer = self.pd.should_hold(request, tracker.extra is not None)
                tracker.remote_pending = True
                self._resolve_remote(tracker, request)
        return tracker

    def _resolve_remote(self, tracker: RequestTracker, request: "Request") -> bool:
        """Reads the request's remote prefill (`PDScheduler.remote_prefill`) into its tracker; False while
        the prefill instance's name is still being resolved (off this thread)."""
        assert self.pd is not None
        remote = self.pd.remote_prefill(request, tracker.extra is not None)
        if isinstance(remote, RemotePrefill) or remote is None:
            tracker.remote, tracker.remote_open, tracker.remote_pending = remote, remote is not None, False
            return True
        return False

    def _new_tracker(self, request: "Request") -> RequestTracker:
        try:
            return RequestTracker(request, self.request_keys.extra_keys(request))
        except UncacheableRequest as exc:
            reason = exc.reason
        except Exception as exc:  # a bug in deriving keys must not break serving: not cached, counted
            logs.warn(logger, "extra_keys_failed", "request %s: extra keys failed", request.request_id,
                      exc_info=True)
            reason = f"error_{type(exc).__name__}"
        metrics.inc("uncacheable_requests", reason=reason)
        if reason not in self._warned_reasons:  # once per reason: a client may send many such requests
            self._warned_reasons.add(reason)
            logger.warning("request %s is not cached (%s); further such requests are only counted",
                           request.request_id, reason)
        return RequestTracker(request, None, uncacheable=reason)

    def _sources(self, lookup: RequestLookup, load_end: int) -> dict[str, int]:
        """Tokens [num_computed_tokens, load_end) split by the tier of the chunk each lies in."""
        sources: dict[str, int] = {}
        start = lookup.num_computed_tokens
        first = lookup.answer.start // self.chunk_size  # the answer's chunks start there
        tiers = lookup.answer.chunk_tiers
        while start < load_end:
            index = start // self.chunk_size
            end = min(load_end, (index + 1) * self.chunk_size)
            tier = tiers[index - first] if 0 <= index - first < len(tiers) else ""
            sources[tier or "unknown"] = sources.get(tier or "unknown", 0) + end - start
            start = end
        return sources

    def _forget(self, req_id: str) -> None:
        self._trackers.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self.hints.forget(req_id)

    def _emit_load(self, tracker: RequestTracker, meta: LMCacheConnectorMetadata,
                   is_async: bool = False) -> None:
        load = tracker.pending_load
        tracker.pending_load = None
        if load is None or load.load_end <= load.skip_leading:
            return
        block_ids, group_block_ids = self._blocks(tracker, load.fetch_len)
        meta.loads.append(LoadSpec(
            req_id=tracker.req_id, token_ids=tracker.token_ids(load.fetch_len), extra=tracker.extra,
            block_ids=block_ids, skip_leading=load.skip_leading, load_end=load.load_end, is_async=is_async,
            group_block_ids=group_block_ids, peer=tracker.peer_load))
        tracker.peer_load = None
        # Whole chunks we just loaded are stored already: no need to save them again.
        tracker.saved_end = max(tracker.saved_end, floor_to(load.load_end, self.chunk_size))
        metrics.inc("load_requests")
        if is_async:
            metrics.inc("async_load_requests")

    def _emit_save(self, tracker: RequestTracker, computed_before: int, kv_end: int,
                   meta: LMCacheConnectorMetadata) -> None:
        """Save what became computable this step: KV of tokens [0, kv_end) exists after it."""
        if not self.can_save or tracker.extra is None or self.hints.skip_save(tracker):
            return
        if computed_before < tracker.saved_end:
            # vLLM rolled the request back (failed load): what we thought saved may not be.
            tracker.saved_end = floor_to(computed_before, self.chunk_size)
            tracker.hold_emitted = False  # the workers skipped it: held again once the prompt is recomputed
        limit = len(tracker.request.all_token_ids) if self.save_decode_cache else tracker.prompt_len
        end = min(kv_end, limit)
        is_last = end >= tracker.prompt_len
        unfull = self.save_unfull_chunk or tracker.holds_for_peer  # a decode instance pulls all of the prompt
        if not (is_last and end == tracker.prompt_len and unfull):
            end = floor_to(end, self.chunk_size)
        if end <= tracker.saved_end:
            return
        start = floor_to(tracker.saved_end, self.chunk_size)
        num_blocks = ceil_to(end, self.block_size) // self.block_size
        if num_blocks > len(tracker.block_ids):
            logs.warn(logger, "save_without_blocks", "request %s: %d tokens to save but only %d blocks known; "
                      "save skipped", tracker.req_id, end, len(tracker.block_ids))
            return
        tracker.saves_emitted += 1
        block_ids, group_block_ids = self._blocks(tracker, end)
        meta.saves.append(SaveSpec(req_id=tracker.req_id, token_ids=tracker.token_ids(end), extra=tracker.extra,
                                   block_ids=block_ids, skip_leading=start, is_last=is_last,
                                   group_block_ids=group_block_ids, for_peer=tracker.holds_for_peer))
        tracker.saved_end = end

    def _emit_hold(self, tracker: RequestTracker, kv_end: int, meta: LMCacheConnectorMetadata) -> None:
        """Prefill side: once the prompt's KV exists (this step), its chunks are held for the decode
        instance; the workers register the hold in this step, before vLLM can answer the request. And a
        prefix the request asked to pin, once its KV exists."""
        self.hints.emit_pin(tracker, kv_end, meta)
        if tracker.holds_for_peer and not tracker.hold_emitted and kv_end >= tracker.prompt_len:
            if self.pd is not None and not self.pd.admit_hold(tracker.req_id, tracker.prompt_len):
                tracker.holds_for_peer = False  # over the cap on held KV: answered without params
                return
            tracker.hold_emitted = True
            meta.peer_holds.append(PeerHoldSpec(tracker.req_id, tracker.token_ids(tracker.prompt_len),
                                                tracker.extra))
