"""Layout adapters on the KV views vLLM 0.32/0.33 really registers (built by vLLM's own `allocate_kv_cache`
where vLLM is importable, by the checked copy otherwise) for every `KVCacheLayout`, FLASH_ATTN-like and MLA
specs, bf16 and fp8 (uint8), kernel block splitting; and vLLM's CPU attention packings (`vec`, `vec16`, `amx`).

For every case, on the torch path and the compiled op: the K and V we read are what the view says (known
values written through `view[b, h, n, :D]` and `[..., D:]`), a gather/scatter round trip is bit-exact and
touches no other byte of the backing allocation, a chunk stored from one layout loads bit-exact into every
other, layerwise equals all layers; `detect_layout` picks a CPU packing only for vLLM's CPU attention.
"""
from __future__ import annotations

import pytest
import torch

from lmcache_vllm import ops
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, all_cases, kv_views, vllm_kv_views
from lmcache_vllm.layouts import (
    CpuAmxLayout,
    CpuVecLayout,
    KVGeometry,
    LayoutError,
    StridedKVLayout,
    UnsupportedLayoutError,
    detect_layout,
    plan_slots,
)

MODES = ["torch"] + (["compiled"] if ops.cpu_ext() is not None else [])
try:
    import vllm  # noqa: F401
    build_views = vllm_kv_views  # the real thing
except ImportError:
    build_views = kv_views  # the copy, checked against vLLM in test_kv_views.py
CASES = all_cases()


@pytest.fixture(params=MODES)
def ops_mode(request):
    previous = ops.mode()
    ops.set_mode("torch" if request.param == "torch" else "auto")
    yield request.param
    ops.set_mode(previous)


def backing_bytes(view: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation the views share (as uint8)."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def random_bits(shape, dtype, gen) -> torch.Tensor:
    bits = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen, dtype=torch.uint8)
    values = bits.view(dtype)
    return torch.nan_to_num(values, nan=0.5, posinf=1.0, neginf=-1.0) if dtype.is_floating_point else values


def view_slots(case: KVViewCase) -> torch.Tensor:
    """Whole blocks in order and out of order, a mid-block stretch, scattered slots and -1 (no slot)."""
    n = case.kernel_block_size or case.block_size
    total = case.num_blocks * case.block_size
    gen = torch.Generator().manual_seed(11)
    used = torch.cat([torch.arange(3 * n, 5 * n), torch.arange(8 * n, 9 * n), torch.arange(n + 3, 2 * n - 2)])
    rest = torch.tensor([s for s in torch.randperm(total, generator=gen).tolist() if s not in set(used.tolist())][:9])
    return torch.cat([used, torch.tensor([-1]), rest, torch.tensor([-1, -1])])


