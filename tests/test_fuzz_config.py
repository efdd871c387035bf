"""Fuzzing the configuration loader (`config.py`, `config_sources.py`, `config_schema.py`): random YAML
files (keys of ours and LMCache's, random values, anchors and aliases, nesting, broken syntax), random
`LMCACHE_*` environment values and random `extra_config` mappings from code. Loading either gives a
configuration or raises one ConfigError; nothing else, and never a hang."""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st

from lmcache_vllm.config import ConfigError, ExtraConfig, LMCacheConfig, load_config
from lmcache_vllm.config.lmcache import LMCACHE_EXTRA_KEYS, LMCACHE_KEYS

pytestmark = pytest.mark.fuzz

TOP_KEYS = sorted({f.name for f in dataclasses.fields(LMCacheConfig)} | set(LMCACHE_KEYS))
EXTRA_KEYS = sorted({f.name for f in dataclasses.fields(ExtraConfig)} | set(LMCACHE_EXTRA_KEYS))
WORDS = ["true", "false", "null", "~", "0", "1", "-1", "256", "1e309", "nan", "5.0", "0.01", "yes", "off",
         "redis://:pw@127.0.0.1:6379/0", "resp://h:1", "unix:///r.sock?db=1", "s3://b", "/tmp/x", "file://rel",
         "xxh3_128", "LRU", "FIFO", "[1, 2]", '{"a": 1}', "{", "'q'", '"', "", " ", "\t", "\x00"]

scalars = st.one_of(st.sampled_from(WORDS), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.booleans(), st.none(), st.text(max_size=12))
# Shallow on purpose: deep and large values are the bounded reader's tests (test_config.py), and
# hypothesis draws nested strategies slowly.
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.sampled_from(["a", "b", ""]), scalars,
                                                                           max_size=2))
extra_maps = st.dictionaries(st.one_of(st.sampled_from(EXTRA_KEYS), st.text(max_size=12)), values, max_size=4)
top_maps = st.dictionaries(st.one_of(st.sampled_from(TOP_KEYS), st.text(max_size=12)),
                           st.one_of(values, extra_maps), max_size=5)


def load(overrides=None, environ=None) -> None:
    try:
        config = load_config(overrides, environ=environ or {})
    except ConfigError as err:
        assert err.problems and str(err)
        return
    assert isinstance(config, LMCacheConfig) and isinstance(config.extra_config, ExtraConfig)
    repr(config), config.summary()  # showing it works too


@st.composite
def yaml_texts(draw):
    """YAML as safe_dump writes it, then sometimes damaged, anchored or nested by hand."""
    mapping = draw(top_maps)
    if draw(st.booleans()):
        mapping["extra_config"] = draw(extra_maps)
    text = yaml.dump(mapping, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), allow_unicode=True)
    trick = draw(st.integers(0, 5))
    if trick == 1:  # anchors and aliases, merge keys
        text = "base: &b {chunk_size: 256, local_cpu: true}\n" + text + "extra: *b\n<<: *b\n"
    elif trick == 2:  # nested deeply
        text += "nested: " + "[" * draw(st.integers(1, 60)) + "]" * 60 + "\n"
    elif trick == 3:  # a byte or line changed
        pos = draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:pos] + draw(st.sampled_from(["\n", ":", "&", "*", "!", "%", "{", "- ", "\t", "'"])) + text[pos:]
    elif trick == 4:
        text = draw(st.text(max_size=200))
    return text


def test_random_yaml_files(tmp_path):
    path = tmp_path / "lmcache.yaml"

    @examples(500)
    @given(yaml_texts())
    def run(text):
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        load(environ={"LMCACHE_CONFIG_FILE": str(path)})

    with bounded_run():
        run()


@examples(400)
@given(st.dictionaries(st.one_of(st.sampled_from(TOP_KEYS), st.text(min_size=1, max_size=10)).map(
    lambda k: "LMCACHE_" + k.upper()), st.one_of(st.sampled_from(WORDS), st.text(max_size=40),
                                                 values.map(str)), max_size=6))
def _random_environment(environ):
    environ = {k: v.replace("\x00", "") for k, v in environ.items() if "\x00" not in k and "=" not in k}
    load(environ=environ)


def test_random_environment_values():
    with bounded_run():
        _random_environment()


@examples(400)
@given(extra_maps, top_maps)
def _random_extra_config(extra, top):
    load({"extra_config": extra})
    load(top)


def test_random_extra_config_from_code():
    with bounded_run():
        _random_extra_config()
