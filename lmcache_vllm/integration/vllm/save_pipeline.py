"""The worker's save pipeline: freshly computed KV out of vLLM's paged KV cache into the engine.

- Whole-step saves (`wait_for_save`, after the forward) run on the background save thread of
  `saves.SaveQueue`, which no step waits for (finished requests keep their blocks until reported in
  finished_sending; preempted ones' saves end in `drain(preempted)` before vLLM rewrites their blocks);
  without `async_save` they run inside the step.
- Layerwise saves (`use_layerwise`) copy each layer as `save_layer` sees it and commit in `wait_for_save`.
- A request whose load failed in this step (on any rank) saves nothing: its KV past the hole was computed
  against missing context.
- A PD producer (`durable`): the step that completes a prompt returns only once its chunks are in every
  lower tier, so vLLM answers only when a consumer can find them; not for a prompt held for a decode
  instance (`SaveSpec.for_peer`, docs/DISAGGREGATED.md), which is pulled from L1.
On a GPU the copies run on a side stream after an event recorded on vLLM's stream (`layouts.streams`), so
they read the KV the forward wrote; a step waits for the device only to commit a layerwise save or a
synchronous one. A model with several KV cache groups saves every group's part (`groups.save_parts`).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

import torch

from lmcache_vllm.cpu_affinity import enter_background_cpus, single_threaded_torch
from lmcache_vllm.integration.vllm.groups import save_parts
from lmcache_vllm.integration.vllm.layerwise import LayerSteps, run_to_end
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, SaveSpec, slot_mapping_for
from lmcache_vllm.integration.vllm.saves import SaveQueue
from lmcache_vllm.observability import logs, metrics

if TYPE_CHECKING:  # built in the worker only, after vLLM's API server imported us
    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.engine.grouped import GroupedEngine
    from lmcache_vllm.layouts.streams import SideStream

logger = logging.getLogger(__name__)


def _save_thread_init() -> None:
    """The save thread runs on the background CPUs, its parallel torch ops on it alone (threads.py)."""
    enter_background_cpus()
    single_threaded_torch()


def _store_failed(what: str, *args: object) -> None:
    logs.warn(logger, "store_failed", what, *args, exc_info=True)
    metrics.inc("failed_stores")


class SavePipeline:
    """See the module docstring. One per worker rank, built once the KV cache exists."""

    def __init__(self, engine: CacheEngine | GroupedEngine, kv_caches: list[torch.Tensor], side: SideStream, *,
                 block_size: int, use_layerwise: bool, async_save: bool, durable: bool, timeout_s: float):
        from lmcache_vllm.engine.grouped import GroupedEngine

        self.engine = engine
        self.grouped = engine if isinstance(engine, GroupedEngine) else None
        self.kv_caches = kv_caches
        self.side = side
        self.block_size = block_size
        self.use_layerwise = use_layerwise
        self.durable = durable
        self.timeout_s = timeout_s
        saver = None
        if async_save and not use_layerwise:
            # The save thread's copies run on it alone: a second OpenMP team in the process would
            # slow every parallel region of vLLM's model thread from then on (see threads.py).
            saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-save",
                                       initializer=_save_thread_init)
        self.queue = SaveQueue(saver, durable=durable, durable_timeout_s=timeout_s)
        self._storers: LayerSteps[str] = LayerSteps()

    def save_layer(self, meta: LMCacheConnectorMetadata, layer: int, failed: set[str]) -> None:
        """Layerwise: copies out layer `layer` of this step's saves (started at layer 0)."""
        if layer == 0:
            for spec in self._saves(meta, failed):
                self._start_layerwise(spec)
        if not self._storers:
            return
        # This layer's KV was written by work vLLM enqueued so far: copy it out after that, on the side stream.
        with self.side.after(self.side.mark()):
            self._storers.step(lambda req_id, exc: _store_failed("layerwise store failed at layer %d", layer))

    def _start_layerwise(self, spec: SaveSpec) -> None:
        try:
            tokens, slots, mask = self._save_args(spec)
            engine = cast("CacheEngine", self.engine)
            self._storers.add(spec.req_id, engine.store_layer(tokens, self.kv_caches, slots, mask,
                                                              extra=spec.extra,
                                                              include_partial=spec.for_peer or None))
        except Exception:
            _store_failed("request %s: store failed", spec.req_id)

    def wait_for_save(self, meta: LMCacheConnectorMetadata, failed: set[str]) -> None:
        if self.use_layerwise:
            with self.side.after(None):  # the commit waits for this step's layer copies on the side stream
                for req_id, storer in self._storers.take():
                    if req_id in failed:  # failed on another rank: never committed
                        storer.close()
                        metrics.inc("stores_skipped_after_failed_load")
                    else:
                        run_to_end(storer, lambda exc: _store_failed("layerwise store failed while committing"))
            self._wait_durable(meta.saves)
            return
        saves = self._saves(meta, failed)
        if not saves:
            return
        mark = self.side.mark()  # the forward that wrote this step's KV was enqueued before this point
        future = self.queue.submit(lambda specs: self._store_all(specs, mark), saves)
        if self.durable and any(spec.is_last and not spec.for_peer for spec in saves):
            # A producer's answer must not leave before a consumer can find the prompt's chunks.
            self.queue.wait([future], self.timeout_s)
            self._wait_durable(saves)

    def _wait_durable(self, saves: list[SaveSpec]) -> None:
        """A producer: the chunks of every prompt completed this step are in every lower tier (bounded)."""
        for spec in saves if self.durable else ():
            # A save held for a decode instance (disaggregated prefill) is pulled from L1: no Redis wait.
            if spec.is_last and not spec.for_peer and not self.engine.wait_written(spec.token_ids, self.timeout_s,
                                                                                   spec.extra):
                metrics.inc("durable_save_timeouts")

    def _store_all(self, saves: list[SaveSpec], mark: torch.cuda.Event | None = None) -> None:
        for spec in saves:
            try:
                with metrics.timed("store_seconds"):
                    if self.grouped is not None:
                        with self.side.after(mark):
                            self.grouped.store(spec.token_ids, save_parts(self.grouped.groups, spec), extra=spec.extra)
                        continue
                    tokens, slots, mask = self._save_args(spec)
                    with self.side.after(mark):  # after the forward that wrote the KV (on a GPU)
                        cast("CacheEngine", self.engine).store(tokens, self.kv_caches, slots, mask, extra=spec.extra,
                                                               include_partial=spec.for_peer or None)
            except Exception:
                _store_failed("request %s: store failed; the chunks stay uncached", spec.req_id)

    def _saves(self, meta: LMCacheConnectorMetadata, failed: set[str]) -> list[SaveSpec]:
        saves = []
        for spec in meta.saves:
            if spec.req_id in failed:
                # Its KV past the hole was computed against missing context: not worth keeping.
                metrics.inc("stores_skipped_after_failed_load")
                continue
            saves.append(spec)
        return saves

    def _save_args(self, spec: SaveSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num = len(spec.token_ids)
        tokens = torch.as_tensor(spec.token_ids, dtype=torch.long)
        slots = slot_mapping_for(spec.block_ids, self.block_size, num)
        mask = torch.zeros(num, dtype=torch.bool)
        mask[spec.skip_leading:] = True
        return tokens, slots, mask

    def drain(self, req_ids: list[str] | None = None) -> None:
        """Waits until the background saves handed out so far (of `req_ids` only, when given) finished."""
        self.queue.drain(req_ids)

    def pause(self) -> None:
        """vLLM is about to release the KV cache: the copies in flight finish, an unfinished layerwise
        save is dropped (its chunks released)."""
        self.drain()
        self._storers.close()

    def close(self) -> None:
        self._storers.close()
        self.queue.close()
