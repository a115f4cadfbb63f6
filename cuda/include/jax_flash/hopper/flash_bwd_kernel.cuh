// Hopper (sm_90a) attention backward for float16 / bfloat16: TMA + wgmma.
//
// The contract is flash_bwd_params.h's; the math, masks, scheduling and deterministic mode are
// the mma.sync backward's (flash_attention_bwd_mma.cuh), with keys as the M dimension so that
// P^T and dS^T stay in registers as wgmma's A operand:
//   CTA (kv head blockIdx.y, key block blockIdx.x of 128 keys) visits, for every query head of
//   the kv head's group (GQA) and every query block of 64 rows that sees one of its keys:
//   loads (thread 0): TMA loads of K and V (once) and of each visit's Q and dO tiles and lse
//     (log2 units) and Delta rows, two visits ahead, into a 3-deep ring. Each stage has a "full"
//     mbarrier (the TMA bytes); a stage is reloaded only once both warpgroups have passed the
//     next visit's dS barrier, so no "empty" barrier is needed. (lse and Delta by plain loads
//     of the first warp put those loads' latency on every visit's barriers: the other warps
//     waited there for the first one.)
//   warpgroups 0, 1 (64 keys each):
//     S^T = K Q^T, dP^T = V dO^T        wgmma ss (K/V rows K-major, Q/dO rows K-major)
//     P^T = exp2(S^T * scale * log2 e - lse * log2 e), masked; dS^T = P^T (dP^T - Delta)
//           (times 1 - tanh^2 under a soft cap)
//     dV += P^T dO, dK += dS^T Q       wgmma rs (P^T / dS^T register fragments, dO / Q MN-major)
//     (HopperBwdTraits::kOverlapDkv: issued in the order S, dP, dV, dQ, dK, so that dV runs
//     under the dS barrier and dK while dQ is staged for its reduce-add; deterministic: S, dP,
//     dV, dK, dQ, dV and dK running while the CTA waits for its dQ turn)
//     dS^T stored to shared memory; dQ = dS K   wgmma ss with both operands MN-major, split by
//           64-column panels over the warpgroups, staged in shared memory and added to the
//           float32 accumulator by TMA reduce-adds (HopperBwdTraits::kDqReduceTma; per warp or
//           per warpgroup as kDqReducePerWarp says; else, and for a sequence's last, partial
//           query block, per-thread atomics) (deterministic mode:
//           in ascending key-block order, per-(head, query tile) turn counters and the visit
//           order of flash_bwd_visit, as in the mma.sync kernel; a visit's turn is passed on in
//           the next visit (by warpgroup 1, while thread 0 waits for that one's turn), so that
//           the wait for the reduce-add's completion overlaps the next visit's GEMMs).
// dK/dV stay in registers across all visits (no atomics for them); the epilogue scales dK and
// writes both for the block's keys.
//
// Head dims below the tile width D (kPadded; D, Dv multiples of 16): the TMA descriptors span
// the tensors' real widths, so Q / K / dO / V columns past head_dim / head_dim_v arrive as zeros
// and add nothing to S^T or dP^T; the dK, dV and dQ columns past them are zeros and never
// stored. (A variant of its own, so that the exact head dims keep their registers.)
//
// Rows past a length: TMA reads whole tiles of the packed tensors (another sequence's rows, or
// zeros past the tensor). Q/dO rows past the query length and K/V rows past the key length are
// zeroed in shared memory (so that no non-finite value there meets a zero weight), their lse is
// +inf (P = 0) and their Delta 0, and keys past the key length are masked.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "jax_flash/flash_attention_bwd_common.cuh"
#include "jax_flash/flash_attention_bwd_mma.cuh"
#include "jax_flash/flash_bwd_params.h"
#include "jax_flash/hopper/bwd_loads.cuh"
#include "jax_flash/hopper/bwd_tile_config.cuh"
#include "jax_flash/hopper/ptx.cuh"
#include "jax_flash/hopper/wgmma.cuh"
#include "jax_flash/mma_sync.cuh"
#include "jax_flash/softmax.cuh"

