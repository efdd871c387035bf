// lmcache_vllm._cuda_ops: the torch binding of paged_copy.cu (built only when torch has CUDA).
// gather(caches, slots, out, layout, block_size, host_path="staged") / scatter(chunk, caches, slots, ...):
// caches are per-layer CUDA tensors of the flash ([2, blocks, bs, heads, D]) or MLA ([blocks, bs, dim])
// layout; the chunk [layers, planes, T, width] is a CUDA tensor (device path) or a host tensor: pinned host
// memory goes through the mapped pointer when host_path == "mapped", otherwise (and for pageable memory)
// through a device staging buffer and an async copy on the current stream; host-memory calls return
// after the stream has finished them.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <vector>

#include "paged_copy.h"

namespace {

constexpr int64_t kFlash = 2, kMla = 3;

// Device arrays of per-layer base addresses, kept per distinct set of caches (vLLM registers them once).
torch::Tensor layer_pointer_array(const std::vector<torch::Tensor>& caches) {
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, torch::Tensor> cache;
  std::vector<int64_t> ptrs;
  for (const auto& c : caches) ptrs.push_back(reinterpret_cast<int64_t>(c.data_ptr()));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(ptrs);
  if (it != cache.end()) return it->second;
  if (cache.size() > 64) cache.clear();
  auto host = torch::tensor(ptrs, torch::dtype(torch::kInt64));
  auto device = host.to(caches[0].device());
  cache.emplace(ptrs, device);
  return device;
}

lmc_paged_args make_args(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                         const torch::Tensor& chunk, int64_t layout, int64_t block_size) {
  TORCH_CHECK(layout == kFlash || layout == kMla, "_cuda_ops: layout code ", layout, " is not flash (2) or mla (3)");
  TORCH_CHECK(!caches.empty(), "_cuda_ops: no KV caches given");
  const auto& c0 = caches[0];
  TORCH_CHECK(c0.is_cuda(), "_cuda_ops: caches must be CUDA tensors");
  int64_t planes, blocks, width;
  if (layout == kFlash) {
    TORCH_CHECK(c0.dim() == 5 && c0.size(0) == 2 && c0.size(2) == block_size,
                "_cuda_ops: flash cache must be [2, blocks, ", block_size, ", heads, D], got ", c0.sizes());
    planes = 2; blocks = c0.size(1); width = c0.size(3) * c0.size(4);
  } else {
    TORCH_CHECK(c0.dim() == 3 && c0.size(1) == block_size, "_cuda_ops: mla cache must be [blocks, ", block_size,
                ", dim], got ", c0.sizes());
    planes = 1; blocks = c0.size(0); width = c0.size(2);
  }
  uint64_t bases_or = 0;
  for (size_t i = 0; i < caches.size(); ++i) {
    const auto& c = caches[i];
    TORCH_CHECK(c.sizes() == c0.sizes() && c.scalar_type() == c0.scalar_type() && c.is_contiguous() &&
                c.device() == c0.device(), "_cuda_ops: cache ", i, " must be contiguous, ", c0.sizes(), ", ",
                c0.scalar_type(), " on ", c0.device());
    bases_or |= reinterpret_cast<uint64_t>(c.data_ptr());
  }
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous() &&
              slots.device() == c0.device(), "_cuda_ops: slot_mapping must be contiguous 1-D int64 on ", c0.device());
  TORCH_CHECK(chunk.dim() == 4 && chunk.is_contiguous() && chunk.scalar_type() == c0.scalar_type() &&
              chunk.size(0) == static_cast<int64_t>(caches.size()) && chunk.size(1) == planes &&
              chunk.size(2) == slots.size(0) && chunk.size(3) == width,
              "_cuda_ops: chunk ", chunk.sizes(), " ", chunk.scalar_type(), " must be contiguous [", caches.size(),
              ", ", planes, ", ", slots.size(0), ", ", width, "] ", c0.scalar_type());
  if (slots.numel()) {
    const int64_t max_slot = slots.max().item<int64_t>();
    TORCH_CHECK(max_slot < blocks * block_size, "_cuda_ops: slot ", max_slot, " beyond the cache's ",
                blocks * block_size, " slots");
  }
  lmc_paged_args args{};
  args.num_layers = static_cast<int64_t>(caches.size());
  if (caches.size() == 1) {
    args.single_layer = reinterpret_cast<uint64_t>(c0.data_ptr());
  } else {
    args.layer_ptrs = reinterpret_cast<const uint64_t*>(layer_pointer_array(caches).data_ptr<int64_t>());
  }
  args.bases_or = bases_or;
  args.planes = planes;
  args.num_slots = blocks * block_size;
  args.row_bytes = width * c0.element_size();
  args.slots = slots.data_ptr<int64_t>();
  args.num_tokens = slots.size(0);
  return args;
}

void check_rc(int rc) { TORCH_CHECK(rc == 0, "_cuda_ops: ", lmc_last_error()); }

void transfer(bool gather, const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, torch::Tensor chunk,
              int64_t layout, int64_t block_size, const std::string& host_path) {
  TORCH_CHECK(host_path == "staged" || host_path == "mapped", "_cuda_ops: host_path must be 'staged' or 'mapped'");
  lmc_paged_args args = make_args(caches, slots, chunk, layout, block_size);
  const c10::cuda::CUDAGuard guard(caches[0].device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (chunk.is_cuda()) {
    args.chunk = chunk.data_ptr();
    check_rc(gather ? lmc_paged_gather(&args, stream) : lmc_paged_scatter(&args, stream));
    return;
  }
  if (host_path == "mapped" && chunk.is_pinned()) {
    args.chunk = lmc_mapped_device_pointer(chunk.data_ptr());
    TORCH_CHECK(args.chunk != nullptr, "_cuda_ops: pinned chunk has no device alias");
    check_rc(gather ? lmc_paged_gather(&args, stream) : lmc_paged_scatter(&args, stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // host memory: done when the call returns
    return;
  }
  auto staging = torch::empty(chunk.sizes(), chunk.options().device(caches[0].device()).pinned_memory(false));
  check_rc(gather ? lmc_paged_gather_staged(&args, staging.data_ptr(), chunk.data_ptr(), stream)
                  : lmc_paged_scatter_staged(&args, staging.data_ptr(), chunk.data_ptr(), stream));
  // Host memory: the data is in place (and the staging buffer free to reuse) when the call returns.
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void gather(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, torch::Tensor out, int64_t layout,
            int64_t block_size, const std::string& host_path) {
  transfer(true, caches, slots, out, layout, block_size, host_path);
}

void scatter(const torch::Tensor& chunk, const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
             int64_t layout, int64_t block_size, const std::string& host_path) {
  transfer(false, caches, slots, chunk, layout, block_size, host_path);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-layer paged KV gather/scatter by slot mapping (CUDA: flash and MLA layouts)";
  m.def("gather", &gather, py::arg("caches"), py::arg("slots"), py::arg("out"), py::arg("layout"),
        py::arg("block_size"), py::arg("host_path") = "staged");
  m.def("scatter", &scatter, py::arg("chunk"), py::arg("caches"), py::arg("slots"), py::arg("layout"),
        py::arg("block_size"), py::arg("host_path") = "staged");
  m.attr("SUPPORTED_LAYOUTS") = py::make_tuple(kFlash, kMla);
}
