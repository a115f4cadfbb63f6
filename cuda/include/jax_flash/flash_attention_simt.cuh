// SIMT (CUDA-core) fused prefill attention: the fallback kernel for every dtype and every option
// of the FlashParams contract (flash_params.h). float32 accumulation, no tensor cores.
//
// Work decomposition: one CTA computes a block of BM query rows of one sequence for one query
// head, looping over the visible key blocks of BN rows (online softmax). Q, K and V tiles are
// converted to float32 in shared memory; each warp owns WM = BM / warps query rows; inside a
// warp, lane = rg * 8 + cg, and a thread owns rows {rg + 4 i} of its warp's rows, score columns
// {cg + 8 j} of the key block, and output columns {4 (cg + 8 jj) .. + 3}. Row statistics are
// reduced over the 8 lanes of a row group with shuffles; P goes through a per-warp shared
// buffer (optionally overlaying the K tile). Global loads are 16-byte when every tensor's
// pointer, row stride and head dims allow it, element loads otherwise; out-of-range K/V rows are
// never read and are zero-filled in shared memory. A q block only visits the key blocks that
// some of its rows can see; masking is per element.
//
// Grid: x = ceil(total_q / BM) + batch tile slots (each CTA walks the sequences to find its q
// block, see flash_find_tile_warp; CTAs loop with a stride of gridDim.x so that nothing is
// skipped even if sequences overlap), y = query heads (looping if there are more than 65535).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/flash_params.h"
#include "jax_flash/launch.cuh"

