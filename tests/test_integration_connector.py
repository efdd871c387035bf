"""The connector's worker path as vLLM 0.32/0.33 drives it on a CUDA host, run on CPU tensors: a real
`VllmConfig` (the local test model) and the worker-role `LMCacheConnector` built with a `KVCacheConfig`,
`register_kv_caches` with the views vLLM's own `allocate_kv_cache` builds for a FLASH_ATTN-like spec
(LBNHC, the CUDA default, also with kernel block splitting) and an MLA spec, then a save and a load through
the connector's step methods; the chunk size both halves take when none is set (vLLM's block size on its CPU
backend); and the class hooks vLLM 0.33 asks (sleep mode, piecewise CUDA graphs, unregister / restore)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from lmcache_vllm.integration.vllm import LMCacheConnector  # noqa: E402
from lmcache_vllm.integration.vllm.chunk_size import default_chunk_size  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, SaveSpec  # noqa: E402
from lmcache_vllm.integration.vllm.testing.local_model import build_model  # noqa: E402
from lmcache_vllm.layouts import StridedKVLayout  # noqa: E402

try:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

BLOCK, CHUNK, LAYERS, BLOCKS = 32, 64, 4, 16


def vllm_setup(layout: str, extra: dict | None = None):
    cache_config = CacheConfig(block_size=BLOCK)
    cache_config.kv_cache_layout = layout
    transfer = KVTransferConfig(kv_connector="LMCacheConnector", kv_role="kv_both",
                                kv_connector_module_path="lmcache_vllm.integration.vllm",
                                kv_connector_extra_config={"chunk_size": CHUNK, "max_local_cpu_size": 0.02,
                                                           **(extra or {})})
    model = ModelConfig(model=str(build_model("tiny")), dtype="bfloat16", max_model_len=1024, enforce_eager=True)
    return VllmConfig(model_config=model, cache_config=cache_config, kv_transfer_config=transfer)


def allocate(vllm_config, spec, layout: str, kernel_block_size=None):
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(names, spec)],
                                             spec.page_size_bytes * LAYERS * BLOCKS)
    kernel = None if kernel_block_size is None else [kernel_block_size]
    return config, allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], kernel)


def fill(kv_caches):
    raw = torch.empty(0, dtype=torch.uint8).set_(next(iter(kv_caches.values())).untyped_storage())
    raw.copy_(torch.randint(0, 100, raw.shape, generator=torch.Generator().manual_seed(1), dtype=torch.uint8))


SPECS = {
    "flash": lambda: FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16),
    "mla": lambda: MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("kind,layout,kernel", [("flash", "LBNHC", None), ("flash", "LBNHC", 16),
                                                ("flash", "BLNHC", None), ("mla", "LBNHC", None)])
def test_connector_registers_vllms_views_and_round_trips(kind, layout, kernel):
    vllm_config = vllm_setup(layout)
    kv_cache_config, kv_caches = allocate(vllm_config, SPECS[kind](), layout, kernel)
    connector = LMCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        connector.register_kv_caches(kv_caches)
        engine = connector._worker.engine
        assert isinstance(engine.layout, StridedKVLayout) and engine.layout.order == layout
        assert engine.layout.geometry.kv_planes == (1 if kind == "mla" else 2)
        fill(kv_caches)
        tokens = np.arange(1000, 1000 + 2 * CHUNK, dtype=np.int64)
        saved_blocks, loaded_blocks = [3, 7, 1, 12], [5, 0, 9, 14]
        step = LMCacheConnectorMetadata(saves=[SaveSpec(req_id="a", token_ids=tokens, block_ids=saved_blocks,
                                                        skip_leading=0, is_last=True)])
        connector.bind_connector_metadata(step)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        # The next step starts with "a" preempted: its background save finishes before any block is reused.
        connector.handle_preemptions(LMCacheConnectorMetadata(preempted_req_ids=["a"]))
        assert engine.lookup(tokens) == 2 * CHUNK

        step = LMCacheConnectorMetadata(loads=[LoadSpec(req_id="b", token_ids=tokens, block_ids=loaded_blocks,
                                                        skip_leading=0, load_end=len(tokens))])
        connector.bind_connector_metadata(step)
        connector.start_load_kv(None)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        assert connector.get_block_ids_with_load_errors() == set()
        for view in kv_caches.values():  # every byte of every loaded block equals the saved block's
            per_block = view if kernel is None else view.unflatten(0, (BLOCKS, -1))
            for old, new in zip(saved_blocks, loaded_blocks):
                assert torch.equal(per_block[old].view(torch.uint8), per_block[new].view(torch.uint8))
    finally:
        connector.shutdown()


@pytest.mark.parametrize("extra,expected", [({}, BLOCK), ({"chunk_size": 256}, 256), ({"chunk_size": BLOCK}, BLOCK)])
def test_chunk_size_not_set_is_vllms_block_size_in_both_halves(extra, expected, caplog):
    """No chunk_size: the scheduler half and the worker half both take vLLM's block size (on this CPU backend),
    and the scheduler logs the choice once; a chunk_size that is set is honoured."""
    vllm_config = vllm_setup("LBNHC", {"chunk_size": None} if not extra else extra)
    kv_cache_config, kv_caches = allocate(vllm_config, SPECS["flash"](), "LBNHC")
    with caplog.at_level(logging.INFO, logger="lmcache_vllm.integration.vllm.chunk_size"):
        scheduler = LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = LMCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        worker.register_kv_caches(kv_caches)
        assert scheduler._scheduler.chunk_size == worker._worker.engine.keys.chunk_size == expected
        chosen = [r.getMessage() for r in caplog.records if "chunk_size" in r.getMessage()]
        assert len(chosen) == (0 if extra else 1), chosen
        if not extra:
            assert f"chunk_size {BLOCK} (not set): vLLM's block size on its CPU backend" in chosen[0]
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_chunk_size_not_set_on_a_gpu_is_a_multiple_of_the_block_size_near_256():
    assert [default_chunk_size(b, on_cpu=False)[0] for b in (16, 32, 64, 96, 128, 256, 512)] == \
        [256, 256, 256, 288, 256, 256, 512]
    assert [default_chunk_size(b, on_cpu=True)[0] for b in (16, 128, 544)] == [16, 128, 544]
    assert "not measured on a GPU" in default_chunk_size(16, on_cpu=False)[1]
    with pytest.raises(ValueError):
        default_chunk_size(0, on_cpu=True)


def test_vllm_033_hooks():
    assert LMCacheConnector.supports_sleep_mode(None) is False
    assert LMCacheConnector.requires_piecewise_for_cudagraph({"use_layerwise": True}) is True
    assert LMCacheConnector.requires_piecewise_for_cudagraph({}) is False

    vllm_config = vllm_setup("LBNHC")
    kv_cache_config, kv_caches = allocate(vllm_config, SPECS["flash"](), "LBNHC")
    connector = LMCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        connector.register_kv_caches(kv_caches)
        fill(kv_caches)
        tokens = np.arange(5, 5 + CHUNK, dtype=np.int64)
        save = LMCacheConnectorMetadata(saves=[SaveSpec(req_id="a", token_ids=tokens, block_ids=[2, 3],
                                                        skip_leading=0, is_last=True)])
        load = LMCacheConnectorMetadata(loads=[LoadSpec(req_id="b", token_ids=tokens, block_ids=[6, 7],
                                                        skip_leading=0, load_end=CHUNK)])
        connector.unregister_kv_caches()
        connector.unregister_kv_caches()  # idempotent
        preempted = LMCacheConnectorMetadata(preempted_req_ids=["a"])  # a's saves finish first
        connector.bind_connector_metadata(save)
        connector.wait_for_save()  # released cache: nothing is copied
        connector.handle_preemptions(preempted)
        assert connector._worker.engine.lookup(tokens) == 0
        connector.restore_kv_caches()
        connector.bind_connector_metadata(save)
        connector.wait_for_save()
        connector.handle_preemptions(preempted)
        assert connector._worker.engine.lookup(tokens) == CHUNK
        connector.unregister_kv_caches()
        connector.bind_connector_metadata(load)
        connector.start_load_kv(None)  # while released: reported for recompute, nothing written
        assert connector.get_block_ids_with_load_errors() == {6, 7}
        connector.restore_kv_caches()
    finally:
        connector.shutdown()


@pytest.mark.parametrize("role", ["kv_both", "kv_consumer"])
def test_require_chunk_mac_refuses_a_worker_that_would_serve_its_transfer_port_unsigned(role, monkeypatch):
    from lmcache_vllm.config import ConfigError
    from lmcache_vllm.storage.registry import MAC_KEY_ENV

    monkeypatch.delenv(MAC_KEY_ENV, raising=False)
    vllm_config = vllm_setup("LBNHC", {"extra_config": {"require_chunk_mac": True}})
    vllm_config.kv_transfer_config.kv_role = role
    kv_cache_config, _ = allocate(vllm_config, SPECS["flash"](), "LBNHC")
    if role == "kv_consumer":  # pulls, serves no port: starts
        LMCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config).shutdown()
        return
    with pytest.raises(ConfigError, match="transfer port"):
        LMCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
