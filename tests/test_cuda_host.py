"""The CUDA kernel source on the host (`testing.cuda_host`) and the device self-check (`layouts.kernel_check`).

- The kernel source, compiled for the host by g++, gives the torch path's bytes on a sample of the cases
  `make check-cuda` runs in full (every vLLM CUDA layout, MLA, fp8, narrow units, the grid-stride loop, a
  chunk inside an arena); the check's one line reports P/T and its exit status is 1 when a case differs.
- The self-check that guards the kernel on a GPU runs here against the host build: a kernel that matches is
  used; a deliberately wrong build (each token's slot xor 1) is refused with one error naming the layout
  and a counted fallback, and the layout's copies still give the right bytes (torch path); `on` makes a
  mismatch an error, `off` never uses the kernel; the check never touches the live cache; its scratch copy
  has the live cache's strides, dtype, layer placement and address alignment.
- The host build runs under UBSan: a 16-byte unit at a misaligned address (a GPU fault) ends the run.
Skipped where no C++ compiler or CUDA toolkit headers are installed (CI has both: `make check-cuda` needs nvcc).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import pytest
import torch
from ci import IN_CI

from lmcache_vllm import ops
from lmcache_vllm.config import load_config
from lmcache_vllm.integration.vllm.testing.cuda_cases import build_views, kernel_cases, run_case
from lmcache_vllm.integration.vllm.testing.cuda_host import HostKernelUnavailable, host_kernel
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, fill_known, kv_views
from lmcache_vllm.layouts import LayoutError, detect_layout
from lmcache_vllm.layouts.kernel_check import backing, scratch_views
from lmcache_vllm.observability import metrics

try:
    host_kernel("as_built")
    UNAVAILABLE = ""
except HostKernelUnavailable as exc:
    if IN_CI:  # CI has g++ and nvcc (make check-cuda needs them): never skip there
        raise
    UNAVAILABLE = str(exc)
pytestmark = pytest.mark.skipif(bool(UNAVAILABLE), reason=f"kernel source not buildable for the host: {UNAVAILABLE}")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sample() -> list:
    """One case for each thing the full list covers, and every slot pattern."""
    seen: set[str] = set()
    sample = []
    for case in kernel_cases():
        key = "slots=" + case.slots if "slots" in case.what else ",".join(case.what) + case.chunk
        if key not in seen:
            seen.add(key)
            sample.append(case)
    return sample


@pytest.mark.parametrize("case", _sample(), ids=str)
def test_host_build_of_the_kernel_matches_the_torch_path(case):
    assert run_case(case, host_kernel(case.variant)) is None


def _check_script():
    spec = importlib.util.spec_from_file_location("check_cuda_kernels", os.path.join(ROOT, "scripts",
                                                                                  "check_cuda_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("build,expect_rc", [("as_built", 0), ("wrong", 1)])
def test_check_prints_its_line_and_fails_when_a_case_differs(capsys, build, expect_rc):
    rc = _check_script().main(["--build", build, "--cases", "LBNHC-kv-bfloat16-b16 FLASH_ATTN slots=mixed",
                               "slots=all_holes"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # Two LBNHC cases (mixed slots, plain and arena chunks) and both all-holes cases, which no kernel can get
    # wrong: the wrong build passes exactly those.
    total = sum(1 for c in kernel_cases() if "LBNHC-kv-bfloat16-b16 FLASH_ATTN slots=mixed" in str(c)
                or "slots=all_holes" in str(c))
    passed = total if build == "as_built" else 2
    assert last == f"cuda kernels on host: {passed}/{total} cases match the torch path"
    assert rc == expect_rc


# ---- the self-check -------------------------------------------------------------------------------------

VIEWS = [KVViewCase(layout=name, num_layers=3, num_blocks=16, block_size=16, num_kv_heads=2, head_size=64)
         for name in ("LBNHC", "LBHNC", "BLNHC", "BLHNC")] + [
    KVViewCase(layout="LBNHC", num_layers=2, num_blocks=16, block_size=16, mla=True, head_size=576,
               dtype=torch.uint8)]


def _live(view: KVViewCase):
    caches = fill_known(build_views(view, "cpu"), view, seed=3)
    return caches, detect_layout(caches, **view.describe())


def _slots(block_size: int) -> torch.Tensor:
    return torch.cat([torch.arange(2 * block_size, 3 * block_size), torch.tensor([-1, 5, 7]),
                      torch.arange(5 * block_size + 3, 6 * block_size)])


def _fallbacks(reason: str) -> float:
    return metrics.value("cuda_kernel_fallbacks", reason=reason)


@pytest.mark.parametrize("view", VIEWS, ids=str)
def test_a_kernel_that_matches_is_used(view):
    caches, layout = _live(view)
    kernel = host_kernel("as_built")
    verdict = layout.bind_kernel(caches, "auto", kernel)
    assert verdict.use_kernel and verdict.layout == repr(layout)
    assert layout._kernel_for(caches) is kernel
    with ops.forced_torch():
        assert layout._kernel_for(caches) is None  # LMCACHE_VLLM_OPS=torch still wins


@pytest.mark.parametrize("view", VIEWS, ids=str)
def test_a_wrong_kernel_is_refused_with_one_error_and_the_output_stays_right(view, caplog):
    caches, layout = _live(view)
    wrong = host_kernel("wrong")
    slots = _slots(view.block_size)
    shape = layout.chunk_shape(len(slots))
    expected = torch.zeros(shape, dtype=view.dtype)
    layout.torch_transfer(True, caches, slots, expected)
    by_wrong = torch.zeros(shape, dtype=view.dtype)
    layout.kernel_transfer(wrong, True, caches, slots, by_wrong)
    assert not torch.equal(by_wrong.view(torch.uint8), expected.view(torch.uint8))  # it is really wrong

    before = _fallbacks("mismatch")
    with caplog.at_level(logging.INFO, logger="lmcache_vllm.layouts.kernel_check"):
        verdict = layout.bind_kernel(caches, "auto", wrong)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and view.layout in errors[0].getMessage() and "self-check failed" in errors[0].getMessage()
    assert not verdict.use_kernel and "differ" in verdict.reason
    assert _fallbacks("mismatch") == before + 1
    assert layout._kernel_for(caches) is None

    out = torch.zeros(shape, dtype=view.dtype)
    layout.gather(caches, slots, out)  # the layout's own call: the torch path now
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    restored = fill_known(build_views(view, "cpu"), view, seed=4)
    layout.scatter(out, restored, slots)
    back = torch.zeros(shape, dtype=view.dtype)
    layout.gather(restored, slots, back)
    assert torch.equal(back.view(torch.uint8), expected.view(torch.uint8))


def test_policy_on_makes_a_mismatch_an_error_and_off_never_checks(caplog):
    caches, layout = _live(VIEWS[0])
    with pytest.raises(LayoutError, match="cuda_kernel is on.*self-check.*LBNHC"):
        layout.bind_kernel(caches, "on", host_kernel("wrong"))
    assert layout.bind_kernel(caches, "on", host_kernel("as_built")).use_kernel
    before = _fallbacks("mismatch")
    verdict = layout.bind_kernel(caches, "off", host_kernel("wrong"))
    assert not verdict.use_kernel and "off" in verdict.reason and _fallbacks("mismatch") == before
    assert layout._kernel_for(caches) is None
    with pytest.raises(ValueError, match="auto"):
        layout.bind_kernel(caches, "sometimes", host_kernel("as_built"))


def test_without_a_kernel_caches_off_a_gpu_keep_the_usual_choice():
    caches, layout = _live(VIEWS[0])
    verdict = layout.bind_kernel(caches, "on")  # no CUDA device: nothing to check, nothing refused
    assert not verdict.bound and layout._kernel_for(caches) is ops.compiled_for(torch.device("cpu"), layout.op_code)


def test_the_check_never_touches_the_live_cache():
    caches, layout = _live(VIEWS[2])
    before = backing(caches[0]).clone()
    layout.bind_kernel(caches, "auto", host_kernel("wrong"))
    layout.bind_kernel(caches, "auto", host_kernel("as_built"))
    assert torch.equal(backing(caches[0]), before)


@pytest.mark.parametrize("view", VIEWS + [VIEWS[0].with_(block_size=32, kernel_block_size=16)], ids=str)
def test_scratch_has_the_live_layout_strides_dtype_and_alignment(view):
    live = kv_views(view)
    # Offset the live layers by 2 elements from a 256-byte line, as a sub-allocation could be.
    raw = torch.zeros(backing(live[0]).numel() + 1024, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % 256 + 2 * live[0].element_size()
    base = raw[shift:].view(live[0].dtype)
    live = [torch.as_strided(base, v.shape, v.stride(), base.storage_offset() + v.storage_offset()) for v in live]
    scratch = scratch_views(live, 6, torch.Generator().manual_seed(0))
    assert len(scratch) == len(live)
    for s, v in zip(scratch, live):
        assert s.dtype == v.dtype and s.stride() == v.stride()
        assert s.shape == (min(6, v.shape[0]), *v.shape[1:])
        assert s.data_ptr() % 256 == v.data_ptr() % 256
    gaps = lambda views: [x.data_ptr() - views[0].data_ptr() for x in views]  # noqa: E731
    if view.layout.startswith("B"):  # layers interleaved inside each block: the same placement
        assert gaps(scratch) == gaps(live)
    else:
        assert all(b - a >= s.shape[0] * s.stride(0) for a, b, s in zip(gaps(scratch), gaps(scratch)[1:], scratch))


def test_config_key_cuda_kernel():
    assert load_config({}, environ={}).extra_config.cuda_kernel == "auto"
    for value, want in (("OFF", "off"), (True, "on"), (False, "off"), ("on", "on")):  # YAML reads on/off as bools
        assert load_config({"extra_config": {"cuda_kernel": value}}, environ={}).extra_config.cuda_kernel == want
    with pytest.raises(Exception, match="cuda_kernel"):
        load_config({"extra_config": {"cuda_kernel": "maybe"}}, environ={})


MISALIGNED = r"""
import ctypes, torch
from lmcache_vllm.integration.vllm.testing.cuda_host import host_kernel
kernel = host_kernel("as_built").with_chunk_path(False)
raw = torch.zeros(4 * 16 * 2 * 128 * 2 + 64, dtype=torch.uint8)
shift = (-raw.data_ptr()) % 64 + 2  # a layer base 2 bytes past a 64-byte line: 2-byte units only
cache = raw[shift:shift + 4 * 16 * 2 * 128 * 2].view(torch.bfloat16).view(4, 16, 2, 128).permute(0, 2, 1, 3)
caches = [cache, cache]
slots, chunk = torch.arange(4), torch.zeros(2, 2, 4, 128, dtype=torch.bfloat16)
args, keep, error = kernel._args(caches, slots, chunk, 4, 16)
assert not error and kernel.library.lmc_paged_unit_bytes(ctypes.byref(args)) == 2
args.bases_or = 0  # a binding that forgot the layer bases would make the kernel pick 16-byte units
print("unit", kernel.library.lmc_paged_unit_bytes(ctypes.byref(args)), flush=True)
kernel.library.lmc_paged_gather(ctypes.byref(args), None)
print("not stopped")
"""


def test_a_misaligned_16_byte_unit_stops_the_host_build():
    """A GPU faults on a 16-byte access at an address that is not 16-byte aligned; x86 would just do it. The
    host build runs under UBSan so such an access ends the run (here: arguments lying about the bases)."""
    result = subprocess.run([sys.executable, "-c", MISALIGNED], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert result.stdout.split() == ["unit", "16"], (result.stdout, result.stderr[-2000:])
    assert result.returncode != 0 and "misaligned address" in result.stderr, result.stderr[-2000:]


def test_a_slot_beyond_the_cache_is_reported_by_the_kernel_as_by_the_cpu_op():
    """The CPU op refuses a slot beyond the cache; the kernel used to skip it silently. Now it stores it where its
    caller reads it (here at once: a host launch; the torch binding at its next call), and both report it
    (issue 30 #11). A slot < 0 (no slot) stays skipped by both, without a report."""
    from lmcache_vllm.layouts.strided import OP_STRIDED

    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # 4 blocks of 16: 64 slots
    caches = [cache, cache]
    kernel = host_kernel("as_built").with_chunk_path(False)
    cpu = ops.cpu_ext()
    for slots, bad in ((torch.tensor([0, 1, 64]), 64), (torch.tensor([3, 9999, -1]), 9999)):
        chunk = torch.zeros(2, 2, len(slots), 128, dtype=torch.bfloat16)
        for gather in (True, False):
            by_kernel = ops.transfer(kernel, gather, caches, slots, chunk, OP_STRIDED, 16)
            assert f"slot {bad} beyond the cache's 64 slots" in by_kernel, by_kernel
            if cpu is not None:
                assert f"slot {bad} beyond the cache's 64 slots" in ops.transfer(cpu, gather, caches, slots, chunk,
                                                                                 OP_STRIDED, 16)
    chunk = torch.zeros(2, 2, 3, 128, dtype=torch.bfloat16)
    assert ops.transfer(kernel, True, caches, torch.tensor([0, -1, 63]), chunk, OP_STRIDED, 16) == ""