namespace jax_flash {
namespace simt {

// kMaxD: bound on head_dim and head_dim_v. BM x BN tile, kWarps warps. kAliasP: P reuses the K
// buffer (less shared memory, one more barrier per key block). kMinBlocks: __launch_bounds__.
// kUnroll: unroll factor of the head-dim loop of Q K^T and of the key loop of P V.
// kPipeline: global loads run under compute (V of block n is loaded while Q K^T of block n is
// computed, K of block n + 1 while P V of block n is), staged in registers.
template <int kMaxD_, int kBM_, int kBN_, int kWarps_, bool kAliasP_, int kMinBlocks_,
          int kUnroll_ = 2, bool kPipeline_ = false>
struct Config {
  static constexpr int kMaxD = kMaxD_;
  static constexpr int kBM = kBM_;
  static constexpr int kBN = kBN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kAliasP = kAliasP_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kUnroll = kUnroll_;
  static constexpr bool kPipeline = kPipeline_;
  static constexpr int kRG = 4;  // row groups per warp
  static constexpr int kCG = 8;  // lanes per row group
  static constexpr int kWM = kBM / kWarps;
  static constexpr int kTM = kWM / kRG;          // rows per thread
  static constexpr int kTN = kBN / kCG;          // score columns per thread
  static constexpr int kNJ = kMaxD / (4 * kCG);  // float4 output chunks per thread
  // Shared memory (floats) at head dims kMaxD (see smem_layout), and the CTAs per SM that fit
  // in sm_80's 164 KB (1 KB reserved per CTA): __launch_bounds__ asks no more than that there.
  static constexpr int kMaxStride = kMaxD + 4;  // padded_stride(kMaxD), kMaxD % 32 == 0
  static constexpr int kSmemQ = kBM * kMaxStride;
  static constexpr int kSmemKV = kBN * kMaxStride;
  static constexpr int kSmemP = kBM * (kBN + 8);
  static constexpr int kMaxSmemFloats =
      kAliasP ? kSmemQ + (kSmemKV > kSmemP ? kSmemKV : kSmemP) + kSmemKV
              : kSmemQ + 2 * kSmemKV + kSmemP;
  static constexpr int kFitSm80 = (164 * 1024) / (kMaxSmemFloats * 4 + 1024);
  static constexpr int kMinBlocksSm80 =
      kMinBlocks < kFitSm80 ? kMinBlocks : (kFitSm80 > 1 ? kFitSm80 : 1);
  static_assert(kBM % (kWarps * kRG) == 0, "BM must split over warps and row groups");
  static_assert(kBN % kCG == 0 && kBN % 4 == 0, "BN must split over lanes");
  static_assert(kMaxD % (4 * kCG) == 0, "kMaxD must be a multiple of 32");
};

// Default configurations, by element size and head-dim bound; chosen by timing the candidates
// (bf16/float32, causal B=4 S=4096 Hq=32 Hkv=8, H200). float32 would spill with the register
// pipeline. Resources (sm_90a): d64 128 regs, 36 KB smem at D=64; d128 168 regs, 66 KB at
// D=128; d256 128 regs x 256 threads (16-bit) / 222 regs (float32), 104 KB at D=256.
template <bool k16Bit, int kMaxHeadDim>
struct DefaultConfigImpl;
template <>
struct DefaultConfigImpl<true, 64> {
  using type = Config<64, 64, 32, 4, true, 4, 1, true>;
};
template <>
struct DefaultConfigImpl<true, 128> {
  using type = Config<128, 64, 32, 4, true, 3, 1, false>;  // pipelining measured slower here
};
template <>
struct DefaultConfigImpl<true, 256> {
  using type = Config<256, 64, 16, 8, false, 2, 1, true>;
};
template <>
struct DefaultConfigImpl<false, 64> {
  using type = Config<64, 64, 32, 4, true, 4, 1, false>;
};
template <>
struct DefaultConfigImpl<false, 128> {
  using type = Config<128, 64, 32, 4, true, 3, 1, false>;
};
template <>
struct DefaultConfigImpl<false, 256> {
  using type = Config<256, 32, 32, 4, false, 2, 2, false>;
};
template <typename T, int kMaxHeadDim>
struct DefaultConfig {
  using type = typename DefaultConfigImpl<sizeof(T) == 2, kMaxHeadDim>::type;
};

// Shared-memory layout in floats; computed identically on host and device from the runtime dims.
struct SmemLayout {
  int32_t dpad, dvpad;                 // head dims rounded up to a 16-byte chunk of T
  int32_t qk_stride, v_stride, p_stride;  // row strides (floats)
  int32_t off_k, off_v, off_p;         // offsets (floats); Q at 0
  int32_t total;                       // floats
};

// Row stride for rows of `x` floats (x % 4 == 0): an odd number of 16-byte units, so that the
// float4 reads of 8 consecutive rows (or 4 rows) hit distinct bank groups.
JAX_FLASH_HD int32_t padded_stride(int32_t x) { return ((x / 4) % 2 == 0) ? x + 4 : x; }

template <typename T, typename Cfg>
JAX_FLASH_HD SmemLayout smem_layout(int32_t d, int32_t dv) {
  constexpr int32_t kVec = 16 / static_cast<int32_t>(sizeof(T));
  SmemLayout L;
  L.dpad = (d + kVec - 1) / kVec * kVec;
  L.dvpad = (dv + kVec - 1) / kVec * kVec;
  L.qk_stride = padded_stride(L.dpad);
  L.v_stride = padded_stride(L.dvpad);
  L.p_stride = Cfg::kBN + 8;  // == 8 (mod 32): conflict-free scalar P stores
  const int32_t q = Cfg::kBM * L.qk_stride;
  const int32_t k = Cfg::kBN * L.qk_stride;
  const int32_t v = Cfg::kBN * L.v_stride;
  const int32_t pz = Cfg::kBM * L.p_stride;
  L.off_k = q;
  if (Cfg::kAliasP) {
    L.off_p = q;
    L.off_v = q + (k > pz ? k : pz);
    L.total = L.off_v + v;
  } else {
    L.off_v = q + k;
    L.off_p = L.off_v + v;
    L.total = L.off_p + pz;
  }
  return L;
}

// Copies kRows rows of `dim` elements (row i at g + i * g_row_stride) into shared memory as
// float (row i at s + i * s_stride), zero-filling rows >= valid_rows and columns in
// [dim, dpad). kVec: 16-byte global loads (requires dim % (16 / sizeof(T)) == 0 and 16-byte
// aligned rows); otherwise element loads. Never reads rows >= valid_rows or columns >= dim.
template <typename T, bool kVec, int kRows, int kMaxD, int kThreads>
__device__ __forceinline__ void load_tile(float* __restrict__ s, int32_t s_stride,
                                          const T* __restrict__ g, int64_t g_row_stride,
                                          int32_t valid_rows, int32_t dim, int32_t dpad,
                                          int tid) {
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  constexpr int kMaxCh = kMaxD / kV;
  constexpr int kIters = (kRows * kMaxCh + kThreads - 1) / kThreads;
  const int32_t nch = dpad / kV;
  const int32_t total = kRows * nch;
  if constexpr (kVec) {
    constexpr int kGroup = kIters < 8 ? kIters : 8;
#pragma unroll
    for (int g0 = 0; g0 < kIters; g0 += kGroup) {
      uint4 raw[kGroup];
      int32_t soff[kGroup];
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        const int32_t idx = tid + (g0 + u) * kThreads;
        raw[u] = make_uint4(0u, 0u, 0u, 0u);
        soff[u] = -1;
        if (g0 + u < kIters && idx < total) {
          const int32_t r = idx / nch;
          const int32_t c = idx - r * nch;
          soff[u] = r * s_stride + c * kV;
          if (r < valid_rows) raw[u] = load16_raw(g + r * g_row_stride + c * kV);
        }
      }
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        if (soff[u] >= 0) {
          float f[kV];
          raw16_to_float<T>(raw[u], f);
          float4* dst = reinterpret_cast<float4*>(s + soff[u]);
#pragma unroll
          for (int e = 0; e < kV / 4; ++e)
            dst[e] = make_float4(f[4 * e], f[4 * e + 1], f[4 * e + 2], f[4 * e + 3]);
        }
      }
    }
  } else {
    constexpr int kGroup = kIters < 4 ? kIters : 4;
#pragma unroll
    for (int g0 = 0; g0 < kIters; g0 += kGroup) {
      float f[kGroup][kV];
      int32_t soff[kGroup];
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        const int32_t idx = tid + (g0 + u) * kThreads;
        soff[u] = -1;
#pragma unroll
        for (int e = 0; e < kV; ++e) f[u][e] = 0.f;
        if (g0 + u < kIters && idx < total) {
          const int32_t r = idx / nch;
          const int32_t c = idx - r * nch;
          soff[u] = r * s_stride + c * kV;
          if (r < valid_rows) {
            const T* src = g + r * g_row_stride + c * kV;
#pragma unroll
            for (int e = 0; e < kV; ++e)
              if (c * kV + e < dim) f[u][e] = to_float(src[e]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        if (soff[u] >= 0) {
          float4* dst = reinterpret_cast<float4*>(s + soff[u]);
#pragma unroll
          for (int e = 0; e < kV / 4; ++e)
            dst[e] = make_float4(f[u][4 * e], f[u][4 * e + 1], f[u][4 * e + 2], f[u][4 * e + 3]);
        }
      }
    }
  }
}

// A kRows x dim tile held in registers between issuing its global loads and storing it to
// shared memory (same layout and guards as load_tile). issue() starts the loads; commit() waits
// for them (implicitly) and writes the float tile.
template <typename T, bool kVec, int kRows, int kMaxD, int kThreads>
struct TileRegs {
  static constexpr int kV = 16 / static_cast<int>(sizeof(T));
  static constexpr int kIters = (kRows * (kMaxD / kV) + kThreads - 1) / kThreads;
  uint4 raw[kVec ? kIters : 1];
  float f[kVec ? 1 : kIters][kV];
  int32_t soff[kIters];

  __device__ __forceinline__ void issue(const T* __restrict__ g, int64_t g_row_stride,
                                        int32_t valid_rows, int32_t dim, int32_t dpad,
                                        int32_t s_stride, int tid) {
    const int32_t nch = dpad / kV;
    const int32_t total = kRows * nch;
#pragma unroll
    for (int u = 0; u < kIters; ++u) {
      const int32_t idx = tid + u * kThreads;
      soff[u] = -1;
      if constexpr (kVec) {
        raw[u] = make_uint4(0u, 0u, 0u, 0u);
      } else {
#pragma unroll
        for (int e = 0; e < kV; ++e) f[u][e] = 0.f;
      }
      if (idx < total) {
        const int32_t r = idx / nch;
        const int32_t c = idx - r * nch;
        soff[u] = r * s_stride + c * kV;
        if (r < valid_rows) {
          const T* src = g + r * g_row_stride + c * kV;
          if constexpr (kVec) {
            raw[u] = load16_raw(src);
          } else {
#pragma unroll
            for (int e = 0; e < kV; ++e)
              if (c * kV + e < dim) f[u][e] = to_float(src[e]);
          }
        }
      }
    }
  }

  __device__ __forceinline__ void commit(float* __restrict__ s) const {
#pragma unroll
    for (int u = 0; u < kIters; ++u) {
      if (soff[u] >= 0) {
        float v[kV];
        if constexpr (kVec) {
          raw16_to_float<T>(raw[u], v);
        } else {
#pragma unroll
          for (int e = 0; e < kV; ++e) v[e] = f[u][e];
        }
        float4* dst = reinterpret_cast<float4*>(s + soff[u]);
#pragma unroll
        for (int e = 0; e < kV / 4; ++e)
          dst[e] = make_float4(v[4 * e], v[4 * e + 1], v[4 * e + 2], v[4 * e + 3]);
      }
    }
  }
};

__device__ __forceinline__ float f4_get(const float4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define JAX_FLASH_SIMT_MIN_BLOCKS(Cfg) (Cfg::kMinBlocksSm80)
#else
#define JAX_FLASH_SIMT_MIN_BLOCKS(Cfg) (Cfg::kMinBlocks)
#endif

template <typename T, typename Cfg, bool kVec>
__global__ void __launch_bounds__(Cfg::kThreads, JAX_FLASH_SIMT_MIN_BLOCKS(Cfg))
    flash_attention_simt_kernel(const FlashParams p) {
  constexpr int BM = Cfg::kBM, BN = Cfg::kBN, WM = Cfg::kWM, TM = Cfg::kTM, TN = Cfg::kTN;
  constexpr int NJ = Cfg::kNJ, RG = Cfg::kRG, CG = Cfg::kCG, NT = Cfg::kThreads;
  // The register-staged pipeline only for 16-byte loads (element loads need too many registers)
  // and on sm_90+ (ptxas for sm_80 spills with the extra live registers).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kPipe = Cfg::kPipeline && kVec;
#else
  constexpr bool kPipe = false;
#endif
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const SmemLayout L = smem_layout<T, Cfg>(p.head_dim, p.head_dim_v);
  float* sQ = smem;
  float* sK = smem + L.off_k;
  float* sV = smem + L.off_v;
  float* sP = smem + L.off_p;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int rg = lane / CG;
  const int cg = lane % CG;
  const int32_t D = p.head_dim;
  const int32_t Dv = p.head_dim_v;
  const int32_t nchv4 = L.dvpad / 4;  // float4 chunks of a V / O row
  const int32_t group = p.num_heads / p.num_heads_k;
  const bool use_softcap = p.softcap > 0.f;
  // Scores are kept in log2 units: x = s * log2(e).
  const float scale_log2 = p.softmax_scale * kLog2e;
  const float cap_in = use_softcap ? p.softmax_scale / p.softcap : 0.f;
  const float cap_out = p.softcap * kLog2e;

  const T* __restrict__ qg = static_cast<const T*>(p.q);
  const T* __restrict__ kg = static_cast<const T*>(p.k);
  const T* __restrict__ vg = static_cast<const T*>(p.v);
  T* __restrict__ og = static_cast<T*>(p.o);

  // First row (within the CTA's q block) owned by this thread; its rows are r0 + RG * i.
  const int r0 = warp * WM + rg;

  for (int32_t h = blockIdx.y; h < p.num_heads; h += gridDim.y) {
    const int32_t kvh = h / group;
    FlashTileCursor cur{0, 0};
    for (int64_t tile = blockIdx.x;; tile += gridDim.x) {
      FlashTile t;
      if (!flash_find_tile_warp(p, BM, tile, cur, t)) break;
      const SeqExtent e = t.ext;
      const int32_t m = t.num_m - 1 - t.m;  // last (longest under causal masks) blocks first
      const int32_t row0 = m * BM;
      const int32_t rows_valid = min(BM, e.q_len - row0);

      // Keys visible to any row of the block: lo and hi are non-decreasing in the row.
      int32_t kt_lo, kt_hi, unused;
      visible_keys(p, row0, e.q_len, e.k_len, &kt_lo, &unused);
      visible_keys(p, row0 + rows_valid - 1, e.q_len, e.k_len, &unused, &kt_hi);

      int32_t row_lo[TM], row_hi[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const int32_t r = row0 + r0 + RG * i;
        if (r < e.q_len) {
          visible_keys(p, r, e.q_len, e.k_len, &row_lo[i], &row_hi[i]);
        } else {
          row_lo[i] = 0;
          row_hi[i] = 0;
        }
      }

      float acc[TM][NJ][4];
      float row_max[TM], row_sum[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        row_max[i] = kNegInf;
        row_sum[i] = 0.f;
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[i][jj][c] = 0.f;
      }

      if (kt_lo < kt_hi) {  // uniform over the CTA
        using KRegs = TileRegs<T, kVec, BN, Cfg::kMaxD, NT>;
        // Registers of one staged K or V tile; K and V loads are issued together when both fit.
        constexpr int kTileRegs = KRegs::kIters * (kVec ? 4 : KRegs::kV);
        constexpr bool kStageKV = !kPipe && 2 * kTileRegs <= 32;
        KRegs kregs, vregs;
        const T* kbase = kg + static_cast<int64_t>(e.k_start) * p.k_row_stride +
                         static_cast<int64_t>(kvh) * D;
        const T* vbase = vg + static_cast<int64_t>(e.k_start) * p.v_row_stride +
                         static_cast<int64_t>(kvh) * Dv;
        __syncthreads();  // the previous block of this CTA is done with shared memory
        if constexpr (kPipe)
          kregs.issue(kbase + static_cast<int64_t>(kt_lo) * p.k_row_stride, p.k_row_stride,
                      min(BN, kt_hi - kt_lo), D, L.dpad, L.qk_stride, tid);
        load_tile<T, kVec, BM, Cfg::kMaxD, NT>(
            sQ, L.qk_stride,
            qg + (static_cast<int64_t>(e.q_start) + row0) * p.q_row_stride +
                static_cast<int64_t>(h) * D,
            p.q_row_stride, rows_valid, D, L.dpad, tid);

        for (int32_t n0 = kt_lo; n0 < kt_hi; n0 += BN) {
          const int32_t n_valid = min(BN, kt_hi - n0);
          __syncthreads();  // everyone is done with sK / sV / sP of the previous key block
          const T* kblk = kbase + static_cast<int64_t>(n0) * p.k_row_stride;
          const T* vblk = vbase + static_cast<int64_t>(n0) * p.v_row_stride;
          if constexpr (kPipe) {
            kregs.commit(sK);
            vregs.issue(vblk, p.v_row_stride, n_valid, Dv, L.dvpad, L.v_stride, tid);
          } else if constexpr (kStageKV) {
            kregs.issue(kblk, p.k_row_stride, n_valid, D, L.dpad, L.qk_stride, tid);
            vregs.issue(vblk, p.v_row_stride, n_valid, Dv, L.dvpad, L.v_stride, tid);
            kregs.commit(sK);
            vregs.commit(sV);
          } else {
            load_tile<T, kVec, BN, Cfg::kMaxD, NT>(sK, L.qk_stride, kblk, p.k_row_stride,
                                                   n_valid, D, L.dpad, tid);
            load_tile<T, kVec, BN, Cfg::kMaxD, NT>(sV, L.v_stride, vblk, p.v_row_stride,
                                                   n_valid, Dv, L.dvpad, tid);
          }
          __syncthreads();

          // S = Q K^T for this thread's TM x TN scores.
          float s[TM][TN];
#pragma unroll
          for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
          {
            const float* qb = sQ + r0 * L.qk_stride;
            const float* kb = sK + cg * L.qk_stride;
            const int32_t qs = RG * L.qk_stride;
            const int32_t ks = CG * L.qk_stride;
#pragma unroll Cfg::kUnroll
            for (int32_t d = 0; d < L.dpad; d += 4) {
              float4 qv[TM], kv[TN];
#pragma unroll
              for (int i = 0; i < TM; ++i)
                qv[i] = *reinterpret_cast<const float4*>(qb + i * qs + d);
#pragma unroll
              for (int j = 0; j < TN; ++j)
                kv[j] = *reinterpret_cast<const float4*>(kb + j * ks + d);
#pragma unroll
              for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                  float a = s[i][j];
                  a = fmaf(qv[i].x, kv[j].x, a);
                  a = fmaf(qv[i].y, kv[j].y, a);
                  a = fmaf(qv[i].z, kv[j].z, a);
                  a = fmaf(qv[i].w, kv[j].w, a);
                  s[i][j] = a;
                }
            }
          }

          // Scale, softcap, mask; online softmax.
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            const int32_t key = n0 + cg + CG * j;
#pragma unroll
            for (int i = 0; i < TM; ++i) {
              float x = s[i][j];
              x = use_softcap ? cap_out * tanhf(x * cap_in) : x * scale_log2;
              s[i][j] = (key >= row_lo[i] && key < row_hi[i]) ? x : kNegInf;
            }
          }
#pragma unroll
          for (int i = 0; i < TM; ++i) {
            float mx = s[i][0];
#pragma unroll
            for (int j = 1; j < TN; ++j) mx = fmaxf(mx, s[i][j]);
#pragma unroll
            for (int off = 1; off < CG; off <<= 1)
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(row_max[i], mx);
            // A row that has seen only masked keys keeps max -inf; use 0 as the reference so
            // that no -inf - -inf appears (every exponent is then exp2(-inf) = 0).
            const float m_ref = (m_new == kNegInf) ? 0.f : m_new;
            const float alpha = exp2f(row_max[i] - m_ref);
            row_max[i] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
              const float pj = exp2f(s[i][j] - m_ref);
              s[i][j] = pj;
              sum += pj;
            }
            row_sum[i] = row_sum[i] * alpha + sum;
#pragma unroll
            for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
              for (int c = 0; c < 4; ++c) acc[i][jj][c] *= alpha;
          }

          if constexpr (kPipe) vregs.commit(sV);
          // All warps are done reading sK (P overwrites it) / sV is complete (pipelined).
          if constexpr (Cfg::kAliasP || kPipe) __syncthreads();
#pragma unroll
          for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j)
              sP[(r0 + RG * i) * L.p_stride + cg + CG * j] = s[i][j];
          __syncwarp();
          if constexpr (kPipe) {
            if (n0 + BN < kt_hi)
              kregs.issue(kblk + static_cast<int64_t>(BN) * p.k_row_stride, p.k_row_stride,
                          min(BN, kt_hi - n0 - BN), D, L.dpad, L.qk_stride, tid);
          }

          // O += P V. Keys in [n_valid, 4 * ceil(n_valid / 4)) have P = 0 and V = 0.
          {
            const float* pb = sP + r0 * L.p_stride;
            const float* vb = sV + cg * 4;
            const int32_t pr = RG * L.p_stride;
            const int32_t n4 = (n_valid + 3) & ~3;
#pragma unroll Cfg::kUnroll
            for (int32_t c = 0; c < n4; c += 4) {
              float4 pv[TM];
#pragma unroll
              for (int i = 0; i < TM; ++i)
                pv[i] = *reinterpret_cast<const float4*>(pb + i * pr + c);
#pragma unroll
              for (int cc = 0; cc < 4; ++cc) {
                const float* vr = vb + (c + cc) * L.v_stride;
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj) {
                  if (cg + CG * jj < nchv4) {
                    const float4 vv = *reinterpret_cast<const float4*>(vr + jj * CG * 4);
#pragma unroll
                    for (int i = 0; i < TM; ++i) {
                      const float pc = f4_get(pv[i], cc);
                      acc[i][jj][0] = fmaf(pc, vv.x, acc[i][jj][0]);
                      acc[i][jj][1] = fmaf(pc, vv.y, acc[i][jj][1]);
                      acc[i][jj][2] = fmaf(pc, vv.z, acc[i][jj][2]);
                      acc[i][jj][3] = fmaf(pc, vv.w, acc[i][jj][3]);
                    }
                  }
                }
              }
            }
          }
        }
      }

