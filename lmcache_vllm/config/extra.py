"""`ExtraConfig`: every key of ours that lives under `extra_config`, each declared once with its type,
default, meaning and validation.

LMCache keeps backend- and feature-specific settings in the free-form `extra_config` mapping; lmcache-vllm
keeps its own less common knobs there too, but as a schema: a key is read only from here, typed and
defaulted (`config.extra_config.write_queue_depth`), never with `extra_config.get("x", default)`. To add a
key, add one field with `setting(default, meaning, check=...)`; the table in docs/CONFIG.md is generated from it.
"""

from __future__ import annotations

import math
import os
import string
from dataclasses import dataclass
from typing import Mapping, Optional

from lmcache_vllm.config.fields import (
    MISSING,
    Problem,
    at_least,
    greater_than,
    normalize_fields,
    raise_if_any,
    redacted_repr,
    setting,
    size_gib,
)
from lmcache_vllm.config.peers import check_peers
from lmcache_vllm.config.redact import remember_secret
from lmcache_vllm.config.values import http_url_problem
from lmcache_vllm.cpu_affinity import parse_cpu_list

POSITIVE_INT = at_least(1, "an integer")
# Chunk codecs a tier can write (storage/coders.py implements exactly these; config imports no storage).
SERDES = ("naive", "lossless", "fp8")
SECONDS = greater_than(0, "seconds")
MAX_RANKS = 256  # ports above a base port kept free for the ranks


def _port_base(value: int) -> Optional[str]:
    return None if 0 <= value <= 65535 - MAX_RANKS else f"a port from 0 to {65535 - MAX_RANKS}"


def _port(value: int) -> Optional[str]:
    return None if 0 <= value <= 65535 else "a port from 0 to 65535"


def _cpu_choice(value: str) -> Optional[str]:
    if value in ("auto", "inherit"):
        return None
    try:
        parse_cpu_list(value)
    except ValueError:
        return "'auto', 'inherit' or a CPU list such as '1' or '2,4-7'"
    return None


def _fraction(value: float) -> Optional[str]:
    return None if 0.0 <= value <= 1.0 else "a fraction from 0 to 1"


MAX_READ_WAIT_MS = 1000.0  # the scheduler, and so every request, waits while a lookup waits


def _read_wait(value: float) -> Optional[str]:
    if math.isfinite(value) and 0.0 <= value <= MAX_READ_WAIT_MS:
        return None
    return f"milliseconds from 0 to {MAX_READ_WAIT_MS:g}"


MIN_KEY_BITS = 128
MAC_KEY_ENV = "LMCACHE_VLLM_CHUNK_MAC_KEY"  # the chunk MAC key(s) (comma-separated), preferred to chunk_mac_key


def env_mac_keys(environ: Mapping[str, str]) -> list[str]:
    """The chunk MAC keys of the environment (comma-separated), [] without any."""
    return [part.strip() for part in environ.get(MAC_KEY_ENV, "").split(",") if part.strip()]
_HEX = frozenset(string.hexdigits)
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/-_")


def key_bits(secret: str) -> int:
    """The most bits a secret can hold as written: 4 per hex digit, 6 per base64 character (padding not
    counted), 8 per byte of anything else. Not its entropy: a word of 16 letters holds far fewer."""
    text = secret.rstrip("=")
    if text and set(text) <= _HEX:
        return 4 * len(text)
    if set(text) <= _BASE64:
        return 6 * len(text)
    return 8 * len(secret.encode("utf-8"))


def check_mac_keys(keys: list[str]) -> Optional[str]:
    """Every key of a chunk MAC key list holds at least `MIN_KEY_BITS` (None: they do). Never names a key."""
    if not keys:
        return "expected at least one key (or null: no MAC)"
    short = [f"key {i + 1} of {len(keys)} holds at most {key_bits(k)} bits" for i, k in enumerate(keys)
             if key_bits(k) < MIN_KEY_BITS]
    if not short:
        return None
    return (f"{'; '.join(short)}: a chunk MAC key must hold at least {MIN_KEY_BITS} bits (32 hex digits, 22 "
            f"base64 characters, or 16 bytes of other text); `lmcache-vllm keygen` prints one of 256 bits")


def READABLE_FILE(path: str) -> Optional[str]:  # noqa: N802 (a check, named like the constants above)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        return "expected the path of a readable file"
    return None


