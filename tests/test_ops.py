"""Compiled transfer ops (`lmcache_vllm._cpu_ops`, `lmcache_vllm._cuda_ops`) against the torch fallback and
vLLM's own CPU reshape-and-cache op, over many shapes and slot mappings (vLLM's CPU packings and the strided
views vLLM builds for CUDA backends); every bad input is a Python exception, checked in a child process so
that a crash fails the test instead of ending the run; ops selection and the `LMCACHE_VLLM_OPS=torch`
switch. CUDA tests run only where a GPU and the CUDA extension exist.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys

import pytest
import torch

from lmcache_vllm import ops
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, fill_known, kv_views
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


# Strided kinds: vLLM's views for a CUDA backend (`KVViewCase`): the FLASH_ATTN default LBNHC, the head-major
# LBHNC, layers interleaved per block (BLNHC), and MLA's one latent plane.
STRIDED = {"lbnhc": dict(layout="LBNHC"), "lbhnc": dict(layout="LBHNC"), "blnhc": dict(layout="BLNHC"),
           "mla": dict(layout="LBNHC", mla=True)}


def cpu_caches(kind, layers, blocks, heads, head_size, block_size, dtype, gen, device="cpu"):
    """Random caches of `kind`: vLLM's CPU backend shape for vec/amx, vLLM's views for the strided kinds."""
    if kind in ("vec", "amx"):
        shape = (blocks, heads, block_size, 2 * head_size)
        return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    case = KVViewCase(num_layers=layers, num_blocks=blocks, block_size=block_size, num_kv_heads=heads,
                      head_size=head_size, dtype=dtype, **STRIDED[kind])
    views = fill_known(kv_views(case), case, seed=int(torch.randint(1 << 30, (1,), generator=gen)))
    if device == "cpu":
        return views
    on_device = kv_views(case, device)  # same construction; copy every byte of the backing allocation
    raw = lambda v: torch.empty(0, dtype=torch.uint8, device=v.device).set_(v.untyped_storage())  # noqa: E731
    raw(on_device[0]).copy_(raw(views[0]))
    return on_device


def hint(kind: str) -> dict:
    if kind in ("vec", "amx"):
        return {"backend": "CPU_ATTN", "cpu_isa": kind}
    return {"backend": "FLASHMLA" if kind == "mla" else "FLASH_ATTN"}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


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
    into_op = random_like(caches, gen)
    into_torch = random_like(into_op, None)
    layout.scatter(chunk, into_op, slots)
    with ops.forced_torch():
        layout.scatter(chunk, into_torch, slots)
    for a, b in zip(into_op, into_torch):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(raw_bytes(into_op[0]), raw_bytes(into_torch[0]))  # no other byte touched


def raw_bytes(view: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation a view lives in."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def random_like(caches: list[torch.Tensor], gen: torch.Generator | None) -> list[torch.Tensor]:
    """The same views (sizes, strides, offsets) into a new allocation: random bytes, or a copy of the
    caches' allocation when `gen` is None."""
    old = raw_bytes(caches[0])
    raw = old.clone() if gen is None else torch.randint(0, 256, old.shape, generator=gen, dtype=torch.uint8)
    if gen is not None and caches[0].dtype.is_floating_point:  # no NaN bit patterns: equal bits compare equal
        raw = raw.view(caches[0].dtype).nan_to_num_(0.0, 1.0, -1.0).view(torch.uint8) \
            if old.numel() % caches[0].element_size() == 0 else raw
    return [torch.empty(0, dtype=c.dtype).set_(raw.untyped_storage(), c.storage_offset(), c.shape, c.stride())
            if c.untyped_storage().data_ptr() == caches[0].untyped_storage().data_ptr()
            else random_like([c], gen)[0] for c in caches]


