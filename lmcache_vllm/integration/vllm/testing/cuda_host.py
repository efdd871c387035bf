"""The CUDA kernel source (`cuda_ops/paged_copy.cu`) compiled for the host and called like `_cuda_ops`.

`host_kernel(variant)` compiles the unchanged kernel source with g++ and `cuda_ops/host_emulation.h` (CUDA's
vector types from the toolkit headers, the grid walked by a host loop) into a shared library under
`build/cuda_host/` (kept out of git; reused while the sources and flags are the same) and returns a
`HostKernel`: `gather(caches, slots, out, layout, block_size)` / `scatter(chunk, caches, slots, layout,
block_size)` on CPU tensors, returning "" or an error message, exactly as the extension is called through
`lmcache_vllm.ops.transfer`. So the index arithmetic, the 16-byte units with their unrolled loop, the tails
and the narrower units for unaligned addresses run in CI exactly as written, under UBSan (`SANITIZE`).

Variants (`VARIANTS`): "as_built" (what nvcc builds), "small_grid" (the grid capped at 2 blocks per row, so
every thread strides over many rounds of the loop) and "wrong" (each token's slot xor 1: a deliberately
wrong kernel, for the tests that show the self-check refuses it).

The arguments are filled the way `cuda_ops/cuda_binding.cpp` fills them (`make_args`): per-layer base
addresses (an array for several layers, `single_layer` for one), byte strides of the `[B, H, N, C]` view,
the chunk's address, through `lmc_mapped_device_pointer` when `mapped` (the pinned-memory path: on the host
every pointer is its own alias).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from lmcache_vllm import ops
from lmcache_vllm.integration.vllm.testing.vllm_jobs import REPO_ROOT
from lmcache_vllm.layouts.strided import OP_STRIDED

CUDA_OPS = os.path.join(REPO_ROOT, "cuda_ops")
SOURCES = ("paged_copy.cu", "paged_copy.h", "host_emulation.h")
VARIANTS: dict[str, tuple[str, ...]] = {
    "as_built": (),
    "small_grid": ("-DLMC_MAX_BLOCKS_X=2u",),
    "wrong": ("-DLMC_KERNEL_SLOT(slot)=((slot) ^ 1)",),
}


# Undefined behaviour the GPU would not forgive stops the process at once: a 16-byte unit at an address that
# is not 16-byte aligned (the GPU faults on it; x86 would just load it), signed overflow of the index math,
# a null or overflowing pointer, an index past a local array.
SANITIZE = ("-fsanitize=alignment,null,signed-integer-overflow,shift,bounds,pointer-overflow",
            "-fno-sanitize-recover=all")


class HostKernelUnavailable(RuntimeError):
    """No kernel source, C++ compiler or CUDA toolkit headers here."""


def cuda_include_dir() -> str | None:
    """The CUDA toolkit's include directory (next to nvcc, as scripts/check_cuda.sh finds it)."""
    candidates = []
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "include"))
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "vector_types.h"))), None)


