"""The extra keys of a vLLM `Request`: what besides its token ids decides its KV, as an `ExtraKeys`.

Mirrors what vLLM's own prefix cache keys on (`vllm/v1/core/kv_cache_utils.py:
generate_block_hash_extra_keys`), in bytes that are the same in every process and on every host:
- LoRA: the adapter's NAME and a digest of its files (`adapter_config.json`, `adapter_model.*`,
  `new_embeddings.*`; cached per path, re-read when a file's size or mtime changes) -> request prefix.
  Not the integer id (another server numbers adapters differently) and not the path (another host
  keeps them elsewhere; a file replaced under the same path changes the digest).
- `cache_salt` -> request prefix, so it enters chunk 0 and every later chunk (vLLM: the first block).
- multimodal: per item its `identifier` (vLLM's hash of the item's data, or the user's uuid) over its
  placeholder range -> a span; the chunk's relative offset is added by `tokens.py`.
- prompt embeddings: the embeddings are hashed per chunk range (BLAKE3 of the tensor bytes, as vLLM
  hashes them per block with sha256 but ~5x faster here, plus the token/embedding position mask of mixed
  prompts) -> one span per chunk; so `prompt_embeds` requests ARE cached, and another embedding tensor
  never shares their keys.

A request whose extra keys cannot be derived (a multimodal item without identifier or with an empty
range, a LoRA adapter whose files cannot be read here) raises `UncacheableRequest`: the scheduler then
neither looks it up nor saves it, and counts it. It is never keyed by its tokens alone.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from typing import TYPE_CHECKING

import blake3
import torch

from lmcache_vllm.extra_keys import LORA_TAG, NO_EXTRA_KEYS, SALT_TAG, ExtraKeys, ExtraSpan
from lmcache_vllm.extra_keys import prefix_item as _item

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_LORA_FILE_PREFIXES = ("adapter_config.json", "adapter_model.", "new_embeddings.")


class UncacheableRequest(Exception):
    """The request's KV depends on something we cannot name in a key; `reason` is a short tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _tensor_bytes(tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class LoraDigests:
    """sha256 over an adapter's files (name, size, content), cached per resolved path and file stamps."""

    def __init__(self):
        self._cache: dict[tuple, bytes] = {}
        self._lock = threading.Lock()

    @staticmethod
    def resolve(lora_path: str) -> str | None:
        """A local directory (or file) for `lora_path`; a hub id only when already in the local cache."""
        if not lora_path:
            return None
        path = os.path.expanduser(lora_path)
        if os.path.exists(path):
            return os.path.abspath(path)
        try:  # never downloads: the worker loads the adapter, we only read what is already here
            from huggingface_hub import snapshot_download

            return snapshot_download(repo_id=lora_path, local_files_only=True)
        except Exception:
            return None

    def digest(self, lora_path: str) -> bytes:
        path = self.resolve(lora_path)
        if path is None:
            raise UncacheableRequest("lora_unreadable", f"LoRA adapter {lora_path!r} is not on this host")
        try:
            if os.path.isdir(path):
                names = sorted(n for n in os.listdir(path) if n.startswith(_LORA_FILE_PREFIXES))
                files = [os.path.join(path, n) for n in names]
            else:
                files = [path]
            stamps = tuple((f, st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
        except OSError as exc:
            raise UncacheableRequest("lora_unreadable", f"LoRA adapter {lora_path!r}: {exc}") from None
        if os.path.isdir(path) and not any(os.path.basename(f).startswith("adapter_model.")
                                           for f, _, _ in stamps):
            raise UncacheableRequest("lora_unreadable", f"no adapter weights file in {path!r}")
        with self._lock:
            cached = self._cache.get(stamps)
        if cached is not None:
            return cached
        sha = hashlib.sha256()
        try:
            for file, size, _ in stamps:
                sha.update(_item(b"f", os.path.basename(file).encode()) + struct.pack("<Q", size))
                with open(file, "rb") as f:
                    sha.update(hashlib.file_digest(f, "sha256").digest())
        except OSError as exc:
            raise UncacheableRequest("lora_unreadable", f"LoRA adapter {lora_path!r}: {exc}") from None
        digest = sha.digest()
        with self._lock:
            self._cache[stamps] = digest
        return digest


class RequestKeys:
    """Derives `ExtraKeys` from vLLM `Request`s (one instance per scheduler; `chunk_size` as stored)."""

    def __init__(self, chunk_size: int, lora_digests: LoraDigests | None = None):
        self.chunk_size = chunk_size
        self.lora_digests = lora_digests or LoraDigests()

    def extra_keys(self, request: "Request") -> ExtraKeys:
        """The request's `ExtraKeys` (`NO_EXTRA_KEYS` for plain text); raises `UncacheableRequest`."""
        lora = request.lora_request
        salt = request.cache_salt
        mm_features = request.mm_features
        embeds = request.prompt_embeds
        if not (lora or salt or mm_features or embeds is not None):
            return NO_EXTRA_KEYS
        prefix = b""
        if lora:
            prefix += _item(LORA_TAG, _item(b"n", lora.lora_name.encode()) +
                            _item(b"d", self.lora_digests.digest(lora.lora_path)))
        if salt:
            prefix += _item(SALT_TAG, str(salt).encode())
        spans = [self._mm_span(feature) for feature in mm_features or ()]
        if embeds is not None:
            spans.extend(self._embeds_spans(request, embeds))
        return ExtraKeys(prefix, tuple(spans))

    @staticmethod
    def _mm_span(feature) -> ExtraSpan:
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not identifier or position is None:
            raise UncacheableRequest("mm_unidentified",
                                     f"multimodal item ({getattr(feature, 'modality', '?')}) has no identifier")
        offset, length = int(position.offset), int(position.length)
        if offset < 0 or length <= 0:
            raise UncacheableRequest("mm_unidentified", f"multimodal item at [{offset}, +{length})")
        return ExtraSpan(offset, offset + length, _item(b"mm", str(identifier).encode()))

    def _embeds_spans(self, request: "Request", embeds: torch.Tensor) -> list[ExtraSpan]:
        mask = request.prompt_is_token_ids
        num = int(embeds.shape[0])
        head = _item(b"pe", f"{embeds.dtype}/{tuple(embeds.shape[1:])}".encode())
        spans = []
        for start in range(0, num, self.chunk_size):
            end = min(start + self.chunk_size, num)
            data = blake3.blake3(_tensor_bytes(embeds[start:end])).digest()
            if mask is not None:
                data += bytes(bool(m) for m in mask[start:end])
            spans.append(ExtraSpan(start, end, head + data))
        return spans
