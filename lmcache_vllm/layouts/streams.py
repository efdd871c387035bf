"""Ordering and completion of the layouts' copies on a GPU: `Fence`, `DeferredRelease`, `SideStream`,
`copy_to_host`.

On a GPU a gather or scatter is only enqueued on the current stream; the host does not wait for it. So:
- host memory a copy writes (a gather into the L1 arena) holds the KV only once the stream has passed the
  copy: `Fence.record(device)` marks that point (on the current stream and on the device's copy stream,
  see below), `fence.wait()` blocks the calling host thread until then;
- host memory a copy reads (a scatter from the L1 arena) must not be freed or reused before that point:
  `DeferredRelease.add(fence, callbacks)` runs the callbacks (e.g. `MemoryObj.ref_down`) only once the fence
  has passed; `reap()` runs those that are due without blocking, `drain()` waits for all;
- a save must copy the KV after the forward that wrote it, which vLLM enqueues on its own (non-blocking)
  stream: `SideStream.mark()` records an event on the current stream (call it from vLLM's thread), and
  `with side.after(mark):` makes the copies issued inside wait for it on the device, not on the host;
- the torch path's copy of a gathered device staging chunk into host memory runs on the device's copy
  stream (`copy_to_host`), after an event recorded on the current stream once the gather is enqueued, so
  the next chunk's gather overlaps this one's transfer; the staging memory is kept from reuse until the copy
  stream has passed the copy (`record_stream`): reusing it earlier is the cross-stream hazard that
  corrupted the KV of vLLM's own CPU offloading.
On the CPU every copy is done when it returns: fences are passed at once, nothing is deferred, and
`copy_to_host` is the same copies without streams or events.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Iterator, Sequence

import torch


class Fence:
    """Points on device streams: passed once everything enqueued on them before `record` has run."""

    __slots__ = ("_events",)

    def __init__(self, *events: "torch.cuda.Event | None"):
        self._events = tuple(e for e in events if e is not None)

    @staticmethod
    def record(device: torch.device) -> "Fence":
        """The current position of `device`'s current stream and of its copy stream, if one was made (on the
        CPU: already passed)."""
        if device.type != "cuda":
            return _PASSED
        streams = [torch.cuda.current_stream(device)]
        copies = _copy_streams.get(_device_key(device))
        if copies is not None:
            streams.append(copies)
        events = []
        for stream in streams:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return Fence(*events)

    def done(self) -> bool:
        return all(event.query() for event in self._events)

    def wait(self) -> None:
        """Blocks the calling host thread until the fence has passed."""
        for event in self._events:
            event.synchronize()


_PASSED = Fence()


class DeferredRelease:
    """Callbacks held until their fence has passed (thread-safe)."""

    def __init__(self) -> None:
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


# ---- the torch path's device-to-host copies ---------------------------------------------------------------

_copy_streams: dict[int, "torch.cuda.Stream"] = {}
_copy_streams_lock = threading.Lock()


def _device_key(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def copy_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The stream the torch path copies device staging chunks into host memory on (one per GPU, made on
    first use; None on the CPU)."""
    if device.type != "cuda":
        return None
    key = _device_key(device)
    with _copy_streams_lock:
        stream = _copy_streams.get(key)
        if stream is None:
            stream = _copy_streams[key] = torch.cuda.Stream(torch.device("cuda", key))
        return stream


def copy_to_host(staging: torch.Tensor, chunk: torch.Tensor, runs: Sequence[tuple[int, int]] | None) -> None:
    """Copies a gathered `staging` chunk `[layers, planes, T, width]` into `chunk` (host memory): all of it
    when `runs` is None (one copy), else only token rows [start, end) of each run, so the rows of skipped
    slots keep the chunk's own bytes (a gather never writes them). On a GPU the copies are enqueued on the
    device's copy stream, after everything enqueued so far on the current stream (the gather), and return at
    once: `Fence.record` covers them."""
    stream = copy_stream(staging.device)
    if stream is None:
        _copy_runs(staging, chunk, runs)
        return
    gathered = torch.cuda.Event()
    gathered.record(torch.cuda.current_stream(staging.device))
    stream.wait_event(gathered)
    with torch.cuda.stream(stream):
        _copy_runs(staging, chunk, runs)
    staging.record_stream(stream)  # its memory is not handed out again before the copy stream passed here


def _copy_runs(staging: torch.Tensor, chunk: torch.Tensor, runs: Sequence[tuple[int, int]] | None) -> None:
    if runs is None:
        chunk.copy_(staging, non_blocking=True)
        return
    # Each (layer, plane, run) is one contiguous piece on both sides: a plain DMA, never a strided copy
    # through a pageable temporary.
    for layer in range(chunk.shape[0]):
        for plane in range(chunk.shape[1]):
            for start, end in runs:
                chunk[layer, plane, start:end].copy_(staging[layer, plane, start:end], non_blocking=True)


def valid_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) ranges of consecutive positions whose slot is >= 0."""
    valid = (slots >= 0).to(torch.int8)
    edges = torch.diff(valid, prepend=valid.new_zeros(1), append=valid.new_zeros(1)).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))
