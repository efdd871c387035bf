"""The KV view helper: its vLLM-free copy builds exactly the views vLLM's own `allocate_kv_cache` builds
(same shapes, strides, offsets, dtype and backing size) for every case, and refuses what vLLM refuses."""
import pytest
import torch

from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, all_cases, kv_views, refuses, vllm_kv_views

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: nothing to compare the copy with")


@pytest.mark.parametrize("case", all_cases(include_refused=True), ids=str)
def test_copy_builds_the_views_vllm_builds(case):
    if refuses(case):
        with pytest.raises(ValueError, match="dense, unpadded pages"):
            vllm_kv_views(case)
        with pytest.raises(ValueError, match="dense, unpadded pages"):
            kv_views(case)
        return
    theirs, ours = vllm_kv_views(case), kv_views(case)
    assert len(theirs) == len(ours) == case.num_layers
    for a, b in zip(theirs, ours):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
    # Layers sit the same distance apart in the one backing allocation.
    gaps = lambda views: [v.data_ptr() - views[0].data_ptr() for v in views]  # noqa: E731
    assert gaps(theirs) == gaps(ours)


def test_cases_cover_what_the_issue_names():
    cases = all_cases()
    assert {c.layout for c in cases} == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert any(c.mla for c in cases) and any(c.dtype == torch.uint8 for c in cases)
    assert any(c.kernel_block_size for c in cases)
    lbnhc = kv_views(KVViewCase(layout="LBNHC"))
    assert not lbnhc[0].is_contiguous()  # CUDA's default: not contiguous per layer