GRID = [
    (kind, layers, heads, head_size, block_size, slots)
    for kind, layers, heads, head_size, block_size, slots in itertools.product(
        ["vec", "amx", "lbnhc", "lbhnc", "blnhc", "mla"], [1, 3], [1, 4], [64, 128], [16, 32, 128],
        ["whole_blocks", "holes", "random"])
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
    layout = detect_layout(caches, backend="CPU_ATTN", cpu_isa="vec")
    a = torch.zeros(layout.chunk_shape(slots.numel()), dtype=dtype)
    b = torch.zeros_like(a)
    layout.gather(caches, slots, a)
    with ops.forced_torch():
        layout.gather(caches, slots, b)
    assert torch.equal(a, b)


CPU_ISAS = ["scalar", "sse2", "avx2", "avx512"]


def _isas() -> list[str]:
    if cpu_ext is None:
        return []
    cpu_ext.set_isa("auto")
    best = cpu_ext.isa()
    # What set_isa may choose on this CPU: every set up to the best (avx512 machines also run avx2).
    return [name for name in CPU_ISAS[: CPU_ISAS.index(best) + 1] if cpu_ext.set_isa(name) == ""]


def _kernel_sets() -> list[str]:
    """Every kernel set, AVX-512 and AVX2 once per task shape (`isa/tasks`): an AMD machine then also checks the
    Intel shape and the other way round, and an AVX-512 machine both AVX2 gathers (staged heads, whole-line tiles)."""
    return [f"{isa}/{tasks}" for isa in _isas()
            for tasks in (("strip", "plane") if isa in ("avx512", "avx2") else ("",))]


def _use(kernel_set: str) -> None:
    isa, _, tasks = kernel_set.partition("/")
    assert cpu_ext.set_isa(isa) == "" and cpu_ext.isa() == isa
    assert cpu_ext.set_tasks(tasks or "auto") == ""


@pytest.fixture
def restore_isa():
    yield
    cpu_ext.set_isa("auto")
    cpu_ext.set_tasks("auto")


def _misaligned_like(shape, dtype) -> torch.Tensor:
    """A contiguous tensor whose data starts 2 bytes past a 64-byte line (no non-temporal stores)."""
    count = 1
    for n in shape:
        count *= n
    return torch.zeros(count + 32, dtype=dtype)[1:1 + count].view(shape)


@needs_cpu_ext
@pytest.mark.parametrize("isa", _kernel_sets())
@pytest.mark.parametrize("kind,dtype,head_size,block_size,slots_kind,aligned", [
    ("vec", torch.bfloat16, 128, 128, "whole_blocks", True), ("vec", torch.bfloat16, 128, 128, "midblock", True),
    ("vec", torch.bfloat16, 64, 32, "holes", False), ("vec", torch.float32, 64, 32, "midblock", True),
    ("vec", torch.float32, 48, 16, "holes", True), ("vec", torch.float16, 96, 64, "midblock", True),
    ("vec", torch.bfloat16, 512, 128, "midblock", True), ("vec", torch.bfloat16, 256, 32, "holes", True),
    ("amx", torch.bfloat16, 128, 128, "midblock", True),
    ("amx", torch.bfloat16, 128, 64, "whole_blocks", False), ("amx", torch.bfloat16, 48, 32, "holes", True),
    ("lbnhc", torch.bfloat16, 64, 16, "holes", True), ("mla", torch.bfloat16, 64, 16, "holes", True),
    ("blnhc", torch.uint8, 128, 16, "midblock", False),
])
def test_every_cpu_kernel_set_matches_torch(restore_isa, isa, kind, dtype, head_size, block_size, slots_kind,
                                            aligned):
    """Each kernel set this CPU can run (scalar and sse2 are the portable paths, avx2 that of CPUs without
    AVX-512), whole-line non-temporal stores (aligned) and cached stores (misaligned chunk), partial blocks at
    both ends, head sizes whose staged K (avx2 gather) spans several groups of tokens per run (512); AVX-512
    with both task shapes (strips of every head; whole runs head by head with look-ahead)."""
    _use(isa)
    gen = torch.Generator().manual_seed(head_size + block_size)
    blocks, heads = 6, 2
    caches = cpu_caches(kind, 2, blocks, heads, head_size, block_size, dtype, gen)
    if slots_kind == "midblock":  # partial, whole, partial block: edges go through the narrower kernels
        slots = torch.arange(block_size + 5, 3 * block_size + 21)
    else:
        slots = slot_mapping(slots_kind, blocks, block_size, gen)
    layout = detect_layout(caches, **hint(kind))
    shape = layout.chunk_shape(slots.numel())
    via_op = torch.zeros(shape, dtype=dtype) if aligned else _misaligned_like(shape, dtype)
    assert_compiled_matches_torch(layout, caches, slots, via_op, gen)


def _split(total: int, sizes: list[int]) -> list[int]:
    """`sizes` cut to add up to `total`: the last takes what is left (a partial last chunk)."""
    out, left = [], total
    for size in sizes:
        if left <= 0:
            break
        out.append(min(size, left))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return out


@needs_cpu_ext
@pytest.mark.parametrize("isa", _kernel_sets())
@pytest.mark.parametrize("kind,head_size,block_size,slots_kind,aligned", [
    ("vec", 128, 32, "midblock", True), ("vec", 64, 128, "holes", False), ("vec", 64, 16, "whole_blocks", True),
    ("amx", 128, 32, "midblock", True), ("amx", 64, 32, "holes", False),
    ("lbnhc", 64, 16, "holes", True), ("mla", 64, 16, "midblock", True),
])
def test_several_chunks_in_one_call_match_one_call_per_chunk(restore_isa, isa, kind, head_size, block_size,
                                                             slots_kind, aligned):
    """`gather_chunks` / `scatter_chunks` (a load's or a save's every chunk in one compiled call, chunk i
    taking the next T_i slots; chunks of different lengths, misaligned chunk memory) give the bits of one
    call per chunk and of the torch fallback, both directions, layerwise too."""
    _use(isa)
    gen = torch.Generator().manual_seed(head_size * 3 + block_size)
    blocks = 8
    caches = cpu_caches(kind, 3, blocks, 2 if kind != "mla" else 1, head_size, block_size, torch.bfloat16, gen)
    if slots_kind == "midblock":
        slots = torch.arange(block_size + 5, 4 * block_size + 21)
    else:
        slots = slot_mapping(slots_kind, blocks, block_size, gen)
    layout = detect_layout(caches, **hint(kind))
    sizes = _split(slots.numel(), [block_size + 3, 2 * block_size, block_size])
    alloc = (lambda shape: torch.zeros(shape, dtype=torch.bfloat16)) if aligned else \
        (lambda shape: _misaligned_like(shape, torch.bfloat16))
    many = [alloc(layout.chunk_shape(n)) for n in sizes]
    layout.gather_chunks(caches, slots, many)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for chunk, start, n in zip(many, starts, sizes):
        one = torch.zeros(layout.chunk_shape(n), dtype=torch.bfloat16)
        with ops.forced_torch():
            layout.gather(caches, slots[start:start + n], one)
        assert torch.equal(bits(chunk), bits(one))
    sources = [torch.randn(c.shape, generator=gen).to(torch.bfloat16) for c in many]
    into_many, into_each = random_like(caches, gen), None
    into_each = random_like(into_many, None)
    layout.scatter_chunks(sources, into_many, slots)
    with ops.forced_torch():
        layout.scatter_chunks(sources, into_each, slots)
    assert torch.equal(raw_bytes(into_many[0]), raw_bytes(into_each[0]))
    for a, b in zip(into_many, into_each):
        assert torch.equal(bits(a), bits(b))
    # Layer by layer (use_layerwise) into fresh chunks: the same bits as the whole call; so does a layerwise
    # load or save's copier (one call of the compiled op per layer, no per-layer views), both directions.
    by_layer = [torch.zeros(c.shape, dtype=torch.bfloat16) for c in many]
    for layer, cache in enumerate(caches):
        layout.gather_layer_chunks(layer, cache, slots, [c[layer] for c in by_layer])
    for mode in ("auto", "torch"):
        with ops.forced_torch() if mode == "torch" else contextlib.nullcontext():
            by_copier = [torch.zeros(c.shape, dtype=torch.bfloat16) for c in many]
            gather_layer = layout.layer_copier(True, caches, slots, by_copier)
            for layer in range(len(caches)):
                gather_layer(layer)
            into_layers = random_like(into_each, None)
            scatter_layer = layout.layer_copier(False, into_layers, slots, sources)
            for layer in range(len(caches)):
                scatter_layer(layer)
        for a, b, c in zip(by_layer, by_copier, many):
            assert torch.equal(bits(a), bits(c)) and torch.equal(bits(b), bits(c))
        for a, b in zip(into_layers, into_each):
            assert torch.equal(bits(a), bits(b))


@needs_cpu_ext
@pytest.mark.parametrize("env,query,forced", [("LMCACHE_VLLM_CPU_ISA", "isa", ("sse2", "scalar")),
                                              ("LMCACHE_VLLM_CPU_TASKS", "tasks", ("strip", "plane"))])
def test_kernel_choices_from_the_environment(env, query, forced):
    code = f"from lmcache_vllm import ops; print(ops.cpu_ext().{query}())"
    for value in forced:
        result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{env: value}),
                                capture_output=True, text=True, timeout=120)
        assert result.stdout.split() == [value], result.stderr


