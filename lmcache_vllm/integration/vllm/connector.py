"""`LMCacheConnector`: the `KVConnectorBase_V1` vLLM loads to reach the lmcache-vllm cache.

    --kv-transfer-config '{"kv_connector": "LMCacheConnector",
                           "kv_connector_module_path": "lmcache_vllm.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"local_disk": "/tmp/kv"}}'

`kv_connector_extra_config` takes the keys of the YAML config (`load_config(overrides=...)`). Roles:
kv_both stores and loads, kv_producer only stores, kv_consumer only loads. Disaggregated prefill with vLLM's
kv_transfer_params (docs/DISAGGREGATED.md): a saving role holds for decode instances, a loading role pulls
from prefill instances; `pd/` holds that part.

vLLM builds one instance per role: the SCHEDULER one (in the EngineCore process) delegates to
`scheduler.SchedulerHalf`, each WORKER one (one per tensor-parallel rank) to `worker.WorkerHalf`. The
two talk only through `LMCacheConnectorMetadata` and the lookup sockets of `lookup.py`.

It is a `SupportsHMA` connector, so vLLM keeps its hybrid KV cache manager on for models with several KV
cache groups (sliding window, Mamba / linear attention): `groups.py` plans the groups, keys and chunks
carry the group, a hit is what every group can serve (docs/MODELS.md).

Importing this module registers the class with vLLM's `KVConnectorFactory` by name, and it can be one child of
vLLM's `MultiConnector` (`composition.py`, docs/COMPOSING.md). On a vLLM release not in
`versions.TESTED_VLLM_VERSIONS` it warns once at start (or refuses, `extra_config.allow_untested_vllm: false`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch
from vllm import __version__ as vllm_version
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_vllm.config import LMCacheConfig, load_config
from lmcache_vllm.config.peers import ip_literal
from lmcache_vllm.cpu_affinity import set_background_cpus
from lmcache_vllm.integration.vllm.chunk_size import with_chunk_size
from lmcache_vllm.integration.vllm.composition import find_composition, register_connector
from lmcache_vllm.integration.vllm.events import (
    LMCacheWorkerReport,
    SchedulerEvents,
    VllmBlocks,
    take_worker_events,
    worker_report,
)
from lmcache_vllm.integration.vllm.fingerprint import model_identity
from lmcache_vllm.integration.vllm.groups import GroupPlan, SchedulerGroups, build_grouped_engine, plan_groups
from lmcache_vllm.integration.vllm.lookup import LookupClient
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata
from lmcache_vllm.integration.vllm.parallelism import ParallelLayout, TPFailureAgreement, check_supported, worker_layout
from lmcache_vllm.integration.vllm.pd.params import advertised_host, bind_host
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler
from lmcache_vllm.integration.vllm.pd.trust import PeerTrust, host_warnings, own_addresses, pd_scope
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf
from lmcache_vllm.integration.vllm.stats import LMCacheConnectorStats, LMCachePromMetrics, take_stats
from lmcache_vllm.integration.vllm.threads import background_cpus_for
from lmcache_vllm.integration.vllm.versions import check_vllm_version
from lmcache_vllm.integration.vllm.worker import WorkerHalf
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.storage.tier import Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.engine.grouped import GroupedEngine
    from lmcache_vllm.integration.vllm.pd.worker import PeerTransfer


logger = logging.getLogger(__name__)

_LOADING_ROLES = ("kv_both", "kv_consumer")
# Where vLLM's prompt_tokens_cached_by_source puts the hits of each of our tiers.
_HIT_SOURCES: dict[str, CacheHitSource] = {
    Tier.LOCAL_CPU: CacheHitSource.HOST, Tier.LOCAL_DISK: CacheHitSource.DISK,
    Tier.REDIS: CacheHitSource.EXTERNAL_UNSPECIFIED, Tier.PEER: CacheHitSource.P2P, Tier.P2P: CacheHitSource.P2P,
    Tier.MOONCAKE: CacheHitSource.EXTERNAL_UNSPECIFIED}
_SAVING_ROLES = ("kv_both", "kv_producer")


def build_cache_engine(config: LMCacheConfig, vllm_config: "VllmConfig", kv_caches: dict[str, torch.Tensor],
                       layout: ParallelLayout, kv_cache_config: "KVCacheConfig | None" = None,
                       plan: GroupPlan | None = None) -> "CacheEngine | GroupedEngine":
    """The `CacheEngine` for one worker rank, keyed by the model's identity (`fingerprint.py`), KV dtype,
    TP and PP size and rank; for a model with several KV cache groups (`plan`) a `GroupedEngine`."""
    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.integration.vllm.kv_layout import layout_for
    from lmcache_vllm.storage.codec import FORMAT_VERSION
    from lmcache_vllm.storage.registry import chunk_mac
    from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

    caches = list(kv_caches.values())
    hasher = ChunkHasher(config.resolved_chunk_size, config.pre_caching_hash_algorithm)
    mac = chunk_mac(config)
    identity = model_identity(vllm_config, namespace=config.extra_config.cache_namespace, mac_keyed=mac is not None)
    logger.info("cache keys of this model: %s@%s (fingerprint of its effective config, revision, dtypes, "
                "weights signature and namespace)", identity.name, identity.fingerprint)
    keys = KeyBuilder(model=identity.name, world_size=layout.tp_size, rank=layout.tp_rank,
                      kv_dtype=caches[0].dtype, fmt_version=FORMAT_VERSION, hasher=hasher,
                      fingerprint=identity.fingerprint, pp_size=layout.pp_size, pp_rank=layout.pp_rank)
    if plan is not None and plan.multi and kv_cache_config is not None:
        return build_grouped_engine(config, vllm_config, kv_caches, kv_cache_config, plan.groups, keys)
    kv_layout = layout_for(vllm_config, kv_cache_config, kv_caches)
    # On a GPU: the kernel is used only once it gave the torch path's bytes on a scratch copy of this layout.
    kv_layout.bind_kernel(caches, config.extra_config.cuda_kernel)
    return CacheEngine(config, kv_layout, keys)


def pd_trust(config: LMCacheConfig, vllm_config: "VllmConfig", tp_size: int) -> PeerTrust:
    """Which prefill instances the scheduler half pulls from, and the key it signs its own params with."""
    from lmcache_vllm.storage.registry import chunk_mac

    mac = chunk_mac(config)
    scope = ""
    if mac is not None:  # signed params name the model's keys: a signature for another model does not pass
        identity = model_identity(vllm_config, namespace=config.extra_config.cache_namespace, mac_keyed=True)
        scope = pd_scope(identity.fingerprint, tp_size, config.resolved_chunk_size)
    pd_host = config.extra_config.pd_host
    advertised = advertised_host(pd_host)  # what this instance names in its own params (vLLM's IP for 0.0.0.0)
    own = own_addresses(bind_host(pd_host)) | (frozenset({advertised}) if ip_literal(advertised) else frozenset())
    return PeerTrust(config.extra_config.pd_peers, mac, scope, own_addresses=own)


def pd_explicit(config: LMCacheConfig, mac: object) -> bool:
    """Whether disaggregated prefill is configured explicitly, so that any client's do_remote_decode is held
    for: `pd: on` with a chunk MAC key, or `pd_peers` (else only a proxy holding the key is)."""
    extra = config.extra_config
    return (extra.pd == "on" and mac is not None) or bool(extra.pd_peers)


class LMCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """Saves vLLM's KV into tiered storage and loads cached prefixes back (see module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        # chunk_size not set: vLLM's block size on its CPU backend (chunk_size.py), chosen alike by both halves.
        self.config = with_chunk_size(load_config(overrides=dict(transfer.kv_connector_extra_config or {})),
                                      vllm_config.cache_config.block_size, current_platform.is_cpu(),
                                      log=role == KVConnectorRole.SCHEDULER)
        check_vllm_version(vllm_version, allow_untested=self.config.extra_config.allow_untested_vllm,
                           warn=role == KVConnectorRole.SCHEDULER)
        composition = find_composition(vllm_config)
        pd_on = composition.pd_enabled(self.config.extra_config.pd)
        kv_role = transfer.kv_role or "kv_both"
        self.can_load = kv_role in _LOADING_ROLES
        self.can_save = kv_role in _SAVING_ROLES
        plan = self._groups = plan_groups(kv_cache_config)
        if plan.disabled:
            # vLLM serves the model as without us: caching it would need what vLLM does not keep.
            logger.warning("LMCacheConnector does not cache this model: %s", plan.disabled)
            self.can_load = self.can_save = False
        if transfer.kv_load_failure_policy != "recompute":
            # A cache miss must never fail a request: a chunk that cannot be loaded is recomputed. (Inside a
            # MultiConnector this is the child's copy, which vLLM does not read: warned about below.)
            logger.info("LMCacheConnector sets kv_load_failure_policy='recompute' (was %r)",
                        transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"
        if role == KVConnectorRole.SCHEDULER:  # once per engine
            if (policy_warning := composition.load_policy_warning()) is not None:
                logger.warning(policy_warning)
            if composition.in_multi or self.config.extra_config.pd != "auto":
                logger.info("LMCacheConnector: %s", composition.describe_pd(self.config.extra_config.pd))
        block_size = vllm_config.cache_config.block_size
        sizes = check_supported(vllm_config)  # PP / DCP / PCP > 1: refused here, with the reason
        world_size = sizes.tp_size
        instance_id = str(transfer.engine_id)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        kv_events.RECORDER.enabled = self.config.enable_kv_events
        # Checked in both roles: a chunk size routers cannot count in vLLM's blocks fails at start.
        self._blocks = VllmBlocks(block_size, self.config.resolved_chunk_size) if self.config.enable_kv_events else None
        self._events = SchedulerEvents(world_size) if (
            self._blocks is not None and role == KVConnectorRole.SCHEDULER) else None
        if role == KVConnectorRole.SCHEDULER:
            client = LookupClient(sizes.lookup_addresses(instance_id), timeout_ms=self.config.lookup_timeout_ms)
            pd = PDScheduler(engine_id=instance_id, host=advertised_host(self.config.extra_config.pd_host),
                             chunk_size=self.config.resolved_chunk_size, tp_size=world_size,
                             ask_ports=lambda: client.command("pd_port"), can_load=self.can_load,
                             can_save=self.can_save, trust=(trust := pd_trust(self.config, vllm_config, world_size)),
                             hold_s=self.config.extra_config.pd_hold_secs, grouped=plan.multi,
                             namespaced_params=composition.namespaced_params,
                             hold_for_any_client=pd_explicit(self.config, trust.mac)) if pd_on else None
            if pd is not None and self.can_save:
                for warning in host_warnings(pd.host):
                    logger.warning(warning)
            if pd is not None and self.config.extra_config.pd == "on" and pd.trust.mac is None \
                    and not pd.hold_for_any_client:
                logger.warning("disaggregated prefill: extra_config.pd is on, but without a chunk MAC key or "
                               "extra_config.pd_peers this instance holds for no request and pulls from no other "
                               "instance: set LMCACHE_VLLM_CHUNK_MAC_KEY on every instance, or list their "
                               "transfer ports in pd_peers (docs/DISAGGREGATED.md)")
            self._scheduler = SchedulerHalf(self.config, block_size=block_size, lookup_client=client,
                                            can_load=self.can_load, can_save=self.can_save, pd=pd,
                                            groups=SchedulerGroups(plan.groups, self.config.resolved_chunk_size)
                                            if plan.multi else None)
        else:
            layout = worker_layout(vllm_config)
            metrics.set_primary(layout.tp_rank == 0 and layout.pp_rank == 0)  # per-engine counts from one rank
            # Before any thread of ours starts: they run beside vLLM's compute cores, not on them.
            set_background_cpus(background_cpus_for(vllm_config, self.config.extra_config.background_cpus))
            from lmcache_vllm.storage.base import InstanceIdentity  # the worker only: it loads the cache's memory

            config = self.config
            can_save = self.can_save
            if can_save and not plan.multi:  # this rank will serve a KV transfer port (pd/worker.py)
                from lmcache_vllm.storage.registry import check_chunk_mac, chunk_mac

                check_chunk_mac(config, chunk_mac(config), transfer_host=bind_host(config.extra_config.pd_host))

            def peer_transfer(engine: "CacheEngine") -> "PeerTransfer":
                from lmcache_vllm.integration.vllm.pd.worker import PeerTransfer
                from lmcache_vllm.storage.registry import chunk_mac

                return PeerTransfer(config, engine, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
                                    mac=chunk_mac(config), serve=can_save)

            self._worker = WorkerHalf(
                config, engine_factory=lambda caches: build_cache_engine(config, vllm_config, caches, layout,
                                                                         kv_cache_config, plan),
                block_size=block_size,
                # A PD producer answers only once its chunks are in the shared tier (save_pipeline.py).
                durable_saves=kv_role == "kv_producer",
                # Every role serves the lookup channel: its commands (reset, the transfer ports) too.
                lookup_address=layout.lookup_address(instance_id),
                max_lookup_tokens=vllm_config.model_config.max_model_len,
                failure_agreement=TPFailureAgreement(layout.tp_size),
                peer_factory=peer_transfer if pd_on else None,
                identity=InstanceIdentity(instance_id, layout.tp_rank, layout.tp_size))
        self._kv_role, self._world_size = kv_role, world_size
        logger.debug("LMCacheConnector (%s, role %s): chunk_size=%d block_size=%d tp=%d", role.name,
                    kv_role, self.config.resolved_chunk_size, block_size, world_size)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never something vLLM must wait for.
        return False

    # Class-level hooks vLLM asks before building any instance. vLLM 0.32 lacks some of them; it just never
    # calls those, so this one module serves 0.32 and 0.33.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33: sleep mode remaps (and discards) the KV cache under us; a cached prefix would then be
        # loaded into memory vLLM may hand elsewhere. Refused: vLLM reports it at start-up.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layerwise loads and saves run in wait_for_layer_load / save_kv_layer between the layers, which a full
        # CUDA graph replay skips: then a layer could be read before its KV is loaded. Piecewise graphs keep them.
        return load_config(overrides=dict(extra_config or {})).use_layerwise

    # ============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._groups.disabled:
            return  # nothing is cached: the worker half stays without an engine (every call a no-op)
        self._worker.register_kv_caches(kv_caches)
        # The one start-up line with the resolved configuration (each worker rank, once).
        logger.info("%s, %d layers", logs.describe_config(
            self.config, layout=self._worker.engine.layout if self._worker.engine else None,
            world_size=self._world_size, role=self._kv_role), len(kv_caches))

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33, before the KV cache is released (sleep, discard): no copy may touch it from now on.
        if self._worker is not None:
            self._worker.pause()

    def restore_kv_caches(self) -> None:
        # vLLM 0.33, after wake-up: the same views are valid again.
        if self._worker is not None:
            self._worker.resume()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this at the start of every step, before it zeroes or writes any block: background
        # saves still copying from the blocks of requests preempted this step must finish first.
        if self._worker is not None and isinstance(kv_connector_metadata, LMCacheConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, LMCacheConnectorMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, LMCacheConnectorMetadata) and meta.saves:
            self._worker.save_kv_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, LMCacheConnectorMetadata):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._worker.get_finished(meta if isinstance(meta, LMCacheConnectorMetadata) else None,
                                         finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        # vLLM 0.32: a model with several KV cache groups reports a failed load as a failed receive (vLLM
        # recomputes the request); block-level errors cannot be mapped for it.
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            results.failed_recving |= self._worker.take_failed_recving()
        return results

    # ============================================================== worker reports: KV events, holds (events.py)
    def build_connector_worker_meta(self) -> "KVConnectorWorkerMetadata | None":
        # The worker metadata, not get_kv_connector_kv_cache_events: MultiConnector forwards only this.
        if self._worker is None:
            return None
        events = take_worker_events(self._blocks) if self._blocks is not None else []
        return worker_report(events, self._worker.hold_report())

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        report = connector_output.kv_connector_worker_meta
        if self._events is not None:
            self._events.add(report)
        pd = self._scheduler.pd if self._scheduler is not None else None
        if pd is not None and isinstance(report, LMCacheWorkerReport) and report.holds is not None:
            pd.heard(report.holds)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self._events.take() if self._events is not None else ()

    # ============================================================== both sides: metrics (stats.py)
    def get_kv_connector_stats(self) -> LMCacheConnectorStats | None:
        return take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMCacheConnectorStats:
        return LMCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LMCachePromMetrics:
        return LMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.lookup_client.close()

    # ============================================================== scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: vLLM calls this instead of request_finished. Block ids do not matter to the answer
        # (saves read the tables each step carried).
        return self._scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0:
            return {}
        sources: dict[CacheHitSource, int] = {}
        for tier, n in self._scheduler.hit_sources(request.request_id).items():
            source = _HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + n
        if sum(sources.values()) != num_external_tokens:  # not our plan for this request: do not guess
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {s: n for s, n in sources.items() if n}

    def reset_cache(self) -> bool | None:
        """vLLM's `/reset_prefix_cache?reset_external=true` and its pause with `clear_cache`: every worker rank
        empties its L1 (and L2/L3 with extra_config.reset_lower_tiers). True when all did; when not, None (what
        vLLM's base class answers for a connector without a reset) rather than False, which vLLM 0.32 / 0.33 turn
        into a RuntimeError in their pause (`pause_generation(clear_cache=True)`). The failure is logged and
        counted (`failed_resets`); the chunks not dropped may still be served."""
        command = "reset_all" if self.config.extra_config.reset_lower_tiers else "reset_l1"
        try:
            results = self._scheduler.lookup_client.command(command) if self._scheduler is not None else None
        except Exception:  # never into vLLM's pause
            logger.exception("LMCache reset (%s) failed", command)
            results = None
        if results is not None and all(r == 1 for r in results):
            logger.info("LMCache reset (%s): done", command)
            return True
        metrics.inc("failed_resets")
        logger.warning("LMCache reset (%s) failed (worker answers: %s): chunks it did not drop may still be "
                       "served; vLLM is told there was nothing to reset, so its own reset goes on", command, results)
        return None


register_connector()  # a name lookup (MultiConnector's stats in the API server) finds us in this process
