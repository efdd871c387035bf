"""Fuzz (`pytest -m fuzz`) the arguments SGLang's controller hands our HiCache backend (page hashes, host slot
indices, flat pages) on a real SGLang host pool and a real disk tier: every call answers one result per page
(False or 0 for what does not name whole pages of the pool, counted as refused), never raises into SGLang's
thread, and never writes a byte of the pool outside the pages a valid call names."""
from __future__ import annotations

import pytest
import sglang_support as S
import torch
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st

S.import_sglang()

from lmcache_vllm.integration.sglang import LMCacheHiCacheStorage  # noqa: E402

pytestmark = pytest.mark.fuzz

HASH = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
ODD = st.one_of(HASH, st.text(max_size=70), st.just(""), st.just("AB" * 32), st.integers(), st.none())
INDICES = st.one_of(st.lists(st.integers(-(2**40), 2**40), max_size=5 * S.PAGE),
                    st.builds(lambda n: list(range(n)), st.integers(0, 5 * S.PAGE)))


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    pool = S.mha_pool("page_first", seed=41, device_tokens=128)
    extra = {"local_cpu": False, "local_disk": str(tmp_path_factory.mktemp("l3")), "max_local_disk_size": 1}
    backend = LMCacheHiCacheStorage(S.storage_config(S.dynamic(extra)), {})
    backend.register_mem_pool_host(pool)
    yield backend
    backend.close()


@examples(60)
@given(keys=st.lists(ODD, max_size=5), indices=INDICES, as_float=st.booleans(),
       op=st.sampled_from(["set", "get", "exists", "flat_set", "flat_get"]))
def test_fuzz_controller_arguments_are_answered_per_page_and_never_touch_other_slots(backend, keys, indices,
                                                                                    as_float, op):
    pool = backend.pools["kv"].pages.pool
    before = pool.kv_buffer.clone()
    host = torch.tensor(indices, dtype=torch.float32 if as_float else torch.int64)
    with bounded_run():
        if op == "set":
            out = backend.batch_set_v1(keys, host)
        elif op == "get":
            out = backend.batch_get_v1(keys, host)
        elif op == "exists":
            out = backend.batch_exists(keys)
        elif op == "flat_set":
            out = backend.batch_set(keys, [host] * len(keys))
        else:
            out = backend.batch_get(keys, [host.clone() for _ in keys])
    if op == "exists":
        assert isinstance(out, int) and 0 <= out <= len(keys)
    elif op == "flat_set":
        assert isinstance(out, bool)
    else:
        assert isinstance(out, list) and len(out) == len(keys)
    valid = not as_float and len(indices) == len(keys) * S.PAGE and all(
        0 <= s and s % S.PAGE == 0 and s + S.PAGE <= pool.size for s in indices[::S.PAGE])
    if op == "get" and not valid:
        assert torch.equal(pool.kv_buffer, before)  # a refused load writes nothing
    if op in ("set", "get") and not valid:
        assert out == [False] * len(keys)
