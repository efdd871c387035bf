"""kv_transfer_params come from clients of the decode instance D (vLLM's API server copies them from any
request body): every field is checked before use, D connects only to prefill instances it trusts (signed
params with a chunk MAC key; else the ports `extra_config.pd_peers` lists, or its own), resolves no name a
client chose and waits on none, sends nothing (not even a RELEASE) to anything else (issue 30 #1, #2, #10,
#11; issue 39 #1, #2, #3). And a prefill instance holds for a plain client's `do_remote_decode` only where PD
is configured explicitly, or for a proxy holding the key (issue 39 #4)."""
from __future__ import annotations

import logging
import threading
import time

import pytest

pytest.importorskip("vllm")

from test_integration_pd import S_BLOCK, S_CHUNK, TOY_PROXY_PREFILL, finish, pd_request, remote_params  # noqa: E402
from test_integration_scheduler import PrefixStore, new_step, vllm_blocks  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from lmcache_vllm.config import ConfigError, LMCacheConfig, load_config  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import PeerSpec  # noqa: E402
from lmcache_vllm.integration.vllm.pd.params import (  # noqa: E402
    PDRefusal,
    parse_remote_prefill,
    prefill_params,
    proxy_authorized,
    proxy_params,
)
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler  # noqa: E402
from lmcache_vllm.integration.vllm.pd.trust import PENDING, PeerTrust, Resolver, host_warnings  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.storage.codec import ChunkMac  # noqa: E402

LISTED = "127.0.0.1:7000"  # the prefill instance of `remote_params`


def half_with(trust: PeerTrust | None = None, *, grouped: bool = False, explicit: bool = True,
              **config) -> SchedulerHalf:
    kwargs = {} if trust is None else {"trust": trust}
    if grouped:
        kwargs["grouped"] = True
    pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=1, ask_ports=lambda: [9000],
                     can_load=True, can_save=True, hold_for_any_client=explicit, **kwargs)
    return SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK, **config), block_size=S_BLOCK,
                         lookup_client=PrefixStore(0), can_load=True, can_save=True, pd=pd)


def params_at(host: str, **changes) -> dict:
    params = dict(remote_params(), remote_host=host)
    params.update(changes)
    return params


def with_ports(params: dict, ports: list[int]) -> dict:
    return dict(params, remote_port=ports[0], tp_size=len(ports),
                lmcache_vllm=dict(params["lmcache_vllm"], ports=ports))


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
    half = half_with(PeerTrust([LISTED]))
    req = pd_request("d", 700, params_at("127.0.0.1", remote_request_id="x\r\nFLUSHALL"))
    with caplog.at_level(logging.WARNING):
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed: its own cache has nothing
    assert metrics.value("pd_pull_failures", reason="bad_params") == 1
    assert "FLUSHALL" not in caplog.text
    assert releases_after_finish(half, req) == []


# ---------------------------------------------------------------- whom D connects to
def test_loopback_is_nobodys_and_others_get_nothing(caplog):
    """Issue 39 #2: before, any 127/8 or ::ffff:127.0.0.1 address and any port was admitted as "loopback" (D
    connected to it, sent a PULL and a RELEASE). Without a key and pd_peers nothing is admitted, and a refused
    peer is sent nothing, not even a RELEASE."""
    half = half_with()
    hosts = ("127.0.0.1", "127.0.0.2", "127.1.2.3", "::1", "::ffff:127.0.0.1", "0.0.0.0", "10.9.8.7")
    reqs = [pd_request(f"d{i}", 700, params_at(host)) for i, host in enumerate(hosts)]
    with caplog.at_level(logging.WARNING):
        for req in reqs:
            assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    assert metrics.value("pd_pull_failures", reason="untrusted") == len(hosts)
    lines = [r for r in caplog.records if "does not trust" in r.getMessage()]
    assert len(lines) == 1 and "extra_config.pd_peers" in lines[0].getMessage()  # one line, naming the setting
    for req in reqs:
        assert releases_after_finish(half, req) == []


