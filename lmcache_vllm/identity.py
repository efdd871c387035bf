"""What the integrations put into a model's fingerprint, engine-neutral: `ModelIdentity` (the readable name and
the fingerprint that go into every `tokens.CacheKey`), `canonical_json` (the deterministic JSON that is hashed)
and the weights signature of a model's files on this host (`weight_files`, `weights_signature`).

vLLM's fingerprint (integration/vllm/fingerprint.py) and SGLang's page namespace (integration/sglang/keys.py)
both build on these, so the same rules decide what a key's fingerprint sees in either engine.

The weights signature: per weight file (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`, `*.gguf`) its name, size
and an xxh3_128 of 8 sampled 64 KiB blocks (the first holds a safetensors header: every tensor's name, dtype,
shape and offset). It notices replaced files, other shapes and most re-trainings; it cannot see a change of
weights that keeps every file's size and leaves all sampled blocks alone (e.g. a few tensors fine-tuned in
place): set `extra_config.cache_namespace` then.
"""
from __future__ import annotations

import enum
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BLOCKS = 8
SAMPLE_BYTES = 64 << 10


@dataclass(frozen=True)
class ModelIdentity:
    """`name` (readable) and `fingerprint` (hex) as they go into keys; `inputs` is what was hashed."""

    name: str
    fingerprint: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def plain(value: Any) -> Any:
    """JSON-able, deterministic form: no addresses, no set order, no path-like bookkeeping keys."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()
                if not str(k).startswith("_") and k != "transformers_version"}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "to_dict"):
        return plain(value.to_dict())
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text  # e.g. torch.bfloat16 -> "torch.bfloat16"


def canonical_json(value: Any) -> str:
    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"))


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
