"""Extension modules for setup.py: `extension_modules() -> (ext_modules, cmdclass)`.

- `lmcache_vllm._cpu_ops` from cpu_ops.cpp (g++, -O3, OpenMP through ATen's parallel_for), always tried.
- `lmcache_vllm._cuda_ops` from paged_copy.cu + cuda_binding.cpp, only when torch has CUDA and nvcc exists.

Builds are best-effort: a missing torch or compiler gives no extensions, and a failing compile is reported
as a warning while the package still installs (lmcache_vllm.ops then uses the torch fallbacks).
No -march=native: the wheel may move to another x86-64 host.
"""
from __future__ import annotations

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CUDA_ARCHS = os.environ.get("LMCACHE_VLLM_CUDA_ARCHS", "80;90")


def _rel(name: str) -> str:
    # setuptools wants source paths relative to the directory setup.py runs in.
    return os.path.relpath(os.path.join(HERE, name), ROOT)


def _nvcc_available() -> bool:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))


def _warn(message: str) -> None:
    print(f"[lmcache_vllm] WARNING: {message}; lmcache_vllm.ops will use the torch fallback", file=sys.stderr)


def extension_modules():
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:  # torch not installed yet: pure-Python install
        print(f"[lmcache_vllm] not building compiled ops: {exc}", file=sys.stderr)
        return [], {}

    cxx_flags = ["-O3", "-fopenmp", "-fno-strict-aliasing"]
    # depends: an edited kernel header rebuilds the op (setuptools compares only these files' times).
    modules = [CppExtension("lmcache_vllm._cpu_ops", [_rel("cpu_ops.cpp")],
                            depends=[_rel(h) for h in ("cpu_ops_avx2.h", "cpu_ops_avx512.h", "op_errors.h")],
                            extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])]
    if torch.version.cuda and _nvcc_available() and os.environ.get("LMCACHE_VLLM_NO_CUDA_EXT") != "1":
        gencode = []
        for arch in CUDA_ARCHS.split(";"):
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        modules.append(CUDAExtension("lmcache_vllm._cuda_ops", [_rel("paged_copy.cu"), _rel("cuda_binding.cpp")],
                                     extra_compile_args={"cxx": ["-O3"],
                                                         "nvcc": ["-O3"] + gencode}))

    class OptionalBuildExtension(BuildExtension):
        """Builds each extension on its own; a failure is a warning, not a failed install."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # e.g. torch's compiler/ABI check found no usable compiler
                _warn(f"compiled ops not built ({exc})")
            # Later steps (in-place copy, wheel contents) must only see what was really built.
            self.extensions = [e for e in self.extensions if os.path.exists(self.get_ext_fullpath(e.name))]

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # compiler missing or failing: keep installing, use torch fallbacks
                _warn(f"could not build {ext.name} ({exc})")

    return modules, {"build_ext": OptionalBuildExtension.with_options(use_ninja=False)}