      // Epilogue: normalize, write O and LSE. Rows that saw no key: O = 0, LSE = -inf.
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        float l = row_sum[i];
#pragma unroll
        for (int off = 1; off < CG; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        const int32_t r = row0 + r0 + RG * i;
        if (r < e.q_len) {
          const bool empty = (l == 0.f);
          const float inv = empty ? 0.f : 1.f / l;
          const int64_t grow = static_cast<int64_t>(e.q_start) + r;
          if (cg == 0)
            p.lse[static_cast<int64_t>(h) * p.total_q + grow] =
                empty ? kNegInf : (row_max[i] + log2f(l)) * kLn2;
          T* orow = og + grow * p.o_row_stride + static_cast<int64_t>(h) * Dv;
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            const int32_t col = (cg + CG * jj) * 4;
            if (col < Dv) {
              float v[4];
#pragma unroll
              for (int c = 0; c < 4; ++c) v[c] = empty ? 0.f : acc[i][jj][c] * inv;
              if constexpr (kVec) {
                store4_from_float<T>(orow + col, v[0], v[1], v[2], v[3]);
              } else {
#pragma unroll
                for (int c = 0; c < 4; ++c)
                  if (col + c < Dv) orow[col + c] = from_float<T>(v[c]);
              }
            }
          }
        }
      }
    }
  }
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Launches the kernel with an explicit configuration (the public entry point below picks the
// default one for the head-dim bound).
template <typename T, typename Cfg>
cudaError_t run_flash_attention_simt_cfg(const FlashParams& p, cudaStream_t stream) {
  if (p.dtype != DTypeOf<T>::value) return cudaErrorInvalidValue;
  // head_dim_v 0 is valid: no o, but lse is computed.
  if (p.head_dim <= 0 || p.head_dim > Cfg::kMaxD || p.head_dim_v < 0 || p.head_dim_v > Cfg::kMaxD)
    return cudaErrorInvalidValue;
  if (p.batch < 0 || p.total_q < 0 || p.total_k < 0 || p.num_heads < 0)
    return cudaErrorInvalidValue;
  if (p.batch == 0 || p.total_q == 0 || p.num_heads == 0 || p.max_seqlen_q <= 0)
    return cudaSuccess;
  if (p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0) return cudaErrorInvalidValue;

  constexpr int64_t kEs = sizeof(T);
  const bool vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.o) &&
                   (p.q_row_stride * kEs) % 16 == 0 && (p.k_row_stride * kEs) % 16 == 0 &&
                   (p.v_row_stride * kEs) % 16 == 0 && (p.o_row_stride * kEs) % 16 == 0 &&
                   (p.head_dim * kEs) % 16 == 0 && (p.head_dim_v * kEs) % 16 == 0;

  const SmemLayout L = smem_layout<T, Cfg>(p.head_dim, p.head_dim_v);
  const size_t smem_bytes = static_cast<size_t>(L.total) * sizeof(float);

  const int64_t slots = flash_num_tile_slots(p, Cfg::kBM);
  const dim3 grid(static_cast<unsigned>(slots),
                  static_cast<unsigned>(p.num_heads < 65535 ? p.num_heads : 65535), 1);

  return dispatch_bool(vec, [&](auto vec_c) {
    return launch_with_smem<flash_attention_simt_kernel<T, Cfg, decltype(vec_c)::value>>(
        grid, Cfg::kThreads, smem_bytes, stream, p);
  });
}

}  // namespace simt

