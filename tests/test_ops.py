"""Compiled transfer ops (`lmcache_vllm._cpu_ops`, `lmcache_vllm._cuda_ops`) against the torch fallback and
vLLM's own CPU reshape-and-cache op, over many shapes and slot mappings; ops selection and the
`LMCACHE_VLLM_OPS=torch` switch. CUDA tests run only where a GPU and the CUDA extension exist.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from lmcache_vllm import ops
from lmcache_vllm.layouts import detect_layout

cpu_ext = ops.cpu_ext()
needs_cpu_ext = pytest.mark.skipif(cpu_ext is None, reason="lmcache_vllm._cpu_ops not built "
                                   "(python setup.py build_ext --inplace)")


def slot_mapping(kind: str, blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    bs = block_size
    if kind == "whole_blocks":
        return torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in (2, 3, 0)])
    if kind == "holes":  # whole block, partial block, -1s, scattered slots
        tail = torch.randperm(bs * 2, generator=gen)[: bs // 2] + 4 * bs
        tail[::3] = -1
        return torch.cat([torch.arange(bs, 2 * bs), torch.arange(3 * bs + 1, 3 * bs + bs // 2), tail])
    perm = torch.randperm(blocks * bs, generator=gen)[: bs + 7]
    perm[::5] = -1
    return perm


def cpu_caches(kind, layers, blocks, heads, head_size, block_size, dtype, gen):
    shape = (blocks, heads, block_size, 2 * head_size) if kind in ("vec", "amx") else \
        (2, blocks, block_size, heads, head_size) if kind == "flash" else (blocks, block_size, head_size)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]


def hint(kind: str) -> dict:
    return {"vec": {"cpu_isa": "vec"}, "amx": {"cpu_isa": "amx"}, "flash": {"backend_hint": "FLASH_ATTN"},
            "mla": {"backend_hint": "MLA"}}[kind]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_compiled_matches_torch(layout, caches, slots, via_op, gen) -> None:
    """Gathers into `via_op`, then scatters a random chunk into random caches, each once with the compiled
    op and once with the torch fallback: both directions must give the same bits."""
    dtype = via_op.dtype
    layout.gather(caches, slots, via_op)
    via_torch = torch.zeros(via_op.shape, dtype=dtype)
    with ops.forced_torch():
        layout.gather(caches, slots, via_torch)
    assert torch.equal(bits(via_op), bits(via_torch))

    chunk = torch.randn(via_op.shape, generator=gen).to(dtype)
    into_op = [torch.randn(c.shape, generator=gen).to(dtype) for c in caches]
    into_torch = [c.clone() for c in into_op]
    layout.scatter(chunk, into_op, slots)
    with ops.forced_torch():
        layout.scatter(chunk, into_torch, slots)
    for a, b in zip(into_op, into_torch):
        assert torch.equal(bits(a), bits(b))


GRID = [
    (kind, layers, heads, head_size, block_size, slots)
    for kind, layers, heads, head_size, block_size, slots in itertools.product(
        ["vec", "amx", "flash", "mla"], [1, 3], [1, 4], [64, 128], [16, 32, 128], ["whole_blocks", "holes", "random"])
    if not (layers == 3 and heads == 1) and not (kind == "mla" and heads == 4)
]


@needs_cpu_ext
@pytest.mark.parametrize("kind,layers,heads,head_size,block_size,slots_kind", GRID)
def test_cpu_op_matches_torch_fallback(kind, layers, heads, head_size, block_size, slots_kind):
    gen = torch.Generator().manual_seed(layers * 1000 + heads * 100 + head_size + block_size)
    blocks = 6
    caches = cpu_caches(kind, layers, blocks, heads, head_size, block_size, torch.bfloat16, gen)
    slots = slot_mapping(slots_kind, blocks, block_size, gen)
    layout = detect_layout(caches, **hint(kind))

    via_op = torch.zeros(layout.chunk_shape(slots.numel()), dtype=torch.bfloat16)
    assert_compiled_matches_torch(layout, caches, slots, via_op, gen)


@needs_cpu_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_op_other_dtypes(dtype):
    gen = torch.Generator().manual_seed(1)
    caches = cpu_caches("vec", 2, 6, 2, 64, 32, dtype, gen)
    slots = slot_mapping("holes", 6, 32, gen)
    layout = detect_layout(caches, cpu_isa="vec")
    a = torch.zeros(layout.chunk_shape(slots.numel()), dtype=dtype)
    b = torch.zeros_like(a)
    layout.gather(caches, slots, a)
    with ops.forced_torch():
        layout.gather(caches, slots, b)
    assert torch.equal(a, b)


def _isas() -> list[str]:
    if cpu_ext is None:
        return []
    best = cpu_ext.set_isa("auto")
    return ["scalar", "sse2", "avx512"][: ["scalar", "sse2", "avx512"].index(best) + 1]


@pytest.fixture
def restore_isa():
    yield
    cpu_ext.set_isa("auto")


def _misaligned_like(shape, dtype) -> torch.Tensor:
    """A contiguous tensor whose data starts 2 bytes past a 64-byte line (no non-temporal stores)."""
    count = 1
    for n in shape:
        count *= n
    return torch.zeros(count + 32, dtype=dtype)[1:1 + count].view(shape)


@needs_cpu_ext
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("kind,dtype,head_size,block_size,slots_kind,aligned", [
    ("vec", torch.bfloat16, 128, 128, "whole_blocks", True), ("vec", torch.bfloat16, 128, 128, "midblock", True),
    ("vec", torch.bfloat16, 64, 32, "holes", False), ("vec", torch.float32, 64, 32, "midblock", True),
    ("vec", torch.float32, 48, 16, "holes", True), ("amx", torch.bfloat16, 128, 128, "midblock", True),
    ("amx", torch.bfloat16, 128, 64, "whole_blocks", False), ("amx", torch.bfloat16, 48, 32, "holes", True),
    ("flash", torch.bfloat16, 64, 16, "holes", True), ("mla", torch.bfloat16, 64, 16, "holes", True),
])
def test_every_cpu_kernel_set_matches_torch(restore_isa, isa, kind, dtype, head_size, block_size, slots_kind,
                                            aligned):
    """Each kernel set this CPU can run (scalar and sse2 are the portable paths of machines without AVX-512),
    whole-line non-temporal stores (aligned) and cached stores (misaligned chunk), partial blocks at both ends."""
    assert cpu_ext.set_isa(isa) == isa
    gen = torch.Generator().manual_seed(head_size + block_size)
    blocks, heads = 6, 2 if kind != "mla" else 1
    caches = cpu_caches(kind, 2, blocks, heads, head_size, block_size, dtype, gen)
    if slots_kind == "midblock":  # partial, whole, partial block: edges go through the narrower kernels
        slots = torch.arange(block_size + 5, 3 * block_size + 21)
    else:
        slots = slot_mapping(slots_kind, blocks, block_size, gen)
    layout = detect_layout(caches, **hint(kind))
    shape = layout.chunk_shape(slots.numel())
    via_op = torch.zeros(shape, dtype=dtype) if aligned else _misaligned_like(shape, dtype)
    assert_compiled_matches_torch(layout, caches, slots, via_op, gen)


@needs_cpu_ext
def test_cpu_isa_env_and_switch(restore_isa):
    code = "from lmcache_vllm import ops; print(ops.cpu_ext().isa())"
    for forced in ("sse2", "scalar"):
        env = dict(os.environ, LMCACHE_VLLM_CPU_ISA=forced)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.stdout.split() == [forced], result.stderr
    with pytest.raises(RuntimeError, match="unknown isa"):
        cpu_ext.set_isa("neon")
    assert cpu_ext.set_isa("auto") == cpu_ext.isa() == _isas()[-1]


def _vllm_cpu_op():
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        return torch.ops._C.cpu_attn_reshape_and_cache
    except (ImportError, AttributeError, RuntimeError):
        return None


@needs_cpu_ext
@pytest.mark.parametrize("isa,heads,head_size,block_size", [
    (isa, heads, head_size, block_size)
    for isa, heads, head_size, block_size in itertools.product(["vec", "amx"], [1, 4], [64, 128], [16, 32, 128])
    if not (isa == "amx" and block_size == 16)  # vLLM's amx kernel needs block_size % 32 == 0
])
def test_cpu_op_matches_vllm_reshape_and_cache(isa, heads, head_size, block_size):
    vllm_op = _vllm_cpu_op()
    if vllm_op is None:
        pytest.skip("vLLM's CPU reshape_and_cache op is not available")
    gen = torch.Generator().manual_seed(heads + head_size + block_size)
    blocks, layers = 6, 2
    slots = slot_mapping("holes", blocks, block_size, gen)
    valid = slots >= 0
    chunk = torch.randn(layers, 2, slots.numel(), heads * head_size, generator=gen).to(torch.bfloat16)
    reference = []
    for layer in range(layers):
        cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16)
        key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
        keys = chunk[layer, 0, valid].view(-1, heads, head_size)
        values = chunk[layer, 1, valid].view(-1, heads, head_size)
        vllm_op(keys, values, key_cache, value_cache, slots[valid], "vec16" if block_size % 32 else isa,
                1.0, 1.0, "auto")
        reference.append(cache)

    layout = detect_layout(reference, cpu_isa=isa)
    ours = [torch.zeros_like(c) for c in reference]
    layout.scatter(chunk, ours, slots)
    for a, b in zip(ours, reference):
        assert torch.equal(bits(a), bits(b))
    back = torch.zeros_like(chunk)
    layout.gather(reference, slots, back)
    assert torch.equal(bits(back[:, :, valid]), bits(chunk[:, :, valid]))


@needs_cpu_ext
def test_cpu_op_rejects_bad_input_with_clear_errors():
    caches = [torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)]
    out = torch.empty(1, 2, 3, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="beyond"):
        cpu_ext.gather(caches, torch.tensor([0, 1, 4 * 16]), out, 0, 16)
    with pytest.raises(RuntimeError, match="unknown layout"):
        cpu_ext.gather(caches, torch.tensor([0, 1, 2]), out, 9, 16)
    with pytest.raises(RuntimeError, match="does not match"):
        cpu_ext.gather(caches, torch.tensor([0, 1]), out, 0, 16)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ext.gather([caches[0].float()], torch.tensor([0, 1, 2]), out, 0, 16)


def test_ops_env_forces_torch_fallback():
    code = ("import torch; from lmcache_vllm import ops; "
            "print(ops.mode(), ops.compiled_for(torch.device('cpu'), 0) is None)")
    env = dict(os.environ, LMCACHE_VLLM_OPS="torch")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["torch", "True"], result.stderr
    assert ops.compiled_for(torch.device("cpu"), None) is None  # a layout without an op code
    with ops.forced_torch():
        assert ops.compiled_for(torch.device("cpu"), 0) is None
    if cpu_ext is not None:
        assert ops.compiled_for(torch.device("cpu"), 0) is cpu_ext


# ---- CUDA ----------------------------------------------------------------------------------------------

cuda_ext = ops.cuda_ext()
needs_cuda_ext = pytest.mark.skipif(cuda_ext is None, reason="no GPU or lmcache_vllm._cuda_ops not built")


@needs_cuda_ext
@pytest.mark.parametrize("kind", ["flash", "mla"])
@pytest.mark.parametrize("target", ["device", "pinned_staged", "pinned_mapped", "pageable"])
@pytest.mark.parametrize("head_size", [64, 128, 3])  # 3: rows not 16-byte aligned
def test_cuda_kernels_match_torch(kind, target, head_size):
    gen = torch.Generator().manual_seed(head_size)
    caches = [c.cuda() for c in cpu_caches(kind, 3, 8, 4, head_size, 16, torch.bfloat16, gen)]
    slots = slot_mapping("holes", 8, 16, gen).cuda()
    layout = detect_layout(caches, **hint(kind))
    shape = layout.chunk_shape(slots.numel())
    with ops.forced_torch():
        expected = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        layout.gather(caches, slots, expected)
    if target == "device":
        out = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    else:
        out = torch.zeros(shape, dtype=torch.bfloat16, pin_memory=target != "pageable")
    host_path = "mapped" if target == "pinned_mapped" else "staged"
    cuda_ext.gather(caches, slots, out, layout.op_code, 16, host_path)
    torch.cuda.synchronize()
    assert torch.equal(bits(out.cuda()), bits(expected))

    fresh = [torch.zeros_like(c) for c in caches]
    reference = [torch.zeros_like(c) for c in caches]
    cuda_ext.scatter(out, fresh, slots, layout.op_code, 16, host_path)
    with ops.forced_torch():
        layout.scatter(expected, reference, slots)
    torch.cuda.synchronize()
    for a, b in zip(fresh, reference):
        assert torch.equal(bits(a), bits(b))
    # Layerwise: one layer at a time gives the same rows.
    one = torch.zeros(shape[1:], dtype=torch.bfloat16, device="cuda")
    layout.gather_layer(1, caches[1], slots, one)
    assert torch.equal(bits(one), bits(expected[1]))
