// Hopper (sm_90a) attention backward for fp16 / bf16 on the 256-wide tile (head dims past 128,
// D != Dv too: Q / K columns past D and V / dO columns past Dv arrive as zeros from TMA, add
// nothing, and the dK, dV, dQ columns past them are never stored). Tiles and shared memory:
// bwd_wide_tile_config.cuh (HopperBwdWideTraits).
//
// Grid: (key blocks of kBlockN = 64 keys over all sequences, kv heads), as the 128-wide kernel
// (flash_bwd_kernel.cuh), whose visit order (flash_bwd_visit), deterministic turns, preprocessing
// (Delta, lse in log2 units) and dQ conversion (run_flash_bwd_accumulated) this kernel shares.
// Per visit (query head h, query block m of 64 rows), both warpgroups:
//     S = Q K^T, dP = dO V^T            wgmma ss m64n32: the 64 queries x this warpgroup's 32 keys
//     P = exp2(S * scale * log2 e - lse * log2 e), masked; dS = P (dP - Delta)
//           (times 1 - tanh^2 under a soft cap), each row's lse / Delta read once
//     P and dS as 16-bit [query][key] tiles in shared memory (two buffers, alternating by visit),
//     then a 256-thread barrier: every GEMM below takes all 64 keys
//     dQ = dS K (this warpgroup's 128 columns, two m64n64 GEMMs; A = dS K-major, B = K MN-major)
//     dV += P^T dO, dK += dS^T Q (m64n128, A = the tiles read MN-major: M = keys, K = queries;
//           B = dO / Q MN-major, this warpgroup's two 64-column panels)
//     dQ added to the float32 accumulator while dV / dK run (deterministic mode: each warp first
//     waits for the visit's turn, which the CTA passes on after the next visit's tile barrier):
//     for whole query blocks by TMA reduce-adds of a staging in the P / dS tiles the visit does
//     not use, otherwise (partial query blocks) by per-thread atomics.
// dK / dV stay in registers across all visits; the epilogue scales dK and writes both for the
// block's keys. Rows past a length as in the 128-wide kernel: Q / dO rows past the query length
// and K / V rows past the key length are zeroed in shared memory, their lse is +inf and their
// Delta 0, keys past the key length are masked.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jax_flash/flash_attention_bwd_common.cuh"
#include "jax_flash/flash_attention_bwd_mma.cuh"
#include "jax_flash/flash_bwd_params.h"
#include "jax_flash/hopper/bwd_loads.cuh"
#include "jax_flash/hopper/bwd_wide_tile_config.cuh"
#include "jax_flash/hopper/ptx.cuh"
#include "jax_flash/hopper/wgmma.cuh"
#include "jax_flash/mma_sync.cuh"
#include "jax_flash/softmax.cuh"

