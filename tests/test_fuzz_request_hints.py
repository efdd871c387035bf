"""Fuzzing the per-request hints (`integration/vllm/request_hints.py`): any JSON a client can put into
kv_transfer_params, with and without our `lmcache.` keys, is parsed without raising into hints within range."""
from __future__ import annotations

import pytest
from fuzzing import examples
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from lmcache_vllm.integration.vllm.request_hints import (  # noqa: E402
    MAX_PIN_TOKENS,
    PIN_TOKENS,
    SKIP_SAVE,
    RequestHints,
    parse_hints,
)

pytestmark = pytest.mark.fuzz
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner,
                                                                                 max_size=4), max_leaves=12)
KEYS = st.sampled_from([SKIP_SAVE, PIN_TOKENS, "lmcache.tag.user", "lmcache.", "do_remote_decode"]) | st.text()


@examples(400)
@given(params=JSON | st.dictionaries(KEYS, JSON, max_size=6), pins=st.booleans())
def test_any_params_parse_into_hints_in_range(params, pins):
    hints, refused = parse_hints(params, pins_enabled=pins)
    assert isinstance(hints, RequestHints) and isinstance(hints.skip_save, bool)
    assert type(hints.pin_tokens) is int and 0 <= hints.pin_tokens <= MAX_PIN_TOKENS
    assert pins or hints.pin_tokens == 0
    assert set(refused) <= {"malformed", "unknown", "bad_skip_save", "bad_pin_tokens", "pins_disabled"}
