"""The worker's load pipeline: cached chunks into vLLM's paged KV cache, and what could not be loaded.

- `start(meta)` (vLLM's `start_load_kv`, before the forward): a synchronous `LoadSpec` takes the chunks
  its lookup held (`loads.RequestLoads`) and copies them in, from memory only (the lookup's prefetch did
  every tier read): all layers at once, layer by layer as vLLM announces them (`wait_for_layer`), or layer
  by layer on the load thread while the forward runs (`load_thread.LoadThread`, `overlap`); an
  asynchronous one starts waiting for its reads while vLLM runs other requests.
- `finished(meta, finished_req_ids)` (vLLM's `get_finished`): copies in the asynchronous loads whose
  reads are over and reports them, and those aborted while waiting, as finished receiving.
- Tokens that could not be loaded are reported by block id (`take_load_errors`, vLLM recomputes them)
  and their request is in `failed` for this step: it saves nothing, since KV computed on top of a hole
  must never be stored. With tensor parallelism `agree` first learns the loads that failed on any rank
  (a hole on one rank corrupts every rank's KV through the all-reduce). A layerwise load that fails at a
  later layer counts as a failure of its whole range.
While paused (vLLM released the KV cache) nothing is copied: loads are reported failed (recompute).
A model with several KV cache groups (`grouped_engine.GroupedEngine`) loads asynchronously only, every group
at once (`groups.load_parts`); a load that could not fill every group is reported as a failed receive
(`take_failed_recving`): vLLM 0.32 cannot map block errors of such a model, and recomputes the request.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, cast

import torch

from lmcache_vllm.integration.vllm.groups import load_parts
from lmcache_vllm.integration.vllm.layerwise import LayerSteps
from lmcache_vllm.integration.vllm.load_thread import LoadThread
from lmcache_vllm.integration.vllm.loads import IDLE_STEP_WAIT_S, OpenPeer, RequestLoads
from lmcache_vllm.integration.vllm.lookup import LookupAnswer, LookupQuery
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, slot_mapping_for
from lmcache_vllm.observability import logs, metrics

if TYPE_CHECKING:  # the engine is built in the worker only, after vLLM's API server imported us
    from lmcache_vllm.engine import CacheEngine, HeldPrefix
    from lmcache_vllm.engine.grouped import GroupedEngine, GroupedHold

logger = logging.getLogger(__name__)

# failed per load of this rank -> failed on any rank, per load (identity without tensor parallelism)
FailureAgreement = Callable[[list[bool]], list[bool]]


class LoadPipeline:
    """See the module docstring. One per worker rank, built once the KV cache exists."""

    def __init__(self, engine: CacheEngine | GroupedEngine, kv_caches: list[torch.Tensor],
                 layer_index: dict[str, int], *, block_size: int, use_layerwise: bool, timeout_s: float,
                 failure_agreement: FailureAgreement | None = None, open_peer: OpenPeer | None = None,
                 overlap: bool = False, read_wait_s: float = 0.0):
        """`overlap`: synchronous loads copy on the load thread beside the forward (not for several KV cache
        groups, whose loads are asynchronous); `read_wait_s`: how long a lookup may wait for its reads
        (`loads.RequestLoads`; never for several KV cache groups, whose loads are asynchronous)."""
        from lmcache_vllm.engine.grouped import GroupedEngine

        self.engine = engine
        self.grouped = engine if isinstance(engine, GroupedEngine) else None
        self._failed_recving: set[str] = set()  # grouped: loads to report failed (vLLM recomputes them)
        self.kv_caches = kv_caches
        self.layer_index = layer_index
        self.block_size = block_size
        self.use_layerwise = use_layerwise
        self.timeout_s = timeout_s
        self.requests = RequestLoads(engine, timeout_s=timeout_s, hold_s=engine.storage.prefetch_hold_secs,
                                     open_peer=open_peer, read_wait_s=0.0 if self.grouped else read_wait_s)
        self._agree = failure_agreement or list
        self._load_errors: set[int] = set()
        self._unloaded: set[str] = set()  # asynchronous loads refused while paused, to report done
        # This step's layerwise loads, the next layer they copy, and the requests whose load failed
        # (on any rank, once `agree` ran).
        self._retrievers: LayerSteps[tuple[LoadSpec, torch.Tensor]] = LayerSteps()
        self._thread: LoadThread[tuple[LoadSpec, torch.Tensor]] | None = (
            LoadThread(len(kv_caches), timeout_s) if overlap and self.grouped is None and kv_caches else None)
        self._next_layer = 0
        # Whether this step copies anything layer by layer: most steps (every decode step) do not, and vLLM
        # asks about every layer of them twice (`wait_for_layer`), so the answer must not cost a lock then.
        self._copying = False
        self.failed: set[str] = set()
        self._agreed = False

    @property
    def overlapped(self) -> bool:
        """Whether synchronous loads copy on the load thread beside the forward."""
        return self._thread is not None

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        # Nothing is left running unless a step ended early (vLLM paused the cache): no copy may go on then.
        if self._copying:
            if self._thread is not None:
                for tag, exc, layer in self._thread.stop():
                    self._layer_failed(tag, exc, layer)
            self._retrievers.close()
            self._copying = False
        self._next_layer = 0
        self.failed = set()
        self._agreed = False

    def lookup(self, query: LookupQuery) -> LookupAnswer:
        return self.requests.lookup(query)

    def start(self, meta: LMCacheConnectorMetadata, paused: bool) -> None:
        if meta.release_req_ids:
            self.requests.release(meta.release_req_ids)
        if paused:  # vLLM does not schedule while its cache is released; recompute if it ever did
            for spec in meta.loads:
                self._not_loaded(spec)
                if spec.is_async:
                    self._unloaded.add(spec.req_id)  # reported done (failed), never left waiting
            return
        self._copying = self._copying or any(not spec.is_async for spec in meta.loads)
        for spec in meta.loads:
            if spec.is_async:
                self.requests.begin_async(spec)
                continue
            held = self.requests.take(spec.req_id)
            if held is not None and not held.ready():
                # Async loading is off and the hit needs a slower tier: wait (bounded) for its reads.
                held.wait(self.timeout_s)
            with metrics.timed("load_seconds"):
                self._load(spec, held, self.use_layerwise or self._thread is not None)
        if self._thread is not None and self._retrievers:
            self._thread.start(self._retrievers.take())

    def finished(self, meta: LMCacheConnectorMetadata | None, finished_req_ids: set[str], paused: bool,
                 idle_wait: Callable[[], None]) -> set[str]:
        """Requests whose asynchronous load is done: copied in from L1 (what is missing is reported as
        load errors in this same step), or aborted while waiting (reads stopped, nothing copied).
        `idle_wait()` is called on an idle step with no load to report (it waits a little for saves)."""
        done = self.requests.abort(finished_req_ids) | self._unloaded
        self._unloaded = set()
        idle = meta is not None and meta.idle
        self.requests.note_step(idle)
        if idle and not done:
            if self.requests.pending_async():
                self.requests.wait_for_progress(IDLE_STEP_WAIT_S)
            else:
                idle_wait()
        for job in self.requests.ready_loads():
            if paused:  # the KV cache views are not valid: nothing may be copied in
                self._not_loaded(job.spec)
                if job.held is not None:
                    job.held.release()
            else:
                with metrics.timed("load_seconds"):
                    self._load(job.spec, job.held, layerwise=False)
            done.add(job.spec.req_id)
        return done

    def _not_loaded(self, spec: LoadSpec) -> None:
        if self.grouped is not None:
            self._failed_recving.add(spec.req_id)
        else:
            self._load_errors.update(spec.block_ids)

    def _load_groups(self, spec: LoadSpec, held: GroupedHold | None) -> None:
        """Every group's part of the load; a group left incomplete fails the whole request (recompute)."""
        assert self.grouped is not None
        try:
            done = self.grouped.retrieve(spec.token_ids, load_parts(self.grouped.groups, spec), extra=spec.extra,
                                         hold=held, lower_tiers=False)
            ok = all(done.values())
        except Exception:
            logs.warn(logger, "load_failed", "request %s: load failed; vLLM will recompute", spec.req_id,
                      exc_info=True)
            done, ok = {}, False
        finally:
            if held is not None:
                held.release()
        if not ok:
            self._failed_recving.add(spec.req_id)
            self.failed.add(spec.req_id)
            metrics.inc("failed_load_tokens", spec.load_end - spec.skip_leading)
            logs.warn(logger, "load_incomplete", "request %s: KV cache groups %s could not be loaded; vLLM "
                      "recomputes the request", spec.req_id, sorted(g for g, ok in done.items() if not ok) or "all")

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def _load(self, spec: LoadSpec, held: HeldPrefix | GroupedHold | None, layerwise: bool) -> None:
        if self.grouped is not None:
            self._load_groups(spec, cast("GroupedHold | None", held))  # a grouped engine's lookups hold these
            return
        held = cast("HeldPrefix | None", held)
        engine = cast("CacheEngine", self.engine)
        num = len(spec.token_ids)
        wanted = torch.zeros(num, dtype=torch.bool)
        wanted[spec.skip_leading:spec.load_end] = True
        tokens = torch.as_tensor(spec.token_ids, dtype=torch.long)
        owner = held.owner if held is not None else None
        try:
            slots = slot_mapping_for(spec.block_ids, self.block_size, num)
            if layerwise:
                retriever = engine.retrieve_layer(tokens, self.kv_caches, slots, wanted, extra=spec.extra,
                                                       owner=owner, lower_tiers=False)
                loaded = torch.as_tensor(next(retriever), dtype=torch.bool)
                self._retrievers.add((spec, loaded), retriever)
            else:
                # Memory only: the lookup's prefetch did the tier reads; none happens in the step.
                loaded = torch.as_tensor(engine.retrieve(tokens, self.kv_caches, slots, wanted,
                                                              extra=spec.extra, owner=owner, lower_tiers=False),
                                         dtype=torch.bool)
        except Exception:
            logs.warn(logger, "load_failed", "request %s: load failed; vLLM will recompute", spec.req_id,
                      exc_info=True)
            loaded = torch.zeros(num, dtype=torch.bool)
        finally:
            if held is not None:
                held.release()  # what the load did not take (chunks past load_end)
        self._fail(spec, wanted & ~loaded, int(wanted.sum()))

    def _fail(self, spec: LoadSpec, missing: torch.Tensor, wanted: int) -> None:
        """Reports the blocks of `missing` tokens to vLLM (recompute) and stops the request's saves."""
        num_missing = int(missing.sum())
        if not num_missing:
            return
        positions = torch.nonzero(missing).flatten().tolist()
        bad_blocks = {spec.block_ids[p // self.block_size] for p in positions}
        self._load_errors.update(bad_blocks)
        self.failed.add(spec.req_id)
        metrics.inc("failed_load_tokens", num_missing)
        logs.warn(logger, "load_incomplete", "request %s: %d of %d tokens could not be loaded; %d blocks "
                  "reported for recompute", spec.req_id, num_missing, wanted, len(bad_blocks))

    def wait_for_layer(self, layer_name: str) -> None:
        """Every layerwise load has copied its layers up to and including `layer_name`'s."""
        target = self.layer_index.get(layer_name)
        if target is not None:
            self._copy_to(target)

    def _copy_to(self, target: int) -> None:
        if not self._copying:
            return
        if self._thread is not None:  # finished or not, it may hold failures not reported yet
            for tag, exc, layer in self._thread.wait(target):
                self._layer_failed(tag, exc, layer)
            return
        while self._retrievers and self._next_layer <= target:
            self._retrievers.step(lambda tag, exc: self._layer_failed(tag, exc, self._next_layer))
            self._next_layer += 1

    def finish_layers(self) -> None:
        """Layers the forward never announced still get their KV before the step ends."""
        self._copy_to(len(self.kv_caches) - 1)

    def _layer_failed(self, tag: tuple[LoadSpec, torch.Tensor], exc: Exception, layer: int) -> None:
        # Earlier layers got their KV, this and later ones did not: the whole range is a hole.
        spec, loaded = tag
        logs.warn(logger, "load_failed", "request %s: layerwise load failed at layer %d (%s: %s)", spec.req_id,
                  layer, type(exc).__name__, exc)
        self._fail(spec, loaded, int(loaded.sum()))

    def agree(self, meta: LMCacheConnectorMetadata) -> None:
        """Once per step with loads and saves (the same steps on every rank: the metadata is identical),
        learns which loads failed on any tensor-parallel rank."""
        if self._agreed or not (meta.loads and meta.saves):
            return
        self._agreed = True
        mine = [spec.req_id in self.failed for spec in meta.loads]
        try:
            anywhere = self._agree(mine)
        except Exception:
            logs.warn(logger, "tp_agreement_failed", "TP ranks could not agree on failed loads; this step's "
                      "loaded requests save nothing", exc_info=True)
            anywhere = [True] * len(mine)
        for spec, here, there in zip(meta.loads, mine, anywhere):
            if there and not here:
                self.failed.add(spec.req_id)
                metrics.inc("loads_failed_on_other_rank")
                logs.warn(logger, "load_failed_on_other_rank", "request %s: its load failed on another "
                          "tensor-parallel rank; it saves nothing this step", spec.req_id)

    def take_load_errors(self) -> set[int]:
        self.finish_layers()  # a failure of a layer still copying counts in this step (vLLM may defer wait_for_save)
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
        self._retrievers.close()
        self.requests.close()
