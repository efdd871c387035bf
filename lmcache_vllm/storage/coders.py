"""The payload coders of a stored chunk: how a chunk's tensor becomes the bytes behind its header
(`codec.py`) and back. A tier picks one by name (`codec.ChunkCodec`); the header names the coder of each
chunk (its `code`, never renumbered) with one argument byte, so a reader needs no setting to read it.

- `naive` (code 0): the tensor's bytes as they are.
- `lossless` (code 1): blosc2 (a well-kept C library) with its byte shuffle (the bytes of each element
  grouped by significance: a bf16 value's sign-and-exponent byte is highly redundant, its low mantissa byte
  is not) and zstd at level 1 over each shuffled byte plane of 1 MiB blocks. Measured on KV vLLM computed
  (medium local model, bf16, AMD EPYC): 1.47x fewer bytes, decode 2.0-2.2 GB/s and encode 0.45 GB/s per core
  (benchmarks/bench_codecs.py; lz4 instead of zstd: 1.13x). Exact.
- `fp8` (code 2): OCP e4m3 values with a power-of-two scale per token and group of `2**arg` elements (64
  where the row width allows: within one head for every head size that is a multiple of 64; MLA's 576-wide
  latent gets 9 scales per token, its 64 rope elements their own). The scale is stored as a signed exponent
  byte, chosen so that the group's largest magnitude maps to at most 448, e4m3's largest; multiplying by a
  power of two is exact, so only e4m3's 3 mantissa bits lose precision. 1.97x fewer bytes on 16-bit KV.
  Lossy: never a default (docs/CONFIG.md, "Compression"). It applies to 16- and 32-bit float chunks whose
  values are finite; any other chunk (an fp8 KV cache stored as bytes, Mamba state pages) is stored lossless.

`encode` returns None when its coder would not make the chunk smaller (or does not apply): the caller stores
it with the coder it falls back to. `decode_into` fills a preallocated tensor from stored bytes whose length
and checksum the caller checked; for bytes that are not what this coder wrote it raises `BadPayload` (the
caller's `CorruptEntry`). Both release the GIL for their bulk work (blosc2 with `set_releasegil`, torch ops).
"""
from __future__ import annotations

import functools
import math
import threading
import time
import warnings
from abc import ABC, abstractmethod
from typing import Any, Optional, Union

import numpy as np
import torch

Buffer = Union[bytes, bytearray, memoryview]

NAIVE, LOSSLESS, FP8 = "naive", "lossless", "fp8"
FP8_MAX = 448.0  # e4m3fn's largest finite value
_FP8_SOURCES = (torch.float16, torch.bfloat16, torch.float32)
_LOSSLESS_BLOCK = 1 << 20


@functools.cache
def _blosc2() -> Any:
    """blosc2, imported on first use (~0.4 s: processes that never code a chunk, vLLM's API server among them,
    import this module through the wire format), set to compress and decompress without the GIL."""
    import blosc2

    blosc2.set_releasegil(True)  # (process-wide in blosc2)
    return blosc2


class BadPayload(ValueError):
    """Stored bytes that this coder did not write (or that were altered)."""


class PayloadCoder(ABC):
    """One way to store a chunk's tensor. `code` goes into chunk headers: stable, never reused."""

    name: str
    code: int

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> Optional[tuple[Buffer, int]]:
        """(stored bytes, argument byte), or None when this coder does not apply or would not shrink it."""

    @abstractmethod
    def stored_size_ok(self, arg: int, shape: tuple[int, ...], dtype: torch.dtype, stored: int) -> bool:
        """Whether `stored` bytes with argument `arg` can hold a chunk of this shape and dtype (checked on
        the header, before anything is read or allocated)."""

    @abstractmethod
    def decode_into(self, stored: Buffer, arg: int, out: torch.Tensor) -> None:
        """Fills `out` (contiguous, on the CPU, of the header's shape and dtype) from `stored`."""


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


class Naive(PayloadCoder):
    name, code = NAIVE, 0

    def encode(self, tensor: torch.Tensor) -> Optional[tuple[Buffer, int]]:
        return None  # the caller stores the tensor's bytes themselves (no copy)

    def stored_size_ok(self, arg: int, shape: tuple[int, ...], dtype: torch.dtype, stored: int) -> bool:
        return arg == 0 and stored == math.prod(shape) * dtype.itemsize

    def decode_into(self, stored: Buffer, arg: int, out: torch.Tensor) -> None:
        _bytes_of(out)[:] = memoryview(stored).cast("B")


