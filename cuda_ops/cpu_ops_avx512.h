// AVX-512 (F + BW) tile kernels for cpu_ops.cpp, compiled with per-function target attributes so the
// extension needs no -march flag: cpu_ops.cpp calls them only after __builtin_cpu_supports says the CPU
// (and OS) has AVX-512F and AVX-512BW. Every tile moves whole 64-byte lines on both sides, so each cache
// line of the paged cache and of the chunk is read or written exactly once, at full width.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LMCACHE_HAVE_AVX512 1
#include <immintrin.h>

#include <cstdint>

#define LMCACHE_AVX512 __attribute__((target("avx512f,avx512bw")))

namespace lmcache_avx512 {

LMCACHE_AVX512 inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }
LMCACHE_AVX512 inline void store(void* p, __m512i v) { _mm512_storeu_si512(p, v); }
// kStream: non-temporal store of a whole 64-byte-aligned line (no read for ownership, no cache pollution).
template <bool kStream>
LMCACHE_AVX512 inline void put(void* p, __m512i v) {
  if (kStream) _mm512_stream_si512(static_cast<__m512i*>(p), v);
  else _mm512_storeu_si512(p, v);
}

// Transposes the 4x4 matrix of 128-bit lanes held in a, b, c, d (a.lane[1] <-> b.lane[0], ...).
LMCACHE_AVX512 inline void transpose_lanes(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  const __m512i u0 = _mm512_shuffle_i64x2(a, b, 0x44), u1 = _mm512_shuffle_i64x2(a, b, 0xEE);
  const __m512i u2 = _mm512_shuffle_i64x2(c, d, 0x44), u3 = _mm512_shuffle_i64x2(c, d, 0xEE);
  a = _mm512_shuffle_i64x2(u0, u2, 0x88);
  b = _mm512_shuffle_i64x2(u0, u2, 0xDD);
  c = _mm512_shuffle_i64x2(u1, u3, 0x88);
  d = _mm512_shuffle_i64x2(u1, u3, 0xDD);
}

// Which rows of a tile a transpose moves. kAllRows: a whole tile. kRowsOut: every source row is read, only
// destination rows [lo, hi) are written (a gather's tile that reaches past its run: the chunk rows of the
// tokens outside it are not this call's); `dst` is row lo. kRowsIn: only source rows [lo, hi) are read (the
// others count as zero), every destination row is written, but only its elements [lo, hi) (masked stores, no
// streaming): a scatter's tile that reaches past its run; `src` is row lo. The cache side of both is whole,
// 64-byte-aligned lines then, for every run however it starts and ends.
enum TileRows : int { kAllRows = 0, kRowsOut = 1, kRowsIn = 2 };

template <typename Lane>
LMCACHE_AVX512 inline Lane row_mask(int lo, int hi) {
  const uint64_t bits = (hi >= 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1);
  return static_cast<Lane>(bits);
}

