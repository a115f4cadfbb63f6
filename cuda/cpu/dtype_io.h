// Element access of the CPU kernels by DType: the storage type and its float32 conversions
// (jax_flash/numeric.h: exact widening, round-to-nearest-even narrowing).
#pragma once

#include <cstdint>

#include "jax_flash/flash_params.h"  // DType
#include "jax_flash/numeric.h"

namespace jax_flash {
namespace cpu {

template <DType DT>
struct Elem;

template <>
struct Elem<DType::kFloat32> {
  using T = float;
  static float load(T x) { return x; }
  static T store(float x) { return x; }
};

template <>
struct Elem<DType::kFloat16> {
  using T = uint16_t;
  static float load(T x) { return numeric::half_to_float(x); }
  static T store(float x) { return numeric::float_to_half(x); }
};

template <>
struct Elem<DType::kBFloat16> {
  using T = uint16_t;
  static float load(T x) { return numeric::bf16_to_float(x); }
  static T store(float x) { return numeric::float_to_bf16(x); }
};

}  // namespace cpu
}  // namespace jax_flash
