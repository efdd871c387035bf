"""What `bench_conversations.py` sends and gets back, recorded, and what an unbounded cache would serve of it.

`RecordingProxy` sits between vLLM's multi-turn benchmark client and the server under test (a thread with
its own asyncio loop, aiohttp both ways). It forwards every request as it is, except that each chat
completion also asks for `return_token_ids` (so the proxy sees the exact prompt token ids the server
rendered and the ids it generated) and, when given, `allowed_token_ids`; it streams every answer back
line by line as it arrives and records one `Exchange` per completed chat request.

Why `allowed_token_ids`: the local models have random weights, so the tokens they generate do not survive
detokenisation and retokenisation (their text tokenises differently after 3 tokens on average), and a
conversation's next turn, which carries the answer as text, would never share the answer's KV with the
turn before. A trained model generates text that mostly tokenises back to the same ids; restricting the
random model to whole-word tokens that round-trip (`round_trip_word_tokens`) restores that property for
every configuration alike.

`unbounded_hits(exchanges, unit)` counts, for each request in arrival order, the prompt tokens that an
unbounded cache of granularity `unit` (vLLM's block, our chunk) would serve: the longest run of whole units
from the start of the prompt that some earlier request's prompt + answer covered, at most the prompt's
length - 1 (the last prompt token is always computed: vLLM needs its logits). An answer's last token has no
KV (it was never fed back), so an exchange caches `prompt + answer[:-1]`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Exchange:
    """One chat completion as it went through the proxy (times from time.monotonic())."""

    arrival_s: float
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    done_s: float = 0.0
    status: int = 0


def _absorb(exchange: Exchange, event: dict) -> None:
    """Takes the token ids out of one streamed chunk or a whole (non-streamed) answer."""
    if event.get("prompt_token_ids"):
        exchange.prompt_ids = list(event["prompt_token_ids"])
    for choice in event.get("choices") or ():
        if choice.get("token_ids"):
            exchange.output_ids.extend(choice["token_ids"])


class RecordingProxy:
    """`start()` -> the proxy's base URL; `exchanges` holds what completed; `stop()` ends it."""

    def __init__(self, upstream: str, allowed_token_ids: Optional[list[int]] = None):
        self.upstream = upstream.rstrip("/")
        self.allowed_token_ids = allowed_token_ids
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chat-proxy", daemon=True)
        self._runner = None
        self._session = None

    def start(self) -> str:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(30)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def take(self) -> list[Exchange]:
        """The exchanges recorded so far, in arrival order; the record starts empty again."""
        with self._lock:
            out, self.exchanges = self.exchanges, []
        return sorted(out, key=lambda e: e.arrival_s)

    async def _serve(self) -> int:
        import aiohttp
        from aiohttp import web

        # Lines of 1 MiB and more: a streamed answer's first event carries every prompt token id.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 22)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        return int(sock.getsockname()[1])

    async def _close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request):
        from aiohttp import web

        body = await request.read()
        exchange = None
        if request.method == "POST" and request.path == CHAT_PATH:
            payload = json.loads(body)
            payload["return_token_ids"] = True
            if self.allowed_token_ids is not None:
                payload["allowed_token_ids"] = self.allowed_token_ids
            body = json.dumps(payload).encode()
            exchange = Exchange(arrival_s=time.monotonic())
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization",
                                                                             "accept", "x-session-id")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            whole = bytearray()
            async for line in upstream.content:  # SSE: one event per line, passed on as it comes
                await response.write(line)
                if exchange is None:
                    continue
                text = line.strip()
                if text.startswith(b"data: ") and text != b"data: [DONE]":
                    _absorb(exchange, json.loads(text[6:]))
                elif not text.startswith(b"data:"):
                    whole += line
            await response.write_eof()
        if exchange is not None:
            if whole.strip():
                try:
                    _absorb(exchange, json.loads(bytes(whole)))
                except ValueError:
                    pass  # an error body: no ids
            exchange.status, exchange.done_s = upstream.status, time.monotonic()
            if upstream.status == 200:
                with self._lock:
                    self.exchanges.append(exchange)
        return response


def round_trip_word_tokens(tokenizer) -> list[int]:
    """Ids of the whole-word tokens (a space then letters: a byte-level BPE's `Ġword`) that tokenise back to
    themselves; any sequence of them does too, since the pre-tokenizer splits text at each such word."""
    out = []
    for text, token_id in tokenizer.get_vocab().items():
        if re.fullmatch(r"\u0120[A-Za-z]+", text) and \
                tokenizer.encode(tokenizer.decode([token_id]), add_special_tokens=False) == [token_id]:
            out.append(token_id)
    return sorted(out)


def prefix_digests(tokens: list[int], unit: int) -> Iterable[bytes]:
    """The digest of each whole-unit prefix of `tokens`, shortest first."""
    digest = hashlib.blake2b(digest_size=16)
    for start in range(0, len(tokens) - unit + 1, unit):
        digest.update(b"".join(t.to_bytes(4, "little") for t in tokens[start:start + unit]))
        yield digest.copy().digest()


def unbounded_hits(exchanges: Iterable[Exchange], unit: int, with_answers: bool = True) -> list[int]:
    """Per exchange (in the order given): prompt tokens an unbounded cache of `unit`-token granularity
    would serve from earlier exchanges' prompt + answer (`with_answers=False`: their prompts only)."""
    if unit <= 0:
        raise ValueError(f"unit ({unit}) must be positive")
    cached: set[bytes] = set()
    hits = []
    for exchange in exchanges:
        prompt = exchange.prompt_ids
        matched = 0
        for digest in prefix_digests(prompt, unit):
            if digest not in cached:
                break
            matched += unit
        hits.append(min(matched, max(0, len(prompt) - 1)))
        stored = prompt + exchange.output_ids[:-1] if with_answers else prompt
        cached.update(prefix_digests(stored, unit))
    return hits


def conversation_moves(exchanges: Sequence[Exchange], servers: Sequence[Optional[str]]) -> tuple[int, int]:
    """(turns after a conversation's first, those served elsewhere than its previous turn): `servers[i]` served
    `exchanges[i]` (None: not known, not counted). A turn continues the conversation whose latest prompt is a
    proper prefix of its own prompt (the exchanges in arrival order)."""
    latest: list[tuple[list[int], Optional[str]]] = []
    turns = moved = 0
    for exchange, server in zip(exchanges, servers):
        prompt = exchange.prompt_ids
        for i, (previous, previous_server) in enumerate(latest):
            if len(previous) < len(prompt) and prompt[:len(previous)] == previous:
                if server is not None and previous_server is not None:
                    turns += 1
                    moved += server != previous_server
                del latest[i]
                break
        latest.append((prompt, server))
    return turns, moved
