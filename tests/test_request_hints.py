"""Per-request hints in kv_transfer_params (`integration/vllm/request_hints.py`, `storage/pins.py`): parsing any
client's params without raising, skip_save and pin_tokens through the scheduler half on vLLM's real Request /
SchedulerOutput, and pins that keep chunks in a real L1 within their budget."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")  # the hints travel in vLLM's connector metadata

from test_engine import CHUNK, make_caches, make_engine, slots_for  # noqa: E402
from test_integration_scheduler import BLOCK, PrefixStore, cached_step, new_step  # noqa: E402
from test_integration_scheduler import CHUNK as SCHED_CHUNK  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_vllm.config import LMCacheConfig, load_config  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import PinSpec  # noqa: E402
from lmcache_vllm.integration.vllm.request_hints import (  # noqa: E402
    NO_HINTS,
    RequestHints,
    WorkerPins,
    parse_hints,
)
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.memory import HostAllocator  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.storage.local_cpu import LocalCPUBackend  # noqa: E402
from lmcache_vllm.storage.pins import PinnedPrefixes  # noqa: E402

SHAPE = (4, 1024)  # 16 KiB of float32
NBYTES = 4 * 1024 * 4


@pytest.mark.parametrize("params, hints, refused", [
    (None, NO_HINTS, []),
    ({}, NO_HINTS, []),
    ({"do_remote_decode": True, "max_load_tokens": 5}, NO_HINTS, []),  # others' keys
    ({"lmcache.skip_save": True}, RequestHints(skip_save=True), []),
    ({"lmcache.skip_save": False}, NO_HINTS, []),
    ({"lmcache.skip_save": "true"}, NO_HINTS, ["bad_skip_save"]),
    ({"lmcache.skip_save": 1}, NO_HINTS, ["bad_skip_save"]),
    ({"lmcache.pin_tokens": 2048}, RequestHints(pin_tokens=2048), []),
    ({"lmcache.pin_tokens": 0}, NO_HINTS, []),
    ({"lmcache.pin_tokens": -1}, NO_HINTS, ["bad_pin_tokens"]),
    ({"lmcache.pin_tokens": 2.5}, NO_HINTS, ["bad_pin_tokens"]),
    ({"lmcache.pin_tokens": True}, NO_HINTS, ["bad_pin_tokens"]),
    ({"lmcache.pin_tokens": 1 << 40}, NO_HINTS, ["bad_pin_tokens"]),
    ({"lmcache.tag.user": "x", "lmcache.skip_save": True}, RequestHints(skip_save=True), ["unknown"]),
    ([1, 2], NO_HINTS, ["malformed"]),
    ("lmcache.skip_save", NO_HINTS, ["malformed"]),
])
def test_parse_hints(params, hints, refused):
    assert parse_hints(params) == (hints, refused)


def test_pin_hints_refused_where_pins_are_off():
    assert parse_hints({"lmcache.pin_tokens": 64}, pins_enabled=False) == (NO_HINTS, ["pins_disabled"])


# ---------------------------------------------------------------------------------------- PinnedPrefixes
def _stored(l1: LocalCPUBackend, key: str):
    obj = l1.allocate(SHAPE, torch.float32)
    l1.put_sync(key, obj)
    obj.ref_down()  # the caller's ref; the index keeps its own


def _held(l1: LocalCPUBackend, *keys: str):
    return [l1.get_sync(k) for k in keys]


def test_pins_keep_chunks_in_l1_under_pressure_and_release_the_oldest_beyond_budget():
    l1 = LocalCPUBackend(HostAllocator(6 * NBYTES))
    for key in "abcdef":
        _stored(l1, key)
    pins = PinnedPrefixes(budget_bytes=3 * NBYTES)
    assert pins.add("ab", _held(l1, "a", "b"))
    for key in "ghij":  # four new chunks: only c..f can make room
        _stored(l1, key)
    assert l1.contains_sync("a") and l1.contains_sync("b")
    assert pins.pinned_bytes == 2 * NBYTES and len(pins) == 1
    gh = _held(l1, "g", "h")
    assert pins.add("gh", gh)  # 4 chunks > budget: the oldest pin goes
    assert len(pins) == 1 and pins.pinned_bytes == 2 * NBYTES
    assert metrics.value("pins_released", reason="budget") == 1
    _stored(l1, "k")
    _stored(l1, "l")
    assert not l1.contains_sync("a") and l1.contains_sync("g") and l1.contains_sync("h")
    pins.close()
    assert [o.ref_count for o in gh] == [1, 1]  # L1's own reference only: evictable again


def test_a_prefix_larger_than_the_budget_is_not_pinned_and_renewing_keeps_one_pin():
    l1 = LocalCPUBackend(HostAllocator(4 * NBYTES))
    for key in "abc":
        _stored(l1, key)
    pins = PinnedPrefixes(budget_bytes=2 * NBYTES)
    objs = _held(l1, "a", "b", "c")
    assert not pins.add("abc", objs)
    assert [o.ref_count for o in objs] == [1, 1, 1]  # the references were dropped again
    assert metrics.value("pins_released", reason="too_large") == 1
    assert pins.add("ab", _held(l1, "a", "b"))
    assert pins.add("ab", _held(l1, "a", "b"))  # renewed, not doubled
    assert len(pins) == 1 and [o.ref_count for o in objs[:2]] == [2, 2]
    assert not pins.add("gone", [])  # nothing of a prefix in L1: no pin, the others stay
    assert len(pins) == 1
    pins.clear()
    assert pins.pinned_bytes == 0 and [o.ref_count for o in objs] == [1, 1, 1]
    snapshot = metrics.snapshot()
    assert metrics.value("pinned_bytes", snapshot) == 0


# ---------------------------------------------------------------------------------------- WorkerPins
class _Saves:
    """The save queue with nothing in flight: `when_done` calls back at once (as SaveQueue does)."""

    def when_done(self, req_ids, callback):
        callback()


def test_worker_pins_an_engines_stored_prefix_and_skips_failed_loads():
    engine = make_engine()
    try:
        tokens = np.arange(1000, 1000 + 3 * CHUNK, dtype=np.int64)
        assert engine.store(tokens, make_caches(True), slots_for(len(tokens), seed=1)) == 3 * CHUNK
        pins = WorkerPins(engine, budget_bytes=engine.config.max_local_cpu_bytes)
        pins.pin([PinSpec("failed", tokens[:CHUNK])], _Saves(), failed={"failed"})
        assert len(pins.pins) == 0
        pins.pin([PinSpec("a", tokens[:2 * CHUNK])], _Saves(), failed=set())
        assert len(pins.pins) == 1 and pins.pins.pinned_bytes > 0
        keys, objs = engine.hold_prefix(tokens[:2 * CHUNK])
        assert [o.ref_count for o in objs] == [3, 3]  # L1's, the pin's, ours just now
        for obj in objs:
            obj.ref_down()
        pins.close()
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------- the scheduler half
def _half(**config) -> SchedulerHalf:
    return SchedulerHalf(LMCacheConfig(chunk_size=SCHED_CHUNK, **config), block_size=BLOCK,
                         lookup_client=PrefixStore(0), can_load=True, can_save=True)


def _request(req_id: str, n: int, params) -> Request:
    return Request(req_id, list(range(100, 100 + n)), SamplingParams(max_tokens=4,
                   extra_args={"kv_transfer_params": params}), None)


def _run_prompt(half: SchedulerHalf, req: Request, n: int):
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, 0)
    first = half.build_connector_meta(new_step(req, list(range(1, 5)), computed=0, scheduled=256))
    second = half.build_connector_meta(cached_step(req, list(range(5, 9)), computed=256, scheduled=n - 256))
    return first, second


def test_skip_save_stores_nothing_of_the_request_and_counts_the_hint():
    half = _half()
    first, second = _run_prompt(half, _request("a", 700, {"lmcache.skip_save": True}), 700)
    assert first.saves == second.saves == []
    assert metrics.value("request_hints", hint="skip_save") == 1
    plain = _half()
    first, second = _run_prompt(plain, _request("b", 700, None), 700)
    assert [s.num_tokens for s in first.saves + second.saves] == [256, 512]


def test_pin_goes_out_once_when_the_prefix_kv_exists_in_whole_chunks():
    half = _half()
    first, second = _run_prompt(half, _request("a", 700, {"lmcache.pin_tokens": 600}), 700)
    assert first.pins == []  # 512 tokens pinned: their KV exists only after the second step
    (pin,) = second.pins
    assert (pin.req_id, len(pin.token_ids)) == ("a", 512)
    assert list(pin.token_ids) == list(range(100, 612))
    decode = half.build_connector_meta(cached_step(_request("a", 700, None), None, computed=700, scheduled=1))
    assert decode.pins == []
    assert metrics.value("request_hints", hint="pin") == 1


def test_bad_hints_are_counted_and_change_nothing():
    half = _half()
    first, second = _run_prompt(half, _request("a", 700, {"lmcache.pin_tokens": "all", "lmcache.skip_save": 1,
                                                          "lmcache.tag.x": "y"}), 700)
    assert [s.num_tokens for s in first.saves + second.saves] == [256, 512] and second.pins == []
    for reason in ("bad_pin_tokens", "bad_skip_save", "unknown"):
        assert metrics.value("refused_request_hints", reason=reason) == 1
    off = _half(extra_config={"max_pinned_fraction": 0})
    _run_prompt(off, _request("b", 700, {"lmcache.pin_tokens": 256}), 700)
    assert metrics.value("refused_request_hints", reason="pins_disabled") == 1


def test_max_pinned_fraction_is_checked():
    with pytest.raises(Exception, match="max_pinned_fraction"):
        load_config({"extra_config": {"max_pinned_fraction": 1.5}})
