// Multi-layer gather (paged KV cache -> chunk) and scatter (chunk -> paged KV cache) by slot mapping over
// vLLM's strided [B, H, N, C] layer views (paged_copy.h). One launch moves every layer: blockIdx.y is
// (layer, plane), the layer's base address read from a device array of per-layer pointers; the threads of
// the grid stride over the plane's (token, head, unit) cells, consecutive threads on consecutive units of
// a head's piece (coalesced on both sides: a piece is head_size elements, 128-1152 bytes). Each thread keeps
// kUnroll units of 16 bytes (when every address and stride allows) in flight: loads first, then stores.
// The chunk may be the device alias of pinned host memory: the kernel then reads / writes host memory over
// PCIe itself, with no staging buffer and no copy-engine call.
//
// The same source is also compiled for the host by g++ (cuda_ops/host_emulation.h, run by `make check-cuda`
// and tests/test_cuda_host.py against the layouts' torch path): the three macros below are its only hooks.
// nvcc never sees them set, so the GPU build is what they default to.
#include "paged_copy.h"

#include <stdio.h>

#ifndef LMC_LAUNCH  // kernel<<<grid, block, 0, stream>>>(args); the host emulation walks the grid instead
#define LMC_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<grid, block, 0, stream>>>
#endif
#ifndef LMC_MAX_BLOCKS_X  // the host emulation also builds with a tiny grid, so the grid-stride loop runs
#define LMC_MAX_BLOCKS_X 4096u
#endif
#ifndef LMC_KERNEL_SLOT  // the host emulation builds a deliberately wrong variant through this (tests only)
#define LMC_KERNEL_SLOT(slot) (slot)
#endif