@needs_cpu_ext
def test_kernel_choices_switch_and_refuse_unknown_names(restore_isa):
    assert "unknown isa" in cpu_ext.set_isa("neon")
    assert cpu_ext.set_isa("auto") == "" and cpu_ext.isa() == _isas()[-1]
    assert "unknown task shape" in cpu_ext.set_tasks("rows")
    assert cpu_ext.set_tasks("plane") == "" and (cpu_ext.tasks(), cpu_ext.tasks_note()) == ("plane", "set")
    assert cpu_ext.set_tasks("auto") == "" and (cpu_ext.tasks(), cpu_ext.tasks_note()) == ("auto", "")


@needs_cpu_ext
@pytest.mark.parametrize("isa,kind", [("avx512", "vec"), ("avx512", "amx"), ("avx2", "vec")])
def test_auto_task_shape_is_measured_once_at_start_up(restore_isa, isa, kind):
    """`auto` (the default) times both task shapes at the first call that runs the AVX-512 vec / amx kernels or
    the AVX2 vec kernels (CPUs without AVX-512: AMD Zen 2/3), on scratch buffers of that call's geometry, and keeps
    the faster for the process: no table of CPU kinds. The connector makes that first call when it binds the
    layout at start-up (`bind_kernel`), not in a request."""
    if isa not in _isas():
        pytest.skip(f"this CPU does not run the {isa} kernels")
    assert cpu_ext.set_isa(isa) == "" and cpu_ext.set_tasks("auto") == ""
    gen = torch.Generator().manual_seed(3)
    caches = cpu_caches(kind, 2, 4, 2, 64, 32, torch.bfloat16, gen)
    layout = detect_layout(caches, **hint(kind))
    layout.bind_kernel(caches)
    chosen, note = cpu_ext.tasks(), cpu_ext.tasks_note()
    assert chosen in ("strip", "plane"), chosen
    assert "strip" in note and "plane" in note and " ms" in note and f"the {isa} kernels" in note, note
    times = dict(part.split()[:2] for part in note.split(": ", 1)[1].split(", ")[:2])  # {"strip": "1.2", ...}
    assert float(times[chosen]) <= float(times["plane" if chosen == "strip" else "strip"])
    slots = torch.arange(5, 60)  # later calls keep that choice and give the torch path's bits
    via_op = torch.zeros(layout.chunk_shape(slots.numel()), dtype=torch.bfloat16)
    assert_compiled_matches_torch(layout, caches, slots, via_op, gen)
    assert (cpu_ext.tasks(), cpu_ext.tasks_note()) == (chosen, note)


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
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's amx reshape_and_cache runs only where the CPU has AMX tiles (the amx packing "
                    "is still compared with the torch path in the other tests)")
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

    layout = detect_layout(reference, backend="CPU_ATTN", cpu_isa=isa)
    ours = [torch.zeros_like(c) for c in reference]
    layout.scatter(chunk, ours, slots)
    for a, b in zip(ours, reference):
        assert torch.equal(bits(a), bits(b))
    back = torch.zeros_like(chunk)
    layout.gather(reference, slots, back)
    assert torch.equal(bits(back[:, :, valid]), bits(chunk[:, :, valid]))


