"""Prefix lookup between vLLM's scheduler and its workers, over local ZMQ sockets.

vLLM's scheduler decides how many prompt tokens the connector can supply, but the cache (the
`CacheEngine` and its storage tiers) lives beside the worker that owns the KV cache, possibly in another
process. Each worker rank runs a `LookupServer` thread answering a `LookupQuery` ("request R: which of
these tokens (with these extra keys), from token `start` on, do you hold?") with a `LookupAnswer` (the
run of cached tokens and the tier of each of its chunks, or `pending`: a slower tier has not said yet,
ask again). A lookup is also a promise: the worker holds what it reported for request R until R's load
takes it or R goes away. The scheduler's `LookupClient` asks every rank and takes the minimum (with
tensor parallelism a prefix is only usable if every rank has its shard).

When every rank's server lives in the client's own process (vLLM's engine core with a single worker,
the common case: scheduler and worker share the process), the client calls the servers' lookup
functions directly instead of going through the sockets: measured inside vLLM, a socket round trip
took ~2 ms (thread wake-ups under the engine's load), a direct call ~0.1 ms.

Wire format (no pickle): lookup request = [seq: u64 LE, request id: UTF-8, start: u64 LE, token ids:
int64 LE array, extra keys: `ExtraKeys.to_bytes()` (b"" for plain text)], reply = [seq, end of the hit
tokens: i64 LE, start: i64 LE, flags: u8 (1 pending, 2 ready), then one byte per chunk of the hit from start: its tier's
index in `storage.tier.TIER_NAMES`]; command request = [seq, b"cmd", name], reply = [seq, i64 LE result]. A rank
that does not answer within the timeout counts as 0 hits (a failed command), never an error.

The answer (`LookupAnswer`) says which tier holds each chunk of the hit (whether the load needs a slower
tier, vLLM's hit-source metric and our `hit_tokens{tier}`); over several ranks a chunk counts in the
slowest tier any rank holds it in. `ready` says the chunks from below are already read into host memory
(on every rank), so the hit loads inside the step like an L1 hit. The same
channel carries commands to every rank (`LookupClient.command`, e.g. clearing the cache for vLLM's
`/reset_prefix_cache`); each answers an integer, and the client gets every rank's or None.

Isolation on a shared host: the sockets live in a private directory (`private_socket_dir`: mode 0700,
owned by this user, refused otherwise) and are chmod 0600; the server drops any message larger than a
lookup can be (`zmq.MAXMSGSIZE`), checks every field (a start beyond the tokens sent, more tokens than
`max_tokens` (vLLM's max_model_len), bytes that do not parse) and answers anything it refuses, or an
answer that does not fit the wire, with an error reply (0 hits; -1 to a command). No message can stop
the server thread; should its loop fail anyway (a ZMQ error), it is counted and serves again. With
pipeline parallelism every (pp, tp) rank serves its own socket and the client takes the minimum over
all of them (a prefix is usable only if every stage holds its layers).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import tempfile
import threading
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np
import zmq

from lmcache_vllm.cpu_affinity import name_os_thread
from lmcache_vllm.extra_keys import MAX_EXTRA_BYTES, NO_EXTRA_KEYS, ExtraKeys
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.tier import TIER_NAMES, Tier

logger = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_ANSWER = struct.Struct("<qqB")  # hit end, start, flags; the chunks' tier codes follow
_PENDING, _READY = 1, 2  # the flags' bits (others are ignored)
_CMD = b"cmd"
_MAX_REQ_ID = 1024  # bytes of a request id on the wire (vLLM's are ~40)
_UNKNOWN_TIER = 255
_MAX_IPC_PATH = 100  # sockaddr_un.sun_path holds 107 bytes plus NUL on Linux

_local_servers: dict[str, "LookupServer"] = {}  # address -> live server of this process
_local_lock = threading.Lock()


def lookup_socket_path(instance_id: str, rank: int, base_dir: str | None = None, pp_rank: int = 0) -> str:
    """The ipc:// address TP rank `rank` of PP stage `pp_rank` of vLLM instance `instance_id` serves
    lookups on, inside this user's private socket directory (see `private_socket_dir`).

    Unix socket paths are limited to ~107 bytes, so the instance id is hashed into a short name.
    """
    base = base_dir or os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    tag = hashlib.sha1(instance_id.encode()).hexdigest()[:16]
    name = f"lookup-{tag}-pp{pp_rank}-tp{rank}.sock"
    path = os.path.join(base, _private_dir_name(), name)
    if len(path) > _MAX_IPC_PATH:
        path = os.path.join("/tmp", _private_dir_name(), name)  # the engine id keeps instances apart
    return f"ipc://{path}"


def _private_dir_name() -> str:
    return f"lmcache-vllm-{os.getuid()}"


def private_socket_dir(path: str) -> str:
    """Creates (or checks) `path` as a directory only this user can enter: mode 0700, owned by us, not a
    symlink. Another user's or a world-accessible directory there is refused (`PermissionError`), since
    whoever controls it could intercept or fake lookups."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"lookup socket directory {path!r} is not a directory owned by uid "
                              f"{os.getuid()}; remove it or set VLLM_RPC_BASE_PATH elsewhere")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours, with a looser mode (e.g. made by an older version): tighten it
    return path


