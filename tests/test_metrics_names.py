"""The metric names, kinds, labels and help texts dashboards depend on, listed here on purpose: renaming or
re-documenting a metric must change this test too. The table in docs/METRICS.md and the Grafana dashboard
are checked against the same table."""
import json
import re
from pathlib import Path

from lmcache_vllm.observability import metrics, metrics_doc

ROOT = Path(__file__).resolve().parents[1]

STABLE = [
    ("lookups", "counter", (),
     'Prefix lookups the scheduler asked the workers for (the answer is reused while the request'
     ' waits for free blocks; a pending one is asked again)'),
    ("lookups_in_process", "counter", (),
     "Lookups answered by a direct call because every rank's lookup server lives in the "
     "scheduler's process"),
    ("lookup_timeouts", "counter", (),
     'Lookups that timed out and counted as 0 hits'),
    ("lookup_rejected", "counter", (),
     'Lookup messages a worker refused: malformed, a field out of range, more tokens than '
     'max_model_len, or an answer that does not fit the wire (answered 0 hits, or -1 to a command)'),
    ("lookup_server_restarts", "counter", (),
     "Times a worker's lookup server loop failed outside any one message (a ZMQ error) and started "
     "serving again"),
    ("uncacheable_requests", "counter", ('reason',),
     'Requests neither looked up nor saved because what decides their KV besides token ids '
     'cannot be named in a key (reason: mm_unidentified, lora_unreadable, error_<exception>)'),
    ("lookup_seconds", "histogram", (),
     'Time of one scheduler lookup over every rank'),
    ("hit_tokens", "counter", ('tier',),
     'Prompt tokens vLLM loads from our tiers beyond its own prefix cache, by the tier holding'
     ' them (counted once per scheduled load)'),
    ("load_requests", "counter", (),
     'Requests the scheduler planned a load for'),
    ("async_load_requests", "counter", (),
     'Loads planned asynchronously: the hit needed the disk or Redis tier (or the model has '
     'several KV cache groups), so the request waited (WAITING_FOR_REMOTE_KVS) while vLLM ran '
     'the others'),
    ("pending_lookups", "counter", (),
     "Lookups answered 'ask again' because a slower tier had not said yet where the chunks are;"
     ' vLLM ran the other requests that step'),
    ("retrieves_below_minimum", "counter", (),
     'Hits not loaded because they would load fewer new tokens than min_retrieve_tokens (vLLM computed them)'),
    ("load_limited_requests", "counter", (),
     "Requests whose kv_transfer_params carried a valid max_load_tokens (vLLM's per-request cap on tokens "
     "loaded beyond its own prefix cache; 0: no load)"),
    ("refused_request_params", "counter", ("param",),
     "Requests with a kv_transfer_params field of ours that was ignored because its value is not accepted "
     "(param: max_load_tokens)"),
    ("failed_resets", "counter", (),
     "Resets (vLLM's /reset_prefix_cache?reset_external=true, its pause with clear_cache) that not every worker "
     "rank confirmed; vLLM was answered 'nothing to reset'"),
    ("loaded_tokens", "counter", (),
     "Tokens whose KV was loaded into vLLM's paged KV cache (counted on TP rank 0)"),
    ("failed_load_tokens", "counter", (),
     'Tokens planned to load that could not be; vLLM recomputes them (summed over TP ranks)'),
    ("stored_tokens", "counter", (),
     'Tokens whose KV was newly stored (counted on TP rank 0)'),
    ("group_loaded_tokens", "counter", ('group',),
     'Tokens loaded into one KV cache group of a model with several (hybrid: full attention, '
     "sliding window, Mamba state); a sliding group loads only the window before the hit's end "
     '(counted on TP rank 0)'),
    ("group_stored_tokens", "counter", ('group',),
     'Tokens newly stored for one KV cache group of a model with several (a state group: one '
     "state per chunk boundary counts as the chunk's tokens; counted on TP rank 0)"),
    ("group_limited_hits", "counter", ('group',),
     'Lookups whose hit a KV cache group cut short: the full-attention chunks ran further than '
     "this group's chunks (sliding window) or states allowed"),
    ("store_skipped_tokens", "counter", (),
     'Tokens handed to a store whose chunks were stored already'),
    ("failed_stores", "counter", (),
     'Stores of a request that failed with an error; its chunks stay uncached'),
    ("stores_skipped_after_failed_load", "counter", (),
     "Saves skipped because the request's load failed in the same step, on this or another TP "
     'rank (KV computed past a hole is not kept)'),
    ("loads_failed_on_other_rank", "counter", (),
     'Loads that succeeded on this TP rank but failed on another; the request saves nothing in '
     'that step on any rank'),
    ("shape_mismatches", "counter", (),
     'Chunks found under their key with another shape or dtype; treated as misses'),
    ("load_seconds", "histogram", (),
     "Time to load one request's cached KV into vLLM's paged cache"),
    ("overlapped_loads", "counter", (),
     "Loads copied layer by layer on the load thread while vLLM's forward ran (extra_config.overlap_loads)"),
    ("load_wait_seconds", "counter", (),
     "Time vLLM's forward waited for layers the load thread had not copied yet (extra_config.overlap_loads)"),
    ("load_thread_timeouts", "counter", (),
     'Steps whose load thread did not copy a layer within blocking_timeout_secs; its loads were stopped and '
     'recomputed'),
    ("load_thread_stuck", "counter", (),
     'Steps whose load thread did not stop within blocking_timeout_secs after a timeout; its loads and those of '
     'later steps while it stayed stuck were recomputed'),
    ("cuda_kernel_fallbacks", "counter", ('reason',),
     'KV layouts whose copies use the torch path on a GPU although extra_config.cuda_kernel is auto: the '
     'CUDA kernel gave other bytes than the torch path on a scratch copy of the layout (mismatch), failed to '
     'run (error) or is not built (not_built)'),
    ("async_load_timeouts", "counter", (),
     'Asynchronous loads whose chunks were not read within blocking_timeout_secs; what had not'
     ' arrived was recomputed'),
    ("lookup_read_waits", "counter", ("result",),
     "First lookups of a hit read from a lower tier that waited for its reads (the recent reads' pace said "
     "they end within extra_config.lookup_read_wait_ms): ready (loaded inside the step like an L1 hit), late "
     "(loaded asynchronously) or failed (a read did not bring a chunk its tier listed: loaded asynchronously, "
     "the rest recomputed)"),
    ("aborted_async_loads", "counter", (),
     'Requests that finished (aborted) while their asynchronous load waited; its reads and holds'
     ' were released'),
    ("durable_save_timeouts", "counter", (),
     "A producer's saves of a complete prompt not written to every lower tier within"
     ' blocking_timeout_secs (a consumer may miss them)'),
    ("store_seconds", "histogram", (),
     "Time to store one request's new KV (on the save thread unless saves are synchronous)"),
    ("save_wait_seconds", "counter", (),
     "Time vLLM's step waited for background saves to finish"),
    ("chunk_hits", "counter", ('tier',),
     'Chunks served by a tier (L1 from memory; L2/L3 read and promoted into L1)'),
    ("chunk_misses", "counter", ('tier',),
     'Chunks a tier was asked for and did not hold'),
    ("read_bytes", "counter", ('tier',),
     'Bytes of chunks served by a tier'),
    ("stored_chunks", "counter", ('tier',),
     'Chunks written to a tier'),
    ("stored_bytes", "counter", ('tier',),
     'Bytes of chunks written to a tier'),
    ("coded_bytes", "counter", ('tier', 'codec'),
     "Payload bytes a tier wrote for its chunks after their codec (a chunk's codec after fallbacks: naive, "
     "lossless, fp8); stored_bytes over it is the compression ratio"),
    ("dropped_stores", "counter", ('reason',),
     'Chunks not stored below L1 or at all: arena_full (no L1 memory for a new chunk), '
     'queue_full (lower-tier write queue full), shutdown (queued at close), cold_backlog (an L1 '
     'eviction the compressed cold part of L1 had no time to code)'),
    ("failed_writes", "counter", ('tier',),
     'Writes a lower tier refused or failed (disk full, chunk larger than the tier, Redis down'
     ' or its breaker open)'),
    ("failed_reads", "counter", ('tier',),
     'Reads or existence checks of a tier that failed (I/O error, Redis or Mooncake down or its '
     'breaker open); answered as misses'),
    ("corrupt_chunks", "counter", ('tier',),
     'Stored chunks that failed their checks (checksum, size, header) and were deleted'),
    ("unauthenticated_chunks", "counter", (),
     'Chunks whose keyed MAC did not verify (extra_config.chunk_mac_key set): also counted in '
     'corrupt_chunks, answered as misses and deleted'),
    ("lost_chunks", "counter", ('tier',),
     'Chunks a tier listed but could not read back (Mooncake: evicted since, or their storage host '
     'died; such an entry is removed): answered as misses'),
    ("evictions", "counter", ('tier',),
     'Chunks evicted from a tier to make room (least recently used first)'),
    ("read_alloc_failures", "counter", ('tier',),
     'Lower-tier hits not read because no L1 memory was free'),
    ("breaker_skipped_calls", "counter", ('tier',),
     "Calls answered at once as misses while the tier's circuit breaker was open"),
    ("storage_timeouts", "counter", ('op',),
     'Storage calls (op lookup or get) that passed their timeout and answered a miss'),
    ("storage_errors", "counter", ('op',),
     'Storage calls (op lookup or get) that failed with an unexpected error and answered a '
     'miss'),
    ("prefetches", "counter", (),
     'Background reads started from the lower tiers into L1'),
    ("adopted_chunks", "counter", ('tier',),
     'Chunk files another process wrote into a shared directory, found on a miss and indexed'),
    ("reindexed_chunks", "counter", ('tier',),
     'Chunk files found and indexed at start-up'),
    ("redis_node_read_chunks", "counter", ('node',),
     'Chunks a Redis node served'),
    ("redis_node_stored_chunks", "counter", ('node',),
     'Chunks written to a Redis node'),
    ("redis_node_failed_calls", "counter", ('node',),
     'Calls to a Redis node that failed (connection refused or lost, timeout, refused credentials): its '
     'keys were misses, its writes dropped'),
    ("redis_node_skipped_calls", "counter", ('node',),
     "Calls answered at once as misses while that node's circuit breaker was open"),
    ("redis_node_redirects", "counter", ('node',),
     "Replies MOVED/ASK/TRYAGAIN from a cluster node (a slot moving or moved): the command was sent again "
     "where redis-py's slot map says"),
    ("tier_read_seconds", "histogram", ('tier',),
     'Time of one batched read from a lower tier'),
    ("tier_write_seconds", "histogram", ('tier',),
     'Time to write one chunk to a lower tier'),
    ("pd_pulled_chunks", "counter", ('peer',),
     'Chunks a decode instance pulled from a prefill instance and verified (peer: its '
     'extra_config.pd_peers entry, own, or other: a bounded set, whatever host a client names)'),
    ("pd_pulled_bytes", "counter", ('peer',),
     'Bytes of the chunks pulled from a prefill instance'),
    ("pd_pull_seconds", "histogram", ('peer',),
     "Time of one request's pull from one prefill instance's rank, first request to last frame"),
    ("pd_pull_failures", "counter", ('reason',),
     'Pulls from a prefill instance that did not bring every chunk asked for (reason: timeout, '
     'unreachable, refused, missing, corrupt, no_memory) or that were not tried (bad_params, untrusted, '
     'unsigned, bad_signature, expired, unresolved: params refused before any connection; tp_mismatch, '
     'role, hybrid, uncacheable); the rest was recomputed'),
    ("pd_served_chunks", "counter", (),
     "Chunks a prefill instance's transfer server sent to a decode instance"),
    ("pd_served_bytes", "counter", (),
     "Bytes a prefill instance's transfer server sent"),
    ("pd_holds_released", "counter", (),
     "Holds of a prefill instance's chunks ended by the decode instance's RELEASE (or the "
     "request's abort)"),
    ("pd_holds_expired", "counter", (),
     'Holds ended because no decode instance released them within extra_config.pd_hold_secs'),
    ("pd_holds_refused", "counter", (),
     "Requests a prefill instance did not hold because the bytes held for decode instances were at "
     "extra_config.pd_max_held_bytes: answered without kv_transfer_params (or their pull is answered ERR full) "
     "and the decode instance recomputes"),
    ("pd_server_refusals", "counter", ("reason",),
     "Requests or connections a prefill instance's transfer server refused or cut off (reason: bad_request, "
     "auth, busy: every slot serving a pull; evicted: closed to make room; idle, timeout: no whole request in "
     "time; incomplete: the peer closed mid-request; lease: a send cut off at the hold's lease end; stalled: "
     "a peer that read nothing for its I/O timeout)"),
    ("pd_prefill_requests", "counter", (),
     'Requests a prefill instance answered with kv_transfer_params for a decode instance'),
    ("pd_remote_decode_refused", "counter", ('reason',),
     'Requests asking a prefill instance for a remote decode (do_remote_decode) it did not hold for, answered '
     'without kv_transfer_params (reason: not_configured: neither extra_config.pd: on with a chunk MAC key nor '
     'extra_config.pd_peers, and no proxy authorization; bad_proxy_auth: an authorization that does not verify)'),
    ("pd_releases_dropped", "counter", ('reason',),
     'RELEASEs a decode instance did not send to a prefill instance, whose hold then lasts its lease (reason: '
     'queue_full, destinations: too many queued; stale: queued too long; unreachable, timeout: the connection '
     'failed or did not take them within 1 s)'),
    ("p2p_pulled_chunks", "counter", ('peer',),
     'Chunks pulled from another instance (peer: its host:port, the first 16 seen; later ones: other) and verified'),
    ("p2p_pulled_bytes", "counter", ('peer',),
     'Bytes of the chunks pulled from other instances'),
    ("p2p_pull_seconds", "histogram", ('peer',),
     "Time of one pull from one peer's rank, first request to last frame"),
    ("p2p_pull_failures", "counter", ('reason',),
     'Pulls from a peer that did not bring every chunk asked for (reason: timeout, unreachable, refused,'
     ' missing, corrupt, no_memory); the rest was recomputed, and a peer that timed out, was unreachable,'
     ' refused or sent what did not verify is skipped for a while'),
    ("p2p_served_chunks", "counter", (),
     "Chunks this instance's transfer servers sent to peers from L1"),
    ("p2p_served_bytes", "counter", (),
     'Bytes of the chunks sent to peers'),
    ("p2p_refused_fetches", "counter", (),
     'Requests for chunks refused because the peer is not trusted (no chunk MAC key, and its address not'
     ' in extra_config.pd_peers)'),
    ("p2p_lookups", "counter", (),
     'Directory lookups (one per batch of keys missing in L1 and disk)'),
    ("p2p_lookup_seconds", "histogram", (),
     'Time of one directory lookup'),
    ("p2p_lookup_failures", "counter", ('reason',),
     'Directory lookups answered as misses because the directory did not answer within'
     ' extra_config.p2p_lookup_timeout_secs (timeout) or failed (error)'),
    ("p2p_skipped_peers", "counter", ('reason',),
     'Peers a lookup left out: backoff (a recent pull failed), untrusted (no chunk MAC key and not in'
     ' extra_config.pd_peers, or no IP address), unsigned (with a chunk MAC key: a directory entry not signed'
     ' with it), tp_mismatch (the same model at another TP size)'),
    ("p2p_directory_failures", "counter", ('op',),
     "Writes of this instance's directory entries that failed (op: advertise); retried, and every entry written again"),
    ("request_hints", "counter", ('hint',),
     'Requests whose kv_transfer_params carried a hint that was followed (hint: skip_save, pin)'),
    ("refused_request_hints", "counter", ('reason',),
     'Hints in kv_transfer_params that were ignored (reason: malformed, unknown, bad_skip_save, '
     'bad_pin_tokens, pins_disabled)'),
    ("pins_released", "counter", ('reason',),
     'Pins that ended (reason: unpinned, expired after pin_ttl_secs, dropped by a forced delete, reset, '
     'shutdown)'),
    ("pins_refused", "counter", ('reason',),
     "Pins (a request's lmcache.pin_tokens, the management API's) refused (reason: tenant_budget, "
     "total_budget, off)"),
    ("management_requests", "counter", ('route', 'code'),
     "Calls to this instance's management API (route: method and path template; code: the HTTP status "
     "answered)"),
    ("quota_evictions", "counter", ('tier',),
     'L1 chunks evicted because their tenant (cache_salt) was past its quota'),
    ("sglang_pages", "counter", ("op", "outcome"),
     "Pages SGLang's HiCache controller handed the backend, by call (op: set, get, exists) and outcome (ok: "
     "stored, loaded into SGLang's host pool or found; missed: not found or not readable in time, a corrupt page "
     "included; failed: a store no tier took in time; refused: arguments that do not name pages of a registered "
     "pool, or a pool of a kind it cannot store)"),
    ("sglang_call_seconds", "histogram", ("op",),
     "Time of one call of SGLang's HiCache controller into the backend (op: set, get, exists)"),
    ("used_bytes", "gauge", ('tier',),
     'Bytes a tier uses now'),
    ("capacity_bytes", "gauge", ('tier',),
     'Bytes a tier may use'),
    ("resident_chunks", "gauge", ('tier',),
     'Chunks a tier holds now'),
    ("unprotected_shared_tier", "gauge", ('tier',),
     '1 while a tier others can write (Redis; a disk directory configured as shared) stores chunks '
     'without a keyed MAC: whoever can write it can plant KV the model reads (set '
     'LMCACHE_VLLM_CHUNK_MAC_KEY), else 0'),
    ("breaker_open", "gauge", ('tier',),
     "1 while the tier's circuit breaker is open (calls answer misses at once), else 0"),
    ("redis_node_breaker_open", "gauge", ('node',),
     "1 while a Redis node's circuit breaker is open (its keys are misses at once), else 0"),
    ("write_queue_pending", "gauge", (),
     'Writes queued for the lower tiers'),
    ("prefetch_held_chunks", "gauge", (),
     'Chunks held in L1 by prefetches until their request loads them'),
    ("pd_holds", "gauge", (),
     'Requests whose chunks a prefill instance holds in L1 until a decode instance pulls them '
     '(or the hold expires)'),
    ("pd_held_bytes", "gauge", (),
     'Bytes of L1 chunks held for decode instances'),
    ("pd_server_connections", "gauge", (),
     "Connections open to a prefill instance's transfer servers"),
    ("p2p_directory_entries", "gauge", (),
     'Chunks this instance lists in the P2P directory (its L1; what peers can pull)'),
    ("pinned_prefixes", "gauge", (),
     "Prefixes pinned in L1 (requests' lmcache.pin_tokens and the management API's pins)"),
    ("pinned_bytes", "gauge", (),
     'Bytes of the L1 chunks those pins keep'),
]


