"""kv_transfer_params come from clients of the decode instance D (vLLM's API server copies them from any
request body): every field is checked before use, D connects only to prefill instances it trusts (signed
params with a chunk MAC key; else loopback or `extra_config.pd_peers`, names resolved within a bound), sends
nothing (not even a RELEASE) to anything else, and keeps the KV of an unlisted loopback peer out of the shared
tiers (issue 30 #1, #2, #10, #11)."""
from __future__ import annotations

import logging
import threading
import time

import pytest

pytest.importorskip("vllm")

from test_integration_pd import S_BLOCK, S_CHUNK, finish, pd_request, remote_params  # noqa: E402
from test_integration_scheduler import PrefixStore, new_step, vllm_blocks  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import PeerSpec  # noqa: E402
from lmcache_vllm.integration.vllm.pd.params import PDRefusal, parse_remote_prefill, prefill_params  # noqa: E402
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler  # noqa: E402
from lmcache_vllm.integration.vllm.pd.trust import PeerTrust, Resolver, host_warnings  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.storage.codec import ChunkMac  # noqa: E402


def half_with(trust: PeerTrust | None = None, *, grouped: bool = False, **config) -> SchedulerHalf:
    kwargs = {} if trust is None else {"trust": trust}
    if grouped:
        kwargs["grouped"] = True
    pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=1, ask_ports=lambda: [9000],
                     can_load=True, can_save=True, **kwargs)
    return SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK, **config), block_size=S_BLOCK,
                         lookup_client=PrefixStore(0), can_load=True, can_save=True, pd=pd)


def params_at(host: str, **changes) -> dict:
    params = dict(remote_params(), remote_host=host)
    params.update(changes)
    return params


def releases_after_finish(half: SchedulerHalf, req) -> list[PeerSpec]:
    finish(half, req, RequestStatus.FINISHED_ABORTED)
    return half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases


