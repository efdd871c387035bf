"""vLLM's KV cache groups for the connector: which groups, which layers, which blocks of a request.

- `plan_groups(kv_cache_config)` reads vLLM 0.32's `KVCacheConfig.kv_cache_groups` into `kv_groups.KVGroup`s
  (`FullAttentionSpec`/`MLAAttentionSpec` -> full, `SlidingWindowSpec` -> sliding, `MambaSpec` -> state).
  A group of another kind (chunked local attention, sink or circular-buffer attention, ...), or a state group
  while vLLM keeps no states at prefix boundaries (`mamba_cache_mode` other than "align": prefix caching
  off), makes the plan say why this model is not cached: the connector then neither looks up nor saves,
  and vLLM serves as without it.
- `build_grouped_engine` builds the `GroupedEngine` of a multi-group model on a worker: per attention group
  a `CacheEngine` over its layers' views, per state group a `StateEngine`, one storage.
- `SchedulerGroups` gives the scheduler half each request's block tables, one per group, as vLLM holds them
  this step (`SchedulerOutput.kv_connector_block_state`: resolved after vLLM freed the blocks that left a
  window, which then read as the null block), and the states vLLM offers to store (its exact blocks,
  `boundary_state_offloads`) at chunk boundaries.
- `load_parts` / `save_parts` turn a `LoadSpec` / `SaveSpec` into each group's slots and wanted tokens
  (`grouped_engine.GroupSlots`): tokens in null blocks are neither loaded nor stored; a sliding group loads
  only the blocks vLLM allocated for the hit (the window), a state group the state at the hit's end.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from lmcache_vllm.engine.kv_groups import GroupKind, GroupSlots, KVGroup
from lmcache_vllm.integration.vllm.metadata import LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.engine.grouped import GroupedEngine
    from lmcache_vllm.tokens import KeyBuilder

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0  # vLLM's null block (`v1/attention/backends/utils.py`): a position a group does not keep
_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class GroupPlan:
    """The groups of a model, or why the connector does not cache it (`disabled`)."""

    groups: tuple[KVGroup, ...]
    disabled: str | None = None

    @property
    def multi(self) -> bool:
        return len(self.groups) > 1


def layer_number(name: str, fallback: int) -> int:
    """The model's layer number in a layer name (`model.layers.3.self_attn.attn` -> 3)."""
    match = _LAYER_NUMBER.search(name)
    return int(match.group(1)) if match else fallback


def _spec_of(group: Any) -> Any:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(per_layer, dict) and per_layer:
        kinds = {type(s) for s in per_layer.values()}
        return next(iter(per_layer.values())) if len(kinds) == 1 else spec
    return spec


def _group(index: int, group: Any, order: dict[str, int]) -> KVGroup | str:
    """The group, or why it cannot be cached."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    spec = _spec_of(group)
    names = tuple(group.layer_names)
    indices = tuple(layer_number(name, order.get(name, i)) for i, name in enumerate(names))
    kind = type(spec)
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        return KVGroup(index, GroupKind.FULL, names, indices, spec.block_size)
    if kind is SlidingWindowSpec:
        return KVGroup(index, GroupKind.SLIDING, names, indices, spec.block_size,
                       window=spec.sliding_window + spec.extra_retained_tokens, sliding_window=spec.sliding_window)
    if kind is MambaSpec:
        if spec.mamba_cache_mode != "align":
            return (f"its state group {index} ({kind.__name__}) runs in mamba_cache_mode "
                    f"{spec.mamba_cache_mode!r}: vLLM keeps no state at prefix boundaries (enable prefix caching)")
        return KVGroup(index, GroupKind.STATE, names, indices, spec.block_size)
    return f"its KV cache group {index} is {kind.__name__}, a kind lmcache-vllm does not store"


def plan_groups(kv_cache_config: "KVCacheConfig | None", layer_order: Sequence[str] = ()) -> GroupPlan:
    """The KV cache groups vLLM transfers (`enable_kv_transfer`), as `KVGroup`s (see the module docstring)."""
    groups_in = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    order = {name: i for i, name in enumerate(layer_order)}
    planned: list[KVGroup] = []
    for index, group in enumerate(groups_in):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # an ephemeral replica vLLM rebuilds from its source group after a load
        found = _group(index, group, order)
        if isinstance(found, str):
            if len(groups_in) == 1:
                break  # a single group keeps today's path (its layout decides at registration)
            return GroupPlan((), found)
        planned.append(found)
    return GroupPlan(tuple(planned))


def build_grouped_engine(config: "LMCacheConfig", vllm_config: "VllmConfig", kv_caches: dict[str, torch.Tensor],
                         kv_cache_config: "KVCacheConfig", groups: Sequence[KVGroup],
                         keys: "KeyBuilder") -> "GroupedEngine":
    """The engine of a multi-group model on one worker rank; `keys` are the model's untagged keys."""
    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.engine.grouped import GroupedEngine
    from lmcache_vllm.engine.state import StateEngine
    from lmcache_vllm.integration.vllm.kv_layout import layout_for
    from lmcache_vllm.layouts.state import StatePageLayout
    from lmcache_vllm.storage.manager import StorageManager

    storage = StorageManager(config)
    engines: list[CacheEngine | StateEngine] = []
    caches: list[list[torch.Tensor]] = []
    try:
        for group in groups:
            views = {name: kv_caches[name] for name in group.layer_names}
            caches.append(list(views.values()))
            if group.kind == GroupKind.STATE:
                spec = _spec_of(kv_cache_config.kv_cache_groups[group.index])
                state_dtypes = "+".join(str(d).replace("torch.", "") for d in spec.dtypes)
                engines.append(StateEngine(config, StatePageLayout.from_views(caches[-1]),
                                           keys.for_group(group.tag, kv_dtype=state_dtypes), storage, caches[-1]))
            else:
                layout = layout_for(vllm_config, kv_cache_config, views)
                # As for a single group (connector.build_cache_engine): a GPU kernel only after its self-check.
                layout.bind_kernel(caches[-1], config.extra_config.cuda_kernel)
                engines.append(CacheEngine(config, layout, keys.for_group(group.tag), storage=storage))
    except Exception:
        storage.close()
        raise
    engine = GroupedEngine(config, groups, engines, caches, storage)
    logger.info("KV cache groups: %s", ", ".join(f"{g.index}: {g.tag} ({len(g.layer_names)} layers, block "
                                                 f"{g.block_size})" for g in groups))
    return engine


