"""The model's identity in cache keys: a short readable name plus a fingerprint of what decides its KV.

Computed once per worker at start-up (`model_identity(vllm_config)`, after the weights are loaded, so
fp8 KV scales are known) and put into every `CacheKey` (`model@fingerprint@...`). The fingerprint is the
first 16 bytes (hex) of sha256 over the canonical JSON of ("model-fingerprint/v1"):
- the EFFECTIVE Hugging Face config (`model_config.hf_config` after `hf_overrides`: architecture, sizes,
  rope scaling/theta, quantization_config, ...), without path-like or bookkeeping entries (keys
  starting with "_", `transformers_version`), so the same model at two paths or on two hosts shares keys;
- revision, dtype, quantization method, load format (and the seed for dummy weights);
- KV cache dtype, the layers it skips, and every attention layer's static K/V scales when the KV cache
  is quantized (fp8);
- a weights signature (`lmcache_vllm/identity.py`, shared with the SGLang integration): per weight file its
  name, size and an xxh3_128 of 8 sampled 64 KiB blocks. It cannot see a change of weights that keeps every
  file's size and leaves all sampled blocks alone (e.g. a few tensors fine-tuned in place) — set
  `extra_config.cache_namespace` then;
- `extra_config.cache_namespace`, the user's name for whatever else we cannot see;
- whether chunks carry a MAC (`storage.registry.chunk_mac`): servers without a key never look up, and so
  never delete as unauthenticated, the chunks of servers with one. Not which key: a fleet rotates its key
  (a list of keys, the new one first) without changing a single cache key; fleets with different keys on
  one tier set different `cache_namespace`s (else each deletes the other's chunks as unauthenticated).
The readable name is the HF `model_type` ("llama"), prefixed by the namespace when one is set.
"""
from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from lmcache_vllm.identity import ModelIdentity, canonical_json, weight_files, weights_signature
from lmcache_vllm.identity import plain as _plain

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

FINGERPRINT_SCHEME = "model-fingerprint/v1"


def _kv_scales(vllm_config: "VllmConfig") -> list[list[Any]]:
    """[layer name, k scale, v scale] of every attention layer (their static fp8 KV scales)."""
    scales = []
    for name, layer in sorted(vllm_config.compilation_config.static_forward_context.items()):
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if k is not None or v is not None:
            scales.append([name, k, v])
    return scales


def model_identity(vllm_config: "VllmConfig", namespace: str | None = None,
                   mac_keyed: bool = False) -> ModelIdentity:
    """The identity of the model vLLM serves (see the module docstring)."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    cache_dtype = str(cache_config.cache_dtype)
    inputs: dict[str, Any] = {
        "scheme": FINGERPRINT_SCHEME,
        "hf_config": model_config.hf_config.to_dict(),
        "revision": model_config.revision,
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "load_format": load_format,
        "kv_cache_dtype": cache_dtype,
        "kv_cache_dtype_skip_layers": list(getattr(cache_config, "kv_cache_dtype_skip_layers", []) or []),
        "namespace": namespace or "",
        "chunk_mac": "keyed" if mac_keyed else "",
    }
    if load_format == "dummy":
        inputs["seed"] = model_config.seed  # dummy weights are drawn from it
    else:
        files = weight_files(str(model_config.model), model_config.revision)
        if not files:
            logger.warning("no weight files of %s found on this host: keys rely on its config and "
                           "revision only (set extra_config.cache_namespace to tell versions apart)",
                           model_config.model)
        inputs["weights"] = weights_signature(files)
    if cache_dtype != "auto" and cache_dtype != str(model_config.dtype).removeprefix("torch."):
        inputs["kv_scales"] = _kv_scales(vllm_config)
    inputs = _plain(inputs)  # exactly what is hashed (no paths, no bookkeeping keys)
    fingerprint = hashlib.sha256(canonical_json(inputs).encode()).hexdigest()[:32]
    model_type = str(getattr(model_config.hf_config, "model_type", "") or "model")
    name = f"{namespace}.{model_type}" if namespace else model_type
    return ModelIdentity(name=name, fingerprint=fingerprint, inputs=inputs)