BAD_INPUTS = r"""
import torch
from lmcache_vllm import ops
ext = ops.cpu_ext()
bf = torch.bfloat16
packed = [torch.zeros(4, 2, 16, 128, dtype=bf)]
out = torch.empty(1, 2, 3, 128, dtype=bf)
views = [torch.zeros(4, 16, 2, 128, dtype=bf).permute(0, 2, 1, 3)] * 2  # LBNHC-like [B, H, N, C]
vout = torch.empty(2, 2, 3, 128, dtype=bf)
ok = torch.tensor([0, 1, 2])
cases = [
    # the GPU hosts' segfaults (2026-11-23 and -30): formatting an integer into the message
    ("slot 64 beyond the cache's 64 slots", lambda: ext.gather(packed, torch.tensor([0, 1, 4 * 16]), out, 0, 16)),
    ("beyond", lambda: ext.scatter(out, packed, torch.tensor([0, 1, 10 ** 12]), 0, 16)),
    ("beyond", lambda: ext.gather(views, torch.tensor([0, 64, 1]), vout, 4, 16)),
    ("unknown layout code 9", lambda: ext.gather(packed, ok, out, 9, 16)),
    ("unknown layout", lambda: ext.gather(packed, ok, out, 2, 16)),  # the old flash code is gone
    ("does not match", lambda: ext.gather(packed, torch.tensor([0, 1]), out, 0, 16)),
    ("dtype BFloat16 differs from the caches' dtype Float", lambda: ext.gather([packed[0].float()], ok, out, 0, 16)),
    ("int64", lambda: ext.gather(packed, ok.int(), out, 0, 16)),
    ("int64", lambda: ext.gather(packed, ok.view(3, 1), out, 0, 16)),
    ("int64", lambda: ext.gather(packed, torch.tensor(3), out, 0, 16)),  # 0-d slots
    ("no KV caches", lambda: ext.gather([], ok, out, 0, 16)),
    ("contiguous", lambda: ext.gather(packed, ok, torch.empty(1, 2, 128, 3, dtype=bf).transpose(2, 3), 0, 16)),
    ("contiguous", lambda: ext.gather(packed, ok, torch.empty(2, 3, 128, dtype=bf), 0, 16)),  # 3-D chunk
    ("contiguous", lambda: ext.gather([torch.zeros(4, 2, 32, 128, dtype=bf)[:, :, ::2]], ok, out, 0, 16)),
    ("2*D", lambda: ext.gather(packed, ok, out, 0, 32)),  # block size not the cache's
    ("amx needs", lambda: ext.gather([torch.zeros(4, 2, 16, 128)], ok, torch.empty(1, 2, 3, 128), 1, 16)),
    ("chunk [1, 2, 3, 64] does not fit planes=2 width=128",
     lambda: ext.gather(packed, ok, torch.empty(1, 2, 3, 64, dtype=bf), 0, 16)),
    ("cache 1", lambda: ext.gather([views[0], views[0].contiguous()], ok, vout, 4, 16)),
    ("does not fit", lambda: ext.gather(views, ok, torch.empty(2, 3, 3, 128, dtype=bf), 4, 16)),  # 3 planes
    ("does not fit", lambda: ext.gather(views, ok, torch.empty(2, 2, 3, 256, dtype=bf), 4, 16)),
    ("contiguous", lambda: ext.gather([torch.zeros(4, 2, 16, 128, dtype=bf)[..., ::2]], ok,
                                      torch.empty(1, 2, 3, 64, dtype=bf), 4, 16)),
    ("strided cache", lambda: ext.gather([torch.zeros(64, dtype=bf)], ok, vout[:1], 4, 16)),  # a raw buffer
    ("CPU", lambda: ext.gather(packed, ok, out.to("meta"), 0, 16)),
    # several chunks in one call: each checked, their tokens together the slot mapping's
    ("no chunks", lambda: ext.gather_chunks(packed, ok[:0], [], 0, 16)),
    ("does not match", lambda: ext.gather_chunks(packed, ok, [out, out], 0, 16)),
    ("does not match", lambda: ext.scatter_chunks([out[:, :, :2].contiguous()] * 2, packed, ok, 0, 16)),
    ("chunk 1", lambda: ext.gather_chunks(packed, torch.arange(6), [out, torch.empty(1, 2, 3, 64, dtype=bf)], 0, 16)),
    ("chunk 1 dtype", lambda: ext.gather_chunks(packed, torch.arange(6), [out, out.float()], 0, 16)),
    ("chunk 1 must be", lambda: ext.scatter_chunks([out, out.transpose(2, 3)], packed, torch.arange(6), 0, 16)),
    ("beyond", lambda: ext.scatter_chunks([out, out], packed, torch.tensor([0, 1, 2, 3, 4, 64]), 0, 16)),
    # one layer of a call with every layer's caches and whole chunks (layerwise loads and saves)
    ("out of range", lambda: ext.scatter_layers([out], packed, ok, 0, 16, 1, 1)),
    ("out of range", lambda: ext.gather_layers(packed, ok, [out], 0, 16, -1, 1)),
    ("out of range", lambda: ext.gather_layers(packed, ok, [out], 0, 16, 0, 0)),
    ("out of range", lambda: ext.scatter_layers([out], packed, ok, 0, 16, 2 ** 62, 2 ** 62)),
    ("chunk 0 must be", lambda: ext.scatter_layers([torch.empty(2, 2, 3, 128, dtype=bf)], packed, ok, 0, 16, 0, 1)),
    ("chunk 0 must be", lambda: ext.gather_layers(packed, ok, [torch.empty(2, 3, 128, dtype=bf)], 0, 16, 0, 1)),
    ("beyond", lambda: ext.scatter_layers([out], packed, torch.tensor([0, 1, 64]), 0, 16, 0, 1)),
]
for expected, call in cases:
    error = call()
    assert isinstance(error, str) and expected in error, (expected, error)
    print("rejected:", error)
print("all", len(cases), "rejected")
"""


