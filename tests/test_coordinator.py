"""The fleet coordinator as users run it (`lmcache-vllm coordinator`, a child process) on a real redis-server, with
instances that register themselves (real engines and instance APIs, in this process, and child processes to
SIGKILL), sharing P2P over the same Redis: membership with leases, lookups that name the instance and tier, pins
refcounted fleet-wide, deletes that respect pins and make the P2P directory forget, relayed prefetches, moves (one
whose target or source dies fails and loses nothing), quotas pushed to every instance, a restart that loses nothing,
the token on every write, and the CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from management_helpers import (
    MODEL,
    TOKEN,
    ChildInstance,
    Coordinator,
    LocalInstance,
    call,
    start_instance,
    write_token,
)
from p2p_helpers import LISTED
from test_engine import CHUNK
from test_management_api import bad_bodies

from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.extra_keys import for_salt
from lmcache_vllm.integration.vllm.testing.openai_server import launcher
from lmcache_vllm.storage.p2p.directory import chunk_id, chunks_key
from lmcache_vllm.storage.redis.client import ClientSettings, sync_client

PROMPT = list(range(1000, 1000 + 3 * CHUNK + 5))
CHUNK_BYTES = 2 * 2 * CHUNK * 128 * 2


@pytest.fixture(scope="module")
def fleet(redis_server, tmp_path_factory) -> Iterator[dict[str, Any]]:
    redis_server.ensure_running()
    tmp = tmp_path_factory.mktemp("coordinator")
    prefix = f"test-coord-{uuid.uuid4().hex[:8]}:"
    token_file = write_token(tmp)
    state = {"url": redis_server.url, "prefix": prefix, "tmp": tmp, "token_file": token_file,
             "coordinator": Coordinator(redis_server.url, token_file, prefix, tmp / "coordinator.log",
                                        instance_timeout=3)}
    try:
        yield state
    finally:
        state["coordinator"].stop()  # the one running now (a test restarts it)


def p2p(fleet: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"enable_p2p": True, "p2p_host": "127.0.0.1",
            "max_local_cpu_size": 64 * CHUNK_BYTES / (1 << 30),
            "extra_config": {"p2p_directory_url": fleet["url"], "remote_key_prefix": fleet["prefix"],
                             "pd_peers": LISTED,  # without a MAC key, peers must be listed (loopback is nobody's)
                             "p2p_lookup_timeout_secs": 5.0, "p2p_pull_timeout_secs": 2.0,
                             "max_pinned_fraction": 0.5, "max_pinned_fraction_per_salt": 0.25, **extra}}


@pytest.fixture
def pair(fleet) -> Iterator[tuple[LocalInstance, LocalInstance]]:
    base = fleet["coordinator"].base
    a = start_instance(f"a-{uuid.uuid4().hex[:6]}", base, **p2p(fleet))
    b = start_instance(f"b-{uuid.uuid4().hex[:6]}", base, **p2p(fleet))
    try:
        assert a.agent.registered.wait(30) and b.agent.registered.wait(30)
        yield a, b
    finally:
        a.close()
        b.close()


def coord(fleet: dict[str, Any], method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
    return call(fleet["coordinator"].base, method, path, body, **kw)


def form(tokens: list[int] = PROMPT, salt: str = "", **more: Any) -> dict[str, Any]:
    return {"model_name": MODEL, "world_size": 1, "token_ids": tokens, "cache_salt": salt, **more}


def listed(fleet: dict[str, Any], inst: LocalInstance, keys: list[str]) -> list[bool]:
    """Whether the P2P directory lists each key under `inst`'s server."""
    tier = next(t for t in inst.engine.storage.lower if t.name == "p2p")
    client = sync_client(parse_remote_url(fleet["url"]), ClientSettings())
    try:
        return [bool(f) for f in client.smismember(chunks_key(tier.directory.prefix, tier.info.sid),
                                                   [chunk_id(k) for k in keys])]
    finally:
        client.close()


