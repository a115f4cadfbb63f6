// Tensor-core attention backward for float16 / bfloat16 (FlashAttention-2 design, mma.sync).
//
// One CTA owns one key block of kBlockN rows of one kv head of one sequence and visits, for every
// query head of the kv head's group (GQA), every query block of kBlockM rows that sees one of its
// keys. Each 16-key slab of the block belongs to kDSplit warps, each of which keeps the slab's dK
// and dV in registers across all visits (no repeated K/V, no atomics for dK/dV) for its 1 /
// kDSplit share of the head dim's columns: head dims 64 and 128 one warp per slab (the whole row,
// up to 128 + 128 accumulator registers a thread), the 256-wide tile two (128 + 128 again).
// Everything is computed transposed, keys as the M dimension of the mma, so that P^T and dS^T
// are A fragments for dV and dK:
//   dP^T = V dO^T,  S^T = K Q^T            (ldmatrix.x4 of K/V rows, Q/dO rows as B; a split
//                                           slab's warps take 1 / kDSplit of the queries each)
//   P^T  = exp2(S^T * scale * log2 e - lse * log2 e), dS^T = P^T (dP^T - Delta) (* (1 - tanh^2))
//   dV  += P^T dO,  dK += dS^T Q           (one warp a slab: P^T, dS^T converted in registers
//                                           to A fragments; split slabs: both staged in shared
//                                           memory, each warp reading back all the block's
//                                           queries with ldmatrix.x4; dO/Q by ldmatrix.x4.trans)
//   dQ  += dS K                            (dS^T staged in shared memory; every warp takes a
//                                           16-row x head_dim/2 slice of the block's dQ)
// Splitting the queries of S^T / dP^T, rather than both warps of a slab computing all of them,
// saves 2/7 of a warp's mma's a visit (320 instead of 448 at d=256) and 32 registers a thread
// (ptxas: 4-32 bytes of spills on sm_90a instead of 32-88), for 8 KB of shared memory (P^T) and
// a barrier before dV / dK.
// dQ is added to a float32 accumulator with atomics; the deterministic mode makes the key blocks
// of a query block add their shares in ascending key-block order (a per-(head, query tile) turn
// counter, waited for by one thread while the others stage dS; the tiles visited in descending
// order, flash_bwd_visit), so every float addition happens in the same order on every run.
// Q/dO (and lse/Delta) of the next visit load with cp.async under the current one
// (double-buffered, kQStages 2), or, where shared memory holds one Q/dO buffer only (the 256-wide
// tile on sm_80: 163 KB), under the current visit's dQ product, which reads only dS^T and K.
//
// Head dims: tiles 64 and 128 take D == Dv == the tile exactly; the 256-wide tile takes D == Dv
// in (128, 256], multiples of 16, zero-padded (kPad: rows load at their own width, the tile's
// other chunks zero-filled; S^T and dP^T skip their 32-column steps past D, dQ its 64-column
// passes wholly past D; dQ, dK, dV written at D columns).
//
// Scheduling: grid.x enumerates the key blocks of all sequences in order (lowest first, so the
// heaviest blocks under causal masking start first and a block's turn-order predecessors are
// always scheduled before it), grid.y the kv heads.
//
// No XLA headers: the FFI layer fills FlashBwdParams and calls run_flash_attention_bwd_mma.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_attention_bwd_common.cuh"
#include "jax_flash/flash_attention_mma.cuh"
#include "jax_flash/flash_bwd_params.h"
#include "jax_flash/launch.cuh"
#include "jax_flash/mma_sync.cuh"
#include "jax_flash/policy/flash.h"
#include "jax_flash/softmax.cuh"

