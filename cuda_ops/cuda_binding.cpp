// lmcache_vllm._cuda_ops: the torch binding of paged_copy.cu (built only when torch has CUDA).
// gather(caches, slots, out, layout, block_size) / scatter(chunk, caches, slots, layout, block_size) -> str:
// caches are vLLM's per-layer [B, H, N, C] CUDA views (layout code 4, any strides, C contiguous), slots an
// int64 tensor on their device, the chunk [layers, planes, T, heads * D] a CUDA tensor or pinned (registered)
// host memory, which the kernel reads / writes through its device alias. The copy is enqueued on the current
// stream and the call returns at once: no host synchronisation, no staging buffer, no allocation after the
// first call for a set of caches (their device array of layer addresses is kept, and kept from reuse until
// every stream that launched a kernel reading it has passed that kernel). Returns "" or an error message; no
// C++ exception reaches Python (see cpu_ops.cpp).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <vector>

#include "op_errors.h"
#include "paged_copy.h"

namespace {

constexpr int64_t kStrided = 4, kAbi = 2;

template <typename... Parts>
std::string msg(const Parts&... parts) {
  return lmc_errors::message("_cuda_ops", parts...);
}

// Device arrays of per-layer base addresses, kept per distinct set of caches (vLLM registers them once, so
// only the first call for a set copies its array to the device). The caller gets the array's tensor, not a
// raw pointer: a reference of its own, so another thread evicting the array from the map cannot free it
// before the launch; after the launch `transfer` marks it used on the launch stream (record_stream), so the
// caching allocator hands its memory out again only once that stream has passed the kernel that reads it,
// whichever stream made the array and whenever the map drops it.
torch::Tensor layer_pointer_array(const std::vector<torch::Tensor>& caches) {
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, torch::Tensor> arrays;
  std::vector<int64_t> ptrs;
  for (const auto& c : caches) ptrs.push_back(reinterpret_cast<int64_t>(c.data_ptr()));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = arrays.find(ptrs);
  if (it == arrays.end()) {
    if (arrays.size() > 64) arrays.clear();
    it = arrays.emplace(ptrs, torch::tensor(ptrs, torch::dtype(torch::kInt64)).to(caches[0].device())).first;
  }
  return it->second;
}

// One word per device in mapped pinned host memory, where the kernels store a slot >= num_slots they met
// (paged_copy.h): the device alias for the launches, the host address to read. Read at the next call on the
// device, without a synchronisation (a kernel still running only delays the report, as CUDA reports a
// kernel's fault at a later call). Null when the device has no mapped memory (then nothing is reported).
int64_t* bad_slot_word(const torch::Device& device, int64_t** device_alias) {
  static std::mutex mutex;
  static std::map<int, std::pair<int64_t*, int64_t*>> words;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = words.find(device.index());
  if (it == words.end()) {
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(int64_t), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();  // clear it: later calls must not see it
      host = nullptr;
    } else {
      *static_cast<volatile int64_t*>(host) = -1;
    }
    void* alias = host ? lmc_mapped_device_pointer(host) : nullptr;
    it = words.emplace(device.index(), std::make_pair(alias ? static_cast<int64_t*>(host) : nullptr,
                                                      static_cast<int64_t*>(alias))).first;
  }
  *device_alias = it->second.second;
  return it->second.first;
}