def test_pd_peers_admit_their_ports_only():
    """Issue 39 #2: every port of a listed host or network was admitted before (D could be pointed at a Redis
    next to its prefill instance); now an entry names its ports."""
    trust = PeerTrust([LISTED, "10.2.0.0/16:8200-8203", "[fd00::/64]:9000"])
    admit = {(host, ports): trust.admit(parse_remote_prefill(with_ports(params_at(host), list(ports))))
             for host, ports in (("127.0.0.1", (7000,)), ("::ffff:127.0.0.1", (7000,)), ("10.2.0.9", (8200, 8203)),
                                 ("fd00::5", (9000,)))}
    assert {k: (r.address, r.trust, r.label) for k, r in admit.items()} == {
        ("127.0.0.1", (7000,)): ("127.0.0.1", "listed", LISTED),
        ("::ffff:127.0.0.1", (7000,)): ("127.0.0.1", "listed", LISTED),  # connected to as the IPv4 address
        ("10.2.0.9", (8200, 8203)): ("10.2.0.9", "listed", "10.2.0.0/16:8200-8203"),
        ("fd00::5", (9000,)): ("fd00::5", "listed", "[fd00::/64]:9000")}
    for host, ports in (("127.0.0.1", [6379]), ("127.0.0.2", [7000]), ("10.2.0.9", [8200, 6379]),
                        ("10.3.0.1", [8200]), ("fd00::5", [9001])):
        with pytest.raises(PDRefusal) as refused:
            trust.admit(parse_remote_prefill(with_ports(params_at(host), ports)))
        assert refused.value.reason == "untrusted", (host, ports)


def test_pd_peers_without_ports_are_refused_at_start():
    with pytest.raises(ConfigError) as refused:
        load_config({"extra_config": {"pd_peers": ["10.0.0.0/24", "prefill-1", "127.0.0.1:0", "h:9-8"]}}, environ={})
    (problem,) = refused.value.problems
    assert problem.key == "extra_config.pd_peers"
    for entry in ("'10.0.0.0/24'", "'prefill-1'", "'127.0.0.1:0'", "'h:9-8'"):
        assert entry in problem.message
    assert "HOST:FIRST-LAST" in problem.message


def test_a_repeated_port_is_refused_before_anything_is_sent():
    """Issue 39 #3: `tp_size: 256` with one port named 256 times made D send 256 RELEASEs to it."""
    params = with_ports(params_at("127.0.0.1"), [7000] * 256)
    with pytest.raises(PDRefusal) as refused:
        parse_remote_prefill(params)
    assert refused.value.reason == "bad_params" and "twice" in str(refused.value)
    half = half_with(PeerTrust([LISTED]))
    req = pd_request("d", 700, params)
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    assert releases_after_finish(half, req) == []


def test_params_of_another_tp_size_get_no_release():
    """Issue 39 #3: RELEASEs only for admitted params of this instance's TP and chunk size (before, 256 listed
    ports of another TP size each got one)."""
    ports = list(range(7000, 7000 + 256))
    half = half_with(PeerTrust(["127.0.0.1:7000-7255"]))
    req = pd_request("d", 700, with_ports(params_at("127.0.0.1"), ports))
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    assert metrics.value("pd_pull_failures", reason="tp_mismatch") == 1
    assert releases_after_finish(half, req) == []
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases == []


def test_this_instances_own_transfer_ports_are_trusted():
    asked = []

    def own_ports():
        asked.append(1)
        return [7000]

    trust = PeerTrust(own_addresses=frozenset({"127.0.0.1"}), own_ports=own_ports)
    remote = trust.admit(parse_remote_prefill(params_at("127.0.0.1")))
    assert remote is not None and (remote.address, remote.trust, remote.label) == ("127.0.0.1", "own", "own")
    for host, ports in (("127.0.0.1", [7001]), ("127.0.0.2", [7000]), ("10.0.0.1", [7000])):
        with pytest.raises(PDRefusal):
            trust.admit(parse_remote_prefill(with_ports(params_at(host), ports)))
    assert len(asked) == 2  # asked only for an address of its own


