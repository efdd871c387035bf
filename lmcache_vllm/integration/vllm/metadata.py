"""What the scheduler half of the connector tells the worker half for one engine step.

`LMCacheConnectorMetadata` travels inside vLLM's `SchedulerOutput` (pickled to worker processes with
tensor parallelism), so it holds plain ints, lists and numpy arrays only (token ids are one int64 array
per request, shared by its specs as views, so hashing and `torch.as_tensor` never copy them) and the
request's `ExtraKeys` (frozen bytes; None only where nothing is cached). Per request it carries at most one
`LoadSpec` (copy a cached prefix into the paged KV cache before the forward, or asynchronously while
the request waits; from a prefill instance first when it names one) and one `SaveSpec` (copy freshly
computed KV out of the paged cache after it; a second one may carry only states of a multi-group model),
and for disaggregated prefill the holds and releases of docs/DISAGGREGATED.md.

Block ids: a model with one KV cache group has them in `block_ids`; a model with several (hybrid: sliding
window, Mamba) has every group's whole table in `group_block_ids` (vLLM's group order, null blocks as 0)
and `block_ids` empty (`groups.py` maps them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache_vllm.extra_keys import ExtraKeys


def slot_mapping_for(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot of each of the first `num_tokens` tokens of a request whose KV lives in `block_ids`."""
    needed = -(-num_tokens // block_size)
    if needed > len(block_ids):
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, "
                         f"request has {len(block_ids)}")
    blocks = np.fromiter(block_ids[:needed], dtype=np.int64, count=needed)
    # Each block's slots in a row (no division per token: this runs in the step, per load and save), in numpy: a
    # torch op lets go of the GIL and must take it back, which on the step thread can mean waiting for ours.
    slots = blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)
    return torch.from_numpy(slots.reshape(-1)[:num_tokens])


@dataclass(frozen=True)
class PeerSpec:
    """A prefill instance holding a request's chunks (disaggregated prefill): its address (an IP literal the
    scheduler resolved and checked, `pd/trust.py`), one transfer port per tensor-parallel rank, the request's
    id there (the name of the hold) and the peer's metric label (a bounded set)."""

    req_id: str
    host: str
    ports: tuple[int, ...]
    label: str = "other"


@dataclass
class PeerHoldSpec:
    """The prefill side: hold the chunks of `token_ids` (the prompt) for the decode instance, once the
    request's saves are over."""

    req_id: str
    token_ids: np.ndarray  # int64
    extra: ExtraKeys | None = None


@dataclass
class PinSpec:
    """Keep the L1 chunks of `token_ids` (whole chunks of a prompt's start) once the request's saves are over: the
    request asked for it (`lmcache.pin_tokens`, request_hints.py)."""

    req_id: str
    token_ids: np.ndarray  # int64
    extra: ExtraKeys | None = None


@dataclass
class LoadSpec:
    """Load tokens [skip_leading, load_end) of `token_ids` into the request's blocks.

    `token_ids` is the cached prefix whose chunks are fetched (chunk-aligned or the whole stored
    sequence); tokens before `skip_leading` are already in vLLM's own prefix cache and tokens at or
    after `load_end` are left for vLLM to compute (a full-prompt hit leaves the last token).
    `is_async`: the request waits in vLLM's WAITING_FOR_REMOTE_KVS while its chunks are read from a
    slower tier; the worker copies them in once they are in L1 and reports the request finished
    receiving (`get_finished`).
    """

    req_id: str
    token_ids: np.ndarray  # int64
    block_ids: list[int]
    skip_leading: int
    load_end: int
    extra: ExtraKeys | None = None  # the request's extra keys (LoRA, multimodal, salt, embeddings)
    is_async: bool = False
    peer: PeerSpec | None = None  # pull from this prefill instance first (disaggregated prefill)
    group_block_ids: tuple[list[int], ...] = ()  # multi-group models: every group's block table


@dataclass
class SaveSpec:
    """Store the KV of `token_ids` (a prefix of the request) from position `skip_leading` on.

    `skip_leading` is chunk-aligned: whole chunks before it were stored in an earlier step.
    `is_last` marks the final save of the prompt (a partial last chunk may be stored then).
    """

    req_id: str
    token_ids: np.ndarray  # int64
    block_ids: list[int]
    skip_leading: int
    is_last: bool = False
    extra: ExtraKeys | None = None
    for_peer: bool = False  # held for a decode instance: the partial last chunk too, no wait for Redis
    group_block_ids: tuple[list[int], ...] = ()  # multi-group models: every group's block table
    states: list[tuple[int, int, int]] = field(default_factory=list)  # (group, block, boundary) to store

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    """All loads and saves of one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    release_req_ids: list[str] = field(default_factory=list)  # looked up, will load nothing: unhold
    idle: bool = False  # vLLM computes nothing this step (e.g. every request waits for its load)
    # Finished requests whose blocks vLLM keeps until the workers report their saves over
    # (finished_sending), and requests preempted this step (their blocks are freed at once).
    delayed_free_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Disaggregated prefill: holds to register (prefill side), holds of aborted requests to drop, and
    # prefill instances to tell that this decode instance will not pull (refused, aborted, nothing to pull).
    peer_holds: list[PeerHoldSpec] = field(default_factory=list)
    peer_unholds: list[str] = field(default_factory=list)
    peer_releases: list[PeerSpec] = field(default_factory=list)
    pins: list[PinSpec] = field(default_factory=list)  # prefixes requests asked to keep in L1

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.release_req_ids or self.peer_holds or self.peer_unholds
                    or self.peer_releases or self.pins)