// `layer_array` receives the device array of layer addresses the launch reads (undefined for one layer).
std::string make_args(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, const torch::Tensor& chunk,
                      int64_t layout, int64_t block_size, lmc_paged_args& args, torch::Tensor& layer_array) {
  if (layout != kStrided) return msg("layout code ", layout, " is not the strided views (4)");
  if (caches.empty()) return msg("no KV caches given");
  const auto& c0 = caches[0];
  if (!c0.defined() || !c0.is_cuda() || c0.dim() != 4 || c0.size(2) != block_size)
    return msg("caches must be CUDA [blocks, heads, ", block_size, ", C] views");
  if (c0.size(3) > 1 && c0.stride(3) != 1) return msg("the last dim of the caches must be contiguous");
  uint64_t bases_or = 0;
  for (size_t i = 0; i < caches.size(); ++i) {
    const auto& c = caches[i];
    if (!c.defined() || c.sizes() != c0.sizes() || c.strides() != c0.strides() || c.scalar_type() != c0.scalar_type() ||
        c.device() != c0.device())
      return msg("cache ", i, " must have cache 0's sizes, strides, dtype and device");
    bases_or |= reinterpret_cast<uint64_t>(c.data_ptr());
  }
  if (!slots.defined() || slots.dim() != 1 || slots.scalar_type() != torch::kInt64 || !slots.is_contiguous() ||
      slots.device() != c0.device())
    return msg("slot_mapping must be a contiguous 1-D int64 tensor on ", c0.device());
  if (!chunk.defined() || chunk.dim() != 4 || !chunk.is_contiguous() || chunk.scalar_type() != c0.scalar_type() ||
      chunk.size(0) != static_cast<int64_t>(caches.size()) || chunk.size(2) != slots.size(0))
    return msg("chunk must be contiguous [", caches.size(), ", planes, ", slots.size(0), ", width] of the caches' dtype");
  const int64_t planes = chunk.size(1), heads = c0.size(1);
  if ((planes != 1 && planes != 2) || c0.size(3) % planes || chunk.size(3) != heads * (c0.size(3) / planes))
    return msg("chunk ", chunk.sizes(), " does not fit caches ", c0.sizes(), " (planes 1 or 2, width heads * C / planes)");
  const int64_t item = c0.element_size();
  args = lmc_paged_args{};
  args.num_layers = static_cast<int64_t>(caches.size());
  if (caches.size() == 1) args.single_layer = reinterpret_cast<uint64_t>(c0.data_ptr());
  else {
    layer_array = layer_pointer_array(caches);
    args.layer_ptrs = reinterpret_cast<const uint64_t*>(layer_array.data_ptr());
  }
  args.bases_or = bases_or;
  args.planes = planes;
  args.heads = heads;
  args.block_size = block_size;
  args.num_slots = c0.size(0) * block_size;
  args.stride_block = c0.stride(0) * item;
  args.stride_head = c0.stride(1) * item;
  args.stride_token = c0.stride(2) * item;
  args.piece_bytes = (c0.size(3) / planes) * item;
  args.slots = static_cast<const int64_t*>(slots.data_ptr());
  args.num_tokens = slots.size(0);
  if (chunk.is_cuda()) {
    if (chunk.device() != c0.device()) return msg("chunk is on ", chunk.device(), ", caches on ", c0.device());
    args.chunk = chunk.data_ptr();
  } else {
    if (!chunk.is_pinned()) return msg("a host chunk must be pinned (registered) memory");
    args.chunk = lmc_mapped_device_pointer(chunk.data_ptr());
    if (!args.chunk) return msg("pinned chunk has no device alias");
  }
  return "";
}

std::string transfer(bool gather, const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                     const torch::Tensor& chunk, int64_t layout, int64_t block_size) {
  return lmc_errors::no_throw("_cuda_ops", [&] {
    lmc_paged_args args;
    torch::Tensor layer_array;
    std::string error = make_args(caches, slots, chunk, layout, block_size, args, layer_array);
    if (!error.empty()) return error;
    const c10::cuda::CUDAGuard guard(caches[0].device());
    int64_t* alias = nullptr;
    volatile int64_t* bad = bad_slot_word(caches[0].device(), &alias);
    if (bad && *bad >= 0) {  // an earlier kernel met a slot beyond the cache: reported once, like the CPU ops
      const int64_t slot = *bad;
      *bad = -1;
      return msg("slot ", slot, " beyond the cache's slots, met by an earlier copy on ", caches[0].device(),
                 " (not copied; the callers check slots first, so a caller's bug)");
    }
    args.bad_slot = alias;
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    const int rc = gather ? lmc_paged_gather(&args, stream.stream()) : lmc_paged_scatter(&args, stream.stream());
    // The kernel reads the array when the stream gets to it: not before, so its memory stays out of reuse
    // until then even if the map evicts it (or another thread does) right after this call.
    if (layer_array.defined()) layer_array.record_stream(stream.unwrap());
    return rc == 0 ? std::string() : msg(lmc_last_error());
  });
}

std::string gather(const std::vector<torch::Tensor>& caches, const torch::Tensor& slots, torch::Tensor out,
                   int64_t layout, int64_t block_size) {
  return transfer(true, caches, slots, out, layout, block_size);
}

std::string scatter(const torch::Tensor& chunk, const std::vector<torch::Tensor>& caches, const torch::Tensor& slots,
                    int64_t layout, int64_t block_size) {
  return transfer(false, caches, slots, chunk, layout, block_size);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-layer paged KV gather/scatter by slot mapping over vLLM's strided KV views (CUDA)";
  m.def("gather", &gather, py::arg("caches"), py::arg("slots"), py::arg("out"), py::arg("layout"),
        py::arg("block_size"));
  m.def("scatter", &scatter, py::arg("chunk"), py::arg("caches"), py::arg("slots"), py::arg("layout"),
        py::arg("block_size"));
  m.attr("SUPPORTED_LAYOUTS") = py::make_tuple(kStrided);
  m.attr("ABI") = kAbi;
}