def test_a_request_the_api_server_refused_releases_only_a_trusted_peer():
    half = half_with(PeerTrust([LISTED]))
    for host in ("10.9.8.7", "127.0.0.2", "127.0.0.1"):
        half.request_finished(pd_request(host, 700, params_at(host)), [])
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases == [
        PeerSpec("p-req", "127.0.0.1", (7000,), LISTED)]


# ---------------------------------------------------------------- names: never resolved nor waited for on the step
class Lookups:
    """A resolver's lookups, held until `release` (a slow DNS zone), each name recorded."""

    def __init__(self, names: dict[str, str]):
        self.names = names
        self.asked: list[str] = []
        self.go = threading.Event()

    def __call__(self, host: str) -> str:
        self.asked.append(host)
        self.go.wait(30)
        if host not in self.names:
            raise OSError("unknown host")
        return self.names[host]


def test_a_name_a_client_chose_is_never_resolved_nor_waited_for():
    """Issue 39 #1: before, D resolved any name a client sent, waiting up to 1 s on vLLM's scheduler thread
    (a fresh name under a slow zone per request held every tenant's step)."""
    lookups = Lookups({})
    half = half_with(PeerTrust([LISTED], resolver=Resolver(lookups)))
    try:
        t0 = time.monotonic()
        for i in range(20):
            req = pd_request(f"d{i}", 700, params_at(f"fresh-{i}.slow.test"))
            assert half.get_num_new_matched_tokens(req, 0) == (0, False)
        assert time.monotonic() - t0 < 0.5
        assert lookups.asked == []  # not even started on another thread
        assert metrics.value("pd_pull_failures", reason="untrusted") == 20
    finally:
        lookups.go.set()


def test_a_listed_name_is_resolved_off_the_scheduler_thread_and_the_request_waits_meanwhile():
    lookups = Lookups({"p1.test": "10.1.0.5"})
    trust = PeerTrust(["p1.test:7000"], resolver=Resolver(lookups), resolve_timeout_s=5.0)
    half = half_with(trust)
    req = pd_request("d", 700, params_at("p1.test"))
    try:
        t0 = time.monotonic()
        assert half.get_num_new_matched_tokens(req, 0) == (None, False)  # pending: vLLM asks again next step
        assert half.get_num_new_matched_tokens(req, 0) == (None, False)
        assert time.monotonic() - t0 < 0.5
    finally:
        lookups.go.set()
    deadline = time.monotonic() + 5
    while (answer := half.get_num_new_matched_tokens(req, 0)) == (None, False) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answer == (700, True)
    assert lookups.asked == ["p1.test"]  # looked up once, at start (pd_peers names are resolved up front)
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 700)
    (load,) = half.build_connector_meta(SchedulerOutput.make_empty()).loads
    assert load.peer == PeerSpec("p-req", "10.1.0.5", (7000,), "p1.test:7000")  # the address, checked


def test_a_hung_resolver_costs_a_request_its_pull_never_the_step():
    lookups = Lookups({})
    trust = PeerTrust([f"slow{i}.test:7000" for i in range(8)], resolver=Resolver(lookups), resolve_timeout_s=0.2)
    half = half_with(trust)
    try:
        reqs = [pd_request(f"d{i}", 700, params_at(f"slow{i}.test")) for i in range(8)]
        t0 = time.monotonic()
        answers = [half.get_num_new_matched_tokens(req, 0) for req in reqs]
        assert time.monotonic() - t0 < 0.5
        assert set(answers) <= {(None, False), (0, False)}  # pending, or refused: at most MAX_LOOKUPS resolve
        time.sleep(0.3)
        assert [half.get_num_new_matched_tokens(req, 0) for req in reqs] == [(0, False)] * 8
        assert metrics.value("pd_pull_failures", reason="unresolved") == 8
        assert all(releases_after_finish(half, req) == [] for req in reqs)
    finally:
        lookups.go.set()