def bind_private_router(address: str, max_message: int) -> tuple["zmq.Socket[bytes]", str | None]:
    """A ROUTER socket bound to `address` (an ipc:// one inside this user's private directory, mode 0600, a stale
    file of a dead process replaced) that drops messages over `max_message` bytes; and its file's path."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message)
    path = address[len("ipc://"):] if address.startswith("ipc://") else None
    if path:
        private_socket_dir(os.path.dirname(path))
        if os.path.lexists(path):
            os.unlink(path)  # a stale socket file from a process that died
    sock.bind(address)
    if path:
        os.chmod(path, 0o600)
    return sock, path


def close_private_router(sock: "zmq.Socket[bytes]", path: str | None) -> None:
    sock.close(linger=0)
    if path and os.path.exists(path):
        try:
            os.unlink(path)
        except OSError:
            pass


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(token_ids, dtype="<i8").tobytes()


def decode_tokens(payload: bytes) -> np.ndarray:
    if len(payload) % 8:
        raise ValueError(f"token payload of {len(payload)} bytes is not a whole number of int64")
    return np.frombuffer(payload, dtype="<i8")


class LookupQuery(NamedTuple):
    """What the scheduler asks a rank about one request."""

    req_id: str
    token_ids: np.ndarray  # int64, the request's tokens so far
    start: int = 0  # vLLM already holds tokens [0, start): only chunks from there on are of use
    extra: ExtraKeys = NO_EXTRA_KEYS


class LookupAnswer(NamedTuple):
    hit_tokens: int  # the cached run ends here (0: nothing cached)
    chunk_tiers: tuple[str, ...] = ()  # tier name of each chunk of the run from `start` ("" = not said)
    start: int = 0  # the run starts here (chunk-aligned, at or before the query's start)
    pending: bool = False  # a slower tier has not said yet where the chunks are: ask again
    ready: bool = False  # every chunk is in host memory now (chunks from below already read into L1)

    @classmethod
    def of(cls, value: LookupAnswer | int) -> "LookupAnswer":
        """A lookup function's result (a LookupAnswer, or a plain hit count) as a LookupAnswer."""
        return value if isinstance(value, LookupAnswer) else cls(int(value))

    @property
    def in_l1(self) -> bool:
        """Every chunk of the hit is in host memory: loading it is a copy, no tier read waits."""
        return all(t == Tier.LOCAL_CPU for t in self.chunk_tiers)

    @property
    def loads_now(self) -> bool:
        """Loading the hit is a copy from host memory (no read to wait for): it can load inside the step."""
        return self.ready or self.in_l1

    def encode(self) -> bytes:
        codes = bytes(TIER_NAMES.index(t) if t in TIER_NAMES else _UNKNOWN_TIER for t in self.chunk_tiers)
        flags = (_PENDING if self.pending else 0) | (_READY if self.ready else 0)
        return _ANSWER.pack(self.hit_tokens, self.start, flags) + codes

    @classmethod
    def decode(cls, payload: bytes) -> "LookupAnswer":
        hit, start, flags = _ANSWER.unpack_from(payload)
        tiers = tuple(TIER_NAMES[c] if c < len(TIER_NAMES) else "" for c in payload[_ANSWER.size:])
        return cls(hit, tiers, start, bool(flags & _PENDING), bool(flags & _READY))

    @classmethod
    def minimum(cls, answers: Sequence["LookupAnswer"]) -> "LookupAnswer":
        """What every rank holds: pending if any rank is; the shortest hit; each chunk in the slowest tier
        any rank has it in (every rank was asked from the same start, so their chunks line up); ready if
        every rank's is."""
        if any(a.pending for a in answers):
            return cls(0, pending=True)
        start = max(a.start for a in answers)
        hit = max(0, min(a.hit_tokens for a in answers))
        if hit <= start:
            return cls(0, start=start)
        n = min(len(a.chunk_tiers) for a in answers)
        order = {t: i for i, t in enumerate(TIER_NAMES)}
        tiers = tuple(max((a.chunk_tiers[i] for a in answers), key=lambda t: order.get(t, len(order)))
                      for i in range(n))
        return cls(hit, tiers, start, ready=all(a.ready for a in answers))