# ---------------------------------------------------------------- every field checked
BAD_FIELDS = {
    "crlf_request_id": {"remote_request_id": "p-req\r\nSET x 1"},
    "space_request_id": {"remote_request_id": "p req"},
    "control_request_id": {"remote_request_id": "p\x1b[2Jreq"},
    "unicode_request_id": {"remote_request_id": "p\u2028req"},
    "long_request_id": {"remote_request_id": "r" * 257},
    "empty_request_id": {"remote_request_id": ""},
    "int_request_id": {"remote_request_id": 7},
    "host_with_port": {"remote_host": "127.0.0.1:6379"},
    "host_with_path": {"remote_host": "127.0.0.1/x"},
    "host_with_space": {"remote_host": "127.0.0.1 "},
    "host_in_brackets": {"remote_host": "[::1]"},
    "host_with_zone": {"remote_host": "fe80::1%lo"},
    "host_with_user": {"remote_host": "u@127.0.0.1"},
    "host_empty_label": {"remote_host": "a..b"},
    "host_crlf": {"remote_host": "h\r\nx"},
    "host_unicode": {"remote_host": "bücher.example"},
    "host_short_ipv4": {"remote_host": "127.1"},
    "host_not_str": {"remote_host": ["127.0.0.1"]},
    "remote_port_other": {"remote_port": 6379},
    "engine_id_crlf": {"remote_engine_id": "e\r\n"},
    "tokens_negative": {"remote_num_tokens": -1},
    "tokens_huge": {"remote_num_tokens": 1 << 60},
    "tokens_float": {"remote_num_tokens": 7.5},
    "tp_bool": {"tp_size": True},
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_every_field_is_checked_before_use(case):
    with pytest.raises(PDRefusal) as refused:
        parse_remote_prefill(params_at("127.0.0.1", **BAD_FIELDS[case]))
    assert refused.value.reason == "bad_params"
    assert "\n" not in str(refused.value) and "\r" not in str(refused.value)  # no peer text in the log line


@pytest.mark.parametrize("ours", [{"ports": [7000, 7001]}, {"ports": [0]}, {"ports": [65536]}, {"ports": "7000"},
                                  {"ports": [True]}, {"chunk_size": 0}, {"chunk_size": 1 << 30},
                                  {"version": "2"}, {"sig": "x" * 500}])
def test_our_fields_are_checked_too(ours):
    params = remote_params()
    params["lmcache_vllm"] = dict(params["lmcache_vllm"], **ours)
    with pytest.raises(PDRefusal) as refused:
        parse_remote_prefill(params)
    assert refused.value.reason == "bad_params"


def test_a_malformed_request_is_refused_counted_and_sends_nothing(caplog):
    half = half_with()
    req = pd_request("d", 700, params_at("127.0.0.1", remote_request_id="x\r\nFLUSHALL"))
    with caplog.at_level(logging.WARNING):
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed: its own cache has nothing
    assert metrics.value("pd_pull_failures", reason="bad_params") == 1
    assert "FLUSHALL" not in caplog.text
    assert releases_after_finish(half, req) == []


# ---------------------------------------------------------------- whom D connects to
def test_without_a_key_only_loopback_is_pulled_from_and_others_get_nothing(caplog):
    half = half_with()
    req = pd_request("d", 700, params_at("10.9.8.7"))
    with caplog.at_level(logging.WARNING):
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)
        other = pd_request("e", 700, params_at("10.9.8.6"))
        half.get_num_new_matched_tokens(other, 0)
    assert metrics.value("pd_pull_failures", reason="untrusted") == 2
    lines = [r for r in caplog.records if "does not trust" in r.getMessage()]
    assert len(lines) == 1 and "extra_config.pd_peers" in lines[0].getMessage()  # one line, naming the setting
    assert releases_after_finish(half, req) == []  # not even a RELEASE to a host a client named
    assert releases_after_finish(half, other) == []
    half.abandoned = None  # (not used below)
    local = pd_request("l", 700, params_at("127.0.0.1"))
    assert half.get_num_new_matched_tokens(local, 0) == (700, True)
    half.update_state_after_alloc(local, vllm_blocks(list(range(6))), 700)
    (load,) = half.build_connector_meta(SchedulerOutput.make_empty()).loads
    assert load.peer == PeerSpec("p-req", "127.0.0.1", (7000,), "loopback")


def test_a_request_the_api_server_refused_releases_only_a_trusted_peer():
    half = half_with()
    for host in ("10.9.8.7", "127.0.0.1"):
        half.request_finished(pd_request(host, 700, params_at(host)), [])
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases == [
        PeerSpec("p-req", "127.0.0.1", (7000,), "loopback")]


def fake_resolver(names: dict[str, str]) -> Resolver:
    def lookup(host: str) -> str:
        if host not in names:
            raise OSError("unknown host")
        return names[host]
    return Resolver(1.0, lookup)


def test_pd_peers_allow_hosts_names_and_networks_checked_on_the_resolved_address():
    names = {"p1.test": "10.1.0.5", "p2.test": "10.2.0.9", "sneaky.test": "10.9.9.9", "lo.test": "127.0.0.2"}
    trust = PeerTrust(["p1.test", "10.2.0.0/16", "192.168.1.4"], resolver=fake_resolver(names))
    admitted = {host: trust.admit(parse_remote_prefill(params_at(host)))
                for host in ("p1.test", "p2.test", "192.168.1.4", "lo.test", "127.0.0.1")}
    assert {h: (r.address, r.trust, r.label) for h, r in admitted.items()} == {
        "p1.test": ("10.1.0.5", "listed", "p1.test"), "p2.test": ("10.2.0.9", "listed", "10.2.0.0/16"),
        "192.168.1.4": ("192.168.1.4", "listed", "192.168.1.4"), "lo.test": ("127.0.0.2", "loopback", "loopback"),
        "127.0.0.1": ("127.0.0.1", "loopback", "loopback")}
    for host, reason in (("sneaky.test", "untrusted"), ("10.1.0.5", "untrusted"), ("nowhere.test", "unresolved")):
        with pytest.raises(PDRefusal) as refused:
            trust.admit(parse_remote_prefill(params_at(host)))
        assert refused.value.reason == reason, host
    assert PeerTrust().admit(parse_remote_prefill(params_at("localhost"))).address == "127.0.0.1"  # a real lookup


