"""The request bodies of the management API and the coordinator, with LMCache's field names and our bounds.

Every body is a pydantic model that forbids unknown fields (LMCache ignores most of them; a misspelt `force`
silently ignored is how a delete does what nobody asked, so here it is a 422). Types are strict: `"2"` is not
a world size, `true` not a token id. What LMCache checks after parsing is checked here too, with its status
code, 400 (`BadRequest`): the cache salt (at most 128 characters, none of `@ / \\ NUL`), a model name without
`@`, at most `MAX_TOKEN_IDS` token ids and `MAX_KEYS` keys per call. The caps make the largest accepted body
about 8 MB, under the servers' `MAX_BODY_BYTES` (beyond it: 413 before anything is parsed).
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Literal, Optional, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_TOKEN_IDS = 1_000_000  # LMCache's MAX_TOKEN_IDS
MAX_KEYS = 10_000  # LMCache's MAX_DELETE_BATCH; also a lookup's keys
MAX_BODY_BYTES = 16 << 20
MAX_SALT_CHARS = 128
MAX_NAME_CHARS = 256
MAX_WORLD_SIZE = 256
DEFAULT_SALT = "_default"  # the empty cache_salt in a URL path (LMCache's sentinel)
_BAD_SALT_CHARS = ("@", "/", "\\", "\0")
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ID = re.compile(ID_PATTERN)

TierName = Literal["l1", "l2", "all"]
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 63)]
WorldSize = Annotated[StrictInt, Field(ge=1, le=MAX_WORLD_SIZE)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME_CHARS)]
InstanceId = Annotated[StrictStr, Field(pattern=ID_PATTERN)]
GiB = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class BadRequest(ValueError):
    """A body that parsed but breaks one of LMCache's rules: answered 400 with this message."""


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_salt(salt: str) -> str:
    if len(salt) > MAX_SALT_CHARS or any(c in salt for c in _BAD_SALT_CHARS):
        raise BadRequest(f"cache_salt must have at most {MAX_SALT_CHARS} characters and none of @ / \\ or NUL")
    return salt


def salt_from_path(text: str) -> str:
    """A cache salt in a URL path: `_default` is the empty salt."""
    return "" if text == DEFAULT_SALT else check_salt(text)


def salt_to_path(salt: str) -> str:
    return salt or DEFAULT_SALT


def check_model_name(name: str) -> str:
    if "@" in name:
        raise BadRequest("model_name must not contain '@'")
    return name


def valid_id(text: str) -> bool:
    return bool(_ID.match(text))


class EncodedObjectKey(Body):
    """LMCache's `EncodedObjectKey`: one chunk of one rank. `kv_rank` packs (world size << 24 | global rank << 16
    | local world size << 8 | local rank); our `chunk_hash_hex` is the chunk's prefix-chain digest."""

    chunk_hash_hex: Annotated[StrictStr, Field(min_length=2, max_length=128, pattern=r"^[0-9a-fA-F]+$")]
    model_name: Name
    kv_rank: Annotated[StrictInt, Field(ge=0, lt=1 << 32)]
    object_group_id: Annotated[StrictInt, Field(ge=0, lt=1 << 16)] = 0
    cache_salt: StrictStr = ""

    def checked(self) -> Self:
        check_salt(self.cache_salt)
        check_model_name(self.model_name)
        return self


class TokensForm(Body):
    """Token ids of a prompt (from position 0) of a model served at `world_size`, with a salt."""

    model_name: Name
    world_size: WorldSize
    token_ids: list[TokenId] = []
    cache_salt: StrictStr = ""

    def checked(self) -> Self:
        check_tokens(self.token_ids)
        check_salt(self.cache_salt)
        check_model_name(self.model_name)
        return self


def check_tokens(token_ids: list[int]) -> None:
    if len(token_ids) > MAX_TOKEN_IDS:
        raise BadRequest(f"{len(token_ids)} token ids: at most {MAX_TOKEN_IDS}")


def check_keys(keys: list[EncodedObjectKey]) -> None:
    if len(keys) > MAX_KEYS:
        raise BadRequest(f"{len(keys)} keys: at most {MAX_KEYS} per call")
    for key in keys:
        key.checked()


