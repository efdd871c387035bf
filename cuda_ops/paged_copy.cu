// Multi-layer gather (paged KV cache -> chunk) and scatter (chunk -> paged KV cache) by slot mapping for
// the token-major paged layouts (vLLM flash attention, MLA). One launch moves every layer: blockIdx.y is
// the layer (its cache address read from a device array of per-layer pointers), blockIdx.x strides over
// the (plane, token) rows, threads copy a row in the widest unit (16 bytes when every address and the row size allow).
// Plain CUDA runtime API behind the C ABI of paged_copy.h.
#include "paged_copy.h"

#include <stdio.h>

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

// One CUDA block per (plane, token) row at a time; its threads copy the row's vector units.
template <typename Vec, bool kGather>
__global__ void paged_copy_kernel(lmc_paged_args a, int64_t units_per_row) {
  const int64_t layer = blockIdx.y;
  const uint64_t base = a.layer_ptrs ? a.layer_ptrs[layer] : a.single_layer;
  Vec* cache = reinterpret_cast<Vec*>(base);
  Vec* chunk = reinterpret_cast<Vec*>(a.chunk);
  const int64_t rows_total = a.planes * a.num_tokens;  // rows of this layer in the chunk
  for (int64_t row = blockIdx.x; row < rows_total; row += gridDim.x) {
    const int64_t plane = row / a.num_tokens, token = row % a.num_tokens;
    const int64_t slot = a.slots[token];
    if (slot < 0 || slot >= a.num_slots) continue;
    Vec* cache_row = cache + (plane * a.num_slots + slot) * units_per_row;
    Vec* chunk_row = chunk + ((layer * a.planes + plane) * a.num_tokens + token) * units_per_row;
    for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) {
      if (kGather) chunk_row[u] = cache_row[u];
      else cache_row[u] = chunk_row[u];
    }
  }
}

int check(const lmc_paged_args* a) {
  if (!a) return fail("lmc_paged: null arguments");
  if (a->num_layers <= 0 || a->planes <= 0 || a->planes > 2 || a->row_bytes <= 0 || a->num_slots <= 0 ||
      a->num_tokens < 0)
    return fail("lmc_paged: layers, planes (1 or 2), row_bytes and num_slots must be positive");
  if (!a->layer_ptrs && (!a->single_layer || a->num_layers != 1))
    return fail("lmc_paged: give layer_ptrs, or single_layer with num_layers == 1");
  if (a->num_tokens > 0 && (!a->slots || !a->chunk)) return fail("lmc_paged: null slots or chunk");
  return 0;
}

// The widest unit that divides the row and aligns every address (cache rows, chunk rows, bases).
int unit_bytes(const lmc_paged_args* a) {
  const uint64_t bits = static_cast<uint64_t>(a->row_bytes) | reinterpret_cast<uint64_t>(a->chunk) |
                        (a->layer_ptrs ? a->bases_or : a->single_layer);
  for (int unit = 16; unit > 1; unit /= 2)
    if (bits % unit == 0) return unit;
  return 1;
}

template <bool kGather>
int launch(const lmc_paged_args* a, cudaStream_t stream, int unit) {
  if (a->num_tokens == 0) return 0;
  const int64_t units = a->row_bytes / unit;
  const int64_t rows = a->planes * a->num_tokens;
  const int threads = units >= kThreads ? kThreads : static_cast<int>(((units + 31) / 32) * 32);
  dim3 grid(static_cast<unsigned>(rows < 65535 ? rows : 65535), static_cast<unsigned>(a->num_layers));
  if (a->num_layers > 65535) return fail("lmc_paged: more than 65535 layers in one launch");
  switch (unit) {
    case 16: paged_copy_kernel<uint4, kGather><<<grid, threads, 0, stream>>>(*a, units); break;
    case 8: paged_copy_kernel<uint2, kGather><<<grid, threads, 0, stream>>>(*a, units); break;
    case 4: paged_copy_kernel<uint32_t, kGather><<<grid, threads, 0, stream>>>(*a, units); break;
    case 2: paged_copy_kernel<uint16_t, kGather><<<grid, threads, 0, stream>>>(*a, units); break;
    default: paged_copy_kernel<uint8_t, kGather><<<grid, threads, 0, stream>>>(*a, units); break;
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : cuda_fail(err, "lmc_paged: kernel launch");
}

}  // namespace

extern "C" {

int lmc_paged_gather(const lmc_paged_args* a, cudaStream_t stream) {
  if (int rc = check(a)) return rc;
  return launch<true>(a, stream, unit_bytes(a));
}

int lmc_paged_scatter(const lmc_paged_args* a, cudaStream_t stream) {
  if (int rc = check(a)) return rc;
  return launch<false>(a, stream, unit_bytes(a));
}

int lmc_paged_gather_staged(const lmc_paged_args* a, void* staging, void* host_dst, cudaStream_t stream) {
  if (!a || !staging || !host_dst) return fail("lmc_paged_gather_staged: null argument");
  lmc_paged_args staged = *a;
  staged.chunk = staging;
  if (int rc = lmc_paged_gather(&staged, stream)) return rc;
  const size_t bytes = static_cast<size_t>(a->num_layers * a->planes * a->num_tokens * a->row_bytes);
  cudaError_t err = cudaMemcpyAsync(host_dst, staging, bytes, cudaMemcpyDeviceToHost, stream);
  return err == cudaSuccess ? 0 : cuda_fail(err, "lmc_paged_gather_staged: copy to host");
}

int lmc_paged_scatter_staged(const lmc_paged_args* a, void* staging, const void* host_src, cudaStream_t stream) {
  if (!a || !staging || !host_src) return fail("lmc_paged_scatter_staged: null argument");
  const size_t bytes = static_cast<size_t>(a->num_layers * a->planes * a->num_tokens * a->row_bytes);
  cudaError_t err = cudaMemcpyAsync(staging, host_src, bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return cuda_fail(err, "lmc_paged_scatter_staged: copy from host");
  lmc_paged_args staged = *a;
  staged.chunk = staging;
  return lmc_paged_scatter(&staged, stream);
}

void* lmc_mapped_device_pointer(void* host_ptr) {
  void* device_ptr = nullptr;
  if (cudaHostGetDevicePointer(&device_ptr, host_ptr, 0) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls do not see it
    return nullptr;
  }
  return device_ptr;
}

const char* lmc_last_error(void) { return g_error; }

}  // extern "C"
