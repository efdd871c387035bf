"""Token ids (+ extra keys) -> chunk boundaries -> prefix-chain digests -> `CacheKey`s, identical in
every process.

Scheme (format "tokens/v1" with "extras/v1"; a change of it must change `TOKEN_HASH_SCHEME` /
`EXTRA_KEYS_SCHEME` and the test vectors):
- Tokens are cut into chunks of `chunk_size`; the last, shorter chunk is included only on request.
- Token ids are hashed as little-endian int64 (8 bytes each), so any id a tokenizer produces is
  representable and no range check is needed; a numpy array / torch tensor is converted to those bytes
  by numpy, a list by one `struct.pack` call — never a per-token Python loop.
- digest[0] = H(root || bytes(chunk 0) || extra(0)), digest[i] = H(digest[i-1] || bytes(chunk i) ||
  extra(i)), where root = H(b"lmcache-vllm/tokens/v1"). A digest therefore names the whole prefix up to
  its chunk end: two prompts share digest i exactly when they share the first (i+1) chunks and their
  extra keys.
- extra(i) is empty for plain text (so plain-text digests are exactly the "tokens/v1" ones and cost
  nothing more). A request whose KV depends on more than its token ids (LoRA adapter, multimodal item,
  cache salt, prompt embeddings) describes that as `ExtraKeys`: request-level `prefix` bytes, which enter
  chunk 0 (and through the chain every later chunk), and `ExtraSpan(start, end, data)`s, which enter
  every chunk they overlap, with their offsets relative to the chunk start. extra(i) is the canonical
  item list (`P` + u32 length + prefix for chunk 0; `S` + i64 rel. start + i64 rel. end + u32 length +
  data per overlapping span, in span order) followed by u32 total length + b"LMX1". That trailer read as
  a little-endian int64 is >= 3.5e18, never a token id, so a digest with extras never equals one of a
  plain token sequence. No pickle, no `hash()`: the bytes are the same in every process.
- H is one of `SUPPORTED_HASH_ALGORITHMS`: "sha256" (default), "blake3" (both cryptographic) or "xxh3_128"
  (128-bit, not collision-resistant). A digest names a prefix in L1, which every tenant of an instance
  shares (and in any shared tier): with a digest one can collide, two different prompts can be made to name
  the same chunks, and one is then served the other's KV. So the default is cryptographic, as vLLM's own
  prefix cache (sha256) is. sha256 over 1 KiB chunks runs on the CPU's SHA instructions: a prompt's keys
  take about 1.5x xxh3_128's time, under 1 us more per chunk (`benchmarks/bench_chunk_digest.py`), less
  than blake3's Python binding at this size. xxh3_128 is for a deployment with no untrusted tenant.
  Python's `hash()` is never used, so keys do not depend on PYTHONHASHSEED or on vLLM's per-process
  block-hash seed.

`CacheKey` adds what makes a stored chunk usable: a short model name and the model fingerprint (see
`integration/vllm/fingerprint.py`), tensor- and pipeline-parallel size and rank, KV dtype, stored-format
version and, for a model whose layers vLLM splits into several KV cache groups, the group (`engine/kv_groups.py`:
which kind of layers, which layers). `to_str()` gives a string safe for file names and Redis keys; a key
without a group (every single-group model) reads exactly as before groups existed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Callable, Sequence, Union
from urllib.parse import quote, unquote

import numpy as np

from lmcache_vllm.config import HASH_ALGORITHMS, LMCacheConfig
from lmcache_vllm.extra_keys import ExtraKeys

try:
    import torch
except ImportError:  # tokens.py works on plain lists / numpy arrays too
    torch = None  # type: ignore[assignment]  # the module or None, tested before use

TOKEN_HASH_SCHEME = "tokens/v1"
TOKEN_BYTES = 8  # little-endian int64 per token id
_hash_default = LMCacheConfig.__dataclass_fields__["pre_caching_hash_algorithm"].default
if not isinstance(_hash_default, str):
    raise RuntimeError("LMCacheConfig.pre_caching_hash_algorithm has no default name")
DEFAULT_HASH_ALGORITHM: str = _hash_default


def _xxh3_128() -> Callable[[bytes], bytes]:
    import xxhash
    return xxhash.xxh3_128_digest


def _blake3() -> Callable[[bytes], bytes]:
    import blake3
    return lambda data: blake3.blake3(data).digest()


def _sha256() -> Callable[[bytes], bytes]:
    sha256 = hashlib.sha256
    return lambda data: sha256(data).digest()


_HASH_FACTORIES = {"xxh3_128": _xxh3_128, "blake3": _blake3, "sha256": _sha256}
SUPPORTED_HASH_ALGORITHMS = HASH_ALGORITHMS  # the configuration's list; implemented here, exactly
if set(_HASH_FACTORIES) != set(HASH_ALGORITHMS):
    raise RuntimeError(f"tokens.py implements {sorted(_HASH_FACTORIES)}, the configuration offers "
                       f"{sorted(HASH_ALGORITHMS)}")

TokenIds = Union[Sequence[int], np.ndarray, "torch.Tensor"]


def hash_function(algorithm: str) -> Callable[[bytes], bytes]:
    """Returns `bytes -> digest` for a supported algorithm name."""
    try:
        factory = _HASH_FACTORIES[algorithm]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; supported: "
                         f"{', '.join(SUPPORTED_HASH_ALGORITHMS)}") from None
    return factory()


def token_bytes(tokens: TokenIds) -> memoryview:
    """Token ids as one contiguous little-endian int64 buffer (vectorised; no per-token loop)."""
    if torch is not None and isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got a {tokens.dtype} tensor")
        tokens = tokens.detach().to("cpu", torch.int64).numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a numpy array of {tokens.dtype}")
        array = np.ascontiguousarray(tokens, dtype="<i8")
        if array.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got shape {array.shape}")
        return array.data.cast("B")
    # A list (what vLLM hands over): struct packs it in C about twice as fast as numpy or array.array
    # convert it (measured: 150-200 vs 60-80 Mtokens/s for 300-4000 tokens).
    try:
        return memoryview(struct.Struct(f"<{len(tokens)}q").pack(*tokens))
    except struct.error as exc:
        raise TypeError(f"token ids must be a 1-D sequence of int64 values: {exc}") from None


class ChunkHasher:
    """Cuts token ids into `chunk_size` chunks and computes their prefix-chain digests."""

    def __init__(self, chunk_size: int, algorithm: str = DEFAULT_HASH_ALGORITHM):
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.algorithm = algorithm
        self._hash = hash_function(algorithm)
        self.root = self._hash(b"lmcache-vllm/" + TOKEN_HASH_SCHEME.encode())

    def spans(self, num_tokens: int, include_partial: bool = False) -> list[tuple[int, int]]:
        """[start, end) of each chunk of a `num_tokens`-long sequence."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        cs = self.chunk_size
        end = num_tokens if include_partial else num_tokens - num_tokens % cs
        return [(s, min(s + cs, end)) for s in range(0, end, cs)]

    def digests(self, tokens: TokenIds, include_partial: bool = False,
                extra: ExtraKeys | None = None) -> list[bytes]:
        """One digest per chunk (see `spans`), each naming the whole prefix up to the chunk's end
        together with the `extra` keys of every chunk up to it."""
        return self._digests_of(token_bytes(tokens), include_partial, extra)

    def _digests_of(self, data: memoryview, include_partial: bool,
                    extra: ExtraKeys | None = None) -> list[bytes]:
        num_tokens = len(data) // TOKEN_BYTES
        step = self.chunk_size * TOKEN_BYTES
        end = len(data) if include_partial else num_tokens // self.chunk_size * step
        h = self._hash
        parent = self.root
        out = []
        if not extra:  # plain text: the "tokens/v1" chain, nothing added
            for offset in range(0, end, step):
                parent = h(parent + data[offset:offset + step])
                out.append(parent)
            return out
        extras = extra.by_chunk(self.chunk_size, num_tokens)
        for index, offset in enumerate(range(0, end, step)):
            chunk_extra = extras.get(index)
            if chunk_extra is None:
                parent = h(parent + data[offset:offset + step])
            else:  # one more concatenation, no extra hash
                parent = h(parent + data[offset:offset + step] + chunk_extra)
            out.append(parent)
        return out