def test_the_resolver_never_waits():
    lookups = Lookups({"p1.test": "10.1.0.5"})
    resolver = Resolver(lookups)
    assert resolver.lookup("10.0.0.1") == "10.0.0.1"  # a literal is itself
    assert resolver.lookup("p1.test") is PENDING and resolver.lookup("p1.test") is PENDING
    lookups.go.set()
    deadline = time.monotonic() + 5
    while resolver.lookup("p1.test") is PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resolver.lookup("p1.test") == "10.1.0.5" and lookups.asked == ["p1.test"]
    assert PeerTrust(["localhost:7000"]).resolver.lookup("localhost") in (PENDING, "127.0.0.1")  # a real lookup


# ---------------------------------------------------------------- signed params
MAC = ChunkMac("the-shared-secret-0123456789")


def signed(host="10.5.5.5", scope="fp/tp1/c256", expires=None, mac=MAC, **changes) -> dict:
    params = prefill_params(engine_id="P", req_id="p-req", host=host, ports=[7000], num_tokens=700,
                            chunk_size=S_CHUNK, mac=mac, scope=scope,
                            expires=int(time.time() + 30) if expires is None else expires)
    params.update(changes)
    return params


def test_with_a_key_only_params_signed_for_this_scope_are_pulled_from():
    trust = PeerTrust(mac=MAC, scope="fp/tp1/c256")
    remote = trust.admit(parse_remote_prefill(signed()))
    assert (remote.address, remote.trust, remote.label) == ("10.5.5.5", "signed", "other")
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
        PeerTrust(mac=ChunkMac("another-secret-0123456789"), scope="fp/tp1/c256").admit(parse_remote_prefill(signed()))
    assert refused.value.reason == "bad_signature"
    with pytest.raises(PDRefusal) as refused:  # no key here: a signature is no reason to trust a host
        PeerTrust().admit(parse_remote_prefill(signed()))
    assert refused.value.reason == "untrusted"


def test_a_key_rotation_verifies_the_old_and_the_new_key():
    """Issue 39 #6: one key only made a rotation split a rolling fleet. With a list, a decode instance that
    verifies [new, old] pulls from prefill instances signing with either."""
    old, new = "the-old-fleet-key-0123456789", "the-new-fleet-key-0123456789"
    rotating = PeerTrust(mac=ChunkMac([new, old]), scope="fp/tp1/c256")
    for signer in (ChunkMac(old), ChunkMac([new, old]), ChunkMac([old, new])):
        assert rotating.admit(parse_remote_prefill(signed(mac=signer))).trust == "signed"
    with pytest.raises(PDRefusal):
        PeerTrust(mac=ChunkMac(old), scope="fp/tp1/c256").admit(parse_remote_prefill(signed(mac=ChunkMac(new))))


def test_a_prefill_instance_with_a_key_signs_its_params():
    pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=1, ask_ports=lambda: [9000],
                     can_load=True, can_save=True, trust=PeerTrust(mac=MAC, scope="s"), hold_s=30,
                     hold_for_any_client=True)
    half = SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK), block_size=S_BLOCK, lookup_client=PrefixStore(0),
                         can_load=True, can_save=True, pd=pd)
    req = pd_request("a", 700, TOY_PROXY_PREFILL)
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    half.build_connector_meta(new_step(req, list(range(6)), computed=0, scheduled=700))
    _, params = finish(half, req)
    remote = PeerTrust(mac=MAC, scope="s").admit(parse_remote_prefill(params))
    assert (remote.host, remote.ports, remote.trust) == ("10.0.0.1", (9000,), "signed")
    assert time.time() + 25 < params["lmcache_vllm"]["expires"] <= time.time() + 31


