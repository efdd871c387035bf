// C ABI of the paged KV copy kernels (paged_copy.cu). Plain CUDA runtime, no torch: the torch binding
// (cuda_binding.cpp) and the self-test call it.
//
// One layer's cache is vLLM's [B, H, N, C] view (any KVCacheLayout): the (plane, token, head) piece of
// `piece_bytes` bytes (head_size elements) of slot s = block * block_size + offset starts at
//   base + block * stride_block + offset * stride_token + head * stride_head + plane * piece_bytes
// (plane 0 = K, 1 = V; MLA: planes = 1). Chunk: contiguous [layers, planes, num_tokens, heads * piece_bytes].
// Slots < 0 are skipped (no slot: the token keeps its KV). A slot >= num_slots is never copied and, like the CPU
// ops' check, reported: the kernel stores it into *bad_slot (when given), where the caller reads it (the host
// emulation at once; the torch binding at its next call on the device, as CUDA reports a kernel's fault).
// The callers check bounds on the host before the launch too, so a report means a caller's bug.
// Everything is enqueued on `stream`; nothing here waits for the device.
#pragma once
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const uint64_t* layer_ptrs;  // device array of per-layer view base addresses (all-layers launch), or NULL
  uint64_t single_layer;       // the one layer's base address when layer_ptrs is NULL (layerwise)
  int64_t num_layers;          // layers in this launch (1 for layerwise)
  int64_t planes;              // 2 (K, V) or 1 (MLA)
  int64_t heads;
  int64_t block_size;          // tokens per (kernel) block
  int64_t num_slots;           // blocks * block_size
  int64_t stride_block;        // bytes
  int64_t stride_head;         // bytes
  int64_t stride_token;        // bytes
  int64_t piece_bytes;         // head_size * element size
  const int64_t* slots;        // device int64 [num_tokens]
  int64_t num_tokens;
  void* chunk;                 // device pointer, or the device alias of pinned (registered) host memory
  uint64_t bases_or;           // bitwise OR of every layer base address (picks the vector width)
  int64_t* bad_slot;           // device-visible word, or NULL: a slot >= num_slots the kernel met is stored there
} lmc_paged_args;

// 0 on success; otherwise a CUDA error code or -1 for bad arguments (see lmc_last_error()).
int lmc_paged_gather(const lmc_paged_args* args, cudaStream_t stream);
int lmc_paged_scatter(const lmc_paged_args* args, cudaStream_t stream);

// The width in bytes (16, 8, 4, 2 or 1) of the units the kernels move for `args`.
int lmc_paged_unit_bytes(const lmc_paged_args* args);

// Device alias of pinned or registered host memory (for the direct path); NULL when it has none.
void* lmc_mapped_device_pointer(void* host_ptr);

const char* lmc_last_error(void);

#ifdef __cplusplus
}
#endif
