"""Fuzz (`pytest -m fuzz`) what a client of a decode instance can put into `kv_transfer_params` (vLLM's API server
copies them from any request body), through the scheduler half on vLLM's own Request objects: valid params of
our prefill instances (plain and signed) with fields replaced by random values, removed or added. Every case
ends in a pull from a checked, admitted peer (an IP address and port listed in `pd_peers`, or signed params
with a key; the request id and ports within their bounds) or in exactly one counted refusal; never an
exception, never a socket, never a name resolved that `pd_peers` does not list (without a key), and a RELEASE
only ever goes to an admitted peer of this instance's TP size (issue 30 #1, issue 39 #1-#3)."""
from __future__ import annotations

import ipaddress
import socket
import time
from contextlib import contextmanager

import pytest
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from test_integration_pd import S_BLOCK, S_CHUNK, finish, pd_request, remote_params  # noqa: E402
from test_integration_scheduler import PrefixStore  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.config.peers import check_request_id  # noqa: E402
from lmcache_vllm.integration.vllm.pd.params import PDRefusal, parse_remote_prefill, prefill_params  # noqa: E402
from lmcache_vllm.integration.vllm.pd.scheduler import PDScheduler  # noqa: E402
from lmcache_vllm.integration.vllm.pd.trust import PeerTrust, Resolver  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.storage.codec import ChunkMac  # noqa: E402

pytestmark = pytest.mark.fuzz

REASONS = ("bad_params", "untrusted", "unsigned", "bad_signature", "expired", "unresolved", "tp_mismatch", "role",
           "hybrid", "uncacheable")
LISTED = ipaddress.ip_network("10.2.0.0/16")
PEERS = ["10.2.0.0/16:7000", "p1.test:7000", "evil.test:7000"]  # evil.test resolves outside the network
NAMES = {"p1.test": "10.2.3.4", "evil.test": "10.66.0.1", "lo.test": "127.0.0.9"}
MAC = ChunkMac("fuzz-secret")
KEYS = ["do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size",
        "remote_num_tokens", "remote_block_ids", "lmcache_vllm"]
OUR_KEYS = ["version", "ports", "chunk_size", "scope", "expires", "sig"]
WORDS = ["127.0.0.1", "::1", "localhost", "p1.test", "evil.test", "lo.test", "10.2.9.9", "10.9.9.9", "[::1]",
         "127.0.0.1:6379", "h\r\nx", "a..b", "r\r\nFLUSHALL", "r r", "x" * 300, "", "é", "7000", "cmpl-1-0"]
# (vLLM itself refuses integers beyond 64 bits in a request.)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.integers(0, 70000),
                    st.floats(allow_nan=True), st.text(max_size=24), st.sampled_from(WORDS))
values = st.one_of(scalars, st.lists(st.one_of(st.integers(-5, 70000), scalars), max_size=4),
                   st.dictionaries(st.sampled_from(OUR_KEYS), scalars, max_size=4))


def base_params(signed: bool) -> dict:
    if not signed:
        return remote_params()
    return prefill_params(engine_id="P", req_id="p-req", host="10.9.9.9", ports=[7000], num_tokens=700,
                          chunk_size=S_CHUNK, mac=MAC, scope="s", expires=int(time.time() + 60))


@st.composite
def params_dicts(draw) -> dict:
    signed = draw(st.booleans())
    params = base_params(signed)
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)))
        if draw(st.integers(0, 4)) == 0:
            params.pop(name, None)
        else:
            params[name] = draw(values)
    ours = params.get("lmcache_vllm")
    if isinstance(ours, dict) and draw(st.booleans()):
        ours = dict(ours)
        for _ in range(draw(st.integers(1, 3))):
            ours[draw(st.sampled_from(OUR_KEYS))] = draw(values)
        params["lmcache_vllm"] = ours
    params["do_remote_prefill"] = True
    return params


RESOLVED: list[str] = []


def lookup(host: str) -> str:
    RESOLVED.append(host)
    if host not in NAMES:
        raise OSError("no such host")
    return NAMES[host]


@contextmanager
def no_sockets():
    """Fails the test if anything opens a connection meanwhile (the scheduler half never may)."""
    real_connect, real_create = socket.socket.connect, socket.create_connection

    def refuse(*args, **kwargs):
        raise AssertionError(f"a connection was opened: {args[1:]}")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    socket.create_connection = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
        socket.create_connection = real_create


def refusals() -> float:
    return sum(metrics.value("pd_pull_failures", reason=r) for r in REASONS)