namespace jax_flash {

namespace mma_bwd {

using namespace mma_detail;

// Tile shape: kBlockN key rows per CTA (a 16-row slab per kDSplit warps), kBlockM query rows
// per visit, kQStages Q/dO buffers; kPad: head dims below kHeadDim run zero-padded.
template <int kHeadDim_, int kBlockM_, int kWarps_, int kDSplit_ = 1, int kQStages_ = 2,
          bool kPad_ = false>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kDSplit = kDSplit_;
  static constexpr int kQStages = kQStages_;
  static constexpr bool kPad = kPad_;
  static constexpr int kSlabs = kWarps / kDSplit;
  static constexpr int kBlockN = 16 * kSlabs;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row (load_tile's names)
  static constexpr int kLoadRowsPerPass = kThreads / kChunks;
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kDsRowBytes = kBlockM * 2;  // dS^T staging: [kBlockN keys][kBlockM]
  static constexpr int kSmemKV = kBlockN * kRowBytes;
  static constexpr int kSmemQ = kBlockM * kRowBytes;  // one Q or one dO buffer
  static constexpr int kSmemDs = kBlockN * kDsRowBytes;
  // P^T staging, where the warps of a slab share P^T (and dS^T) through shared memory.
  static constexpr int kSmemP = kDSplit > 1 ? kSmemDs : 0;
  static constexpr int kSmemBytes =
      2 * kSmemKV + 2 * kQStages * kSmemQ + kSmemDs + kSmemP + 2 * 2 * kBlockM * 4;
  // S^T / dP^T: every warp computes its slab's 16 keys x kSQueries of the block's queries.
  static constexpr int kSQueries = kBlockM / kDSplit;
  // dK / dV: every warp keeps kKvCols columns of its slab's 16 rows.
  static constexpr int kKvCols = kHeadDim / kDSplit;
  // dQ: every warp takes one 16-row slice and 1/kDqSplit of the head dim.
  static constexpr int kDqSplit = kWarps / (kBlockM / 16);
  static constexpr int kDqCols = kHeadDim / kDqSplit;

  static_assert(kHeadDim % 64 == 0, "rows must span whole 128-byte swizzle atoms");
  static_assert(kBlockM == 64, "the dS^T staging rows are one 128-byte swizzle atom");
  static_assert(kWarps % kDSplit == 0 && kKvCols % 16 == 0 && kSQueries % 16 == 0,
                "bad dK / dV or S^T split");
  static_assert(kWarps % (kBlockM / 16) == 0 && kDqCols % 16 == 0, "bad dQ split");
  static_assert(kQStages == 1 || kQStages == 2, "1 or 2 Q / dO buffers");
  static_assert(kBlockM % kLoadRowsPerPass == 0 && kBlockN % kLoadRowsPerPass == 0,
                "tiles must be loaded in whole passes");
};

// d=128: 145 KB of shared memory, one CTA (8 warps) per SM; d=64: 81 KB.
template <int kHeadDim>
using DefaultBwdTraits = BwdTraits<kHeadDim, 64, 8>;

// The 256-wide tile (D in (128, 256]): 8 warps, two per 16-key slab (64 keys a CTA), 64 + 64
// dK / dV accumulators a thread as at d=128. Shared memory: K, V 64 KB, Q / dO 128 KB
// double-buffered (209 KB with dS^T, P^T, lse, Delta: sm_90's 227 KB) or 64 KB single (145 KB:
// sm_80's 163 KB); 99 KB devices (sm_86 / sm_89) keep the SIMT kernel. Exact D = 256 runs the
// padded variant too: its checks are 8 + 2 uniform branches a visit, around 32-column steps of
// S^T / dP^T and dQ passes.
template <int kQStages>
using WideBwdTraits = BwdTraits<256, 64, 8, 2, kQStages, true>;

__device__ __forceinline__ void add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

template <typename T, class Tr, bool kSoftcap, bool kDeterministic>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_bwd_mma_kernel(const __grid_constant__ FlashBwdParams p, const FlashBwdWorkspace ws) {
  constexpr int D = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int R = Tr::kRowBytes;
  constexpr int RS = Tr::kDsRowBytes;
  constexpr int QS = Tr::kQStages;
  constexpr bool kPad = Tr::kPad;
  constexpr int kMN = Tr::kSQueries / 8;  // n8 tiles of S^T per warp (query columns)
  constexpr int kDT = Tr::kKvCols / 8;    // n8 tiles of dK / dV per warp
  const FlashParams& f = p.fwd;
  // The head dim: the tile's, or the call's (D == Dv, a multiple of 16) when padded.
  const int hd = kPad ? f.head_dim : D;

  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sK = smem_addr(smem);
  const uint32_t sV = sK + Tr::kSmemKV;
  const uint32_t sQ = sV + Tr::kSmemKV;        // QS buffers
  const uint32_t sdO = sQ + QS * Tr::kSmemQ;   // QS buffers
  const uint32_t sdS = sdO + QS * Tr::kSmemQ;
  const uint32_t sP = sdS + Tr::kSmemDs;  // kDSplit > 1 only
  float* s_lse = reinterpret_cast<float*>(smem + 2 * Tr::kSmemKV + 2 * QS * Tr::kSmemQ +
                                          Tr::kSmemDs + Tr::kSmemP);
  float* s_delta = s_lse + 2 * BM;  // both [2][BM]

  const int kv_head = blockIdx.y;
  FlashBwdVisits v;
  // False past the last key tile, or when no query tile sees its keys (dk, dv then stay the
  // launcher's zeros).
  if (!flash_bwd_find_visits(f, BN, BM, blockIdx.x, &v)) return;
  const SeqExtent& e = v.kt.ext;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  // This warp's key rows within the block, its share of the slab (the first 16-byte chunk of
  // its dK / dV columns, the first query of its S^T columns).
  const int kr0 = (Tr::kDSplit == 1 ? warp : warp % Tr::kSlabs) * 16;
  const int part = Tr::kDSplit == 1 ? 0 : warp / Tr::kSlabs;
  const int kv_c0 = part * kDT;
  const int sq0 = part * Tr::kSQueries;

  // ldmatrix lane addresses (row % 8 == lane % 8 throughout, see chunk_pair):
  //   A from [m][k] rows (K, V):            row lane % 16, chunk lane / 16
  //   B from [n][k] rows (Q, dO as n = query; dS^T as A^T): row (lane/16)*8 + lane%8, chunk lane/8%2
  //   B^T from [k][n] rows (dO, Q, K):      row (lane/8%2)*8 + lane%8, chunk lane / 16
  const uint32_t a_lane = (kr0 + (lane & 15)) * R + (((lane >> 4) ^ (lane & 7)) << 4);
  const int b_row = ((lane >> 4) & 1) * 8 + (lane & 7);
  const uint32_t b_lane = b_row * R + ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
  const uint32_t ds_lane = b_row * RS + ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
  const uint32_t bt_lane =
      (((lane >> 3) & 1) * 8 + (lane & 7)) * R + ((((lane >> 4) & 1) ^ (lane & 7)) << 4);
  //   A from the staged [key][query] P^T / dS^T rows (split slabs): as K / V's
  const uint32_t pds_lane = (kr0 + (lane & 15)) * RS + (((lane >> 4) ^ (lane & 7)) << 4);

  const ScoreScale score = score_scale<kSoftcap>(f);
  const float scale_log2 = score.scale_log2, softcap_in = score.softcap_in;
  int d_min, d_max;
  flash_diag_band(f, v.q_len, v.k_len, &d_min, &d_max);

  const T* q_base = static_cast<const T*>(f.q) + static_cast<int64_t>(e.q_start) * f.q_row_stride;
  const T* do_base =
      static_cast<const T*>(p.dout) + static_cast<int64_t>(e.q_start) * p.dout_row_stride;

  auto visit = [&](int it, int* h, int* m) {
    flash_bwd_visit(v, kv_head, it, h, m);
  };
  auto load_q_do = [&](int it, int buf) {
    int h, m;
    visit(it, &h, &m);
    const int m0 = m * BM;
    load_tile<Tr, BM, true, kPad>(sQ + buf * Tr::kSmemQ, q_base + static_cast<int64_t>(h) * hd,
                                  f.q_row_stride, m0, v.q_len, hd / 8, tid);
    load_tile<Tr, BM, true, kPad>(sdO + buf * Tr::kSmemQ, do_base + static_cast<int64_t>(h) * hd,
                                  p.dout_row_stride, m0, v.q_len, hd / 8, tid);
  };
  // lse in log2 units (the workspace's lse_log2: +inf for rows that saw no key, lse = -inf),
  // +inf for rows past the sequence: their weights are exp2(-inf) = 0.
  auto read_lse = [&](int it, float* lse2, float* delta) {
    int h, m;
    visit(it, &h, &m);
    const int row = m * BM + tid;
    *lse2 = INFINITY;
    *delta = 0.f;
    if (tid < BM && row < v.q_len) {
      const int64_t at = static_cast<int64_t>(h) * ws.row_stride + e.q_start + row;
      *lse2 = ws.lse_log2[at];
      *delta = ws.delta[at];
    }
  };

  {
    const int64_t kv_off = static_cast<int64_t>(kv_head) * hd;
    load_tile<Tr, BN, true, kPad>(sK, static_cast<const T*>(f.k) +
                                          static_cast<int64_t>(e.k_start) * f.k_row_stride + kv_off,
                                  f.k_row_stride, v.n0, v.k_len, hd / 8, tid);
    load_tile<Tr, BN, true, kPad>(sV, static_cast<const T*>(f.v) +
                                          static_cast<int64_t>(e.k_start) * f.v_row_stride + kv_off,
                                  f.v_row_stride, v.n0, v.k_len, hd / 8, tid);
    load_q_do(0, 0);
    cp_async_commit();
    float l, d;
    read_lse(0, &l, &d);
    if (tid < BM) {
      s_lse[tid] = l;
      s_delta[tid] = d;
    }
  }

  float acc_dk[kDT][4], acc_dv[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc_dk[i][j] = acc_dv[i][j] = 0.f;
  }

  int32_t* pending_turn = nullptr;  // deterministic: the counter to advance after a barrier
  for (int it = 0; it < v.items; ++it) {
    const int buf = it & 1;             // lse / Delta buffer
    const int qbuf = QS == 2 ? buf : 0;  // Q / dO buffer
    int h, m;
    visit(it, &h, &m);
    const int m0 = m * BM;
    const uint32_t sQ_cur = sQ + qbuf * Tr::kSmemQ;
    const uint32_t sdO_cur = sdO + qbuf * Tr::kSmemQ;

    cp_async_wait<0>();
    __syncthreads();  // Q/dO/lse of this visit ready; every warp is done with the last one
    if constexpr (kDeterministic) {
      if (tid == 0) flash_bwd_pass_dq_turn(pending_turn);
      pending_turn = nullptr;
    }
    float next_lse = INFINITY, next_delta = 0.f;
    if (it + 1 < v.items) {
      if constexpr (QS == 2) load_q_do(it + 1, buf ^ 1);
      read_lse(it + 1, &next_lse, &next_delta);
    }
    if constexpr (QS == 2) cp_async_commit();

    // dP^T = V dO^T and S^T = K Q^T for this warp's 16 keys x kSQueries queries from sq0.
    float dp[kMN][4], s[kMN][4];
#pragma unroll
    for (int i = 0; i < kMN; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) dp[i][j] = s[i][j] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // Padded: 32-column steps wholly past D are skipped (a 16-column rest multiplies zeros),
      // so that each branch encloses enough loads and mma's for them to overlap.
      if (kPad && kk % 2 == 0 && kk * 16 >= hd) break;
      uint32_t va[4], ka[4];
      ldmatrix_x4(va, chunk_pair(sV + a_lane, kk));
      ldmatrix_x4(ka, chunk_pair(sK + a_lane, kk));
#pragma unroll
      for (int np = 0; np < kMN / 2; ++np) {
        uint32_t ob[4], qb[4];
        ldmatrix_x4(ob, chunk_pair(sdO_cur + b_lane, kk) + (sq0 + np * 16) * R);
        ldmatrix_x4(qb, chunk_pair(sQ_cur + b_lane, kk) + (sq0 + np * 16) * R);
        mma_16816<T>(dp[2 * np], va, ob[0], ob[1]);
        mma_16816<T>(dp[2 * np + 1], va, ob[2], ob[3]);
        mma_16816<T>(s[2 * np], ka, qb[0], qb[1]);
        mma_16816<T>(s[2 * np + 1], ka, qb[2], qb[3]);
      }
    }

    // P^T and dS^T (s becomes P^T, dp becomes dS^T).
    int lo, hi;
    flash_tile_keys(f, m0, min(BM, v.q_len - m0), v.q_len, v.k_len, &lo, &hi);
    int lo_last, hi_first, unused;
    visible_keys(f, m0 + min(BM, v.q_len - m0) - 1, v.q_len, v.k_len, &lo_last, &unused);
    visible_keys(f, m0, v.q_len, v.k_len, &unused, &hi_first);
    const bool need_mask = v.n0 < lo_last || v.n0 + BN > hi_first;
    const float* lse_cur = s_lse + buf * BM;
    const float* delta_cur = s_delta + buf * BM;
#pragma unroll
    for (int nt = 0; nt < kMN; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = sq0 + nt * 8 + 2 * t + c;
        const float l2 = lse_cur[col];
        const float dl = delta_cur[col];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 2 * hf + c;
          float x = s[nt][i];
          if constexpr (kSoftcap) x = softcap_tanh(x * softcap_in);
          float pv = fast_exp2(fmaf(x, scale_log2, -l2));
          if (need_mask) {
            const int j = v.n0 + kr0 + g + 8 * hf;
            const int dj = j - (m0 + col);
            if (j >= v.k_len || dj < d_min || dj > d_max) pv = 0.f;
          }
          float ds = pv * (dp[nt][i] - dl);
          if constexpr (kSoftcap) ds *= 1.f - x * x;
          s[nt][i] = pv;
          dp[nt][i] = ds;
        }
      }
    }

