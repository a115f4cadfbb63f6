// The float32 GEMM micro-kernel of the CPU attention kernels (forward and backward), and the
// register-block shapes each ISA copy of a kernel uses (isa.h). Inlined into every copy.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"  // JF_INLINE, JF_RESTRICT

namespace jax_flash {
namespace cpu {

// C[M, N] (+)= A[M, K] B[K, N], float32. Element (i, k) of A is A[i * a_rs + k * a_cs]; B and C
// are row-major. M % MR == 0, N % (W * NV) == 0. An MR x (W * NV) block of C stays in registers
// over the K loop: each step broadcasts MR elements of A against NV vectors of a row of B.
// With GCC / Clang the block is held in generic vector types (vector_size; no ISA-specific
// intrinsics: the compiler lowers them to whatever the target has, e.g. 2 x SSE for a 256-bit
// type). Plain loops are not used here because the auto-vectoriser then vectorises the K loop
// with shuffles and spills the block.
template <int W, int MR, int NV, bool kAccumulate>
JF_INLINE void gemm(int M, int N, int K, const float* JF_RESTRICT A, int64_t a_rs, int64_t a_cs,
                    const float* JF_RESTRICT B, int64_t ldb, float* JF_RESTRICT C, int64_t ldc) {
  constexpr int NR = W * NV;
#if defined(__GNUC__)
  typedef float V __attribute__((vector_size(W * sizeof(float))));
  for (int i = 0; i < M; i += MR) {
    const float* a = A + i * a_rs;
    for (int j = 0; j < N; j += NR) {
      V c[MR][NV];
      for (int ii = 0; ii < MR; ++ii)
        for (int v = 0; v < NV; ++v) {
          if (kAccumulate)
            std::memcpy(&c[ii][v], C + (i + ii) * ldc + j + v * W, sizeof(V));
          else
            c[ii][v] = V{};
        }
      const float* b = B + j;
      for (int k = 0; k < K; ++k) {
        V bk[NV];
        for (int v = 0; v < NV; ++v) std::memcpy(&bk[v], b + k * ldb + v * W, sizeof(V));
        for (int ii = 0; ii < MR; ++ii) {
          const float av = a[ii * a_rs + k * a_cs];
          for (int v = 0; v < NV; ++v) c[ii][v] += av * bk[v];
        }
      }
      for (int ii = 0; ii < MR; ++ii)
        for (int v = 0; v < NV; ++v)
          std::memcpy(C + (i + ii) * ldc + j + v * W, &c[ii][v], sizeof(V));
    }
  }
#else
  for (int i = 0; i < M; i += MR) {
    const float* a = A + i * a_rs;
    for (int j = 0; j < N; j += NR) {
      float c[MR][NR];
      for (int ii = 0; ii < MR; ++ii)
        for (int jj = 0; jj < NR; ++jj) c[ii][jj] = kAccumulate ? C[(i + ii) * ldc + j + jj] : 0.0f;
      const float* b = B + j;
      for (int k = 0; k < K; ++k) {
        const float* bk = b + k * ldb;
        for (int ii = 0; ii < MR; ++ii) {
          const float av = a[ii * a_rs + k * a_cs];
          for (int jj = 0; jj < NR; ++jj) c[ii][jj] += av * bk[jj];
        }
      }
      for (int ii = 0; ii < MR; ++ii)
        for (int jj = 0; jj < NR; ++jj) C[(i + ii) * ldc + j + jj] = c[ii][jj];
    }
  }
#endif
}

// Micro-kernel shape: vectors of W floats; MR x NV vectors of C are held in registers, so a
// block of C is MR x NR with NR = W * NV.
template <int W_, int MR_, int NV_>
struct MicroTile {
  static constexpr int W = W_, MR = MR_, NV = NV_, NR = W_ * NV_;
};
using TileGeneric = MicroTile<4, 4, 2>;  // 8 accumulators of 128 bits (baseline x86-64: 16 xmm)
using TileAvx2 = MicroTile<8, 6, 2>;     // 12 accumulators of 256 bits (16 ymm)
using TileAvx512 = MicroTile<16, 6, 2>;  // 12 accumulators of 512 bits (32 zmm)

// An attention tile of BlockM query rows x BlockN keys, its extents padded for the micro-kernel.
// The rows are the N extent of S^T = K Q^T (a multiple of NR) and the M extent of a GEMM that
// produces per-row results such as dQ (of MR); the keys are the M extent of S^T (of MR).
template <class Tile, int BlockM, int BlockN>
struct PaddedTile : Tile {
  using Tile::MR;
  using Tile::NR;
  static constexpr int RC = std::max((BlockM + NR - 1) / NR * NR, (BlockM + MR - 1) / MR * MR);
  static constexpr int KR = (BlockN + MR - 1) / MR * MR;
};

// The padded tile of each micro-kernel shape, picked at run time by the CPU's vector width.
template <int BlockM, int BlockN>
struct PaddedTiles {
  using Generic = PaddedTile<TileGeneric, BlockM, BlockN>;
  using Avx2 = PaddedTile<TileAvx2, BlockM, BlockN>;
  using Avx512 = PaddedTile<TileAvx512, BlockM, BlockN>;
};

}  // namespace cpu
}  // namespace jax_flash
