"""Chooses how KV layouts move data: the compiled ops (`lmcache_vllm._cpu_ops`, `lmcache_vllm._cuda_ops`,
built from `cuda_ops/`) when present, the layouts' torch code otherwise.

`compiled_for(device, op_code)` returns the extension module to call, or None for the torch path; the
choice per device type is logged once. `LMCACHE_VLLM_OPS=torch` (or `set_mode("torch")`, or the
`forced_torch()` context) makes every layout use torch. Both paths give bit-identical results.

Extension calls (all layers of a chunk in one call; slots < 0 skipped), through `transfer`:
  ext.gather(caches: list[Tensor], slots: LongTensor[T], out: Tensor[L, planes, T, width], op_code, block_size)
  ext.scatter(chunk: Tensor[L, planes, T, width], caches: list[Tensor], slots, op_code, block_size)
and every chunk of a load or a save in one call, through `transfer_chunks` (chunk i takes the next T_i slots):
  ext.gather_chunks(caches, slots: LongTensor[sum T_i], outs: list[Tensor[L, planes, T_i, width]], op_code,
                    block_size)
  ext.scatter_chunks(chunks: list[Tensor[L, planes, T_i, width]], caches, slots, op_code, block_size)
(an extension without them, the CUDA one, gets one `transfer` per chunk).
All return "" on success and an error message otherwise: no C++ exception ever crosses into Python, so a
bad input cannot crash the process even where exceptions do not unwind across the extension boundary.
op_code: 0 cpu vec, 1 cpu amx, 4 strided `[B, H, N, C]` views (see `lmcache_vllm.layouts`). An extension
built from older sources (`ABI` below `ABI_VERSION`) is ignored with a warning: rebuild it.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from types import ModuleType
from typing import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

_MODES = ("auto", "torch")
_mode = os.environ.get("LMCACHE_VLLM_OPS", "auto").strip().lower() or "auto"
if _mode not in _MODES:
    logger.warning("LMCACHE_VLLM_OPS=%r is not one of %s; using 'auto'", _mode, _MODES)
    _mode = "auto"

ABI_VERSION = 2  # the calling convention above; cuda_ops/*.cpp export it as `ABI`
_loaded: dict[str, ModuleType | None] = {}
_logged: set[str] = set()


def _load(name: str) -> ModuleType | None:
    if name not in _loaded:
        try:
            module = importlib.import_module(f"lmcache_vllm.{name}")
        except (ImportError, OSError) as exc:  # not built, or built against another torch
            logger.debug("lmcache_vllm.%s not available: %s", name, exc)
            module = None
        if module is not None and getattr(module, "ABI", 0) != ABI_VERSION:
            logger.warning("lmcache_vllm.%s was built from other sources (ABI %s, expected %s): ignored; "
                           "rebuild with `python setup.py build_ext --inplace`", name,
                           getattr(module, "ABI", 0), ABI_VERSION)
            module = None
        _loaded[name] = module
    return _loaded[name]


def cpu_ext() -> ModuleType | None:
    """The compiled CPU op module, or None when it was not built."""
    return _load("_cpu_ops")


def cuda_ext() -> ModuleType | None:
    """The compiled CUDA op module, or None when it was not built (or torch has no CUDA)."""
    return _load("_cuda_ops") if torch.cuda.is_available() else None


def mode() -> str:
    return _mode


def set_mode(new_mode: str) -> None:
    """'auto' = compiled ops where built, 'torch' = always the torch fallback."""
    global _mode
    if new_mode not in _MODES:
        raise ValueError(f"ops mode must be one of {_MODES}, got {new_mode!r}")
    _mode = new_mode


@contextlib.contextmanager
def forced_torch() -> Iterator[None]:
    """Runs the block with the torch fallback (tests and benchmarks compare the two)."""
    previous = _mode
    set_mode("torch")
    try:
        yield
    finally:
        set_mode(previous)


def compiled_for(device: torch.device, op_code: int | None) -> ModuleType | None:
    """The extension that handles `op_code` on `device`, or None for the torch path."""
    ext = None
    if _mode == "auto" and op_code is not None:
        ext = cuda_ext() if device.type == "cuda" else cpu_ext() if device.type == "cpu" else None
        if ext is not None and op_code not in getattr(ext, "SUPPORTED_LAYOUTS", ()):
            ext = None
    key = f"{device.type}:{'compiled' if ext is not None else 'torch'}:{_mode}"
    if key not in _logged:
        _logged.add(key)
        logger.info("KV transfer on %s uses %s", device.type,
                    "the compiled op" if ext is not None else f"the torch fallback (mode {_mode})")
    return ext


def transfer(ext: ModuleType, gather: bool, caches: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor,
             op_code: int, block_size: int) -> str:
    """Runs one compiled gather (caches -> chunk) or scatter (chunk -> caches); returns the op's error
    message, "" on success."""
    error: str = (ext.gather(caches, slots, chunk, op_code, block_size) if gather
                  else ext.scatter(chunk, caches, slots, op_code, block_size))
    return error


def transfer_chunks(ext: ModuleType, gather: bool, caches: Sequence[torch.Tensor], slots: torch.Tensor,
                    chunks: Sequence[torch.Tensor], op_code: int, block_size: int) -> str:
    """`transfer` of several chunks, chunk i holding the next `chunks[i].shape[2]` slots of `slots`: one call
    where the extension has the multi-chunk entry points, else one `transfer` per chunk."""
    if len(chunks) == 1:
        return transfer(ext, gather, caches, slots, chunks[0], op_code, block_size)
    if hasattr(ext, "gather_chunks"):
        error: str = (ext.gather_chunks(caches, slots, chunks, op_code, block_size) if gather
                      else ext.scatter_chunks(chunks, caches, slots, op_code, block_size))
        return error
    first = 0
    for chunk in chunks:
        count = chunk.shape[2]
        error = transfer(ext, gather, caches, slots[first:first + count], chunk, op_code, block_size)
        if error:
            return error
        first += count
    return ""


def log_cpu_tasks(ext: ModuleType) -> None:
    """Logs once how the compiled CPU op splits its calls (`_cpu_ops.tasks`) and why."""
    key = "cpu_tasks"
    if key in _logged:
        return
    _logged.add(key)
    note = ext.tasks_note() or "not chosen yet"
    logger.info("compiled CPU op: %s kernels, task shape %s (%s)", ext.isa(), ext.tasks(), note)


def describe() -> dict[str, object]:
    """What is available, for logs and `lmcache-vllm` diagnostics."""
    cpu = cpu_ext()
    tasks = f"{cpu.tasks()} ({cpu.tasks_note()})" if cpu is not None and hasattr(cpu, "tasks_note") else None
    return {"mode": _mode, "cpu_ext": cpu is not None, "cpu_tasks": tasks,
            "cuda_ext": _load("_cuda_ops") is not None, "cuda_available": torch.cuda.is_available()}
