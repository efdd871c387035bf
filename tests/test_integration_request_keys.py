"""Extra keys from vLLM's real `Request` objects: multimodal items, LoRA adapters, cache salt, prompt
embeddings; requests whose keys cannot be derived are not cached and are counted."""
from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.extra_keys import NO_EXTRA_KEYS  # noqa: E402
from lmcache_vllm.integration.vllm.request_keys import RequestKeys, UncacheableRequest  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.integration.vllm.testing.local_lora import build_lora  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder  # noqa: E402

CHUNK = 256
PLACEHOLDER = 7  # the same image placeholder token at every image position
TOKENS = list(range(1000, 1100)) + [PLACEHOLDER] * 300 + list(range(2000, 2200))  # 600 tokens


def request(req_id="r", tokens=TOKENS, **kwargs) -> Request:
    return Request(req_id, list(tokens) if tokens is not None else None, SamplingParams(max_tokens=4),
                   None, **kwargs)


def image(identifier, offset=100, length=300) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def keys_of(req: Request, derive: RequestKeys | None = None) -> list[bytes]:
    extra = (derive or RequestKeys(CHUNK)).extra_keys(req)
    builder = KeyBuilder("llama", 1, 0, "bfloat16", 2, ChunkHasher(CHUNK))
    return [k.digest for k, _, _ in builder.keys(req.all_token_ids, include_partial=True, extra=extra)]


def test_plain_request_has_no_extra_keys():
    assert RequestKeys(CHUNK).extra_keys(request()) is NO_EXTRA_KEYS


def test_multimodal_items_decide_the_keys_of_the_chunks_they_touch():
    plain = keys_of(request())
    a = keys_of(request(mm_features=[image("hash-of-image-a")]))
    b = keys_of(request(mm_features=[image("hash-of-image-b")]))
    assert a == keys_of(request(mm_features=[image("hash-of-image-a")]))  # same image: same keys
    # The image covers tokens [100, 400): chunk 0 already; every chunk differs between images.
    assert all(x != y for x, y in zip(a, b)) and all(x != y for x, y in zip(a, plain))
    # The same image later in the prompt (placeholders of equal length): other keys.
    moved = keys_of(request(tokens=list(range(1000, 1150)) + [PLACEHOLDER] * 300 + list(range(2000, 2150)),
                            mm_features=[image("hash-of-image-a", offset=150)]))
    assert moved[0] != a[0]


def test_multimodal_item_only_after_the_first_chunk_keeps_chunk_zero_shared():
    tokens = list(range(1000, 1300)) + [PLACEHOLDER] * 200 + list(range(2000, 2100))
    a = keys_of(request(tokens=tokens, mm_features=[image("a", offset=300, length=200)]))
    b = keys_of(request(tokens=tokens, mm_features=[image("b", offset=300, length=200)]))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_unidentified_multimodal_item_is_not_cached_and_counted():
    with pytest.raises(UncacheableRequest) as info:
        RequestKeys(CHUNK).extra_keys(request(mm_features=[image("")]))
    assert info.value.reason == "mm_unidentified"

    from lmcache_vllm.integration.vllm.lookup import LookupAnswer

    class Lookups:
        calls = 0

        def lookup(self, query):
            self.calls += 1
            return LookupAnswer(512, ("local_cpu", "local_cpu"))

    lookups = Lookups()
    half = SchedulerHalf(LMCacheConfig(chunk_size=CHUNK), block_size=128, lookup_client=lookups,
                         can_load=True, can_save=True)
    for i in range(3):
        assert half.get_num_new_matched_tokens(request(f"r{i}", mm_features=[image("")]), 0) == (0, False)
    assert lookups.calls == 0  # never looked up by its tokens alone
    assert metrics.value("uncacheable_requests", reason="mm_unidentified") == 3
    assert half.get_num_new_matched_tokens(request("plain"), 0) == (512, False)


def test_cache_salt_separates_tenants_from_the_first_chunk():
    plain = keys_of(request())
    a = keys_of(request(cache_salt="tenant-a"))
    b = keys_of(request(cache_salt="tenant-b"))
    assert a == keys_of(request(cache_salt="tenant-a"))
    assert all(x != y for x, y in zip(a, b)) and all(x != y for x, y in zip(a, plain))


def test_lora_keys_follow_adapter_name_and_weights_not_id_or_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 2, '
                                       '"num_key_value_heads": 1, "num_hidden_layers": 2}')
    one = build_lora(model, tmp_path / "one", seed=1)
    two = build_lora(model, tmp_path / "two", seed=2)
    copy = tmp_path / "elsewhere" / "one-copy"
    copy.parent.mkdir()
    shutil.copytree(one, copy)  # the same adapter on another host / at another path
    derive = RequestKeys(CHUNK)

    def lora(name, path, int_id=1):
        return keys_of(request(lora_request=LoRARequest(name, int_id, str(path))), derive)

    base = lora("sql", one)
    assert base == lora("sql", one, int_id=7)  # another server numbers its adapters differently
    assert base == lora("sql", copy)  # the path is not the identity; the files are
    assert base != lora("sql", two)  # other weights under the same name
    assert base != lora("chat", one)  # the name is part of the identity
    assert base != keys_of(request())
    # Weights replaced under the same path: the digest follows (size/mtime changed -> re-read).
    build_lora(model, one, seed=3, rank=4)
    assert lora("sql", one) != base


def test_lora_without_readable_weights_is_not_cached(tmp_path):
    derive = RequestKeys(CHUNK)
    for path in (tmp_path / "missing", "org/not-downloaded-adapter"):
        with pytest.raises(UncacheableRequest) as info:
            derive.extra_keys(request(lora_request=LoRARequest("x", 1, str(path))))
        assert info.value.reason == "lora_unreadable"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text("{}")
    with pytest.raises(UncacheableRequest):
        derive.extra_keys(request(lora_request=LoRARequest("x", 1, str(empty))))


def test_prompt_embeds_are_keyed_by_the_embeddings_per_chunk():
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(600, 32, generator=gen).to(torch.bfloat16)
    other = embeds.clone()
    other[450] += 1  # differs in chunk 1 only
    a = keys_of(request(tokens=None, prompt_embeds=embeds))
    b = keys_of(request(tokens=None, prompt_embeds=other))
    assert len(a) == 3 and a == keys_of(request(tokens=None, prompt_embeds=embeds.clone()))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    # Placeholder token ids are all zero: without the embeddings every such prompt would share keys.
    assert keys_of(request(tokens=[0] * 600)) != a


def test_extra_keys_travel_with_lookup_load_and_save():
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from lmcache_vllm.integration.vllm.lookup import LookupAnswer

    class Lookups:
        extras = []

        def lookup(self, query):
            self.extras.append(query.extra)
            return LookupAnswer(512, ("local_cpu", "local_cpu"))

    lookups = Lookups()
    half = SchedulerHalf(LMCacheConfig(chunk_size=CHUNK), block_size=128, lookup_client=lookups,
                         can_load=True, can_save=True)
    req = request("salted", tokens=list(range(100, 900)), cache_salt="tenant-a")
    n, _ = half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, n)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(range(7)),))]
    out.scheduled_new_reqs[0].num_computed_tokens = 512
    out.num_scheduled_tokens = {req.request_id: 800 - 512}
    meta = half.build_connector_meta(out)
    (extra,) = lookups.extras
    assert extra.prefix and extra == RequestKeys(CHUNK).extra_keys(req)
    assert meta.loads[0].extra is extra and meta.saves[0].extra is extra