namespace jax_flash::hopper {

template <typename T, class Tr, bool kSoftcap, bool kDeterministic, bool kPadded>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_bwd_hopper_kernel(const __grid_constant__ FlashBwdParams p, const FlashBwdWorkspace ws,
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
  constexpr int D = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int S = Tr::kStages;
  const FlashParams& f = p.fwd;
  // Columns of dQ / dK and of dV that are stored, and their head strides.
  const int dk_cols = kPadded ? f.head_dim : D;
  const int dv_cols = kPadded ? f.head_dim_v : D;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* base_ptr = smem_raw + (base - raw);
  const uint32_t sK = base + Tr::kOffK;
  const uint32_t sV = base + Tr::kOffV;
  const uint32_t sQ = base + Tr::kOffQ;
  const uint32_t sdO = base + Tr::kOffDo;
  const uint32_t sdS = base + Tr::kOffDs;
  const uint32_t sDq = base + Tr::kOffDq;
  // [S][kRowsStage]: per stage Delta, then lse in log2 units (kRowsBox entries each, from the
  // 16-byte aligned row at or before the visit's first).
  float* s_rows = reinterpret_cast<float*>(base_ptr + Tr::kOffRows);
  const uint32_t bars = base + Tr::kOffBars;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int wg = warp >> 2;

  const int kv_head = blockIdx.y;
  FlashBwdVisits v;
  // False past the last key tile, or when no query tile sees its keys (dk, dv then stay the
  // launcher's zeros). The CTA's key tile in the order Tr::kLongestFirst picks.
  constexpr bool kLongestFirst = Tr::template kLongestFirst<kDeterministic>;
  if (!flash_bwd_find_visits<kLongestFirst>(f, BN, BM, blockIdx.x, &v)) return;
  const SeqExtent& e = v.kt.ext;
  auto visit = [&](int it, int* h, int* m) {
    flash_bwd_visit(v, kv_head, it, h, m);
  };

  // The TMA loads (thread 0; bwd_loads.cuh): K / V once, each visit's Q / dO tiles and lse /
  // Delta rows S - 1 visits ahead. No thread waits here for a global load, so the loads stay
  // off the warpgroups' barriers.
  const BwdLoads<Tr> loads{sK, sV, sQ, sdO, s_rows, bars, &tm_q, &tm_k, &tm_v, &tm_do,
                           &tm_rows, &v, kv_head};
  if (tid == 0) loads.init_barriers();
  __syncthreads();
  if (tid == 0) loads.issue_first();

  const int cw = wg;           // warpgroup: keys 64 cw .. 64 cw + 63 of the block
  constexpr bool kDqPerWarp = Tr::template kDqReducePerWarp<kDeterministic>;
  // The thread that issues the dQ reduce-adds of this warpgroup (where it computes dQ), or of
  // this warp (kDqPerWarp).
  const bool dq_issuer = cw < Tr::kDqWarpgroups && (kDqPerWarp ? lane == 0 : (tid & 127) == 0);
  const int ctid = tid;        // 0..255
  const int g = lane >> 2;     // accumulator row (and +8) within the warp's 16
  const int t = lane & 3;      // accumulator column pair
  const int kr = 64 * cw + 16 * (warp & 3) + g;  // this thread's first key row in the block

  const ScoreScale score = score_scale<kSoftcap>(f);
  const float scale_log2 = score.scale_log2, softcap_in = score.softcap_in;
  int d_min, d_max;
  flash_diag_band(f, v.q_len, v.k_len, &d_min, &d_max);

  mbar_wait(loads.kv_full(), 0);
  loads.zero_partial_kv(ctid);

  float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  const uint32_t k_rows = sK + 64 * cw * 128;  // this warpgroup's 64 keys (K-major A)
  const uint32_t v_rows = sV + 64 * cw * 128;

  // Deterministic mode: the dQ turn of the last visit, passed on in the next visit once its
  // reduce-add has completed (below), so that the wait for that completion overlaps this
  // visit's S / dP GEMMs and softmax instead of stalling the block at the end of the last one.
  int32_t* held_turn = nullptr;
  for (int it = 0; it < v.items; ++it) {
    const int stage = it % S;
    const int phase = (it / S) & 1;
    int h, m;
    visit(it, &h, &m);
    const int m0 = m * BM;
    const int rows = min(BM, v.q_len - m0);
    const uint32_t q_st = sQ + stage * Tr::kSmemQ;
    const uint32_t do_st = sdO + stage * Tr::kSmemQ;
    const uint32_t ds_buf = sdS + (it & 1) * Tr::kSmemDs;

    // This visit's Delta and lse (log2 units) rows in the stage.
    float* delta_st = s_rows + stage * Tr::kRowsStage + ((e.q_start + m0) & 3);
    float* lse_st = delta_st + Tr::kRowsBox;

    mbar_wait(loads.q_full(stage), phase);
    loads.zero_partial_visit(q_st, do_st, lse_st, delta_st, rows, ctid);

    // S^T = K Q^T and dP^T = V dO^T: this warpgroup's 64 keys x BM queries.
    float s[BM / 2], dp[BM / 2];
    reg_fence(s);
    reg_fence(dp);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      const uint32_t off = (k / 4) * Tr::kPanelKV + (k % 4) * 32;  // k16 step in a panel
      const uint32_t qoff = (k / 4) * Tr::kPanelQ + (k % 4) * 32;
      Wgmma<T, BM>::ss(s, smem_desc_sw128(k_rows + off, 16, 1024),
                       smem_desc_sw128(q_st + qoff, 16, 1024), k > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      const uint32_t off = (k / 4) * Tr::kPanelKV + (k % 4) * 32;
      const uint32_t qoff = (k / 4) * Tr::kPanelQ + (k % 4) * 32;
      Wgmma<T, BM>::ss(dp, smem_desc_sw128(v_rows + off, 16, 1024),
                       smem_desc_sw128(do_st + qoff, 16, 1024), k > 0);
    }
    wgmma_commit();

    // P^T and dS^T (s becomes P^T, dp becomes dS^T). Element i of a fragment: key row
    // kr + 8 * (i / 2 % 2), query column 8 * (i / 4) + 2 * t + i % 2.
    int lo, hi;
    flash_tile_keys(f, m0, rows, v.q_len, v.k_len, &lo, &hi);
    int lo_last, hi_first, unused;
    visible_keys(f, m0 + rows - 1, v.q_len, v.k_len, &lo_last, &unused);
    visible_keys(f, m0, v.q_len, v.k_len, &unused, &hi_first);
    const bool need_mask = v.n0 < lo_last || v.n0 + BN > hi_first;
    // P of element i from its score x (soft-capped already), masked.
    auto weight = [&](int i, float x) {
      const int j = i / 4, hf = (i / 2) % 2, col = 8 * j + 2 * t + i % 2;
      float pv = fast_exp2(fmaf(x, scale_log2, -lse_st[col]));
      if (need_mask) {
        const int kj = v.n0 + kr + 8 * hf;
        const int dj = kj - (m0 + col);
        if (kj >= v.k_len || dj < d_min || dj > d_max) pv = 0.f;
      }
      return pv;
    };
    uint32_t pa[BM / 16][4], da[BM / 16][4];
    if constexpr (kSoftcap) {
      // dS needs tanh of each score, which P overwrites: both GEMMs first, then one pass.
      wgmma_wait<0>();
      reg_fence(s);
      reg_fence(dp);
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) {
        const float x = softcap_tanh(s[i] * softcap_in);
        const float pv = weight(i, x);
        s[i] = pv;
        dp[i] = pv * (dp[i] - delta_st[8 * (i / 4) + 2 * t + i % 2]) * (1.f - x * x);
      }
    } else {
      // P under the dP GEMM.
      wgmma_wait<1>();
      reg_fence(s);
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) s[i] = weight(i, s[i]);
      wgmma_wait<0>();
      reg_fence(dp);
#pragma unroll
      for (int i = 0; i < BM / 2; ++i)
        dp[i] = s[i] * (dp[i] - delta_st[8 * (i / 4) + 2 * t + i % 2]);
    }
    // A fragments of P^T and dS^T (k16 step kk over the queries).
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        pa[kk][q] = pack2<T>(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);
        da[kk][q] = pack2<T>(dp[8 * kk + 2 * q], dp[8 * kk + 2 * q + 1]);
      }
    }

    // dV += P^T dO and dK += dS^T Q (dO / Q read MN-major: k = query rows, n = head dim).
    // kOverlapDkv (bwd_tile_config.cuh): dV is issued here, to run under the dS stores and the
    // barrier below (issued before dS is computed it would overlap that too, but P^T's
    // fragments then live beside the S / dP accumulators: at head dim 128 the registers do not
    // suffice and ptxas serializes every wgmma); the deterministic mode issues dK with it, to
    // run while the CTA waits for its dQ turn, the fast mode after dQ, to run while dQ is
    // staged. Otherwise both are issued after the dS stores, as one commit group.
    auto fence_dkv = [&] {
      reg_fence(acc_dk);
      reg_fence(acc_dv);
      reg_fence(pa);
      reg_fence(da);
    };
    auto issue_dkv = [&](bool dv, bool dk) {
      if (dv && dk) {
        fence_dkv();
      } else {
        reg_fence(dv ? acc_dv : acc_dk);
        reg_fence(dv ? pa : da);
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        if (dv)
          Wgmma<T, D>::rs(acc_dv, pa[kk], smem_desc_sw128(do_st + kk * 16 * 128, Tr::kPanelQ, 1024));
        if (dk)
          Wgmma<T, D>::rs(acc_dk, da[kk], smem_desc_sw128(q_st + kk * 16 * 128, Tr::kPanelQ, 1024));
      }
      wgmma_commit();
    };
    constexpr bool kDkAfterDq = Tr::kOverlapDkv && !kDeterministic;
    if constexpr (Tr::kOverlapDkv) {
      issue_dkv(true, false);
      if constexpr (kDeterministic) issue_dkv(false, true);
    }

    // dS^T to shared memory for dQ: key row r, query columns 8j + 2t, +1 in the
    // 128-byte-swizzled [BN][BM] buffer.
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = kr + 8 * hf;  // r % 8 == g
        st_shared_b32(ds_buf + r * 128 + ((j ^ g) << 4) + 4 * t,
                      da[j / 2][2 * (j % 2) + hf]);
      }
    }
    if constexpr (!Tr::kOverlapDkv) issue_dkv(true, true);

    // Both warpgroups' dS^T staged, both past visit it - 1 (and, deterministic, the key blocks
    // before this one have added their dQ shares of this (head, query block): lo / BN is the
    // first that visits it).
    fence_proxy_async();
    int32_t* turn = nullptr;
    if constexpr (kDeterministic) {
      // The last visit's dQ shares added (its reduce-add completed, every thread's atomics
      // issued): its turn passes to the next key block while this one is waited for, by a
      // thread of the other warpgroup (the pass's fence and the wait's acquire loads are each
      // a round trip to L2; one thread doing both put their sum on every visit's path).
      if (dq_issuer) bulk_wait<0>();
      named_sync(1, 256);
      if (ctid == 128) flash_bwd_pass_dq_turn(held_turn);
      turn = flash_bwd_take_dq_turn(ws, v.kt, h, m, lo, BN, ctid == 0);
      held_turn = turn;
    } else if (dq_issuer) {
      bulk_wait_read<0>();  // the last visit's dQ reduce-add has read the staging rewritten below
    }
    named_sync(1, 256);

    // dQ (unscaled) = dS K for head-dim panel cw: A = dS^T read MN-major (m = queries,
    // k = keys), B = K read MN-major (k = keys, n = 64 head-dim columns).
    float dq[32];
    if (cw < Tr::kDqWarpgroups) {
      reg_fence(dq);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        Wgmma<T, 64>::template ss<1, 1>(
            dq, smem_desc_sw128(ds_buf + kk * 16 * 128, Tr::kSmemDs, 1024),
            smem_desc_sw128(sK + cw * Tr::kPanelKV + kk * 16 * 128, Tr::kPanelKV, 1024), kk > 0);
      }
      wgmma_commit();
    }
    if constexpr (kDkAfterDq) issue_dkv(false, true);
    // Every thread is past visit it - 1: its stage takes the loads of visit it + S - 1 (issued
    // here, under the GEMMs in flight).
    if (tid == 0 && it + S - 1 < v.items) loads.issue_visit(it + S - 1);
    wgmma_wait<kDkAfterDq ? 1 : 0>();  // dV and dQ (and dK unless it runs under the staging)
    if constexpr (Tr::kOverlapDkv) {
      reg_fence(acc_dv);
      reg_fence(pa);
    } else {
      fence_dkv();
    }
    if (cw < Tr::kDqWarpgroups && Tr::template kDqReduceTma<kDeterministic> && rows == BM) {
      // A whole query block: dQ's 64 x 64 panel staged in shared memory (two 128-byte-swizzled
      // boxes of 32 float32 columns) and added to the accumulator by TMA reduce-adds (of the
      // warpgroup's panel, or of each warp's 16 rows: kDqPerWarp).
      reg_fence(dq);
      // Element pair (row r, columns c, c + 1), c = 8j + 2t: box j / 4, 16-byte chunk
      // (2 (j % 4) + t / 2) of row r, swizzled by r % 8 = g, 8 bytes in for odd t. A 64-bit
      // store is served a half-warp (rows g = 4 i .. 4 i + 3) at a time; with every lane storing
      // the same j, rows g and g ^ 1 would hit the same 32-byte chunk pair (4 wavefronts where 2
      // do). So lanes of odd rows store j ^ 2 where the others store j: row g's pair is then
      // (j % 4) ^ (g' / 2), g' = g ^ (4 (g & 1)), four different pairs in each half-warp.
      const bool odd_row = (g & 1) != 0;
      const int gs = g ^ (odd_row ? 4 : 0);
      const uint32_t row0 = sDq + cw * Tr::kSmemDqPanel + (16 * (warp & 3) + g) * 128 + (t & 1) * 8;
      // The panel's second box (columns 64 cw + 32 ..) lies past the head dim in padded tiles
      // of D <= 64 cw + 32 (D 80 / 96 in the second warpgroup): neither staged nor added.
      const bool box1 = !kPadded || 64 * cw + 32 < dk_cols;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j >= 4 && !box1) continue;  // warpgroup-uniform
          // This lane's element j ^ (odd_row ? 2 : 0): same box, chunk pair flipped by 2.
          const uint32_t addr = row0 + hf * 8 * 128 + (j / 4) * (BM * 128) +
                                (((2 * (j % 4) + (t >> 1)) ^ gs) << 4);
          const float x0 = odd_row ? dq[4 * (j ^ 2) + 2 * hf] : dq[4 * j + 2 * hf];
          const float x1 = odd_row ? dq[4 * (j ^ 2) + 2 * hf + 1] : dq[4 * j + 2 * hf + 1];
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x0), "f"(x1)
                       : "memory");
        }
      }
      fence_proxy_async();
      // Per warp: this warp's rows 16 (warp % 4) .. + 15 of both boxes (a 1024-byte aligned
      // band: the swizzle's phase is the box's), added once the warp's stores are in; else the
      // warpgroup's whole panel, once all its warps' are.
      const int r0 = kDqPerWarp ? 16 * (warp & 3) : 0;
      const uint32_t src = sDq + cw * Tr::kSmemDqPanel + r0 * 128;
      if constexpr (kDqPerWarp) {
        __syncwarp();
      } else {
        named_sync(2 + cw, 128);
      }
      if (dq_issuer) {
        tma_reduce_add_3d(&tm_dq, src, 64 * cw, h, e.q_start + m0 + r0);
        if (box1) tma_reduce_add_3d(&tm_dq, src + BM * 128, 64 * cw + 32, h, e.q_start + m0 + r0);
        bulk_commit();
      }
    } else if (cw < Tr::kDqWarpgroups) {
      // Per-thread atomics (kDqReduceTma off, or the sequence's last, partial query block,
      // whose rows past it belong to the next sequence or to no one): each thread adds its own
      // valid rows.
      reg_fence(dq);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * (warp & 3) + g + 8 * hf;
        if (r < rows) {
          float* dst = ws.dq_accum +
                       ((static_cast<int64_t>(e.q_start) + m0 + r) * f.num_heads + h) * dk_cols +
                       64 * cw + 2 * t;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (!kPadded || 64 * cw + 8 * j < dk_cols)
              mma_bwd::add_f32x2(dst + 8 * j, dq[4 * j + 2 * hf], dq[4 * j + 2 * hf + 1]);
        }
      }
    }
    if constexpr (Tr::kOverlapDkv) {
      // dK done before the next visit's S and dP accumulators are live (with dK's in flight
      // too, the registers do not suffice at head dim 128 and ptxas serializes the wgmmas).
      wgmma_wait<0>();
      reg_fence(acc_dk);
      reg_fence(da);
    }
  }
  // Shared memory must outlive the reduce-adds that read it; the last turn passes on once they
  // have completed.
  if (dq_issuer) bulk_wait<0>();
  if constexpr (kDeterministic) {
    named_sync(1, 256);
    if (ctid == 0) flash_bwd_pass_dq_turn(held_turn);
  }

  // Epilogue: dK (scaled) and dV of this thread's key rows, straight from the fragments
  // (element i: key row kr + 8 * (i / 2 % 2), column 8 * (i / 4) + 2 * t + i % 2).
  T* dk = static_cast<T*>(p.dk) + static_cast<int64_t>(kv_head) * dk_cols + 2 * t;
  T* dv = static_cast<T*>(p.dv) + static_cast<int64_t>(kv_head) * dv_cols + 2 * t;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = kr + 8 * hf;
    if (v.n0 + r < v.k_len) {
      const int64_t row = static_cast<int64_t>(e.k_start) + v.n0 + r;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        if (!kPadded || 8 * j < dk_cols)
          *reinterpret_cast<uint32_t*>(dk + row * p.dk_row_stride + 8 * j) =
              pack2<T>(acc_dk[4 * j + 2 * hf] * f.softmax_scale,
                       acc_dk[4 * j + 2 * hf + 1] * f.softmax_scale);
        if (!kPadded || 8 * j < dv_cols)
          *reinterpret_cast<uint32_t*>(dv + row * p.dv_row_stride + 8 * j) =
              pack2<T>(acc_dv[4 * j + 2 * hf], acc_dv[4 * j + 2 * hf + 1]);
      }
    }
  }
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::hopper
