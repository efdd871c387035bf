// lmcache_vllm._cpu_ops: multi-layer gather (paged KV cache -> stored chunk) and scatter (chunk -> paged
// cache) by slot mapping on the CPU, for the layouts of lmcache_vllm.layouts:
//   0 cpu vec/vec16: per layer [blocks, heads, bs, 2*D]; per (block, head) K^T [D][bs] then V [bs][D]
//   1 cpu amx (2-byte dtypes): K [bs/16][D/2][16][2], V [D/16][bs/2][16][2] per (block, head)
//   4 strided: vLLM's per-layer [B, H, N, C] views with any strides (C contiguous; C = planes * D), read
//     from the tensors; each (layer, plane, token, head) is one contiguous piece of D elements.
// Chunk: [layers, planes, T, width] contiguous. Slots < 0 are skipped. All layers move in one call, split
// over ATen's thread pool as (layer, 32-token strip) tasks that the threads take one by one (a thread the
// OS preempts on a busy host delays only its own task, not a fixed half of the work). Runs of consecutive
// slots inside a block (whole blocks are the usual case) move as tiles; the other tokens one row at a time.
// Errors: gather/scatter return "" or a message and never throw. Every input (shapes, strides, dtypes,
// devices, every slot) is validated before any data is read or any parallel region starts, and nothing
// inside a parallel region can throw: a bad input is a Python exception (raised by lmcache_vllm.ops), never
// a crash, even where C++ exceptions do not unwind across the extension (`throw_for_diagnosis` tells).
// Kernels, picked at run time (`isa()`, `set_isa()`, env LMCACHE_VLLM_CPU_ISA=auto|avx512|avx2|sse2|scalar):
//   avx512  32x32 (16-bit) / 16x16 (32-bit) transposes and 2-line amx V permutes that read and write whole
//           64-byte lines (cpu_ops_avx512.h, target attributes: no -march flag, the wheel runs anywhere);
//   avx2    vec layout, 2- and 4-byte elements: 16x16 / 8x8 transposes over 32-byte rows, the gather's K staged
//           per head so every chunk row's head segment is written at once (cpu_ops_avx2.h); amx: sse2 tiles;
//   sse2    8x8 / 4x4 tile transposes (every x86-64);   scalar  plain loops (any CPU).
// Every kernel gives results bit-identical to the torch code of the layouts (tests/test_ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>
#include <numeric>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <utility>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif
#include <vector>

#include "cpu_ops_avx2.h"
#include "cpu_ops_avx512.h"
#include "op_errors.h"

