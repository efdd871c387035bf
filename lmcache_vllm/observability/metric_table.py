"""The table of every metric of lmcache-vllm (`METRIC_LIST`, by name in `METRICS`): name, kind, unit, help
text, labels, scope across tensor-parallel ranks and, for gauges, how processes combine. Only data: the
recorder, Prometheus export (integration/vllm/stats.py) and docs/METRICS.md (metrics_doc.py) all read
it, and `observability.metrics` re-exports it."""
from __future__ import annotations

from dataclasses import dataclass

PREFIX = "lmcache_vllm:"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    scope: str = "rank"  # "rank": every TP rank counts, summed; "engine": the scheduler or TP rank 0
    gauge_agg: str = "sum"  # gauges: sum | max | min over processes
    buckets: tuple[float, ...] = LATENCY_BUCKETS


def _c(name: str, unit: str, help: str, labels: tuple[str, ...] = (), scope: str = "rank") -> MetricDef:
    return MetricDef(name, "counter", unit, help, tuple(labels), scope)


def _g(name: str, unit: str, help: str, labels: tuple[str, ...] = (), agg: str = "sum") -> MetricDef:
    return MetricDef(name, "gauge", unit, help, tuple(labels), gauge_agg=agg)


def _h(name: str, help: str, labels: tuple[str, ...] = (), scope: str = "rank") -> MetricDef:
    return MetricDef(name, "histogram", "seconds", help, tuple(labels), scope)


