// lmcache_vllm._cpu_ops: multi-layer gather (paged KV cache -> stored chunk) and scatter (chunk -> paged
// cache) by slot mapping on the CPU, for the layouts of lmcache_vllm.layouts:
//   0 cpu vec/vec16: per layer [blocks, heads, bs, 2*D]; per (block, head) K^T [D][bs] then V [bs][D]
//   1 cpu amx (2-byte dtypes): K [bs/16][D/2][16][2], V [D/16][bs/2][16][2] per (block, head)
//   2 flash: per layer [2, blocks, bs, heads, D]      3 mla: per layer [blocks, bs, dim]
// Chunk: [layers, planes, T, width] contiguous. Slots < 0 are skipped. All layers move in one call, split
// over ATen's thread pool (at::parallel_for). Runs of consecutive slots inside a block (8-token aligned;
// whole blocks are the usual case) move with SSE2 tile transposes or memcpy; the other tokens one row at a
// time. Results are bit-identical to the torch code of the layouts (tests/test_ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif
#include <vector>

namespace {

enum LayoutCode : int64_t { kVec = 0, kAmx = 1, kFlash = 2, kMla = 3 };

struct Geometry {
  int64_t blocks, bs, heads, dim, planes, width;
};

// A run of consecutive slots inside one block, offsets [first, first + len) with first and len multiples of
// kRunAlign, so it can move with tiled transposes (8 tokens = one 8x8 tile of 16-bit elements).
constexpr int64_t kRunAlign = 8;

struct Segment {
  int64_t pos, block, first, len;  // chunk position of offset `first`
};

struct Plan {
  std::vector<Segment> runs;
  std::vector<int64_t> tokens;  // chunk positions of the other valid slots, moved one by one
};

Plan make_plan(const int64_t* slots, int64_t n, int64_t bs) {
  Plan plan;
  int64_t p = 0;
  while (p < n) {
    const int64_t s = slots[p];
    if (s < 0) { ++p; continue; }
    int64_t q = p + 1;  // extend while consecutive and inside the same block
    while (q < n && slots[q] == slots[q - 1] + 1 && slots[q] % bs != 0) ++q;
    const int64_t start = s % bs, stop = start + (q - p);
    const int64_t a = bs % kRunAlign ? stop : (start + kRunAlign - 1) / kRunAlign * kRunAlign;
    const int64_t b = bs % kRunAlign ? stop : stop / kRunAlign * kRunAlign;
    if (b > a) {
      for (int64_t i = p; i < p + (a - start); ++i) plan.tokens.push_back(i);
      plan.runs.push_back({p + (a - start), s / bs, a, b - a});
      for (int64_t i = p + (b - start); i < q; ++i) plan.tokens.push_back(i);
    } else {
      for (int64_t i = p; i < q; ++i) plan.tokens.push_back(i);
    }
    p = q;
  }
  // Neighbouring slots share cache lines (K^T keeps 8..32 tokens of one d in a line): visit them together.
  std::stable_sort(plan.tokens.begin(), plan.tokens.end(), [&](int64_t x, int64_t y) { return slots[x] < slots[y]; });
  return plan;
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols; 16x16 tiles stay in L1.
template <typename T>
inline void transpose_scalar(const T* src, int64_t rows, int64_t cols, int64_t src_stride, T* dst, int64_t dst_stride) {
  constexpr int64_t kTile = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = std::min(r0 + kTile, rows);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = std::min(c0 + kTile, cols);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
    }
  }
}

#if defined(__SSE2__)
// 8x8 transpose of 16-bit elements in SSE2 registers (SSE2 is part of every x86-64, so no dispatch).
inline void store16(void* p, __m128i v) { _mm_storeu_si128(static_cast<__m128i*>(p), v); }

