// Element access of the CPU kernels by DType: the storage type and its float32 conversions
// (jax_flash/numeric.h: exact widening, round-to-nearest-even narrowing).
#pragma once

#include <cstdint>

#include "cpu_math.h"  // JF_INLINE
#include "jax_flash/dtype.h"
#include "jax_flash/numeric.h"

namespace jax_flash {
namespace cpu {

template <DType DT>
struct Elem;

template <>
struct Elem<DType::kFloat32> {
  using T = float;
  static JF_INLINE float load(T x) { return x; }
  static JF_INLINE T store(float x) { return x; }
};

template <>
struct Elem<DType::kFloat16> {
  using T = uint16_t;
  static JF_INLINE float load(T x) { return numeric::half_to_float(x); }
  static JF_INLINE T store(float x) { return numeric::float_to_half(x); }
};

template <>
struct Elem<DType::kBFloat16> {
  using T = uint16_t;
  static JF_INLINE float load(T x) { return numeric::bf16_to_float(x); }
  static JF_INLINE T store(float x) { return numeric::float_to_bf16(x); }
};

}  // namespace cpu
}  // namespace jax_flash
