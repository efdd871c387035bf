"""Which codec a chunk sent to another instance gets (`extra_config.transfer_serde`), and the rates `auto`
decides by.

A codec pays on a wire only when the link is slower than the codec: with the chunk coded before it is sent
(PD holds code at fill, on the save thread), a send takes stored bytes / link rate, and the receiver decodes
one chunk while the next arrives, so coding wins when the encode rate (raw bytes per second, the slower side:
lossless decodes ~4x faster than it encodes) is above the link's rate. `auto` compares the two measured
rates: this process's lossless encode rate (`coders.encode_rate`, from every lossless encode, the disk and
Redis tiers' included; an instance that has none yet codes one chunk to measure it) and the rate its recent
sends reached (`LINK`, fed by the transfer server with every send of at least `MIN_SAMPLE_BYTES`). Until a
send was measured, `auto` sends naive (that first send measures the link). Loopback and a fast LAN stay
naive; a link slower than the codec (1 GbE: 0.11 GB/s against ~0.45 GB/s per core) gets lossless.
"""
from __future__ import annotations

import threading
from typing import Optional

from lmcache_vllm.storage import coders

AUTO = "auto"
MIN_SAMPLE_BYTES = 1 << 20  # smaller sends measure latency, not bandwidth
_WEIGHT = 0.3  # of a new sample in the moving average


class LinkRate:
    """A moving average of the rates (wire bytes per second) this process's sends reached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rate: Optional[float] = None

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        with self._lock:
            self._rate = sample if self._rate is None else (1 - _WEIGHT) * self._rate + _WEIGHT * sample

    @property
    def rate(self) -> Optional[float]:
        with self._lock:
            return self._rate

    def reset(self) -> None:
        with self._lock:
            self._rate = None


LINK = LinkRate()


def wire_coder(setting: str, link: LinkRate = LINK) -> str:
    """The codec for the next chunk sent under `setting` (a codec name, or `auto`: see the module docstring)."""
    if setting != AUTO:
        return setting
    link_rate = link.rate
    if link_rate is None:
        return coders.NAIVE
    encode_rate = coders.encode_rate(coders.LOSSLESS)
    if encode_rate is None:
        return coders.LOSSLESS  # measures this process's encode rate on this chunk
    return coders.LOSSLESS if encode_rate > link_rate else coders.NAIVE