# ---------------------------------------------------------------- whose do_remote_decode a prefill instance holds for
def prefill_half(trust: PeerTrust, explicit: bool) -> SchedulerHalf:
    pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=1, ask_ports=lambda: [9000],
                     can_load=True, can_save=True, trust=trust, hold_for_any_client=explicit)
    return SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK), block_size=S_BLOCK, lookup_client=PrefixStore(0),
                         can_load=True, can_save=True, pd=pd)


def prefilled(half: SchedulerHalf, req_id: str, params: dict):
    """The holds that went out for a request prefilled in one step, and its answer's kv_transfer_params."""
    req = pd_request(req_id, 700, params)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, vllm_blocks(list(range(6))), 0)
    holds = half.build_connector_meta(new_step(req, list(range(6)), computed=0, scheduled=700)).peer_holds
    return [h.req_id for h in holds], finish(half, req)[1]


def test_a_plain_clients_remote_decode_is_not_held_unless_pd_is_configured_explicitly(caplog):
    """Issue 39 #4: by default any client's `do_remote_decode: true` held a unique prompt's chunks for 30 s
    (up to half of L1) and was answered with the instance's internal host, ports and engine id."""
    half = prefill_half(PeerTrust(), explicit=False)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            assert prefilled(half, f"a{i}", TOY_PROXY_PREFILL) == ([], None)  # no hold, no address
    assert metrics.value("pd_remote_decode_refused", reason="not_configured") == 3
    assert "configured explicitly" in caplog.text and "pd_peers" in caplog.text
    explicit = prefill_half(PeerTrust([LISTED]), explicit=True)
    holds, params = prefilled(explicit, "b", TOY_PROXY_PREFILL)
    assert holds == ["b"] and params["remote_host"] == "10.0.0.1"


def test_a_proxy_holding_the_key_is_held_for_without_explicit_pd():
    half = prefill_half(PeerTrust(mac=MAC, scope="s"), explicit=False)
    holds, params = prefilled(half, "a", proxy_params(MAC))
    assert holds == ["a"] and parse_remote_prefill(params).ports == (9000,)
    other = ChunkMac("another-proxy-key-0123456789")
    for i, forged in enumerate((proxy_params(other), proxy_params(MAC, now=time.time() - 600),
                                proxy_params(MAC, now=time.time() + 3600),
                                dict(proxy_params(MAC), lmcache_vllm={"proxy_sig": "zz", "proxy_expires": 1}))):
        assert prefilled(half, f"f{i}", forged) == ([], None)
    assert metrics.value("pd_remote_decode_refused", reason="bad_proxy_auth") == 4
    assert prefilled(half, "plain", TOY_PROXY_PREFILL) == ([], None)
    assert metrics.value("pd_remote_decode_refused", reason="not_configured") == 1
    assert proxy_authorized(proxy_params(MAC), None) is False  # no key here: nothing verifies


def test_explicit_pd_is_pd_on_with_a_key_or_pd_peers():
    from lmcache_vllm.integration.vllm.connector import pd_explicit

    def explicit(key: bool = False, **extra) -> bool:
        return pd_explicit(LMCacheConfig(chunk_size=S_CHUNK, extra_config=extra), MAC if key else None)

    assert not explicit() and not explicit(pd="on") and not explicit(key=True)  # auto with a key: proxies only
    assert explicit(pd="on", key=True) and explicit(pd_peers=[LISTED])


# ---------------------------------------------------------------- a hybrid model, host warnings
def test_a_hybrid_model_on_the_decode_side_refuses_pd_clearly(caplog):
    half = half_with(PeerTrust([LISTED]), grouped=True)
    req = pd_request("d", 700, params_at("127.0.0.1"))
    with caplog.at_level(logging.WARNING):
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # no promise of tokens it never loads
    assert metrics.value("pd_pull_failures", reason="hybrid") == 1
    assert "several KV cache groups" in caplog.text
    assert half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases == [
        PeerSpec("p-req", "127.0.0.1", (7000,), LISTED)]


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
        config = LMCacheConfig(chunk_size=S_CHUNK, extra_config={"chunk_mac_key": "one-secret-for-both-0123456789"})
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