inline void transpose8x8_u16(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds) {
  __m128i a[8], b[8], c[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ss));
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  c[0] = _mm_unpacklo_epi32(b[0], b[2]); c[1] = _mm_unpackhi_epi32(b[0], b[2]);
  c[2] = _mm_unpacklo_epi32(b[1], b[3]); c[3] = _mm_unpackhi_epi32(b[1], b[3]);
  c[4] = _mm_unpacklo_epi32(b[4], b[6]); c[5] = _mm_unpackhi_epi32(b[4], b[6]);
  c[6] = _mm_unpacklo_epi32(b[5], b[7]); c[7] = _mm_unpackhi_epi32(b[5], b[7]);
  for (int i = 0; i < 4; ++i) {
    store16(dst + (2 * i) * ds, _mm_unpacklo_epi64(c[i], c[i + 4]));
    store16(dst + (2 * i + 1) * ds, _mm_unpackhi_epi64(c[i], c[i + 4]));
  }
}

// 4x4 transpose of 32-bit elements.
inline void transpose4x4_u32(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m128 r0 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  __m128 r1 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + ss)));
  __m128 r2 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * ss)));
  __m128 r3 = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 3 * ss)));
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  store16(dst, _mm_castps_si128(r0));
  store16(dst + ds, _mm_castps_si128(r1));
  store16(dst + 2 * ds, _mm_castps_si128(r2));
  store16(dst + 3 * ds, _mm_castps_si128(r3));
}
#endif

// Flat element offset of (plane, slot, head, d) in one layer's cache.
inline int64_t element_offset(int64_t layout, const Geometry& g, int64_t plane, int64_t slot, int64_t h, int64_t d) {
  const int64_t b = slot / g.bs, o = slot % g.bs;
  if (layout == kFlash || layout == kMla) return ((plane * g.blocks + b) * g.bs + o) * g.width + h * g.dim + d;
  const int64_t base = (b * g.heads + h) * 2 * g.bs * g.dim + plane * g.bs * g.dim;
  if (layout == kVec) return base + (plane == 0 ? d * g.bs + o : o * g.dim + d);
  if (plane == 0) return base + ((o / 16) * (g.dim / 2) + d / 2) * 32 + (o % 16) * 2 + d % 2;
  return base + ((d / 16) * (g.bs / 2) + o / 2) * 32 + (d % 16) * 2 + o % 2;
}

// Transposes an 8x8 (16-bit) or 4x4 (32-bit) tile; scalar where SSE2 is missing.
template <typename T>
inline void transpose_tile(const T* src, int64_t ss, T* dst, int64_t ds) {
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    transpose8x8_u16(reinterpret_cast<const uint16_t*>(src), ss, reinterpret_cast<uint16_t*>(dst), ds);
    return;
  } else if constexpr (sizeof(T) == 4) {
    transpose4x4_u32(reinterpret_cast<const uint32_t*>(src), ss, reinterpret_cast<uint32_t*>(dst), ds);
    return;
  }
#endif
  constexpr int64_t n = sizeof(T) == 2 ? 8 : 4;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < n; ++c) dst[c * ds + r] = src[r * ss + c];
}