    // dV += P^T dO, dK += dS^T Q over the 16 queries of step kk, from A fragments pa / da.
    auto dkdv_step = [&](int kk, const uint32_t(&pa)[4], const uint32_t(&da)[4]) {
#pragma unroll
      for (int dp2 = 0; dp2 < kDT / 2; ++dp2) {
        // This warp's column pair of the head dim (padded: pairs past D multiply zeros, which
        // no branch around these small steps would save).
        const int pair = kv_c0 / 2 + dp2;
        uint32_t ob[4], qb[4];
        ldmatrix_x4_trans(ob, chunk_pair(sdO_cur + bt_lane, pair) + kk * 16 * R);
        ldmatrix_x4_trans(qb, chunk_pair(sQ_cur + bt_lane, pair) + kk * 16 * R);
        mma_16816<T>(acc_dv[2 * dp2], pa, ob[0], ob[1]);
        mma_16816<T>(acc_dv[2 * dp2 + 1], pa, ob[2], ob[3]);
        mma_16816<T>(acc_dk[2 * dp2], da, qb[0], qb[1]);
        mma_16816<T>(acc_dk[2 * dp2 + 1], da, qb[2], qb[3]);
      }
    };
    // A fragment x (rows kr0 + g (+8), query chunks 2q (+1)) to a [key][query] staging tile.
    auto stage = [&](uint32_t tile, int q, const uint32_t(&x)[4]) {
      st_shared_b32(tile + swizzle<BM / 8>(kr0 + g, 2 * q) + 4 * t, x[0]);
      st_shared_b32(tile + swizzle<BM / 8>(kr0 + g + 8, 2 * q) + 4 * t, x[1]);
      st_shared_b32(tile + swizzle<BM / 8>(kr0 + g, 2 * q + 1) + 4 * t, x[2]);
      st_shared_b32(tile + swizzle<BM / 8>(kr0 + g + 8, 2 * q + 1) + 4 * t, x[3]);
    };
    // This warp's 16-query steps: dS^T to shared memory for dQ; one warp a slab goes on with
    // dV / dK from registers, split slabs stage P^T too and share them after the barrier.
#pragma unroll
    for (int kk = 0; kk < kMN / 2; ++kk) {
      uint32_t pa[4], da[4];
      pa[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      da[0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
      if constexpr (Tr::kDSplit == 1) {
        stage(sdS, kk, da);
        dkdv_step(kk, pa, da);
      } else {
        stage(sdS, sq0 / 16 + kk, da);
        stage(sP, sq0 / 16 + kk, pa);
      }
    }
    if (tid < BM) {
      s_lse[(buf ^ 1) * BM + tid] = next_lse;
      s_delta[(buf ^ 1) * BM + tid] = next_delta;
    }

    // Deterministic: wait until the key blocks before this one have added their dQ shares of
    // this (head, query block): lo / BN is the first key block that visits it.
    int32_t* turn = nullptr;
    if constexpr (kDeterministic) turn = flash_bwd_take_dq_turn(ws, v.kt, h, m, lo, BN, tid == 0);
    __syncthreads();  // dS^T (P^T) staged; one warp a slab: done with this visit's Q / dO
    if constexpr (Tr::kDSplit > 1) {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t pa[4], da[4];
        ldmatrix_x4(pa, chunk_pair(sP + pds_lane, kk));
        ldmatrix_x4(da, chunk_pair(sdS + pds_lane, kk));
        dkdv_step(kk, pa, da);
      }
    }
    if constexpr (QS == 1) {
      if constexpr (Tr::kDSplit > 1) __syncthreads();  // every warp is done with Q / dO
      if (it + 1 < v.items) load_q_do(it + 1, 0);
      cp_async_commit();
    }

    // dQ (unscaled) += dS K: rows 16 * (warp % (BM/16)), columns kDqCols * (warp / (BM/16)), in
    // passes of at most 64 columns (32 accumulators: the 256-wide tile's 128 columns at once
    // would spill next to the dK / dV accumulators).
    {
      constexpr int kPassCols = Tr::kDqCols < 64 ? Tr::kDqCols : 64;
      constexpr int kDqT = kPassCols / 8;
      const int mt = warp % (BM / 16);
#pragma unroll
      for (int pass = 0; pass < Tr::kDqCols / kPassCols; ++pass) {
        // First column chunk of the pass (padded: a pass wholly past D is skipped; one partly
        // past it multiplies the zero columns of sK and adds only the columns below D).
        const int c0 = (warp / (BM / 16)) * (Tr::kDqCols / 8) + pass * kDqT;
        if (kPad && c0 * 8 >= hd) break;
        float dq[kDqT][4];
#pragma unroll
        for (int i = 0; i < kDqT; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) dq[i][j] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, chunk_pair(sdS + ds_lane, mt) + kk * 16 * RS);
#pragma unroll
          for (int dp2 = 0; dp2 < kDqT / 2; ++dp2) {
            uint32_t kb[4];
            ldmatrix_x4_trans(kb, chunk_pair(sK + bt_lane, c0 / 2 + dp2) + kk * 16 * R);
            mma_16816<T>(dq[2 * dp2], a, kb[0], kb[1]);
            mma_16816<T>(dq[2 * dp2 + 1], a, kb[2], kb[3]);
          }
        }
        const int r = m0 + mt * 16 + g;
        float* dst = ws.dq_accum +
                     (static_cast<int64_t>(e.q_start) + r) * f.num_heads * hd +
                     static_cast<int64_t>(h) * hd + c0 * 8 + 2 * t;
        const int64_t row8 = int64_t{8} * f.num_heads * hd;
#pragma unroll
        for (int i = 0; i < kDqT; ++i) {
          if (kPad && (c0 + i) * 8 >= hd) break;
          if (r < v.q_len) add_f32x2(dst + i * 8, dq[i][0], dq[i][1]);
          if (r + 8 < v.q_len) add_f32x2(dst + row8 + i * 8, dq[i][2], dq[i][3]);
        }
      }
    }
    // Deterministic: passed on after the next barrier (every thread's adds issued by then).
    if constexpr (kDeterministic) pending_turn = turn;
  }
  __syncthreads();  // every warp is done with sK / sV (dQ reads all of sK)
  if constexpr (kDeterministic) {
    if (tid == 0) flash_bwd_pass_dq_turn(pending_turn);
  }

  // Epilogue: dK (scaled) and dV to 16-bit, staged in this warp's own rows and columns of sK /
  // sV, then whole 16-byte chunks of the valid rows.
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = kr0 + g + 8 * hf;
      st_shared_b32(sK + swizzle<Tr::kChunks>(r, kv_c0 + dt) + 4 * t,
                    pack2<T>(acc_dk[dt][2 * hf] * f.softmax_scale,
                             acc_dk[dt][2 * hf + 1] * f.softmax_scale));
      st_shared_b32(sV + swizzle<Tr::kChunks>(r, kv_c0 + dt) + 4 * t,
                    pack2<T>(acc_dv[dt][2 * hf], acc_dv[dt][2 * hf + 1]));
    }
  }
  __syncwarp();
  T* dk = static_cast<T*>(p.dk) + (static_cast<int64_t>(e.k_start) + v.n0 + kr0) * p.dk_row_stride +
          static_cast<int64_t>(kv_head) * hd;
  T* dv = static_cast<T*>(p.dv) + (static_cast<int64_t>(e.k_start) + v.n0 + kr0) * p.dv_row_stride +
          static_cast<int64_t>(kv_head) * hd;
