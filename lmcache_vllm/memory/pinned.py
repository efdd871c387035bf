"""Host memory a GPU copies to and from asynchronously, of exactly the size asked: `pinned_arena(nbytes)`.

`torch.empty(n, pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every request
up to a power of two (a 5 GiB L1 arena pinned 8 GiB per rank; LMCache #1147 is the same bug). Here the arena
is an anonymous mmap of `nbytes` rounded up to a page, pinned with `cudaHostRegister` (portable and mapped:
the CUDA kernels reach it through its device alias), as vLLM's own offloader registers its shared region
(`vllm/v1/kv_offload/cpu/host_register.py`). Registration faults in every page from the calling thread, so
on a NUMA host the pages come from that thread's node (the worker's). If registration fails the arena stays
pageable and says so (`registered` is False): copies still work, without overlap.

The registration lasts as long as the memory: it is undone when the last tensor viewing the mmap is gone.
"""
from __future__ import annotations

import logging
import mmap
import weakref

import torch

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped


def pinned_arena(nbytes: int) -> tuple[torch.Tensor, bool]:
    """A page-aligned uint8 tensor of `nbytes` bytes (its mmap is `nbytes` rounded up to a page) and whether
    it is registered with CUDA (never on a host without a GPU)."""
    if nbytes <= 0:
        raise ValueError(f"pinned_arena: size must be positive, got {nbytes}")
    size = -(-nbytes // PAGE) * PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` for as long as a view lives
    registered = _register(tensor.data_ptr(), size)
    if registered:
        weakref.finalize(region, _unregister, tensor.data_ptr())
    return tensor[:nbytes], registered


def _register(ptr: int, size: int) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(ptr, size, _REGISTER_PORTABLE | _REGISTER_MAPPED)
    except (RuntimeError, AttributeError) as exc:  # a torch without these bindings
        logger.warning("pinned arena: cudaHostRegister unavailable (%s); the L1 arena stays pageable", exc)
        return False
    if int(error) != 0:
        cudart.cudaGetLastError()
        logger.warning("pinned arena: cudaHostRegister of %d bytes failed (%s); the L1 arena stays pageable "
                       "(check `ulimit -l` in containers)", size, error)
        return False
    logger.info("pinned arena: %d bytes registered with cudaHostRegister", size)
    return True


def _unregister(ptr: int) -> None:
    try:
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostUnregister(ptr)) != 0:
            cudart.cudaGetLastError()
    except Exception:  # interpreter shutdown: the process exit releases the pages anyway
        pass