// dst[c * ds + r] = src[r * ss + c] for a 32x32 tile of 16-bit elements (strides in elements), rows as kRows
// says. Each group of 8 rows is transposed as four 8x8 blocks inside the 128-bit lanes, then the lanes are
// regrouped.
template <bool kStream, int kRows = kAllRows>
LMCACHE_AVX512 inline void transpose32x32_u16(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds, int lo = 0,
                                              int hi = 32) {
  __m512i t[4][8];
  for (int g = 0; g < 4; ++g) {
    __m512i a[8], b[8], c[8];
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * g + i;
      if (kRows == kRowsIn) a[i] = r >= lo && r < hi ? load(src + (r - lo) * ss) : _mm512_setzero_si512();
      else a[i] = load(src + r * ss);
    }
    for (int i = 0; i < 4; ++i) {
      b[2 * i] = _mm512_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
      b[2 * i + 1] = _mm512_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      c[4 * i] = _mm512_unpacklo_epi32(b[4 * i], b[4 * i + 2]);
      c[4 * i + 1] = _mm512_unpackhi_epi32(b[4 * i], b[4 * i + 2]);
      c[4 * i + 2] = _mm512_unpacklo_epi32(b[4 * i + 1], b[4 * i + 3]);
      c[4 * i + 3] = _mm512_unpackhi_epi32(b[4 * i + 1], b[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {  // lane l of t[g][j] = column 8l + j of rows 8g..8g+7
      t[g][2 * i] = _mm512_unpacklo_epi64(c[i], c[i + 4]);
      t[g][2 * i + 1] = _mm512_unpackhi_epi64(c[i], c[i + 4]);
    }
  }
  const __mmask32 mask = kRows == kRowsIn ? row_mask<__mmask32>(lo, hi) : 0;
  for (int j = 0; j < 8; ++j) {
    transpose_lanes(t[0][j], t[1][j], t[2][j], t[3][j]);
    for (int l = 0; l < 4; ++l) {
      const int r = 8 * l + j;
      if (kRows == kRowsIn) _mm512_mask_storeu_epi16(dst + r * ds, mask, t[l][j]);
      else if (kRows == kRowsOut) { if (r >= lo && r < hi) put<kStream>(dst + (r - lo) * ds, t[l][j]); }
      else put<kStream>(dst + r * ds, t[l][j]);
    }
  }
}

// dst[c * ds + r] = src[r * ss + c] for a 16x16 tile of 32-bit elements, rows as kRows says.
template <bool kStream, int kRows = kAllRows>
LMCACHE_AVX512 inline void transpose16x16_u32(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds, int lo = 0,
                                              int hi = 16) {
  __m512i t[4][4];
  for (int g = 0; g < 4; ++g) {
    __m512i r[4];
    for (int i = 0; i < 4; ++i) {
      const int row = 4 * g + i;
      if (kRows == kRowsIn) r[i] = row >= lo && row < hi ? load(src + (row - lo) * ss) : _mm512_setzero_si512();
      else r[i] = load(src + row * ss);
    }
    const __m512i b0 = _mm512_unpacklo_epi32(r[0], r[1]), b1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i b2 = _mm512_unpacklo_epi32(r[2], r[3]), b3 = _mm512_unpackhi_epi32(r[2], r[3]);
    t[g][0] = _mm512_unpacklo_epi64(b0, b2);  // lane l of t[g][j] = column 4l + j of rows 4g..4g+3
    t[g][1] = _mm512_unpackhi_epi64(b0, b2);
    t[g][2] = _mm512_unpacklo_epi64(b1, b3);
    t[g][3] = _mm512_unpackhi_epi64(b1, b3);
  }
  const __mmask16 mask = kRows == kRowsIn ? row_mask<__mmask16>(lo, hi) : 0;
  for (int j = 0; j < 4; ++j) {
    transpose_lanes(t[0][j], t[1][j], t[2][j], t[3][j]);
    for (int l = 0; l < 4; ++l) {
      const int r = 4 * l + j;
      if (kRows == kRowsIn) _mm512_mask_storeu_epi32(dst + r * ds, mask, t[l][j]);
      else if (kRows == kRowsOut) { if (r >= lo && r < hi) put<kStream>(dst + (r - lo) * ds, t[l][j]); }
      else put<kStream>(dst + r * ds, t[l][j]);
    }
  }
}

// amx V: two neighbouring [16 d][2 tokens] lines (d groups i and i+1, same token pair) <-> 32 d of the
// pair's two token rows. kGather: lines -> rows, else rows -> lines.
struct AmxVIndex {
  alignas(64) uint16_t even[32], odd[32], lo[32], hi[32];
  AmxVIndex() {
    for (int m = 0; m < 32; ++m) {
      even[m] = static_cast<uint16_t>(m < 16 ? 2 * m : 32 + 2 * (m - 16));
      odd[m] = static_cast<uint16_t>(even[m] + 1);
      lo[m] = static_cast<uint16_t>((m % 2 ? 32 : 0) + m / 2);
      hi[m] = static_cast<uint16_t>(lo[m] + 16);
    }
  }
};

template <bool kGather, bool kStream>
LMCACHE_AVX512 inline void amx_v_lines(uint16_t* line0, uint16_t* line1, uint16_t* row0, uint16_t* row1) {
  static const AmxVIndex idx;
  if (kGather) {
    const __m512i a = load(line0), b = load(line1);
    put<kStream>(row0, _mm512_permutex2var_epi16(a, load(idx.even), b));
    put<kStream>(row1, _mm512_permutex2var_epi16(a, load(idx.odd), b));
  } else {
    const __m512i r0 = load(row0), r1 = load(row1);
    put<kStream>(line0, _mm512_permutex2var_epi16(r0, load(idx.lo), r1));
    put<kStream>(line1, _mm512_permutex2var_epi16(r0, load(idx.hi), r1));
  }
}

// amx_v_lines for one token of the pair only (`second`: token 1, else token 0): the gather writes that token's
// row alone, the scatter writes that token's elements of the two lines alone (masked stores).
template <bool kGather>
LMCACHE_AVX512 inline void amx_v_lines_one(uint16_t* line0, uint16_t* line1, uint16_t* row, bool second) {
  static const AmxVIndex idx;
  if (kGather) {
    const __m512i a = load(line0), b = load(line1);
    store(row, _mm512_permutex2var_epi16(a, load(second ? idx.odd : idx.even), b));
  } else {
    const __m512i r = load(row), z = _mm512_setzero_si512();
    const __m512i r0 = second ? z : r, r1 = second ? r : z;
    const __mmask32 mask = second ? 0xAAAAAAAAu : 0x55555555u;
    _mm512_mask_storeu_epi16(line0, mask, _mm512_permutex2var_epi16(r0, load(idx.lo), r1));
    _mm512_mask_storeu_epi16(line1, mask, _mm512_permutex2var_epi16(r0, load(idx.hi), r1));
  }
}

// Brings the lines of [p, p + bytes) towards L2 (not L1: the current tile's lines stay there).
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T1);
}

// Copies n bytes (a multiple of 64, both ends 64-byte aligned when kStream) in whole lines.
template <bool kStream>
LMCACHE_AVX512 inline void copy_lines(void* dst, const void* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) put<kStream>(static_cast<char*>(dst) + i, load(static_cast<const char*>(src) + i));
}

}  // namespace lmcache_avx512

#endif
