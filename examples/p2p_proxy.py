"""A round-robin proxy in front of N vLLM instances that share their caches peer to peer (docs/P2P.md).

    python examples/p2p_proxy.py --port 8000 --backends http://127.0.0.1:8100 http://127.0.0.1:8200

Every request (any path and method: completions, chat, /v1/models, ...) goes to the next instance in turn,
its answer (streamed or not) back as it comes; an instance that cannot be reached is skipped for that request
(the next one is tried, each at most once). Round robin on purpose: it is the router that knows nothing about
caches, so a prompt one instance computed often lands on another, which then pulls the prompt's KV from the
first (enable_p2p) instead of computing it. GET /proxy/health answers the counts per instance. fastapi,
httpx and uvicorn come with vLLM.
"""
from __future__ import annotations

import argparse
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("p2p_proxy")
_DROPPED_HEADERS = ("host", "content-length", "connection", "transfer-encoding")


def build_app(backends: list[str], timeout_s: float = 600.0) -> FastAPI:
    sent = {b: 0 for b in backends}
    failed = {b: 0 for b in backends}
    turn = {"next": 0}
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["http"] = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=None,
                                                                                     max_keepalive_connections=None))
        yield
        await clients["http"].aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/proxy/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "sent": sent, "unreachable": failed}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
        first = turn["next"]
        turn["next"] = (first + 1) % len(backends)
        for i in range(len(backends)):
            backend = backends[(first + i) % len(backends)]
            upstream = clients["http"].build_request(request.method, f"{backend}/{path}", content=body,
                                                     headers=headers, params=request.query_params)
            try:
                response = await clients["http"].send(upstream, stream=True)
            except httpx.HTTPError as exc:
                failed[backend] += 1
                logger.warning("%s unreachable (%s); trying the next instance", backend, exc)
                continue
            sent[backend] += 1
            return StreamingResponse(_relay(response), status_code=response.status_code,
                                     media_type=response.headers.get("content-type"))
        return JSONResponse({"error": "no instance reachable"}, status_code=502)

    return app


async def _relay(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for part in response.aiter_raw():
            yield part
    finally:
        await response.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backends", nargs="+", required=True, help="base URLs of the vLLM instances")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one instance may take to answer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(build_app([b.rstrip("/") for b in args.backends], args.timeout), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
