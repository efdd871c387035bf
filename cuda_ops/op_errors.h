// What both torch bindings (cpu_ops.cpp, cuda_binding.cpp) share: an error is a returned message, never a
// C++ exception crossing into Python (lmcache_vllm.ops raises it there). `no_throw` turns anything a call
// might still throw (an allocation failure, a torch check) into such a message.
#pragma once
#include <exception>
#include <sstream>
#include <string>

namespace lmc_errors {

template <typename... Parts>
std::string message(const char* module, const Parts&... parts) {
  std::ostringstream out;
  out << module << ": ";
  (out << ... << parts);
  return out.str();
}

template <typename F>
std::string no_throw(const char* module, const F& call) noexcept {
  try {
    return call();
  } catch (const std::exception& e) {
    return message(module, e.what());
  } catch (...) {
    return message(module, "unknown error");
  }
}

}  // namespace lmc_errors
