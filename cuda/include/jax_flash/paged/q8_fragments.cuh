// The tensor-core paged decode kernel's 8-bit-cache fragments (paged_attention_mma.cuh): the
// head-dim permutations under which 8-bit K and V rows load straight into mma B fragments, and
// the conversions of cache codes to float16 inside those fragments (int8 and e4m3, exact and
// unscaled; int8 K biased, cvt4_k). Device code only; no XLA headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "jax_flash/paged/ptx.cuh"  // e4m3x4_to_f16x2

namespace jax_flash {
namespace paged {

namespace q8 {

// Logical word (pair of 16-bit elements) of a query row of head dim D that holds physical word
// P (elements 2P, 2P + 1) for the 8-bit K path: physical d = 64 j + 16 t + 4 i + 2 h sits at
// logical element 16 (4 j + i) + 2 t + 8 h, where the mma's A fragment of k-step 4 j + i expects
// the columns that lane t's K word i supplies.
__device__ __forceinline__ int q_perm_word(int P) {
  return ((P >> 5) * 4 + ((P >> 1) & 3)) * 8 + ((P >> 3) & 3) + 4 * (P & 1);
}

// Head-dim index of output column n (0..7) of n8-tile dt of the 8-bit V path: lane (g, t) loads
// the bytes vcol(g, 0..D/8-1) of its V rows (16 contiguous bytes per 128 columns; D = 64: 8).
template <int D>
__device__ __forceinline__ int vcol(int n, int dt) {
  if constexpr (D == 64) {
    return 8 * n + dt;
  } else {
    return 128 * (dt >> 4) + 16 * n + (dt & 15);
  }
}

// 4 int8 codes x (the bytes of w, low first) -> two registers of two float16 values 1152 + x
// (codes 0, 1 -> lo; 2, 3 -> hi), exact: the byte x + 128 under float16's 0x64 exponent byte is
// 1024 + x + 128.
__device__ __forceinline__ void int8x4_to_f16x2_biased(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t x = w ^ 0x80808080u;
  lo = __byte_perm(x, 0x64646464u, 0x4140);
  hi = __byte_perm(x, 0x64646464u, 0x4342);
}

// 4 cache codes (the bytes of w, low first) -> two registers of two float16 values (codes 0, 1
// -> lo; 2, 3 -> hi), exact and unscaled (|int8| <= 128 and every e4m3 value are float16 values).
template <typename TC>
__device__ __forceinline__ void cvt4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (std::is_same_v<TC, int8_t>) {
    uint32_t a, b;
    int8x4_to_f16x2_biased(w, a, b);
    const __half2 off = __half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
    __half2 ha, hb;
    memcpy(&ha, &a, 4);
    memcpy(&hb, &b, 4);
    ha = __hsub2(ha, off);
    hb = __hsub2(hb, off);
    memcpy(&lo, &ha, 4);
    memcpy(&hi, &hb, 4);
  } else {
    e4m3x4_to_f16x2(w, lo, hi);
  }
}

// K codes as Q K^T's B operand: e4m3 as cvt4; int8 biased (1152 + code, without cvt4's
// subtract), so that every score carries 1152 * (the sum of its q row), which the kernel takes
// off in float32 (kBiasK).
template <typename TC>
__device__ __forceinline__ void cvt4_k(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (std::is_same_v<TC, int8_t>) {
    int8x4_to_f16x2_biased(w, lo, hi);
  } else {
    cvt4<TC>(w, lo, hi);
  }
}

// V fragments of one column group: wa, wb hold 4 columns (bytes) of keys 2t, 2t + 1 (or 2t + 8,
// 2t + 9); f[e] = the two keys' float16 values of column e (low half: the first key), exact.
template <typename TC>
__device__ __forceinline__ void cvt4_v(uint32_t wa, uint32_t wb, uint32_t (&f)[4]) {
  cvt4<TC>(__byte_perm(wa, wb, 0x5140), f[0], f[1]);
  cvt4<TC>(__byte_perm(wa, wb, 0x7362), f[2], f[3]);
}

// Largest |x| of the two bfloat16 values of a word.
__device__ __forceinline__ float bf16_absmax2(uint32_t w) {
  return fmaxf(fabsf(__uint_as_float(w << 16)), fabsf(__uint_as_float(w & 0xffff0000u)));
}

// A word of two bfloat16 q values -> two float16 values times 2^-sh (exact where the product is
// a normal float16; see the kernel's Q load); float16 words as they are.
template <typename T>
__device__ __forceinline__ uint32_t q_to_f16(uint32_t w, float scale) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __half2 h = __floats2half2_rn(__uint_as_float(w << 16) * scale,
                                        __uint_as_float(w & 0xffff0000u) * scale);
    uint32_t r;
    memcpy(&r, &h, 4);
    return r;
  } else {
    return w;
  }
}

}  // namespace q8

}  // namespace paged
}  // namespace jax_flash