namespace {

enum LayoutCode : int64_t { kVec = 0, kAmx = 1, kStrided = 4 };
constexpr int64_t kAbi = 2;  // calling convention (lmcache_vllm.ops.ABI_VERSION)
enum Isa : int { kScalar = 0, kSse2 = 1, kAvx2 = 2, kAvx512 = 3 };
const char* const kIsaNames[] = {"scalar", "sse2", "avx2", "avx512"};

Isa best_isa() {
#if defined(LMCACHE_HAVE_AVX512)
  __builtin_cpu_init();  // libgcc also checks that the OS saves the zmm state
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return kAvx512;
#endif
#if defined(LMCACHE_HAVE_AVX2)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return kAvx2;
#endif
#if defined(__SSE2__)
  return kSse2;
#else
  return kScalar;
#endif
}

std::atomic<int> g_isa{-1};

// Picks `name` (auto = the best this CPU runs). Returns "" or why `name` cannot be used (nothing changes then).
std::string set_isa_checked(const std::string& name) {
  const Isa best = best_isa();
  Isa chosen = best;
  if (name != "auto" && !name.empty()) {
    int i = 0;
    while (i <= kAvx512 && name != kIsaNames[i]) ++i;
    if (i > kAvx512) return "unknown isa '" + name + "' (auto, avx512, avx2, sse2, scalar)";
    if (i > best) return "isa '" + name + "' not supported here (best: " + kIsaNames[best] + ")";
    chosen = static_cast<Isa>(i);
  }
  g_isa.store(chosen);
  return "";
}

Isa current_isa() {
  int isa = g_isa.load();
  if (isa < 0) {
    const char* env = std::getenv("LMCACHE_VLLM_CPU_ISA");
    // A bad env value must not break the op: fall back to the best.
    if (!set_isa_checked(env ? env : "auto").empty()) set_isa_checked("auto");
    isa = g_isa.load();
  }
  return static_cast<Isa>(isa);
}

// How the AVX-512 vec and amx kernels and the AVX2 vec kernels split a call into tasks (`tasks()`, `set_tasks()`,
// env LMCACHE_VLLM_CPU_TASKS=auto|strip|plane): strip = (layer, 32-token strip) walking every head, the shape first
// tuned on Intel Xeon (1.08-1.24 of a plain copy there; AVX2: the gather per (layer, run, head) through a staged
// head, tuned on AMD Zen 3); plane = (layer, run) head by head with the next head's source prefetched into L2,
// which took AMD Zen 4 from 0.5 to ~0.9 of a plain copy (strips with the same prefetch: ~0.75; the K^T tiles are
// latency-bound there; AVX2: the gather in whole-line tiles, `gather_vec_lines_avx2`). Which is faster depends on
// the CPU's prefetchers and was never measured on every kind, so auto measures: the first call that runs these kernels times both shapes on
// scratch buffers of its own geometry (`measure_tasks`, once per process) and keeps the faster (`tasks_note()`
// says what was measured).
enum Tasks : int { kStripTasks = 0, kPlaneTasks = 1, kAutoTasks = 2 };
const char* const kTaskNames[] = {"strip", "plane", "auto"};
std::atomic<int> g_tasks{-1};
std::mutex g_tasks_mutex;  // guards the measurement and g_tasks_note
std::string g_tasks_note;

std::string set_tasks_checked(const std::string& name) {
  Tasks chosen;
  if (name == "auto" || name.empty()) chosen = kAutoTasks;
  else if (name == "strip") chosen = kStripTasks;
  else if (name == "plane") chosen = kPlaneTasks;
  else return "unknown task shape '" + name + "' (auto, strip, plane)";
  std::lock_guard<std::mutex> lock(g_tasks_mutex);
  g_tasks.store(chosen);
  g_tasks_note = chosen == kAutoTasks ? "" : "set";
  return "";
}

Tasks current_tasks() {
  if (g_tasks.load() < 0) {
    const char* env = std::getenv("LMCACHE_VLLM_CPU_TASKS");
    if (!set_tasks_checked(env ? env : "auto").empty()) set_tasks_checked("auto");
  }
  return static_cast<Tasks>(g_tasks.load());
}

std::string tasks_note() {
  std::lock_guard<std::mutex> lock(g_tasks_mutex);
  return g_tasks_note;
}

struct Geometry {
  int64_t blocks, bs, heads, dim, planes, width;
};

// Shorter in-block runs go one token at a time (sorted by slot so neighbours share cache lines). The AVX-512 tiles
// (`avx512_tiles`) take every run of at least kMinTileRun tokens, their first and last tiles moving part of a
// tile; single tokens (random slots) measured faster one by one (bench_ops.py's scattered case, AMD Zen 5).
constexpr int64_t kMinRun = 8;
constexpr int64_t kMinTileRun = 2;
// Tokens per task of a run (a multiple of the 32-token AVX-512 tile and of amx's 16-token K groups).
constexpr int64_t kStrip = 32;

struct Segment {
  int64_t pos, block, first, len;  // chunk position of block offset `first`
};

struct Plan {
  std::vector<Segment> runs;
  std::vector<int64_t> tokens;  // chunk positions of the other valid slots, moved one by one
};

Plan make_plan(const int64_t* slots, int64_t n, int64_t bs, int64_t min_run = kMinRun) {
  Plan plan;
  int64_t p = 0;
  while (p < n) {
    const int64_t s = slots[p];
    if (s < 0) { ++p; continue; }
    int64_t q = p + 1;  // extend while consecutive and inside the same block
    while (q < n && slots[q] == slots[q - 1] + 1 && slots[q] % bs != 0) ++q;
    if (q - p >= min_run) plan.runs.push_back({p, s / bs, s % bs, q - p});
    else for (int64_t i = p; i < q; ++i) plan.tokens.push_back(i);
    p = q;
  }
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
inline void store16(void* p, __m128i v) { _mm_storeu_si128(static_cast<__m128i*>(p), v); }

// 8x8 transpose of 16-bit elements in SSE2 registers (SSE2 is part of every x86-64).
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

// Transposes an 8x8 (16-bit) or 4x4 (32-bit) tile; scalar below SSE2.
template <typename T>
inline void transpose_tile(Isa isa, const T* src, int64_t ss, T* dst, int64_t ds) {
#if defined(__SSE2__)
  if (isa >= kSse2) {
    if constexpr (sizeof(T) == 2) {
      transpose8x8_u16(reinterpret_cast<const uint16_t*>(src), ss, reinterpret_cast<uint16_t*>(dst), ds);
      return;
    } else if constexpr (sizeof(T) == 4) {
      transpose4x4_u32(reinterpret_cast<const uint32_t*>(src), ss, reinterpret_cast<uint32_t*>(dst), ds);
      return;
    }
  }
#endif
  constexpr int64_t n = sizeof(T) == 2 ? 8 : 4;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < n; ++c) dst[c * ds + r] = src[r * ss + c];
}

// AMX V: a [16 d][2 tokens] tile <-> 16 d of token rows r0 and r1.
template <typename T, bool kGather>
inline void amx_v_pairs(Isa isa, T* tile, T* r0, T* r1) {
#if defined(__SSE2__)
  if (sizeof(T) == 2 && isa >= kSse2) {
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

// Flat element offset of (plane, slot, head, d) in one layer's cache.
inline int64_t element_offset(int64_t layout, const Geometry& g, int64_t plane, int64_t slot, int64_t h, int64_t d) {
  const int64_t b = slot / g.bs, o = slot % g.bs;
  const int64_t base = (b * g.heads + h) * 2 * g.bs * g.dim + plane * g.bs * g.dim;
  if (layout == kVec) return base + (plane == 0 ? d * g.bs + o : o * g.dim + d);
  if (plane == 0) return base + ((o / 16) * (g.dim / 2) + d / 2) * 32 + (o % 16) * 2 + d % 2;
  return base + ((d / 16) * (g.bs / 2) + o / 2) * 32 + (d % 16) * 2 + o % 2;
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

// What one task moves: block offsets [o0, o1) of one plane of one head. `region` is that (block, head,
// plane)'s part of the cache, `rows` the chunk row of offset o0 at the head's first column; row stride W.
template <typename T>
struct HeadPlane {
  T* region;
  T* rows;
  int64_t o0, o1;
  T* row(int64_t o) const { return rows + (o - o0) * W; }
  int64_t W;
};

template <typename T, bool kGather>
void move_tokens(int64_t layout, const Geometry& g, const HeadPlane<T>& x, int64_t plane, int64_t from, int64_t to) {
  for (int64_t o = from; o < to; ++o)
    move_token_head<T, kGather>(layout, g, x.region + (element_offset(layout, g, plane, o, 0, 0) -
                                                       element_offset(layout, g, plane, 0, 0, 0)),
                                plane, x.row(o));
}

// Portable kernels (SSE2 tiles or scalar loops) for offsets [from, to) of a vec/amx head plane.
template <typename T, bool kGather>
void move_portable(Isa isa, int64_t layout, const Geometry& g, const HeadPlane<T>& x, int64_t plane, int64_t from,
                   int64_t to) {
  const int64_t bs = g.bs, D = g.dim, W = x.W;
  if (from >= to) return;
  if (layout == kVec && plane == 1) {  // V [bs][D]: row pieces
    for (int64_t o = from; o < to; ++o) {
      if (kGather) std::memcpy(x.row(o), x.region + o * D, D * sizeof(T));
      else std::memcpy(x.region + o * D, x.row(o), D * sizeof(T));
    }
    return;
  }
  if (layout == kVec) {  // K^T [D][bs]
    constexpr int64_t n = sizeof(T) == 2 ? 8 : 4;
    const bool tiles = (sizeof(T) == 2 || sizeof(T) == 4) && D % n == 0;
    const int64_t stop = tiles ? from + (to - from) / n * n : from;
    for (int64_t d = 0; d < D && stop > from; d += n)
      for (int64_t o = from; o < stop; o += n) {
        if (kGather) transpose_tile(isa, x.region + d * bs + o, bs, x.row(o) + d, W);
        else transpose_tile(isa, x.row(o) + d, W, x.region + d * bs + o, bs);
      }
    if (stop < to) {
      if (kGather) transpose_scalar(x.region + stop, D, to - stop, bs, x.row(stop), W);
      else transpose_scalar(x.row(stop), to - stop, D, W, x.region + stop, bs);
    }
    return;
  }
  if (plane == 0) {  // amx K: [bs/16][D/2][16] pairs, 4x4 tiles of 32-bit pairs over 4 aligned tokens
    const int64_t a = std::min(to, (from + 3) / 4 * 4), b = std::max(a, to / 4 * 4);
    move_tokens<T, kGather>(layout, g, x, plane, from, a);
    using P = uint32_t;
    const int64_t Dp = D / 2;
    for (int64_t o = a; o < b; o += 4) {
      P* pairs = reinterpret_cast<P*>(x.region) + (o / 16) * Dp * 16 + o % 16;
      P* row = reinterpret_cast<P*>(x.row(o));
      for (int64_t k = 0; k < Dp; k += 4) {
        if (kGather) transpose_tile(isa, pairs + k * 16, 16, row + k, W / 2);
        else transpose_tile(isa, row + k, W / 2, pairs + k * 16, 16);
      }
    }
    move_tokens<T, kGather>(layout, g, x, plane, b, to);
    return;
  }
  // amx V: [D/16][bs/2][16 d][2 tokens], token pairs.
  const int64_t a = std::min(to, (from + 1) / 2 * 2), b = std::max(a, to / 2 * 2);
  move_tokens<T, kGather>(layout, g, x, plane, from, a);
  for (int64_t o = a; o < b; o += 2)
    for (int64_t i = 0; i < D / 16; ++i)
      amx_v_pairs<T, kGather>(isa, x.region + (i * (bs / 2) + o / 2) * 32, x.row(o) + i * 16, x.row(o + 1) + i * 16);
  move_tokens<T, kGather>(layout, g, x, plane, b, to);
}

// Whether the AVX-512 tile kernels move every token of a vec / amx run with elements of type T, any run (no
// per-token path): vec needs 2- or 4-byte elements and head and block sizes that are multiples of the tile (32
// or 16 tokens: one 64-byte line of one d), amx 2-byte elements and a head size that is a multiple of 32.
template <typename T>
bool avx512_tiles(int64_t layout, const Geometry& g) {
  if (layout == kVec) {
    constexpr int64_t n = sizeof(T) == 2 ? 32 : sizeof(T) == 4 ? 16 : 0;
    return n > 0 && g.dim % n == 0 && g.bs % n == 0;
  }
  return layout == kAmx && sizeof(T) == 2 && g.dim % 32 == 0 && g.bs % 16 == 0;
}

#if defined(LMCACHE_HAVE_AVX512)
// The AVX-512 tile transpose of U's size (32x32 of 16-bit, 16x16 of 32-bit elements).
template <typename U, bool kStream, int kRows>
LMCACHE_AVX512 inline void transpose_tile_avx512(const U* src, int64_t ss, U* dst, int64_t ds, int lo = 0,
                                                 int hi = 64 / static_cast<int>(sizeof(U))) {
  if constexpr (sizeof(U) == 2) lmcache_avx512::transpose32x32_u16<kStream, kRows>(src, ss, dst, ds, lo, hi);
  else lmcache_avx512::transpose16x16_u32<kStream, kRows>(src, ss, dst, ds, lo, hi);
}
#endif

#if defined(LMCACHE_HAVE_AVX512)
// AVX-512 kernels for the tile-aligned middle of [o0, o1); the rest goes to the portable kernels. kStream:
// the chunk side is written with non-temporal stores (gather into a 64-byte-aligned chunk). `next`: element
// distance from this head plane's source to the next head's (0: none); for vec, every tile and row prefetches
// the next head's matching source lines into L2 meanwhile. Why: the K^T tiles read 32 lines 256 bytes apart
// (the chunk rows 2 KiB apart in the scatter), a pattern the hardware prefetchers do not follow; without it
// the vec gather ran at 0.5 of a plain copy on AMD Zen 4, latency-bound (bench_ops.py).
template <typename T, bool kGather, bool kStream>
LMCACHE_AVX512 void move_avx512(int64_t layout, const Geometry& g, const HeadPlane<T>& x, int64_t plane,
                                int64_t next = 0) {
  namespace k5 = lmcache_avx512;
  const int64_t bs = g.bs, D = g.dim, W = x.W, o0 = x.o0, o1 = x.o1;
  if (layout == kVec && plane == 1 && (D * sizeof(T)) % 64 == 0) {  // V [bs][D]: whole lines per row
    for (int64_t o = o0; o < o1; ++o) {
      const T* src = kGather ? x.region + o * D : x.row(o);
      if (next) k5::prefetch_l2(src + next, D * sizeof(T));
      if (kGather) k5::copy_lines<kStream>(x.row(o), src, D * sizeof(T));
      else k5::copy_lines<kStream>(x.region + o * D, src, D * sizeof(T));
    }
    return;
  }
  if (layout == kVec && plane == 0 && avx512_tiles<T>(layout, g)) {  // K^T [D][bs]
    // Tiles of n tokens aligned to n in the block (n tokens of one d fill a 64-byte line): the cache side is whole
    // aligned lines; a run's first and last tiles may reach past it and move only its tokens (TileRows).
    constexpr int64_t n = sizeof(T) == 2 ? 32 : 16;
    using U = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
    U* region = reinterpret_cast<U*>(x.region);
    for (int64_t w = o0 / n * n; w < o1; w += n) {  // token windows outer: chunk rows left to right, whole lines
      const int lo = static_cast<int>(std::max(o0, w) - w), hi = static_cast<int>(std::min(o1, w + n) - w);
      for (int64_t d = 0; d < D; d += n) {
        U* row = reinterpret_cast<U*>(x.row(w + lo)) + d;  // the chunk row of the window's first token moved
        U* lines = region + d * bs + w;
        if (next) {  // the source lines of this tile in the next head
          if (kGather) for (int64_t r = 0; r < n; ++r) k5::prefetch_l2(lines + next + r * bs, 64);
          else for (int64_t r = 0; r < hi - lo; ++r) k5::prefetch_l2(row + next + r * W, 64);
        }
        if (lo == 0 && hi == n) {
          if (kGather) transpose_tile_avx512<U, kStream, k5::kAllRows>(lines, bs, row, W);
          else transpose_tile_avx512<U, kStream, k5::kAllRows>(row, W, lines, bs);
        } else if (kGather) {
          transpose_tile_avx512<U, kStream, k5::kRowsOut>(lines, bs, row, W, lo, hi);
        } else {
          transpose_tile_avx512<U, false, k5::kRowsIn>(row, W, lines, bs, lo, hi);
        }
      }
    }
    return;
  }
  if (layout == kAmx && avx512_tiles<T>(layout, g)) {
    if (plane == 0) {  // K: 16 tokens (aligned to 16) x 16 pairs of d per tile, pairs as 32-bit elements
      const int64_t Dp = D / 2;
      for (int64_t w = o0 / 16 * 16; w < o1; w += 16) {
        const int lo = static_cast<int>(std::max(o0, w) - w), hi = static_cast<int>(std::min(o1, w + 16) - w);
        uint32_t* pairs = reinterpret_cast<uint32_t*>(x.region) + (w / 16) * Dp * 16;
        uint32_t* row = reinterpret_cast<uint32_t*>(x.row(w + lo));
        if (kGather && next) k5::prefetch_l2(reinterpret_cast<uint16_t*>(pairs) + next, Dp * 16 * 4);
        for (int64_t k = 0; k < Dp; k += 16) {
          if (lo == 0 && hi == 16) {
            if (kGather) k5::transpose16x16_u32<kStream>(pairs + k * 16, 16, row + k, W / 2);
            else k5::transpose16x16_u32<kStream>(row + k, W / 2, pairs + k * 16, 16);
          } else if (kGather) {
            k5::transpose16x16_u32<kStream, k5::kRowsOut>(pairs + k * 16, 16, row + k, W / 2, lo, hi);
          } else {
            k5::transpose16x16_u32<false, k5::kRowsIn>(row + k, W / 2, pairs + k * 16, 16, lo, hi);
          }
        }
      }
      return;
    }
    // V: token pairs x 32 d (two [16 d][2] lines) per step; d groups outer so the cache side is sequential. A run
    // starting on an odd token or ending on an even one has a pair of which it moves one token.
    const int64_t a = std::min(o1, (o0 + 1) / 2 * 2), b = std::max(a, o1 / 2 * 2);
    uint16_t* region = reinterpret_cast<uint16_t*>(x.region);
    for (int64_t i = 0; i < D / 16; i += 2) {
      auto lines = [&](int64_t o) { return region + (i * (bs / 2) + o / 2) * 32; };
      if (kGather && next) {  // this d group pair's lines of the run, in the next head
        const int64_t bytes = ((o1 + 1) / 2 - o0 / 2) * 64;
        k5::prefetch_l2(lines(o0) + next, bytes);
        k5::prefetch_l2(lines(o0) + (bs / 2) * 32 + next, bytes);
      }
      if (o0 < a) k5::amx_v_lines_one<kGather>(lines(o0), lines(o0) + (bs / 2) * 32,
                                                reinterpret_cast<uint16_t*>(x.row(o0)) + i * 16, true);
      for (int64_t o = a; o < b; o += 2) {
        uint16_t* row = reinterpret_cast<uint16_t*>(x.row(o)) + i * 16;
        k5::amx_v_lines<kGather, kStream>(lines(o), lines(o) + (bs / 2) * 32, row, row + W);
      }
      if (b < o1) k5::amx_v_lines_one<kGather>(lines(b), lines(b) + (bs / 2) * 32,
                                               reinterpret_cast<uint16_t*>(x.row(b)) + i * 16, false);
    }
    return;
  }
  move_portable<T, kGather>(kSse2, layout, g, x, plane, o0, o1);
}
#endif

// Whether the AVX2 kernels take a layout with elements of type T: vec, 2- or 4-byte elements, a head size that
// is a multiple of the tile and whose transposed tile fits the gather's staging buffer.
template <typename T>
bool avx2_takes(int64_t layout, const Geometry& g) {
#if defined(LMCACHE_HAVE_AVX2)
  constexpr int64_t n = lmcache_avx2::tile<T>();
  return layout == kVec && n > 0 && g.dim > 0 && g.dim % n == 0 &&
         g.dim * n * static_cast<int64_t>(sizeof(T)) <= lmcache_avx2::kStageBytes;
#else
  (void)layout, (void)g;
  return false;
#endif
}

// (K^T, V) planes of head h of a run of the vec/amx layouts.
template <typename T>
std::pair<HeadPlane<T>, HeadPlane<T>> head_planes(const Geometry& g, T* cache, const Segment& run, int64_t h, T* rows,
                                                  int64_t plane_stride) {
  T* k = cache + (run.block * g.heads + h) * 2 * g.bs * g.dim;
  const int64_t o1 = run.first + run.len;
  return {HeadPlane<T>{k, rows + h * g.dim, run.first, o1, g.width},
          HeadPlane<T>{k + g.bs * g.dim, rows + plane_stride + h * g.dim, run.first, o1, g.width}};
}

#if defined(LMCACHE_HAVE_AVX2)
// AVX2 kernels for heads [h0, h1) of a vec run, both planes; K^T tokens that do not fill a tile go to the SSE2
// kernels. kStream: the written side is stored non-temporally (every piece is 32-byte aligned then). The
// scatter moves V token row by token row across the heads: its reads of the chunk are then front to back
// (head by head, they were 256 bytes every 2 KiB; measured ~1.2x faster on Zen 3).
template <typename T, bool kGather, bool kStream>
LMCACHE_AVX2 void move_vec_avx2(const Geometry& g, T* cache, const Segment& run, int64_t h0, int64_t h1, T* rows,
                                int64_t plane_stride) {
  namespace k2 = lmcache_avx2;
  const int64_t bs = g.bs, D = g.dim, W = g.width, o0 = run.first, o1 = run.first + run.len;
  for (int64_t h = h0; h < h1; ++h) {
    const auto [k, v] = head_planes(g, cache, run, h, rows, plane_stride);
    if (kGather) {
      const int64_t moved = k2::gather_kt<T, kStream>(k.region + o0, bs, D, o1 - o0, k.rows, W);
      move_portable<T, true>(kSse2, kVec, g, k, 0, o0 + moved, o1);
      k2::gather_v<T, kStream>(v.region + o0 * D, D, v.rows, W, o1 - o0);
      continue;
    }
    // Whole 64-byte K^T lines: steps of two tiles from a line-aligned block offset. Prefetched meanwhile: the
    // next head's K columns of the same rows, after the last head the V rows.
    constexpr int64_t line = 2 * k2::tile<T>();
    const int64_t a = std::min(o1, (o0 + line - 1) / line * line), b = std::max(a, o1 / line * line);
    move_portable<T, false>(kSse2, kVec, g, k, 0, o0, a);
    const T* next = h + 1 < h1 ? k.row(a) + D : v.row(a) - h * D;
    k2::scatter_kt<T, kStream>(k.row(a), W, k.region + a, bs, D, b - a, next);
    move_portable<T, false>(kSse2, kVec, g, k, 0, b, o1);
  }
  if (!kGather) {
    const HeadPlane<T> v = head_planes(g, cache, run, h0, rows, plane_stride).second;
    k2::scatter_v<T, kStream>(v.rows, W, v.region + o0 * D, 2 * bs * D, h1 - h0, D, o1 - o0);
  }
}

// AVX2, vec, plane tasks, the gather: heads [h0, h1) of a whole run, head by head, K^T in whole lines on both
// sides (`gather_kt_lines`) with the next head's K^T lines prefetched into L2, V row by row. On AMD Zen 4 made to run
// the AVX2 kernels (LMCACHE_VLLM_CPU_ISA=avx2, torch's copy with ATEN_CPU_CAPABILITY=avx2; a shared machine, load
// ~3) the gather went from 0.53-0.62 (strip: the staged heads, tuned on Zen 3) to 0.76-0.92 of a plain copy, heads
// of 128 and 64; not run on a real AVX2-only CPU. Which is faster is measured at first use (`measure_tasks`).
template <typename T, bool kStream>
LMCACHE_AVX2 void gather_vec_lines_avx2(const Geometry& g, T* cache, const Segment& run, int64_t h0, int64_t h1,
                                        T* rows, int64_t plane_stride) {
  namespace k2 = lmcache_avx2;
  const int64_t o0 = run.first, o1 = run.first + run.len;
  for (int64_t h = h0; h < h1; ++h) {
    const auto [k, v] = head_planes(g, cache, run, h, rows, plane_stride);
    k2::gather_kt_lines<T, kStream>(k.region, g.bs, g.dim, o0, o1, k.rows, g.width, h + 1 < h1 ? 2 * g.bs * g.dim : 0);
    k2::gather_v<T, kStream>(v.region + o0 * g.dim, g.dim, v.rows, g.width, o1 - o0);
  }
}
#endif

#if defined(LMCACHE_HAVE_AVX512)
// AVX-512, vec, plane tasks: heads [h0, h1) of a whole run, head by head, each head's source prefetched into L2
// while the previous head moves. The scatter moves V token row by token row across the heads instead (its
// chunk reads front to back, a few rows ahead prefetched): measured ~1.3x faster than head by head on Zen 4.
template <typename T, bool kGather, bool kStream>
LMCACHE_AVX512 void move_vec_planes_avx512(const Geometry& g, T* cache, const Segment& run, int64_t h0, int64_t h1,
                                           T* rows, int64_t plane_stride) {
  namespace k5 = lmcache_avx512;
  const int64_t piece = g.dim * static_cast<int64_t>(sizeof(T));
  const bool v_rows = !kGather && piece % 64 == 0;
  for (int64_t h = h0; h < h1; ++h) {
    const auto [k, v] = head_planes(g, cache, run, h, rows, plane_stride);
    // The next head's source: its (block, head) region in the cache, or its columns of the chunk rows.
    const int64_t next = h + 1 < h1 ? (kGather ? 2 * g.bs * g.dim : g.dim) : 0;
    move_avx512<T, kGather, kStream>(kVec, g, k, 0, next);
    if (!v_rows) move_avx512<T, kGather, kStream>(kVec, g, v, 1, next);
  }
  if (!v_rows) return;
  constexpr int64_t kAhead = 4;  // rows
  const HeadPlane<T> v = head_planes(g, cache, run, h0, rows, plane_stride).second;
  const int64_t head_stride = 2 * g.bs * g.dim, span = (h1 - h0) * piece;
  for (int64_t o = v.o0; o < v.o1; ++o) {
    if (o + kAhead < v.o1) k5::prefetch_l2(v.row(o + kAhead), span);
    for (int64_t h = 0; h < h1 - h0; ++h)
      k5::copy_lines<kStream>(v.region + h * head_stride + o * g.dim, v.row(o) + h * g.dim, piece);
  }
}
#endif

#if defined(LMCACHE_HAVE_AVX512)
// AVX-512, amx, plane tasks: heads [h0, h1) of a whole run. The gather goes head by head, each head's K and V
// regions (32 KiB each at head size 128, read front to back) prefetched into L2 while the previous head moves.
// The scatter goes across the heads instead, so that it reads the chunk rows front to back: K window by window
// (16 tokens: every head's tiles of those rows), V token pair by token pair (both rows across every head).
template <typename T, bool kGather, bool kStream>
LMCACHE_AVX512 void move_amx_planes_avx512(const Geometry& g, T* cache, const Segment& run, int64_t h0, int64_t h1,
                                           T* rows, int64_t plane_stride) {
  namespace k5 = lmcache_avx512;
  if constexpr (kGather || sizeof(T) != 2) {
    for (int64_t h = h0; h < h1; ++h) {
      const auto [k, v] = head_planes(g, cache, run, h, rows, plane_stride);
      const int64_t next = h + 1 < h1 ? 2 * g.bs * g.dim : 0;
      move_avx512<T, kGather, kStream>(kAmx, g, k, 0, next);
      move_avx512<T, kGather, kStream>(kAmx, g, v, 1, next);
    }
  } else {
    const int64_t bs = g.bs, D = g.dim, W = g.width, Dp = D / 2, o0 = run.first, o1 = run.first + run.len;
    const int64_t head_stride = 2 * bs * D;  // elements from one head's (block, head) region to the next one's
    uint16_t* k_region = reinterpret_cast<uint16_t*>(cache) + (run.block * g.heads + h0) * head_stride;
    uint16_t* v_region = k_region + bs * D;
    uint16_t* k_rows = reinterpret_cast<uint16_t*>(rows) + h0 * D;  // chunk row o0, head h0, K plane
    uint16_t* v_rows = k_rows + plane_stride;
    auto row = [&](uint16_t* base, int64_t o) { return base + (o - o0) * W; };
    const int64_t span = (h1 - h0) * D * 2;  // bytes of the heads' columns in one chunk row
    for (int64_t w = o0 / 16 * 16; w < o1; w += 16) {  // K
      const int lo = static_cast<int>(std::max(o0, w) - w), hi = static_cast<int>(std::min(o1, w + 16) - w);
      if (w + 16 < o1)  // the next window's rows
        for (int64_t r = w + 16; r < std::min(o1, w + 32); ++r) k5::prefetch_l2(row(k_rows, r), span);
      for (int64_t h = 0; h < h1 - h0; ++h) {
        uint32_t* pairs = reinterpret_cast<uint32_t*>(k_region + h * head_stride) + (w / 16) * Dp * 16;
        uint32_t* src = reinterpret_cast<uint32_t*>(row(k_rows, w + lo) + h * D);
        for (int64_t k = 0; k < Dp; k += 16) {
          if (lo == 0 && hi == 16) k5::transpose16x16_u32<kStream>(src + k, W / 2, pairs + k * 16, 16);
          else k5::transpose16x16_u32<false, k5::kRowsIn>(src + k, W / 2, pairs + k * 16, 16, lo, hi);
        }
      }
    }
    const int64_t a = std::min(o1, (o0 + 1) / 2 * 2), b = std::max(a, o1 / 2 * 2);
    auto v_pair = [&](int64_t o, int first, int count) {  // tokens o + first .. of the pair at o (o even)
      for (int64_t h = 0; h < h1 - h0; ++h)
        for (int64_t i = 0; i < D / 16; i += 2) {
          uint16_t* line = v_region + h * head_stride + (i * (bs / 2) + o / 2) * 32;
          uint16_t* r0 = row(v_rows, o + first) + h * D + i * 16;
          if (count == 2) k5::amx_v_lines<false, kStream>(line, line + (bs / 2) * 32, r0, r0 + W);
          else k5::amx_v_lines_one<false>(line, line + (bs / 2) * 32, r0, first == 1);
        }
    };
    if (o0 < a) v_pair(o0 - 1, 1, 1);
    for (int64_t o = a; o < b; o += 2) {
      if (o + 4 < b) {
        k5::prefetch_l2(row(v_rows, o + 4), span);
        k5::prefetch_l2(row(v_rows, o + 5), span);
      }
      v_pair(o, 0, 2);
    }
    if (b < o1) v_pair(b, 0, 1);
  }
}
#endif

// One task: both planes of heads [h0, h1) of one run (vec/amx). `planes`: plane tasks (move_vec_planes_avx512,
// move_amx_planes_avx512; AVX2: gather_vec_lines_avx2).
template <typename T, bool kGather>
void move_run_heads(Isa isa, bool stream, bool planes, int64_t layout, const Geometry& g, T* cache,
                    const Segment& run, int64_t h0, int64_t h1, T* rows, int64_t plane_stride) {
#if defined(LMCACHE_HAVE_AVX2)
  if (isa == kAvx2 && avx2_takes<T>(layout, g)) {
    if (kGather && planes && lmcache_avx2::lines_fit<T>(g.bs, g.dim)) {
      if (stream) gather_vec_lines_avx2<T, true>(g, cache, run, h0, h1, rows, plane_stride);
      else gather_vec_lines_avx2<T, false>(g, cache, run, h0, h1, rows, plane_stride);
      return;
    }
    if (stream) move_vec_avx2<T, kGather, true>(g, cache, run, h0, h1, rows, plane_stride);
    else move_vec_avx2<T, kGather, false>(g, cache, run, h0, h1, rows, plane_stride);
    return;
  }
#endif
#if defined(LMCACHE_HAVE_AVX512)
  if (isa == kAvx512 && planes && layout == kVec) {
    if (stream) move_vec_planes_avx512<T, kGather, true>(g, cache, run, h0, h1, rows, plane_stride);
    else move_vec_planes_avx512<T, kGather, false>(g, cache, run, h0, h1, rows, plane_stride);
    return;
  }
  if (isa == kAvx512 && planes && layout == kAmx && avx512_tiles<T>(layout, g)) {
    if (stream) move_amx_planes_avx512<T, kGather, true>(g, cache, run, h0, h1, rows, plane_stride);
    else move_amx_planes_avx512<T, kGather, false>(g, cache, run, h0, h1, rows, plane_stride);
    return;
  }
#endif
  for (int64_t h = h0; h < h1; ++h) {
    const auto halves = head_planes(g, cache, run, h, rows, plane_stride);
    for (int64_t plane = 0; plane < g.planes; ++plane) {
      const HeadPlane<T>& x = plane == 0 ? halves.first : halves.second;
#if defined(LMCACHE_HAVE_AVX512)
      if (isa == kAvx512) {
        if (stream) move_avx512<T, kGather, true>(layout, g, x, plane);
        else move_avx512<T, kGather, false>(layout, g, x, plane);
        continue;
      }
#endif
      move_portable<T, kGather>(isa, layout, g, x, plane, x.o0, x.o1);
    }
  }
}

// Calls fn(begin, end) over [0, n) in pieces of `grain`, handed out one by one to ATen's threads; `done` runs
// once per thread after its last piece.
template <typename F, typename G>
void parallel_items(int64_t n, int64_t grain, const F& fn, const G& done) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(grain, std::memory_order_relaxed)) < n;) fn(i, std::min(n, i + grain));
    done();
  });
}

