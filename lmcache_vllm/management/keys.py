"""`KeySpace`: what an instance's chunk keys are made of, so token ids and LMCache's object keys become exactly
the keys its requests store and load.

A request's chunk keys come from `tokens.KeyBuilder`: the model's name and fingerprint, the tensor-parallel
size and rank, the KV dtype, the stored format, the chunk size and hash, and the request's extra keys (a
`cache_salt` among them: `extra_keys.for_salt`). Each worker rank reports its builder's template (`of_builder`);
the instance API and the coordinator (which learns it when the instance registers) rebuild the very same
`KeyBuilder` from it (`builder`), so a lookup through either predicts what the next request with those tokens
and that salt loads (tests/test_management_keys.py checks it against the engine's own keys).

LMCache's wire names a chunk of one rank as an `EncodedObjectKey`: its digest (`chunk_hash_hex`), the model
name a client uses, `kv_rank` (world size << 24 | global rank << 16 | local world size << 8 | local rank), an
object group and the salt. `key_of` turns one into our `CacheKey` (the model name must be one of the
instance's `model_names`: vLLM's served names, the model path, or the key's own name); `encode` goes back. As
with LMCache, token ids count from position 0 and only whole chunks have keys; `resolve` orders a prompt's
keys chunk-major, then rank.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Sequence

from lmcache_vllm.extra_keys import for_salt
from lmcache_vllm.management.schemas import BadRequest, EncodedObjectKey
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.tokens import CacheKey, ChunkHasher, KeyBuilder, hash_function


def shared_tier(name: str) -> bool:
    """Whether one of our tiers is a fleet's shared pool (Redis, Mooncake: remote to every instance)."""
    try:
        names = Tier(name).event_names
    except ValueError:
        return False
    return names is not None and names.locality == "REMOTE"


def lmcache_tier(name: str) -> tuple[str, bool]:
    """(LMCache's tier, shared) of one of our tiers: host memory (L1, and its compressed cold part) is `l1`, every
    other tier `l2` (its name is the placement's `backend`)."""
    try:
        names = Tier(name).event_names
    except ValueError:
        names = None
    in_memory = names is not None and names.medium == "CPU" and names.locality == "LOCAL"
    return ("l1" if in_memory else "l2"), shared_tier(name)


def pack_rank(world_size: int, rank: int) -> int:
    """LMCache's kv_rank of a single-node tensor-parallel rank."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


def unpack_rank(kv_rank: int) -> tuple[int, int]:
    """(world size, global rank) of a kv_rank."""
    return (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF


@dataclass(frozen=True)
class KeySpace:
    """See the module docstring. Plain values only: it travels as JSON (`to_json` / `from_json`)."""

    model: str  # CacheKey.model: the readable name in keys
    fingerprint: str
    world_size: int
    kv_dtype: str
    fmt_version: int
    chunk_size: int
    hash_algorithm: str
    pp_size: int = 1
    model_names: tuple[str, ...] = ()

    @classmethod
    def of_builder(cls, keys: KeyBuilder, model_names: Sequence[str] = ()) -> "KeySpace":
        t = keys.template
        return cls(t.model, t.fingerprint, t.world_size, t.kv_dtype, t.fmt_version, keys.chunk_size,
                   keys.hasher.algorithm, t.pp_size, tuple(dict.fromkeys([*model_names, t.model])))

    def with_names(self, names: Sequence[str]) -> "KeySpace":
        return dataclasses.replace(self, model_names=tuple(dict.fromkeys([*names, *self.model_names, self.model])))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "KeySpace":
        """Raises ValueError for anything that is not a key space (it may come from the coordinator's Redis)."""
        try:
            raw: Any = json.loads(text)
            space = cls(**{**raw, "model_names": tuple(raw.get("model_names", ()))})
            space.builder(0)  # every field checked by the key's own validation
            hash_function(space.hash_algorithm)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a key space: {exc}") from None
        if not all(isinstance(n, str) for n in space.model_names):
            raise ValueError("not a key space: model_names")
        if not 1 <= space.world_size <= 255:  # LMCache's kv_rank has 8 bits for it
            raise ValueError("not a key space: world_size")
        return space

    @property
    def digest_bytes(self) -> int:
        return len(hash_function(self.hash_algorithm)(b""))

    def accepts(self, model_name: str, world_size: int) -> bool:
        return world_size == self.world_size and (model_name in self.model_names or model_name == self.model)

    def builder(self, rank: int) -> KeyBuilder:
        return KeyBuilder(self.model, self.world_size, rank, self.kv_dtype, self.fmt_version,
                          ChunkHasher(self.chunk_size, self.hash_algorithm), fingerprint=self.fingerprint,
                          pp_size=self.pp_size)

    def resolve(self, token_ids: Sequence[int], salt: str = "") -> list[CacheKey]:
        """The keys of the whole chunks of `token_ids`, chunk-major then rank (what LMCache's resolver gives)."""
        extra = for_salt(salt)
        per_rank = [[key for key, _, _ in self.builder(rank).keys(list(token_ids), False, extra)]
                    for rank in range(self.world_size)]
        return [per_rank[rank][chunk] for chunk in range(len(per_rank[0])) for rank in range(self.world_size)]

    def key_of(self, encoded: EncodedObjectKey) -> CacheKey:
        """Our key for LMCache's; BadRequest when it cannot be one of this instance's."""
        world_size, rank = unpack_rank(encoded.kv_rank)
        if not self.accepts(encoded.model_name, world_size) or rank >= world_size:
            raise BadRequest(f"key of model {encoded.model_name!r} at kv_rank {encoded.kv_rank}: this instance "
                             f"serves {self.model_names[0] if self.model_names else self.model!r} at world_size "
                             f"{self.world_size}")
        if encoded.object_group_id != 0:
            raise BadRequest("object_group_id: only group 0 (lmcache-vllm keeps one object group)")
        try:
            digest = bytes.fromhex(encoded.chunk_hash_hex)
        except ValueError:
            raise BadRequest("chunk_hash_hex is not hex") from None
        if len(digest) != self.digest_bytes:
            raise BadRequest(f"chunk_hash_hex must be {2 * self.digest_bytes} hex digits ({self.hash_algorithm})")
        return dataclasses.replace(self.builder(rank).template, digest=digest)

    def encode(self, key: CacheKey, model_name: str = "", salt: str = "") -> dict[str, Any]:
        """LMCache's EncodedObjectKey of `key` (named by `model_name`, default the instance's first name)."""
        return {"chunk_hash_hex": key.digest.hex(), "model_name": model_name or self.display_name,
                "kv_rank": pack_rank(key.world_size, key.rank), "object_group_id": 0, "cache_salt": salt}

    @property
    def display_name(self) -> str:
        return self.model_names[0] if self.model_names else self.model

    def same_keys(self, other: "KeySpace") -> bool:
        """Whether two instances' requests store the same keys for the same tokens."""
        return dataclasses.replace(self, model_names=()) == dataclasses.replace(other, model_names=())
