"""The worker half of `LMCacheConnector`: moves KV between vLLM's paged cache and the `CacheEngine`.

It runs in each vLLM worker (one per tensor-parallel rank), next to the KV cache tensors:
- `register_kv_caches` detects the paged layout, builds the `CacheEngine` and starts this rank's
  `LookupServer`;
- lookups hold a request's chunks until its load takes them (`loads.RequestLoads`); `start_load_kv`
  copies a synchronous `LoadSpec` in before the forward (all layers, or layer by layer driven by
  `wait_for_layer_load`), only the chunks vLLM lacks, from memory only; an asynchronous one waits for
  its reads while vLLM runs other requests, and `get_finished` copies it in and reports it finished
  receiving (an aborted one too, its reads stopped);
- `save_kv_layer` / `wait_for_save` store each `SaveSpec`; whole-step saves run on a background thread
  that no step waits for (`saves.SaveQueue`: finished requests keep their blocks until reported in
  finished_sending; preempted ones' saves end in `handle_preemptions`; a producer's prompt is durable
  in every lower tier before the step returns). A lookup waits for pending saves that share its first
  chunk, so a prompt sent right after another still finds what that one stored;
- tokens that could not be loaded are reported by block id through `get_block_ids_with_load_errors`,
  and vLLM recomputes them (vLLM unites the block ids of all ranks). A request whose load failed in a
  step saves nothing in that step, so KV computed on top of a hole is never stored; with tensor
  parallelism the ranks first agree (`failure_agreement`, see `parallelism.TPFailureAgreement`), since a
  hole on one rank corrupts the all-reduced activations, and so the KV, of every rank. A layerwise load
  that fails at a later layer counts as a failure of its whole range.
On a GPU (`layouts.streams`): loads are enqueued on vLLM's current stream, so they run before the
attention that reads them; saves copy on a side stream that first waits for an event recorded on vLLM's
stream in `wait_for_save` (layerwise: in `save_kv_layer`), so they read the KV the forward wrote; a step
waits for the device only to commit a layerwise save or a synchronous one (`async_save` off). `pause` / `resume` (vLLM 0.33's
unregister / restore of the KV cache) stop every copy while vLLM has released the cache.
Every failure here is logged and turned into a miss; none propagates into vLLM's step.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.integration.vllm.loads import IDLE_STEP_WAIT_S, RequestLoads
from lmcache_vllm.integration.vllm.lookup import LookupAnswer, LookupQuery, LookupServer
from lmcache_vllm.integration.vllm.metadata import (
    LMCacheConnectorMetadata,
    LoadSpec,
    SaveSpec,
    slot_mapping_for,
)
from lmcache_vllm.integration.vllm.saves import SaveQueue
from lmcache_vllm.integration.vllm.threads import single_threaded_torch

logger = logging.getLogger(__name__)


@dataclass
class _StepState:
    """Per-step layerwise generators (with their request) and the requests whose load failed."""

    retrievers: list[tuple[LoadSpec, torch.Tensor, Generator]] = field(default_factory=list)
    storers: list[tuple[str, Generator]] = field(default_factory=list)
    failed_loads: set[str] = field(default_factory=set)
    agreed: bool = False  # failed_loads holds every rank's failures
    next_layer_to_load: int = 0


class WorkerHalf:
    """Implements the worker-side methods of `KVConnectorBase_V1` for `LMCacheConnector`.

    `engine_factory(kv_caches: dict[layer name, Tensor]) -> CacheEngine` builds the engine once the KV cache
    tensors exist; `lookup_address` is where this rank serves lookups (None: no server);
    `failure_agreement(failed per load) -> failed on any rank per load` (identity without TP).
    """

    def __init__(self, *, engine_factory: Callable, block_size: int, use_layerwise: bool,
                 lookup_address: str | None, async_save: bool = True, max_lookup_tokens: int = 1 << 20,
                 failure_agreement: Callable[[list[bool]], list[bool]] | None = None,
                 load_timeout_s: float = 10.0, durable_saves: bool = False):
        self._engine_factory = engine_factory
        self.block_size = block_size
        self.use_layerwise = use_layerwise
        self.lookup_address = lookup_address
        self.max_lookup_tokens = max_lookup_tokens
        self._agree = failure_agreement or list
        self.engine = None
        self.loads: RequestLoads | None = None
        self._unloaded: set[str] = set()  # asynchronous loads refused while paused, to report done
        self.load_timeout_s = load_timeout_s
        self.lookup_server: LookupServer | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._step = _StepState()
        self.async_save = async_save and not use_layerwise
        self.durable_saves = durable_saves
        self.saves = SaveQueue(None)
        self._side = None  # layouts.streams.SideStream, made with the caches
        self._paused = False

    # ------------------------------------------------------------------ setup / teardown
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # vLLM inserts layers in forward order; that order is the stored chunk's layer order.
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.kv_caches = list(kv_caches.values())
        from lmcache_vllm.layouts.streams import SideStream  # not at import: vLLM's API server imports us
        self._side = SideStream(self.kv_caches[0].device)
        self.engine = self._engine_factory(kv_caches)
        self.loads = RequestLoads(self.engine, timeout_s=self.load_timeout_s,
                                  hold_s=self.engine.storage.prefetch_hold_secs)
        saver = None
        if self.async_save:
            # The save thread's copies run on it alone: a second OpenMP team in the process would
            # slow every parallel region of vLLM's model thread from then on (see threads.py).
            saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-save",
                                       initializer=single_threaded_torch)
        self.saves = SaveQueue(saver, durable=self.durable_saves, durable_timeout_s=self.load_timeout_s)
        if self.lookup_address is not None:
            self.lookup_server = LookupServer(self.lookup_address, self._lookup,
                                              max_tokens=self.max_lookup_tokens, commands={
                "reset_l1": lambda: self._reset(lower_tiers=False),
                "reset_all": lambda: self._reset(lower_tiers=True)})
        logger.debug("LMCache worker ready: %d layers, layout %s, lookups on %s", len(self.kv_caches),
                    getattr(self.engine, "layout", None), self.lookup_address)

    def _lookup(self, query: LookupQuery) -> LookupAnswer:
        if self.engine is not None and self.saves.shares_prefix(query.token_ids, self.engine.keys.chunk_size):
            self.drain_saves()  # chunks a just-finished request is still storing count as present
        if self.loads is None:
            return LookupAnswer(0)
        return self.loads.lookup(query)

    def _reset(self, lower_tiers: bool) -> int:
        """vLLM's reset of the prefix cache (sent by the scheduler): saves handed out so far land first,
        then L1 (and with `lower_tiers` L2/L3) is emptied. 1 when done."""
        self.drain_saves()
        engine = self.engine
        if engine is None:
            return 1
        ok = engine.clear(lower_tiers=lower_tiers)
        logger.info("LMCache cache reset (%s): %s", "every tier" if lower_tiers else "L1",
                    "done" if ok else "lower tiers did not finish")
        return int(ok)

    def drain_saves(self, req_ids=None) -> None:
        """Waits until the background saves handed out so far (of `req_ids` only, when given) finished."""
        self.saves.drain(req_ids)

    def pause(self) -> None:
        """vLLM is about to release the KV cache: finish the copies in flight and start no new one."""
        self.drain_saves()
        for _, storer in self._step.storers:
            storer.close()  # an unfinished layerwise save is dropped, its chunks released
        self._step = _StepState()
        self._paused = True

    def resume(self) -> None:
        """The KV cache views are valid again."""
        self._paused = False

    def shutdown(self) -> None:
        self.saves.close()
        if self.loads is not None:
            self.loads.close()
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        self._step = _StepState()

    def handle_preemptions(self, meta: LMCacheConnectorMetadata) -> None:
        """vLLM frees a preempted request's blocks at once and may write them this step: its saves still
        copying from them finish first. (Other requests' blocks are never rewritten under a save.)"""
        if meta.preempted_req_ids:
            self.drain_saves(meta.preempted_req_ids)

    def start_load_kv(self, meta: LMCacheConnectorMetadata) -> None:
        if self.engine is None:
            return
        if meta.release_req_ids:
            self.loads.release(meta.release_req_ids)
        if self._paused:  # vLLM does not schedule while its cache is released; recompute if it ever did
            for spec in meta.loads:
                self._load_errors.update(spec.block_ids)
                if spec.is_async:
                    self._unloaded.add(spec.req_id)  # reported done (failed), never left waiting
            return
        for spec in meta.loads:
            if spec.is_async:
                self.loads.begin_async(spec)
                continue
            held = self.loads.take(spec.req_id)
            if held is not None and not held.ready():
                # Async loading is off and the hit needs a slower tier: wait (bounded) for its reads.
                held.handle.wait(self.load_timeout_s)
            with metrics.timed("load_seconds"):
                self._start_load(spec, held)

    def get_finished(self, meta: LMCacheConnectorMetadata | None,
                     finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load is done: copied in from L1 (what is missing is reported as
        load errors in this same step), or aborted while waiting (reads stopped, nothing copied)."""
        if self.loads is None:
            return None, None
        if meta is not None and meta.delayed_free_req_ids:
            self.saves.finished(meta.delayed_free_req_ids)
        done = self.loads.abort(finished_req_ids) | self._unloaded
        self._unloaded = set()
        if meta is not None and meta.idle and not done:
            if self.loads.pending_async():
                self.loads.wait_for_progress(IDLE_STEP_WAIT_S)
            elif self.saves.has_delayed():
                self.saves.wait_any(IDLE_STEP_WAIT_S)
        for job in self.loads.ready_loads():
            if self._paused:  # the KV cache views are not valid: nothing may be copied in
                self._load_errors.update(job.spec.block_ids)
                if job.held is not None:
                    job.held.release()
            else:
                with metrics.timed("load_seconds"):
                    self._start_load(job.spec, job.held, layerwise=False)
            done.add(job.spec.req_id)
        return (self.saves.newly_done() or None), (done or None)

    def _start_load(self, spec: LoadSpec, held=None, layerwise: bool | None = None) -> None:
        layerwise = self.use_layerwise if layerwise is None else layerwise
        num = len(spec.token_ids)
        wanted = torch.zeros(num, dtype=torch.bool)
        wanted[spec.skip_leading:spec.load_end] = True
        tokens = torch.as_tensor(spec.token_ids, dtype=torch.long)
        owner = held.owner if held is not None else None
        try:
            slots = slot_mapping_for(spec.block_ids, self.block_size, num)
            if layerwise:
                retriever = self.engine.retrieve_layer(tokens, self.kv_caches, slots, wanted, extra=spec.extra,
                                                       owner=owner, lower_tiers=False)
                loaded = next(retriever)
                self._step.retrievers.append((spec, torch.as_tensor(loaded, dtype=torch.bool), retriever))
            else:
                # Memory only: the lookup's prefetch did the tier reads; none happens in the step.
                loaded = self.engine.retrieve(tokens, self.kv_caches, slots, wanted, extra=spec.extra,
                                              owner=owner, lower_tiers=False)
        except Exception:
            logs.warn(logger, "load_failed", "request %s: load failed; vLLM will recompute", spec.req_id,
                      exc_info=True)
            loaded = torch.zeros(num, dtype=torch.bool)
        finally:
            if held is not None:
                held.release()  # what the load did not take (chunks past load_end)
        missing = wanted & ~torch.as_tensor(loaded, dtype=torch.bool)
        self._fail_load(spec, missing, int(wanted.sum()))

    def _fail_load(self, spec: LoadSpec, missing: torch.Tensor, wanted: int) -> None:
        """Reports the blocks of `missing` tokens to vLLM (recompute) and stops the request's saves."""
        num_missing = int(missing.sum())
        if not num_missing:
            return
        positions = torch.nonzero(missing).flatten().tolist()
        bad_blocks = {spec.block_ids[p // self.block_size] for p in positions}
        self._load_errors.update(bad_blocks)
        self._step.failed_loads.add(spec.req_id)
        metrics.inc("failed_load_tokens", num_missing)
        logs.warn(logger, "load_incomplete", "request %s: %d of %d tokens could not be loaded; %d blocks "
                  "reported for recompute", spec.req_id, num_missing, wanted, len(bad_blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._step.retrievers:
            return
        target = self.layer_index.get(layer_name)
        if target is None:
            return
        # Layers are visited in order; advance every retriever up to and including `target`.
        while self._step.next_layer_to_load <= target:
            for entry in list(self._step.retrievers):
                spec, loaded, retriever = entry
                try:
                    next(retriever)
                except StopIteration:
                    self._step.retrievers.remove(entry)
                except Exception:
                    # Earlier layers got their KV, this and later ones did not: the whole range is a hole.
                    logs.warn(logger, "load_failed", "request %s: layerwise load failed at layer %d", spec.req_id,
                              self._step.next_layer_to_load, exc_info=True)
                    self._step.retrievers.remove(entry)
                    self._fail_load(spec, loaded, int(loaded.sum()))
            self._step.next_layer_to_load += 1

    def save_kv_layer(self, meta: LMCacheConnectorMetadata, layer_name: str) -> None:
        if not self.use_layerwise or self.engine is None or self._paused:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        if layer == 0:
            started = [(spec.req_id, self._start_layerwise_store(spec)) for spec in self._saves(meta)]
            self._step.storers = [(req_id, s) for req_id, s in started if s is not None]
        # This layer's KV was written by work vLLM enqueued so far: copy it out after that, on the side stream.
        mark = self._side.mark() if self._step.storers else None
        for entry in list(self._step.storers):
            try:
                with self._side.after(mark):
                    next(entry[1])
            except StopIteration:
                self._step.storers.remove(entry)
            except Exception:
                logs.warn(logger, "store_failed", "layerwise store failed at layer %d", layer, exc_info=True)
                metrics.inc("failed_stores")
                self._step.storers.remove(entry)

    def _start_layerwise_store(self, spec: SaveSpec):
        try:
            tokens, slots, mask = self._save_args(spec)
            return self.engine.store_layer(tokens, self.kv_caches, slots, mask, extra=spec.extra)
        except Exception:
            logs.warn(logger, "store_failed", "request %s: store failed", spec.req_id, exc_info=True)
            metrics.inc("failed_stores")
            return None

    def wait_for_save(self, meta: LMCacheConnectorMetadata) -> None:
        if self.engine is None or self._paused:
            return
        if self._step.retrievers:
            # Layers the forward never announced still get their KV before the step ends.
            self.wait_for_layer_load(next(reversed(self.layer_index)))
        self._agree_on_failed_loads(meta)
        if self.use_layerwise:
            with self._side.after(None):  # the commit waits for this step's layer copies on the side stream
                for req_id, storer in self._step.storers:
                    if req_id in self._step.failed_loads:  # failed on another rank: never committed
                        storer.close()
                        metrics.inc("stores_skipped_after_failed_load")
                        continue
                    self._finish_store(storer)
            self._step.storers = []
            self._wait_durable(meta.saves)
            return
        saves = self._saves(meta)
        if not saves:
            return
        mark = self._side.mark()  # the forward that wrote this step's KV was enqueued before this point
        future = self.saves.submit(lambda specs: self._store_all(specs, mark), saves)
        if self.durable_saves and any(spec.is_last for spec in saves):
            # A producer's answer must not leave before a consumer can find the prompt's chunks.
            self.saves.wait([future], self.load_timeout_s)
            self._wait_durable(saves)

    def _wait_durable(self, saves: list[SaveSpec]) -> None:
        """A producer: the chunks of every prompt completed this step are in every lower tier (bounded)."""
        for spec in saves if self.durable_saves else ():
            if spec.is_last and not self.engine.wait_written(spec.token_ids, self.load_timeout_s, spec.extra):
                metrics.inc("durable_save_timeouts")

    def _store_all(self, saves: list[SaveSpec], mark=None) -> None:
        for spec in saves:
            try:
                with metrics.timed("store_seconds"):
                    tokens, slots, mask = self._save_args(spec)
                    with self._side.after(mark):  # after the forward that wrote the KV (on a GPU)
                        self.engine.store(tokens, self.kv_caches, slots, mask, extra=spec.extra)
            except Exception:
                logs.warn(logger, "store_failed", "request %s: store failed; the chunks stay uncached",
                          spec.req_id, exc_info=True)
                metrics.inc("failed_stores")

    def _finish_store(self, storer: Generator) -> None:
        try:
            while True:
                next(storer)
        except StopIteration:
            pass
        except Exception:
            logs.warn(logger, "store_failed", "layerwise store failed while committing", exc_info=True)
            metrics.inc("failed_stores")

    def _agree_on_failed_loads(self, meta: LMCacheConnectorMetadata) -> None:
        """Once per step with loads and saves (the same steps on every rank: the metadata is identical),
        learns which loads failed on any tensor-parallel rank."""
        if self._step.agreed or not (meta.loads and meta.saves):
            return
        self._step.agreed = True
        mine = [spec.req_id in self._step.failed_loads for spec in meta.loads]
        try:
            anywhere = self._agree(mine)
        except Exception:
            logs.warn(logger, "tp_agreement_failed", "TP ranks could not agree on failed loads; this step's "
                      "loaded requests save nothing", exc_info=True)
            anywhere = [True] * len(mine)
        for spec, here, there in zip(meta.loads, mine, anywhere):
            if there and not here:
                self._step.failed_loads.add(spec.req_id)
                metrics.inc("loads_failed_on_other_rank")
                logs.warn(logger, "load_failed_on_other_rank", "request %s: its load failed on another "
                          "tensor-parallel rank; it saves nothing this step", spec.req_id)

    def _saves(self, meta: LMCacheConnectorMetadata) -> list[SaveSpec]:
        saves = []
        for spec in meta.saves:
            if spec.req_id in self._step.failed_loads:
                # Its KV past the hole was computed against missing context: not worth keeping.
                metrics.inc("stores_skipped_after_failed_load")
                continue
            saves.append(spec)
        return saves

    def _save_args(self, spec: SaveSpec):
        num = len(spec.token_ids)
        tokens = torch.as_tensor(spec.token_ids, dtype=torch.long)
        slots = slot_mapping_for(spec.block_ids, self.block_size, num)
        mask = torch.zeros(num, dtype=torch.bool)
        mask[spec.skip_leading:] = True
        return tokens, slots, mask

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