def wait(check, timeout: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_instances_register_heartbeat_and_go_when_their_lease_ends(fleet):
    inst = start_instance(f"lease-{uuid.uuid4().hex[:6]}", fleet["coordinator"].base)
    try:
        assert inst.agent.registered.wait(30)
        rows = {i["instance_id"]: i for i in coord(fleet, "GET", "/instances", token=None)[1]["instances"]}
        row = rows[inst.api.instance_id]
        assert (row["ip"], row["http_port"]) == ("127.0.0.1", inst.server.port)
        assert json.loads(row["metadata"]["lmcache_vllm_keyspace"])["chunk_size"] == CHUNK
        body = {"ip": "127.0.0.1", "http_port": inst.server.port, "instance_id": inst.api.instance_id,
                "metadata": row["metadata"]}
        status, got = coord(fleet, "POST", "/instances", body)
        assert status == 200 and got["re_registered"] and got["incarnation"] == inst.api.incarnation + 1
        assert coord(fleet, "PUT", "/instances/nobody/heartbeat")[0] == 404
        assert coord(fleet, "POST", "/instances", dict(body, instance_id="x y"))[0] == 400
        assert coord(fleet, "POST", "/instances", dict(body, instance_id="intruder"), token=None)[0] == 401
        assert "intruder" not in str(coord(fleet, "GET", "/instances")[1])
        inst.agent.close()  # no more heartbeats (and deregistered)
        inst.agent = None
        assert inst.api.instance_id not in str(coord(fleet, "GET", "/instances")[1])
        status, got = coord(fleet, "POST", "/instances", body)  # registered once more, then left to its lease
        assert status == 200
        wait(lambda: inst.api.instance_id not in str(coord(fleet, "GET", "/instances")[1]), 10, "the lease")
        for _ in range(2):
            status, got = coord(fleet, "DELETE", f"/instances/{inst.api.instance_id}")
            assert (status, got) == (204, None)
    finally:
        inst.close()


def test_a_lookup_through_the_coordinator_names_the_instance_and_tier_of_the_next_load(fleet, pair):
    a, b = pair
    a.store(PROMPT, salt="s")
    status, got = coord(fleet, "POST", "/directory/lookup", form(salt="s"), token=None)
    assert status == 200 and got["chunks"] == 3
    keys = a.engine.chunk_keys(PROMPT, for_salt("s"))
    assert [r["key"]["chunk_hash_hex"] for r in got["results"]] == [k.digest.hex() for k in keys]
    for result in got["results"]:
        assert [(p["instance_id"], p["tier"], p["backend"]) for p in result["placements"]] == \
            [(a.api.instance_id, "l1", "local_cpu")]  # not b: the directory's hint is not a placement of b
    assert a.engine.lookup(PROMPT, for_salt("s")) == 3 * CHUNK  # what A's next request loads
    wait(lambda: all(listed(fleet, a, [k.to_str() for k in keys])), what="a's listing")
    assert b.engine.lookup(PROMPT, for_salt("s")) == 3 * CHUNK  # B would pull it from A (P2P)...
    assert b.engine.lookup_tiers(PROMPT, for_salt("s"))[1] == ["p2p"] * 3  # ...which the lookup said
    status, again = coord(fleet, "POST", "/directory/lookup", {"keys": [r["key"] for r in got["results"]]})
    assert status == 200 and again["results"] == [dict(r, token_ids=[]) for r in got["results"]]
    assert coord(fleet, "POST", "/directory/lookup", form(model_name="nobody"))[0] == 404
    assert coord(fleet, "POST", "/directory/lookup", {"keys": [], "token_ids": []})[0] == 422
    stats = coord(fleet, "GET", "/directory/stats")[1]
    assert stats["l1_keys_by_instance"][a.api.instance_id] == 3
    keys_listing = coord(fleet, "GET", f"/directory/keys?instance_id={a.api.instance_id}")[1]
    assert {k["key"]["chunk_hash_hex"] for k in keys_listing["keys"]} == {k.digest.hex() for k in keys}
    usage = coord(fleet, "GET", f"/instances/{a.api.instance_id}/usage")[1]
    assert usage["modules"][0]["tier"] == "l1" and usage["modules"][0]["used_bytes"] == 3 * CHUNK_BYTES


def test_pins_are_refcounted_fleet_wide_and_a_refused_pin_is_undone_everywhere(fleet, pair):
    a, b = pair
    a.store(PROMPT)
    for count in (1, 2):
        status, got = coord(fleet, "POST", "/cache/pins", form())
        assert (status, got["requested"], got["affected"]) == (200, 3, 3)
        assert got["instances"][a.api.instance_id]["pin_count"] == count
    pins = coord(fleet, "GET", f"/cache/pins?model_name={MODEL}")[1]
    assert pins["total"] == 3 and {p["pin_count"] for p in pins["pins"]} == {2}
    assert [e.count for e in a.ledger.entries()] == [2] and len(b.ledger) == 0  # b holds none of it
    for _ in range(2):
        assert coord(fleet, "DELETE", "/cache/pins", form())[0] == 200
    assert coord(fleet, "GET", "/cache/pins")[1]["total"] == 0 and len(a.ledger) == 0
    big = list(range(70_000, 70_000 + 17 * CHUNK))  # a quarter of a's L1 is 16 chunks: past the salt's budget
    a.store(big, salt="t")
    b.store(big[:2 * CHUNK], salt="t")
    status, got = coord(fleet, "POST", "/cache/pins", form(big, salt="t"))
    assert status == 409 and a.api.instance_id in got["detail"] and "budget" in got["detail"]
    assert len(b.ledger) == 0 and coord(fleet, "GET", "/cache/pins")[1]["total"] == 0  # undone on b too


def test_a_delete_keeps_pinned_keys_unless_forced_and_the_directory_forgets_them(fleet, pair):
    a, b = pair
    a.store(PROMPT)
    keys = [k.to_str() for k in a.engine.chunk_keys(PROMPT)]
    wait(lambda: all(listed(fleet, a, keys)), what="the P2P listing")
    delete = form(instance_id=a.api.instance_id, tier="all")
    assert coord(fleet, "POST", "/cache/delete", dict(delete, instance_id="nobody", token_ids=[]))[0] == 404
    coord(fleet, "POST", "/cache/pins", form())
    status, got = coord(fleet, "POST", "/cache/delete", delete)
    assert (status, got["affected"], got["skipped"], got["status"]) == (200, 0, 3, "deleted")
    assert a.engine.lookup(PROMPT) == 3 * CHUNK
    status, got = coord(fleet, "POST", "/cache/delete", dict(delete, force=True))
    assert (status, got["affected"], got["skipped"]) == (200, 3, 0)
    assert a.engine.lookup(PROMPT) == 0 and len(a.ledger) == 0
    assert coord(fleet, "GET", "/cache/pins")[1]["total"] == 0
    wait(lambda: not any(listed(fleet, a, keys)), what="the directory to forget the keys")
    assert b.engine.lookup(PROMPT) == 0  # no instance finds it any more
    lookup = coord(fleet, "POST", "/directory/lookup", form())[1]
    assert all(r["placements"] == [] for r in lookup["results"])
    noop = coord(fleet, "POST", "/cache/delete", dict(delete, token_ids=PROMPT[:3]))[1]
    assert noop["status"] == "noop" and noop["requested"] == 0


def test_a_prefetch_is_relayed_and_a_move_leaves_the_prompt_at_the_target_only(fleet, pair):
    a, b = pair
    a.store(PROMPT)
    wait(lambda: all(listed(fleet, a, [k.to_str() for k in a.engine.chunk_keys(PROMPT)])), what="a's listing")
    status, got = coord(fleet, "POST", "/cache/prefetches", form(instance_id=b.api.instance_id))
    assert status == 200 and got["status"] == "submitted" and got["instance_id"] == b.api.instance_id
    path = f"/cache/prefetches/{b.api.instance_id}/{got['request_id']}"
    done = wait(lambda: (r := coord(fleet, "GET", path)[1]).get("status") == "completed" and r, what="prefetch")
    assert (done["found_keys"], done["total_keys"]) == (3, 3)  # pulled from a's L1, kept in b's
    assert coord(fleet, "GET", path)[0] == 404
    assert b.engine.lookup_tiers(PROMPT)[1] == ["local_cpu"] * 3
    other = list(range(40_000, 40_000 + 2 * CHUNK))
    a.store(other)
    wait(lambda: all(listed(fleet, a, [k.to_str() for k in a.engine.chunk_keys(other)])), what="a's listing")
    status, got = coord(fleet, "POST", "/cache/moves", form(other, source_instance_id=a.api.instance_id,
                                                           target_instance_id=b.api.instance_id))
    assert status == 200 and got["status"] == "submitted" and got["requested"] == 2
    state = wait(lambda: (r := coord(fleet, "GET", f"/cache/moves/{got['move_id']}")[1])["status"] != "pending"
                 and r, what="the move")
    assert (state["status"], state["phase"], state["loaded"], state["missing"], state["deleted"]) == \
        ("completed", "delete", 2, 0, 2), state
    assert b.engine.lookup_tiers(other)[1] == ["local_cpu"] * 2 and a.engine.storage.l1.tenants.usage() == \
        {"": 3 * CHUNK_BYTES}  # a let go of the moved prompt only
    keys = [k.to_str() for k in b.engine.chunk_keys(other)]
    wait(lambda: all(listed(fleet, b, keys)) and not any(listed(fleet, a, keys)), what="the listing to move")
    for bad, code in ((dict(source_instance_id=a.api.instance_id, target_instance_id=a.api.instance_id), 400),
                      (dict(source_instance_id=a.api.instance_id, target_instance_id="nobody"), 404),
                      (dict(source_instance_id=a.api.instance_id, target_instance_id=b.api.instance_id,
                            keep_soruce=True), 422)):
        assert coord(fleet, "POST", "/cache/moves", form(other, **bad))[0] == code
    assert coord(fleet, "GET", "/cache/moves/0123abcd")[0] == 404


@pytest.mark.parametrize("dies", ["target", "source"])
def test_a_move_whose_target_or_source_dies_fails_loses_nothing_and_holds_nothing(fleet, dies):
    base, tmp = fleet["coordinator"].base, fleet["tmp"]
    tag = uuid.uuid4().hex[:6]
    source = ChildInstance(f"src-{tag}", base, p2p(fleet), [(1000, 2 * CHUNK)], tmp / f"src-{tag}.log")
    target = ChildInstance(f"dst-{tag}", base, p2p(fleet), [], tmp / f"dst-{tag}.log")
    prompt = list(range(1000, 1000 + 2 * CHUNK))
    try:
        if dies == "target":
            target.kill()  # still registered (its lease has not run out), gone
        else:
            os.kill(source.proc.pid, signal.SIGSTOP)  # listed and registered, answers nothing: the pull times out
        status, got = coord(fleet, "POST", "/cache/moves", form(prompt, source_instance_id=source.instance_id,
                                                               target_instance_id=target.instance_id))
        assert status == 200, got
        state = wait(lambda: (r := coord(fleet, "GET", f"/cache/moves/{got['move_id']}")[1])["status"]
                     != "pending" and r, 30, "the move")
        assert (state["status"], state["phase"], state["deleted"]) == ("failed", "load", 0), state
        if dies == "target":
            lookup = coord(fleet, "POST", "/directory/lookup", form(prompt))[1]
            assert all([p["instance_id"] for p in r["placements"]] == [source.instance_id]
                       for r in lookup["results"])  # nothing lost at the source
            assert call(source.base, "GET", "/status")[1]["storage_manager"]["l1"]["held_chunks"] == 0
        else:
            source.kill()
            status = call(target.base, "GET", "/status")[1]["storage_manager"]["l1"]
            assert (status["chunks"], status["held_chunks"]) == (0, 0)  # nothing half-moved, nothing held
    finally:
        if source.proc.poll() is None:
            os.kill(source.proc.pid, signal.SIGCONT)
        source.kill()
        target.kill()


def test_quotas_live_in_redis_and_are_set_on_every_instance_also_one_that_joins_later(fleet, pair):
    a, b = pair
    gib = CHUNK_BYTES / (1 << 30)
    status, got = coord(fleet, "PUT", "/quota/q", {"limit_gb": gib, "tier": "l1"})
    assert status == 200 and set(got["instances"]) >= {a.api.instance_id, b.api.instance_id}
    a.store(PROMPT, salt="q")
    wait(lambda: a.engine.storage.l1.tenants.usage()["q"] <= CHUNK_BYTES, what="a to enforce it on its L1")
    late = start_instance(f"late-{uuid.uuid4().hex[:6]}", fleet["coordinator"].base)
    try:
        wait(lambda: late.engine.storage.l1.tenants.limits().get("q") is not None, what="the quota push")
    finally:
        late.close()
    got = coord(fleet, "GET", "/quota/q?tier=l1")[1]
    assert got["quota_exists"] and got["quota_limit_gb"] == gib and 0 < got["usage_gb"] <= 2 * gib
    assert any(r["cache_salt"] == "q" for r in coord(fleet, "GET", "/quota")[1]["by_cache_salt"])
    assert coord(fleet, "GET", "/quota?tier=all")[0] == 400
    assert coord(fleet, "PUT", "/quota/q", {"limit_gb": 1.0, "tier": "l2"})[0] == 400
    assert coord(fleet, "PUT", "/quota/config", {"default_limit_gb": 1.0})[0] == 501
    assert coord(fleet, "PUT", "/quota/q", {"limit_gb": -1.0})[0] == 422
    assert coord(fleet, "DELETE", "/quota/q")[1]["status"] == "removed"
    assert coord(fleet, "DELETE", "/quota/q")[1]["status"] == "not_found"
    assert a.engine.storage.l1.tenants.limits().get("q") is None


def test_writes_without_the_token_change_nothing_and_a_restart_loses_nothing(fleet, pair):
    a, b = pair
    a.store(PROMPT)
    assert coord(fleet, "POST", "/cache/pins", form())[0] == 200
    assert coord(fleet, "PUT", "/quota/r", {"limit_gb": 1.0})[0] == 200

    def snapshot() -> Any:
        return (coord(fleet, "GET", "/cache/pins")[1], coord(fleet, "GET", "/quota")[1]["by_cache_salt"],
                {a.api.instance_id, b.api.instance_id} <= {i["instance_id"] for i in
                                                            coord(fleet, "GET", "/instances")[1]["instances"]},
                a.engine.lookup(PROMPT), len(a.ledger))

    before = snapshot()
    writes = [("POST", "/cache/pins", form()), ("DELETE", "/cache/pins", form()),
              ("POST", "/cache/delete", form(instance_id=a.api.instance_id, force=True)),
              ("POST", "/cache/moves", form(source_instance_id=a.api.instance_id,
                                            target_instance_id=b.api.instance_id)),
              ("POST", "/cache/prefetches", form(instance_id=b.api.instance_id)),
              ("PUT", "/quota/r", {"limit_gb": 0.0}), ("DELETE", "/quota/r", None),
              ("DELETE", f"/instances/{a.api.instance_id}", None),
              ("POST", "/instances", {"ip": "x", "http_port": 1})]
    for method, path, body in writes:
        assert coord(fleet, method, path, body, token=None)[0] == 401, path
        assert coord(fleet, method, path, body, token="wrong-" + TOKEN)[0] == 403, path
    assert snapshot() == before
    old = fleet["coordinator"]
    old.stop(signal.SIGKILL)
    fresh = Coordinator(fleet["url"], fleet["token_file"], fleet["prefix"], fleet["tmp"] / "coordinator2.log",
                        port=old.port, instance_timeout=3)  # the same address: the instances' agents find it
    fleet["coordinator"] = fresh  # the module's later tests use the restarted one
    assert snapshot()[:2] == before[:2]  # pins and quotas: from Redis
    wait(lambda: snapshot()[2], what="the instances' agents to find the coordinator again")
    assert coord(fleet, "DELETE", "/cache/pins", form())[0] == 200
    assert coord(fleet, "DELETE", "/quota/r")[0] == 200


def test_the_cli_looks_up_pins_and_deletes_through_the_coordinator(fleet, pair):
    a, _ = pair
    a.store(PROMPT, salt="cli")
    ids = ",".join(map(str, PROMPT))
    common = ["--coordinator", fleet["coordinator"].base, "--model", MODEL, "--token-ids", ids, "--salt", "cli"]
    env = dict(os.environ)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*launcher(), "cache", *args], capture_output=True, text=True, timeout=120, env=env)

    out = cli("lookup", *common)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(f"{a.api.instance_id}:l1/local_cpu") == 3 and "3 chunk(s)" in out.stdout
    out = cli("lookup", *common, "--json")
    assert [r["placements"][0]["tier"] for r in json.loads(out.stdout)["results"]] == ["l1"] * 3
    out = cli("pin", *common)
    assert out.returncode == 1 and "401" in out.stderr  # a write without the token
    out = cli("pin", *common, "--token-file", str(fleet["token_file"]), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["affected"] == 3
    out = cli("delete", *common, "--token-file", str(fleet["token_file"]), "--instance", a.api.instance_id,
              "--force")
    assert out.returncode == 0 and "affected" in out.stdout and a.engine.lookup(PROMPT, for_salt("cli")) == 0
    assert cli("move", *common, "--instance", a.api.instance_id).returncode == 1  # no --to
    assert cli("lookup", "--model", MODEL).returncode == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bad_bodies(), route=st.sampled_from([("POST", "/cache/pins"), ("DELETE", "/cache/pins"),
                                                  ("POST", "/cache/delete"), ("POST", "/cache/moves"),
                                                  ("POST", "/cache/prefetches"), ("POST", "/directory/lookup"),
                                                  ("POST", "/instances"), ("PUT", "/quota/z")]))
def test_what_others_can_send_the_coordinator_gets_a_4xx_and_changes_nothing(fleet, body, route):
    def snapshot() -> Any:
        return (coord(fleet, "GET", "/cache/pins")[1], coord(fleet, "GET", "/quota")[1]["by_cache_salt"],
                {i["instance_id"] for i in coord(fleet, "GET", "/instances")[1]["instances"]})

    before = snapshot()
    method, path = route
    status, got = coord(fleet, method, path, raw=body[1]) if isinstance(body, tuple) else \
        coord(fleet, method, path, body)
    assert 400 <= status < 500, (body, status, got)
    after = snapshot()
    assert after[:2] == before[:2] and after[2] <= before[2]  # (an instance of an earlier test may leave)