@dataclass
class ExtraConfig:
    """lmcache-vllm's own settings under `extra_config` (see the module docstring)."""

    # Saving
    async_save: bool = setting(True, "store whole steps on a background save thread; false: inside the step")
    write_queue_depth: int = setting(64, "write-throughs to L2/L3 waiting at most; beyond it a store is "
                                         "dropped and counted (inference never waits)", check=POSITIVE_INT)
    write_workers: int = setting(4, "concurrent write-throughs to the lower tiers", check=POSITIVE_INT)
    background_cpus: str = setting("auto", "CPUs of our background threads in a vLLM worker (storage, disk, save, "
                                           "load, transfer; the lookup server stays on the worker's own cores, "
                                           "idle while the scheduler asks): 'auto' = the cores vLLM's CPU "
                                           "backend reserves beside its compute cores when it binds them itself "
                                           "(VLLM_CPU_OMP_THREADS_BIND=auto); for an in-process engine (LLM() with "
                                           "VLLM_ENABLE_V1_MULTIPROCESSING=0) bound explicitly, the CPUs its "
                                           "binding leaves out; else where vLLM put the process; "
                                           "'inherit' = where vLLM put the process; or a CPU list such as '2,4-7' "
                                           "(with an explicit binding: cores no vLLM instance computes on)",
                                   check=_cpu_choice)
    overlap_loads: str = setting("auto", "copy a step's loads from L1 layer by layer on a thread of ours while vLLM's "
                                         "forward computes the layers before (the forward waits only for a layer "
                                         "not copied yet): 'auto' = on the CPU backend when background_cpus are "
                                         "set and vLLM's step may run on another CPU; 'on'; 'off' = before the "
                                         "forward",
                                 choices=("auto", "on", "off"), value_aliases={True: "on", False: "off"})
    lookup_read_wait_ms: float = setting(10.0, "how long a request's first lookup may wait for its hit's reads from "
                                               "disk or Redis, and only when the pace of recent reads says they end "
                                               "within it: a hit read by then loads inside the step like an L1 hit "
                                               "instead of waiting a step in WAITING_FOR_REMOTE_KVS (vLLM's scheduler, "
                                               "so every request, waits meanwhile); 0 = never",
                                         check=_read_wait)
    close_drain_secs: float = setting(5.0, "at shutdown, longest wait for queued writes",
                                      check=at_least(0, "seconds"))
    prefetch_hold_secs: float = setting(30.0, "how long prefetched chunks stay held for the request that "
                                              "asked for them", check=SECONDS)
    # L1 host memory
    staging_buffer_size: float = setting(1.0, "GiB of arena to stage transfers in when local_cpu is false "
                                              "and max_local_cpu_size is 0", check=size_gib)
    prefault_local_cpu: str = setting("off", "back the L1 arena's pages with memory before serving: 'sync' "
                                             "(during start-up), 'background' (low-priority thread) or 'off'",
                                      choices=("off", "background", "sync"),
                                      value_aliases={False: "off", True: "background"})
    max_pinned_fraction: float = setting(0.0, "L1 that pinned prefixes (requests' lmcache.pin_tokens, the "
                                              "management API's pins) may keep at most, every tenant together, "
                                              "as a fraction of max_local_cpu_size; a pin past it is refused "
                                              "(never made by letting another pin go); 0: pins are off",
                                        check=_fraction)
    max_pinned_fraction_per_salt: float = setting(0.05, "L1 the pins of one tenant (one cache_salt; requests "
                                                        "without one are the tenant '') may keep at most, as a "
                                                        "fraction of max_local_cpu_size (within "
                                                        "max_pinned_fraction); a pin past it is refused",
                                                  check=_fraction)
    pin_ttl_secs: Optional[float] = setting(3600.0, "a pin ends this long after it was last pinned (a request's "
                                                    "lmcache.pin_tokens or the management API renews it); null: "
                                                    "never", check=SECONDS)
    local_cpu_cold_fraction: float = setting(0.0, "part of max_local_cpu_size that keeps L1's least recently used "
                                                  "chunks lossless-coded (1.47x fewer bytes on bf16 KV: more "
                                                  "distinct prompts in the same memory; a hit there is decoded "
                                                  "and loaded asynchronously, like a disk hit); 0: none",
                                             check=lambda v: None if 0.0 <= v <= 0.9 else "a fraction from 0 to 0.9")
    # L2 local disk
    disk_io_threads: int = setting(8, "threads reading chunk files (writes: one thread per write_workers)",
                                   check=POSITIVE_INT)
    disk_fsync: bool = setting(False, "fsync every chunk file before it counts as stored")
    local_disk_serde: str = setting("naive", "codec of the chunk files written to local_disk, as remote_serde: "
                                             "'naive' (a cold read at disk speed beat decoding on 2 busy cores: "
                                             "docs/CONFIG.md, 'Compression'), 'lossless' (1.47x the chunks in "
                                             "max_local_disk_size), 'fp8'; files of every codec are read",
                                    choices=SERDES)
    disk_direct_io: bool = setting(True, "write chunk files with O_DIRECT straight from the arena "
                                         "(file systems that refuse it are written normally)")
    local_disk_shared: bool = setting(False, "the local_disk directory is shared with other users: it may "
                                             "be owned by another user or writable by its group or everyone, "
                                             "and is used as it is. False: such a directory is refused at "
                                             "start, since whoever can write it can plant chunks the model "
                                             "reads (shared: set a chunk MAC key, see docs/SECURITY.md)")
    # L3 Redis (and Mooncake: remote_key_prefix, remote_timeout_secs, remote_breaker_max_secs)
    remote_key_prefix: str = setting("lmcache_vllm:", "prefix of every Redis (or Mooncake) key we write")
    remote_ttl_secs: Optional[float] = setting(None, "expiry of stored chunks in Redis; null: never",
                                               check=SECONDS)
    remote_timeout_secs: float = setting(2.0, "timeout of one Redis or Mooncake call, per chunk it moves; past "
                                              "it: a miss", check=SECONDS)
    remote_max_connections: int = setting(16, "Redis connections per server (per node of a Redis Cluster), "
                                              "also the most calls in flight to one node: more wait for one, "
                                              "within remote_timeout_secs", check=POSITIVE_INT)
    remote_read_groups: int = setting(1, "concurrent groups one batched Redis read is split into",
                                      check=POSITIVE_INT)
    remote_read_batch_keys: int = setting(8, "keys per Redis read command", check=POSITIVE_INT)
    remote_breaker_max_secs: float = setting(30.0, "longest pause of Redis (or Mooncake) calls after repeated "
                                                   "failures", check=SECONDS)
    ssl_ca_certs: Optional[str] = setting(None, "TLS remote_url (rediss://, rediss-cluster://, rediss-sentinel://): "
                                                "PEM file of the CAs that sign the servers' certificates; null: "
                                                "the system's CAs", check=READABLE_FILE)
    ssl_certfile: Optional[str] = setting(None, "TLS remote_url: PEM file of our client certificate, for servers "
                                                "that require one (tls-auth-clients)", check=READABLE_FILE)
    ssl_keyfile: Optional[str] = setting(None, "TLS remote_url: PEM file of the client certificate's private key",
                                         check=READABLE_FILE)
    ssl_cert_reqs: str = setting("required", "TLS remote_url: check the servers' certificates: 'required' (and "
                                             "their host names), 'optional' or 'none' (encryption without "
                                             "authentication of the server)",
                                 choices=("required", "optional", "none"))
    # L3 Mooncake Store (remote_url: mooncakestore://master:port; docs/MOONCAKE.md). LMCache's names and units.
    local_hostname: str = setting("localhost", "Mooncake: the host name or address this process gives Mooncake "
                                               "as its own (the master and other clients reach its segment there)")
    metadata_server: str = setting("P2PHANDSHAKE", "Mooncake: the transfer engine's metadata service: "
                                                   "'P2PHANDSHAKE' (clients handshake directly, no service), or "
                                                   "http://host:port/metadata, etcd://host:port")
    master_server_address: Optional[str] = setting(None, "Mooncake: the master's host:port; null: remote_url's. "
                                                         "Set together, they must agree")
    global_segment_size: int = setting(3355443200, "Mooncake: bytes of this process's memory it gives the store's "
                                                   "pool (LMCache's default); chunks placed there go when the "
                                                   "process does. 0: only a client of the pool, which lives in "
                                                   "storage hosts (mooncake_client) or other instances",
                                       check=at_least(0, "bytes"))
    local_buffer_size: int = setting(0, "Mooncake's own transfer buffer in bytes; lmcache-vllm moves chunks "
                                        "straight from and into the L1 arena and needs none (LMCache's "
                                        "default: 1 GiB)", check=at_least(0, "bytes"))
    protocol: str = setting("tcp", "Mooncake's transfer protocol: 'tcp', 'rdma', or another the installed "
                                   "Mooncake has")
    device_name: str = setting("", "Mooncake: the RDMA devices to use (e.g. 'mlx5_0'); '' lets Mooncake "
                                   "choose; remote_url's ?device= wins")
    mooncake_prefer_local_alloc: bool = setting(False, "Mooncake: place the chunks this process stores in its "
                                                       "own segment where it has room")
    mooncake_threads: int = setting(4, "threads that make Mooncake calls, so the most calls in flight. A call "
                                       "past its timeout keeps its thread until Mooncake returns (about 4 s "
                                       "when the master is gone); while every thread is taken, calls are "
                                       "misses at once", check=POSITIVE_INT)
    # Disaggregated prefill (docs/DISAGGREGATED.md)
    pd: str = setting("auto", "our part in disaggregated prefill: 'on' (a prefill instance holds for its decode "
                              "instances, a decode instance pulls), 'off' (kv_transfer_params are ignored: never "
                              "hold or pull), 'auto' (on, unless another connector of the same MultiConnector "
                              "does the handoff: NIXL, Mooncake, MoRIIO, P2P NCCL; docs/COMPOSING.md)",
                      choices=("auto", "on", "off"), value_aliases={True: "on", False: "off"})
    pd_host: Optional[str] = setting(None, "address the KV transfer server of each worker rank binds and a "
                                           "prefill instance names in kv_transfer_params (\"0.0.0.0\": every "
                                           "interface, vLLM's host IP named); null: as vLLM's NIXL connector, "
                                           "VLLM_NIXL_SIDE_CHANNEL_HOST (default localhost)")
    pd_port: int = setting(0, "port of TP rank 0's KV transfer server (rank r: pd_port + r); 0: ports the OS "
                              "picks (the scheduler asks the workers)", check=_port_base)
    pd_hold_secs: float = setting(30.0, "how long a prefill instance holds a request's chunks for its decode "
                                        "instance when no RELEASE comes (vLLM's kv_lease_duration)", check=SECONDS)
    pd_max_held_bytes: Optional[int] = setting(None, "most bytes of L1 chunks a prefill instance holds for "
                                                     "decode instances at once; a request that would go over "
                                                     "it is not held (answered without kv_transfer_params, or, "
                                                     "when that was not foreseen, its pull is answered ERR "
                                                     "full; the decode instance recomputes; counted in "
                                                     "pd_holds_refused); null: half of the L1 arena; 0: no cap",
                                               check=at_least(0, "bytes"))
    transfer_serde: str = setting("auto", "codec of chunks sent to other instances (disaggregated prefill pulls, "
                                          "P2P): 'auto' (lossless while this instance's measured encode rate is "
                                          "above the rate its sends reached: a link slower than the codec; else "
                                          "naive), or naive, lossless, fp8 (as remote_serde); a receiver reads "
                                          "every codec", choices=SERDES + ("auto",))
    pd_pull_timeout_secs: float = setting(5.0, "a decode instance's longest wait for the prefill instance's "
                                                "next message of a pull; past it, the rest is recomputed",
                                          check=SECONDS)
    pd_peers: list[str] = setting(
        meaning="the transfer ports of the other instances this one connects to without chunk_mac_key: prefill "
        "instances (kv_transfer_params come from clients, so they may name any host and port) and P2P peers (the "
        "directory names them): HOST:PORT or HOST:FIRST-LAST, HOST an address, a network (10.0.0.0/24:5600-5607) "
        "or a name (resolved off vLLM's step; no other name is ever looked up); IPv6 in brackets. Loopback is "
        "nobody's by default. Non-empty: disaggregated prefill is configured explicitly (this instance holds for "
        "any client's do_remote_decode). With chunk_mac_key set, prefill instances sign their params and any "
        "signed peer is pulled from",
        check=check_peers, default_factory=list)
    # Peer-to-peer sharing (enable_p2p; docs/P2P.md)
    p2p_directory_url: Optional[str] = setting(None, "the P2P directory (which instance holds which chunk: keys "
                                                     "and addresses, never KV): any form remote_url accepts; "
                                                     "null: remote_url")
    p2p_serve_disk: bool = setting(False, "also list and serve the chunks of local_disk (read into L1 for a pull)")
    p2p_lookup_timeout_secs: float = setting(0.5, "longest wait for the directory's answer to one lookup; past "
                                                  "it: a miss (counted), never a stalled step", check=SECONDS)
    p2p_pull_timeout_secs: float = setting(5.0, "longest silence of a peer during a pull; past it the rest is "
                                                "recomputed and the peer skipped for p2p_peer_backoff_secs",
                                           check=SECONDS)
    p2p_keep_pulled: bool = setting(False, "keep a chunk pulled from a peer in L1 (not listed): fewer pulls of "
                                           "popular prefixes, but copies take L1 from chunks no other instance has; "
                                           "false: the fleet's L1s hold each chunk once, where it was computed")
    p2p_lease_secs: float = setting(30.0, "an instance's directory entries expire this long after its last "
                                          "refresh (refreshed every third of it): a dead instance's entries go "
                                          "with its lease", check=greater_than(1, "seconds"))
    p2p_peer_backoff_secs: float = setting(10.0, "a peer that failed a pull (dead, slow, or sent what did not "
                                                 "verify) is not asked again for this long", check=SECONDS)
    # KV copies on a GPU
    cuda_kernel: str = setting("auto", "the CUDA gather/scatter kernel: 'auto' (used for a KV layout once it gave "
                                       "the torch path's bytes on a scratch copy of that layout; otherwise an "
                                       "error is logged and the torch path used), 'on' (the same check; a "
                                       "mismatch or a missing kernel stops the start), 'off' (torch path)",
                               choices=("auto", "on", "off"), value_aliases={True: "on", False: "off"})
    # Management API and fleet coordinator (docs/MANAGEMENT.md)
    management_port: int = setting(0, "port of this instance's management API (LMCache's MP-server HTTP paths: "
                                      "lookup, delete, clear, prefetch, pins, quotas), served by vLLM's "
                                      "engine-core process for every tensor-parallel rank; 0: off",
                                   check=_port)
    management_host: str = setting("127.0.0.1", "address the management API binds (\"0.0.0.0\": every "
                                                "interface; the coordinator is then told this host's address)")
    management_token_file: Optional[str] = setting(None, "file holding the bearer token every write to the "
                                                         "management API needs (and every read from off "
                                                         "loopback); required with management_port; the "
                                                         "coordinator's token (docs/SECURITY.md); never logged",
                                                   check=READABLE_FILE)
    coordinator_url: Optional[str] = setting(None, "http://host:port of the fleet coordinator (lmcache-vllm "
                                                   "coordinator) this instance registers with and heartbeats "
                                                   "to (needs management_port); null: none")
    coordinator_heartbeat_secs: float = setting(5.0, "how often an instance renews its registration with the "
                                                     "coordinator (which drops it after its --instance-timeout)",
                                                check=SECONDS)
    quota_evict_batch: int = setting(64, "most chunks one tenant's quota check evicts at once from L1 (the rest "
                                         "at its next store)", check=POSITIVE_INT)
    # Operations
    reset_lower_tiers: bool = setting(False, "vLLM's /reset_prefix_cache?reset_external=true also empties "
                                             "L2 and L3 (shared with other instances); false: only L1")
    # Cache keys
    cache_namespace: Optional[str] = setting(None, "goes into every key's model fingerprint (and its readable "
                                                   "name): servers with other namespaces never share chunks; "
                                                   "set it for what the fingerprint cannot see (weights "
                                                   "changed in place at the same size)")
    chunk_mac_key: Optional[list[str]] = setting(
        None, "secret for a keyed MAC (BLAKE3) of every chunk on disk and in Redis, of the params and requests "
        "between instances: chunks without a valid MAC are misses and deleted. At least 128 bits (lmcache-vllm "
        "keygen). A list rotates keys: everything is signed with the first, a MAC of any of them verifies "
        "(comma-separated in the environment). Prefer the LMCACHE_VLLM_CHUNK_MAC_KEY environment variable: "
        "vLLM logs kv_connector_extra_config (a key there is warned about at start)", check=check_mac_keys)
    require_chunk_mac: bool = setting(False, "refuse to start when a tier others can write (remote_url; a "
                                             "local_disk with local_disk_shared) would store chunks, or a "
                                             "prefill instance would serve its KV transfer port, without a MAC "
                                             "key (chunk_mac_key / LMCACHE_VLLM_CHUNK_MAC_KEY); false: start "
                                             "with one warning (see docs/SECURITY.md)")
    # Configuration itself
    strict_env: bool = setting(False, "an unknown LMCACHE_* environment variable is an error, not a warning")
    allow_untested_vllm: bool = setting(True, "start on a vLLM release lmcache-vllm is not tested with "
                                              "(integration/vllm/versions.py) with one warning; false: refuse "
                                              "to start")

    def __post_init__(self) -> None:
        problems = normalize_fields(self, prefix="extra_config.")
        if self.management_port and not self.management_token_file:
            problems.append(Problem("extra_config.management_token_file", MISSING, "required with management_port: "
                                    "every write to the management API needs its bearer token "
                                    "(docs/MANAGEMENT.md)"))
        if self.coordinator_url is not None:
            message = http_url_problem(self.coordinator_url)
            if message is None and not self.management_port:
                message = "needs extra_config.management_port: the coordinator steers this instance through it"
            if message is not None:
                problems.append(Problem("extra_config.coordinator_url", self.coordinator_url, message))
        raise_if_any(problems)
        for key in self.chunk_mac_key or ():
            remember_secret(key)  # from now on redacted from any text we show

    def __repr__(self) -> str:
        return redacted_repr(self)
