"""The HTTP parts the instance API and the coordinator share, on aiohttp: routes with their access rule, bodies
parsed into `schemas` models, LMCache's error bodies, and a server on a thread of its own.

- `Routes.add(method, path, handler, write=...)`: the handler runs only after `auth.check` passed; what it raises
  becomes a JSON answer: `ApiError(status, detail)` and `AuthError` → `{"detail": ...}` with that status,
  `schemas.BadRequest` → 400, a body pydantic refuses (bad JSON, wrong type, unknown field, missing field) → 422
  with pydantic's errors (location, message, type; never the input echoed back), a body over
  `schemas.MAX_BODY_BYTES` → 413 before it is read whole, anything else → 500 (logged, no detail).
- `body(request, Model)` reads and validates one body (an empty body is the model's defaults where it has them).
- `ServerThread` serves an app on its own event loop and daemon thread (inside vLLM's engine-core process the
  loop must not be vLLM's), bound before `start` returns (port 0: the OS picks; `port` tells which).
Every answer is counted in `management_requests{route, code}` (route: the path template).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Awaitable, Callable, Optional, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from lmcache_vllm.management import auth
from lmcache_vllm.management.schemas import MAX_BODY_BYTES, BadRequest
from lmcache_vllm.observability import metrics

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, detail: Any):
        super().__init__(str(detail))
        self.status = status
        self.detail = detail


def answer(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda v: json.dumps(v, separators=(",", ":")))


async def body(request: web.Request, model: type[M], *, optional: bool = False) -> M:
    """The request's JSON body as `model` (see the module docstring); `optional`: no body means the defaults."""
    raw = await request.read()
    if optional and not raw.strip():
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError(422, [{"loc": ["body", *exc_loc], "msg": e["msg"], "type": e["type"]}
                             for e in exc.errors(include_url=False, include_input=False, include_context=False)
                             for exc_loc in [list(e["loc"])]]) from None
    except (ValueError, RecursionError) as exc:  # deeply nested JSON and the like
        raise ApiError(422, [{"loc": ["body"], "msg": f"invalid JSON: {type(exc).__name__}",
                              "type": "json_invalid"}]) from None


def query_int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ApiError(422, [{"loc": ["query", name], "msg": f"expected an integer from {low} to {high}",
                              "type": "value_error"}])
    return value


class Routes:
    """An aiohttp app whose every route checks the token first (see the module docstring)."""

    def __init__(self, token: bytes, *, metric: str = "management_requests"):
        self.token = token
        self.metric = metric
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)

    def add(self, method: str, path: str, handler: Handler, *, write: bool) -> None:
        self.app.router.add_route(method, path, self._guarded(path, handler, write))

    def _guarded(self, path: str, handler: Handler, write: bool) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                auth.check(request.headers.get("Authorization"), self.token, write=write, peer=request.remote)
                response = await handler(request)
            except auth.AuthError as exc:
                response = answer({"detail": str(exc)}, exc.status)
                if exc.status == 401:
                    response.headers["WWW-Authenticate"] = "Bearer"
            except ApiError as exc:
                response = answer({"detail": exc.detail}, exc.status)
            except BadRequest as exc:
                response = answer({"detail": str(exc)}, 400)
            except web.HTTPRequestEntityTooLarge:
                response = answer({"detail": f"the body is larger than {MAX_BODY_BYTES} bytes"}, 413)
            except Exception:
                logger.exception("management call %s %s failed", request.method, path)
                response = answer({"detail": "internal error"}, 500)
            metrics.inc(self.metric, route=f"{request.method} {path}", code=str(response.status))
            return response
        return guarded


class ServerThread:
    """Serves `app` on `host:port` from a daemon thread with its own event loop."""

    def __init__(self, app: web.Application, host: str, port: int, name: str):
        self.app = app
        self.host = host
        self.port = port
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._runner: Optional[web.AppRunner] = None
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self, timeout: float = 30.0) -> int:
        """Binds and serves; the port bound. Raises OSError when it cannot bind."""
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout)
        return self.port

    async def _start(self) -> int:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        sockets = [s for s in (getattr(site._server, "sockets", None) or [])]  # the bound port (0: picked)
        return int(sockets[0].getsockname()[1]) if sockets else self.port

    def run(self, coro: Awaitable[Any], timeout: Optional[float] = None) -> Any:
        """Runs `coro` on this server's loop from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self, timeout: float = 10.0) -> None:
        if self._runner is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout)
            except Exception:
                logger.warning("%s did not stop cleanly", self.name, exc_info=True)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
