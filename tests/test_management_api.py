"""An instance's management API (`management/instance.py`) over real HTTP, in front of a real engine (L1 and a disk
directory, plain tensors in vLLM's CPU paged layout): LMCache's paths, fields, units and codes; token ids resolved
to exactly the keys a request loads; deletes that respect pins unless forced and emit removals per tier; pins
refcounted and capped with a clear 409; prefetches from the disk read once; quotas that evict within their
tenant; and what others can send — no token, a wrong token, bad JSON, unknown fields, bad salts, huge arrays —
answered 4xx with nothing changed (fuzzed)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from management_helpers import MODEL, TOKEN, LocalInstance, call, start_instance
from test_engine import CHUNK

from lmcache_vllm.extra_keys import for_salt
from lmcache_vllm.management.keys import pack_rank
from lmcache_vllm.management.schemas import MAX_BODY_BYTES
from lmcache_vllm.observability import kv_events, metrics

PROMPT = list(range(1000, 1000 + 3 * CHUNK + 7))  # three whole chunks and a tail
CHUNK_BYTES = 2 * 2 * CHUNK * 128 * 2
L1_CHUNKS = 32


@pytest.fixture
def inst(tmp_path: Path) -> Iterator[LocalInstance]:
    instance = start_instance(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1,
                              max_local_cpu_size=L1_CHUNKS * CHUNK_BYTES / (1 << 30),
                              extra_config={"max_pinned_fraction": 0.5, "max_pinned_fraction_per_salt": 0.25})
    try:
        yield instance
    finally:
        instance.close()


def form(tokens: list[int] = PROMPT, salt: str = "", **more: Any) -> dict[str, Any]:
    return {"model_name": MODEL, "world_size": 1, "token_ids": tokens, "cache_salt": salt, **more}


def state(inst: LocalInstance) -> tuple[Any, ...]:
    """What a call could change: L1's keys, the disk's, the pins, the quotas."""
    l1 = inst.engine.storage.l1
    disk = next(t for t in inst.engine.storage.lower if t.name == "local_disk")
    return (sorted(l1.keys_page(0, 1 << 20)[1]), disk.gauges().get("resident_chunks"),
            [(e.tenant, e.name, e.count) for e in inst.ledger.entries()], l1.tenants.limits())


def wait_prefetch(inst: LocalInstance, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        status, got = call(inst.base, "GET", f"/cache/prefetches/{request_id}")
        assert status == 200, got
        if got["status"] == "completed":
            return got
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_health_and_status_need_no_token_from_loopback_but_refuse_a_wrong_one(inst):
    assert call(inst.base, "GET", "/healthcheck", token=None) == (200, {"status": "healthy"})
    assert call(inst.base, "GET", "/api/healthcheck", token=None)[0] == 200
    assert call(inst.base, "GET", "/", token=None)[1]["status"] == "ok"
    status, got = call(inst.base, "GET", "/status", token=None)
    assert status == 200 and got["is_healthy"] and got["chunk_size"] == CHUNK
    assert got["model_names"][0] == MODEL and got["world_size"] == 1
    assert TOKEN not in json.dumps(got)
    assert call(inst.base, "GET", "/status", token="wrong-" + TOKEN)[0] == 403


def test_lookup_names_each_chunks_tiers_and_predicts_the_next_load(inst):
    assert inst.store(PROMPT, salt="s") == 3 * CHUNK
    first_key = inst.engine.chunk_keys(PROMPT, for_salt("s"))[2].to_str()
    inst.engine.storage.l1.remove_sync(first_key)  # the third chunk: on disk only now
    status, got = call(inst.base, "POST", "/cache/lookup", form(salt="s"), token=None)
    assert status == 200 and got["chunks"] == 3
    tiers = [[(p["tier"], p["backend"]) for p in r["placements"]] for r in got["results"]]
    assert tiers == [[("l1", "local_cpu"), ("l2", "local_disk")]] * 2 + [[("l2", "local_disk")]]
    assert [r["token_ids"] for r in got["results"]] == [PROMPT[i * CHUNK:(i + 1) * CHUNK] for i in range(3)]
    keys = inst.engine.chunk_keys(PROMPT, for_salt("s"))  # the engine's own keys: what a request loads
    assert [r["key"]["chunk_hash_hex"] for r in got["results"]] == [k.digest.hex() for k in keys]
    assert {r["key"]["kv_rank"] for r in got["results"]} == {pack_rank(1, 0)}
    assert inst.engine.lookup_tiers(PROMPT, for_salt("s"))[1] == ["local_cpu", "local_cpu", "local_disk"]
    assert got["results"][0]["placements"][0]["size_bytes"] == CHUNK_BYTES
    # another salt is another tenant's prefix: nothing of it is cached
    other = call(inst.base, "POST", "/cache/lookup", form(salt="t"))[1]
    assert all(r["placements"] == [] for r in other["results"])
    # the keys form, with keys the tokens form answered
    status, again = call(inst.base, "POST", "/cache/lookup", {"keys": [r["key"] for r in got["results"]]})
    assert status == 200 and again["results"][2]["placements"] == got["results"][2]["placements"]


def test_a_delete_skips_pinned_chunks_unless_forced_and_emits_removals_per_tier(inst):
    kv_events.RECORDER.enabled = True
    inst.store(PROMPT)
    keys = [r["key"] for r in call(inst.base, "POST", "/cache/lookup", form())[1]["results"]]
    assert call(inst.base, "POST", "/cache/pins", form(PROMPT[:2 * CHUNK]))[0] == 200
    kv_events.RECORDER.take()
    status, got = call(inst.base, "DELETE", "/cache/objects", {"keys": keys, "tier": "l1"})
    assert (status, got) == (200, {"deleted": 1, "skipped": 2, "ok": True})  # the pinned two stay
    assert call(inst.base, "POST", "/cache/lookup", form())[1]["results"][2]["placements"][0]["tier"] == "l2"
    status, got = call(inst.base, "DELETE", "/cache/objects", {"keys": keys, "tier": "all", "force": True})
    assert (status, got["deleted"], got["skipped"]) == (200, 5, 0)  # 2 from L1, 3 from the disk
    assert len(inst.ledger) == 0 and metrics.value("pins_released", reason="dropped") == 1
    lookup = call(inst.base, "POST", "/cache/lookup", form())[1]
    assert all(r["placements"] == [] for r in lookup["results"])
    removed = [(e.tier, e.digest.hex()) for e in kv_events.RECORDER.take() if not e.stored]
    digests = [k["chunk_hash_hex"] for k in keys]
    assert sorted(removed) == sorted([("local_cpu", d) for d in digests] + [("local_disk", d) for d in digests])
    assert call(inst.base, "DELETE", "/cache/objects", {"keys": keys, "tier": "all"})[1]["deleted"] == 0


def test_pins_are_refcounted_listed_and_a_budget_refusal_is_a_clear_409(inst):
    inst.store(PROMPT)
    for count in (1, 2):
        status, got = call(inst.base, "POST", "/cache/pins", form())
        assert (status, got["requested"], got["affected"], got["pin_count"]) == (200, 3, 3, count)
    listing = call(inst.base, "GET", "/cache/pins", token=None)[1]
    assert listing["total"] == 3 and {p["pin_count"] for p in listing["pins"]} == {2}
    assert call(inst.base, "DELETE", "/cache/pins", form())[1]["pin_count"] == 1
    assert call(inst.base, "DELETE", "/cache/pins", form())[1]["pin_count"] == 0
    assert call(inst.base, "GET", "/cache/pins")[1] == {"total": 0, "pins": []}
    # tenant "big" may pin a quarter of L1; a prompt larger than that is refused, with the reason
    budget_chunks = int(0.25 * inst.engine.config.max_local_cpu_bytes) // CHUNK_BYTES
    big = list(range(50_000, 50_000 + (budget_chunks + 1) * CHUNK))
    inst.store(big, salt="big")
    status, got = call(inst.base, "POST", "/cache/pins", form(big, salt="big"))
    assert status == 409 and "cache_salt 'big'" in got["detail"] and "budget" in got["detail"]
    assert len(inst.ledger) == 0
    # a prompt not cached: nothing pinned, said so
    status, got = call(inst.base, "POST", "/cache/pins", form(list(range(7, 7 + CHUNK))))
    assert (status, got["affected"], got["missing"]) == (200, 0, 1)


def test_pins_are_off_unless_configured(tmp_path):
    off = start_instance()
    try:
        off.store(PROMPT)
        status, got = call(off.base, "POST", "/cache/pins", form())
        assert status == 409 and "max_pinned_fraction" in got["detail"]
    finally:
        off.close()


def test_a_prefetch_warms_l1_from_the_disk_and_its_result_is_read_once(inst):
    inst.store(PROMPT)
    assert call(inst.base, "POST", "/cache/clear", {"tier": "l1"}) == (200, {"status": "ok",
                                                                              "cleared": {"tier": "l1"}})
    assert inst.engine.lookup_tiers(PROMPT)[1] == ["local_disk"] * 3
    status, got = call(inst.base, "POST", "/cache/prefetches", form())
    assert status == 202 and got["chunks"] == 3 and got["status"] == "submitted"
    done = wait_prefetch(inst, got["request_id"])
    assert (done["found_keys"], done["total_keys"], done["missing_key_indices"]) == (3, 3, [])
    assert call(inst.base, "GET", f"/cache/prefetches/{got['request_id']}")[0] == 404
    assert inst.engine.lookup_tiers(PROMPT)[1] == ["local_cpu"] * 3
    # already in L1: nothing loaded, every key "missing" (LMCache counts only what this request loaded)
    again = wait_prefetch(inst, call(inst.base, "POST", "/cache/prefetches", form())[1]["request_id"])
    assert (again["found_keys"], again["missing_key_indices"]) == (0, [0, 1, 2])
    assert call(inst.base, "POST", "/cache/prefetches", form(PROMPT[:5])) == (200, {"chunks": 0, "status": "noop"})
    assert call(inst.base, "POST", "/cache/prefetches", form(model_name="other"))[0] == 409
    assert call(inst.base, "POST", "/cache/prefetches", form(source_tier="l1"))[0] == 400


def test_quotas_evict_within_their_tenant_only(inst):
    a = list(range(1000, 1000 + 3 * CHUNK))
    b = list(range(9000, 9000 + 3 * CHUNK))
    inst.store(a, salt="a")
    inst.store(b)
    gib = CHUNK_BYTES / (1 << 30)
    status, got = call(inst.base, "PUT", "/quota/a", {"limit_gb": gib})
    assert (status, got) == (200, {"cache_salt": "a", "limit_gb": gib, "status": "ok"})
    assert inst.engine.lookup_tiers(b)[1] == ["local_cpu"] * 3  # the other tenant: untouched
    usage = inst.engine.storage.l1.tenants.usage()
    assert usage["a"] <= CHUNK_BYTES and usage[""] == 3 * CHUNK_BYTES
    got = call(inst.base, "GET", "/quota/a", token=None)[1]
    assert got["exists"] and got["cache_salt"] == "a" and got["current_usage_gb"] <= gib
    assert call(inst.base, "PUT", "/quota/_default", {"limit_gb": 10.0})[1]["cache_salt"] == "_default"
    assert set(call(inst.base, "GET", "/quota")[1]["users"]) == {"a", "_default"}
    assert call(inst.base, "DELETE", "/quota/a")[1] == {"cache_salt": "a", "status": "removed"}
    assert call(inst.base, "DELETE", "/quota/a")[1]["status"] == "not_found"
    assert call(inst.base, "GET", "/quota/a")[1]["exists"] is False
    assert call(inst.base, "PUT", "/quota/a", {"limit_gb": -1})[0] == 422
    assert call(inst.base, "PUT", "/quota/bad@salt", {"limit_gb": 1})[0] == 400


def test_clear_of_every_tier_and_the_l1_listing(inst):
    inst.store(PROMPT)
    status, got = call(inst.base, "GET", "/cache/objects?page_size=2")
    assert status == 200 and len(got["entries"]) == 2 and got["next_page_token"] == "2"
    rest = call(inst.base, "GET", "/cache/objects?page_size=2&page_token=2")[1]
    assert len(rest["entries"]) == 1 and rest["next_page_token"] is None
    assert call(inst.base, "GET", "/cache/objects?tier=l2")[0] == 501
    assert call(inst.base, "POST", "/cache/clear", {"tier": "l2"})[0] == 400
    assert call(inst.base, "POST", "/cache/clear", {"tier": "all"})[0] == 200
    assert inst.engine.lookup(PROMPT) == 0


WRITES = [("POST", "/cache/clear", {"tier": "all"}), ("POST", "/clear-cache", None),
          ("DELETE", "/cache/objects", None), ("POST", "/cache/prefetches", form()),
          ("POST", "/cache/pins", form()), ("DELETE", "/cache/pins", form()),
          ("PUT", "/quota/_default", {"limit_gb": 0.0}), ("DELETE", "/quota/x", None)]


@pytest.mark.parametrize("method, path, body", WRITES)
def test_a_write_without_the_token_changes_nothing(inst, method, path, body):
    inst.store(PROMPT)
    call(inst.base, "POST", "/cache/pins", form(PROMPT[:CHUNK]))
    call(inst.base, "PUT", "/quota/x", {"limit_gb": 1.0})
    if body is None and path == "/cache/objects":
        body = {"keys": [r["key"] for r in call(inst.base, "POST", "/cache/lookup", form())[1]["results"]],
                "tier": "all", "force": True}
    before = state(inst)
    for token, headers, code in ((None, None, 401), ("wrong-" + TOKEN, None, 403),
                                 (None, {"Authorization": f"Basic {TOKEN}"}, 401),
                                 (None, {"Authorization": "Bearer"}, 401),
                                 (TOKEN[:-1] + "\u00e9", None, 403)):
        status, got = call(inst.base, method, path, body, token=None if headers else token, headers=headers)
        assert status == code, (path, got)
        assert TOKEN not in json.dumps(got)
    assert state(inst) == before
    template = path.replace("/x", "/{salt}").replace("/_default", "/{salt}")
    assert metrics.value("management_requests", route=f"{method} {template}", code="401") >= 3


def bad_bodies() -> st.SearchStrategy[Any]:
    good = form(PROMPT)
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                            max_size=4),
                               max_leaves=10)
    bad_salts = st.sampled_from(["a/b", "a\0b", "bad@salt", "\\", "x" * 129, "ok/../x"])
    return st.one_of(
        json_values.filter(lambda v: not isinstance(v, dict) or set(v) - set(good)),
        st.builds(lambda salt: dict(good, cache_salt=salt), bad_salts),
        st.builds(lambda k, v: dict(good, **{k: v}), st.text(min_size=1).filter(lambda k: k not in good), json_values),
        st.builds(lambda t: dict(good, token_ids=t), st.lists(st.one_of(
            st.integers(max_value=-1), st.integers(min_value=1 << 63), st.floats(), st.booleans(), st.text()),
            min_size=1, max_size=3)),
        st.builds(lambda ws: dict(good, world_size=ws), st.one_of(st.integers(max_value=0), st.just("1"),
                                                                   st.integers(min_value=257))),
        st.builds(lambda name: dict(good, model_name=name), st.sampled_from(["a@b", "", "x" * 300])),
        st.binary(max_size=64).map(lambda b: ("raw", b)),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bad_bodies(), route=st.sampled_from([("POST", "/cache/pins"), ("DELETE", "/cache/pins"),
                                                   ("POST", "/cache/prefetches"), ("POST", "/cache/lookup"),
                                                   ("DELETE", "/cache/objects"), ("POST", "/cache/clear"),
                                                   ("PUT", "/quota/t")]))
def test_what_others_can_send_gets_a_4xx_and_changes_nothing(inst, body, route):
    if not inst.engine.lookup(PROMPT):
        inst.store(PROMPT)
        call(inst.base, "POST", "/cache/pins", form(PROMPT[:CHUNK]))
    before = state(inst)
    method, path = route
    if isinstance(body, tuple):
        status, got = call(inst.base, method, path, raw=body[1])
    else:
        status, got = call(inst.base, method, path, body)
    if path == "/cache/clear" and status == 200:
        return  # {} is a valid clear (its defaults): not a bad body
    assert 400 <= status < 500, (body, status, got)
    assert state(inst) == before


def test_huge_bodies_and_arrays_are_refused_before_anything_changes(inst):
    inst.store(PROMPT)
    before = state(inst)
    status, got = call(inst.base, "POST", "/cache/pins", raw=b"[" + b"1," * (MAX_BODY_BYTES // 2) + b"1]")
    assert status == 413
    key = call(inst.base, "POST", "/cache/lookup", form())[1]["results"][0]["key"]
    status, got = call(inst.base, "DELETE", "/cache/objects", {"keys": [key] * 10_001, "tier": "all"})
    assert status == 400 and "10000" in got["detail"]
    status, got = call(inst.base, "POST", "/cache/pins", raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 422
    assert state(inst) == before
    status, got = call(inst.base, "POST", "/cache/pins", form(list(range(1_000_001))))
    assert status == 400 and "1000000" in got["detail"]
    assert state(inst) == before


# ---------------------------------------------------------------------------------------- configuration, token
def test_the_management_keys_are_checked_together_at_start(tmp_path):
    from lmcache_vllm.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config({"extra_config": {"management_port": 8300, "coordinator_url": "http://c:9300/x?y"}})
    assert refused.value.keys == {"extra_config.management_token_file", "extra_config.coordinator_url"}
    with pytest.raises(ConfigError, match="needs extra_config.management_port"):
        load_config({"extra_config": {"coordinator_url": "http://127.0.0.1:9300"}})
    with pytest.raises(ConfigError, match="management_port"):
        load_config({"extra_config": {"management_port": 70000}})
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = load_config({"extra_config": {"management_port": 8300, "management_token_file": str(token),
                                           "coordinator_url": "http://127.0.0.1:9300"}})
    assert TOKEN not in repr(config) and TOKEN not in config.summary()


def test_the_token_file_is_read_checked_and_compared_as_bytes(tmp_path, caplog):
    from lmcache_vllm.config.redact import redact_text
    from lmcache_vllm.management import auth

    path = tmp_path / "token"
    for bad in ("short", "two words here!!", "x" * 5000, ""):
        path.write_text(bad)
        with pytest.raises(ValueError, match="token"):
            auth.read_token(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        auth.read_token(str(tmp_path / "missing"))
    path.write_text(TOKEN + "\nsecond line ignored\n")
    path.chmod(0o644)
    assert auth.read_token(str(path)) == TOKEN.encode()
    assert "can be read by other users" in caplog.text and TOKEN not in caplog.text
    assert redact_text(f"a message with {TOKEN} in it") == "a message with *** in it"
    token = TOKEN.encode()
    auth.check(f"Bearer {TOKEN}", token, write=True, peer="10.0.0.1")
    auth.check(None, token, write=False, peer="127.0.0.1")
    auth.check(None, token, write=False, peer="::ffff:127.0.0.2")
    for header, peer, write, status in ((None, "10.0.0.1", False, 401), (None, "127.0.0.1", True, 401),
                                        (f"Basic {TOKEN}", "127.0.0.1", True, 401),
                                        ("Bearer \udcff\u00e9", "127.0.0.1", True, 403),
                                        (f"Bearer {TOKEN}x", "127.0.0.1", False, 403), (None, None, False, 401)):
        with pytest.raises(auth.AuthError) as refused:
            auth.check(header, token, write=write, peer=peer)
        assert refused.value.status == status


def test_l1s_compressed_cold_part_is_l1_to_lookups_and_deletes(tmp_path):
    cold = start_instance(max_local_cpu_size=L1_CHUNKS * CHUNK_BYTES / (1 << 30),
                          extra_config={"local_cpu_cold_fraction": 0.5})
    try:
        cold.store(PROMPT)
        for n in range(6):  # the arena holds 16 chunks: these push the prompt's out, into the cold part
            cold.store(list(range(20_000 + n * 1000, 20_000 + n * 1000 + 3 * CHUNK)))
        deadline = time.monotonic() + 30
        while True:
            got = call(cold.base, "POST", "/cache/lookup", form())[1]
            backends = [[p["backend"] for p in r["placements"]] for r in got["results"]]
            if backends == [["local_cpu_cold"]] * 3:
                break
            assert time.monotonic() < deadline, backends
            time.sleep(0.1)
        assert {p["tier"] for r in got["results"] for p in r["placements"]} == {"l1"}
        keys = [r["key"] for r in got["results"]]
        status, deleted = call(cold.base, "DELETE", "/cache/objects", {"keys": keys, "tier": "l1"})
        assert (status, deleted["deleted"]) == (200, 3)
        assert all(r["placements"] == [] for r in call(cold.base, "POST", "/cache/lookup", form())[1]["results"])
    finally:
        cold.close()