def test_a_hung_resolver_never_holds_the_scheduler():
    release = threading.Event()

    def hang(host: str) -> str:
        release.wait(30)
        raise OSError("gave up")

    trust = PeerTrust(["slow.test"], resolver=Resolver(0.2, hang))
    try:
        t0 = time.monotonic()
        for i in range(8):  # more than MAX_LOOKUPS hung lookups: the rest are refused at once
            with pytest.raises(PDRefusal) as refused:
                trust.admit(parse_remote_prefill(params_at(f"slow{i}.test")))
            assert refused.value.reason == "unresolved"
        assert time.monotonic() - t0 < 0.2 * 4 + 1.0
    finally:
        release.set()


# ---------------------------------------------------------------- signed params
MAC = ChunkMac("the-shared-secret")


def signed(host="10.5.5.5", scope="fp/tp1/c256", expires=None, **changes) -> dict:
    params = prefill_params(engine_id="P", req_id="p-req", host=host, ports=[7000], num_tokens=700,
                            chunk_size=S_CHUNK, mac=MAC, scope=scope,
                            expires=int(time.time() + 30) if expires is None else expires)
    params.update(changes)
    return params


def test_with_a_key_only_params_signed_for_this_scope_are_pulled_from():
    trust = PeerTrust(mac=MAC, scope="fp/tp1/c256")
    remote = trust.admit(parse_remote_prefill(signed()))
    assert (remote.address, remote.trust, remote.label, remote.stores_through) == ("10.5.5.5", "signed", "other", True)
    forged = signed()
    forged["lmcache_vllm"] = dict(forged["lmcache_vllm"], ports=[6379])
    for params, reason in ((dict(signed(), remote_host="10.5.5.6"), "bad_signature"),
                           (dict(signed(), remote_port=6379) | {"lmcache_vllm": forged["lmcache_vllm"]},
                            "bad_signature"),
                           (dict(signed(), remote_request_id="other"), "bad_signature"),
                           (dict(signed(), remote_num_tokens=9000), "bad_signature"),
                           (signed(scope="another-model/tp1/c256"), "bad_signature"),
                           (signed(expires=int(time.time() - 120)), "expired"),
                           (remote_params(), "unsigned")):
        with pytest.raises(PDRefusal) as refused:
            trust.admit(parse_remote_prefill(params))
        assert refused.value.reason == reason
    with pytest.raises(PDRefusal) as refused:  # signed by another key
        PeerTrust(mac=ChunkMac("another-secret"), scope="fp/tp1/c256").admit(parse_remote_prefill(signed()))
    assert refused.value.reason == "bad_signature"
    with pytest.raises(PDRefusal) as refused:  # no key here: a signature is no reason to trust a host
        PeerTrust().admit(parse_remote_prefill(signed()))
    assert refused.value.reason == "untrusted"


def test_a_prefill_instance_with_a_key_signs_its_params():
    pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=1, ask_ports=lambda: [9000],
                     can_load=True, can_save=True, trust=PeerTrust(mac=MAC, scope="s"), hold_s=30)
    half = SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK), block_size=S_BLOCK, lookup_client=PrefixStore(0),
                         can_load=True, can_save=True, pd=pd)
    from test_integration_pd import TOY_PROXY_PREFILL

    req = pd_request("a", 700, TOY_PROXY_PREFILL)
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    half.build_connector_meta(new_step(req, list(range(6)), computed=0, scheduled=700))
    _, params = finish(half, req)
    remote = PeerTrust(mac=MAC, scope="s").admit(parse_remote_prefill(params))
    assert (remote.host, remote.ports, remote.trust) == ("10.0.0.1", (9000,), "signed")
    assert time.time() + 25 < params["lmcache_vllm"]["expires"] <= time.time() + 31


