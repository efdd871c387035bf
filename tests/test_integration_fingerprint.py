"""The model fingerprint in cache keys, from vLLM's real config objects for the local test model: the same
model at another path shares keys; another config, override, dtype, weights or namespace does not."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.config import ModelConfig, VllmConfig  # noqa: E402

from lmcache_vllm.identity import SAMPLE_BYTES, weights_signature  # noqa: E402
from lmcache_vllm.integration.vllm.fingerprint import model_identity  # noqa: E402
from lmcache_vllm.integration.vllm.testing.local_model import build_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_model("tiny")


def identity(path, namespace=None, **model_kwargs):
    kwargs = {"dtype": "bfloat16", **model_kwargs}
    return model_identity(VllmConfig(model_config=ModelConfig(model=str(path), **kwargs)), namespace=namespace)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_same_model_at_another_path_shares_the_fingerprint(model_dir, tmp_path):
    here = identity(model_dir)
    there = identity(copy_model(model_dir, tmp_path / "elsewhere" / "renamed-model"))
    assert here == there and here.name == "llama" and len(here.fingerprint) == 32
    assert str(model_dir) not in json.dumps(here.inputs, default=str)  # no path went into it


def test_config_overrides_dtype_and_namespace_change_it(model_dir, tmp_path):
    base = identity(model_dir)
    changed = copy_model(model_dir, tmp_path / "rope")
    config = json.loads((changed / "config.json").read_text())
    if "rope_parameters" in config:
        config["rope_parameters"]["rope_theta"] = 20000.0
    else:
        config["rope_theta"] = 20000.0
    (changed / "config.json").write_text(json.dumps(config))
    others = {
        "config.json": identity(changed).fingerprint,
        "hf_overrides": identity(model_dir, hf_overrides={"rope_theta": 20000.0}).fingerprint,
        "dtype": identity(model_dir, dtype="float32").fingerprint,
        "namespace": identity(model_dir, namespace="tenant-7").fingerprint,
        "chunk MAC": model_identity(VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype="bfloat16")),
                                    mac_keyed=True).fingerprint,
    }
    assert base.fingerprint not in others.values() and len(set(others.values())) == len(others)
    assert identity(model_dir, namespace="tenant-7").name == "tenant-7.llama"


def test_weights_signature_sees_replaced_weights_and_says_what_it_cannot(model_dir, tmp_path):
    copy = copy_model(model_dir, tmp_path / "weights")
    (weights,) = sorted(copy.glob("*.safetensors"))
    base = identity(copy)
    data = bytearray(weights.read_bytes())
    size = len(data)
    data[-10] ^= 0xFF  # inside the last sampled block
    weights.write_bytes(bytes(data))
    assert identity(copy).fingerprint != base.fingerprint
    data[-10] ^= 0xFF
    # A byte between the sampled blocks: the documented blind spot (cache_namespace covers it).
    gap = SAMPLE_BYTES + (size - SAMPLE_BYTES) // 14
    data[gap] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert identity(copy).fingerprint == base.fingerprint
    assert weights_signature([str(weights)])[0][:2] == [weights.name, size]




def test_fp8_kv_cache_scales_are_part_of_it(model_dir):
    from vllm.config import CacheConfig

    config = VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype="bfloat16"),
                        cache_config=CacheConfig(cache_dtype="fp8"))

    class AttentionLayer:  # what vLLM's attention layers expose after loading the checkpoint's scales
        _k_scale_float = 1.0
        _v_scale_float = 1.0

    layer = AttentionLayer()
    config.compilation_config.static_forward_context["model.layers.0.self_attn.attn"] = layer
    fp8 = model_identity(config)
    assert fp8.fingerprint != identity(model_dir).fingerprint  # the KV dtype alone changes it
    layer._k_scale_float = 0.5  # another checkpoint's K scale: its fp8 KV means other numbers
    assert model_identity(config).fingerprint != fp8.fingerprint