// One stored chunk of a call: its data and the part of the call's slot mapping it holds ([first, first + n)).
template <typename T>
struct ChunkPart {
  T* base;
  int64_t first, n;
};

// A run of one chunk (vec/amx): where its rows start in layer 0 and the chunk's layer and plane strides.
template <typename T>
struct Piece {
  T* rows;  // layer 0, plane 0, the chunk row of seg.pos
  int64_t layer_stride, plane_stride;
  Segment seg;
};

// A token moved one row at a time: the chunk row (layer 0, plane 0), its slot, the chunk's strides.
template <typename T>
struct TokenRow {
  T* row;
  int64_t slot, layer_stride, plane_stride;
};

template <typename T, bool kGather>
void run(Isa isa, int64_t layout, const Geometry& g, const std::vector<T*>& caches, const std::vector<ChunkPart<T>>& parts,
         const int64_t* slots, Tasks tasks) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  const int64_t heads = g.heads;
  // Non-temporal stores when every line the kernels write is 64-byte aligned: the chunk side (gather) or the
  // cache side (scatter; whole-line tiles start at block offsets that are multiples of 32) is written with
  // no read for ownership. Measured ~1.4x faster gather and scatter than cached stores here (bench_ops.py).
  // AVX2 (vec): 32-byte alignment of every written piece is enough; measured ~1.3x on AMD Zen 3 (cpu_ops_avx2.h).
  const bool avx2 = isa == kAvx2 && avx2_takes<T>(layout, g);
  const uintptr_t line = avx2 ? 32 : 64;
  bool aligned = true;
  for (const auto& p : parts) aligned = aligned && reinterpret_cast<uintptr_t>(p.base) % line == 0;
  for (T* c : caches) aligned = aligned && reinterpret_cast<uintptr_t>(c) % 64 == 0;
  const bool stream = aligned && (g.width * sizeof(T)) % line == 0 &&
                      ((isa == kAvx512 && (g.dim * sizeof(T)) % 64 == 0 && g.bs % 32 == 0 &&
                        (layout == kVec || layout == kAmx)) ||
                       (avx2 && (g.bs * sizeof(T)) % 32 == 0));
  // Tasks: (layer, 32-token strip of a run); a task walks every head, so the chunk rows of the strip (one
  // contiguous stretch per plane) are read or written front to back while the cache side is whole lines.
  // The AVX2 gather instead takes (layer, run, head): it reads the head's K^T front to back and writes each
  // chunk row's head segment at once (measured faster than strips on Zen 3).
  // Plane tasks (current_tasks()): a task is a whole run; AVX-512 moves it head by head, each head's source
  // prefetched while the previous head moves; AVX2 gathers it so (whole-line K^T tiles) and scatters it with the
  // strip kernels. The runs of every chunk of the call are tasks of one pool.
  const bool planes = ((isa == kAvx512 && (layout == kVec || (layout == kAmx && avx512_tiles<T>(layout, g)))) ||
                       avx2) && tasks == kPlaneTasks;
  const bool per_head = avx2 && kGather && heads > 1 && !planes;
  const int64_t min_run = isa == kAvx512 && avx512_tiles<T>(layout, g) ? kMinTileRun : kMinRun;
  std::vector<Piece<T>> pieces;
  std::vector<TokenRow<T>> tokens;
  for (const auto& part : parts) {
    const int64_t plane_stride = part.n * g.width, layer_stride = g.planes * plane_stride;
    const int64_t* s = slots + part.first;
    const Plan plan = make_plan(s, part.n, g.bs, min_run);
    for (const Segment& r : plan.runs)
      for (int64_t s0 = r.first; s0 < r.first + r.len;) {
        const int64_t s1 = heads > 1 && !per_head && !planes ? std::min(r.first + r.len, (s0 / kStrip + 1) * kStrip)
                                                             : r.first + r.len;
        const Segment seg{r.pos + (s0 - r.first), r.block, s0, s1 - s0};
        pieces.push_back({part.base + seg.pos * g.width, layer_stride, plane_stride, seg});
        s0 = s1;
      }
    for (int64_t pos : plan.tokens) tokens.push_back({part.base + pos * g.width, s[pos], layer_stride, plane_stride});
  }
  const int64_t np = static_cast<int64_t>(pieces.size()), head_tasks = per_head ? heads : 1;
  parallel_items(layers * np * head_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / (np * head_tasks);
      const Piece<T>& piece = pieces[item / head_tasks % np];
      T* rows = piece.rows + layer * piece.layer_stride;
      const int64_t h0 = per_head ? item % head_tasks : 0;
      move_run_heads<T, kGather>(isa, stream, planes, layout, g, caches[layer], piece.seg, h0,
                                 per_head ? h0 + 1 : heads, rows, piece.plane_stride);
    }
  }, [&] {
#if defined(__SSE2__)
    if (stream) _mm_sfence();  // this thread's non-temporal stores are visible before the call returns
#endif
  });
  const int64_t ntok = static_cast<int64_t>(tokens.size());
  if (ntok) {
    parallel_items(layers * ntok, 16, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t layer = item / ntok;
        const TokenRow<T>& t = tokens[item % ntok];
        for (int64_t plane = 0; plane < g.planes; ++plane) {
          T* row = t.row + layer * t.layer_stride + plane * t.plane_stride;
          T* cache = caches[layer];
          for (int64_t h = 0; h < g.heads; ++h)
            move_token_head<T, kGather>(layout, g, cache + element_offset(layout, g, plane, t.slot, h, 0), plane,
                                        row + h * g.dim);
        }
      }
    }, [] {});
  }
}

