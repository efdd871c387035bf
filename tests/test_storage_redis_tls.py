"""TLS, AUTH and ACL users of the Redis tier against real servers: a TLS-only redis-server (and a TLS
cluster) with certificates made by the test with `openssl`, client certificates, passwords and ACL users. A
wrong password, a wrong CA, a missing client certificate, a plain client at a TLS port or a TLS client at a
plain port is one clear error at start (no credentials in it or in the log), then counted misses and failed
writes: never an exception out of the tier."""

import logging

import pytest
import torch
from redis_servers import (
    ClusterProcesses,
    Process,
    TlsServer,
    free_port,
    make_certificates,
    server_args,
    tls_server_args,
)

from lmcache_vllm.config import ConfigError, LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.redis import RedisBackend

pytestmark = pytest.mark.redis
CHUNK = (2, 2, 16, 64)
PASSWORD = "tls-pass-w0rd"


def key(i: int) -> str:
    return f"m@1@0@bfloat16@v1@{i:064x}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(certs, tmp_path_factory):
    server = TlsServer(tmp_path_factory.mktemp("tls"), certs, client_certs=True, password=PASSWORD)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    """A plain server with an ACL user `cache` (password PASSWORD) allowed only our key prefix."""
    port = free_port()
    server = Process(server_args(port, tmp_path_factory.mktemp("acl")), port)
    server.start()
    client = server.client()
    client.acl_setuser("cache", enabled=True, passwords=[f"+{PASSWORD}"], keys=["acl:*"],
                       commands=["+@all"])
    client.close()
    yield server
    server.kill()


def tls_extra(certs, **overrides):
    extra = {"ssl_ca_certs": str(certs["ca.crt"]), "ssl_certfile": str(certs["client.crt"]),
             "ssl_keyfile": str(certs["client.key"]), "remote_timeout_secs": 1.0}
    return {**extra, **overrides}


async def round_trip(backend, i: int = 1) -> bool:
    allocator = HostAllocator(1 << 20)
    src = allocator.allocate(CHUNK, torch.bfloat16)
    src.tensor.fill_(i)
    try:
        if not await backend.put(key(i), src):
            return False
        got = await backend.get(key(i), lambda s, d: allocator.allocate(s, d))
        ok = got is not None and torch.equal(got.tensor, src.tensor)
        if got is not None:
            got.ref_down()
        return ok
    finally:
        src.ref_down()


async def test_tls_with_client_certificate_and_password(tls_server, certs):
    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}/0"
    backend = RedisBackend(LMCacheConfig(remote_url=url, extra_config=tls_extra(certs, remote_key_prefix="t:")))
    assert backend.start_problem is None
    assert await round_trip(backend)
    assert PASSWORD not in backend.location and PASSWORD not in repr(backend.target)
    await backend.close()


async def test_acl_user(acl_server, caplog):
    good = RedisBackend(LMCacheConfig(remote_url=f"redis://cache:{PASSWORD}@127.0.0.1:{acl_server.port}",
                                      extra_config={"remote_key_prefix": "acl:"}))
    assert good.start_problem is None and await round_trip(good)
    await good.close()
    bad = RedisBackend(LMCacheConfig(remote_url=f"redis://cache:wrong-{PASSWORD}@127.0.0.1:{acl_server.port}",
                                     extra_config={"remote_key_prefix": "acl:"}))
    assert bad.start_problem.startswith("authentication failed for user 'cache'")
    assert not await round_trip(bad)  # a failed write, counted; no exception
    assert metrics.value("failed_writes", tier="redis") == 1
    await bad.close()
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize("case, fragment", [
    ("wrong password", "authentication failed for the default user"),
    ("wrong CA", "the server's certificate is not trusted"),
    ("no client certificate", "client certificate"),
    ("plain client at a TLS port", "use rediss://"),
])
async def test_misconfiguration_is_one_clear_error_at_start(tls_server, certs, case, fragment, caplog):
    url, extra = f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}", tls_extra(certs)
    if case == "wrong password":
        url = url.replace(PASSWORD, "not-" + PASSWORD)
    elif case == "wrong CA":
        extra["ssl_ca_certs"] = str(certs["other-ca.crt"])
    elif case == "no client certificate":
        del extra["ssl_certfile"], extra["ssl_keyfile"]
    else:
        url, extra = url.replace("rediss://", "redis://"), {"remote_timeout_secs": 1.0}
    with caplog.at_level(logging.ERROR):
        backend = RedisBackend(LMCacheConfig(remote_url=url, extra_config=extra))
    assert fragment in backend.start_problem, backend.start_problem
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and fragment in errors[0].getMessage()
    assert PASSWORD not in caplog.text and PASSWORD not in backend.start_problem
    assert await backend.contains([key(1)]) == [False]
    assert not await round_trip(backend)
    assert metrics.value("failed_writes", tier="redis") == 1
    await backend.close()


