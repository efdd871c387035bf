"""`Breaker`: the circuit breaker of a remote tier's server (a Redis node: `redis/guard.py`; a Mooncake master:
`mooncake/client.py`).

Closed, or open until a retry time that doubles after each failure, from `base_secs` up to `max_secs`; calls
refused while it is open fail at once, without the network. The first call admitted after the retry time is
the probe: its success closes the breaker, its failure pushes the time out. A probe that ends neither way
(cancelled: its request was aborted; or never sent) gives its turn back (`abandon_probe`), so the next call
probes instead of the breaker staying shut. Used from one event loop.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

logger = logging.getLogger(__name__)


class Breaker:
    def __init__(self, subject: str, *, base_secs: float, max_secs: float):
        """`subject`: what fails, for the log (e.g. "redis node host:port"; never credentials)."""
        self.subject = subject
        self.base_secs = float(base_secs)
        self.max_secs = float(max_secs)
        self._failures = 0
        self._retry_at: Optional[float] = None  # open until then (None: closed)
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._retry_at is not None

    def admit(self) -> Optional[bool]:
        """None: refused (open); True: let through as the probe; False: let through (closed)."""
        if self._retry_at is None:
            return False
        if time.monotonic() >= self._retry_at and not self._probing:
            self._probing = True
            return True
        return None

    def succeeded(self) -> None:
        if self._retry_at is not None:
            logger.info("%s reachable again", self.subject)
        self._retry_at, self._failures, self._probing = None, 0, False

    def failed(self, why: str) -> None:
        delay = min(self.max_secs, self.base_secs * (2 ** self._failures))
        if self._failures == 0:
            logger.warning("%s failed (%s); its keys are misses for %.1fs", self.subject, why, delay)
        self._failures += 1
        self._retry_at = time.monotonic() + delay
        self._probing = False

    def abandon_probe(self) -> None:
        """A probe that said nothing about the server gives its turn to the next call."""
        self._probing = False