// The task shape for a call (see Tasks): auto is decided by measure_tasks at the first call that needs it.
template <typename T>
Tasks measure_tasks(Isa isa, int64_t layout, const Geometry& call);

template <typename T>
Tasks resolve_tasks(Isa isa, int64_t layout, const Geometry& g) {
  const Tasks tasks = current_tasks();
  const bool shaped = (isa == kAvx512 && (layout == kVec || (layout == kAmx && avx512_tiles<T>(layout, g)))) ||
                      (isa == kAvx2 && avx2_takes<T>(layout, g));
  if (tasks != kAutoTasks || !shaped) return tasks == kAutoTasks ? kStripTasks : tasks;
  return measure_tasks<T>(isa, layout, g);
}

// Seconds on the clock measure_tasks uses: the calling thread's CPU time when the op runs on that thread alone (time
// the OS gives other processes is not counted: on a busy host a preemption inside one round flipped the choice),
// else the wall clock (the work is spread over a team of threads).
double task_clock(bool one_thread) {
  if (one_thread) {
    timespec ts{};
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Times a gather and a scatter of whole blocks in each shape on scratch caches and a chunk of the call's geometry
// (4 layers, ~24 MiB each side: beyond the caches of most CPUs, so the memory's latency shows as in real loads),
// the best of five interleaved rounds each (`task_clock`), and keeps the faster for the process.
template <typename T>
Tasks measure_tasks(Isa isa, int64_t layout, const Geometry& call) {
  std::lock_guard<std::mutex> lock(g_tasks_mutex);
  if (g_tasks.load() != kAutoTasks) return static_cast<Tasks>(g_tasks.load());  // decided meanwhile
  Geometry g = call;
  constexpr int64_t kLayers = 4, kTarget = int64_t{24} << 20;
  const int64_t block_bytes = 2 * g.bs * g.width * static_cast<int64_t>(sizeof(T));  // one block of one layer
  g.blocks = std::max<int64_t>(2, kTarget / (kLayers * block_bytes));
  const int64_t elems = g.blocks * 2 * g.bs * g.width, tokens = g.blocks * g.bs;
  const auto dtype = sizeof(T) == 2 ? torch::kInt16 : torch::kInt32;  // avx512_tiles: 2- or 4-byte elements
  std::vector<torch::Tensor> keep;
  std::vector<T*> caches;
  for (int64_t l = 0; l < kLayers; ++l) {
    keep.push_back(torch::zeros({elems}, dtype));
    caches.push_back(static_cast<T*>(keep.back().data_ptr()));
  }
  torch::Tensor chunk = torch::zeros({kLayers * elems}, dtype);
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  std::iota(slots.begin(), slots.end(), int64_t{0});
  const std::vector<ChunkPart<T>> parts{{static_cast<T*>(chunk.data_ptr()), 0, tokens}};
  double best[2] = {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  const bool one_thread = at::get_num_threads() == 1;
  for (int round = 0; round < 5; ++round)
    for (const Tasks shape : {kStripTasks, kPlaneTasks}) {
      const double t0 = task_clock(one_thread);
      run<T, true>(isa, layout, g, caches, parts, slots.data(), shape);
      run<T, false>(isa, layout, g, caches, parts, slots.data(), shape);
      best[shape] = std::min(best[shape], task_clock(one_thread) - t0);
    }
  const Tasks chosen = best[kPlaneTasks] < best[kStripTasks] ? kPlaneTasks : kStripTasks;
  g_tasks_note = std::string("measured with the ") + kIsaNames[isa] + " kernels on " + (layout == kVec ? "vec" : "amx") +
                 " blocks of " +
                 std::to_string(g.heads) + " heads x " + std::to_string(g.dim) + ", " +
                 std::to_string(g.blocks * block_bytes * kLayers >> 20) + " MiB: strip " +
                 std::to_string(best[kStripTasks] * 1e3) + " ms, plane " + std::to_string(best[kPlaneTasks] * 1e3) +
                 " ms (gather + scatter, " + (one_thread ? "thread CPU time" : "wall time") + ", best of 5)";
  g_tasks.store(chosen);
  return chosen;
}

// ---- strided views ----------------------------------------------------------------------------------------
struct Strided {
  int64_t blocks, bs, heads, dim, planes, width;  // dim = D (elements per piece), width = heads * D
  int64_t s_block, s_head, s_token;               // element strides of the [B, H, N, C] view
};

// Tasks: (layer, strip of kStrip tokens of one chunk); per token every plane and head is one piece of D elements.
template <typename T, bool kGather>
void run_strided(const Strided& g, const std::vector<T*>& caches, const std::vector<ChunkPart<T>>& parts,
                 const int64_t* slots) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  struct Strip {
    int64_t part, t0, t1;
  };
  std::vector<Strip> strips;
  for (int64_t p = 0; p < static_cast<int64_t>(parts.size()); ++p)
    for (int64_t t0 = 0; t0 < parts[p].n; t0 += kStrip) strips.push_back({p, t0, std::min(parts[p].n, t0 + kStrip)});
  const int64_t ns = static_cast<int64_t>(strips.size());
  const size_t piece = static_cast<size_t>(g.dim) * sizeof(T);
  parallel_items(layers * ns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / ns;
      const Strip& strip = strips[item % ns];
      const ChunkPart<T>& part = parts[strip.part];
      const int64_t plane_stride = part.n * g.width;
      T* layer_chunk = part.base + layer * g.planes * plane_stride;
      for (int64_t t = strip.t0; t < strip.t1; ++t) {
        const int64_t slot = slots[part.first + t];
        if (slot < 0) continue;
        T* token = caches[layer] + (slot / g.bs) * g.s_block + (slot % g.bs) * g.s_token;
        for (int64_t p = 0; p < g.planes; ++p) {
          T* row = layer_chunk + p * plane_stride + t * g.width;
          for (int64_t h = 0; h < g.heads; ++h) {
            T* cell = token + h * g.s_head + p * g.dim;
            if (kGather) std::memcpy(row + h * g.dim, cell, piece);
            else std::memcpy(cell, row + h * g.dim, piece);
          }
        }
      }
    }
  }, [] {});
}

