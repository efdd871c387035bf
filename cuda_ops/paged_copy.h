// C ABI of the paged KV copy kernels (paged_copy.cu). Plain CUDA runtime, no torch: the torch binding
// (cuda_binding.cpp) and anything else can call it.
//
// Layout of one layer's cache, viewed as rows: [planes, num_slots, row_bytes] (flash: planes = 2,
// row = num_kv_heads*head_size elements of one slot; MLA: planes = 1, row = latent dim). Chunk: contiguous
// [layers, planes, num_tokens, row_bytes]. slot = block_id*block_size + offset; slots < 0 are skipped and
// slots >= num_slots are never touched (the caller checks bounds before the launch).
#pragma once
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const uint64_t* layer_ptrs;  // device array of per-layer cache base addresses (all-layers launch), or NULL
  uint64_t single_layer;       // the one layer's cache base address when layer_ptrs is NULL (layerwise)
  int64_t num_layers;          // layers in this launch (1 for layerwise)
  int64_t planes;              // 2 (K, V) or 1 (MLA)
  int64_t num_slots;           // num_blocks * block_size
  int64_t row_bytes;           // bytes per slot per plane
  const int64_t* slots;        // device int64 [num_tokens]
  int64_t num_tokens;
  void* chunk;                 // device pointer, or the device alias of mapped pinned host memory
  uint64_t bases_or;           // bitwise OR of every layer base address (picks the vector width)
} lmc_paged_args;

// 0 on success; otherwise a CUDA error code or -1 for bad arguments (see lmc_last_error()).
int lmc_paged_gather(const lmc_paged_args* args, cudaStream_t stream);
int lmc_paged_scatter(const lmc_paged_args* args, cudaStream_t stream);

// Through a device staging buffer of >= layers*planes*tokens*row_bytes bytes, then an async copy to/from
// host memory (pinned for true asynchrony). args->chunk is ignored.
int lmc_paged_gather_staged(const lmc_paged_args* args, void* staging, void* host_dst, cudaStream_t stream);
int lmc_paged_scatter_staged(const lmc_paged_args* args, void* staging, const void* host_src, cudaStream_t stream);

// Device alias of pinned host memory (for the direct path); NULL when it has none.
void* lmc_mapped_device_pointer(void* host_ptr);

const char* lmc_last_error(void);

#ifdef __cplusplus
}
#endif
