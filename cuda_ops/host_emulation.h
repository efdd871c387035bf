// Host emulation of the CUDA runtime for paged_copy.cu: g++ compiles the kernel source unchanged with
//   g++ -include cuda_ops/host_emulation.h -x c++ cuda_ops/paged_copy.cu -I<CUDA toolkit include> -Icuda_ops
// (lmcache_vllm/integration/vllm/testing/cuda_host.py builds it; `make check-cuda` and tests/test_cuda_host.py run it).
//
// What it provides:
// - CUDA's own types from the toolkit headers (uint4, uint2, dim3, cudaStream_t, cudaError_t); under g++ the
//   toolkit's host_defines.h turns __global__ / __device__ / __host__ into nothing, so a kernel is a host
//   function;
// - blockIdx, threadIdx, gridDim, blockDim as (thread-local) variables, set by LMC_LAUNCH, which walks the
//   whole grid: every block of every grid row, every thread of a block, one after another. The kernel's
//   threads share nothing (no shared memory, no barriers), so running them in turn gives what any
//   interleaving on a GPU gives, as long as no two threads write the same byte (the tests never scatter
//   one slot twice with different values);
// - the few runtime calls paged_copy.cu makes: launches never fail, and host memory is its own "device
//   alias" (cudaHostGetDevicePointer returns the pointer it is given), so a chunk in host memory takes the
//   kernel's pinned-memory path.
#pragma once

#include <cuda_runtime_api.h>
#include <vector_types.h>

#include <stdint.h>

#ifndef __launch_bounds__  // host_defines.h defines it only for nvcc
#define __launch_bounds__(...)
#endif

static thread_local uint3 blockIdx, threadIdx;
static thread_local dim3 gridDim, blockDim;

namespace lmc_emu {

template <typename... Params>
struct Launch {
  dim3 grid, block;
  void (*kernel)(Params...);

  template <typename... Args>
  void operator()(Args&&... args) const {
    gridDim = grid;
    blockDim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
      for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx)
          for (unsigned tz = 0; tz < block.z; ++tz)
            for (unsigned ty = 0; ty < block.y; ++ty)
              for (unsigned tx = 0; tx < block.x; ++tx) {
                blockIdx = uint3{bx, by, bz};
                threadIdx = uint3{tx, ty, tz};
                kernel(args...);
              }
  }
};

template <typename... Params>
Launch<Params...> launch(dim3 grid, dim3 block, void (*kernel)(Params...)) {
  return Launch<Params...>{grid, block, kernel};
}

}  // namespace lmc_emu

#define LMC_LAUNCH(grid, block, stream, ...) (void)(stream), lmc_emu::launch(grid, block, __VA_ARGS__)

extern "C" {
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "host emulation: no CUDA error"; }
cudaError_t cudaHostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned int) {
  *device_ptr = host_ptr;
  return cudaSuccess;
}
}