class SchedulerGroups:
    """What the scheduler half needs to know about a multi-group model's groups (see the module docstring)."""

    def __init__(self, groups: Sequence[KVGroup], chunk_size: int):
        self.groups = list(groups)
        self.chunk_size = chunk_size

    @staticmethod
    def tables(scheduler_output: "SchedulerOutput", req_id: str) -> tuple[list[int], ...] | None:
        """The request's block table of every group as vLLM holds it in this step (None if not given)."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is None:
            return None
        ids = state.get_block_ids(req_id)
        return None if ids is None else tuple(list(table) for table in ids)

    def states(self, scheduler_output: "SchedulerOutput") -> dict[str, list[tuple[int, int, int]]]:
        """(group, block, boundary) of each state vLLM offers this step at a chunk boundary, by request."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        wanted = {g.index for g in self.groups if g.kind == GroupKind.STATE}
        out: dict[str, list[tuple[int, int, int]]] = {}
        for req_id, entries in offers.items():
            kept = [(g, b, n) for g, b, n in entries
                    if g in wanted and n > 0 and n % self.chunk_size == 0 and b != NULL_BLOCK_ID]
            if kept:
                out[req_id] = kept
        return out


def slots_of(table: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot of each of `num_tokens` tokens in `table`; -1 where the block is the null block or missing."""
    blocks = torch.full((-(-num_tokens // block_size),), NULL_BLOCK_ID, dtype=torch.long)
    known = torch.as_tensor(list(table[:blocks.numel()]), dtype=torch.long)
    blocks[:known.numel()] = known
    positions = torch.arange(num_tokens, dtype=torch.long)
    block = blocks[positions // block_size]
    return torch.where(block == NULL_BLOCK_ID, torch.full_like(block, -1),
                       block * block_size + positions % block_size)


def load_parts(groups: Sequence[KVGroup], spec: LoadSpec) -> dict[int, GroupSlots]:
    """Each group's part of a load of tokens [skip_leading, load_end)."""
    parts: dict[int, GroupSlots] = {}
    num = len(spec.token_ids)
    for group in groups:
        table = spec.group_block_ids[group.index] if group.index < len(spec.group_block_ids) else []
        if group.kind == GroupKind.STATE:
            # vLLM keeps the state of a prefix of n tokens in the block at index (n - 1) // block_size.
            index = (spec.load_end - 1) // group.block_size
            block = table[index] if 0 <= index < len(table) else NULL_BLOCK_ID
            parts[group.index] = GroupSlots(states=[(spec.load_end, block if block != NULL_BLOCK_ID else -1)],
                                            complete=block != NULL_BLOCK_ID)
            continue
        slots = slots_of(table, group.block_size, num)
        # Every token of the blocks vLLM allocated for the hit is written (none left holding stale bytes); those
        # the next token attends to must all have a block.
        mask = torch.zeros(num, dtype=torch.bool)
        mask[spec.skip_leading:spec.load_end] = True
        needed = slots[max(spec.skip_leading, group.kept_start(spec.load_end)):spec.load_end]
        parts[group.index] = GroupSlots(slots, mask & (slots >= 0), complete=bool((needed >= 0).all()))
    return parts


def save_parts(groups: Sequence[KVGroup], spec: SaveSpec) -> dict[int, GroupSlots]:
    """Each group's part of a save of tokens [skip_leading, len(token_ids)) and of the spec's states."""
    parts: dict[int, GroupSlots] = {}
    num = spec.num_tokens
    for group in groups:
        if group.kind == GroupKind.STATE:
            states = [(n, block) for g, block, n in spec.states if g == group.index]
            if states:
                parts[group.index] = GroupSlots(states=states)
            continue
        if spec.skip_leading >= num:
            continue
        table = spec.group_block_ids[group.index] if group.index < len(spec.group_block_ids) else []
        slots = slots_of(table, group.block_size, num)
        mask = torch.zeros(num, dtype=torch.bool)
        mask[spec.skip_leading:] = True
        parts[group.index] = GroupSlots(slots, mask & (slots >= 0))
    return parts