// ---- validation: everything is checked here, before any data is touched; nothing throws --------------------
template <typename... Parts>
std::string msg(const Parts&... parts) {
  return lmc_errors::message("_cpu_ops", parts...);
}

bool same_layout(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type() &&
         a.device() == b.device();
}

// The chunk and slot checks every layout shares: every chunk [layers, planes, T_i, width] like chunk 0 but for
// T_i, and the slot mapping as long as the chunks' tokens together (chunk i holds the next T_i slots).
std::string check_common(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                         const std::vector<torch::Tensor>& chunks) {
  if (caches.empty()) return msg("no KV caches given");
  if (chunks.empty()) return msg("no chunks given");
  for (size_t i = 0; i < caches.size(); ++i)
    if (!caches[i].defined() || !caches[i].device().is_cpu()) return msg("cache ", i, " must be a CPU tensor");
  if (!slots.defined() || slots.dim() != 1 || slots.scalar_type() != torch::kInt64 || !slots.is_contiguous() ||
      !slots.device().is_cpu())
    return msg("slot_mapping must be a contiguous 1-D int64 CPU tensor");
  int64_t tokens = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const torch::Tensor& c = chunks[i];
    if (!c.defined() || c.dim() != 4 || !c.is_contiguous() || !c.device().is_cpu())
      return msg("chunk ", i, " must be a contiguous CPU tensor [layers, planes, T, width]");
    if (c.size(0) != static_cast<int64_t>(caches.size()) || c.size(1) != chunks[0].size(1) ||
        c.size(3) != chunks[0].size(3))
      return msg("chunk ", i, " ", c.sizes(), " does not match ", caches.size(), " layers and chunk 0 ", chunks[0].sizes());
    if (c.scalar_type() != caches[0].scalar_type())
      return msg("chunk ", i, " dtype ", c.scalar_type(), " differs from the caches' dtype ", caches[0].scalar_type());
    tokens += c.size(2);
  }
  if (tokens != slots.size(0))
    return msg("chunks of ", tokens, " tokens in all: that does not match ", slots.size(0), " slots");
  const int64_t item = chunks[0].element_size();
  if (item != 1 && item != 2 && item != 4 && item != 8) return msg("unsupported element size ", item);
  return "";
}

