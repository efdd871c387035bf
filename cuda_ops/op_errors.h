// What both torch bindings (cpu_ops.cpp, cuda_binding.cpp) share: an error is a returned message, never a
// C++ exception crossing into Python (lmcache_vllm.ops raises it there). `no_throw` turns anything a call
// might still throw (an allocation failure, a torch check) into such a message.
//
// Messages are built by appending strings, never through iostreams: on the H200 host of 2026-11-30
// (extension built by /opt/gcc's g++, run against the system's libstdc++), inserting an integer into a
// std::ostringstream inside the extension segfaulted, while strings alone went through. Integers here go
// through std::to_string, torch's types through their own string functions.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <exception>
#include <string>
#include <type_traits>

namespace lmc_errors {

inline void append(std::string& out, const char* part) { out += part ? part : "(null)"; }
inline void append(std::string& out, const std::string& part) { out += part; }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
inline void append(std::string& out, c10::ScalarType type) { out += c10::toString(type); }
inline void append(std::string& out, c10::IntArrayRef values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  out += ']';
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Parts>
std::string message(const char* module, const Parts&... parts) {
  std::string out(module);
  out += ": ";
  (append(out, parts), ...);
  return out;
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
