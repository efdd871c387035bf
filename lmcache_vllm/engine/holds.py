"""What a lookup answers and holds: `PrefixHit` (where a run of chunks is) and `HeldPrefix` (the chunks held for
one request until its load takes them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lmcache_vllm.storage.prefetch import PrefetchHandle


@dataclass(frozen=True)
class PrefixHit:
    """Where a looked-up run of chunks is: tokens [start, end) found (end 0: nothing found), and the tier
    holding each of its chunks (`Tier.LOCAL_CPU` for L1, then the lower tiers' names)."""

    start: int
    end: int
    chunk_tiers: tuple[str, ...]


@dataclass
class HeldPrefix:
    """What a lookup promised one request: the chunks of its tokens from `start` on that some tier holds,
    held (L1 ones at once, lower-tier ones once read into L1) until a `retrieve(..., owner=self.owner)`
    takes them or `release()` (the request went away or is done)."""

    handle: PrefetchHandle
    start: int  # first token of the first chunk looked up (chunk-aligned)
    ends: list[int]  # end token of each chunk looked up

    @property
    def owner(self) -> int | None:
        return self.handle.owner

    def located(self, timeout: float | None = 0.0) -> PrefixHit | None:
        """The hit, once every tier answered (waiting at most `timeout` seconds); None before."""
        found = self.handle.located(timeout)
        if found is None:
            return None
        n = found.num_chunks
        return PrefixHit(self.start, self.ends[n - 1] if n else 0, tuple(found.tiers))

    def ready(self) -> bool:
        """Whether the reads are over (nothing left to wait for; a failed read also ends them)."""
        return self.handle.done()

    def read_in_full(self) -> bool:
        """Whether the reads are over and brought every chunk located: a lower tier can list a chunk it then
        cannot give (its host died), and a load planned on the located hit would fail."""
        found = self.handle.located(0.0)
        return self.handle.done() and found is not None and self.handle.held() >= found.num_chunks

    def wait(self, timeout: float | None) -> None:
        """Waits (at most `timeout` s) until every chunk located is read and held."""
        self.handle.wait(timeout)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` once the reads are over (at once if they are)."""
        self.handle.add_done_callback(callback)

    def release(self) -> None:
        self.handle.cancel()