#pragma unroll
  for (int i = 0; i < 16 * kDT / 32; ++i) {
    const int idx = lane + 32 * i;
    const int r = idx / kDT;
    const int c = kv_c0 + idx % kDT;
    if (v.n0 + kr0 + r < v.k_len && (!kPad || c * 8 < hd)) {
      st_global_v4(dk + static_cast<int64_t>(r) * p.dk_row_stride + c * 8,
                   ld_shared_v4(sK + swizzle<Tr::kChunks>(kr0 + r, c)));
      st_global_v4(dv + static_cast<int64_t>(r) * p.dv_row_stride + c * 8,
                   ld_shared_v4(sV + swizzle<Tr::kChunks>(kr0 + r, c)));
    }
  }
}

template <typename T, class Tr, bool kSoftcap, bool kDeterministic>
cudaError_t launch_flash_bwd_mma(const FlashBwdParams& p, const FlashBwdWorkspace& ws,
                                 cudaStream_t stream) {
  // Key tiles, as flash_num_tile_slots counts query tiles.
  const int64_t tiles = tile_slots(p.fwd.total_k, p.fwd.batch, Tr::kBlockN);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.fwd.num_heads_k));
  return launch_with_smem<flash_bwd_mma_kernel<T, Tr, kSoftcap, kDeterministic>>(
      grid, Tr::kThreads, Tr::kSmemBytes, stream, p, ws);
}

