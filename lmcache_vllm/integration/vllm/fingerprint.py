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
- a weights signature: per weight file (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`, `*.gguf`) its name,
  size and an xxh3_128 of 8 sampled 64 KiB blocks (the first holds a safetensors header: every tensor's
  name, dtype, shape and offset). It notices replaced files, other shapes and most re-trainings; it
  cannot see a change of weights that keeps every file's size and leaves all sampled blocks alone
  (e.g. a few tensors fine-tuned in place) — set `extra_config.cache_namespace` then;
- `extra_config.cache_namespace`, the user's name for whatever else we cannot see;
- whether chunks carry a MAC (`storage.registry.chunk_mac`): servers without a key never look up, and so
  never delete as unauthenticated, the chunks of servers with one. Not which key: a fleet rotates its key
  (a list of keys, the new one first) without changing a single cache key; fleets with different keys on
  one tier set different `cache_namespace`s (else each deletes the other's chunks as unauthenticated).
The readable name is the HF `model_type` ("llama"), prefixed by the namespace when one is set.
"""
from __future__ import annotations

import enum
import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

FINGERPRINT_SCHEME = "model-fingerprint/v1"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BLOCKS = 8
SAMPLE_BYTES = 64 << 10


@dataclass(frozen=True)
class ModelIdentity:
    """`name` (readable) and `fingerprint` (hex) as they go into keys; `inputs` is what was hashed."""

    name: str
    fingerprint: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _plain(value: Any) -> Any:
    """JSON-able, deterministic form: no addresses, no set order, no path-like bookkeeping keys."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()
                if not str(k).startswith("_") and k != "transformers_version"}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text  # e.g. torch.bfloat16 -> "torch.bfloat16"


def canonical_json(value: Any) -> str:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def weight_files(model: str, revision: str | None = None) -> list[str]:
    """The weight files of `model` on this host: a local directory or file, else the local hub cache
    (never downloads); [] when none are found."""
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(repo_id=model, revision=revision, local_files_only=True)
        except Exception:
            return []
    if os.path.isfile(path):
        return [path]
    return sorted(f for suffix in WEIGHT_SUFFIXES for f in glob.glob(os.path.join(path, f"*{suffix}")))


def weights_signature(files: list[str]) -> list[list[Any]]:
    """[name, size, xxh3_128 of sampled blocks] per file (see the module docstring for its limits)."""
    out = []
    for file in files:
        size = os.path.getsize(file)
        last = max(0, size - SAMPLE_BYTES)
        offsets = sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)})
        sampled = xxhash.xxh3_128()
        with open(file, "rb") as f:
            for offset in offsets:
                sampled.update(os.pread(f.fileno(), SAMPLE_BYTES, offset))
        out.append([os.path.basename(file), size, sampled.hexdigest()])
    return out


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