_KEY_RE = re.compile(r"^([^@]+)@([0-9a-f]*|-)@tp(\d+)\.(\d+)@pp(\d+)\.(\d+)@([^@]+)@v(\d+)"
                     r"(?:@g-([a-z0-9.-]+))?@([0-9a-f]+)$")
_GROUP_RE = re.compile(r"^[a-z0-9.-]*$")  # a group tag: safe in file names and Redis keys as it is


@dataclass(frozen=True)
class CacheKey:
    """Identifies one stored chunk: whose KV (model and its fingerprint, TP/PP layout, dtype, format)
    for which prefix."""

    model: str  # short readable name (e.g. the HF model_type); the fingerprint is the identity
    world_size: int  # tensor-parallel size and rank
    rank: int
    kv_dtype: str
    fmt_version: int
    digest: bytes
    fingerprint: str = dataclasses.field(default="", kw_only=True)  # hex; "" = none given
    pp_size: int = dataclasses.field(default=1, kw_only=True)  # pipeline-parallel size and rank
    pp_rank: int = dataclasses.field(default=0, kw_only=True)
    # The KV cache group whose layers the chunk holds (`kv_groups.KVGroup.tag`); "" = all layers of the model.
    group: str = dataclasses.field(default="", kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty str, got {self.model!r}")
        if not isinstance(self.fingerprint, str) or not _is_hex(self.fingerprint):
            raise ValueError(f"fingerprint must be a lowercase hex str, got {self.fingerprint!r}")
        if not isinstance(self.kv_dtype, str) or not self.kv_dtype:
            raise ValueError(f"kv_dtype must be a non-empty str, got {self.kv_dtype!r}")
        for size, rank, what in ((self.world_size, self.rank, "rank"), (self.pp_size, self.pp_rank, "pp_rank")):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"parallel size must be an int >= 1, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"{what} must be an int in [0, {size}), got {rank!r}")
        if not isinstance(self.fmt_version, int) or self.fmt_version < 0:
            raise ValueError(f"fmt_version must be an int >= 0, got {self.fmt_version!r}")
        if not isinstance(self.digest, bytes) or not self.digest:
            raise ValueError(f"digest must be non-empty bytes, got {self.digest!r}")
        if not isinstance(self.group, str) or not _GROUP_RE.match(self.group):
            raise ValueError(f"group must be a str of [a-z0-9.-], got {self.group!r}")

    def to_str(self) -> str:
        """`model@fingerprint@tp<size>.<rank>@pp<size>.<rank>@kv_dtype@v<fmt>[@g-<group>]@<hex digest>`
        (fingerprint "-" when none; the group part only for a chunk of one KV cache group of a multi-group
        model); model and dtype percent-escaped, so the string holds no '/', '@' or ':' of its own and is
        safe as a file name or Redis key."""
        return _key_prefix(self.model, self.fingerprint, self.world_size, self.rank, self.pp_size, self.pp_rank,
                           self.kv_dtype, self.fmt_version, self.group) + self.digest.hex()

    @classmethod
    def from_str(cls, s: str) -> "CacheKey":
        match = _KEY_RE.match(s) if isinstance(s, str) else None
        if match is None:
            raise ValueError(f"not a CacheKey string: {s!r}")
        model, fingerprint, tp, rank, pp, pp_rank, kv_dtype, fmt, group, digest = match.groups()
        try:
            return cls(unquote(model), int(tp), int(rank), unquote(kv_dtype), int(fmt), bytes.fromhex(digest),
                       fingerprint="" if fingerprint == "-" else fingerprint, pp_size=int(pp),
                       pp_rank=int(pp_rank), group=group or "")
        except ValueError as exc:
            raise ValueError(f"not a CacheKey string: {s!r} ({exc})") from None

    def with_rank(self, rank: int) -> "CacheKey":
        return dataclasses.replace(self, rank=rank)

    def __str__(self) -> str:
        return self.to_str()


@functools.lru_cache(maxsize=1024)
def _key_prefix(model: str, fingerprint: str, world_size: int, rank: int, pp_size: int, pp_rank: int,
                kv_dtype: str, fmt_version: int, group: str) -> str:
    """Everything of `CacheKey.to_str` before the digest: the same for every chunk of one engine, so built once
    (every lookup, load and save names its chunks by these strings)."""
    group_part = f"@g-{group}" if group else ""
    return (f"{quote(model, safe='')}@{fingerprint or '-'}@tp{world_size}.{rank}@pp{pp_size}.{pp_rank}"
            f"@{quote(kv_dtype, safe='')}@v{fmt_version}{group_part}@")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def dtype_name(dtype: object) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; the spelling stored in keys."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


class KeyBuilder:
    """Turns token ids (+ extra keys) into `(CacheKey, start, end)` for one model / TP and PP rank /
    KV dtype / format / KV cache group."""

    def __init__(self, model: str, world_size: int, rank: int, kv_dtype: object, fmt_version: int,
                 hasher: ChunkHasher, *, fingerprint: str = "", pp_size: int = 1, pp_rank: int = 0,
                 group: str = "") -> None:
        self.hasher = hasher
        self.template = CacheKey(model, world_size, rank, dtype_name(kv_dtype), fmt_version, b"\0",
                                 fingerprint=fingerprint, pp_size=pp_size, pp_rank=pp_rank, group=group)
        self._fields = dict(self.template.__dict__)

    def for_group(self, group: str, kv_dtype: object = None) -> "KeyBuilder":
        """The same keys for another KV cache group's chunks (another tag, optionally another dtype)."""
        t = self.template
        return KeyBuilder(t.model, t.world_size, t.rank, t.kv_dtype if kv_dtype is None else kv_dtype,
                          t.fmt_version, self.hasher, fingerprint=t.fingerprint, pp_size=t.pp_size,
                          pp_rank=t.pp_rank, group=group)

    @property
    def chunk_size(self) -> int:
        return self.hasher.chunk_size

    def keys(self, tokens: TokenIds, include_partial: bool = False,
             extra: ExtraKeys | None = None) -> list[tuple[CacheKey, int, int]]:
        data = token_bytes(tokens)
        digests = self.hasher._digests_of(data, include_partial, extra)
        n = len(data) // TOKEN_BYTES
        fields = self._fields
        cs = self.hasher.chunk_size
        new = object.__new__
        out = []
        for i, digest in enumerate(digests):
            # The template was validated once; filling instances directly is 5x faster than __init__.
            key = new(CacheKey)
            attrs = key.__dict__
            attrs.update(fields)
            attrs["digest"] = digest
            start = i * cs
            out.append((key, start, min(start + cs, n)))
        return out
