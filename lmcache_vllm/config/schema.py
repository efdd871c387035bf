"""`LMCacheConfig`: the top-level keys of lmcache-vllm's configuration, each declared once with LMCache's
name, its default, meaning and check; our own keys live in `extra.ExtraConfig` under `extra_config`.

Constructing it (from code or by `loader.load_config`) validates every field and the keys that only make
sense together (a disk tier needs a size, a Redis URL must be one we can use), and raises one
`ConfigError` listing every problem.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from lmcache_vllm.config.extra import SERDES, ExtraConfig
from lmcache_vllm.config.fields import (
    Origin,
    Problem,
    at_least,
    greater_than,
    normalize_fields,
    raise_if_any,
    redacted_repr,
    setting,
    size_gib,
)
from lmcache_vllm.config.reader import build_extra
from lmcache_vllm.config.redact import redact_value, remember_url_secrets
from lmcache_vllm.config.remote_url import is_mooncake_url, parse_mooncake_url
from lmcache_vllm.config.values import normalize_local_disk, remote_url_problem, tls_problems

HASH_ALGORITHMS = ("xxh3_128", "blake3", "sha256")  # chunk digests; tokens.py implements exactly these
GiB = 1 << 30


def _ports_problem(ports: list[int]) -> Optional[str]:
    if not ports or any(not 0 < p < 65536 for p in ports):
        return "expected a list of ports from 1 to 65535 (one per TP rank), or null"
    return None


@dataclass
class LMCacheConfig:
    """Configuration of lmcache-vllm; key names and units (sizes in GiB) are LMCache's."""

    chunk_size: Optional[int] = setting(
        None, "tokens per stored chunk, any value; null (not set): vLLM's block size on its CPU backend (a repeat "
              "loads what vLLM's own prefix cache would), on a GPU the multiple of the block size nearest 256 "
              "(LMCache's default); chunk keys depend on it (see 'Chunk size and vLLM's block size')",
        check=at_least(1, "an integer"))
    local_cpu: bool = setting(True, "L1 host-memory tier (false: the arena only stages transfers)")
    max_local_cpu_size: float = setting(
        5.0, "GiB of host memory for L1, reserved at start-up; pages are backed on first write "
             "(see extra_config.prefault_local_cpu)", check=size_gib)
    local_disk: Optional[str] = setting(
        None, "L2 directory: /path, file:///path or a path relative to the working directory; null or "
              "false: no disk tier", value_aliases={False: None})
    max_local_disk_size: float = setting(0.0, "GiB cap of L2 (> 0 when local_disk is set)", check=size_gib)
    remote_url: Optional[str] = setting(
        None, "L3 Redis: redis://[user:pw@]host:port[/db], rediss://... (TLS), unix:///path/to/redis.sock, "
              "redis-cluster://[user:pw@]host:port[,host:port...], redis-sentinel://host:port[,host:port...]"
              "/master_name (see docs/SCALING.md); or a Mooncake Store: mooncakestore://master_host:port "
              "(docs/MOONCAKE.md); null: no L3")
    remote_serde: str = setting(
        "lossless", "codec of the chunks written to a Redis remote_url: 'lossless' (exact; 1.47x fewer bytes on "
                    "bf16 KV), 'naive' (raw bytes: LMCache's default, and what builds before this one read), 'fp8' "
                    "(scaled e4m3, 1.97x, lossy: never a default); chunks of every codec are read whatever it is "
                    "(a Mooncake Store's chunks stay naive: its reads land in L1 without a copy; docs/CONFIG.md, "
                    "'Compression')", choices=SERDES, value_aliases={None: "naive"})
    save_unfull_chunk: bool = setting(
        False, "also store the trailing partial chunk: an exact repeat then loads all but its last token "
               "(with whole chunks, up to chunk_size - 1 tokens are recomputed)")
    save_decode_cache: bool = setting(
        True, "also store KV produced while decoding: a conversation's next turn, which repeats the answer, loads "
              "it instead of recomputing it (docs/BENCHMARKS.md: conversations and no reuse)")
    use_layerwise: bool = setting(False, "load and store one layer at a time, overlapping compute")
    enable_async_loading: bool = setting(
        True, "a hit that needs the disk or Redis tier loads while vLLM runs other requests (the request "
              "waits in WAITING_FOR_REMOTE_KVS); a hit all in L1, or one whose reads end while its lookup waits "
              "(extra_config.lookup_read_wait_ms), always loads inside the step. LMCache's default is false")
    min_retrieve_tokens: int = setting(
        0, "a hit that would load fewer new tokens than this is not loaded (vLLM computes them); 0: every "
           "hit is loaded", check=at_least(0, "tokens"))
    cache_policy: str = setting(
        "LRU", "L1 eviction order: LRU (least recently used first); LIP (LRU, but a chunk enters as the least "
               "recently used: only a load makes it recent, so chunks stored or read once evict each other "
               "before the ones in use; needs local_disk or remote_url, where the chunks it drops stay; see "
               "docs/BENCHMARKS.md, conversations)", choices=("LRU", "LIP"))
    blocking_timeout_secs: float = setting(
        10.0, "upper bound of every synchronous wait on the cache; past it: a miss, never a hang",
        check=greater_than(0, "seconds"))
    lookup_timeout_ms: int = setting(3000, "upper bound of a scheduler lookup; past it: a miss",
                                     check=at_least(1, "milliseconds"))
    pre_caching_hash_algorithm: str = setting(
        "sha256", "chunk digest: sha256 (cryptographic, as vLLM's prefix cache; benchmarks/bench_chunk_digest.py "
                  "measures it against xxh3_128 on the hit path), blake3, or xxh3_128 (fastest, not "
                  "collision-resistant: only where no untrusted tenant shares a cache; see tokens.py)",
        choices=HASH_ALGORITHMS)
    enable_kv_events: bool = setting(
        False, "KV cache events for cache-aware routers, in vLLM's own form (BlockStored / BlockRemoved of vLLM's "
               "blocks per tier: medium CPU for L1, STORAGE for disk and a shared pool; docs/ROUTING.md) through "
               "vLLM's KV event publisher (vLLM's --kv-events-config turns publishing on); chunk_size must then be "
               "a multiple of vLLM's block size")
    enable_p2p: bool = setting(
        False, "share chunks between instances peer to peer: each instance serves what its L1 holds (its disk "
               "too with extra_config.p2p_serve_disk) from a transfer server per worker rank and lists it in a "
               "directory on Redis (extra_config.p2p_directory_url, default remote_url); a miss in L1 and disk "
               "is looked up there and pulled from the peer (docs/P2P.md)")
    p2p_host: Optional[str] = setting(
        None, "address each worker rank's P2P transfer server binds and advertises (\"0.0.0.0\": every interface, "
              "this host's IP advertised); null: as extra_config.pd_host (VLLM_NIXL_SIDE_CHANNEL_HOST, default "
              "localhost)")
    p2p_init_ports: Optional[list[int]] = setting(
        None, "port of each TP rank's P2P transfer server, one per rank (a single port: rank r takes port + r); "
              "null: ports the OS picks", check=_ports_problem)
    extra_config: ExtraConfig = setting(
        meaning="lmcache-vllm's own settings (next table; config/extra.py); merged key by key across sources",
        default_factory=ExtraConfig)

    def __post_init__(self) -> None:
        problems = normalize_fields(self, skip=("extra_config",))
        if not isinstance(self.extra_config, ExtraConfig):
            # A mapping given in code is read like every other source's extra_config (LMCache's names, typos).
            self.extra_config = build_extra(self.extra_config, Origin("code"), problems)
        problems += _check_together(self)
        for url in (self.remote_url, self.extra_config.p2p_directory_url):
            if isinstance(url, str):
                remember_url_secrets(url)  # from now on redacted from any text we show
        raise_if_any(problems)

    def __repr__(self) -> str:
        return redacted_repr(self)

    @property
    def resolved_chunk_size(self) -> int:
        """`chunk_size` as set, or as the connector chose it from vLLM's block size when it was not
        (`integration/vllm/chunk_size.py`); until then there is none, an error."""
        if self.chunk_size is None:
            raise ValueError("chunk_size is not set and was not chosen from vLLM's block size yet")
        return self.chunk_size

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GiB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GiB)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line with every top-level key and the extra_config keys that differ from their default
        (for the start-up log; secrets redacted: see redact.py)."""
        parts = [f"{f.name}={redact_value(f.name, getattr(self, f.name))!r}" for f in dataclasses.fields(self)
                 if f.name != "extra_config"]
        defaults = ExtraConfig()
        changed = {f.name: redact_value(f.name, getattr(self.extra_config, f.name))
                   for f in dataclasses.fields(ExtraConfig)
                   if getattr(self.extra_config, f.name) != getattr(defaults, f.name)}
        return ", ".join(parts + [f"extra_config={changed!r}"])




def p2p_directory_url(cfg: LMCacheConfig) -> Optional[str]:
    """Where the P2P directory lives: extra_config.p2p_directory_url, else remote_url when it is a Redis form."""
    if cfg.extra_config.p2p_directory_url:
        return cfg.extra_config.p2p_directory_url
    return cfg.remote_url if cfg.remote_url is not None and not is_mooncake_url(cfg.remote_url) else None


def _check_together(cfg: LMCacheConfig) -> list[Problem]:
    problems: list[Problem] = []
    if cfg.local_cpu and cfg.max_local_cpu_bytes <= 0:
        problems.append(Problem("max_local_cpu_size", cfg.max_local_cpu_size,
                                "expected a size > 0 while local_cpu is true"))
    if cfg.local_disk is not None:
        cfg.local_disk, message = normalize_local_disk(cfg.local_disk)
        if message:
            problems.append(Problem("local_disk", cfg.local_disk, message))
        elif cfg.max_local_disk_bytes <= 0:
            problems.append(Problem("max_local_disk_size", cfg.max_local_disk_size,
                                    "expected a size > 0 when local_disk is set"))
    if cfg.cache_policy == "LIP" and cfg.local_disk is None and cfg.remote_url is None:
        problems.append(Problem("cache_policy", cfg.cache_policy, "LIP drops newly stored chunks first: set "
                                "local_disk or remote_url to keep them, or use LRU"))
    if cfg.remote_url is not None:
        message = remote_url_problem(cfg.remote_url)
        if message:
            problems.append(Problem("remote_url", cfg.remote_url, message))
    if cfg.extra_config.lookup_read_wait_ms >= cfg.lookup_timeout_ms:
        problems.append(Problem("extra_config.lookup_read_wait_ms", cfg.extra_config.lookup_read_wait_ms,
                                f"expected less than lookup_timeout_ms ({cfg.lookup_timeout_ms}): a lookup still "
                                f"waiting for its reads then would count as a miss"))
    problems += tls_problems(cfg.remote_url, cfg.extra_config)
    problems += _p2p_problems(cfg)
    problems += _mooncake_problems(cfg)
    return problems


def _mooncake_problems(cfg: LMCacheConfig) -> list[Problem]:
    """A mooncakestore:// remote_url needs the mooncake package, and a master address that says one thing."""
    url = cfg.remote_url
    if url is None or not is_mooncake_url(url) or remote_url_problem(url):
        return []
    problems = []
    if importlib.util.find_spec("mooncake") is None:
        problems.append(Problem("remote_url", url, "a Mooncake Store needs the Python package mooncake: pip install "
                                "mooncake-transfer-engine (mooncake-transfer-engine-non-cuda without CUDA)"))
    given = cfg.extra_config.master_server_address
    named = parse_mooncake_url(url).master_address
    if given is not None and given != named:
        problems.append(Problem("extra_config.master_server_address", given,
                                f"remote_url names the master {named}: LMCache's releases differ on which of the "
                                f"two wins, so set one of them (or both alike)"))
    return problems


def _p2p_problems(cfg: LMCacheConfig) -> list[Problem]:
    url = cfg.extra_config.p2p_directory_url
    if url is not None:
        message = remote_url_problem(url, redis_only=True)
        if message:
            return [Problem("extra_config.p2p_directory_url", url, message)]
    if cfg.enable_p2p and p2p_directory_url(cfg) is None:
        return [Problem("enable_p2p", True, "needs a directory on Redis: set extra_config.p2p_directory_url (any "
                                            "Redis form remote_url accepts) or a Redis remote_url (docs/P2P.md)")]
    return []