namespace {

thread_local char g_error[256] = "";

int fail(const char* what) {
  snprintf(g_error, sizeof(g_error), "%s", what);
  return -1;
}

int cuda_fail(cudaError_t err, const char* where) {
  snprintf(g_error, sizeof(g_error), "%s: %s", where, cudaGetErrorString(err));
  return static_cast<int>(err);
}

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr unsigned kMaxBlocksX = LMC_MAX_BLOCKS_X;  // fills any current GPU; the grid strides over the rest

template <typename Vec, bool kGather>
__global__ void __launch_bounds__(kThreads) paged_copy_kernel(lmc_paged_args a, uint32_t units_per_piece) {
  const int64_t layer = blockIdx.y / a.planes, plane = blockIdx.y % a.planes;
  const char* base = reinterpret_cast<const char*>(a.layer_ptrs ? a.layer_ptrs[layer] : a.single_layer);
  const uint32_t per_token = static_cast<uint32_t>(a.heads) * units_per_piece;
  const uint32_t total = static_cast<uint32_t>(a.num_tokens) * per_token;  // < 2^31: checked by the host
  Vec* chunk = reinterpret_cast<Vec*>(a.chunk) + static_cast<int64_t>(blockIdx.y) * total;
  const uint32_t step = gridDim.x * blockDim.x;
  for (uint32_t first = blockIdx.x * blockDim.x + threadIdx.x; first < total; first += step * kUnroll) {
    Vec value[kUnroll];
    Vec* target[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      target[k] = nullptr;
      const uint32_t i = first + k * step;
      if (i >= total) continue;
      const uint32_t token = i / per_token, rest = i - token * per_token;
      const uint32_t head = rest / units_per_piece, unit = rest - head * units_per_piece;
      const int64_t slot = LMC_KERNEL_SLOT(a.slots[token]);
      if (slot < 0) continue;  // no slot: the token keeps its KV
      if (slot >= a.num_slots) {  // never copied, and reported (any one of several racing stores is)
        if (a.bad_slot) *a.bad_slot = slot;
        continue;
      }
      Vec* cell = const_cast<Vec*>(reinterpret_cast<const Vec*>(
                      base + (slot / a.block_size) * a.stride_block + (slot % a.block_size) * a.stride_token +
                      head * a.stride_head + plane * a.piece_bytes)) + unit;
      if (kGather) { value[k] = *cell; target[k] = chunk + i; }
      else { value[k] = chunk[i]; target[k] = cell; }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (target[k]) *target[k] = value[k];
  }
}

int check(const lmc_paged_args* a) {
  if (!a) return fail("lmc_paged: null arguments");
  if (a->num_layers <= 0 || a->planes < 1 || a->planes > 2 || a->heads <= 0 || a->block_size <= 0 ||
      a->num_slots <= 0 || a->piece_bytes <= 0 || a->num_tokens < 0 || a->stride_block < 0 || a->stride_head < 0 ||
      a->stride_token < 0)
    return fail("lmc_paged: layers, planes (1 or 2), heads, block_size, num_slots, piece_bytes must be positive");
  if (!a->layer_ptrs && (!a->single_layer || a->num_layers != 1))
    return fail("lmc_paged: give layer_ptrs, or single_layer with num_layers == 1");
  if (a->num_tokens > 0 && (!a->slots || !a->chunk)) return fail("lmc_paged: null slots or chunk");
  if (a->num_layers * a->planes > 65535) return fail("lmc_paged: more than 65535 (layer, plane) pairs in one launch");
  if (a->num_tokens * a->heads * a->piece_bytes >= (int64_t{1} << 31))
    return fail("lmc_paged: more than 2^31 bytes per (layer, plane) in one launch");
  return 0;
}

template <bool kGather>
int launch(const lmc_paged_args* a, cudaStream_t stream) {
  if (int rc = check(a)) return rc;
  if (a->num_tokens == 0) return 0;
  const int unit = lmc_paged_unit_bytes(a);
  const uint32_t units = static_cast<uint32_t>(a->piece_bytes / unit);
  const uint64_t total = static_cast<uint64_t>(a->num_tokens) * a->heads * units;
  const uint64_t wanted = (total + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  dim3 grid(static_cast<unsigned>(wanted < kMaxBlocksX ? wanted : kMaxBlocksX),
            static_cast<unsigned>(a->num_layers * a->planes));
  switch (unit) {
    case 16: LMC_LAUNCH(grid, kThreads, stream, paged_copy_kernel<uint4, kGather>)(*a, units); break;
    case 8: LMC_LAUNCH(grid, kThreads, stream, paged_copy_kernel<uint2, kGather>)(*a, units); break;
    case 4: LMC_LAUNCH(grid, kThreads, stream, paged_copy_kernel<uint32_t, kGather>)(*a, units); break;
    case 2: LMC_LAUNCH(grid, kThreads, stream, paged_copy_kernel<uint16_t, kGather>)(*a, units); break;
    default: LMC_LAUNCH(grid, kThreads, stream, paged_copy_kernel<uint8_t, kGather>)(*a, units); break;
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : cuda_fail(err, "lmc_paged: kernel launch");
}

}  // namespace

extern "C" {

int lmc_paged_unit_bytes(const lmc_paged_args* a) {
  // Every address a unit is read from or written to is a sum of these: all must be multiples of the unit.
  const uint64_t bits = static_cast<uint64_t>(a->piece_bytes) | static_cast<uint64_t>(a->stride_block) |
                        static_cast<uint64_t>(a->stride_head) | static_cast<uint64_t>(a->stride_token) |
                        reinterpret_cast<uint64_t>(a->chunk) | (a->layer_ptrs ? a->bases_or : a->single_layer);
  for (int unit = 16; unit > 1; unit /= 2)
    if (bits % unit == 0) return unit;
  return 1;
}

int lmc_paged_gather(const lmc_paged_args* a, cudaStream_t stream) { return launch<true>(a, stream); }

int lmc_paged_scatter(const lmc_paged_args* a, cudaStream_t stream) { return launch<false>(a, stream); }

void* lmc_mapped_device_pointer(void* host_ptr) {
  void* device_ptr = nullptr;
  if (cudaHostGetDevicePointer(&device_ptr, host_ptr, 0) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls do not see it
    return nullptr;
  }
  return device_ptr;
}

const char* lmc_last_error(void) { return g_error; }

}  // extern "C"
