"""A small proxy for disaggregated prefill/decode with vLLM's protocol (docs/DISAGGREGATED.md).

    python examples/pd_proxy.py --port 8000 \\
        --prefiller-hosts 127.0.0.1 --prefiller-ports 8100 --decoder-hosts 127.0.0.1 --decoder-ports 8200

Driven like vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), same arguments:
for each /v1/completions or /v1/chat/completions request it picks a prefill and a decode instance (round
robin), sends the prefill instance a copy of the body with `kv_transfer_params: {"do_remote_decode": true,
...}`, `max_tokens: 1` and no streaming, takes `kv_transfer_params` from its answer and sends the original
body with those params to the decode instance, whose answer (streamed or not) goes back to the client as it
comes. Both instances get the same `X-Request-Id`. If the prefill instance fails, the decode instance gets
the request without params and computes the prompt itself (counted in /healthcheck's `prefill_failures`): a
client's own `kv_transfer_params` never reach either instance.
With the fleet's chunk MAC key in its environment (`LMCACHE_VLLM_CHUNK_MAC_KEY`), the proxy authorizes each
prefill request with it (`params.proxy_params`): a prefill instance where disaggregated prefill is not
configured explicitly (`extra_config.pd: auto` with a key) holds for this proxy's requests only, never for a
plain client's (docs/SECURITY.md).
GET /healthcheck answers 200 with those counts. fastapi, httpx and uvicorn come with vLLM.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("pd_proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_HOP_HEADERS = ("authorization",)  # forwarded to both instances


def proxy_mac() -> Any:
    """The chunk MAC of the key(s) in this process's environment (None without one)."""
    from lmcache_vllm.config.extra import env_mac_keys
    from lmcache_vllm.storage.codec import ChunkMac

    keys = env_mac_keys(os.environ)
    return ChunkMac(keys) if keys else None


def prefill_body(body: dict[str, Any], mac: Any = None) -> dict[str, Any]:
    """What the prefill instance gets: one token, no streaming, the request to hold its KV (authorized with
    `mac`, the fleet's chunk MAC key, when there is one)."""
    params = dict(PREFILL_PARAMS)
    if mac is not None:
        from lmcache_vllm.integration.vllm.pd.params import proxy_params

        params.update(proxy_params(mac))
    out = dict(body, kv_transfer_params=params, stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """What the decode instance gets: the client's body with the prefill instance's params, if any, and never
    the client's own (they could name any host for the decode instance to connect to)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        out["kv_transfer_params"] = params
    return out


def build_app(prefillers: list[str], decoders: list[str], timeout_s: float = 600.0) -> FastAPI:
    state: dict[str, Any] = {"prefill_failures": 0, "requests": 0}
    mac = proxy_mac()
    next_prefiller = itertools.cycle(prefillers)
    next_decoder = itertools.cycle(decoders)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        state["client"] = httpx.AsyncClient(timeout=timeout_s, limits=limits)
        yield
        await state["client"].aclose()

    app = FastAPI(lifespan=lifespan)

    async def prefill(url: str, body: dict, headers: dict) -> dict[str, Any] | None:
        try:
            response = await state["client"].post(url, json=prefill_body(body, mac), headers=headers)
            response.raise_for_status()
            return response.json().get("kv_transfer_params") or None
        except (httpx.HTTPError, ValueError) as exc:
            state["prefill_failures"] += 1
            logger.warning("prefill at %s failed (%s); the decode instance computes the prompt", url, exc)
            return None

    async def handle(path: str, request: Request) -> Response:
        body = await request.json()
        state["requests"] += 1
        headers = {"X-Request-Id": str(uuid.uuid4())}
        headers.update({k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS})
        params = await prefill(f"{next(next_prefiller)}{path}", body, headers)
        client: httpx.AsyncClient = state["client"]
        decode = client.build_request("POST", f"{next(next_decoder)}{path}", json=decode_body(body, params),
                                      headers=headers)
        try:
            response = await client.send(decode, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"decode instance unreachable: {exc}"}, status_code=502)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for part in response.aiter_raw():
                    yield part
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code,
                                 media_type=response.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return {"status": "ok", "prefillers": prefillers, "decoders": decoders,
                "requests": state["requests"], "prefill_failures": state["prefill_failures"]}

    return app


def _urls(hosts: list[str], ports: list[int], what: str) -> list[str]:
    if len(hosts) != len(ports):
        raise SystemExit(f"--{what}-hosts and --{what}-ports need as many entries each")
    return [f"http://{h}:{p}" for h, p in zip(hosts, ports)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"])
    parser.add_argument("--prefiller-ports", nargs="+", type=int, default=[8100])
    parser.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"])
    parser.add_argument("--decoder-ports", nargs="+", type=int, default=[8200])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one instance may take to answer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    app = build_app(_urls(args.prefiller_hosts, args.prefiller_ports, "prefiller"),
                    _urls(args.decoder_hosts, args.decoder_ports, "decoder"), args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