std::string check_slots(const torch::Tensor& slots, int64_t limit) {
  const int64_t* s = static_cast<const int64_t*>(slots.data_ptr());
  for (int64_t i = 0; i < slots.size(0); ++i)
    if (s[i] >= limit) return msg("slot ", s[i], " beyond the cache's ", limit, " slots");
  return "";
}

std::string check_packed(const std::vector<torch::Tensor>& caches, const torch::Tensor& chunk, int64_t layout,
                         int64_t block_size, Geometry& g) {
  const auto& c0 = caches[0];
  if (c0.dim() != 4 || c0.size(2) != block_size || c0.size(3) % 2)
    return msg("cpu cache must be [blocks, heads, ", block_size, ", 2*D], got ", c0.sizes());
  g = {c0.size(0), block_size, c0.size(1), c0.size(3) / 2, 2, c0.size(1) * (c0.size(3) / 2)};
  if (layout == kAmx && (c0.element_size() != 2 || block_size % 16 || g.dim % 16))
    return msg("amx needs a 2-byte dtype and block/head sizes that are multiples of 16");
  if (chunk.size(1) != g.planes || chunk.size(3) != g.width)
    return msg("chunk ", chunk.sizes(), " does not fit planes=", g.planes, " width=", g.width);
  for (size_t i = 0; i < caches.size(); ++i)
    if (!same_layout(caches[i], c0) || !caches[i].is_contiguous())
      return msg("cache ", i, " must be a contiguous tensor ", c0.sizes(), " like cache 0");
  return "";
}

