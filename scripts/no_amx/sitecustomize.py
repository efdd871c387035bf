"""Validation aid: makes an Intel machine with AMX look like an AMD EPYC (AVX-512, no AMX tiles) to vLLM and
oneDNN, so the AMD paths run here: vLLM's CPU attention picks the `vec` K packing instead of `amx`, and
oneDNN's GEMMs use AVX-512 bf16 instead of AMX (their rounding differs, as between the two machine kinds).
Use it by putting this directory first on PYTHONPATH (child processes inherit it), e.g.

    PYTHONPATH=$PWD/scripts/no_amx:$PWD .venv/bin/python -m pytest -q tests/e2e
    PYTHONPATH=$PWD/scripts/no_amx:$PWD .venv/bin/python examples/demo.py

It is not a real AMD machine (memory bandwidth, caches and kernels other than these two stay Intel's).
"""
import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
try:
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
except Exception:  # no torch in this interpreter: nothing to patch
    pass