# ------------------------------------------------------------------ the instance (LMCache's MP server)
class ClearBody(Body):
    tier: TierName = "l1"
    force: StrictBool = True


class DeleteObjectsBody(Body):
    keys: list[EncodedObjectKey]
    tier: TierName = "l2"
    force: StrictBool = False
    adapter: Optional[StrictStr] = None


class PrefetchBody(TokensForm):
    source_tier: TierName = "l2"
    target_tier: TierName = "l1"


class InstanceQuotaBody(Body):
    limit_gb: GiB


class LookupBody(Body):
    """`POST /directory/lookup` (and an instance's `POST /cache/lookup`): the keys form or the tokens form."""

    keys: Optional[list[EncodedObjectKey]] = None
    token_ids: Optional[list[TokenId]] = None
    model_name: Optional[Name] = None
    world_size: WorldSize = 1
    cache_salt: StrictStr = ""

    @model_validator(mode="after")
    def _one_form(self) -> "LookupBody":
        if (self.keys is None) == (self.token_ids is None):
            raise ValueError("give exactly one of keys and token_ids")
        if self.token_ids is not None and self.model_name is None:
            raise ValueError("model_name is required with token_ids")
        return self

    def checked(self) -> "LookupBody":
        if self.keys is not None:
            check_keys(self.keys)
        else:
            check_tokens(self.token_ids or [])
            check_model_name(self.model_name or "")
        check_salt(self.cache_salt)
        return self


# ------------------------------------------------------------------ the coordinator
class RegisterBody(Body):
    ip: Annotated[StrictStr, Field(min_length=1, max_length=255)]
    http_port: Annotated[StrictInt, Field(ge=1, le=65535)]
    instance_id: Annotated[StrictStr, Field(max_length=128)] = ""
    metadata: Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=1 << 16)]],
                        Field(max_length=64)] = {}
    p2p_advertised_url: Annotated[StrictStr, Field(max_length=512)] = ""
    mq_port: Annotated[StrictInt, Field(ge=0, le=65535)] = 0

    def checked(self) -> "RegisterBody":
        if not self.ip.strip() or any(c.isspace() or c in "/@?#" for c in self.ip.strip()):
            raise BadRequest("ip must be a host name or address")
        if self.instance_id and not valid_id(self.instance_id):
            raise BadRequest(f"instance_id must match {ID_PATTERN}")
        return self


class InstanceTokens(TokensForm):
    instance_id: InstanceId


class CacheDeleteBody(InstanceTokens):
    tier: TierName = "all"
    force: StrictBool = False


class MoveBody(Body):
    source_instance_id: InstanceId
    target_instance_id: InstanceId
    model_name: Name
    world_size: WorldSize = 1
    token_ids: list[TokenId] = []
    cache_salt: StrictStr = ""
    source_tier: TierName = "l1"
    target_tier: TierName = "l1"
    keep_source: StrictBool = False

    def checked(self) -> "MoveBody":
        check_tokens(self.token_ids)
        check_salt(self.cache_salt)
        check_model_name(self.model_name)
        if self.source_instance_id == self.target_instance_id:
            raise BadRequest("source_instance_id and target_instance_id must differ")
        if self.source_tier != "l1" or self.target_tier != "l1":
            raise BadRequest("moves go from l1 to l1 only")
        return self

    def tokens(self) -> TokensForm:
        return TokensForm(model_name=self.model_name, world_size=self.world_size, token_ids=self.token_ids,
                          cache_salt=self.cache_salt)


class QuotaBody(Body):
    """A coordinator quota. LMCache's default tier is l2 (its shared store); ours is l1, the only tier quotas
    are enforced on (an explicit l2 is refused)."""

    limit_gb: GiB
    tier: Literal["l1", "l2"] = "l1"


class QuotaConfigBody(Body):
    default_limit_gb: Optional[GiB] = None
    tier: Literal["l1", "l2"] = "l1"


def gib(nbytes: int) -> float:
    return nbytes / (1 << 30)


def gib_to_bytes(value: float) -> int:
    if not math.isfinite(value) or value < 0:
        raise BadRequest("limit_gb must be a finite number >= 0")
    return int(value * (1 << 30))
