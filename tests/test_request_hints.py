"""Per-request hints in kv_transfer_params (`integration/vllm/request_hints.py`, `storage/pins.py`): parsing any
client's params without raising, skip_save and pin_tokens through the scheduler half on vLLM's real Request /
SchedulerOutput, and pins that keep chunks in a real L1 within their budget."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

pytest.importorskip("vllm")  # the hints travel in vLLM's connector metadata

from test_engine import CHUNK, make_caches, make_engine, slots_for, worker_config  # noqa: E402
from test_integration_scheduler import BLOCK, PrefixStore, cached_step, new_step  # noqa: E402
from test_integration_scheduler import CHUNK as SCHED_CHUNK  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_vllm.config import LMCacheConfig, load_config  # noqa: E402
from lmcache_vllm.extra_keys import for_salt  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, PinSpec  # noqa: E402
from lmcache_vllm.integration.vllm.request_hints import (  # noqa: E402
    NO_HINTS,
    RequestHints,
    WorkerPins,
    parse_hints,
)
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.integration.vllm.worker import WorkerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.storage.pins import PinLedger  # noqa: E402


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
        budget = engine.config.max_local_cpu_bytes
        pins = WorkerPins(engine, PinLedger(budget, budget, ttl_s=None))
        pins.pin([PinSpec("failed", tokens[:CHUNK])], _Saves(), failed={"failed"})
        assert len(pins.ledger) == 0
        pins.pin([PinSpec("a", tokens[:2 * CHUNK])], _Saves(), failed=set())
        pins.pin([PinSpec("b", tokens[:2 * CHUNK])], _Saves(), failed=set())  # the same prefix: renewed
        assert len(pins.ledger) == 1 and pins.ledger.pinned_bytes > 0
        (entry,) = pins.ledger.entries()
        assert entry.tenant == "" and entry.count == 0  # a hint renews, it does not count
        keys, objs = engine.hold_prefix(tokens[:2 * CHUNK])
        assert [o.ref_count for o in objs] == [3, 3]  # L1's, the pin's, ours just now
        for obj in objs:
            obj.ref_down()
        pins.ledger.close()
    finally:
        engine.close()


def test_a_hint_pin_belongs_to_the_requests_salt_and_a_full_tenant_is_refused_not_someone_else():
    """Issue 39: lmcache.pin_tokens pins are owned per cache_salt within that salt's budget; before, all pins
    shared one global budget whose oldest pin went first, so one tenant's pins pushed out everyone else's."""
    engine = make_engine()
    try:
        prompts = {name: np.arange(base, base + 2 * CHUNK, dtype=np.int64)
                   for name, base in (("a", 1000), ("b", 5000), ("b2", 9000))}
        owner = {"a": "a", "b": "b", "b2": "b"}  # b2: another prompt of tenant b
        for name, tokens in prompts.items():
            engine.store(tokens, make_caches(True), slots_for(len(tokens), seed=1), extra=for_salt(owner[name]))
        chunk_bytes = engine.hold_prefix(prompts["a"][:CHUNK], for_salt("a"))[1][0]
        nbytes = chunk_bytes.reserved
        chunk_bytes.ref_down()
        ledger = PinLedger(total_budget_bytes=8 * nbytes, tenant_budget_bytes=2 * nbytes, ttl_s=None)
        pins = WorkerPins(engine, ledger)
        pins.pin([PinSpec("a", prompts["a"], for_salt("a"))], _Saves(), failed=set())
        pins.pin([PinSpec("b", prompts["b"], for_salt("b"))], _Saves(), failed=set())
        pins.pin([PinSpec("b2", prompts["b2"], for_salt(owner["b2"]))], _Saves(), failed=set())  # past b's budget
        assert sorted(e.tenant for e in ledger.entries()) == ["a", "b"]  # a's pin stays
        assert ledger.usage() == {"a": 2 * nbytes, "b": 2 * nbytes}
        assert metrics.value("pins_refused", reason="tenant_budget") == 1
        ledger.close()
    finally:
        engine.close()


def _salted(salt: str):
    """A request's extra keys for its cache_salt, spelled out (request_keys.py's encoding)."""
    return for_salt(salt)


def test_one_tenants_pins_cannot_push_out_another_tenants_pin():
    """Issue 39, "a greedy pin": with room for four pinned chunks, tenant a pins two, then tenant b pins two
    prompts of two. Before, b's second pin let a's go (one global FIFO without owners); now it is refused and
    a's chunks stay pinned. Driven through the worker half, as the scheduler's metadata drives it."""
    engine = make_engine()
    caches = make_caches(True)
    nbytes = 2 * 2 * CHUNK * 128 * 2  # one chunk: layers x K/V x tokens x (heads x head size) x bf16
    fraction = 4 * nbytes / engine.config.max_local_cpu_bytes
    config = worker_config(engine)
    config = dataclasses.replace(config, extra_config=dataclasses.replace(
        config.extra_config, max_pinned_fraction=fraction, max_pinned_fraction_per_salt=fraction))
    worker = WorkerHalf(config, engine_factory=lambda _: engine, block_size=16, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    try:
        prompts = [("a", 1000), ("b", 5000), ("b", 9000)]
        for n, (salt, base) in enumerate(prompts):
            tokens = np.arange(base, base + 2 * CHUNK, dtype=np.int64)
            engine.store(tokens, caches, slots_for(len(tokens), seed=1), extra=_salted(salt))
            worker.begin_step()
            worker.wait_for_save(LMCacheConnectorMetadata(pins=[PinSpec(f"r{n}", tokens, _salted(salt))]))
        keys, objs = engine.hold_prefix(np.arange(1000, 1000 + 2 * CHUNK, dtype=np.int64), _salted("a"))
        assert [o.ref_count for o in objs] == [3, 3]  # L1's, a's pin, ours: still pinned
        for obj in objs:
            obj.ref_down()
    finally:
        worker.shutdown()


def test_a_hint_pin_ends_pin_ttl_secs_after_it_was_last_renewed():
    """Issue 39: a request's pin has an expiry (before, it stayed until pushed out or a reset)."""
    engine = make_engine()
    caches = make_caches(True)
    config = worker_config(engine)
    config = dataclasses.replace(config, extra_config=dataclasses.replace(
        config.extra_config, max_pinned_fraction=0.5, max_pinned_fraction_per_salt=0.5, pin_ttl_secs=0.2))
    worker = WorkerHalf(config, engine_factory=lambda _: engine, block_size=16, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    try:
        tokens = np.arange(1000, 1000 + 2 * CHUNK, dtype=np.int64)
        engine.store(tokens, caches, slots_for(len(tokens), seed=1))
        worker.begin_step()
        worker.wait_for_save(LMCacheConnectorMetadata(pins=[PinSpec("r", tokens)]))

        def references() -> list[int]:
            objs = engine.hold_prefix(tokens)[1]
            counts = [o.ref_count - 1 for o in objs]  # without ours
            for obj in objs:
                obj.ref_down()
            return counts

        assert references() == [2, 2]  # L1's and the pin's
        time.sleep(0.3)
        worker.begin_step()
        worker.wait_for_save(LMCacheConnectorMetadata())  # any step lets go what expired
        assert references() == [1, 1]  # L1's only: evictable again
        assert metrics.value("pins_released", reason="expired") == 1
    finally:
        worker.shutdown()


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
    half = _half(extra_config={"max_pinned_fraction": 0.25})
    first, second = _run_prompt(half, _request("a", 700, {"lmcache.pin_tokens": 600}), 700)
    assert first.pins == []  # 512 tokens pinned: their KV exists only after the second step
    (pin,) = second.pins
    assert (pin.req_id, len(pin.token_ids)) == ("a", 512)
    assert list(pin.token_ids) == list(range(100, 612))
    decode = half.build_connector_meta(cached_step(_request("a", 700, None), None, computed=700, scheduled=1))
    assert decode.pins == []
    assert metrics.value("request_hints", hint="pin") == 1


def test_bad_hints_are_counted_and_change_nothing():
    half = _half(extra_config={"max_pinned_fraction": 0.25})
    first, second = _run_prompt(half, _request("a", 700, {"lmcache.pin_tokens": "all", "lmcache.skip_save": 1,
                                                          "lmcache.tag.x": "y"}), 700)
    assert [s.num_tokens for s in first.saves + second.saves] == [256, 512] and second.pins == []
    for reason in ("bad_pin_tokens", "bad_skip_save", "unknown"):
        assert metrics.value("refused_request_hints", reason=reason) == 1
    off = _half()  # pins are off unless configured (issue 39)
    _run_prompt(off, _request("b", 700, {"lmcache.pin_tokens": 256}), 700)
    assert metrics.value("refused_request_hints", reason="pins_disabled") == 1


def test_max_pinned_fraction_is_checked():
    with pytest.raises(Exception, match="max_pinned_fraction"):
        load_config({"extra_config": {"max_pinned_fraction": 1.5}})