@needs_cpu_ext
def test_cpu_op_rejects_every_bad_input_without_crashing():
    """Run in a child: a crash (the GPU host's segfault) fails this test with its signal instead of killing the
    run. Every case returns an error message; none reads memory before its inputs were validated."""
    for threads in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        result = subprocess.run([sys.executable, "-c", BAD_INPUTS], env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, f"child ended with {result.returncode}: {result.stderr[-2000:]}"
        assert "rejected" in result.stdout and result.stdout.rstrip().endswith("rejected"), result.stdout


@needs_cpu_ext
def test_cpp_exceptions_reach_python_on_this_toolchain():
    """Diagnosis for the GPU host's segfault: a C++ exception thrown by the extension must arrive as a Python
    RuntimeError. If this fails (a crash in the child), exceptions do not unwind across the extension with
    the compiler it was built with: the ops above still never throw, but report it (toolchain, not ours)."""
    code = ("from lmcache_vllm import ops\ntry:\n    ops.cpu_ext().throw_for_diagnosis()\n"
            "except RuntimeError as e:\n    print('caught', 'diagnostic exception' in str(e))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["caught", "True"], (result.returncode, result.stderr)


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
@pytest.mark.parametrize("kind", ["lbnhc", "lbhnc", "blnhc", "mla"])
@pytest.mark.parametrize("target", ["device", "pinned", "pageable"])
@pytest.mark.parametrize("head_size,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.uint8),
                                             (3, torch.bfloat16)])  # 3: pieces not 16-byte aligned
def test_cuda_kernels_match_the_cpu_reference(kind, target, head_size, dtype):
    """GPU gather/scatter (the kernel for device and pinned chunks, the torch path for pageable ones) give
    the CPU's bytes; rows of slot -1 keep what the chunk held (the old staged path overwrote them); a
    scatter changes no other byte of the allocation; layerwise equals all layers."""
    gen = torch.Generator().manual_seed(head_size)
    cpu_views = cpu_caches(kind, 3, 8, 4, head_size, 16, dtype, gen)
    gpu_views = cpu_caches(kind, 3, 8, 4, head_size, 16, dtype, torch.Generator().manual_seed(head_size), "cuda")
    assert torch.equal(raw_bytes(gpu_views[0]).cpu(), raw_bytes(cpu_views[0]))
    slots = slot_mapping("holes", 8, 16, gen)
    assert bool((slots < 0).any())
    layout = detect_layout(cpu_views, **hint(kind))
    gpu_layout = detect_layout(gpu_views, **hint(kind))
    assert gpu_layout.bind_kernel(gpu_views, "on").use_kernel  # the kernel, not a silent torch fallback
    shape = layout.chunk_shape(slots.numel())
    sentinel = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen,
                             dtype=torch.uint8).view(dtype)
    expected = sentinel.clone()
    layout.gather(cpu_views, slots, expected)
    out = sentinel.clone().cuda() if target == "device" else sentinel.clone().pin_memory() if target == "pinned" \
        else sentinel.clone()
    gpu_layout.gather(gpu_views, slots, out)
    torch.cuda.synchronize()
    assert torch.equal(bits(out.cpu()), bits(expected))

    fresh_cpu = cpu_caches(kind, 3, 8, 4, head_size, 16, dtype, torch.Generator().manual_seed(99))
    fresh_gpu = cpu_caches(kind, 3, 8, 4, head_size, 16, dtype, torch.Generator().manual_seed(99), "cuda")
    layout.scatter(expected, fresh_cpu, slots)
    gpu_layout.scatter(out, fresh_gpu, slots)
    torch.cuda.synchronize()
    assert torch.equal(raw_bytes(fresh_gpu[0]).cpu(), raw_bytes(fresh_cpu[0]))

    one = sentinel[1].clone().cuda()
    gpu_layout.gather_layer(1, gpu_views[1], slots, one)
    torch.cuda.synchronize()
    assert torch.equal(bits(one.cpu()), bits(expected[1]))