// Q / dO buffers of the 256-wide tile on the current device: 2 where its double-buffered shared
// memory fits a block (sm_90: 227 KB), 1 where the single-buffered one does (sm_80: 163 KB), 0
// where neither does (sm_86 / sm_89: 99 KB) or the device cannot be queried.
inline int wide_q_stages() {
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 0;
  if (optin >= WideBwdTraits<2>::kSmemBytes) return 2;
  return optin >= WideBwdTraits<1>::kSmemBytes ? 1 : 0;
}

}  // namespace mma_bwd

// The parameters this kernel computes exactly as the contract says; the dispatcher sends all
// others to the SIMT kernels: those of flash_bwd_tensor_core_layout_supported with the head dims
// of policy::flash_bwd_mma_head_dims_supported, the 256-wide tile's on devices whose shared
// memory holds it.
inline bool flash_attention_bwd_mma_supported(const FlashBwdParams& p) {
  if (!policy::flash_bwd_mma_head_dims_supported(p.fwd.head_dim, p.fwd.head_dim_v) ||
      !flash_bwd_tensor_core_layout_supported(p))
    return false;
  return policy::flash_bwd_mma_tile_dim(p.fwd.head_dim) != 256 || mma_bwd::wide_q_stages() > 0;
}

// Backward for kHeadDim == policy::flash_bwd_mma_tile_dim(p.fwd.head_dim) (64, 128: that head
// dim exactly; 256: D == Dv in (128, 256]), T = __half or __nv_bfloat16, params accepted by
// flash_attention_bwd_mma_supported, p.workspace of flash_bwd_workspace_bytes(p.fwd,
// kBwdMmaBlockM, p.deterministic) bytes. Writes dq, dk, dv (zeros on rows no sequence owns).
// Asynchronous on `stream`; never synchronizes or allocates.
constexpr int32_t kBwdMmaBlockM = 64;

