"""Packaging for lmcache-vllm.

The compiled transfer ops (`cuda_ops/`) are optional: a CPU C++ op is built with the host compiler, a
CUDA op only when torch has CUDA and nvcc is present, and `LMCACHE_VLLM_NO_EXT=1` skips both. A build
that fails or finds no compiler still installs the package; `lmcache_vllm.ops` then uses the torch
fallbacks.
"""
import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_ops"))


def _read_requirements(name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements", name)
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def _extensions():
    """Returns (ext_modules, cmdclass) for cuda_ops, or ([], {}) when they are not to be built."""
    if os.environ.get("LMCACHE_VLLM_NO_EXT") == "1":
        return [], {}
    try:
        from build_ext import extension_modules  # cuda_ops/build_ext.py
    except ImportError:
        return [], {}
    return extension_modules()


ext_modules, cmdclass = _extensions()

setup(
    name="lmcache-vllm",
    version="0.1.0",
    description="KV-cache layer for vLLM: tiered host-memory/disk/Redis storage behind a KVConnectorBase_V1",
    packages=find_packages(include=["lmcache_vllm", "lmcache_vllm.*"]),
    python_requires=">=3.11",
    install_requires=_read_requirements("base.txt"),
    extras_require={"test": _read_requirements("test.txt")},
    entry_points={"console_scripts": ["lmcache-vllm=lmcache_vllm.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
