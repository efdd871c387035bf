// AVX2 kernels for cpu_ops.cpp (x86-64 CPUs without AVX-512, e.g. AMD Zen 2/3), compiled with per-function
// target attributes so the extension needs no -march flag: cpu_ops.cpp calls them only after
// __builtin_cpu_supports("avx2") said yes. Tiles are 32-byte rows: 16x16 (16-bit) and 8x8 (32-bit) transposes.
// What was measured on an AMD EPYC Zen 3 (2 cores, shared host; benchmarks/bench_ops.py and a standalone
// harness of the same loops, single thread, per-round ratios to a copy) and decided the shapes below:
//  - the gather's K^T -> chunk direction was slow because its chunk writes were 64-byte pieces 2 KiB apart
//    (one line of each token row per pass): staging a head's transposed K in a thread-local buffer and writing
//    each token row's whole head segment at once (as V is written) took it from ~0.8 to ~1.0 of a copy;
//  - non-temporal stores on the written side (no read for ownership) are worth ~1.3x on both directions;
//  - the scatter's reads of the chunk: head segments (256 bytes every 2 KiB) are slower than whole rows; V
//    moves row by row across the heads, and K prefetches the next head's segments while it transposes;
//  - software prefetch of the gather's next 16 K^T rows (the hardware prefetchers do not follow the tile order).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LMCACHE_HAVE_AVX2 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define LMCACHE_AVX2 __attribute__((target("avx2")))

namespace lmcache_avx2 {

// Bytes of the per-call staging buffer of `gather_kt` (on the stack): a head's transposed K for up to
// kStageBytes / (head_size * element size) tokens, so that each chunk row's head segment is written at once.
constexpr int64_t kStageBytes = 32768;

// Elements of one 32-byte tile row: 16 (2-byte types), 8 (4-byte types), 0 = no AVX2 kernel for this size.
template <typename T>
constexpr int64_t tile() {
  return sizeof(T) == 2 ? 16 : sizeof(T) == 4 ? 8 : 0;
}

LMCACHE_AVX2 inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
// kStream: non-temporal store of a 32-byte-aligned piece (no read for ownership, no cache pollution).
template <bool kStream>
LMCACHE_AVX2 inline void put(void* p, __m256i v) {
  if (kStream) _mm256_stream_si256(static_cast<__m256i*>(p), v);
  else _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}

// out[j] = column j of the 16x16 tile of 16-bit elements at src (row stride ss elements). The unpacks
// transpose the two 8x8 quarters inside each 128-bit lane; the lane permutes regroup them.
LMCACHE_AVX2 inline void transpose16x16_u16(const uint16_t* src, int64_t ss, __m256i out[16]) {
  __m256i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = load(src + i * ss);
  for (int i = 0; i < 8; ++i) {
    b[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    a[4 * g] = _mm256_unpacklo_epi32(b[4 * g], b[4 * g + 2]);
    a[4 * g + 1] = _mm256_unpackhi_epi32(b[4 * g], b[4 * g + 2]);
    a[4 * g + 2] = _mm256_unpacklo_epi32(b[4 * g + 1], b[4 * g + 3]);
    a[4 * g + 3] = _mm256_unpackhi_epi32(b[4 * g + 1], b[4 * g + 3]);
  }
  for (int h = 0; h < 2; ++h)  // b[8h + j]: lane 0 = column j, lane 1 = column 8 + j of rows 8h..8h+7
    for (int k = 0; k < 4; ++k) {
      b[8 * h + 2 * k] = _mm256_unpacklo_epi64(a[8 * h + k], a[8 * h + 4 + k]);
      b[8 * h + 2 * k + 1] = _mm256_unpackhi_epi64(a[8 * h + k], a[8 * h + 4 + k]);
    }
  for (int j = 0; j < 8; ++j) {
    out[j] = _mm256_permute2x128_si256(b[j], b[8 + j], 0x20);
    out[8 + j] = _mm256_permute2x128_si256(b[j], b[8 + j], 0x31);
  }
}

// out[j] = column j of the 8x8 tile of 32-bit elements at src.
LMCACHE_AVX2 inline void transpose8x8_u32(const uint32_t* src, int64_t ss, __m256i out[8]) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = load(src + i * ss);
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)  // a[4h + j]: lane 0 = column j, lane 1 = column 4 + j of rows 4h..4h+3
    for (int k = 0; k < 2; ++k) {
      a[4 * h + 2 * k] = _mm256_unpacklo_epi64(b[4 * h + k], b[4 * h + 2 + k]);
      a[4 * h + 2 * k + 1] = _mm256_unpackhi_epi64(b[4 * h + k], b[4 * h + 2 + k]);
    }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(a[j], a[4 + j], 0x20);
    out[4 + j] = _mm256_permute2x128_si256(a[j], a[4 + j], 0x31);
  }
}