class LookupServer:
    """Answers prefix lookups and commands for one worker rank on its own daemon thread.

    `lookup_fn(LookupQuery) -> LookupAnswer | int` is the worker's lookup; an exception in it answers 0.
    More than `max_tokens` token ids are answered 0 without a lookup.
    `commands` maps a name to a function returning an int (a failing one answers -1).
    """

    def __init__(self, address: str, lookup_fn: Callable[[LookupQuery], "LookupAnswer | int"],
                 max_tokens: int = 1 << 20, commands: dict[str, Callable[[], int]] | None = None):
        self.address = address
        self._lookup_fn = lookup_fn
        self.max_tokens = int(max_tokens)
        self._commands = dict(commands or {})
        # A peer sending a larger message is disconnected by ZMQ before it is buffered.
        self._socket, self._path = bind_private_router(
            address, max(self.max_tokens * 8, MAX_EXTRA_BYTES) + _MAX_REQ_ID + 64)
        with _local_lock:
            _local_servers[address] = self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-lookup-server", daemon=True)
        self._thread.start()

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to one message: its answer, or for anything malformed or failing an error reply
        (0 hits; -1 to a command) that names the message's sequence number. Never raises."""
        if len(frames) < 2:
            return None  # no peer identity and nothing else: nobody to answer
        identity, seq = frames[0], frames[1] if len(frames[1]) == _U64.size else b""
        is_command = len(frames) == 4 and frames[2] == _CMD
        try:
            if is_command and seq:
                return [identity, seq, _I64.pack(self.command(frames[3].decode("utf-8", "replace")))]
            if len(frames) != 6 or not seq or len(frames[3]) != _U64.size:
                raise ValueError(f"{len(frames)} frames, not a lookup request")
            return [identity, seq, self.lookup(self._query(frames[2:])).encode()]
        except Exception as exc:  # ValueError (bad fields), struct.error (an answer out of range), ...
            metrics.inc("lookup_rejected")
            logs.warn(logger, "malformed_lookup", "malformed lookup message or answer (%s: %s); "
                      "answering with an error", type(exc).__name__, exc)
            return [identity, seq, _I64.pack(-1) if is_command else LookupAnswer(0).encode()]

    def _query(self, fields: list[bytes]) -> LookupQuery:
        """A lookup request's fields (request id, start, tokens, extra keys), each checked."""
        req_id, start_bytes, payload, extra_bytes = fields
        if len(req_id) > _MAX_REQ_ID:
            raise ValueError(f"request id of {len(req_id)} bytes")
        tokens = decode_tokens(payload)
        if len(tokens) > self.max_tokens:
            raise ValueError(f"{len(tokens)} tokens, at most {self.max_tokens}")
        start = _U64.unpack(start_bytes)[0]
        if start > len(tokens):  # vLLM's own hit never exceeds the prompt (and this bounds it below 2**63)
            raise ValueError(f"start {start} beyond the {len(tokens)} tokens sent")
        return LookupQuery(req_id.decode("utf-8"), tokens, start, ExtraKeys.from_bytes(extra_bytes))

    def lookup(self, query: LookupQuery) -> LookupAnswer:
        try:
            return LookupAnswer.of(self._lookup_fn(query))
        except Exception:  # the cache never breaks inference: a failing lookup is a miss
            logs.warn(logger, "lookup_failed", "lookup failed; answering 0 hits", exc_info=True)
            return LookupAnswer(0)

    def command(self, name: str) -> int:
        fn = self._commands.get(name)
        if fn is None:
            logger.warning("unknown lookup-channel command %r", name)
            return -1
        try:
            result = int(fn())
        except Exception:
            logger.exception("command %r failed", name)
            return -1
        if not -2**63 <= result < 2**63:
            logger.warning("command %r answered %d, beyond the wire's int64", name, result)
            return -1
        return result

    def _serve(self) -> None:
        """The server thread: serves until closed. Every message is answered by `_answer`, which never
        raises; should serving fail anyway (a ZMQ error receiving or sending), the failure is counted
        (`lookup_server_restarts`) and serving starts again, so lookups never stop for good."""
        # Not on the background CPUs: on the worker's own (its compute cores), which are idle while a
        # lookup waits, since the scheduler asks only between steps and the worker then spins in
        # `sched_yield` for the next one. On the background CPUs the wake-up waits behind vLLM's API server,
        # the load generator and our other threads, with the scheduler stopped meanwhile (bench_serving,
        # AMD Zen 5: a pass's 180 lookups took 0.35-0.59 s there, 0.29-0.44 s here).
        name_os_thread()
        while not self._stop.is_set():
            try:
                self._serve_until_stopped()
            except Exception:
                if self._stop.is_set():
                    break
                metrics.inc("lookup_server_restarts")
                logs.warn(logger, "lookup_server_restart", "lookup server failed; serving again",
                          exc_info=True)
                self._stop.wait(0.01)  # a fault that repeats at once must not spin a core

    def _serve_until_stopped(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            reply = self._answer(frames)
            if reply is not None:
                self._socket.send_multipart(reply)

    def close(self) -> None:
        with _local_lock:
            if _local_servers.get(self.address) is self:
                del _local_servers[self.address]
        self._stop.set()
        self._thread.join(timeout=5)
        close_private_router(self._socket, self._path)


class LookupClient:
    """Asks every rank's `LookupServer`; the answer is the minimum over ranks, 0 on any timeout."""

    def __init__(self, addresses: Sequence[str], timeout_ms: int, *, direct: bool = True):
        if not addresses:
            raise ValueError("LookupClient needs at least one server address")
        self.timeout_ms = max(1, int(timeout_ms))
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sockets = []
        for address in addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets.append(sock)
        self._addresses = list(addresses)
        self._seq = 0
        self._lock = threading.Lock()
        self.direct = direct  # False: always the sockets (tests of the wire path)

    def _local(self) -> list[LookupServer] | None:
        if not self.direct:
            return None
        with _local_lock:
            found = [_local_servers.get(a) for a in self._addresses]
        servers = [s for s in found if s is not None]
        return servers if len(servers) == len(found) else None

    def lookup(self, query: LookupQuery) -> LookupAnswer:
        servers = self._local()
        if servers is not None:
            metrics.inc("lookups_in_process")
            return LookupAnswer.minimum([server.lookup(query) for server in servers])
        with self._lock:
            payloads = self._ask([query.req_id.encode("utf-8"), _U64.pack(max(0, int(query.start))),
                                  encode_tokens(query.token_ids), query.extra.to_bytes() if query.extra else b""],
                                 min_size=_ANSWER.size)
        if payloads is None:
            metrics.inc("lookup_timeouts")
            return LookupAnswer(0)
        return LookupAnswer.minimum([LookupAnswer.decode(p) for p in payloads])

    def command(self, name: str) -> list[int] | None:
        """Runs command `name` on every rank; each rank's result, or None when one did not answer."""
        servers = self._local()
        if servers is not None:
            return [server.command(name) for server in servers]
        with self._lock:
            payloads = self._ask([_CMD, name.encode()], min_size=_I64.size, exact_size=_I64.size)
        return None if payloads is None else [_I64.unpack(p)[0] for p in payloads]

    def _ask(self, frames: list[bytes], min_size: int, exact_size: int | None = None) -> list[bytes] | None:
        """Sends [seq, *frames] to every rank; each rank's reply payload, None after the timeout."""
        self._seq += 1
        seq = _U64.pack(self._seq)
        for sock in self._sockets:
            sock.send_multipart([seq, *frames])
        return self._collect(seq, min_size, exact_size)

    def _collect(self, seq: bytes, min_size: int, exact_size: int | None) -> list[bytes] | None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        answers: dict[int, bytes] = {}
        deadline_ms = self.timeout_ms
        start = time.monotonic()
        while len(answers) < len(self._sockets):
            left = deadline_ms - (time.monotonic() - start) * 1000
            if left <= 0:
                logs.warn(logger, "lookup_timeout", "lookup channel: no answer after %d ms (%d/%d ranks "
                          "answered)", self.timeout_ms, len(answers), len(self._sockets))
                return None
            ready = dict(poller.poll(int(left)))  # whole ms, as pyzmq would round it
            for index, sock in enumerate(self._sockets):
                if sock not in ready:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    # Replies to earlier requests that timed out are stale: skip them.
                    if len(frames) == 2 and frames[0] == seq and len(frames[1]) >= min_size and (
                            exact_size is None or len(frames[1]) == exact_size):
                        answers[index] = frames[1]
        return [answers[i] for i in range(len(self._sockets))]

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