def write_known(views: list[torch.Tensor], case: KVViewCase, slots: torch.Tensor, seed: int) -> torch.Tensor:
    """Writes random values through `views[l][b, h, n, :D]` (K) and `[..., D:]` (V) for every valid slot and
    returns the chunk that holds them, built element by element from the view's own indexing."""
    n, d = case.kernel_block_size or case.block_size, case.head_size
    planes = 1 if case.mla else 2
    gen = torch.Generator().manual_seed(seed)
    chunk = torch.zeros(case.num_layers, planes, slots.numel(), case.heads * d, dtype=case.dtype)
    for layer, view in enumerate(views):
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            b, o = divmod(slot, n)
            for h in range(case.heads):
                for p in range(planes):
                    values = random_bits((d,), case.dtype, gen)
                    view[b, h, o, p * d:(p + 1) * d] = values
                    chunk[layer, p, t, h * d:(h + 1) * d] = values
    return chunk


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---- vLLM's [B, H, N, C] views -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=str)
def test_reads_what_the_view_says_and_round_trips(ops_mode, case):
    views = build_views(case)
    layout = detect_layout(views, **case.describe())
    assert isinstance(layout, StridedKVLayout) and layout.geometry.kv_planes == (1 if case.mla else 2)
    slots = view_slots(case)
    expected = write_known(views, case, slots, seed=1)
    valid = slots >= 0

    sentinel = random_bits(layout.chunk_shape(slots.numel()), case.dtype, torch.Generator().manual_seed(2))
    chunk = sentinel.clone()
    layout.gather(views, slots, chunk)
    assert torch.equal(bits(chunk[:, :, valid]), bits(expected[:, :, valid]))
    assert torch.equal(bits(chunk[:, :, ~valid]), bits(sentinel[:, :, ~valid])), "rows of slot -1 were written"

    # Scatter into a fresh allocation: exactly the bytes the view addresses for those slots change.
    fresh = build_views(case)
    reference = build_views(case)
    write_known(reference, case, slots, seed=1)
    layout.scatter(chunk, fresh, slots)
    assert torch.equal(backing_bytes(fresh[0]), backing_bytes(reference[0]))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunk_from_one_layout_loads_into_every_other(ops_mode, case):
    """A chunk written by the LBNHC (CUDA default) layout of the same spec loads bit-exact into `case`, and
    the chunk `case` writes back out is the same chunk."""
    source_case = case.with_(layout="LBNHC", kernel_block_size=None)
    source = build_views(source_case)
    source_layout = detect_layout(source, **source_case.describe())
    slots = view_slots(source_case)
    stored = write_known(source, source_case, slots, seed=3)
    chunk = torch.zeros_like(stored)
    source_layout.gather(source, slots, chunk)
    assert torch.equal(bits(chunk[:, :, slots >= 0]), bits(stored[:, :, slots >= 0]))

    target = build_views(case)
    target_layout = detect_layout(target, **case.describe())
    other_slots = torch.where(slots >= 0, (slots + 7 * case.block_size) % (case.num_blocks * case.block_size), slots)
    target_layout.scatter(chunk, target, other_slots)
    back = torch.zeros_like(chunk)
    target_layout.gather(target, other_slots, back)
    assert torch.equal(bits(back[:, :, slots >= 0]), bits(chunk[:, :, slots >= 0]))


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_packings_and_strided_views_share_the_chunk_format(ops_mode, isa):
    """vLLM's CPU attention (packed C) and a CUDA-style view load each other's chunks bit-exact."""
    case = KVViewCase(layout="LBNHC", block_size=32, num_kv_heads=2, head_size=64, num_blocks=9)
    views = build_views(case)
    strided = detect_layout(views, **case.describe())
    slots = view_slots(case)
    stored = write_known(views, case, slots, seed=4)
    packed, cpu_caches = make_layout(isa, layers=case.num_layers, blocks=case.num_blocks, block_size=32, heads=2,
                                     head_size=64)
    chunk = torch.zeros_like(stored)
    strided.gather(views, slots, chunk)
    packed.scatter(chunk, cpu_caches, slots)
    back = torch.zeros_like(chunk)
    packed.gather(cpu_caches, slots, back)
    valid = slots >= 0
    assert torch.equal(bits(back[:, :, valid]), bits(stored[:, :, valid]))
    into = build_views(case)
    strided.scatter(back, into, slots)
    again = torch.zeros_like(chunk)
    strided.gather(into, slots, again)
    assert torch.equal(bits(again[:, :, valid]), bits(stored[:, :, valid]))


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.bfloat16], ids=str)
def test_layerwise_equals_all_layers_on_views(ops_mode, case):
    views = build_views(case)
    layout = detect_layout(views, **case.describe())
    slots = view_slots(case)
    write_known(views, case, slots, seed=5)
    whole = torch.zeros(layout.chunk_shape(slots.numel()), dtype=case.dtype)
    layout.gather(views, slots, whole)
    per_layer = torch.zeros_like(whole)
    for layer, view in enumerate(views):
        layout.gather_layer(layer, view, slots, per_layer[layer])
    assert torch.equal(bits(whole), bits(per_layer))
    all_at_once, layerwise = build_views(case), build_views(case)
    layout.scatter(whole, all_at_once, slots)
    for layer, view in enumerate(layerwise):
        layout.scatter_layer(whole[layer], layer, view, slots)
    assert torch.equal(backing_bytes(all_at_once[0]), backing_bytes(layerwise[0]))


# ---- vLLM's CPU attention packings ---------------------------------------------------------------------------

def element_offsets(layout, slots: torch.Tensor) -> torch.Tensor:
    """[planes, T, width] flat offsets into one layer's cache, from the packing written out by hand."""
    g = layout.geometry
    bs, heads, dim = g.block_size, g.num_kv_heads, g.head_size
    b, o = (slots // bs)[None, :, None, None], (slots % bs)[None, :, None, None]
    h = torch.arange(heads)[None, None, :, None]
    d = torch.arange(dim)[None, None, None, :]
    plane = torch.arange(g.kv_planes)[:, None, None, None]
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
    """A CPU packing adapter (`vec`, `amx`) and random caches of vLLM's CPU backend shape."""
    geometry = KVGeometry(layers, blocks, block_size, heads, head_size, dtype)
    layout = {"vec": CpuVecLayout, "amx": CpuAmxLayout}[kind](geometry)
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
        "block_then_tail_and_holes": torch.cat([torch.arange(8 * bs, 9 * bs),
                                                torch.tensor([-1, 3, 4, -1, 70 % (blocks * bs)])]),
        "short_partial": torch.tensor([5, 6, 7]),
        "all_skipped": torch.full((4,), -1),
    }


LAYOUT_CASES = [("vec", torch.bfloat16, 32, 64), ("vec", torch.float32, 16, 128), ("vec", torch.float16, 128, 64),
                ("amx", torch.bfloat16, 32, 64), ("amx", torch.bfloat16, 128, 128)]


