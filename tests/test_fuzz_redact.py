"""Redaction shares the URL parser (issue 30 #7): for any `remote_url` the parser accepts, whatever its password
holds (`/`, `#`, `?`, `@`, `:`, `%`, quotes, spaces, non-ASCII), the password never appears in what we show of
it: `redact_url`, the target's repr and `display()`, a configuration's repr, summary and start-up line, a
configuration error about the URL, the text of a connection failure, free text quoting the URL. A password of
fewer than 4 characters is masked where the URL is shown whole (redact_url, display, config values); in free
text it is masked by the URL's structure only (shorter "secrets" would mask ordinary words everywhere)."""
from __future__ import annotations

import pytest
from fuzzing import bounded_run, examples
from hypothesis import assume, given
from hypothesis import strategies as st

from lmcache_vllm.config import ConfigError, LMCacheConfig, load_config
from lmcache_vllm.config.redact import redact_text, redact_url, split_url
from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.observability import logs
from lmcache_vllm.storage.redis.client import describe_failure

pytestmark = pytest.mark.fuzz

SCHEMES = ["redis", "rediss", "valkey", "valkeys", "redis-cluster", "rediss-cluster", "valkey-cluster",
           "redis-sentinel", "rediss-sentinel", "unix"]
password_chars = st.one_of(st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                           st.sampled_from(["/", "#", "?", "@", ":", "%", "%2F", "'", '"', " ", "é", "\u2028"]))
passwords = st.lists(password_chars, min_size=4, max_size=14).map("".join)
users = st.text(st.sampled_from("abcXYZ019_-."), max_size=6)


@st.composite
def urls(draw) -> tuple[str, str]:
    """(a URL with a password, the password as written in it)."""
    scheme = draw(st.sampled_from(SCHEMES))
    password = draw(passwords)
    user = draw(users)
    if scheme == "unix":
        return f"unix://{user}:{password}@/run/redis.sock" + draw(st.sampled_from(["", "?db=2"])), password
    nodes = draw(st.lists(st.sampled_from(["127.0.0.1:6390", "h1:7000", "[::1]:7001", "node-2"]), min_size=1,
                          max_size=1 if scheme in ("redis", "rediss", "valkey", "valkeys") else 3))
    path = draw(st.sampled_from(["", "/0", "/3"] if "sentinel" not in scheme else ["", "/mymaster", "/mymaster/2"]))
    if "cluster" in scheme:
        path = draw(st.sampled_from(["", "/0"]))
    return f"{scheme}://{user}:{password}@{','.join(nodes)}{path}", password


def shown(url: str) -> list[str]:
    """Everything we show of a URL the parser accepted."""
    target = parse_remote_url(url)
    out = [redact_url(url), target.display(), repr(target), str(target),
           redact_text(f"connecting to {url} failed"), redact_text(f"remote_url='{url}'"),
           describe_failure(ConnectionError(f"Error 111 connecting to {url}. Connection refused."), target)[0]]
    try:
        config = LMCacheConfig(remote_url=url)
    except ConfigError as err:  # e.g. a TLS scheme without its files: an error about the URL
        out += [str(err), repr(err)]
    else:
        out += [repr(config), str(config), config.summary(), logs.describe_config(config)]
    return out


@examples(300)
@given(urls())
def test_no_password_of_an_accepted_url_is_ever_shown(case):
    url, written = case
    try:
        target = parse_remote_url(url)
    except ValueError:
        assume(False)
    parts = split_url(url)
    assert parts is not None and parts.password == written  # the parser and the redaction split alike
    secrets = {s for s in (written, target.password) if s}
    # A password that is also a word of what we show anyway (a host, a scheme) proves nothing.
    baseline = " ".join(shown(url.replace(f":{written}@", ":PLACEHOLDER@")))
    assume(not any(s in baseline for s in secrets))
    with bounded_run():
        for text in shown(url):
            for secret in secrets:
                assert secret not in text, (secret, text)


@examples(200)
@given(urls(), st.sampled_from([":99999", ":0", ":port"]))
def test_no_password_of_a_refused_url_is_shown_in_the_error(case, bad_port):
    url, written = case
    assume("://" in url and not url.startswith("unix"))
    head, _, tail = url.rpartition("@")
    broken = f"{head}@bad-node{bad_port}{tail[tail.find('/'):] if '/' in tail else ''}"
    with pytest.raises(ConfigError) as err:
        load_config({"remote_url": broken}, environ={})
    baseline = str(load_config_error(broken.replace(f":{written}@", ":PLACEHOLDER@")))
    assume(written not in baseline)
    assert written not in str(err.value) and written not in repr(err.value)


def load_config_error(url: str) -> ConfigError:
    try:
        load_config({"remote_url": url}, environ={})
    except ConfigError as err:
        return err
    raise AssertionError(f"{url} was accepted")


@pytest.mark.parametrize("password", ["pass/word", "pa#ss", "p?ss=1", "p@ss@word", "a b'c\"d", "p%2Fss"])
def test_cli_and_admin_output_hold_no_password(password, capsys):
    """The admin tools' own output for a URL with such a password (a dead port: the failure is reported)."""
    from lmcache_vllm import cli

    url = f"redis://user:{password}@127.0.0.1:9/0"
    code = cli.main(["ping", "--redis", url, "--timeout", "0.5"])
    out = capsys.readouterr()
    assert code != 0
    assert "127.0.0.1" in out.out + out.err  # the failure is reported, with its address
    for text in (out.out, out.err):
        assert password not in text