// AMX V: a [16 d][2 tokens] tile <-> 16 d of token rows r0 and r1.
template <typename T, bool kGather>
inline void amx_v_pairs(T* tile, T* r0, T* r1) {
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    auto load = [](const T* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
    if (kGather) {
      // Each 32-bit lane holds (token 0, token 1) of one d: sign-extend each half, then pack exactly.
      __m128i even[4], odd[4];
      for (int k = 0; k < 4; ++k) {
        const __m128i x = load(tile + 8 * k);
        even[k] = _mm_srai_epi32(_mm_slli_epi32(x, 16), 16);
        odd[k] = _mm_srai_epi32(x, 16);
      }
      store16(r0, _mm_packs_epi32(even[0], even[1]));
      store16(r0 + 8, _mm_packs_epi32(even[2], even[3]));
      store16(r1, _mm_packs_epi32(odd[0], odd[1]));
      store16(r1 + 8, _mm_packs_epi32(odd[2], odd[3]));
    } else {
      for (int half = 0; half < 2; ++half) {
        const __m128i a = load(r0 + 8 * half), b = load(r1 + 8 * half);
        store16(tile + 16 * half, _mm_unpacklo_epi16(a, b));
        store16(tile + 16 * half + 8, _mm_unpackhi_epi16(a, b));
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < 16; ++j) {
    if (kGather) { r0[j] = tile[2 * j]; r1[j] = tile[2 * j + 1]; }
    else { tile[2 * j] = r0[j]; tile[2 * j + 1] = r1[j]; }
  }
}

// One run (offsets [o0, o0 + len) of one block), one plane, every head of one layer. kGather: cache -> rows,
// else rows -> cache. `rows` points at the chunk row of offset o0 in that plane; row stride = width. Heads
// are the outer loop: one head's source region stays in L1 while its strip of the destination is written
// in whole lines.
template <typename T, bool kGather>
void move_run(int64_t layout, const Geometry& g, T* cache, const Segment& run, int64_t plane, T* rows) {
  const int64_t bs = g.bs, D = g.dim, W = g.width, H = g.heads, o0 = run.first, o1 = run.first + run.len;
  if (layout == kFlash || layout == kMla) {  // the rows of all heads are contiguous on both sides
    T* base = cache + ((plane * g.blocks + run.block) * bs + o0) * W;
    if (kGather) std::memcpy(rows, base, run.len * W * sizeof(T));
    else std::memcpy(base, rows, run.len * W * sizeof(T));
    return;
  }
  auto region = [&](int64_t h) { return cache + (run.block * H + h) * 2 * bs * D + plane * bs * D; };
  auto row = [&](int64_t o, int64_t h) { return rows + (o - o0) * W + h * D; };
  if (layout == kVec && plane == 1) {  // V [bs][D] per head: row pieces
    for (int64_t h = 0; h < H; ++h)
      for (int64_t o = o0; o < o1; ++o) {
        if (kGather) std::memcpy(row(o, h), region(h) + o * D, D * sizeof(T));
        else std::memcpy(region(h) + o * D, row(o, h), D * sizeof(T));
      }
    return;
  }
  if (layout == kVec) {  // K^T [D][bs] per head
    constexpr int64_t n = sizeof(T) == 2 ? 8 : 4;
    if (!(sizeof(T) == 2 || sizeof(T) == 4) || D % n) {
      for (int64_t h = 0; h < H; ++h) {
        if (kGather) transpose_scalar(region(h) + o0, D, run.len, bs, row(o0, h), W);
        else transpose_scalar(row(o0, h), run.len, D, W, region(h) + o0, bs);
      }
      return;
    }
    for (int64_t h = 0; h < H; ++h) {
      if (kGather) {
        for (int64_t o = o0; o < o1; o += n)
          for (int64_t d = 0; d < D; d += n) transpose_tile(region(h) + d * bs + o, bs, row(o, h) + d, W);
      } else {
        for (int64_t d = 0; d < D; d += n)
          for (int64_t o = o0; o < o1; o += n) transpose_tile(row(o, h) + d, W, region(h) + d * bs + o, bs);
      }
    }
    return;
  }
  // amx (2-byte elements). K per head: [bs/16][D/2][16] pairs, moved as 4x4 tiles of 32-bit pairs.
  if (plane == 0) {
    using P = uint32_t;
    const int64_t Wp = W / 2, Dp = D / 2;
    auto pairs = [&](int64_t h, int64_t o) {  // K pair (o, k = 0) of head h; k steps by 16
      return reinterpret_cast<P*>(region(h)) + (o / 16) * Dp * 16 + o % 16;
    };
    auto row_pairs = [&](int64_t o, int64_t h) { return reinterpret_cast<P*>(rows) + (o - o0) * Wp + h * Dp; };
    for (int64_t h = 0; h < H; ++h) {
      if (kGather) {
        for (int64_t o = o0; o < o1; o += 4)
          for (int64_t k = 0; k < Dp; k += 4) transpose_tile(pairs(h, o) + k * 16, 16, row_pairs(o, h) + k, Wp);
      } else {
        for (int64_t k = 0; k < Dp; k += 4)
          for (int64_t o = o0; o < o1; o += 4) transpose_tile(row_pairs(o, h) + k, Wp, pairs(h, o) + k * 16, 16);
      }
    }
    return;
  }
  // amx V per head: [D/16][bs/2][16 d][2 tokens].
  for (int64_t h = 0; h < H; ++h)
    for (int64_t o = o0; o < o1; o += 2)
      for (int64_t i = 0; i < D / 16; ++i) {
        T* r0 = row(o, h) + i * 16;
        amx_v_pairs<T, kGather>(region(h) + (i * (bs / 2) + o / 2) * 32, r0, r0 + W);
      }
}

// One token of one (plane, head) of the CPU layouts; `base` is the element of d = 0.
template <typename T, bool kGather>
inline void move_token_head(int64_t layout, const Geometry& g, T* base, int64_t plane, T* row) {
  const int64_t D = g.dim;
  if (layout == kVec) {
    if (plane == 1) {
      if (kGather) std::memcpy(row, base, D * sizeof(T)); else std::memcpy(base, row, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) { if (kGather) row[d] = base[d * g.bs]; else base[d * g.bs] = row[d]; }
    }
  } else if (plane == 0) {  // amx K: pairs of d, 16 pairs apart
    for (int64_t k = 0; k < D / 2; ++k) {
      if (kGather) std::memcpy(row + 2 * k, base + k * 32, 2 * sizeof(T));
      else std::memcpy(base + k * 32, row + 2 * k, 2 * sizeof(T));
    }
  } else {  // amx V: runs of 16 d, stride 2 inside a run, runs (bs/2)*32 apart
    for (int64_t i = 0; i < D / 16; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        T& c = base[i * (g.bs / 2) * 32 + j * 2];
        if (kGather) row[i * 16 + j] = c; else c = row[i * 16 + j];
      }
  }
}

template <typename T, bool kGather>
void run(int64_t layout, const Geometry& g, const std::vector<T*>& caches, T* chunk, const int64_t* slots,
         int64_t num_tokens, const Plan& plan) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  const int64_t layer_stride = g.planes * num_tokens * g.width, plane_stride = num_tokens * g.width;
  const int64_t units = static_cast<int64_t>(plan.runs.size()) * g.planes;
  if (units) {
    at::parallel_for(0, layers * units, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t layer = item / units, plane = item % g.planes;
        const Segment& seg = plan.runs[(item % units) / g.planes];
        T* rows = chunk + layer * layer_stride + plane * plane_stride + seg.pos * g.width;
        move_run<T, kGather>(layout, g, caches[layer], seg, plane, rows);
      }
    });
  }
  const int64_t ntok = static_cast<int64_t>(plan.tokens.size());
  if (ntok) {
    at::parallel_for(0, layers * ntok, 16, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t layer = item / ntok, pos = plan.tokens[item % ntok], slot = slots[pos];
        for (int64_t plane = 0; plane < g.planes; ++plane) {
          T* row = chunk + layer * layer_stride + plane * plane_stride + pos * g.width;
          T* cache = caches[layer];
          if (layout == kFlash || layout == kMla) {
            T* src = cache + element_offset(layout, g, plane, slot, 0, 0);
            if (kGather) std::memcpy(row, src, g.width * sizeof(T));
            else std::memcpy(src, row, g.width * sizeof(T));
            continue;
          }
          for (int64_t h = 0; h < g.heads; ++h)
            move_token_head<T, kGather>(layout, g, cache + element_offset(layout, g, plane, slot, h, 0), plane,
                                        row + h * g.dim);
        }
      }
    });
  }
}

