"""The worker half of `LMCacheConnector`: one per vLLM worker (tensor-parallel rank), beside the KV cache.

`register_kv_caches` detects the paged layout, builds the `CacheEngine`, the load pipeline
(`load_pipeline.LoadPipeline`: cached chunks into the paged cache, failed loads reported for recompute)
and the save pipeline (`save_pipeline.SavePipeline`: computed KV out of it, on a background thread),
and starts this rank's `LookupServer`, which answers the scheduler's lookups by holding the chunks it
promises until the load takes them. The methods below are vLLM's worker-side connector calls, in the
order of a step: `handle_preemptions`, `begin_step`, `start_load_kv`, `wait_for_layer_load` /
`save_kv_layer` per layer, `wait_for_save`, `get_finished`, `take_load_errors`.

Disaggregated prefill (`pd/worker.py`): the holds of a prefill instance are registered, and the holds to
drop and the releases of a decode instance sent, in `wait_for_save` (every step, empty ones included); an
asynchronous load naming a prefill instance pulls from it first (`loads.RequestLoads`).

A lookup waits for pending saves that share its first chunk, so a prompt sent right after another still
finds what that one stored. A model with several KV cache groups (`grouped_engine.GroupedEngine`) loads and
saves whole steps only (no layerwise copies), and when vLLM frees blocks of running requests (sliding
window, states) the saves handed out in a step end before the next step writes any block. `pause` /
`resume` (vLLM 0.33's unregister / restore of the KV cache) stop every copy while vLLM has released the
cache. With the management API on, each rank answers its calls on a control socket (`control.py`). Every
failure is logged and turned into a miss; none propagates into vLLM's step.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.cpu_affinity import background_cpus
from lmcache_vllm.integration.vllm.control import ControlServer, control_address
from lmcache_vllm.integration.vllm.load_pipeline import FailureAgreement, LoadPipeline
from lmcache_vllm.integration.vllm.load_thread import overlap_wanted
from lmcache_vllm.integration.vllm.loads import IDLE_STEP_WAIT_S
from lmcache_vllm.integration.vllm.lookup import LookupAnswer, LookupQuery, LookupServer
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata
from lmcache_vllm.integration.vllm.request_hints import WorkerPins
from lmcache_vllm.integration.vllm.save_pipeline import SavePipeline
from lmcache_vllm.storage.pins import PinLedger

if TYPE_CHECKING:  # the engine is built in the worker only, after vLLM's API server imported us
    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.engine.grouped import GroupedEngine
    from lmcache_vllm.integration.vllm.events import HoldReport
    from lmcache_vllm.integration.vllm.pd.worker import PeerTransfer
    from lmcache_vllm.storage.base import InstanceIdentity

logger = logging.getLogger(__name__)


class WorkerHalf:
    """Implements the worker-side methods of `KVConnectorBase_V1` for `LMCacheConnector`.

    `config` gives the load/save settings (`use_layerwise`, `extra_config.async_save`,
    `blocking_timeout_secs`); `engine_factory(kv_caches: dict[layer name, Tensor])` builds the engine once
    the KV cache tensors exist; `lookup_address` is where this rank serves lookups (None: no server);
    `failure_agreement(failed per load) -> failed on any rank per load` (identity without TP);
    `durable_saves`: a PD producer's saves wait until they are in every lower tier;
    `peer_factory(engine)`: this rank's disaggregated-prefill part (None: kv_transfer_params are ignored);
    `identity`: this instance and rank, named to the storage once the engine exists (P2P serves and lists its L1
    under it).
    """

    def __init__(self, config: LMCacheConfig, *,
                 engine_factory: Callable[[dict[str, torch.Tensor]], CacheEngine | GroupedEngine],
                 block_size: int, lookup_address: str | None, max_lookup_tokens: int = 1 << 20,
                 failure_agreement: FailureAgreement | None = None, durable_saves: bool = False,
                 peer_factory: Callable[[CacheEngine], PeerTransfer] | None = None,
                 identity: InstanceIdentity | None = None, management: bool = False):
        self.config = config
        self.identity = identity
        self._engine_factory = engine_factory
        self.block_size = block_size
        self.lookup_address = lookup_address
        self.max_lookup_tokens = max_lookup_tokens
        self._failure_agreement = failure_agreement
        self.durable_saves = durable_saves
        self._peer_factory = peer_factory
        self.pd: PeerTransfer | None = None
        self.pins: WorkerPins | None = None  # prefixes requests asked to keep in L1 (request_hints.py)
        self.pin_ledger: PinLedger | None = None  # every pin of this rank: hints' and the management API's
        self.engine: CacheEngine | GroupedEngine | None = None
        self.load: LoadPipeline | None = None
        self.save: SavePipeline | None = None
        self.lookup_server: LookupServer | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self._paused = False
        self._drain_every_step = False  # vLLM frees blocks of running requests (see the module docstring)
        self.management = management  # serve the management API's calls (integration/vllm/control.py)
        self.control: ControlServer | None = None

    # ------------------------------------------------------------------ setup / teardown
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # vLLM inserts layers in forward order; that order is the stored chunk's layer order.
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.kv_caches = list(kv_caches.values())
        from lmcache_vllm.engine.grouped import GroupedEngine  # noqa: F811 (the runtime import of the type)
        from lmcache_vllm.layouts.streams import SideStream  # not at import: vLLM's API server imports us

        engine = self.engine = self._engine_factory(kv_caches)
        if self.identity is not None:
            engine.storage.attach_instance(self.identity)
        config = self.config
        layerwise = config.use_layerwise
        if isinstance(engine, GroupedEngine):
            self._drain_every_step = engine.frees_blocks_while_running
            if layerwise:
                logger.warning("use_layerwise is ignored for a model with several KV cache groups (%s): its "
                               "loads and saves copy whole steps", engine)
                layerwise = False
            if self._peer_factory is not None:
                logger.warning("disaggregated prefill (kv_transfer_params) is not served for a model with several "
                               "KV cache groups (%s): such requests are computed by the decode instance", engine)
        else:
            self.pd = self._peer_factory(engine) if self._peer_factory is not None else None
            self.pin_ledger = PinLedger.from_config(config)
            self.pins = WorkerPins(engine, self.pin_ledger) if self.pin_ledger.enabled else None
        self.load = LoadPipeline(engine, self.kv_caches, self.layer_index, block_size=self.block_size,
                                 use_layerwise=layerwise, timeout_s=config.blocking_timeout_secs,
                                 failure_agreement=self._failure_agreement,
                                 open_peer=self.pd.open_peer if self.pd is not None else None,
                                 read_wait_s=config.extra_config.lookup_read_wait_ms / 1000,
                                 # vLLM registers the caches from the thread that runs its steps
                                 overlap=not layerwise and overlap_wanted(config.extra_config.overlap_loads,
                                                                          self.kv_caches[0].device.type))
        self.save = SavePipeline(engine, self.kv_caches, SideStream(self.kv_caches[0].device),
                                 block_size=self.block_size, use_layerwise=layerwise,
                                 async_save=config.extra_config.async_save, durable=self.durable_saves,
                                 timeout_s=config.blocking_timeout_secs)
        if self.lookup_address is not None:
            self.lookup_server = LookupServer(self.lookup_address, self._lookup,
                                              max_tokens=self.max_lookup_tokens, commands={
                "reset_l1": lambda: self._reset(lower_tiers=False),
                "reset_all": lambda: self._reset(lower_tiers=True),
                "pd_port": lambda: self.pd.port if self.pd is not None else -1})
        if self.management and self.lookup_address is not None and not isinstance(engine, GroupedEngine):
            from lmcache_vllm.management.ops import RankOps

            ops = RankOps(engine, self.pin_ledger, drain=self.drain_saves)
            self.control = ControlServer(control_address(self.lookup_address), ops.handle)
        logger.debug("LMCache worker ready: %d layers, layout %s, lookups on %s", len(self.kv_caches),
                     engine.layout, self.lookup_address)
        if self.load.overlapped:
            logger.info("loads from L1 copy layer by layer beside the forward, on the load thread (CPUs %s)",
                        sorted(background_cpus() or ()))

    def _lookup(self, query: LookupQuery) -> LookupAnswer:
        if self.engine is None or self.load is None or self.save is None:
            return LookupAnswer(0)
        if self.save.queue.shares_prefix(query.token_ids, self.engine.keys.chunk_size):
            self.drain_saves()  # chunks a just-finished request is still storing count as present
        return self.load.lookup(query)

    def _reset(self, lower_tiers: bool) -> int:
        """vLLM's reset of the prefix cache (sent by the scheduler): saves handed out so far land first,
        then L1 (and with `lower_tiers` L2/L3) is emptied. 1 when done."""
        self.drain_saves()
        if self.pin_ledger is not None:
            self.pin_ledger.clear()  # a reset empties L1: pinned prefixes too
        if self.engine is None:
            return 1
        ok = self.engine.clear(lower_tiers=lower_tiers)
        logger.info("LMCache cache reset (%s): %s", "every tier" if lower_tiers else "L1",
                    "done" if ok else "lower tiers did not finish")
        return int(ok)

    def drain_saves(self, req_ids: list[str] | None = None) -> None:
        """Waits until the background saves handed out so far (of `req_ids` only, when given) finished."""
        if self.save is not None:
            self.save.drain(req_ids)

    def pause(self) -> None:
        """vLLM is about to release the KV cache: finish the copies in flight and start no new one."""
        if self.save is not None and self.load is not None:
            self.save.pause()
            self.load.begin_step()
        self._paused = True

    def resume(self) -> None:
        """The KV cache views are valid again."""
        self._paused = False

    def shutdown(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.save is not None:
            self.save.close()
        if self.load is not None:
            self.load.close()
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        if self.pd is not None:
            self.pd.close()
            self.pd = None
        self.pins = None
        if self.pin_ledger is not None:
            self.pin_ledger.close()
            self.pin_ledger = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        if self.load is not None:
            self.load.begin_step()

    def handle_preemptions(self, meta: LMCacheConnectorMetadata) -> None:
        """vLLM frees a preempted request's blocks at once and may write them this step: its saves still
        copying from them finish first. (Other requests' blocks are never rewritten under a save.)"""
        if self._drain_every_step:
            self.drain_saves()  # a sliding or state block a save still reads may be handed elsewhere now
        elif meta.preempted_req_ids:
            self.drain_saves(meta.preempted_req_ids)

    def start_load_kv(self, meta: LMCacheConnectorMetadata) -> None:
        if self.load is not None:
            self.load.start(meta, self._paused)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.load is not None:
            self.load.wait_for_layer(layer_name)

    def save_kv_layer(self, meta: LMCacheConnectorMetadata, layer_name: str) -> None:
        if self.save is None or not self.save.use_layerwise or self.load is None or self._paused:
            return
        layer = self.layer_index.get(layer_name)
        if layer is not None:
            self.save.save_layer(meta, layer, self.load.failed)

    def hold_report(self) -> HoldReport | None:
        """This rank's holds for decode instances, for the scheduler half (None: nothing new)."""
        return self.pd.report() if self.pd is not None else None

    def wait_for_save(self, meta: LMCacheConnectorMetadata) -> None:
        if self.pd is not None:
            self.pd.unhold(meta.peer_unholds)
            self.pd.release(meta.peer_releases)
        if self.save is None or self.load is None or self._paused:
            return
        self.load.finish_layers()
        self.load.agree(meta)
        self.save.wait_for_save(meta, self.load.failed)
        if self.pd is not None and meta.peer_holds:
            self.pd.hold(meta.peer_holds, self.save.queue, self.load.failed)
        if self.pins is not None and meta.pins:
            self.pins.pin(meta.pins, self.save.queue, self.load.failed)
        if self.pin_ledger is not None and self.pin_ledger.due():
            self.pin_ledger.expire()

    def get_finished(self, meta: LMCacheConnectorMetadata | None,
                     finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are over: vLLM may free their blocks, requests whose asynchronous load
        is over: copied in, failed or aborted)."""
        if self.load is None or self.save is None:
            return None, None
        queue = self.save.queue
        if meta is not None and meta.delayed_free_req_ids:
            queue.finished(meta.delayed_free_req_ids)

        def idle_wait() -> None:
            if queue.has_delayed():
                queue.wait_any(IDLE_STEP_WAIT_S)

        done = self.load.finished(meta, finished_req_ids, self._paused, idle_wait)
        return (queue.newly_done() or None), (done or None)

    def take_load_errors(self) -> set[int]:
        return self.load.take_load_errors() if self.load is not None else set()

    def take_failed_recving(self) -> set[str]:
        """Asynchronous loads of a multi-group model that failed (reported finished too): vLLM recomputes them."""
        return self.load.take_failed_recving() if self.load is not None else set()