def _build_dir() -> str:
    preferred = os.path.join(REPO_ROOT, "build", "cuda_host")
    try:
        os.makedirs(preferred, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    fallback = os.path.join(tempfile.gettempdir(), "lmcache_vllm_cuda_host")
    os.makedirs(fallback, exist_ok=True)
    return fallback


def build(variant: str = "as_built") -> str:
    """Compiles the kernel source for the host (once per source contents and flags); the library's path."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if not all(os.path.isfile(os.path.join(CUDA_OPS, name)) for name in SOURCES):
        raise FileNotFoundError(f"no kernel sources in {CUDA_OPS}")  # a broken checkout, never a skip
    compiler = os.environ.get("CXX") or shutil.which("g++")
    include = cuda_include_dir()
    if compiler is None or include is None:
        raise HostKernelUnavailable(f"needs g++ ({compiler}) and the CUDA toolkit headers ({include})")
    # -Bsymbolic: the kernel's calls of the emulated CUDA runtime (cudaHostGetDevicePointer, ...) bind to this
    # library's own definitions. Without it, in a process whose torch has CUDA (libcudart loaded globally),
    # they went to the real runtime, which gives a host chunk no alias (seen on the H200 host, 2026-11-30).
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-Wl,-Bsymbolic", "-Wall", "-Werror", "-Wno-unknown-pragmas",
             *SANITIZE,
             f"-I{include}", f"-I{CUDA_OPS}", "-include", os.path.join(CUDA_OPS, "host_emulation.h"),
             *VARIANTS[variant]]
    digest = hashlib.sha1(" ".join([compiler, *flags]).encode())
    for name in SOURCES:
        with open(os.path.join(CUDA_OPS, name), "rb") as f:
            digest.update(f.read())
    target = os.path.join(_build_dir(), f"paged_copy_host-{variant}-{digest.hexdigest()[:12]}.so")
    if not os.path.exists(target):
        partial = f"{target}.{os.getpid()}.tmp"
        result = subprocess.run([compiler, *flags, "-x", "c++", os.path.join(CUDA_OPS, "paged_copy.cu"),
                                 "-o", partial], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"g++ could not compile paged_copy.cu for the host:\n{result.stderr[-4000:]}")
        os.replace(partial, target)  # atomic: parallel builds of the same variant never see half a file
        for stale in glob.glob(os.path.join(os.path.dirname(target), f"paged_copy_host-{variant}-*.so")):
            if stale != target:  # builds of older sources
                with contextlib.suppress(OSError):
                    os.remove(stale)
    return target


class _PagedArgs(ctypes.Structure):
    """`lmc_paged_args` of cuda_ops/paged_copy.h, field for field."""

    _fields_ = [("layer_ptrs", ctypes.c_void_p), ("single_layer", ctypes.c_uint64),
                ("num_layers", ctypes.c_int64), ("planes", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("num_slots", ctypes.c_int64), ("stride_block", ctypes.c_int64),
                ("stride_head", ctypes.c_int64), ("stride_token", ctypes.c_int64), ("piece_bytes", ctypes.c_int64),
                ("slots", ctypes.c_void_p), ("num_tokens", ctypes.c_int64), ("chunk", ctypes.c_void_p),
                ("bases_or", ctypes.c_uint64), ("bad_slot", ctypes.c_void_p)]


@dataclass
class HostKernel:
    """The kernel built for the host, with `_cuda_ops`' calling convention (see the module docstring)."""

    library: ctypes.CDLL
    variant: str
    mapped: bool = True  # reach the chunk through lmc_mapped_device_pointer (the pinned-memory path)

    SUPPORTED_LAYOUTS = (OP_STRIDED,)
    ABI = ops.ABI_VERSION

    def __post_init__(self):
        lib = self.library
        for name in ("lmc_paged_gather", "lmc_paged_scatter"):
            getattr(lib, name).argtypes = [ctypes.POINTER(_PagedArgs), ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        lib.lmc_paged_unit_bytes.argtypes = [ctypes.POINTER(_PagedArgs)]
        lib.lmc_paged_unit_bytes.restype = ctypes.c_int
        lib.lmc_mapped_device_pointer.argtypes = [ctypes.c_void_p]
        lib.lmc_mapped_device_pointer.restype = ctypes.c_void_p
        lib.lmc_last_error.restype = ctypes.c_char_p

    def with_chunk_path(self, mapped: bool) -> "HostKernel":
        return HostKernel(self.library, self.variant, mapped)

    def gather(self, caches, slots: torch.Tensor, out: torch.Tensor, layout: int, block_size: int) -> str:
        return self._call(self.library.lmc_paged_gather, caches, slots, out, layout, block_size)

    def scatter(self, chunk: torch.Tensor, caches, slots: torch.Tensor, layout: int, block_size: int) -> str:
        return self._call(self.library.lmc_paged_scatter, caches, slots, chunk, layout, block_size)

    def unit_bytes(self, caches, slots: torch.Tensor, chunk: torch.Tensor, block_size: int) -> int:
        """The width of the units the kernel moves for these arguments (16 when every address allows)."""
        args, _, error = self._args(list(caches), slots, chunk, OP_STRIDED, block_size)
        if error:
            raise ValueError(error)
        return int(self.library.lmc_paged_unit_bytes(ctypes.byref(args)))

    def _call(self, fn, caches, slots, chunk, layout, block_size) -> str:
        args, keep_alive, error = self._args(list(caches), slots, chunk, layout, block_size)
        if error:
            return error
        bad = ctypes.c_int64(-1)  # where the kernel reports a slot beyond the cache (read at once: a host launch)
        args.bad_slot = ctypes.addressof(bad)
        rc = fn(ctypes.byref(args), None)
        del keep_alive  # the layer pointer array, read by the (synchronous) emulated launch
        if rc != 0:
            return f"_cuda_ops (host emulation): {self.library.lmc_last_error().decode()}"
        if bad.value >= 0:
            return f"_cuda_ops (host emulation): slot {bad.value} beyond the cache's {args.num_slots} slots"
        return ""

    def _args(self, caches: list[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, layout: int,
              block_size: int) -> tuple[_PagedArgs, torch.Tensor | None, str]:
        args = _PagedArgs()
        if layout != OP_STRIDED:
            return args, None, f"_cuda_ops (host emulation): layout code {layout} is not the strided views (4)"
        c0 = caches[0] if caches else None
        if c0 is None or c0.dim() != 4 or c0.shape[2] != block_size or (c0.shape[3] > 1 and c0.stride(3) != 1):
            return args, None, "_cuda_ops (host emulation): caches must be [blocks, heads, block_size, C] views"
        if any(c.shape != c0.shape or c.stride() != c0.stride() or c.dtype != c0.dtype for c in caches):
            return args, None, "_cuda_ops (host emulation): every cache must have cache 0's sizes, strides, dtype"
        planes = chunk.shape[1]
        if (slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous() or chunk.dim() != 4
                or not chunk.is_contiguous() or chunk.dtype != c0.dtype or chunk.shape[0] != len(caches)
                or chunk.shape[2] != slots.numel() or planes not in (1, 2) or c0.shape[3] % planes
                or chunk.shape[3] != c0.shape[1] * (c0.shape[3] // planes)):
            return args, None, "_cuda_ops (host emulation): slots or chunk do not fit the caches"
        item = c0.element_size()
        pointers = None
        args.num_layers = len(caches)
        if len(caches) == 1:
            args.single_layer = c0.data_ptr()
        else:
            pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
            args.layer_ptrs = pointers.data_ptr()
        args.bases_or = functools.reduce(lambda acc, c: acc | c.data_ptr(), caches, 0)
        args.planes, args.heads, args.block_size = planes, c0.shape[1], block_size
        args.num_slots = c0.shape[0] * block_size
        args.stride_block, args.stride_head, args.stride_token = (s * item for s in c0.stride()[:3])
        args.piece_bytes = (c0.shape[3] // planes) * item
        args.slots, args.num_tokens = slots.data_ptr(), slots.numel()
        args.chunk = self.library.lmc_mapped_device_pointer(chunk.data_ptr()) if self.mapped else chunk.data_ptr()
        return args, pointers, ""


@functools.lru_cache(maxsize=None)
def host_kernel(variant: str = "as_built") -> HostKernel:
    """The kernel source built for the host (see `build`); raises `HostKernelUnavailable` where it cannot be."""
    return HostKernel(ctypes.CDLL(build(variant)), variant)
