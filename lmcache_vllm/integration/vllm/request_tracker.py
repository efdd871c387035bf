"""What the scheduler half keeps per live request (`RequestTracker`: its token array, blocks, saved
position, planned load, load limit and disaggregated-prefill state), the chunk arithmetic its rules use, and
`max_load_tokens_of`: the request's own cap on what is loaded for it."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from lmcache_vllm.extra_keys import ExtraKeys
from lmcache_vllm.integration.vllm.lookup import LookupAnswer
from lmcache_vllm.integration.vllm.metadata import PeerSpec
from lmcache_vllm.integration.vllm.pd.params import RemotePrefill
from lmcache_vllm.observability import logs, metrics

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
MAX_LOAD_TOKENS = "max_load_tokens"


def floor_to(n: int, multiple: int) -> int:
    return n - n % multiple


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def max_load_tokens_of(req_id: str, params: Mapping[str, Any] | None) -> int | None:
    """The request's `max_load_tokens` (vLLM's OffloadingConnector convention in 0.32 / 0.33: at most that many
    tokens are loaded beyond vLLM's own prefix-cache hit, in whole chunks; 0: nothing) or None (no cap). A value
    that is not a non-negative integer (a bool is not one) is ignored, logged and counted (refused_request_params):
    any client can send kv_transfer_params."""
    raw = params.get(MAX_LOAD_TOKENS) if isinstance(params, Mapping) else None
    if raw is None:
        return None
    if type(raw) is int and raw >= 0:
        metrics.inc("load_limited_requests")
        return raw
    metrics.inc("refused_request_params", param=MAX_LOAD_TOKENS)
    logs.warn(logger, "refused_max_load_tokens", "request %s: kv_transfer_params max_load_tokens=%.40r is not a "
              "non-negative integer; ignored (no cap)", req_id, raw)
    return None


@dataclass
class PendingLoad:
    fetch_len: int  # tokens whose chunks are fetched (chunk-aligned or the whole stored sequence)
    skip_leading: int  # already in vLLM's prefix cache
    load_end: int  # exclusive; vLLM computes from here


@dataclass
class RequestLookup:
    answer: LookupAnswer  # what the workers reported (and hold): the run, the tier of each chunk
    num_computed_tokens: int = 0  # vLLM's local hit at the latest ask
    load_async: bool = False  # the answer given to vLLM at the latest ask


class RequestTracker:
    """What the scheduler half knows about one live request."""

    def __init__(self, request: "Request", extra: ExtraKeys | None, uncacheable: str | None = None):
        self.request = request
        self.extra = extra  # None: see `uncacheable` (the reason), nothing is looked up or saved
        self.req_id: str = request.request_id
        self.prompt_len: int = request.num_prompt_tokens
        self.block_ids: list[int] = []
        self.group_tables: tuple[list[int], ...] = ()  # multi-group models: every group's table (vLLM's)
        self.saved_end = 0  # tokens [0, saved_end) already handed to a save (or known stored)
        self.pending_load: PendingLoad | None = None
        self.uncacheable = uncacheable
        self.hit_sources: dict[str, int] = {}  # tokens of the last planned load, by the tier holding them
        self.saves_emitted = 0
        self.max_load_tokens: int | None = None  # the request's cap on loaded tokens (None: none)
        self._token_array = np.empty(0, dtype=np.int64)
        # Disaggregated prefill. Prefill side: hold the prompt's chunks for a decode instance (and whether
        # the hold went out). Decode side: where the prompt's KV waits, whether this instance still has to
        # pull or release it (`remote_open`), whether its host name is still being resolved
        # (`remote_pending`), vLLM's own hit when asked, and the pull of the planned load.
        self.holds_for_peer = False
        self.hold_emitted = False
        self.remote: RemotePrefill | None = None
        self.remote_open = False
        self.remote_pending = False
        self.remote_computed = 0
        self.peer_load: PeerSpec | None = None

    def token_array(self) -> np.ndarray:
        """The request's token ids as one int64 array, converted from vLLM's list once per request.

        Hashing (lookup, save, load) converts token ids to bytes; from a numpy array that is a copy,
        from a Python list a per-element conversion several times slower. Generated tokens are appended
        to the cached array; it is never modified in place, so slices handed out stay valid.
        """
        all_ids = self.request.all_token_ids
        have = len(self._token_array)
        if have != len(all_ids):
            if have > len(all_ids):  # never seen from vLLM; rebuild rather than trust a stale array
                have, self._token_array = 0, self._token_array[:0]
            tail = np.fromiter(all_ids[have:], dtype=np.int64, count=len(all_ids) - have)
            self._token_array = np.concatenate((self._token_array, tail)) if have else tail
        return self._token_array

    def token_ids(self, end: int) -> np.ndarray:
        return self.token_array()[:end]
