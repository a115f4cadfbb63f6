// Paged decode attention on CUDA cores: the kernel and its launcher for one query-row count
// per CTA (MT). Design: paged_attention.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jax_flash/launch.cuh"  // ensure_smem_attrs
#include "jax_flash/paged/common.cuh"
#include "jax_flash/paged/merge.cuh"
#include "jax_flash/paged/ptx.cuh"
#include "jax_flash/paged_params.h"

namespace jax_flash {
namespace paged {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

// MT query rows per CTA, in kMG "m-groups" of kMTL <= 8 rows: each m-group is 4 warps that own
// the tile's rows (Q K^T, softmax, P V) for their kMTL query rows; the m-groups share the copy
// pipeline (MT = 16: 256 threads, K/V read from shared memory twice, registers as for MT = 8).
template <typename TC, int D, int MT, int kStagesReq = 0>
struct Cfg {
  static_assert(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256");
  static_assert(MT == 4 || MT == 8 || MT == 16, "MT must be 4, 8 or 16");
  static constexpr int kMTL = MT > 8 ? 8 : MT;                       // rows per m-group
  static constexpr int kMG = MT / kMTL;                              // m-groups
  static constexpr int kThreadsCTA = kThreads * kMG;
  static constexpr int kBytes = static_cast<int>(sizeof(TC));
  static constexpr int kRowBytes = D * kBytes;                       // one K (or V) row
  static constexpr int kCPR = kRowBytes / 16;                        // 16-byte chunks per row
  static constexpr int kEPC = 16 / kBytes;                           // elements per chunk
  static constexpr int kTPR = kRowBytes >= 128 ? kRowBytes / 128 : 1;  // QK lanes per row
  static constexpr int kCPT = kCPR / kTPR;                           // chunks per QK lane
  static constexpr int kRW = 32 / kTPR;                              // rows per warp per tile
  static constexpr int kTK = kRW * kWarps;                           // rows per tile
  static constexpr int kLPR = D / 8;                                 // PV lanes per row
  static constexpr int kRGw = 32 / kLPR;                             // PV row groups per warp
  static constexpr int kRowsPV = kRW / kRGw;                         // rows per PV lane per tile
  static constexpr int kPStride = kMTL + 4;                          // floats per P row
  static constexpr int kStageBytes = 2 * kTK * kRowBytes;            // K + V of one tile
  static constexpr int kRedBytes = kWarps * kRGw * MT * D * 4;       // epilogue partial outputs
  static constexpr int kCopies = (kTK * kCPR) / kThreadsCTA;         // 16-byte copies / thread
  static_assert(kTPR <= 8 && kCPT * kTPR == kCPR, "bad row split");
  static_assert(kCPR >= 8 || (kCPR == 4 && kTPR == 1), "bad swizzle case");
  static_assert(kRowsPV * kRGw == kRW, "bad PV split");
  static_assert(kCopies * kThreadsCTA == kTK * kCPR, "bad copy split");

  static constexpr __host__ __device__ int kv_bytes(int stages) {
    return stages * kStageBytes > kRedBytes ? stages * kStageBytes : kRedBytes;
  }
  static constexpr __host__ __device__ int smem_bytes(int stages) {
    return kv_bytes(stages) + stages * kTK * 8 /*offsets*/ + stages * kTK * 8 /*scales*/ +
           MT * D * 4 /*q*/ + kMG * kTK * kPStride * 4 /*P*/ + MT * 8 /*lo, hi*/ +
           kWarps * MT * 8 /*warp max, sum*/ + MT * 8 /*final max, sum*/;
  }
  // Stages: 3 where two CTAs fit an SM (113 KB each), else 2; with two m-groups (one CTA per
  // SM, 256 threads) up to 4 within 200 KB.
  static constexpr int kStages =
      kStagesReq > 0 ? kStagesReq
      : kMG == 1     ? (smem_bytes(3) <= 113 * 1024 ? 3 : 2)
                     : (smem_bytes(4) <= 200 * 1024 ? 4 : (smem_bytes(3) <= 200 * 1024 ? 3 : 2));
  static constexpr int kSmem = smem_bytes(kStages);
  static constexpr int kKVBytes = kv_bytes(kStages);

  // Physical 16-byte chunk of logical chunk lc in tile row r: lc ^ swz(r).
  static __device__ __forceinline__ int swz(int r) {
    return kCPR >= 8 ? ((r * kTPR) & 7) : ((r >> 1) & 3);
  }
};

// ---------------------------------------------------------------------------------------------
// Main kernel
// ---------------------------------------------------------------------------------------------

template <typename TQ, typename TC, int D, int MT, int kStagesReq>
__global__ void __launch_bounds__(Cfg<TC, D, MT, kStagesReq>::kThreadsCTA,
                                  Cfg<TC, D, MT, kStagesReq>::kMG == 1 ? 2 : 1)
    paged_attention_kernel(const PagedAttentionParams p, const int32_t num_chunks) {
  using C = Cfg<TC, D, MT, kStagesReq>;
  constexpr int kS = C::kStages;
  constexpr int kTK = C::kTK;
  constexpr int kRB = C::kRowBytes;
  constexpr int kTPR = C::kTPR;
  constexpr int kEPC = C::kEPC;
  constexpr int kMTL = C::kMTL;
  constexpr int kNT = C::kThreadsCTA;
  constexpr int kKV = C::kKVBytes;

  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* kv_s = smem;                                         // [kS][K|V][kTK][kRB]
  int64_t* offs_s = reinterpret_cast<int64_t*>(smem + kKV);          // [kS][kTK]
  float* scl_s = reinterpret_cast<float*>(offs_s + kS * kTK);        // [kS][K|V][kTK]
  float* q_s = scl_s + kS * 2 * kTK;                                  // [MT][D]
  float* p_s = q_s + MT * D;                                          // [kMG][kTK][kPStride]
  int32_t* lo_s = reinterpret_cast<int32_t*>(p_s + C::kMG * kTK * C::kPStride);  // [MT]
  int32_t* hi_s = lo_s + MT;                                          // [MT]
  float* wm_s = reinterpret_cast<float*>(hi_s + MT);                  // [kWarps][MT]
  float* wl_s = wm_s + kWarps * MT;                                   // [kWarps][MT]
  float* fm_s = wl_s + kWarps * MT;                                   // [MT] final max (ref)
  float* fl_s = fm_s + MT;                                            // [MT] final sum
  float* red_s = reinterpret_cast<float*>(smem);                      // epilogue overlay

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Lets the split-KV merge grid (launched as a programmatic dependent) be scheduled early; it
  // waits for this grid's completion (griddepcontrol.wait) before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = (tid >> 5) % kWarps;  // warp within the m-group
  const int mg = (tid >> 5) / kWarps;    // m-group
  const int mbase = mg * kMTL;           // first CTA row of the m-group

  const PagedCta cta = paged_cta<MT>(p, num_chunks);
  if (paged_reject_bad_klen<TQ, kNT>(p, D, cta, tid)) return;
  // ---- key range of this CTA: the union of its rows' visible keys within the split ----
  const PagedKeyRange kr = paged_key_range<kTK>(p, cta);
  const int32_t kb = kr.kb, ke = kr.ke;
  const int ntiles = kr.ntiles;

  // ---- page-table resolution: thread r < kTK owns row r of every tile. Every page id is
  // checked before use: an invalid one is never read through (its row is zero-filled) and
  // marks the sequence bad (the whole-sequence check below catches it anyway). ----
  constexpr float kLog2e = 1.4426950408889634f;
  const bool has_cap = p.softcap > 0.f;
  const bool per_token = p.scale_mode == ScaleMode::kPerToken;
  const char* kp = static_cast<const char*>(p.k_pages);
  const char* vp = static_cast<const char*>(p.v_pages);
  int bad = 0;
  PagedRowRef pf;  // the page of this thread's row of the next tile to place
  auto prefetch_row = [&](int T) {
    pf = paged_row_ref(cta.bt, static_cast<int64_t>(kb) + static_cast<int64_t>(T) * kTK + tid, ke,
                       p.page_size, true);
  };
  auto store_row = [&](int slot) { offs_s[slot * kTK + tid] = paged_row_index(pf, p, cta.kvh, bad); };
  auto issue = [&](int slot) {
    const int64_t* offs = offs_s + slot * kTK;
    unsigned char* kdst = kv_s + slot * C::kStageBytes;
    unsigned char* vdst = kdst + kTK * kRB;
#pragma unroll
    for (int j = 0; j < C::kCopies; ++j) {
      const int c = tid + j * kNT;
      const int r = c / C::kCPR;
      const int lc = c % C::kCPR;
      const int64_t ri = offs[r];
      const int dst = r * kRB + ((lc ^ C::swz(r)) << 4);
      paged_copy16(kdst + dst, kp, ri, kRB, lc << 4);
      paged_copy16(vdst + dst, vp, ri, kRB, lc << 4);
    }
    if (per_token && tid < kTK) {
      const int64_t ri = offs[tid];
      const int nb = ri >= 0 ? 4 : 0;
      cp_async4(scl_s + slot * 2 * kTK + tid, ri >= 0 ? p.k_scale + ri : p.k_scale, nb);
      cp_async4(scl_s + slot * 2 * kTK + kTK + tid, ri >= 0 ? p.v_scale + ri : p.v_scale, nb);
    }
  };

  // ---- prologue: the page ids of the first kS + 1 tiles and the query rows are loaded
  // together (one memory round trip) ----
  PagedRowRef ref0[kS + 1];
#pragma unroll
  for (int T = 0; T <= kS; ++T)
    ref0[T] = paged_row_ref(cta.bt, static_cast<int64_t>(kb) + static_cast<int64_t>(T) * kTK + tid,
                            ke, p.page_size, tid < kTK);
  float qscale = p.softmax_scale * (has_cap ? 1.f / p.softcap : kLog2e);
  float vscale_head = 1.f;
  if (p.scale_mode == ScaleMode::kPerHead) {
    qscale *= __ldg(p.k_scale + cta.kvh);
    vscale_head = __ldg(p.v_scale + cta.kvh);
  }
  const float cap2 = p.softcap * kLog2e;
  constexpr int kQIt = (MT * (D / 4) + kNT - 1) / kNT;
  float4 qv[kQIt];
#pragma unroll
  for (int k = 0; k < kQIt; ++k) {
    const int idx = tid + k * kNT;
    const int m = idx / (D / 4);
    const int d4 = idx - m * (D / 4);
    qv[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < cta.mvalid)
      qv[k] = load4_q<TQ>(static_cast<const TQ*>(p.q) + paged_q_offset(p, D, cta, cta.m0 + m, 4 * d4));
  }
  paged_place_first_rows<kS, kTK>(tid, ntiles, ref0, pf, store_row);
#pragma unroll
  for (int k = 0; k < kQIt; ++k) {
    const int idx = tid + k * kNT;
    const int m = idx / (D / 4);
    const int d4 = idx - m * (D / 4);
    if (m < MT)
      *reinterpret_cast<float4*>(q_s + m * D + 4 * d4) = make_float4(
          qv[k].x * qscale, qv[k].y * qscale, qv[k].z * qscale, qv[k].w * qscale);
  }
  if (tid < MT) {
    int32_t lo, hi;
    paged_row_visible(p, cta, tid, &lo, &hi);
    lo_s[tid] = lo;
    hi_s[tid] = hi;
  }
  __syncthreads();
  paged_prime_pipeline<kS>(ntiles, issue);
  paged_scan_block_table<kNT>(p, cta, tid, bad);

  // ---- main loop ----
  float m_run[kMTL], l_run[kMTL], o[kMTL][8];
#pragma unroll
  for (int m = 0; m < kMTL; ++m) {
    m_run[m] = neg_inf();
    l_run[m] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[m][e] = 0.f;
  }

  const int rq = warp * C::kRW + lane / kTPR;  // QK: tile row of this lane
  const int pp = lane % kTPR;                  // QK: part of the row
  const int swq = C::swz(rq);
  const int rg = lane / C::kLPR;               // PV: row group
  const int cv = lane % C::kLPR;               // PV: column slot
  float* p_g = p_s + mg * kTK * C::kPStride;   // this m-group's P
  const float* q_g = q_s + mbase * D;          // this m-group's query rows

  for (int n = 0; n < ntiles; ++n) {
    cp_async_wait<kS - 2>();
    __syncthreads();
    if (n + kS - 1 < ntiles) issue((n + kS - 1) % kS);
    cp_async_commit();
    if (tid < kTK && n + kS < ntiles) {
      store_row((n + kS) % kS);
      prefetch_row(n + kS + 1);
    }

    const int buf = n % kS;
    const unsigned char* kbuf = kv_s + buf * C::kStageBytes;
    const unsigned char* vbuf = kbuf + kTK * kRB;

    // Q K^T
    float s[kMTL];
#pragma unroll
    for (int m = 0; m < kMTL; ++m) s[m] = 0.f;
    {
      const unsigned char* krow = kbuf + rq * kRB;
#pragma unroll
      for (int i = 0; i < C::kCPT; ++i) {
        const int lc = pp + kTPR * i;
        const uint4 raw = *reinterpret_cast<const uint4*>(krow + ((lc ^ swq) << 4));
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        float kf[kEPC];
        cvt_words<TC>(w, kf, 4);
#pragma unroll
        for (int m = 0; m < kMTL; ++m) {
          const float4* qv = reinterpret_cast<const float4*>(q_g + m * D + lc * kEPC);
#pragma unroll
          for (int e = 0; e < kEPC / 4; ++e) {
            const float4 qq = qv[e];
            s[m] = fmaf(qq.x, kf[4 * e], s[m]);
            s[m] = fmaf(qq.y, kf[4 * e + 1], s[m]);
            s[m] = fmaf(qq.z, kf[4 * e + 2], s[m]);
            s[m] = fmaf(qq.w, kf[4 * e + 3], s[m]);
          }
        }
      }
    }
#pragma unroll
    for (int off = 1; off < kTPR; off <<= 1) {
#pragma unroll
      for (int m = 0; m < kMTL; ++m) s[m] += __shfl_xor_sync(kFull, s[m], off);
    }

    // scale, softcap, mask
    const int64_t t0 = static_cast<int64_t>(kb) + static_cast<int64_t>(n) * kTK;
    const bool full = t0 >= kr.lo_last && t0 + kTK <= kr.hi_first && t0 + kTK <= ke;
    const float ksc = per_token ? scl_s[buf * 2 * kTK + rq] : 1.f;
    const float vsc = per_token ? scl_s[buf * 2 * kTK + kTK + rq] : 1.f;
    const int64_t j = t0 + rq;
#pragma unroll
    for (int m = 0; m < kMTL; ++m) {
      float x = s[m] * ksc;
      if (has_cap) x = tanhf(x) * cap2;
      if (!full && !(j < ke && j >= lo_s[mbase + m] && j < hi_s[mbase + m])) x = neg_inf();
      s[m] = x;
    }

    // online softmax (per warp); the rescaling of a row's output is skipped (warp-uniformly)
    // while its max holds
#pragma unroll
    for (int m = 0; m < kMTL; ++m) {
      float mx = s[m];
#pragma unroll
      for (int off = kTPR; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
      const float m_new = fmaxf(m_run[m], mx);
      const float mref = m_new == neg_inf() ? 0.f : m_new;
      if (m_new != m_run[m]) {
        const float alpha = fast_exp2(m_run[m] - mref);
        l_run[m] *= alpha;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[m][e] *= alpha;
        m_run[m] = m_new;
      }
      const float pm = fast_exp2(s[m] - mref);
      if (pp == 0) l_run[m] += pm;
      s[m] = pm * vsc;
    }
    if (pp == 0) {
      float4* prow = reinterpret_cast<float4*>(p_g + rq * C::kPStride);
#pragma unroll
      for (int k = 0; k < kMTL / 4; ++k)
        prow[k] = make_float4(s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]);
    }
    __syncwarp();

    // P V
#pragma unroll
    for (int i = 0; i < C::kRowsPV; ++i) {
      const int rv = warp * C::kRW + rg + C::kRGw * i;  // tile row
      const unsigned char* vrow = vbuf + rv * kRB;
      const int sw = C::swz(rv);
      float vf[8];
      if constexpr (sizeof(TC) == 4) {
        const uint4 a = *reinterpret_cast<const uint4*>(vrow + ((cv ^ sw) << 4));
        const uint4 c2 =
            *reinterpret_cast<const uint4*>(vrow + (((cv + C::kCPR / 2) ^ sw) << 4));
        const uint32_t w[8] = {a.x, a.y, a.z, a.w, c2.x, c2.y, c2.z, c2.w};
        cvt_words<TC>(w, vf, 8);
      } else if constexpr (sizeof(TC) == 2) {
        const uint4 a = *reinterpret_cast<const uint4*>(vrow + ((cv ^ sw) << 4));
        const uint32_t w[4] = {a.x, a.y, a.z, a.w};
        cvt_words<TC>(w, vf, 4);
      } else {
        const uint2 a = *reinterpret_cast<const uint2*>(vrow + (((cv >> 1) ^ sw) << 4) +
                                                        ((cv & 1) << 3));
        const uint32_t w[2] = {a.x, a.y};
        cvt_words<TC>(w, vf, 2);
      }
      float pm[kMTL];
      const float4* prow = reinterpret_cast<const float4*>(p_g + rv * C::kPStride);
#pragma unroll
      for (int k = 0; k < kMTL / 4; ++k) {
        const float4 t = prow[k];
        pm[4 * k] = t.x;
        pm[4 * k + 1] = t.y;
        pm[4 * k + 2] = t.z;
        pm[4 * k + 3] = t.w;
      }
#pragma unroll
      for (int m = 0; m < kMTL; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[m][e] = fmaf(pm[m], vf[e], o[m][e]);
      }
    }
  }

  // ---- epilogue: merge the warps' states ----
  cp_async_wait<0>();
#pragma unroll
  for (int m = 0; m < kMTL; ++m) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) l_run[m] += __shfl_xor_sync(kFull, l_run[m], off);
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < kMTL; ++m) {
      wm_s[warp * MT + mbase + m] = m_run[m];
      wl_s[warp * MT + mbase + m] = l_run[m];
    }
  }
  // also: every warp is done with the stage buffers (red_s overlays them)
  if (__syncthreads_or(bad)) {
    paged_store_nan<TQ, kNT>(p, D, cta, tid);
    return;
  }
  const int group = warp * C::kRGw + rg;
#pragma unroll
  for (int m = 0; m < kMTL; ++m) {
    const int cm = mbase + m;
    const float mref = paged_final_max<kWarps, MT>(wm_s, cm);
    const float f = fast_exp2(m_run[m] - mref);
    float* dst = red_s + (group * MT + cm) * D;
    if constexpr (sizeof(TC) == 4) {
      *reinterpret_cast<float4*>(dst + 4 * cv) =
          make_float4(o[m][0] * f, o[m][1] * f, o[m][2] * f, o[m][3] * f);
      *reinterpret_cast<float4*>(dst + 4 * cv + D / 2) =
          make_float4(o[m][4] * f, o[m][5] * f, o[m][6] * f, o[m][7] * f);
    } else {
      *reinterpret_cast<float4*>(dst + 8 * cv) =
          make_float4(o[m][0] * f, o[m][1] * f, o[m][2] * f, o[m][3] * f);
      *reinterpret_cast<float4*>(dst + 8 * cv + 4) =
          make_float4(o[m][4] * f, o[m][5] * f, o[m][6] * f, o[m][7] * f);
    }
    if (warp == 0 && lane == m) {
      fm_s[cm] = mref;
      fl_s[cm] = paged_final_sum<kWarps, MT>(wm_s, wl_s, cm, mref);
    }
  }
  __syncthreads();
  paged_store_rows<TQ, kWarps * C::kRGw, MT, D, kNT>(p, D, cta, tid, red_s, fm_s, fl_s,
                                                        vscale_head);
}

template <typename TQ, typename TC, int D, int MT, int kStagesReq = 0>
cudaError_t launch_paged_attention_mt(const PagedAttentionParams& p, cudaStream_t stream) {
  using C = Cfg<TC, D, MT, kStagesReq>;
  const int64_t rows = static_cast<int64_t>(p.num_heads / p.num_heads_k) * p.seqlen_q;
  const int64_t chunks = (rows + MT - 1) / MT;
  const int64_t blocks = static_cast<int64_t>(p.batch) * p.num_heads_k * p.num_splits * chunks;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  auto kernel = paged_attention_kernel<TQ, TC, D, MT, kStagesReq>;
  cudaError_t err = ensure_smem_attrs<paged_attention_kernel<TQ, TC, D, MT, kStagesReq>>(C::kSmem);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), C::kThreadsCTA, C::kSmem, stream>>>(
      p, static_cast<int32_t>(chunks));
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_paged_merge<TQ, D>(p, stream);
}

}  // namespace paged
}  // namespace jax_flash