@pytest.mark.parametrize("cert_reqs", ["required", "optional"])
async def test_a_certificate_for_another_host_is_refused(certs, tmp_path, cert_reqs):
    """A certificate the CA signed for another host name authenticates that host, not this one: refused with
    ssl_cert_reqs 'optional' too (it used to skip the host-name check; issue 30 #11)."""
    other = dict(certs, **{"server.crt": certs["other-host.crt"], "server.key": certs["other-host.key"]})
    port = free_port()
    server = Process(server_args(0, tmp_path, "--tls-port", str(port), *tls_server_args(other, client_certs=False)),
                     port, ping={"ssl": True, "ssl_ca_certs": str(certs["ca.crt"]), "ssl_check_hostname": False})
    server.start()
    try:
        extra = {"ssl_ca_certs": str(certs["ca.crt"]), "ssl_cert_reqs": cert_reqs, "remote_timeout_secs": 1.0}
        backend = RedisBackend(LMCacheConfig(remote_url=f"rediss://127.0.0.1:{port}", extra_config=extra))
        assert backend.start_problem is not None and "not trusted" in backend.start_problem, backend.start_problem
        assert not await round_trip(backend)
        await backend.close()
    finally:
        server.kill()


async def test_tls_client_at_a_plain_port_is_reported(redis_server, certs):
    url = f"rediss://127.0.0.1:{redis_server.port}"
    backend = RedisBackend(LMCacheConfig(remote_url=url, extra_config=tls_extra(certs, remote_timeout_secs=0.5)))
    assert "does not speak TLS" in backend.start_problem
    assert not await round_trip(backend)
    await backend.close()


def test_tls_files_are_checked_with_the_configuration(tmp_path, certs):
    with pytest.raises(ConfigError) as error:
        LMCacheConfig(remote_url="redis://127.0.0.1:6379", extra_config={
            "ssl_ca_certs": str(certs["ca.crt"]), "ssl_certfile": str(tmp_path / "missing.crt")})
    assert error.value.keys == {"extra_config.ssl_ca_certs", "extra_config.ssl_certfile"}
    assert "applies to a TLS remote_url only" in str(error.value)
    assert "expected the path of a readable file" in str(error.value)


async def test_tls_cluster(certs, tmp_path):
    cluster = ClusterProcesses(tmp_path / "tls-cluster", certs=certs)
    try:
        cluster.start()
        assert cluster.url.startswith("rediss-cluster://")
        backend = RedisBackend(LMCacheConfig(remote_url=cluster.url, extra_config=tls_extra(
            certs, remote_key_prefix="tc:")))
        assert backend.start_problem is None
        assert [await round_trip(backend, i) for i in range(12)] == [True] * 12
        assert sum(1 for n in cluster.keys_per_node("tc:*").values() if n) >= 2
        await backend.close()
    finally:
        cluster.stop()


def test_admin_ping_with_tls_flags(tls_server, certs, capsys):
    from lmcache_vllm import cli

    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}"
    files = ["--ssl-ca-certs", str(certs["ca.crt"]), "--ssl-certfile", str(certs["client.crt"]),
             "--ssl-keyfile", str(certs["client.key"])]
    assert cli.main(["ping", "--redis", url, *files]) == cli.EXIT_OK
    assert cli.main(["ping", "--redis", url, *files[:2], "--timeout", "1"]) == cli.EXIT_AUTH  # no client cert
    out = capsys.readouterr()
    assert "tls on" in out.out and "client certificate" in out.err and PASSWORD not in out.out + out.err