@needs_cuda_ext
def test_cuda_kernel_rejects_bad_input_without_crashing():
    """In a child, like the CPU op's: on the H200 host of 2026-11-30 the old message building crashed the
    process (an integer into a std::ostringstream), which killed the whole test run."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import test_ops; "
            "test_ops.cuda_bad_inputs(); print('rejected')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.split()[-1:] == ["rejected"], \
        f"child ended with {result.returncode}: {result.stderr[-2000:]}"


def cuda_bad_inputs() -> None:
    caches = cpu_caches("lbnhc", 2, 8, 2, 64, 16, torch.bfloat16, torch.Generator().manual_seed(0), "cuda")
    slots = torch.arange(4, device="cuda")
    out = torch.zeros(2, 2, 4, 128, dtype=torch.bfloat16, device="cuda")
    assert "pinned" in cuda_ext.gather(caches, slots, out.cpu(), 4, 16)  # pageable host memory
    assert "int64" in cuda_ext.gather(caches, slots.cpu(), out, 4, 16)  # slots on the host
    assert "layout code 2 is not" in cuda_ext.gather(caches, slots, out, 2, 16)
    assert "does not fit" in cuda_ext.gather(caches, slots, out[:, :, :, :64].contiguous(), 4, 16)
    assert "cache 1" in cuda_ext.gather([caches[0], caches[1].contiguous()], slots, out, 4, 16)
    assert cuda_ext.gather(caches, slots, out, 4, 16) == ""