def test_metric_names_kinds_labels_and_help_texts_are_stable():
    assert [(d.name, d.kind, d.labels, d.help) for d in metrics.METRIC_LIST] == STABLE


def test_metrics_doc_carries_the_generated_metric_table():
    section = metrics_doc.generated_section((ROOT / "docs" / "METRICS.md").read_text())
    assert section == metrics_doc.markdown(), "run: python -m lmcache_vllm.observability.metrics_doc --update-docs"


def test_grafana_dashboard_uses_only_metrics_that_exist():
    dashboard = json.loads((ROOT / "examples" / "grafana" / "lmcache-vllm.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = set(re.findall(r"lmcache_vllm:([a-z_]+)", " ".join(exprs)))
    suffixes = ("_total", "_bucket", "_sum", "_count")
    names = {next((u[:-len(s)] for s in suffixes if u.endswith(s) and u[:-len(s)] in metrics.METRICS), u)
             for u in used}
    assert names <= set(metrics.METRICS), names - set(metrics.METRICS)
    for name in names:  # counters are used with _total, histograms with _bucket
        kind = metrics.METRICS[name].kind
        assert any(u == name + {"counter": "_total", "histogram": "_bucket", "gauge": ""}[kind] for u in used)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit rate", "bytes", "latency", "evictions", "errors"):
        assert topic in titles