// out[j] = column j of the tile<T>() x tile<T>() tile at src.
template <typename T>
LMCACHE_AVX2 inline void transpose_tile(const T* src, int64_t ss, __m256i* out) {
  if constexpr (sizeof(T) == 2) transpose16x16_u16(reinterpret_cast<const uint16_t*>(src), ss, out);
  else transpose8x8_u32(reinterpret_cast<const uint32_t*>(src), ss, out);
}

// Copies n bytes (a multiple of 32; 32-byte-aligned destination when kStream).
template <bool kStream>
LMCACHE_AVX2 inline void copy(void* dst, const void* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) put<kStream>(static_cast<char*>(dst) + i, load(static_cast<const char*>(src) + i));
}

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

// Gather of one head's K^T plane (vLLM CPU `vec`: element (d, o) at kt[d * bs + o]) for tokens [0, count)
// counted from kt's column 0, into chunk rows (token o at rows + o * W, d at column d). Moves the largest
// multiple of tile<T>() tokens and returns it; the caller moves the rest. Needs dim % tile<T>() == 0 and
// dim * tile<T>() * sizeof(T) <= kStageBytes; kStream needs 32-byte-aligned rows and dim * sizeof(T) % 32 == 0.
template <typename T, bool kStream>
LMCACHE_AVX2 int64_t gather_kt(const T* kt, int64_t bs, int64_t dim, int64_t count, T* rows, int64_t W) {
  constexpr int64_t n = tile<T>();
  alignas(64) T stage[kStageBytes / sizeof(T)];
  const int64_t moved = count / n * n;
  const int64_t group = std::max(n, kStageBytes / static_cast<int64_t>(sizeof(T)) / dim / n * n);
  for (int64_t g0 = 0; g0 < moved; g0 += group) {
    const int64_t g1 = std::min(moved, g0 + group), span = (g1 - g0) * static_cast<int64_t>(sizeof(T));
    for (int64_t d = 0; d < dim; d += n) {
      for (int64_t r = d + n; r < std::min(dim, d + 2 * n); ++r) prefetch(kt + r * bs + g0, span);
      for (int64_t o = g0; o < g1; o += n) {
        __m256i cols[16];
        transpose_tile<T>(kt + d * bs + o, bs, cols);
        for (int64_t j = 0; j < n; ++j) put<false>(stage + (o - g0 + j) * dim + d, cols[j]);
      }
    }
    for (int64_t o = g0; o < g1; ++o) copy<kStream>(rows + o * W, stage + (o - g0) * dim, dim * sizeof(T));
  }
  return moved;
}

// Brings the lines of [p, p + bytes) towards L2 (not L1: the current tile's lines stay there).
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T1);
}

// Gather of one head's K^T plane in whole 64-byte lines on both sides, tokens [o0, o1) of the block (kt: the
// plane, element (d, o) at kt[d * bs + o]; rows: the chunk row of token o0 at the head's column 0, row stride
// W). Steps of 2n tokens (one line of each K^T row, aligned to 2n in the block) x 2n d: four n x n tile
// transposes, then each chunk row gets its 2n d (one line) in two adjacent 32-byte stores, so each line of
// both sides is read or written once and at once (what the AVX-512 32x32 tiles do). A step reaching past the
// run reads its whole lines (inside the block) and writes only the run's rows. `next`: element distance to the
// next head's plane (0: none), whose lines of each step are prefetched into L2 meanwhile (the tile order is
// not one the hardware prefetchers follow). Needs dim % 2n == 0 and bs % 2n == 0 (`lines_fit`).
template <typename T>
constexpr bool lines_fit(int64_t bs, int64_t dim) {
  return tile<T>() > 0 && dim % (2 * tile<T>()) == 0 && bs % (2 * tile<T>()) == 0;
}