std::string check_strided(const std::vector<torch::Tensor>& caches, const torch::Tensor& chunk, int64_t block_size,
                          Strided& g) {
  const auto& c0 = caches[0];
  if (c0.dim() != 4 || c0.size(2) != block_size)
    return msg("strided cache must be a [blocks, heads, ", block_size, ", C] view, got ", c0.sizes());
  if (c0.size(3) > 1 && c0.stride(3) != 1) return msg("the last dim of a strided cache must be contiguous, strides ",
                                                      c0.strides());
  const int64_t planes = chunk.size(1), heads = c0.size(1);
  if ((planes != 1 && planes != 2) || c0.size(3) % planes || chunk.size(3) != heads * (c0.size(3) / planes))
    return msg("chunk ", chunk.sizes(), " does not fit a [", c0.size(0), ", ", heads, ", ", block_size, ", ", c0.size(3),
               "] cache (planes 1 or 2, width heads * C / planes)");
  for (size_t i = 0; i < caches.size(); ++i)
    if (!same_layout(caches[i], c0)) return msg("cache ", i, " must have cache 0's sizes, strides and dtype");
  g = {c0.size(0), block_size, heads, c0.size(3) / planes, planes, chunk.size(3), c0.stride(0), c0.stride(1),
       c0.stride(2)};
  return "";
}