// Fused prefill attention on CUDA cores. T: float, __half or __nv_bfloat16 (must match
// p.dtype); kMaxHeadDim (64, 128 or 256) bounds head_dim (in [1, kMaxHeadDim]) and head_dim_v
// (in [0, kMaxHeadDim]). Does not clear uncovered rows: call flash_attention_fill_uncovered
// first when p.fill_uncovered is set. Asynchronous on `stream`; returns the launch status.
template <typename T, int kMaxHeadDim>
cudaError_t run_flash_attention_simt(const FlashParams& p, cudaStream_t stream) {
  return simt::run_flash_attention_simt_cfg<T, typename simt::DefaultConfig<T, kMaxHeadDim>::type>(
      p, stream);
}

// Instantiated once each in the files flash_attention_simt_{f32,f16,bf16}_d{64,128,256}.cu that
// cuda/src/instantiations.cmake generates.
#define JAX_FLASH_DECLARE_SIMT(T, D) \
  extern template cudaError_t run_flash_attention_simt<T, D>(const FlashParams&, cudaStream_t);
JAX_FLASH_DECLARE_SIMT(float, 64)
JAX_FLASH_DECLARE_SIMT(float, 128)
JAX_FLASH_DECLARE_SIMT(float, 256)
JAX_FLASH_DECLARE_SIMT(__half, 64)
JAX_FLASH_DECLARE_SIMT(__half, 128)
JAX_FLASH_DECLARE_SIMT(__half, 256)
JAX_FLASH_DECLARE_SIMT(__nv_bfloat16, 64)
JAX_FLASH_DECLARE_SIMT(__nv_bfloat16, 128)
JAX_FLASH_DECLARE_SIMT(__nv_bfloat16, 256)
#undef JAX_FLASH_DECLARE_SIMT

}  // namespace jax_flash
