// Error helpers of the FFI handlers of every op: the one form of an invalid-argument error
// ("jax_flash.<op>: <message>", which the Python layer shows as is) and the shape printing the
// messages use.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_flash {

// kInvalidArgument error of op `op` (its public name, e.g. "apply_rope").
inline xla::ffi::Error invalid(const char* op, const std::string& msg) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument,
                         std::string("jax_flash.") + op + ": " + msg);
}

// "[d0, d1, ...]"
inline std::string dims_str(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string dims_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t d : dims) s += (i++ ? ", " : "") + std::to_string(d);
  return s + "]";
}

}  // namespace jax_flash