template <typename T, int kHeadDim>
cudaError_t run_flash_attention_bwd_mma(const FlashBwdParams& p, cudaStream_t stream) {
  static_assert(kIsHalfOrBFloat16<T>, "float16 or bfloat16");
  auto run = [&](auto traits) {
    using Tr = decltype(traits);
    static_assert(Tr::kBlockM == kBwdMmaBlockM, "the workspace is sized with kBwdMmaBlockM");
    return run_flash_bwd_accumulated<T>(
        p, Tr::kBlockM, stream,
        [&](const FlashBwdWorkspace& ws, auto softcap, auto deterministic) {
          return mma_bwd::launch_flash_bwd_mma<T, Tr, decltype(softcap)::value,
                                               decltype(deterministic)::value>(p, ws, stream);
        });
  };
  if constexpr (kHeadDim == 256) {
    const int stages = mma_bwd::wide_q_stages();
    if (stages == 2) return run(mma_bwd::WideBwdTraits<2>{});
    if (stages == 1) return run(mma_bwd::WideBwdTraits<1>{});
    return cudaErrorInvalidConfiguration;  // not flash_attention_bwd_mma_supported here
  } else {
    return run(mma_bwd::DefaultBwdTraits<kHeadDim>{});
  }
}

extern template cudaError_t run_flash_attention_bwd_mma<__half, 64>(const FlashBwdParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_mma<__half, 128>(const FlashBwdParams&,
                                                                     cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_mma<__nv_bfloat16, 64>(const FlashBwdParams&,
                                                                           cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_mma<__nv_bfloat16, 128>(
    const FlashBwdParams&, cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_mma<__half, 256>(const FlashBwdParams&,
                                                                     cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_mma<__nv_bfloat16, 256>(
    const FlashBwdParams&, cudaStream_t);

}  // namespace jax_flash
