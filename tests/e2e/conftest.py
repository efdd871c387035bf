"""Fixtures of the end-to-end tests: the tiny local model (built once, cached between runs)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> str:
    pytest.importorskip("vllm")
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    return str(build_model("tiny"))