Geometry check_inputs(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, const torch::Tensor& chunk,
                      int64_t layout, int64_t block_size) {
  TORCH_CHECK(layout >= kVec && layout <= kMla, "_cpu_ops: unknown layout code ", layout);
  TORCH_CHECK(!caches.empty(), "_cpu_ops: no KV caches given");
  TORCH_CHECK(chunk.dim() == 4 && chunk.is_contiguous() && chunk.device().is_cpu(),
              "_cpu_ops: chunk must be a contiguous CPU tensor [layers, planes, T, width], got ", chunk.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.device().is_cpu(),
              "_cpu_ops: slot_mapping must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(chunk.size(0) == static_cast<int64_t>(caches.size()) && chunk.size(2) == slots.size(0),
              "_cpu_ops: chunk ", chunk.sizes(), " does not match ", caches.size(), " layers and ", slots.size(0), " slots");
  const auto& c0 = caches[0];
  Geometry g{};
  if (layout == kVec || layout == kAmx) {
    TORCH_CHECK(c0.dim() == 4 && c0.size(2) == block_size, "_cpu_ops: cpu cache must be [blocks, heads, ", block_size,
                ", 2*D], got ", c0.sizes());
    g = {c0.size(0), block_size, c0.size(1), c0.size(3) / 2, 2, c0.size(1) * (c0.size(3) / 2)};
    if (layout == kAmx)
      TORCH_CHECK(c0.element_size() == 2 && block_size % 16 == 0 && g.dim % 16 == 0,
                  "_cpu_ops: amx needs a 2-byte dtype and block/head sizes that are multiples of 16");
  } else if (layout == kFlash) {
    TORCH_CHECK(c0.dim() == 5 && c0.size(0) == 2 && c0.size(2) == block_size,
                "_cpu_ops: flash cache must be [2, blocks, ", block_size, ", heads, D], got ", c0.sizes());
    g = {c0.size(1), block_size, c0.size(3), c0.size(4), 2, c0.size(3) * c0.size(4)};
  } else {
    TORCH_CHECK(c0.dim() == 3 && c0.size(1) == block_size, "_cpu_ops: mla cache must be [blocks, ", block_size,
                ", dim], got ", c0.sizes());
    g = {c0.size(0), block_size, 1, c0.size(2), 1, c0.size(2)};
  }
  TORCH_CHECK(chunk.size(1) == g.planes && chunk.size(3) == g.width, "_cpu_ops: chunk ", chunk.sizes(),
              " does not fit planes=", g.planes, " width=", g.width);
  for (size_t i = 0; i < caches.size(); ++i) {
    const auto& c = caches[i];
    TORCH_CHECK(c.sizes() == c0.sizes() && c.scalar_type() == chunk.scalar_type() && c.is_contiguous() && c.device().is_cpu(),
                "_cpu_ops: cache ", i, " must be a contiguous CPU tensor ", c0.sizes(), " of the chunk's dtype");
  }
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t limit = g.blocks * g.bs;
  for (int64_t i = 0; i < slots.size(0); ++i)
    TORCH_CHECK(s[i] < limit, "_cpu_ops: slot ", s[i], " beyond the cache's ", limit, " slots");
  return g;
}

