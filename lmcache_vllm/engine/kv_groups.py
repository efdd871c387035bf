"""KV cache groups: which layers share one block table, and which tokens a group needs for a hit of n tokens.

A model whose layers are of several kinds has one KV cache group per kind in vLLM's hybrid KV cache manager
(`integration/vllm/groups.py` reads them from vLLM). What each kind keeps, mirroring vLLM 0.32's managers
(`v1/core/single_type_kv_cache_manager.py`):
- `full` attention keeps every token: a hit of n tokens needs every chunk below n.
- `sliding` window attention keeps the blocks from `(n - window + 1) // block_size` on (`window` includes
  vLLM's extra retained tokens); the blocks before are vLLM's null block. A hit of n needs the chunks that
  overlap the kept blocks.
- `state` (Mamba, linear attention) keeps one recurrent state per prefix boundary, in the block at index
  `n / block_size - 1`. A hit of n needs the state at n: n must be a boundary a state was stored at.

`GroupSlots` is one group's part of a load or save (`grouped.py` moves it).

`KVGroup.tag` names a group in its chunks' keys (`tokens.CacheKey.group`): the kind, the window and the
model's layer indices, e.g. `full.l0.2`, `swa384.l1.3`, `state.l0.2`. A model with a single group uses no
tag at all (its keys are those of a model without groups).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import xxhash

_MAX_LAYER_PART = 40  # longer layer lists are named by count and hash (keys stay short enough for files)


class GroupKind(enum.StrEnum):
    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


def layer_part(layer_indices: tuple[int, ...]) -> str:
    """`l0.2` for layers 0 and 2, `l0-4.6-10` for runs; `n<count>h<hash>` when that gets long."""
    runs: list[list[int]] = []
    for index in sorted(layer_indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    text = "l" + ".".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    if len(text) <= _MAX_LAYER_PART:
        return text
    digest = xxhash.xxh3_64_hexdigest(",".join(map(str, sorted(layer_indices))).encode())[:8]
    return f"n{len(layer_indices)}h{digest}"


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: vLLM's group id, its kind, layers and block size (tokens per block)."""

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    layer_indices: tuple[int, ...]  # the model's layer numbers, in `layer_names` order
    block_size: int
    window: int = 0  # sliding: the tokens before the next one whose blocks vLLM keeps (sliding_window + extra)
    sliding_window: int = 0  # sliding: the model's attention window (named in the tag)

    def __post_init__(self) -> None:
        problems = []
        if self.block_size <= 0:
            problems.append(f"block_size {self.block_size} must be positive")
        if len(self.layer_names) != len(self.layer_indices) or not self.layer_names:
            problems.append(f"{len(self.layer_names)} layer names for {len(self.layer_indices)} layer indices")
        if self.kind == GroupKind.SLIDING and self.window <= 0:
            problems.append("a sliding group needs a positive window")
        if problems:
            raise ValueError(f"KV cache group {self.index}: " + "; ".join(problems))

    @property
    def tag(self) -> str:
        kind = f"swa{self.sliding_window or self.window}" if self.kind == GroupKind.SLIDING else str(self.kind)
        return f"{kind}.{layer_part(self.layer_indices)}"

    def kept_start(self, num_computed: int) -> int:
        """First token whose block vLLM keeps for a request with `num_computed` tokens (hit or computed)."""
        if self.kind == GroupKind.FULL:
            return 0
        if self.kind == GroupKind.SLIDING:
            skipped = max(0, num_computed - self.window + 1)
        else:
            skipped = max(0, num_computed - 1)
        return skipped // self.block_size * self.block_size

    def chunks_needed(self, hit_end: int, start: int, chunk_size: int) -> range:
        """Indices of the chunks this group must hold for a hit ending at token `hit_end` when the tokens
        before `start` (chunk-aligned) are in vLLM's own cache. A state group: the chunk ending at
        `hit_end`, whose key names the state there (empty unless `hit_end` is a chunk boundary)."""
        last = -(-hit_end // chunk_size)  # exclusive: the chunk holding token hit_end - 1 is needed
        if self.kind == GroupKind.STATE:
            if hit_end <= start or hit_end % chunk_size:
                return range(0)
            return range(last - 1, last)
        first = max(start, self.kept_start(hit_end)) // chunk_size
        return range(first, max(first, last))


def anchor_groups(groups: tuple[KVGroup, ...] | list[KVGroup]) -> list[KVGroup]:
    """The groups whose chunks form a prefix from the start (full attention)."""
    return [g for g in groups if g.kind == GroupKind.FULL]


@dataclass
class GroupSlots:
    """One group's part of a load or save: token slots and the tokens wanted (attention groups), or the
    states as (boundary, block) pairs (state groups)."""

    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    states: list[tuple[int, int]] = field(default_factory=list)
    complete: bool = True  # False: vLLM lacks a block this part needs (the load fails, nothing guessed)