template <typename T, bool kStream>
LMCACHE_AVX2 void gather_kt_lines(const T* kt, int64_t bs, int64_t dim, int64_t o0, int64_t o1, T* rows, int64_t W,
                                  int64_t next) {
  constexpr int64_t n = tile<T>(), line = 2 * n;
  for (int64_t w = o0 / line * line; w < o1; w += line) {
    const int64_t lo = std::max(o0, w) - w, hi = std::min(o1, w + line) - w;
    for (int64_t d = 0; d < dim; d += line) {
      const T* src = kt + d * bs + w;
      if (next)
        for (int64_t r = 0; r < line; ++r) prefetch_l2(src + next + r * bs, 64);
      for (int64_t half = 0; half < 2; ++half) {
        if (half * n >= hi || half * n + n <= lo) continue;
        __m256i a[16], b[16];
        transpose_tile<T>(src + half * n, bs, a);          // d .. d + n - 1 of tokens w + half n ..
        transpose_tile<T>(src + n * bs + half * n, bs, b);  // d + n .. d + 2n - 1
        const int64_t j0 = std::max<int64_t>(0, lo - half * n), j1 = std::min<int64_t>(n, hi - half * n);
        for (int64_t j = j0; j < j1; ++j) {
          T* row = rows + (w + half * n + j - o0) * W + d;
          put<kStream>(row, a[j]);
          put<kStream>(row + n, b[j]);
        }
      }
    }
  }
}

// Scatter into one head's K^T plane: chunk rows (token o at rows + o * W) -> kt[d * bs + o] for tokens
// [0, count), count a multiple of 2 * tile<T>(): each step writes tile<T>() K^T rows x 64 bytes (whole lines
// when kt is 64-byte aligned; kStream needs that). Needs dim % tile<T>() == 0. Meanwhile prefetches dim
// elements of each of the rows [0, count) at `next` (row stride W): what is read next.
template <typename T, bool kStream>
LMCACHE_AVX2 void scatter_kt(const T* rows, int64_t W, T* kt, int64_t bs, int64_t dim, int64_t count, const T* next) {
  constexpr int64_t n = tile<T>();
  const int64_t groups = dim / n, per_group = (count + groups - 1) / groups;
  for (int64_t d = 0; d < dim; d += n) {
    for (int64_t r = d / n * per_group; r < std::min(count, (d / n + 1) * per_group); ++r)
      prefetch(next + r * W, dim * static_cast<int64_t>(sizeof(T)));
    for (int64_t o = 0; o < count; o += 2 * n) {
      __m256i lo[16], hi[16];
      transpose_tile<T>(rows + o * W + d, W, lo);
      transpose_tile<T>(rows + (o + n) * W + d, W, hi);
      for (int64_t j = 0; j < n; ++j) {
        put<kStream>(kt + (d + j) * bs + o, lo[j]);
        put<kStream>(kt + (d + j) * bs + o + n, hi[j]);
      }
    }
  }
}

// One head's V plane (token o's dim elements at v + o * dim) -> chunk rows, tokens [0, count), prefetching
// 16 tokens ahead. dim * sizeof(T) must be a multiple of 32.
template <typename T, bool kStream>
LMCACHE_AVX2 void gather_v(const T* v, int64_t dim, T* rows, int64_t W, int64_t count) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < count; ++o) {
    prefetch(v + (o + 16) * dim, bytes);
    copy<kStream>(rows + o * W, v + o * dim, bytes);
  }
}

// Chunk rows -> the V planes of `heads` heads (head i's at v + i * head_stride), token row by token row so
// that the chunk is read front to back. dim * sizeof(T) must be a multiple of 32.
template <typename T, bool kStream>
LMCACHE_AVX2 void scatter_v(const T* rows, int64_t W, T* v, int64_t head_stride, int64_t heads, int64_t dim,
                            int64_t count) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < count; ++o)
    for (int64_t i = 0; i < heads; ++i) copy<kStream>(v + i * head_stride + o * dim, rows + o * W + i * dim, bytes);
}

}  // namespace lmcache_avx2

#endif
