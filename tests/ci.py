"""Skips that must not hide a failure in CI: `CI=true` (set by CI; `.ci/run` installs everything the suite
needs there) turns a skip for something missing or broken into a failure (`skip_or_fail`), and `missing_in_ci()`
names what every CI run must have (checked once at the start of the session, tests/conftest.py): vLLM and its
compiled CPU ops, our compiled CPU ops, and the web stack of examples/pd_proxy.py. Elsewhere (a laptop without
vLLM, a GPU host) the same tests skip with their reason."""
from __future__ import annotations

import importlib
import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """A skip outside CI, a failure in CI (where a skip would hide a broken install or a start-up failure)."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: a failure, not a skip)")
    pytest.skip(reason)


def missing_in_ci() -> list[str]:
    """What the suite would skip for, that CI must have: [] when everything is there."""
    missing = []
    for module in ("vllm", "vllm._custom_ops", "fastapi", "uvicorn", "hypothesis"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure to import is one
            missing.append(f"{module} ({type(exc).__name__}: {exc})")
    try:
        import torch
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        torch.ops._C.cpu_attn_reshape_and_cache  # noqa: B018  (the op tests/test_ops.py compares with)
    except Exception as exc:
        missing.append(f"vLLM's CPU op cpu_attn_reshape_and_cache ({type(exc).__name__}: {exc})")
    from lmcache_vllm import ops

    if ops.cpu_ext() is None:
        missing.append("lmcache_vllm._cpu_ops (not built: python setup.py build_ext --inplace)")
    return missing