class Lossless(PayloadCoder):
    """blosc2: byte shuffle by element size, zstd level 1 per byte plane (see the module docstring)."""

    name, code = LOSSLESS, 1
    _OVERHEAD = 32  # blosc2's chunk header; a stored chunk is never larger than raw + this

    def encode(self, tensor: torch.Tensor) -> Optional[tuple[Buffer, int]]:
        raw = _bytes_of(tensor)
        if not raw.nbytes or raw.nbytes >= (1 << 31) - self._OVERHEAD:  # blosc2 chunks hold < 2 GiB
            return None
        blosc2 = _blosc2()
        stored = blosc2.compress2(raw, codec=blosc2.Codec.ZSTD, clevel=1, typesize=tensor.element_size(),
                                  filters=[blosc2.Filter.SHUFFLE], splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
                                  blocksize=_LOSSLESS_BLOCK, nthreads=1)
        return (stored, 0) if len(stored) < raw.nbytes else None

    def stored_size_ok(self, arg: int, shape: tuple[int, ...], dtype: torch.dtype, stored: int) -> bool:
        return arg == 0 and self._OVERHEAD <= stored < math.prod(shape) * dtype.itemsize

    def decode_into(self, stored: Buffer, arg: int, out: torch.Tensor) -> None:
        dest = _bytes_of(out)
        blosc2 = _blosc2()
        head = bytes(memoryview(stored)[:self._OVERHEAD])  # (both read the chunk's header only)
        try:
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(head)
            clib = blosc2.get_clib(head)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BadPayload(f"not a blosc2 chunk: {exc}") from None
        if nbytes != dest.nbytes or cbytes != len(stored) or clib != "Zstd":
            raise BadPayload(f"blosc2 chunk of {nbytes} bytes ({cbytes} stored, {clib}); expected "
                             f"{dest.nbytes} ({len(stored)} stored, Zstd)")
        try:  # (into `dest`, whose size the header's nbytes matched: it writes no byte beyond it)
            blosc2.decompress2(stored, dst=dest, nthreads=1)
        except (RuntimeError, ValueError) as exc:
            raise BadPayload(f"blosc2 could not decode the chunk: {exc}") from None


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where power-of-two scaling is exact: bf16 and fp32 themselves; fp16 (exponents up to 15 only) in fp32."""
    return torch.float32 if dtype == torch.float16 else dtype


def _as_tensor(buf: Buffer) -> torch.Tensor:
    """A uint8 tensor over `buf` without a copy (read only: torch warns about read-only buffers, we only read)."""
    view = memoryview(buf).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def fp8_group(width: int) -> int:
    """Elements per scale along a row of `width`: 64 where it divides the row, else the largest power of
    two below it that does (head sizes of 80 or 112: 16)."""
    group = 64
    while width % group:
        group //= 2
    return group


class Fp8(PayloadCoder):
    """Scaled e4m3 (see the module docstring). Stored: one int8 exponent per group, then one e4m3 byte per
    element; `arg` = log2 of the group size."""

    name, code = FP8, 2

    def encode(self, tensor: torch.Tensor) -> Optional[tuple[Buffer, int]]:
        if tensor.dtype not in _FP8_SOURCES or tensor.dim() == 0 or not tensor.numel():
            return None
        group = fp8_group(tensor.shape[-1])
        if group < 4:  # a scale byte per 1 or 2 elements saves nothing on 16-bit values
            return None
        rows = tensor.reshape(-1, group)
        amax = rows.abs().amax(dim=1).float()
        if not bool(torch.isfinite(amax).all()):
            return None  # inf or nan in the chunk: stored exactly instead
        # 2**-e must stay a normal number of the working type: e in [-126, 126] (log2(0) = -inf: clamped)
        exponents = torch.ceil(torch.log2(amax / FP8_MAX)).clamp_(-126, 126)
        scaled = rows * torch.exp2(-exponents).to(_work_dtype(tensor.dtype)).unsqueeze(1)
        values = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
        stored = torch.cat([exponents.to(torch.int8).view(torch.uint8), values])
        return _bytes_of(stored), group.bit_length() - 1

    def stored_size_ok(self, arg: int, shape: tuple[int, ...], dtype: torch.dtype, stored: int) -> bool:
        if dtype not in _FP8_SOURCES or not shape or not 2 <= arg <= 6 or shape[-1] % (1 << arg):
            return False
        numel = math.prod(shape)
        return stored == numel + numel // (1 << arg)

    def decode_into(self, stored: Buffer, arg: int, out: torch.Tensor) -> None:
        group = 1 << arg
        data = _as_tensor(stored)
        ngroups = out.numel() // group
        if data.numel() != out.numel() + ngroups:
            raise BadPayload(f"{data.numel()} stored bytes for {out.numel()} fp8 values in groups of {group}")
        exponents = data[:ngroups].view(torch.int8).float()
        work = _work_dtype(out.dtype)
        rows = out.view(ngroups, group) if work == out.dtype else torch.empty((ngroups, group), dtype=work)
        # e4m3 -> the working type through a 256-entry table (numpy's take: ~1 GB/s per core here, against
        # 0.2 GB/s for torch's own fp8 conversion on the CPU), then the exact power-of-two scaling in place.
        np.take(_FP8_TABLES[work], data[ngroups:].numpy(), out=_int_view(rows).numpy().reshape(-1))
        rows.mul_(torch.exp2(exponents).to(work).unsqueeze(1))
        if rows.data_ptr() != out.data_ptr():
            out.view(ngroups, group).copy_(rows)


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width (numpy has no bf16: the table holds its bits)."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


_FP8_TABLES = {work: _int_view(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(work)).numpy()
               for work in (torch.bfloat16, torch.float32)}


CODERS: dict[str, PayloadCoder] = {c.name: c for c in (Naive(), Lossless(), Fp8())}
BY_CODE: dict[int, PayloadCoder] = {c.code: c for c in CODERS.values()}
CODER_NAMES: tuple[str, ...] = tuple(CODERS)


FALLBACK = {FP8: LOSSLESS, LOSSLESS: NAIVE}  # a coder that does not apply (or pay) hands over to this one


def check_coder(name: str) -> PayloadCoder:
    coder = CODERS.get(name)
    if coder is None:
        raise ValueError(f"unknown chunk coder {name!r}: one of {', '.join(CODERS)}")
    return coder


def encode_payload(tensor: torch.Tensor, coder: str = NAIVE) -> tuple[PayloadCoder, int, Buffer]:
    """(the coder that applied, its argument, the stored bytes) for `tensor` (contiguous, on the CPU) with
    `coder` or its fallbacks (`FALLBACK`); naive: a view of the tensor's bytes. Runs on a tier's writer
    thread, never on vLLM's step."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("chunk coders work on contiguous CPU tensors")
    view = _bytes_of(tensor)
    name: Optional[str] = check_coder(coder).name
    while name is not None and name != NAIVE:
        start = time.perf_counter()
        found = CODERS[name].encode(tensor)
        _RATES.observe(name, view.nbytes, time.perf_counter() - start)
        if found is not None:
            return CODERS[name], found[1], found[0]
        name = FALLBACK.get(name)
    return CODERS[NAIVE], 0, view


class _EncodeRates:
    """A moving average, per coder, of the raw bytes per second its encodes in this process reached (samples of
    at least `_SAMPLE` bytes: small chunks are summed until they make one, so call overheads count as they do)."""

    _SAMPLE = 256 << 10

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[str, float] = {}
        self._open: dict[str, tuple[int, float]] = {}  # bytes and seconds of the sample being summed

    def observe(self, name: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            total, spent = self._open.get(name, (0, 0.0))
            total, spent = total + nbytes, spent + seconds
            if total < self._SAMPLE or spent <= 0:
                self._open[name] = (total, spent)
                return
            self._open.pop(name, None)
            old = self._rates.get(name)
            self._rates[name] = total / spent if old is None else 0.7 * old + 0.3 * total / spent

    def get(self, name: str) -> Optional[float]:
        with self._lock:
            return self._rates.get(name)


_RATES = _EncodeRates()


def encode_rate(name: str) -> Optional[float]:
    """Raw bytes per second this process's encodes with coder `name` reached lately (None: none measured)."""
    return _RATES.get(name)