_T = ("tier",)
_N = ("node",)
METRIC_LIST: tuple[MetricDef, ...] = (
    # -- scheduler: one per engine
    _c("lookups", "requests", "Prefix lookups the scheduler asked the workers for (the answer is reused "
       "while the request waits for free blocks; a pending one is asked again)", scope="engine"),
    _c("lookups_in_process", "requests", "Lookups answered by a direct call because every rank's lookup "
       "server lives in the scheduler's process", scope="engine"),
    _c("lookup_timeouts", "requests", "Lookups that timed out and counted as 0 hits", scope="engine"),
    _c("lookup_rejected", "requests", "Lookup messages a worker refused: malformed, a field out of range, "
       "more tokens than max_model_len, or an answer that does not fit the wire (answered 0 hits, or -1 "
       "to a command)"),
    _c("lookup_server_restarts", "events", "Times a worker's lookup server loop failed outside any one "
       "message (a ZMQ error) and started serving again"),
    _c("uncacheable_requests", "requests", "Requests neither looked up nor saved because what decides "
       "their KV besides token ids cannot be named in a key (reason: mm_unidentified, lora_unreadable, "
       "error_<exception>)", ("reason",), scope="engine"),
    _h("lookup_seconds", "Time of one scheduler lookup over every rank", scope="engine"),
    _c("hit_tokens", "tokens", "Prompt tokens vLLM loads from our tiers beyond its own prefix cache, by "
       "the tier holding them (counted once per scheduled load)", _T, scope="engine"),
    _c("load_requests", "requests", "Requests the scheduler planned a load for", scope="engine"),
    _c("async_load_requests", "requests", "Loads planned asynchronously: the hit needed the disk or Redis "
       "tier (or the model has several KV cache groups), so the request waited (WAITING_FOR_REMOTE_KVS) while "
       "vLLM ran the others", scope="engine"),
    _c("pending_lookups", "requests", "Lookups answered 'ask again' because a slower tier had not said "
       "yet where the chunks are; vLLM ran the other requests that step", scope="engine"),
    _c("retrieves_below_minimum", "requests", "Hits not loaded because they would load fewer new tokens "
       "than min_retrieve_tokens (vLLM computed them)", scope="engine"),
    _c("load_limited_requests", "requests", "Requests whose kv_transfer_params carried a valid max_load_tokens "
       "(vLLM's per-request cap on tokens loaded beyond its own prefix cache; 0: no load)", scope="engine"),
    _c("refused_request_params", "requests", "Requests with a kv_transfer_params field of ours that was ignored "
       "because its value is not accepted (param: max_load_tokens)", ("param",), scope="engine"),
    _c("failed_resets", "events", "Resets (vLLM's /reset_prefix_cache?reset_external=true, its pause with "
       "clear_cache) that not every worker rank confirmed; vLLM was answered 'nothing to reset'",
       scope="engine"),
    # -- worker / engine
    _c("loaded_tokens", "tokens", "Tokens whose KV was loaded into vLLM's paged KV cache (counted on TP "
       "rank 0)", scope="engine"),
    _c("failed_load_tokens", "tokens", "Tokens planned to load that could not be; vLLM recomputes them "
       "(summed over TP ranks)"),
    _c("stored_tokens", "tokens", "Tokens whose KV was newly stored (counted on TP rank 0)",
       scope="engine"),
    _c("group_loaded_tokens", "tokens", "Tokens loaded into one KV cache group of a model with several "
       "(hybrid: full attention, sliding window, Mamba state); a sliding group loads only the window before the "
       "hit's end (counted on TP rank 0)", ("group",), scope="engine"),
    _c("group_stored_tokens", "tokens", "Tokens newly stored for one KV cache group of a model with several "
       "(a state group: one state per chunk boundary counts as the chunk's tokens; counted on TP rank 0)",
       ("group",), scope="engine"),
    _c("group_limited_hits", "requests", "Lookups whose hit a KV cache group cut short: the full-attention "
       "chunks ran further than this group's chunks (sliding window) or states allowed", ("group",),
       scope="engine"),
    _c("store_skipped_tokens", "tokens", "Tokens handed to a store whose chunks were stored already",
       scope="engine"),
    _c("failed_stores", "requests", "Stores of a request that failed with an error; its chunks stay "
       "uncached"),
    _c("stores_skipped_after_failed_load", "requests", "Saves skipped because the request's load failed "
       "in the same step, on this or another TP rank (KV computed past a hole is not kept)"),
    _c("loads_failed_on_other_rank", "requests", "Loads that succeeded on this TP rank but failed on "
       "another; the request saves nothing in that step on any rank"),
    _c("shape_mismatches", "chunks", "Chunks found under their key with another shape or dtype; "
       "treated as misses"),
    _h("load_seconds", "Time to load one request's cached KV into vLLM's paged cache"),
    _c("overlapped_loads", "requests", "Loads copied layer by layer on the load thread while vLLM's forward ran "
       "(extra_config.overlap_loads)"),
    _c("load_wait_seconds", "seconds", "Time vLLM's forward waited for layers the load thread had not copied yet "
       "(extra_config.overlap_loads)"),
    _c("load_thread_timeouts", "steps", "Steps whose load thread did not copy a layer within "
       "blocking_timeout_secs; its loads were stopped and recomputed"),
    _c("load_thread_stuck", "steps", "Steps whose load thread did not stop within blocking_timeout_secs after "
       "a timeout; its loads and those of later steps while it stayed stuck were recomputed"),
    _c("cuda_kernel_fallbacks", "layouts", "KV layouts whose copies use the torch path on a GPU although "
       "extra_config.cuda_kernel is auto: the CUDA kernel gave other bytes than the torch path on a scratch "
       "copy of the layout (mismatch), failed to run (error) or is not built (not_built)", ("reason",)),
    _c("async_load_timeouts", "requests", "Asynchronous loads whose chunks were not read within "
       "blocking_timeout_secs; what had not arrived was recomputed"),
    _c("lookup_read_waits", "requests", "First lookups of a hit read from a lower tier that waited for its reads "
       "(the recent reads' pace said they end within extra_config.lookup_read_wait_ms): ready (loaded inside "
       "the step like an L1 hit), late (loaded asynchronously) or failed (a read did not bring a chunk its tier "
       "listed: loaded asynchronously, the rest recomputed)", ("result",)),
    _c("aborted_async_loads", "requests", "Requests that finished (aborted) while their asynchronous load "
       "waited; its reads and holds were released"),
    _c("durable_save_timeouts", "requests", "A producer's saves of a complete prompt not written to every "
       "lower tier within blocking_timeout_secs (a consumer may miss them)"),
    _h("store_seconds", "Time to store one request's new KV (on the save thread unless saves are "
       "synchronous)"),
    _c("save_wait_seconds", "seconds", "Time vLLM's step waited for background saves to finish"),
    # -- storage tiers
    _c("chunk_hits", "chunks", "Chunks served by a tier (L1 from memory; L2/L3 read and promoted into "
       "L1)", _T),
    _c("chunk_misses", "chunks", "Chunks a tier was asked for and did not hold", _T),
    _c("read_bytes", "bytes", "Bytes of chunks served by a tier", _T),
    _c("stored_chunks", "chunks", "Chunks written to a tier", _T),
    _c("stored_bytes", "bytes", "Bytes of chunks written to a tier", _T),
    _c("coded_bytes", "bytes", "Payload bytes a tier wrote for its chunks after their codec (a chunk's codec "
       "after fallbacks: naive, lossless, fp8); stored_bytes over it is the compression ratio",
       ("tier", "codec")),
    _c("dropped_stores", "chunks", "Chunks not stored below L1 or at all: arena_full (no L1 memory for a "
       "new chunk), queue_full (lower-tier write queue full), shutdown (queued at close), cold_backlog (an L1 "
       "eviction the compressed cold part of L1 had no time to code)", ("reason",)),
    _c("failed_writes", "chunks", "Writes a lower tier refused or failed (disk full, chunk larger than "
       "the tier, Redis down or its breaker open)", _T),
    _c("failed_reads", "requests", "Reads or existence checks of a tier that failed (I/O error, Redis or Mooncake "
       "down or its breaker open); answered as misses", _T),
    _c("corrupt_chunks", "chunks", "Stored chunks that failed their checks (checksum, size, header) and "
       "were deleted", _T),
    _c("unauthenticated_chunks", "chunks", "Chunks whose keyed MAC did not verify (extra_config."
       "chunk_mac_key set): also counted in corrupt_chunks, answered as misses and deleted"),
    _c("lost_chunks", "chunks", "Chunks a tier listed but could not read back (Mooncake: evicted since, or their "
       "storage host died; such an entry is removed): answered as misses", _T),
    _c("evictions", "chunks", "Chunks evicted from a tier to make room (least recently used first)", _T),
    _c("read_alloc_failures", "chunks", "Lower-tier hits not read because no L1 memory was free", _T),
    _c("breaker_skipped_calls", "requests", "Calls answered at once as misses while the tier's circuit "
       "breaker was open", _T),
    _c("storage_timeouts", "requests", "Storage calls (op lookup or get) that passed their timeout and "
       "answered a miss", ("op",)),
    _c("storage_errors", "requests", "Storage calls (op lookup or get) that failed with an unexpected "
       "error and answered a miss", ("op",)),
    _c("prefetches", "requests", "Background reads started from the lower tiers into L1"),
    _c("adopted_chunks", "chunks", "Chunk files another process wrote into a shared directory, found on "
       "a miss and indexed", _T),
    _c("reindexed_chunks", "chunks", "Chunk files found and indexed at start-up", _T),
    # -- Redis nodes (label `node`: host:port of a server or cluster node, sentinel:<master>, cluster for
    #    finding the cluster's slot map)
    _c("redis_node_read_chunks", "chunks", "Chunks a Redis node served", _N),
    _c("redis_node_stored_chunks", "chunks", "Chunks written to a Redis node", _N),
    _c("redis_node_failed_calls", "requests", "Calls to a Redis node that failed (connection refused or "
       "lost, timeout, refused credentials): its keys were misses, its writes dropped", _N),
    _c("redis_node_skipped_calls", "requests", "Calls answered at once as misses while that node's circuit "
       "breaker was open", _N),
    _c("redis_node_redirects", "requests", "Replies MOVED/ASK/TRYAGAIN from a cluster node (a slot moving "
       "or moved): the command was sent again where redis-py's slot map says", _N),
    _h("tier_read_seconds", "Time of one batched read from a lower tier", _T),
    _h("tier_write_seconds", "Time to write one chunk to a lower tier", _T),
    # -- disaggregated prefill (docs/DISAGGREGATED.md): D pulls a request's chunks from P's transfer server
    _c("pd_pulled_chunks", "chunks", "Chunks a decode instance pulled from a prefill instance and verified "
       "(peer: its extra_config.pd_peers entry, own, or other: a bounded set, whatever host a client "
       "names)", ("peer",)),
    _c("pd_pulled_bytes", "bytes", "Bytes of the chunks pulled from a prefill instance", ("peer",)),
    _h("pd_pull_seconds", "Time of one request's pull from one prefill instance's rank, first request "
       "to last frame", ("peer",)),
    _c("pd_pull_failures", "requests", "Pulls from a prefill instance that did not bring every chunk asked "
       "for (reason: timeout, unreachable, refused, missing, corrupt, no_memory) or that were not tried "
       "(bad_params, untrusted, unsigned, bad_signature, expired, unresolved: params refused before any "
       "connection; tp_mismatch, role, hybrid, uncacheable); the rest was recomputed", ("reason",)),
    _c("pd_served_chunks", "chunks", "Chunks a prefill instance's transfer server sent to a decode instance"),
    _c("pd_served_bytes", "bytes", "Bytes a prefill instance's transfer server sent"),
    _c("pd_holds_released", "requests", "Holds of a prefill instance's chunks ended by the decode "
       "instance's RELEASE (or the request's abort)"),
    _c("pd_holds_expired", "requests", "Holds ended because no decode instance released them within "
       "extra_config.pd_hold_secs"),
    _c("pd_holds_refused", "requests", "Requests a prefill instance did not hold because the bytes held for "
       "decode instances were at extra_config.pd_max_held_bytes: answered without kv_transfer_params (or their "
       "pull is answered ERR full) and the decode instance recomputes"),
    _c("pd_server_refusals", "connections", "Requests or connections a prefill instance's transfer server "
       "refused or cut off (reason: bad_request, auth, busy: every slot serving a pull; evicted: closed to "
       "make room; idle, timeout: no whole request in time; incomplete: the peer closed mid-request; lease: "
       "a send cut off at the hold's lease end; stalled: a peer that read nothing for its I/O timeout)",
       ("reason",)),
    _c("pd_prefill_requests", "requests", "Requests a prefill instance answered with kv_transfer_params "
       "for a decode instance", scope="engine"),
    _c("pd_remote_decode_refused", "requests", "Requests asking a prefill instance for a remote decode "
       "(do_remote_decode) it did not hold for, answered without kv_transfer_params (reason: not_configured: "
       "neither extra_config.pd: on with a chunk MAC key nor extra_config.pd_peers, and no proxy "
       "authorization; bad_proxy_auth: an authorization that does not verify)", ("reason",), scope="engine"),
    _c("pd_releases_dropped", "requests", "RELEASEs a decode instance did not send to a prefill instance, "
       "whose hold then lasts its lease (reason: queue_full, destinations: too many queued; stale: queued too "
       "long; unreachable, timeout: the connection failed or did not take them within 1 s)", ("reason",)),
    # -- P2P sharing (docs/P2P.md): chunks pulled from other instances' L1, found in a directory on Redis
    _c("p2p_pulled_chunks", "chunks", "Chunks pulled from another instance (peer: its host:port, the first 16 "
       "seen; later ones: other) and verified", ("peer",)),
    _c("p2p_pulled_bytes", "bytes", "Bytes of the chunks pulled from other instances", ("peer",)),
    _h("p2p_pull_seconds", "Time of one pull from one peer's rank, first request to last frame", ("peer",)),
    _c("p2p_pull_failures", "requests", "Pulls from a peer that did not bring every chunk asked for (reason: "
       "timeout, unreachable, refused, missing, corrupt, no_memory); the rest was recomputed, and a peer that "
       "timed out, was unreachable, refused or sent what did not verify is skipped for a while", ("reason",)),
    _c("p2p_served_chunks", "chunks", "Chunks this instance's transfer servers sent to peers from L1"),
    _c("p2p_served_bytes", "bytes", "Bytes of the chunks sent to peers"),
    _c("p2p_refused_fetches", "requests", "Requests for chunks refused because the peer is not trusted (no chunk "
       "MAC key, and its address not in extra_config.pd_peers)"),
    _c("p2p_lookups", "requests", "Directory lookups (one per batch of keys missing in L1 and disk)"),
    _h("p2p_lookup_seconds", "Time of one directory lookup"),
    _c("p2p_lookup_failures", "requests", "Directory lookups answered as misses because the directory did not "
       "answer within extra_config.p2p_lookup_timeout_secs (timeout) or failed (error)", ("reason",)),
    _c("p2p_skipped_peers", "servers", "Peers a lookup left out: backoff (a recent pull failed), untrusted (no "
       "chunk MAC key and not in extra_config.pd_peers, or no IP address), unsigned (with a chunk MAC key: a "
       "directory entry not signed with it), tp_mismatch (the same model at another TP size)",
       ("reason",)),
    _c("p2p_directory_failures", "requests", "Writes of this instance's directory entries that failed (op: "
       "advertise); retried, and every entry written again", ("op",)),
    # -- per-request hints in kv_transfer_params (docs/CONFIG.md, "Per-request hints")
    _c("request_hints", "requests", "Requests whose kv_transfer_params carried a hint that was followed "
       "(hint: skip_save, pin)", ("hint",), scope="engine"),
    _c("refused_request_hints", "requests", "Hints in kv_transfer_params that were ignored (reason: "
       "malformed, unknown, bad_skip_save, bad_pin_tokens, pins_disabled)", ("reason",), scope="engine"),
    _c("pins_released", "prefixes", "Pins that ended (reason: unpinned, expired after pin_ttl_secs, dropped by "
       "a forced delete, reset, shutdown)", ("reason",)),
    _c("pins_refused", "prefixes", "Pins (a request's lmcache.pin_tokens, the management API's) refused "
       "(reason: tenant_budget, total_budget, off)", ("reason",)),
    # -- the management API (docs/MANAGEMENT.md)
    _c("management_requests", "requests", "Calls to this instance's management API (route: method and path "
       "template; code: the HTTP status answered)", ("route", "code"), scope="engine"),
    _c("quota_evictions", "chunks", "L1 chunks evicted because their tenant (cache_salt) was past its quota",
       _T),
    # -- SGLang's HiCache storage backend (docs/SGLANG.md): calls of SGLang's cache controller into our tiers
    _c("sglang_pages", "pages", "Pages SGLang's HiCache controller handed the backend, by call (op: set, get, "
       "exists) and outcome (ok: stored, loaded into SGLang's host pool or found; missed: not found or not "
       "readable in time, a corrupt page included; failed: a store no tier took in time; refused: arguments "
       "that do not name pages of a registered pool, or a pool of a kind it cannot store)", ("op", "outcome")),
    _h("sglang_call_seconds", "Time of one call of SGLang's HiCache controller into the backend (op: set, get, "
       "exists)", ("op",)),
    # -- gauges, read when asked for
    _g("used_bytes", "bytes", "Bytes a tier uses now", _T),
    _g("capacity_bytes", "bytes", "Bytes a tier may use", _T),
    _g("resident_chunks", "chunks", "Chunks a tier holds now", _T),
    _g("unprotected_shared_tier", "state", "1 while a tier others can write (Redis; a disk directory "
       "configured as shared) stores chunks without a keyed MAC: whoever can write it can plant KV the "
       "model reads (set LMCACHE_VLLM_CHUNK_MAC_KEY), else 0", _T, agg="max"),
    _g("breaker_open", "state", "1 while the tier's circuit breaker is open (calls answer misses at "
       "once), else 0", _T, agg="max"),
    _g("redis_node_breaker_open", "state", "1 while a Redis node's circuit breaker is open (its keys are "
       "misses at once), else 0", _N, agg="max"),
    _g("write_queue_pending", "chunks", "Writes queued for the lower tiers"),
    _g("prefetch_held_chunks", "chunks", "Chunks held in L1 by prefetches until their request loads "
       "them"),
    _g("pd_holds", "requests", "Requests whose chunks a prefill instance holds in L1 until a decode "
       "instance pulls them (or the hold expires)"),
    _g("pd_held_bytes", "bytes", "Bytes of L1 chunks held for decode instances"),
    _g("pd_server_connections", "connections", "Connections open to a prefill instance's transfer servers"),
    _g("p2p_directory_entries", "chunks", "Chunks this instance lists in the P2P directory (its L1; what peers "
       "can pull)"),
    _g("pinned_prefixes", "prefixes", "Prefixes pinned in L1 (requests' lmcache.pin_tokens and the management "
       "API's pins)"),
    _g("pinned_bytes", "bytes", "Bytes of the L1 chunks those pins keep"),
)
METRICS: dict[str, MetricDef] = {d.name: d for d in METRIC_LIST}