template <bool kGather>
void dispatch(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, const torch::Tensor& chunk,
              int64_t layout, int64_t block_size) {
  const Geometry g = check_inputs(caches, slots, chunk, layout, block_size);
  const Plan plan = make_plan(slots.data_ptr<int64_t>(), slots.size(0), g.bs);
  const int64_t item = chunk.element_size();
  auto go = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T*> ptrs;
    for (const auto& c : caches) ptrs.push_back(static_cast<T*>(c.data_ptr()));
    run<T, kGather>(layout, g, ptrs, static_cast<T*>(chunk.data_ptr()), slots.data_ptr<int64_t>(), slots.size(0), plan);
  };
  if (item == 1) go(uint8_t{});
  else if (item == 2) go(uint16_t{});
  else if (item == 4) go(uint32_t{});
  else if (item == 8) go(uint64_t{});
  else TORCH_CHECK(false, "_cpu_ops: unsupported element size ", item);
}

void gather(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, torch::Tensor out, int64_t layout,
            int64_t block_size) {
  dispatch<true>(caches, slots, out, layout, block_size);
}

void scatter(const torch::Tensor& chunk, const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
             int64_t layout, int64_t block_size) {
  dispatch<false>(caches, slots, chunk, layout, block_size);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-layer paged KV gather/scatter by slot mapping (CPU)";
  m.def("gather", &gather, "paged caches -> chunk [L, planes, T, width]", py::arg("caches"), py::arg("slots"),
        py::arg("out"), py::arg("layout"), py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.def("scatter", &scatter, "chunk [L, planes, T, width] -> paged caches", py::arg("chunk"), py::arg("caches"),
        py::arg("slots"), py::arg("layout"), py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.attr("SUPPORTED_LAYOUTS") = py::make_tuple(0, 1, 2, 3);
}
