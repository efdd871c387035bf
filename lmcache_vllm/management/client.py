"""`request`: one JSON call to a management API or the coordinator, with the bearer token, bounded in time (the
instances' registration and the CLI use it; it imports nothing heavy, so `lmcache-vllm cache` starts fast)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional


def request(url: str, method: str, token: Optional[bytes], body: Optional[dict[str, Any]] = None,
            timeout: float = 5.0) -> tuple[int, Any]:
    """(status, JSON answer or None) of one call (with the bearer token, when given); OSError when unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": "Bearer " + token.decode("ascii")} if token else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None