def admitted(host: str, ports: tuple[int, ...]) -> bool:
    address = ipaddress.ip_address(host)
    return (address in LISTED or str(address) == NAMES["evil.test"]) and ports == (7000,)


def test_any_params_end_in_a_checked_pull_or_one_counted_refusal():
    resolver = Resolver(lookup, start=lambda run: run())  # lookups answered at once (no thread to wait for)

    @examples(400)
    @given(params=params_dicts(), mac=st.booleans())
    def run(params, mac):
        trust = PeerTrust(PEERS, MAC if mac else None, "s", resolver=resolver)
        RESOLVED.clear()
        pd = PDScheduler(engine_id="E", host="10.0.0.1", chunk_size=S_CHUNK, tp_size=1, ask_ports=lambda: [9000],
                         can_load=True, can_save=True, trust=trust)
        half = SchedulerHalf(LMCacheConfig(chunk_size=S_CHUNK), block_size=S_BLOCK, lookup_client=PrefixStore(0),
                             can_load=True, can_save=True, pd=pd)
        before = refusals()
        try:  # the peer a RELEASE may go to: one the decode instance admits (refused for other reasons or not)
            peer = trust.admit(parse_remote_prefill(params))
        except PDRefusal:
            peer = None
        req = pd_request("d", 700, params)
        with no_sockets():
            n, load_async = half.get_num_new_matched_tokens(req, 0)
            remote = half._trackers["d"].remote
            if remote is None:
                assert refusals() == before + 1 and (n, load_async) == (0, False)
            else:
                assert refusals() == before and load_async and n > 0
                assert admitted(remote.address, remote.ports) or (mac and remote.trust == "signed")
                check_request_id(remote.req_id)
                assert remote.tp_size == len(remote.ports) == 1 and all(0 < p < 65536 for p in remote.ports)
            finish(half, req, RequestStatus.FINISHED_ABORTED)
            releases = half.build_connector_meta(SchedulerOutput.make_empty()).peer_releases
        if not mac:  # no name a client chose is resolved: only the names pd_peers lists
            assert set(RESOLVED) <= {"p1.test", "evil.test"}, RESOLVED
        for spec in releases:  # only to a peer it admits, of its TP size (it may refuse it for other reasons)
            assert peer is not None and spec.host == peer.address and spec.ports == peer.ports
            assert len(spec.ports) == 1 and (admitted(spec.host, spec.ports) or (mac and peer.trust == "signed"))

    with bounded_run(thread_grace_s=2.0):
        run()


# ---------------------------------------------------------------- pd_peers entries and proxy authorizations
ENTRY_WORDS = ["10.0.0.0/24", "127.0.0.1", "::1", "[::1]", "[fd00::/64]", "p1.test", "a..b", "", ":", "-", "/",
               "5600", "65535", "65536", "0", "[", "]", "é", " ", "\r\n", "*"]


@examples(300)
@given(parts=st.lists(st.one_of(st.sampled_from(ENTRY_WORDS), st.text(max_size=6)), max_size=5),
       port=st.integers(0, 70000))
def test_any_pd_peers_entry_parses_to_a_host_and_ports_or_is_refused_clearly(parts, port):
    """Whatever a configuration writes into pd_peers: an entry with a host or network and a port range, or a
    ValueError (one ConfigError at start-up); an entry admits only its own ports."""
    import ipaddress as ip

    from lmcache_vllm.config.peers import check_peers, parse_peer

    text = ":".join(parts) if len(parts) > 1 else "".join(parts)
    try:
        entry = parse_peer(text)
    except ValueError:
        assert check_peers([text]) is not None
        return
    assert check_peers([text]) is None and 0 < entry.low <= entry.high <= 65535
    assert (entry.network is None) != (entry.name is None)
    address = ip.ip_address("10.0.0.5") if entry.network is None else entry.network.network_address
    host = entry.name or str(address)
    assert entry.allows(host, address, port) == (entry.low <= port <= entry.high)


@examples(300)
@given(ours=st.one_of(values, st.dictionaries(st.sampled_from(["proxy_sig", "proxy_expires", "version"]), values,
                                               max_size=3)),
       extra=st.dictionaries(st.text(max_size=8), values, max_size=2))
def test_any_proxy_authorization_verifies_or_is_refused(ours, extra):
    from lmcache_vllm.integration.vllm.pd.params import proxy_authorized, proxy_params

    params = {"do_remote_decode": True, **extra, "lmcache_vllm": ours}
    assert proxy_authorized(params, MAC) in (None, False)  # nothing but a key holder's authorization passes
    assert proxy_authorized(params, None) in (None, False)
    assert proxy_authorized(dict(params, **proxy_params(MAC)), MAC) is True
