// Self-test of paged_copy.cu without torch: on a machine with a CUDA device it checks every path (all
// layers at once, layerwise, into device memory and into mapped pinned host memory; gather and scatter;
// slots with -1 and out-of-order blocks; LBNHC, LBHNC and block-outermost strides; 16-byte and narrow units)
// byte for byte against a CPU reference, and exits 1 on any mismatch. Without a device it says so and
// exits 0 (scripts/check_cuda.sh still proves that it compiles and links).
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

static void expect(bool ok, const char* what, const char* name) {
  if (!ok) { fprintf(stderr, "FAIL: %s (%s)\n", what, name); ++failures; }
}

// Layer geometry in bytes, as vLLM's views give it: `order` 0 = LBNHC, 1 = LBHNC, 2 = BLNHC (interleaved).
struct Case {
  const char* name;
  int64_t layers, blocks, heads, bs, piece, planes, tokens;
  int order;
};

static void run_case(const Case& c) {
  const int64_t C = c.piece * c.planes, page = c.heads * c.bs * C;
  int64_t sb, sh, sn, sl;
  if (c.order == 0) { sn = c.heads * C; sh = C; sb = page; sl = page * c.blocks; }
  else if (c.order == 1) { sh = c.bs * C; sn = C; sb = page; sl = page * c.blocks; }
  else { sn = c.heads * C; sh = C; sl = page; sb = page * c.layers; }
  const size_t total = page * c.blocks * c.layers, chunk_bytes = c.layers * c.planes * c.tokens * c.heads * c.piece;
  std::vector<unsigned char> host(total);
  for (auto& b : host) b = static_cast<unsigned char>(rand());
  std::vector<int64_t> slots(c.tokens);
  const int64_t num_slots = c.blocks * c.bs;
  for (int64_t t = 0; t < c.tokens; ++t) slots[t] = (t % 7 == 3) ? -1 : (t < 2 * c.bs ? 3 * c.bs + t : (t * 37 + 5) % num_slots);
  auto cell = [&](int64_t l, int64_t p, int64_t s, int64_t h) {
    return l * sl + (s / c.bs) * sb + (s % c.bs) * sn + h * sh + p * c.piece;
  };
  auto row = [&](int64_t l, int64_t p, int64_t t, int64_t h) {
    return ((l * c.planes + p) * c.tokens + t) * c.heads * c.piece + h * c.piece;
  };
  std::vector<unsigned char> expected(chunk_bytes, 0xAB);
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t p = 0; p < c.planes; ++p)
      for (int64_t t = 0; t < c.tokens; ++t)
        for (int64_t h = 0; h < c.heads; ++h)
          if (slots[t] >= 0) memcpy(&expected[row(l, p, t, h)], &host[cell(l, p, slots[t], h)], c.piece);

  unsigned char* dev;
  CHECK_CUDA(cudaMalloc(&dev, total));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), total, cudaMemcpyHostToDevice));
  std::vector<uint64_t> ptrs(c.layers);
  uint64_t bases_or = 0;
  for (int64_t l = 0; l < c.layers; ++l) bases_or |= ptrs[l] = reinterpret_cast<uint64_t>(dev + l * sl);
  uint64_t* dev_ptrs; int64_t* dev_slots; unsigned char *dev_chunk, *pinned;
  CHECK_CUDA(cudaMalloc(&dev_ptrs, c.layers * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemcpy(dev_ptrs, ptrs.data(), c.layers * sizeof(uint64_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev_slots, c.tokens * sizeof(int64_t)));
  CHECK_CUDA(cudaMemcpy(dev_slots, slots.data(), c.tokens * sizeof(int64_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev_chunk, chunk_bytes));
  CHECK_CUDA(cudaHostAlloc(&pinned, chunk_bytes, cudaHostAllocMapped));

  lmc_paged_args a{};
  a.layer_ptrs = dev_ptrs; a.num_layers = c.layers; a.planes = c.planes; a.heads = c.heads; a.block_size = c.bs;
  a.num_slots = num_slots; a.stride_block = sb; a.stride_head = sh; a.stride_token = sn; a.piece_bytes = c.piece;
  a.slots = dev_slots; a.num_tokens = c.tokens; a.bases_or = bases_or;
  std::vector<unsigned char> got(chunk_bytes);

  CHECK_CUDA(cudaMemset(dev_chunk, 0xAB, chunk_bytes));  // all layers into device memory
  a.chunk = dev_chunk;
  CHECK_RC(lmc_paged_gather(&a, 0));
  CHECK_CUDA(cudaMemcpy(got.data(), dev_chunk, chunk_bytes, cudaMemcpyDeviceToHost));
  expect(got == expected, "gather all layers (device)", c.name);

  CHECK_CUDA(cudaMemset(dev_chunk, 0xAB, chunk_bytes));  // layerwise
  for (int64_t l = 0; l < c.layers; ++l) {
    lmc_paged_args one = a;
    one.layer_ptrs = nullptr; one.single_layer = ptrs[l]; one.num_layers = 1;
    one.chunk = dev_chunk + l * c.planes * c.tokens * c.heads * c.piece;
    CHECK_RC(lmc_paged_gather(&one, 0));
  }
  CHECK_CUDA(cudaMemcpy(got.data(), dev_chunk, chunk_bytes, cudaMemcpyDeviceToHost));
  expect(got == expected, "gather layerwise", c.name);

  memset(pinned, 0xAB, chunk_bytes);  // straight into mapped pinned host memory
  a.chunk = lmc_mapped_device_pointer(pinned);
  expect(a.chunk != nullptr, "mapped device pointer", c.name);
  CHECK_RC(lmc_paged_gather(&a, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  expect(memcmp(pinned, expected.data(), chunk_bytes) == 0, "gather into mapped pinned memory", c.name);

  // Scatter back into a zeroed cache (from device memory, then from mapped pinned memory): every valid
  // slot's pieces are restored and no other byte changes.
  std::vector<unsigned char> want(total, 0);
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t p = 0; p < c.planes; ++p)
      for (int64_t t = 0; t < c.tokens; ++t)
        for (int64_t h = 0; h < c.heads; ++h)
          if (slots[t] >= 0) memcpy(&want[cell(l, p, slots[t], h)], &host[cell(l, p, slots[t], h)], c.piece);
  for (int pass = 0; pass < 2; ++pass) {
    CHECK_CUDA(cudaMemset(dev, 0, total));
    memcpy(pinned, expected.data(), chunk_bytes);
    CHECK_CUDA(cudaMemcpy(dev_chunk, expected.data(), chunk_bytes, cudaMemcpyHostToDevice));
    a.chunk = pass == 0 ? static_cast<void*>(dev_chunk) : lmc_mapped_device_pointer(pinned);
    CHECK_RC(lmc_paged_scatter(&a, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned char> back(total);
    CHECK_CUDA(cudaMemcpy(back.data(), dev, total, cudaMemcpyDeviceToHost));
    expect(back == want, pass == 0 ? "scatter from device" : "scatter from mapped pinned memory", c.name);
  }
  cudaFree(dev); cudaFree(dev_ptrs); cudaFree(dev_slots); cudaFree(dev_chunk); cudaFreeHost(pinned);
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("paged_copy_selftest: no CUDA device, compile/link check only\n");
    return 0;
  }
  const Case cases[] = {
      {"LBNHC bf16 8x128", 4, 64, 8, 16, 256, 2, 300, 0},  // FLASH_ATTN default: 16-byte units
      {"LBHNC bf16 4x64", 3, 32, 4, 16, 128, 2, 77, 1},    // head-major block interior (FlashInfer on SM100)
      {"BLNHC fp8 2x64", 3, 16, 2, 32, 64, 2, 90, 2},     // layers interleaved per block, 1-byte KV
      {"MLA 576", 3, 32, 1, 16, 1152, 1, 77, 0},           // one latent plane
      {"odd 3", 2, 8, 3, 16, 6, 2, 33, 1},                 // narrow pieces: 2-byte units
  };
  for (const Case& c : cases) run_case(c);
  expect(lmc_paged_gather(nullptr, 0) != 0, "null args rejected", "-");
  printf("paged_copy_selftest: %s\n", failures ? "FAILED" : "all paths match the CPU reference");
  return failures ? 1 : 0;
}
