"""Ordering and completion of the layouts' copies on a GPU: `Fence`, `DeferredRelease`, `SideStream`.

On a GPU a gather or scatter is only enqueued on the current stream; the host does not wait for it. So:
- host memory a copy writes (a gather into the L1 arena) holds the KV only once the stream has passed the
  copy: `Fence.record(device)` marks that point, `fence.wait()` blocks the calling host thread until then;
- host memory a copy reads (a scatter from the L1 arena) must not be freed or reused before that point:
  `DeferredRelease.add(fence, callbacks)` runs the callbacks (e.g. `MemoryObj.ref_down`) only once the fence
  has passed; `reap()` runs those that are due without blocking, `drain()` waits for all;
- a save must copy the KV after the forward that wrote it, which vLLM enqueues on its own (non-blocking)
  stream: `SideStream.mark()` records an event on the current stream (call it from vLLM's thread), and
  `with side.after(mark):` makes the copies issued inside wait for it on the device, not on the host.
On the CPU every copy is done when it returns: fences are passed at once and nothing is deferred.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Iterator

import torch


class Fence:
    """A point on a device stream: passed once everything enqueued on it before `record` has run."""

    __slots__ = ("_event",)

    def __init__(self, event: "torch.cuda.Event | None"):
        self._event = event

    @staticmethod
    def record(device: torch.device) -> "Fence":
        """The current position of `device`'s current stream (on the CPU: already passed)."""
        if device.type != "cuda":
            return _PASSED
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return Fence(event)

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Blocks the calling host thread until the fence has passed."""
        if self._event is not None:
            self._event.synchronize()


_PASSED = Fence(None)


class DeferredRelease:
    """Callbacks held until their fence has passed (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[tuple[Fence, list[Callable[[], None]]]] = []

    def add(self, fence: Fence, callbacks: Iterable[Callable[[], None]]) -> None:
        callbacks = list(callbacks)
        if fence.done():
            _run(callbacks)
            return
        with self._lock:
            self._pending.append((fence, callbacks))

    def reap(self) -> None:
        """Runs the callbacks whose fence has passed (fences pass in order per stream; a later one may be
        due before an earlier one of another stream, so each is asked)."""
        with self._lock:
            due = [entry for entry in self._pending if entry[0].done()]
            self._pending = [entry for entry in self._pending if entry not in due]
        for _, callbacks in due:
            _run(callbacks)

    def drain(self) -> None:
        """Waits for every fence and runs every callback."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fence, callbacks in pending:
            fence.wait()
            _run(callbacks)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def _run(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()


class SideStream:
    """A stream of its own for saves on a GPU (on the CPU: nothing, copies run where they are called)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def mark(self) -> "torch.cuda.Event | None":
        """An event at the current position of the calling thread's current stream (vLLM's, when called
        from vLLM's step)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def after(self, mark: "torch.cuda.Event | None") -> Iterator[None]:
        """Copies issued inside run on the side stream, after `mark` (None: no extra ordering)."""
        if self.stream is None:
            yield
            return
        if mark is not None:
            self.stream.wait_event(mark)
        with torch.cuda.stream(self.stream):
            yield
