"""`benchmarks/_chat_trace.py`, which bench_conversations.py's figures rest on: the unbounded-cache count of a
trace (whole units of an earlier prompt + answer, the last prompt token always computed) and the recording
proxy between a chat client and a server (real sockets: a small aiohttp server stands in for vLLM)."""
from __future__ import annotations

import json
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _chat_trace import Exchange, RecordingProxy, conversation_moves, unbounded_hits  # noqa: E402
from _l1_replay import compare  # noqa: E402


def _ex(prompt: list[int], output: list[int] = ()) -> Exchange:
    return Exchange(arrival_s=0.0, prompt_ids=list(prompt), output_ids=list(output))


def test_unbounded_hits_count_whole_units_of_earlier_prompts_and_answers():
    turn1 = _ex(range(10), [100, 101, 102, 103])
    # the next turn: turn 1's prompt and answer (its last token has no KV: never fed back), then new tokens
    turn2 = _ex([*range(10), 100, 101, 102, 103, 50, 51])
    other = _ex([*range(4), 7, 7, 7, 7])
    repeat = _ex(range(8))  # all of it cached: its last token is computed anyway
    assert unbounded_hits([turn1, turn2, other, repeat], 4) == [0, 12, 4, 7]
    assert unbounded_hits([turn1, turn2, other, repeat], 4, with_answers=False) == [0, 8, 4, 7]
    assert unbounded_hits([turn1, turn2], 3) == [0, 12]
    with pytest.raises(ValueError):
        unbounded_hits([turn1], 0)


def _sessions(users: int, turns: int) -> list[Exchange]:
    """`users` conversations served round robin, each turn adding one 4-token chunk of question and one of
    answer (+1 token: an answer's last token has no KV) to the conversation's history."""
    history = {u: [] for u in range(users)}
    out, token = [], 10
    for _ in range(turns):
        for u in range(users):
            prompt = history[u] + list(range(token, token + 4))
            answer = list(range(token + 4, token + 9))
            token += 9
            out.append(_ex(prompt, answer))
            history[u] = prompt + answer[:-1]
    return out


def test_conversation_moves_count_later_turns_served_elsewhere_than_the_previous_one():
    system = [1, 2, 3]
    a1, b1 = _ex([*system, 10]), _ex([*system, 20])  # two conversations sharing a system prompt
    a2, b2 = _ex([*system, 10, 11, 12]), _ex([*system, 20, 21])
    a3 = _ex([*system, 10, 11, 12, 13])
    trace = [a1, b1, a2, b2, a3]
    assert conversation_moves(trace, ["x", "y", "x", "x", "y"]) == (3, 2)  # b2 and a3 moved
    assert conversation_moves(trace, ["x", "y", "x", "y", "x"]) == (3, 0)
    assert conversation_moves(trace, ["x", None, "x", "y", "x"]) == (2, 0)  # b's first server not known


def test_l1_replay_lru_and_arc_miss_round_robin_sessions_that_lip_partly_keeps():
    trace = _sessions(users=3, turns=4)  # every turn's history: 2 chunks per earlier turn
    got = compare(trace, unit=4, capacity=4)
    assert len({sum(v) for v in got.values()}) == 1  # the disk has everything: the same chunks are found
    assert got["lru"][0] == 0  # the next session is always the least recently used: a loop beats LRU
    assert got["belady"][0] > got["lip"][0] > got["lru"][0] == got["arc"][0]  # ARC does not help a loop
    assert compare(trace, unit=4, capacity=100)["lru"] == (sum(got["lru"]), 0)  # all fits: all from L1


def _upstream():
    """An aiohttp server answering chat completions like vLLM with return_token_ids (streamed or not), and
    echoing what it was sent; (base URL, the bodies it got, stop)."""
    import asyncio
    import socket

    from aiohttp import web

    bodies: list[dict] = []

    async def chat(request):
        body = await request.json()
        bodies.append(body)
        if not body.get("stream"):
            return web.json_response({"prompt_token_ids": [1, 2, 3],
                                      "choices": [{"message": {"content": "ab"}, "token_ids": [7, 8]}]})
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        for event in ({"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"content": ""}}]},
                      {"choices": [{"delta": {"content": "a"}, "token_ids": [7]}]},
                      {"choices": [{"delta": {"content": "b"}, "token_ids": [8, 9]}]}):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", lambda request: web.json_response({"data": []}))
    runner = web.AppRunner(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", bodies, stop


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def test_proxy_records_token_ids_and_passes_answers_through():
    upstream, bodies, stop = _upstream()
    proxy = RecordingProxy(upstream, allowed_token_ids=[7, 8, 9])
    base = proxy.start()
    try:
        streamed = _post(f"{base}/v1/chat/completions", {"messages": [], "stream": True})
        whole = json.loads(_post(f"{base}/v1/chat/completions", {"messages": []}))
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
            assert json.loads(resp.read()) == {"data": []}
    finally:
        exchanges = proxy.take()
        proxy.stop()
        stop()
    assert streamed.count(b"data: ") == 4 and streamed.endswith(b"data: [DONE]\n\n")
    assert whole["choices"][0]["message"]["content"] == "ab"
    assert all(b["return_token_ids"] is True and b["allowed_token_ids"] == [7, 8, 9] for b in bodies)
    assert [(e.prompt_ids, e.output_ids, e.status) for e in exchanges] == [([1, 2, 3], [7, 8, 9], 200),
                                                                          ([1, 2, 3], [7, 8], 200)]
    assert all(e.done_s >= e.arrival_s > 0 for e in exchanges)