@pytest.mark.parametrize("kind,dtype,block_size,head_size", LAYOUT_CASES)
def test_cpu_packing_matches_reference_and_leaves_other_slots(ops_mode, kind, dtype, block_size, head_size):
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


@pytest.mark.parametrize("kind", ["vec", "amx"])
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
    assert isinstance(detect_layout(cpu, backend="CPU_ATTN", cpu_isa="vec"), CpuVecLayout)
    assert isinstance(detect_layout(cpu, backend="CPU_ATTN", cpu_isa="amx"), CpuAmxLayout)
    assert detect_layout(cpu, backend="CPU_ATTN", cpu_isa="vec16").geometry.head_size == 64
    assert detect_layout({"a": cpu[0], "b": cpu[1]}, backend="CPU_ATTN", cpu_isa="vec").num_layers == 2
    with pytest.raises(UnsupportedLayoutError, match="neon"):
        detect_layout(cpu, backend="CPU_ATTN", cpu_isa="neon")
    with pytest.raises(LayoutError, match="do not divide vLLM's block_size=48"):
        detect_layout(cpu, backend="CPU_ATTN", cpu_isa="vec", block_size=48)
    with pytest.raises(UnsupportedLayoutError, match="fp8"):
        detect_layout([torch.zeros(4, 2, 32, 128, dtype=torch.uint8)], backend="CPU_ATTN", cpu_isa="vec")
    # A contiguous LBHNC view is not taken for the CPU packing unless the backend is vLLM's CPU attention.
    for backend in (None, "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        layout = detect_layout(cpu, backend=backend)
        assert isinstance(layout, StridedKVLayout) and layout.order == "LBHNC", backend
    # CPU attention only reads contiguous LBHNC layers: any other order is named in the error.
    lbnhc = kv_views(KVViewCase(layout="LBNHC", head_size=64))
    with pytest.raises(UnsupportedLayoutError, match="LBNHC"):
        detect_layout(lbnhc, backend="CPU_ATTN", cpu_isa="vec")
    # MLA: from the spec (head_size_v = 0) or the backend's name; vLLM's CPU MLA backend is not packed.
    mla = kv_views(KVViewCase(layout="LBNHC", mla=True, head_size=576))
    for kwargs in ({"head_size": 576, "head_size_v": 0}, {"backend": "FLASHMLA"}, {"backend": "CPU_MLA"}):
        layout = detect_layout(mla, **kwargs)
        assert layout.chunk_shape(8) == (3, 1, 8, 576), kwargs
    # Kernel block splitting: the views' 16-token blocks divide vLLM's 32; slots keep vLLM's numbering.
    split = kv_views(KVViewCase(layout="LBNHC", kernel_block_size=16))
    assert detect_layout(split, block_size=32, num_kv_heads=2, head_size=64).geometry.block_size == 16
    with pytest.raises(LayoutError, match="kv heads"):
        detect_layout(split, num_kv_heads=4)
    with pytest.raises(UnsupportedLayoutError, match="head_size_v"):
        detect_layout([torch.zeros(4, 2, 16, 192)], head_size=128, head_size_v=64)
    with pytest.raises(LayoutError, match="head_size 64 \\+ head_size_v 64"):
        detect_layout([torch.zeros(4, 2, 16, 192)], head_size=64, head_size_v=64)
    with pytest.raises(UnsupportedLayoutError, match=r"\(3, 4\)"):
        detect_layout([torch.zeros(3, 4)])
    with pytest.raises(UnsupportedLayoutError, match="non-attention"):  # a raw int8 buffer (mamba & co.)
        StridedKVLayout.from_views([torch.zeros(64, dtype=torch.int8)], 64, 64)
    with pytest.raises(LayoutError, match="strides"):
        detect_layout([split[0], split[0].contiguous()])


def test_strided_layout_rejects_other_views_at_call_time():
    case = KVViewCase(layout="LBNHC")
    views = kv_views(case)
    layout = detect_layout(views, **case.describe())
    out = torch.zeros(layout.chunk_shape(4), dtype=case.dtype)
    with pytest.raises(LayoutError, match="strides"):
        layout.gather([v.contiguous() for v in views], torch.arange(4), out)
    with pytest.raises(LayoutError, match="beyond"):
        layout.gather(views, torch.tensor([0, 1, 2, case.num_blocks * case.block_size]), out)


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
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's amx reshape_and_cache runs only where the CPU has AMX tiles (the amx packing "
                    "is still compared with the torch path in the other tests)")
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

    layout = detect_layout([cache], backend="CPU_ATTN", cpu_isa=isa)
    chunk = torch.stack((key.flatten(1), value.flatten(1)))[None]
    ours = torch.zeros_like(cache)
    layout.scatter(chunk, [ours], slots)
    assert torch.equal(ours.view(torch.int16), cache.view(torch.int16))

    back = torch.empty_like(chunk)
    layout.gather([cache], slots, back)
    assert torch.equal(back.view(torch.int16), chunk.view(torch.int16))
