// Self-test of paged_copy.cu without torch: on a machine with a CUDA device it checks every path (all
// layers, layerwise, mapped pinned host memory, staging buffer; gather and scatter; slots with -1 and
// unaligned rows) byte for byte against a CPU reference and exits 1 on any mismatch. Without a device it
// says so and exits 0 (scripts/check_cuda.sh still proves that it compiles and links).
#include "paged_copy.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define CHECK_CUDA(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(2); } } while (0)
#define CHECK_RC(x) do { if ((x) != 0) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, lmc_last_error()); \
  exit(2); } } while (0)

static int failures = 0;

static void expect(bool ok, const char* what) {
  if (!ok) { fprintf(stderr, "FAIL: %s\n", what); ++failures; }
}

// One geometry: `layers` caches of [planes, slots, row_bytes] bytes, T tokens.
static void run_case(int64_t layers, int64_t planes, int64_t num_slots, int64_t row_bytes, int64_t tokens) {
  const size_t cache_bytes = planes * num_slots * row_bytes, chunk_bytes = layers * planes * tokens * row_bytes;
  std::vector<std::vector<unsigned char>> host_caches(layers, std::vector<unsigned char>(cache_bytes));
  for (auto& c : host_caches) for (auto& b : c) b = static_cast<unsigned char>(rand());
  std::vector<int64_t> slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) slots[t] = (t % 7 == 3) ? -1 : (t * 37 + 5) % num_slots;  // distinct mod

  std::vector<unsigned char> expected(chunk_bytes, 0xAB);
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t p = 0; p < planes; ++p)
      for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= 0)
          memcpy(&expected[((l * planes + p) * tokens + t) * row_bytes],
                 &host_caches[l][(p * num_slots + slots[t]) * row_bytes], row_bytes);

  std::vector<void*> dev_caches(layers);
  std::vector<uint64_t> ptrs(layers);
  uint64_t bases_or = 0;
  for (int64_t l = 0; l < layers; ++l) {
    CHECK_CUDA(cudaMalloc(&dev_caches[l], cache_bytes));
    CHECK_CUDA(cudaMemcpy(dev_caches[l], host_caches[l].data(), cache_bytes, cudaMemcpyHostToDevice));
    ptrs[l] = reinterpret_cast<uint64_t>(dev_caches[l]);
    bases_or |= ptrs[l];
  }
  uint64_t* dev_ptrs; int64_t* dev_slots; unsigned char *dev_chunk, *staging, *pinned;
  CHECK_CUDA(cudaMalloc(&dev_ptrs, layers * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemcpy(dev_ptrs, ptrs.data(), layers * sizeof(uint64_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev_slots, tokens * sizeof(int64_t)));
  CHECK_CUDA(cudaMemcpy(dev_slots, slots.data(), tokens * sizeof(int64_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev_chunk, chunk_bytes));
  CHECK_CUDA(cudaMalloc(&staging, chunk_bytes));
  CHECK_CUDA(cudaHostAlloc(&pinned, chunk_bytes, cudaHostAllocMapped));

  lmc_paged_args a{};
  a.layer_ptrs = dev_ptrs; a.num_layers = layers; a.planes = planes; a.num_slots = num_slots;
  a.row_bytes = row_bytes; a.slots = dev_slots; a.num_tokens = tokens; a.bases_or = bases_or;
  std::vector<unsigned char> got(chunk_bytes);

  // All layers into device memory.
  CHECK_CUDA(cudaMemset(dev_chunk, 0xAB, chunk_bytes));
  a.chunk = dev_chunk;
  CHECK_RC(lmc_paged_gather(&a, 0));
  CHECK_CUDA(cudaMemcpy(got.data(), dev_chunk, chunk_bytes, cudaMemcpyDeviceToHost));
  expect(got == expected, "gather all layers (device)");

  // Layerwise.
  CHECK_CUDA(cudaMemset(dev_chunk, 0xAB, chunk_bytes));
  for (int64_t l = 0; l < layers; ++l) {
    lmc_paged_args one = a;
    one.layer_ptrs = nullptr; one.single_layer = ptrs[l]; one.num_layers = 1;
    one.chunk = dev_chunk + l * planes * tokens * row_bytes;
    CHECK_RC(lmc_paged_gather(&one, 0));
  }
  CHECK_CUDA(cudaMemcpy(got.data(), dev_chunk, chunk_bytes, cudaMemcpyDeviceToHost));
  expect(got == expected, "gather layerwise");

  // Mapped pinned host memory.
  memset(pinned, 0xAB, chunk_bytes);
  a.chunk = lmc_mapped_device_pointer(pinned);
  expect(a.chunk != nullptr, "mapped device pointer");
  CHECK_RC(lmc_paged_gather(&a, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  expect(memcmp(pinned, expected.data(), chunk_bytes) == 0, "gather into mapped pinned memory");

  // Staging buffer + async copy.
  memset(pinned, 0xAB, chunk_bytes);
  CHECK_CUDA(cudaMemset(staging, 0xAB, chunk_bytes));
  CHECK_RC(lmc_paged_gather_staged(&a, staging, pinned, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  expect(memcmp(pinned, expected.data(), chunk_bytes) == 0, "gather staged");

  // Scatter back into zeroed caches (staged, then mapped): every valid slot restored, others untouched.
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t l = 0; l < layers; ++l) CHECK_CUDA(cudaMemset(dev_caches[l], 0, cache_bytes));
    memcpy(pinned, expected.data(), chunk_bytes);
    if (pass == 0) {
      CHECK_RC(lmc_paged_scatter_staged(&a, staging, pinned, 0));
    } else {
      a.chunk = lmc_mapped_device_pointer(pinned);
      CHECK_RC(lmc_paged_scatter(&a, 0));
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    for (int64_t l = 0; l < layers; ++l) {
      std::vector<unsigned char> back(cache_bytes), want(cache_bytes, 0);
      CHECK_CUDA(cudaMemcpy(back.data(), dev_caches[l], cache_bytes, cudaMemcpyDeviceToHost));
      for (int64_t p = 0; p < planes; ++p)
        for (int64_t t = 0; t < tokens; ++t)
          if (slots[t] >= 0)
            memcpy(&want[(p * num_slots + slots[t]) * row_bytes], &host_caches[l][(p * num_slots + slots[t]) * row_bytes],
                   row_bytes);
      expect(back == want, pass == 0 ? "scatter staged" : "scatter mapped");
    }
  }

  for (auto c : dev_caches) cudaFree(c);
  cudaFree(dev_ptrs); cudaFree(dev_slots); cudaFree(dev_chunk); cudaFree(staging); cudaFreeHost(pinned);
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("paged_copy_selftest: no CUDA device, compile/link check only\n");
    return 0;
  }
  run_case(4, 2, 16 * 64, 8 * 128 * 2, 300);  // flash, bf16, 8 heads x 128: 16-byte units
  run_case(3, 1, 16 * 32, 576 * 2, 77);       // MLA 576-dim latent
  run_case(2, 2, 16 * 8, 3 * 2, 33);          // odd rows: 2-byte units
  expect(lmc_paged_gather(nullptr, 0) != 0, "null args rejected");
  printf("paged_copy_selftest: %s\n", failures ? "FAILED" : "all paths match the CPU reference");
  return failures ? 1 : 0;
}
