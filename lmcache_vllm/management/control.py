"""`CacheControl`: how the instance API reaches every tensor-parallel rank's `RankOps`.

`call(op, bodies, timeout)` sends one call to every rank (one body each, in rank order, or the same body to all)
and returns every rank's answer, or raises `ControlUnavailable` when a rank did not answer in time (the engine is
not built yet, a worker is gone). The connector's scheduler side implements it over the workers' control sockets
(`integration/vllm/control.py`); `LocalControl` calls `RankOps` objects of this process (an instance whose
workers share the engine core's process, and the tests).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional, Sequence, Union

from lmcache_vllm.management.ops import RankOps

Bodies = Union[dict[str, Any], Sequence[dict[str, Any]]]


class ControlUnavailable(Exception):
    """A rank did not answer (not started yet, gone, or slower than the call's timeout)."""


class CacheControl(abc.ABC):
    @abc.abstractmethod
    def call(self, op: str, bodies: Bodies, timeout: float) -> list[dict[str, Any]]:
        """Every rank's answer to `op` (see the module docstring)."""

    def close(self) -> None:
        return None


def per_rank(bodies: Bodies, n: int) -> list[dict[str, Any]]:
    if isinstance(bodies, dict):
        return [bodies] * n
    if len(bodies) != n:
        raise ValueError(f"{len(bodies)} bodies for {n} ranks")
    return list(bodies)


class LocalControl(CacheControl):
    """`RankOps` of this process; `ranks()` gives them (None or fewer than expected: not ready yet)."""

    def __init__(self, ranks: Callable[[], Optional[Sequence[RankOps]]], world_size: int):
        self._ranks = ranks
        self.world_size = world_size

    def call(self, op: str, bodies: Bodies, timeout: float) -> list[dict[str, Any]]:
        ranks = self._ranks()
        if not ranks or len(ranks) != self.world_size:
            raise ControlUnavailable("the cache engine is not built yet")
        return [r.handle(op, b) for r, b in zip(ranks, per_rank(bodies, self.world_size))]