# ---------------------------------------------------------------- KV of an unlisted peer stays in L1
def saves_of_a_pulled_request(half: SchedulerHalf, host: str) -> list:
    req = pd_request("d", 700, params_at(host))
    assert half.get_num_new_matched_tokens(req, 0) == (700, True)
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 700)
    half.build_connector_meta(SchedulerOutput.make_empty())  # the pull
    # Pulled: vLLM schedules it, recomputing the last prompt token.
    return half.build_connector_meta(new_step(req, list(range(6)), computed=699, scheduled=1)).saves


def test_kv_pulled_from_an_unlisted_loopback_peer_is_never_saved_to_the_shared_tiers():
    """D saves what its pull leaves unsaved (here the partial last chunk, with save_unfull_chunk; also what it
    recomputes after a partial pull, and decode tokens): KV computed from, or pulled from, a peer that is not
    trusted to write the shared tiers stays in L1."""
    assert saves_of_a_pulled_request(half_with(save_unfull_chunk=True), "127.0.0.1") == []
    listed = saves_of_a_pulled_request(half_with(PeerTrust(["127.0.0.1"]), save_unfull_chunk=True), "127.0.0.1")
    assert [(s.skip_leading, s.num_tokens) for s in listed] == [(512, 700)]


# ---------------------------------------------------------------- a hybrid model, host warnings
def test_a_hybrid_model_on_the_decode_side_refuses_pd_clearly(caplog):
    half = half_with(grouped=True)
    req = pd_request("d", 700, params_at("127.0.0.1"))
    with caplog.at_level(logging.WARNING):
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # no promise of tokens it never loads
    assert metrics.value("pd_pull_failures", reason="hybrid") == 1
    assert "several KV cache groups" in caplog.text
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases == [
        PeerSpec("p-req", "127.0.0.1", (7000,), "loopback")]


def test_an_advertised_localhost_is_said_at_start():
    (warning,) = host_warnings("localhost")
    assert "only decode instances on this host" in warning and "pd_host" in warning
    assert host_warnings("10.0.0.1") == []


def test_the_connector_signs_for_its_models_scope():
    """What the connector builds (`pd_trust`): instances of one model share a scope, so one verifies the
    other's params; another model (here: another dtype) has another scope, and its signature does not pass."""
    from vllm.config import ModelConfig, VllmConfig

    from lmcache_vllm.integration.vllm.connector import pd_trust
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    def trust_of(dtype: str) -> PeerTrust:
        model = ModelConfig(model=str(build_model("tiny")), dtype=dtype, max_model_len=1024, enforce_eager=True)
        config = LMCacheConfig(chunk_size=S_CHUNK, extra_config={"chunk_mac_key": "one-secret-for-both"})
        return pd_trust(config, VllmConfig(model_config=model), 1)

    p, d, other = trust_of("bfloat16"), trust_of("bfloat16"), trust_of("float32")
    assert p.scope == d.scope != other.scope and p.mac is not None
    params = prefill_params(engine_id="P", req_id="p-req", host="10.5.5.5", ports=[7000], num_tokens=700,
                            chunk_size=S_CHUNK, mac=p.mac, scope=p.scope, expires=int(time.time() + 30))
    assert d.admit(parse_remote_prefill(params)).trust == "signed"
    with pytest.raises(PDRefusal) as refused:
        other.admit(parse_remote_prefill(params))
    assert refused.value.reason == "bad_signature"
    assert PeerTrust().mac is None and pd_trust(LMCacheConfig(chunk_size=S_CHUNK), None, 1).scope == ""  # type: ignore[arg-type]