namespace jax_flash::hopper {

template <typename T, class Tr, bool kSoftcap, bool kDeterministic, bool kPadded>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_bwd_hopper_wide_kernel(const __grid_constant__ FlashBwdParams p,
                                 const FlashBwdWorkspace ws,
                                 const __grid_constant__ CUtensorMap tm_q,
                                 const __grid_constant__ CUtensorMap tm_k,
                                 const __grid_constant__ CUtensorMap tm_v,
                                 const __grid_constant__ CUtensorMap tm_do,
                                 const __grid_constant__ CUtensorMap tm_dq,
                                 const __grid_constant__ CUtensorMap tm_rows) {
#if defined(JAX_FLASH_SM90A)
  using mma_detail::fast_exp2;
  using mma_detail::pack2;
  using mma_detail::st_shared_b32;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int S = Tr::kStages;
  constexpr int NK = Tr::kKeysPerWarpgroup;  // 32
  constexpr int NC = Tr::kColsPerWarpgroup;  // 128
  const FlashParams& f = p.fwd;
  // Columns of dQ / dK and of dV that are stored, and their head strides.
  const int dk_cols = kPadded ? f.head_dim : Tr::kHeadDim;
  const int dv_cols = kPadded ? f.head_dim_v : Tr::kHeadDim;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* base_ptr = smem_raw + (base - raw);
  const uint32_t sK = base + Tr::kOffK;
  const uint32_t sV = base + Tr::kOffV;
  const uint32_t sQ = base + Tr::kOffQ;
  const uint32_t sdO = base + Tr::kOffDo;
  const uint32_t sP = base + Tr::kOffP;
  const uint32_t sdS = base + Tr::kOffDs;
  // [S][kRowsStage]: per stage Delta, then lse in log2 units (kRowsBox entries each, from the
  // 16-byte aligned row at or before the visit's first).
  float* s_rows = reinterpret_cast<float*>(base_ptr + Tr::kOffRows);
  const uint32_t bars = base + Tr::kOffBars;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int cw = warp >> 2;  // warpgroup: keys 32 cw .. + 31 of S / dP, columns 128 cw .. + 127
  const int g = lane >> 2;   // accumulator row (and +8) within the warp's 16
  const int t = lane & 3;    // accumulator column pair

  const int kv_head = blockIdx.y;
  FlashBwdVisits v;
  // False past the last key tile, or when no query tile sees its keys (dk, dv then stay the
  // launcher's zeros).
  if (!flash_bwd_find_visits(f, BN, BM, blockIdx.x, &v)) return;
  const SeqExtent& e = v.kt.ext;
  auto visit = [&](int it, int* h, int* m) { flash_bwd_visit(v, kv_head, it, h, m); };

  // The TMA loads (thread 0), as the 128-wide kernel's (bwd_loads.cuh).
  const BwdLoads<Tr> loads{sK, sV, sQ, sdO, s_rows, bars, &tm_q, &tm_k, &tm_v, &tm_do,
                           &tm_rows, &v, kv_head};
  if (tid == 0) loads.init_barriers();
  __syncthreads();
  if (tid == 0) loads.issue_first();

  const ScoreScale score = score_scale<kSoftcap>(f);
  const float scale_log2 = score.scale_log2, softcap_in = score.softcap_in;
  int d_min, d_max;
  flash_diag_band(f, v.q_len, v.k_len, &d_min, &d_max);

  mbar_wait(loads.kv_full(), 0);
  loads.zero_partial_kv(tid);

  // dK / dV of all 64 keys, this warpgroup's 128 columns: element i is key row
  // 16 (warp % 4) + g + 8 (i / 2 % 2), column 128 cw + 8 (i / 4) + 2 t + i % 2.
  float acc_dk[NC / 2], acc_dv[NC / 2];
#pragma unroll
  for (int i = 0; i < NC / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  // This thread's two query rows of S / dP / dQ in the visit's block, and its keys' base column.
  const int r0 = 16 * (warp & 3) + g;
  const int key0 = NK * cw + 2 * t;
  // Deterministic mode: the last visit's dQ turn, passed on after this visit's tile barrier (by
  // then every thread's atomics of the last visit are issued).
  int32_t* pending_turn = nullptr;
  // Whole query blocks: this warpgroup's dQ goes to the accumulator by TMA reduce-adds (four
  // boxes of 16 rows x 32 columns a warp, one after the other) instead of atomics, staged in the
  // band of this warp's 16 rows of the P (warpgroup 0) or dS (warpgroup 1) tile the visit does
  // not use: that band is rewritten next visit only by this warp and its partner in the other
  // warpgroup (the same rows), which first wait for the reduce-adds to have read it (in
  // deterministic mode: to have completed, before the turn passes). The atomics alone
  // saturated the path to L2; on an H200, against half of dQ by TMA (fast mode, D 256 only):
  // D 256 +8-9% fast and deterministic, D 192/128 +8.5% and D 160 +5% fast; the padded
  // deterministic variants +1-2% once the boxes past the head dim skip the slot's wait (-3%
  // before). Partial query blocks keep the atomics.
  const bool dq_issuer = lane == 0;
  bool staged_last = false;
  for (int it = 0; it < v.items; ++it) {
    const int stage = it % S;
    const int phase = (it / S) & 1;
    int h, m;
    visit(it, &h, &m);
    const int m0 = m * BM;
    const int rows = min(BM, v.q_len - m0);
    const uint32_t q_st = sQ + stage * Tr::kSmemQ;
    const uint32_t do_st = sdO + stage * Tr::kSmemQ;
    const uint32_t p_buf = sP + (it & 1) * Tr::kSmemPs;
    const uint32_t ds_buf = sdS + (it & 1) * Tr::kSmemPs;
    float* delta_st = s_rows + stage * Tr::kRowsStage + ((e.q_start + m0) & 3);
    float* lse_st = delta_st + Tr::kRowsBox;

    mbar_wait(loads.q_full(stage), phase);
    loads.zero_partial_visit(q_st, do_st, lse_st, delta_st, rows, tid);

    // S = Q K^T and dP = dO V^T: 64 queries x keys 32 cw .. 32 cw + 31 (rows 32 cw of K / V:
    // a 4096-byte offset, whole swizzle atoms).
    float s[NK / 2], dp[NK / 2];
    reg_fence(s);
    reg_fence(dp);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < Tr::kHeadDim / 16; ++k) {
      const uint32_t qoff = (k / 4) * Tr::kPanelQ + (k % 4) * 32;  // k16 step in a panel
      const uint32_t koff = (k / 4) * Tr::kPanelKV + NK * cw * 128 + (k % 4) * 32;
      Wgmma<T, NK>::ss(s, smem_desc_sw128(q_st + qoff, 16, 1024),
                       smem_desc_sw128(sK + koff, 16, 1024), k > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int k = 0; k < Tr::kHeadDim / 16; ++k) {
      const uint32_t qoff = (k / 4) * Tr::kPanelQ + (k % 4) * 32;
      const uint32_t koff = (k / 4) * Tr::kPanelKV + NK * cw * 128 + (k % 4) * 32;
      Wgmma<T, NK>::ss(dp, smem_desc_sw128(do_st + qoff, 16, 1024),
                       smem_desc_sw128(sV + koff, 16, 1024), k > 0);
    }
    wgmma_commit();

    // P and dS. Element i of s / dp: query row r0 + 8 (i / 2 % 2), key key0 + 8 (i / 4) + i % 2.
    int lo, hi;
    flash_tile_keys(f, m0, rows, v.q_len, v.k_len, &lo, &hi);
    int lo_last, hi_first, unused;
    visible_keys(f, m0 + rows - 1, v.q_len, v.k_len, &lo_last, &unused);
    visible_keys(f, m0, v.q_len, v.k_len, &unused, &hi_first);
    const bool need_mask = v.n0 < lo_last || v.n0 + BN > hi_first;
    const float lse_r[2] = {lse_st[r0], lse_st[r0 + 8]};
    const float delta_r[2] = {delta_st[r0], delta_st[r0 + 8]};
    auto weight = [&](int i, float x) {
      const int hf = (i / 2) % 2;
      float pv = fast_exp2(fmaf(x, scale_log2, -lse_r[hf]));
      if (need_mask) {
        const int kj = v.n0 + key0 + 8 * (i / 4) + i % 2;
        const int dj = kj - (m0 + r0 + 8 * hf);
        if (kj >= v.k_len || dj < d_min || dj > d_max) pv = 0.f;
      }
      return pv;
    };
    if constexpr (kSoftcap) {
      wgmma_wait<0>();
      reg_fence(s);
      reg_fence(dp);
#pragma unroll
      for (int i = 0; i < NK / 2; ++i) {
        const float x = softcap_tanh(s[i] * softcap_in);
        const float pv = weight(i, x);
        s[i] = pv;
        dp[i] = pv * (dp[i] - delta_r[(i / 2) % 2]) * (1.f - x * x);
      }
    } else {
      wgmma_wait<1>();  // P under the dP GEMM
      reg_fence(s);
#pragma unroll
      for (int i = 0; i < NK / 2; ++i) s[i] = weight(i, s[i]);
      wgmma_wait<0>();
      reg_fence(dp);
#pragma unroll
      for (int i = 0; i < NK / 2; ++i) dp[i] = s[i] * (dp[i] - delta_r[(i / 2) % 2]);
    }

    if (staged_last) {
      if (dq_issuer) {
        if constexpr (kDeterministic) {
          bulk_wait<0>();  // completed before the turn passes (after the tile barrier below)
          fence_proxy_async_global();
        } else {
          bulk_wait_read<0>();
        }
      }
      named_sync(2 + (warp & 3), 64);  // this warp and its partner: the band's reads are done
    }
    // P and dS to their [query][key] tiles: query row r, keys key0 + 8j, +1 (16-byte chunk
    // 4 cw + j of the 128-byte row, swizzled by r % 8 = g: a warp's eight rows hit eight
    // different chunks, conflict-free).
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = r0 + 8 * hf;
        const uint32_t off = r * 128 + (((4 * cw + j) ^ g) << 4) + 4 * t;
        st_shared_b32(p_buf + off, pack2<T>(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
        st_shared_b32(ds_buf + off, pack2<T>(dp[4 * j + 2 * hf], dp[4 * j + 2 * hf + 1]));
      }
    }
    fence_proxy_async();
    named_sync(1, 256);  // both warpgroups' halves of P and dS stored; both past visit it - 1
    if constexpr (kDeterministic) {
      // The release holds the passing warp. Padded, warpgroup 1 passes (its columns lie
      // partly past the head dim: fewer dQ boxes to stage and add); at D 256 thread 0 does, as
      // warpgroup 1 passing measured 1.5% slower there (H200: D 160 +2.9%, D 192/128 +1.2%).
      if (tid == (kPadded ? 128 : 0)) flash_bwd_pass_dq_turn_release(pending_turn);
      pending_turn = nullptr;
    }
    // Every thread is past visit it - 1: its stage takes the loads of visit it + S - 1.
    if (tid == 0 && it + S - 1 < v.items) loads.issue_visit(it + S - 1);

    // dQ (unscaled) = dS K for columns 128 cw + 64 c .. + 63, c = 0, 1: A = dS K-major (m =
    // queries, k = keys: 32 bytes a k16 step), B = K MN-major (k = keys, n = 64 columns).
    float dq0[32], dq1[32];
    reg_fence(dq0);
    reg_fence(dq1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint64_t a = smem_desc_sw128(ds_buf + kk * 32, 16, 1024);
      Wgmma<T, 64>::template ss<0, 1>(
          dq0, a,
          smem_desc_sw128(sK + (2 * cw) * Tr::kPanelKV + kk * 16 * 128, Tr::kPanelKV, 1024),
          kk > 0);
      Wgmma<T, 64>::template ss<0, 1>(
          dq1, a,
          smem_desc_sw128(sK + (2 * cw + 1) * Tr::kPanelKV + kk * 16 * 128, Tr::kPanelKV, 1024),
          kk > 0);
    }
    wgmma_commit();
    // dV += P^T dO and dK += dS^T Q: A = the P / dS tile read MN-major (m = the 64 keys, k =
    // queries: 16 rows a k16 step), B = dO / Q MN-major (k = queries, n = this warpgroup's 128
    // columns: panels 2 cw, 2 cw + 1).
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint32_t tile_off = kk * 16 * 128;
      const uint32_t col_off = (2 * cw) * Tr::kPanelQ + kk * 16 * 128;
      Wgmma<T, NC>::template ss<1, 1>(acc_dv, smem_desc_sw128(p_buf + tile_off, Tr::kSmemPs, 1024),
                                      smem_desc_sw128(do_st + col_off, Tr::kPanelQ, 1024), 1);
      Wgmma<T, NC>::template ss<1, 1>(acc_dk,
                                      smem_desc_sw128(ds_buf + tile_off, Tr::kSmemPs, 1024),
                                      smem_desc_sw128(q_st + col_off, Tr::kPanelQ, 1024), 1);
    }
    wgmma_commit();

    // dQ's pairs to the accumulator while dV / dK run (deterministic: once this warp has seen
    // the visit's turn: the key blocks before this one have added their shares; lo / BN is the
    // first that visits the query block).
    wgmma_wait<1>();
    reg_fence(dq0);
    reg_fence(dq1);
    if constexpr (kDeterministic) {
      pending_turn = flash_bwd_take_dq_turn(ws, v.kt, h, m, lo, BN, lane == 0);
      __syncwarp();
    }
    const bool staged = rows == BM;
    const int dq_row0 = Tr::kDqBoxRows * (warp & 3);  // this warp's rows of the block
    const uint32_t dq_slot = (cw == 0 ? sP : sdS) + ((it + 1) & 1) * Tr::kSmemPs + dq_row0 * 128;
    // Box q (columns NC cw + 32 q .. + 31: dq0 for q < 2, else dq1) to the slot, 128-byte
    // swizzled as the tensor map's box, and its reduce-add issued; the map clips a box's columns
    // past the head dim. Element pair (row r, columns c, c + 1),
    // c = 8 jj + 2 t: 16-byte chunk (2 jj + t / 2) of row r, swizzled by r % 8 = g, 8 bytes in
    // for odd t; lanes of odd rows store jj ^ 2 (as the 128-wide kernel's staging: no bank
    // conflict between rows g and g ^ 1).
    auto stage_box = [&](int q) {
      const int col = NC * cw + 32 * q;
      const bool odd_row = (g & 1) != 0;
      const int gs = g ^ (odd_row ? 4 : 0);
      const uint32_t row0 = dq_slot + g * 128 + (t & 1) * 8;
      const float* dq = q < 2 ? dq0 : dq1;
      const int b = q % 2;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          // Selects, not an index by the row's parity (which would put dQ in local memory).
          const int j = 4 * b + jj, jo = 4 * b + (jj ^ 2);
          const float x0 = odd_row ? dq[4 * jo + 2 * hf] : dq[4 * j + 2 * hf];
          const float x1 = odd_row ? dq[4 * jo + 2 * hf + 1] : dq[4 * j + 2 * hf + 1];
          const uint32_t addr = row0 + hf * 8 * 128 + (((2 * jj + (t >> 1)) ^ gs) << 4);
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x0), "f"(x1)
                       : "memory");
        }
      }
      fence_proxy_async();
      __syncwarp();
      if (dq_issuer) {
        tma_reduce_add_3d(&tm_dq, dq_slot, col, h, e.q_start + m0 + dq_row0);
        bulk_commit();
      }
    };
    if (staged) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // Boxes past the head dim (padded tiles) are skipped before the wait for the slot, so
        // the warp does not wait for the previous box's read only to stage nothing. Warp-uniform.
        if (kPadded && NC * cw + 32 * q >= dk_cols) break;
        if (q > 0) {  // the previous box read before the slot takes the next
          if (dq_issuer) bulk_wait_read<0>();
          __syncwarp();
        }
        stage_box(q);
      }
    } else {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = r0 + 8 * hf;
        if (r < rows) {
          float* dst = ws.dq_accum +
                       ((static_cast<int64_t>(e.q_start) + m0 + r) * f.num_heads + h) * dk_cols +
                       NC * cw + 2 * t;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (!kPadded || NC * cw + 8 * j < dk_cols)
              mma_bwd::add_f32x2(dst + 8 * j, dq0[4 * j + 2 * hf], dq0[4 * j + 2 * hf + 1]);
            if (!kPadded || NC * cw + 64 + 8 * j < dk_cols)
              mma_bwd::add_f32x2(dst + 64 + 8 * j, dq1[4 * j + 2 * hf], dq1[4 * j + 2 * hf + 1]);
          }
        }
      }
    }
    staged_last = staged;
    // dV / dK done before the next visit's tiles are written and its stage reloaded.
    wgmma_wait<0>();
    reg_fence(acc_dk);
    reg_fence(acc_dv);
  }
  if constexpr (kDeterministic) {
    if (dq_issuer) {  // the last visit's reduce-adds completed before its turn passes
      bulk_wait<0>();
      fence_proxy_async_global();
    }
    __syncthreads();  // every thread's atomics of the last visit issued
    if (tid == 0) flash_bwd_pass_dq_turn_release(pending_turn);
  }
  // Shared memory must outlive the reduce-adds that read it (waited for to completion, as the
  // 128-wide kernel does, before the dQ conversion that follows in the stream).
  if (dq_issuer) bulk_wait<0>();

  // Epilogue: dK (scaled) and dV of all 64 keys, this warpgroup's columns, straight from the
  // fragments.
  T* dk = static_cast<T*>(p.dk) + static_cast<int64_t>(kv_head) * dk_cols + NC * cw + 2 * t;
  T* dv = static_cast<T*>(p.dv) + static_cast<int64_t>(kv_head) * dv_cols + NC * cw + 2 * t;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = r0 + 8 * hf;
    if (v.n0 + r < v.k_len) {
      const int64_t row = static_cast<int64_t>(e.k_start) + v.n0 + r;
#pragma unroll
      for (int j = 0; j < NC / 8; ++j) {
        if (!kPadded || NC * cw + 8 * j < dk_cols)
          *reinterpret_cast<uint32_t*>(dk + row * p.dk_row_stride + 8 * j) =
              pack2<T>(acc_dk[4 * j + 2 * hf] * f.softmax_scale,
                       acc_dk[4 * j + 2 * hf + 1] * f.softmax_scale);
        if (!kPadded || NC * cw + 8 * j < dv_cols)
          *reinterpret_cast<uint32_t*>(dv + row * p.dv_row_stride + 8 * j) =
              pack2<T>(acc_dv[4 * j + 2 * hf], acc_dv[4 * j + 2 * hf + 1]);
      }
    }
  }
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::hopper