template <bool kGather>
std::string dispatch(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                     const std::vector<torch::Tensor>& chunks, int64_t layout, int64_t block_size) {
  if (layout != kVec && layout != kAmx && layout != kStrided) return msg("unknown layout code ", layout);
  std::string error = check_common(caches, slots, chunks);
  if (!error.empty()) return error;
  Geometry g{};
  Strided sg{};
  error = layout == kStrided ? check_strided(caches, chunks[0], block_size, sg)
                             : check_packed(caches, chunks[0], layout, block_size, g);
  if (!error.empty()) return error;
  error = check_slots(slots, layout == kStrided ? sg.blocks * sg.bs : g.blocks * g.bs);
  if (!error.empty()) return error;

  const int64_t* s = static_cast<const int64_t*>(slots.data_ptr());
  auto go = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T*> ptrs;
    for (const auto& c : caches) ptrs.push_back(static_cast<T*>(c.data_ptr()));
    std::vector<ChunkPart<T>> parts;
    int64_t first = 0;
    for (const auto& c : chunks) {
      parts.push_back({static_cast<T*>(c.data_ptr()), first, c.size(2)});
      first += c.size(2);
    }
    if (layout == kStrided) run_strided<T, kGather>(sg, ptrs, parts, s);
    else {
      const Isa isa = current_isa();
      run<T, kGather>(isa, layout, g, ptrs, parts, s, resolve_tasks<T>(isa, layout, g));
    }
  };
  switch (chunks[0].element_size()) {
    case 1: go(uint8_t{}); break;
    case 2: go(uint16_t{}); break;
    case 4: go(uint32_t{}); break;
    default: go(uint64_t{}); break;
  }
  return "";
}

// The bindings: nothing escapes as a C++ exception (an allocation failure in the plan is reported too).
std::string gather(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, torch::Tensor out,
                   int64_t layout, int64_t block_size) {
  return lmc_errors::no_throw("_cpu_ops", [&] { return dispatch<true>(caches, slots, {out}, layout, block_size); });
}

std::string scatter(const torch::Tensor& chunk, const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                    int64_t layout, int64_t block_size) {
  return lmc_errors::no_throw("_cpu_ops", [&] { return dispatch<false>(caches, slots, {chunk}, layout, block_size); });
}

std::string gather_chunks(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                          const std::vector<torch::Tensor>& outs, int64_t layout, int64_t block_size) {
  return lmc_errors::no_throw("_cpu_ops", [&] { return dispatch<true>(caches, slots, outs, layout, block_size); });
}

std::string scatter_chunks(const std::vector<torch::Tensor>& chunks, const std::vector<torch::Tensor>& caches,
                           const torch::Tensor& slots, int64_t layout, int64_t block_size) {
  return lmc_errors::no_throw("_cpu_ops", [&] { return dispatch<false>(caches, slots, chunks, layout, block_size); });
}

// Layers [first, first + count) of a call with every layer's caches and whole chunks [layers, ...]: a layerwise
// load or save makes one such call per layer without building per-layer views in Python (where each view is a
// trip through the GIL, which vLLM's forward, running beside a load, waits for).
template <bool kGather>
std::string dispatch_layers(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                            const std::vector<torch::Tensor>& chunks, int64_t layout, int64_t block_size,
                            int64_t first, int64_t count) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  if (first < 0 || count < 1 || first > layers - count)
    return msg("layers [", first, ", ", first + count, ") out of range [0, ", layers, ")");
  std::vector<torch::Tensor> part_caches(caches.begin() + first, caches.begin() + first + count), part_chunks;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const torch::Tensor& c = chunks[i];
    if (!c.defined() || c.dim() != 4 || c.size(0) != layers)
      return msg("chunk ", i, " must be [", layers, ", planes, T, width]");
    part_chunks.push_back(c.narrow(0, first, count));  // the leading dim: still contiguous
  }
  return dispatch<kGather>(part_caches, slots, part_chunks, layout, block_size);
}

std::string gather_layers(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                          const std::vector<torch::Tensor>& outs, int64_t layout, int64_t block_size, int64_t first,
                          int64_t count) {
  return lmc_errors::no_throw("_cpu_ops", [&] {
    return dispatch_layers<true>(caches, slots, outs, layout, block_size, first, count);
  });
}

std::string scatter_layers(const std::vector<torch::Tensor>& chunks, const std::vector<torch::Tensor>& caches,
                           const torch::Tensor& slots, int64_t layout, int64_t block_size, int64_t first,
                           int64_t count) {
  return lmc_errors::no_throw("_cpu_ops", [&] {
    return dispatch_layers<false>(caches, slots, chunks, layout, block_size, first, count);
  });
}

// Raises a c10::Error on purpose: run in a child process, it tells whether C++ exceptions from this extension
// reach Python on this toolchain (tests/test_ops.py, scripts/check_cuda.sh).
void throw_for_diagnosis() { TORCH_CHECK(false, "_cpu_ops: diagnostic exception"); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-layer paged KV gather/scatter by slot mapping (CPU)";
  m.def("gather", &gather, "paged caches -> chunk [L, planes, T, width]; returns '' or an error message",
        py::arg("caches"), py::arg("slots"), py::arg("out"), py::arg("layout"), py::arg("block_size"),
        py::call_guard<py::gil_scoped_release>());
  m.def("scatter", &scatter, "chunk [L, planes, T, width] -> paged caches; returns '' or an error message",
        py::arg("chunk"), py::arg("caches"), py::arg("slots"), py::arg("layout"), py::arg("block_size"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gather_chunks", &gather_chunks, "paged caches -> chunks [L, planes, T_i, width], chunk i taking the next "
        "T_i slots; returns '' or an error message", py::arg("caches"), py::arg("slots"), py::arg("outs"),
        py::arg("layout"), py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.def("scatter_chunks", &scatter_chunks, "chunks [L, planes, T_i, width] -> paged caches, chunk i holding the "
        "next T_i slots; returns '' or an error message", py::arg("chunks"), py::arg("caches"), py::arg("slots"),
        py::arg("layout"), py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.def("gather_layers", &gather_layers, "layers [first, first + count) of gather_chunks, from every layer's caches "
        "into whole chunks; returns '' or an error message", py::arg("caches"), py::arg("slots"), py::arg("outs"),
        py::arg("layout"), py::arg("block_size"), py::arg("first"), py::arg("count"),
        py::call_guard<py::gil_scoped_release>());
  m.def("scatter_layers", &scatter_layers, "layers [first, first + count) of scatter_chunks, from whole chunks into "
        "every layer's caches; returns '' or an error message", py::arg("chunks"), py::arg("caches"),
        py::arg("slots"), py::arg("layout"), py::arg("block_size"), py::arg("first"), py::arg("count"),
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(kIsaNames[current_isa()]); },
        "kernel set in use: avx512, avx2, sse2 or scalar");
  m.def("set_isa", &set_isa_checked, "use kernel set auto|avx512|avx2|sse2|scalar (tests and benchmarks); returns '' "
        "or why not", py::arg("name"));
  m.def("tasks", [] { return std::string(kTaskNames[current_tasks()]); },
        "how the AVX-512 vec and amx kernels split a call: strip, plane, or auto (measured at the first such call)");
  m.def("tasks_note", &tasks_note, "how the task shape was chosen: what auto measured, 'set', or '' (not yet)");
  m.def("set_tasks", &set_tasks_checked, "use task shape auto|strip|plane (tests and benchmarks); returns '' or why "
        "not", py::arg("name"));
  m.def("throw_for_diagnosis", &throw_for_diagnosis, "raises a C++ exception (toolchain check, run in a child)");
  m.attr("SUPPORTED_LAYOUTS") = py::make_tuple(int64_t{kVec}, int64_t{kAmx}, int64_t{kStrided});
  m.attr("ABI") = kAbi;
}
