// Paged decode attention on CUDA cores (see paged_params.h for the contract): one CTA per
// (sequence, kv head, split, query-row chunk). The CTA holds all query rows of its chunk (MT = 4,
// 8 or 16 rows: the query heads of the GQA group times the Sq query rows, row m = i * G + g), so
// every K/V row is read from device memory once and serves the whole group; G * Sq > 16 takes
// several chunks (several CTAs, each reading the K/V). MT = 16 runs two "m-groups" of 4 warps
// (256 threads) that share the copy pipeline.
//
// Pipeline: the K and V rows of a tile of TK keys are copied with 16-byte cp.async (L1 bypass)
// into a ring of 2-4 shared-memory stages (3 where two CTAs fit an SM), rows placed through the
// page table one by one (any page size; a tile may straddle pages; page offsets in int64). The
// page id of the row a thread places is loaded one tile ahead into a register and checked before
// use; the row offsets go to a ring in shared memory; per-token scales travel with their tile
// (4-byte cp.async). Rows past the key range are zero-filled (never read from memory). The
// whole-sequence check of the block table (bad data -> NaN) runs under the first copies.
//
// Compute, per warp and tile (each warp owns TK / 4 rows of the tile, with its own running
// max / sum / output, merged across warps at the end):
//   Q K^T: TPR lanes per K row, each lane 128 bytes of the row (16-byte shared loads, elements
//          converted to float32 in registers, int8 / e4m3 dequantised there), dotted with Q
//          (float32 in shared memory, pre-scaled by softmax_scale * log2(e) [/ softcap] and the
//          per-head K scale), reduced over the TPR lanes with shuffles.
//   softmax: scores in log2 units, exp2; the warp's running max per query row (shuffles over
//          rows); P (times the per-token V scale) goes to a per-warp shared buffer.
//   P V:   Dv / 8 lanes per V row, each owning 8 output columns of its m-group's rows.
// Shared-memory rows are XOR-swizzled in 16-byte units so that the cp.async writes, the Q K^T
// reads and the P V reads are free of bank conflicts.
//
// Split-KV (num_splits > 1): each split writes its normalised partial output and LSE to
// o_partial / lse_partial; paged_merge_kernel combines them (one CTA per output row, fixed
// order: deterministic), launched as a programmatic dependent launch on sm_90+.
//
// 16-bit q with a cache of q's dtype or an int8 / e4m3 cache goes to the tensor-core kernel of
// paged_attention_mma.cuh instead (paged_use_mma; it shares the page-table, bad-data and output
// helpers and the merge).
//
// No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/paged_params.h"

namespace jax_flash {
namespace paged {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fffffff); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

// The address a * b + c (one wide multiply-add: the compiler would otherwise re-associate the
// 64-bit additions).
__device__ __forceinline__ const void* mad_wide(uint32_t a, uint32_t b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return reinterpret_cast<const void*>(d);
}

// The same copies with a zero-fill predicate: `zero` writes zeros and reads nothing (gmem must
// still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool zero) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(s),
      "l"(gmem), "r"(static_cast<int>(zero)));
}

__device__ __forceinline__ void cp_async4_zfill(void* smem, const void* gmem, bool zero) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
      " cp.async.ca.shared.global [%0], [%1], 4, z;\n}\n" ::"r"(s),
      "l"(gmem), "r"(static_cast<int>(zero)));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 4 signed bytes -> 4 floats (exact): 0x4B0000xx is 2^23 + xx as a float.
__device__ __forceinline__ void s8x4_to_float(uint32_t w, float* f) {
  const uint32_t x = w ^ 0x80808080u;
  f[0] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7440)) - 8388736.f;
  f[1] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7441)) - 8388736.f;
  f[2] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7442)) - 8388736.f;
  f[3] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7443)) - 8388736.f;
}

// 4 e4m3 bytes -> 4 floats (exact; the hardware conversion on sm_89+).
__device__ __forceinline__ void e4m3x4_to_float(uint32_t w, float* f) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo));
  const float2 b = __half22float2(__half2(hi));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// Converts nwords 32-bit words of cache elements (1, 2 or 4 elements each) to floats. nwords is
// a compile-time constant at every call site (the loop unrolls).
template <typename TC>
__device__ __forceinline__ void cvt_words(const uint32_t* w, float* f, int nwords) {
#pragma unroll
  for (int i = 0; i < nwords; ++i) {
    if constexpr (std::is_same_v<TC, float>) {
      f[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<TC, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else if constexpr (std::is_same_v<TC, __half>) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 v = __half22float2(h);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    } else if constexpr (std::is_same_v<TC, int8_t>) {
      s8x4_to_float(w[i], f + 4 * i);
    } else {
      e4m3x4_to_float(w[i], f + 4 * i);
    }
  }
}

// 4 consecutive elements of q (aligned to 4 elements) as floats.
template <typename TQ>
__device__ __forceinline__ float4 load4_q(const TQ* src) {
  if constexpr (std::is_same_v<TQ, float>) {
    return __ldg(reinterpret_cast<const float4*>(src));
  } else {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(src));
    const uint32_t w[2] = {u.x, u.y};
    float f[4];
    cvt_words<TQ>(w, f, 2);
    return make_float4(f[0], f[1], f[2], f[3]);
  }
}

// ---------------------------------------------------------------------------------------------
// Sequence, page-table and output helpers shared by the CUDA-core kernel below and the
// tensor-core kernel (paged_attention_mma.cuh)
// ---------------------------------------------------------------------------------------------

// A kv length outside [0, max_pages * page_size] makes the whole sequence bad (NaN).
__device__ __forceinline__ bool paged_klen_bad(const PagedAttentionParams& p, int32_t klen) {
  return klen < 0 || static_cast<int64_t>(klen) > static_cast<int64_t>(p.max_pages) * p.page_size;
}

// Visible keys [lo, hi) of query position i (0 <= i < Sq) of a sequence of klen keys (bottom-right
// aligned window, paged_params.h); non-decreasing in i; hi >= lo.
__device__ __forceinline__ void paged_visible(const PagedAttentionParams& p, int32_t klen, int i,
                                              int32_t* lo, int32_t* hi) {
  const int64_t diag = static_cast<int64_t>(i) + klen - p.seqlen_q;
  int64_t l = 0, h = klen;
  if (p.window_left >= 0 && diag - p.window_left > l) l = diag - p.window_left;
  if (p.window_right >= 0 && diag + p.window_right + 1 < h) h = diag + p.window_right + 1;
  if (h < l) h = l;
  *lo = static_cast<int32_t>(l);
  *hi = static_cast<int32_t>(h);
}

// Page id and in-page offset of key t of a sequence (bt: its block-table row), loaded ahead of
// use: the id is checked only when the row is placed (paged_row_index).
struct PagedRowRef {
  int32_t page;
  int32_t off;
  bool valid;  // active and t < ke
};

__device__ __forceinline__ PagedRowRef paged_row_ref(const int32_t* bt, int64_t t, int32_t ke,
                                                     int32_t ps, bool active) {
  PagedRowRef r;
  r.valid = active && t < ke;
  r.page = 0;
  r.off = 0;
  if (r.valid) {  // 0 <= t < ke <= 2^31 - 1: 32-bit division
    const uint32_t t32 = static_cast<uint32_t>(t);
    const uint32_t pidx = t32 / static_cast<uint32_t>(ps);
    r.off = static_cast<int32_t>(t32 - pidx * static_cast<uint32_t>(ps));
    r.page = __ldg(bt + pidx);
  }
  return r;
}

// Whether a prefetched key has a row to read: it is in range and its page id is valid; a key in
// range behind an invalid id sets `bad`.
__device__ __forceinline__ bool paged_row_ok(const PagedRowRef& r, const PagedAttentionParams& p,
                                             int& bad) {
  const bool ok = r.page >= 0 && r.page < p.num_pages;
  bad |= r.valid && !ok;
  return r.valid && ok;
}

// Cache row ((page * page_size + off) * Hkv + kvh) of a prefetched key, or -1 for a key past the
// range or behind an invalid page id (never read through; it sets `bad`).
__device__ __forceinline__ int64_t paged_row_index(const PagedRowRef& r,
                                                   const PagedAttentionParams& p, int kvh,
                                                   int& bad) {
  return paged_row_ok(r, p, bad)
             ? (static_cast<int64_t>(r.page) * p.page_size + r.off) * p.num_heads_k + kvh
             : int64_t(-1);
}

// 16-byte chunk `byte_off` of cache row `ri` (rows of row_bytes) of `base` into shared memory;
// ri < 0 zero-fills the 16 bytes without reading.
__device__ __forceinline__ void paged_copy16(void* smem, const char* base, int64_t ri,
                                             int row_bytes, int byte_off) {
  cp_async16(smem, ri >= 0 ? base + ri * row_bytes + byte_off : base, ri >= 0 ? 16 : 0);
}

// Whole-sequence check of the first ceil(klen / page_size) block-table entries by kNT threads
// (each returns its own flag; OR them over the CTA).
template <int kNT>
__device__ __forceinline__ int paged_block_table_bad(const PagedAttentionParams& p,
                                                     const int32_t* bt, int32_t klen, int tid) {
  const int32_t ps = p.page_size;
  const int32_t npg = klen / ps + (klen % ps != 0);
  int bad = 0;
  for (int i0 = 0; i0 < npg; i0 += 8 * kNT) {
    int32_t id[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = i0 + k * kNT + tid;
      id[k] = i < npg ? __ldg(bt + i) : 0;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) bad |= (id[k] < 0) | (id[k] >= p.num_pages);
  }
  return bad;
}

// Stores 4 output columns [4 * q4, 4 * q4 + 4) of group row gm (query position gm / G, head
// kvh * G + gm % G) of sequence b, and its LSE when write_lse: to o / lse, or with split-KV to
// this split's o_partial / lse_partial.
template <typename TQ, int D>
__device__ __forceinline__ void paged_store_out(const PagedAttentionParams& p, int b, int kvh,
                                                int split, int G, int gm, int q4, float4 v,
                                                bool write_lse, float lse) {
  const int i = gm / G;
  const int h = kvh * G + (gm - i * G);
  const int Sq = p.seqlen_q, Hq = p.num_heads;
  const bool split_out = p.num_splits > 1;
  const int64_t bb = split_out ? static_cast<int64_t>(split) * p.batch + b : b;
  const int64_t o_off = ((bb * Sq + i) * Hq + h) * D + 4 * q4;
  const int64_t l_off = (bb * Hq + h) * Sq + i;
  if (split_out) {
    *reinterpret_cast<float4*>(p.o_partial + o_off) = v;
    if (write_lse) p.lse_partial[l_off] = lse;
  } else {
    store4_from_float<TQ>(static_cast<TQ*>(p.o) + o_off, v.x, v.y, v.z, v.w);
    if (write_lse) p.lse[l_off] = lse;
  }
}

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

  // blockIdx.x = ((b * Hkv + kvh) * num_splits + split) * num_chunks + chunk (< 2^31)
  uint32_t bid = blockIdx.x;
  const int chunk = static_cast<int>(bid % static_cast<uint32_t>(num_chunks));
  bid /= static_cast<uint32_t>(num_chunks);
  const int split = static_cast<int>(bid % static_cast<uint32_t>(p.num_splits));
  bid /= static_cast<uint32_t>(p.num_splits);
  const int kvh = static_cast<int>(bid % static_cast<uint32_t>(p.num_heads_k));
  const int b = static_cast<int>(bid / static_cast<uint32_t>(p.num_heads_k));

  const int Hq = p.num_heads;
  const int Hkv = p.num_heads_k;
  const int G = Hq / Hkv;
  const int Sq = p.seqlen_q;
  const int m0 = chunk * MT;
  const int mvalid = min(MT, G * Sq - m0);
  const int ps = p.page_size;

  // Output of CTA row m (m < mvalid): 4 columns at 4 * q4, and the LSE when q4 == 0.
  auto store_out = [&](int m, int q4, float4 v, float lse) {
    paged_store_out<TQ, D>(p, b, kvh, split, G, m0 + m, q4, v, q4 == 0, lse);
  };

  // ---- kv length; a bad one makes the whole sequence NaN at once ----
  const int32_t klen = __ldg(p.kv_lens + b);
  const int32_t* bt = p.block_tables + static_cast<int64_t>(b) * p.max_pages;
  auto store_nan = [&]() {
    for (int idx = tid; idx < mvalid * (D / 4); idx += kNT)
      store_out(idx / (D / 4), idx % (D / 4), make_float4(qnan(), qnan(), qnan(), qnan()), qnan());
  };
  if (paged_klen_bad(p, klen)) {
    store_nan();  // klen is the same for every thread: no barrier needed
    return;
  }

  // ---- visible key range of this CTA ----
  // Visible keys of query position i: [lo(i), hi(i)), non-decreasing in i; rows are ordered
  // by query position, padding rows (m >= mvalid) see nothing.
  auto visible = [&](int i, int32_t* lo, int32_t* hi) { paged_visible(p, klen, i, lo, hi); };
  int32_t lo_first, hi_first, lo_last, hi_last;
  visible(m0 / G, &lo_first, &hi_first);
  visible((m0 + mvalid - 1) / G, &lo_last, &hi_last);
  int32_t kb, ke;
  split_range(klen, ps, p.num_splits, split, &kb, &ke);
  kb = max(kb, lo_first);
  ke = min(ke, hi_last);
  const int ntiles =
      ke > kb ? static_cast<int>((static_cast<int64_t>(ke) - kb + kTK - 1) / kTK) : 0;

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
    pf = paged_row_ref(bt, static_cast<int64_t>(kb) + static_cast<int64_t>(T) * kTK + tid, ke,
                       ps, true);
  };
  auto store_row = [&](int slot) { offs_s[slot * kTK + tid] = paged_row_index(pf, p, kvh, bad); };
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
    ref0[T] = paged_row_ref(bt, static_cast<int64_t>(kb) + static_cast<int64_t>(T) * kTK + tid,
                            ke, ps, tid < kTK);
  float qscale = p.softmax_scale * (has_cap ? 1.f / p.softcap : kLog2e);
  float vscale_head = 1.f;
  if (p.scale_mode == ScaleMode::kPerHead) {
    qscale *= __ldg(p.k_scale + kvh);
    vscale_head = __ldg(p.v_scale + kvh);
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
    if (m < mvalid) {
      const int gm = m0 + m;
      const int i = gm / G;
      const int h = kvh * G + (gm - i * G);
      qv[k] = load4_q<TQ>(static_cast<const TQ*>(p.q) +
                          ((static_cast<int64_t>(b) * Sq + i) * Hq + h) * D + 4 * d4);
    }
  }
  if (tid < kTK) {
#pragma unroll
    for (int T = 0; T < kS; ++T) {
      pf = ref0[T];
      if (T < ntiles) store_row(T);
    }
    pf = ref0[kS];
  }
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
    int32_t lo = 0, hi = 0;
    if (tid < mvalid) visible((m0 + tid) / G, &lo, &hi);
    lo_s[tid] = lo;
    hi_s[tid] = hi;
  }
  __syncthreads();
#pragma unroll
  for (int T = 0; T < kS - 1; ++T) {
    if (T < ntiles) issue(T);
    cp_async_commit();
  }

  // ---- whole-sequence check of the page ids (under the first copies). With split-KV only
  // split 0 scans: its NaN partial makes the merged output NaN. ----
  if (split == 0) bad |= paged_block_table_bad<kNT>(p, bt, klen, tid);

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
    const bool full = t0 >= lo_last && t0 + kTK <= hi_first && t0 + kTK <= ke;
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
    store_nan();
    return;
  }
  const int group = warp * C::kRGw + rg;
#pragma unroll
  for (int m = 0; m < kMTL; ++m) {
    const int cm = mbase + m;
    float mf = neg_inf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mf = fmaxf(mf, wm_s[w * MT + cm]);
    const float mref = mf == neg_inf() ? 0.f : mf;
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
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        l += fast_exp2(wm_s[w * MT + cm] - mref) * wl_s[w * MT + cm];
      fm_s[cm] = mref;
      fl_s[cm] = l;
    }
  }
  __syncthreads();
  constexpr int kGroups = kWarps * C::kRGw;
  constexpr float kLn2 = 0.6931471805599453f;
  for (int idx = tid; idx < mvalid * (D / 4); idx += kNT) {
    const int m = idx / (D / 4);
    const int q4 = idx - m * (D / 4);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const float4 t = *reinterpret_cast<const float4*>(red_s + (g * MT + m) * D + 4 * q4);
      acc.x += t.x;
      acc.y += t.y;
      acc.z += t.z;
      acc.w += t.w;
    }
    const float l = fl_s[m];
    const float inv = (l == 0.f ? 0.f : 1.f / l) * vscale_head;
    const float lse = l == 0.f ? neg_inf() : (fm_s[m] + log2f(l)) * kLn2;
    store_out(m, q4, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv), lse);
  }
}

// ---------------------------------------------------------------------------------------------
// Split-KV merge: one CTA of 128 threads per output row (b, i, h). Thread t owns float4 column
// t % (D / 4) of the splits s = t / (D / 4) (mod kGroups); its first loads are issued before the
// weights are known, so a row costs about two memory round trips. Warp 0 computes the LSE and
// the weights exp(lse_s - lse) (dynamic shared memory, one float per split); the groups' sums
// are added in a fixed order (deterministic).
// ---------------------------------------------------------------------------------------------

constexpr int kMaxMergeSplits = 8192;  // dynamic shared memory: 4 bytes per split

template <typename TQ, int D>
__global__ void __launch_bounds__(128) paged_merge_kernel(const PagedAttentionParams p) {
  constexpr int kQ = D / 4;            // float4 columns per row
  constexpr int kGroups = 128 / kQ;    // split groups: 8, 4 or 2
  // loads in flight per thread: 64 splits in one round for D 64 and 128 (D 256: 32)
  constexpr int kBatch = kGroups >= 8 ? 8 : 16;
  extern __shared__ float w_s[];       // [num_splits] lse_s, then weights
  __shared__ float4 red_s[kGroups][kQ];
  __shared__ float lse_s;
  __shared__ int mode_s;               // 0 normal, 1 all -inf (empty), 2 NaN

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the attention grid: wait until it has completed
  // and its writes are visible (a no-op for an ordinary launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int c = tid % kQ;
  const int g = tid / kQ;
  const int64_t row = blockIdx.x;  // (b * Sq + i) * Hq + h
  const int Hq = p.num_heads, Sq = p.seqlen_q;
  const int64_t rows = static_cast<int64_t>(p.batch) * Sq * Hq;
  const int h = static_cast<int>(row % Hq);
  const int i = static_cast<int>((row / Hq) % Sq);
  const int64_t b = row / (static_cast<int64_t>(Hq) * Sq);
  const int64_t l_idx = (b * Hq + h) * Sq + i;
  const int ns = p.num_splits;
  const float4* src = reinterpret_cast<const float4*>(p.o_partial + row * D) + c;
  const int64_t o_stride4 = rows * kQ;  // float4 per split

  // first batch of partial outputs (independent of the weights)
  float4 pre[kBatch];
#pragma unroll
  for (int k = 0; k < kBatch; ++k) {
    const int s = g + k * kGroups;
    pre[k] = s < ns ? src[s * o_stride4] : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (tid < 32) {
    float mx = neg_inf();
    bool nan = false;
    for (int s = lane; s < ns; s += 32) {
      const float v = p.lse_partial[s * rows + l_idx];
      w_s[s] = v;
      nan |= v != v;
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
    nan = __any_sync(kFull, nan);
    const int mode = nan ? 2 : (mx == neg_inf() ? 1 : 0);
    float lse = nan ? qnan() : neg_inf();
    if (mode == 0) {
      float sum = 0.f;
      for (int s = lane; s < ns; s += 32) sum += expf(w_s[s] - mx);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
      lse = mx + logf(sum);
      // an empty split (-inf) gets weight 0; its partial output is 0
      for (int s = lane; s < ns; s += 32) w_s[s] = expf(w_s[s] - lse);
    }
    if (lane == 0) {
      lse_s = lse;
      mode_s = mode;
    }
  }
  __syncthreads();
  const int mode = mode_s;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mode == 0) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int s = g + k * kGroups;
      if (s < ns) {
        const float w = w_s[s];
        acc.x = fmaf(w, pre[k].x, acc.x);
        acc.y = fmaf(w, pre[k].y, acc.y);
        acc.z = fmaf(w, pre[k].z, acc.z);
        acc.w = fmaf(w, pre[k].w, acc.w);
      }
    }
    for (int s0 = g + kBatch * kGroups; s0 < ns; s0 += kBatch * kGroups) {
      float4 v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = s0 + k * kGroups;
        v[k] = s < ns ? src[s * o_stride4] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = s0 + k * kGroups;
        const float w = s < ns ? w_s[s] : 0.f;
        acc.x = fmaf(w, v[k].x, acc.x);
        acc.y = fmaf(w, v[k].y, acc.y);
        acc.z = fmaf(w, v[k].z, acc.z);
        acc.w = fmaf(w, v[k].w, acc.w);
      }
    }
  }
  red_s[g][c] = acc;
  __syncthreads();
  if (g == 0) {
    float4 o = red_s[0][c];
#pragma unroll
    for (int k = 1; k < kGroups; ++k) {
      const float4 t = red_s[k][c];
      o.x += t.x;
      o.y += t.y;
      o.z += t.z;
      o.w += t.w;
    }
    if (mode == 2) o = make_float4(qnan(), qnan(), qnan(), qnan());
    store4_from_float<TQ>(static_cast<TQ*>(p.o) + row * D + 4 * c, o.x, o.y, o.z, o.w);
    if (c == 0) p.lse[l_idx] = lse_s;
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

// Whether the split-KV merge is launched as a programmatic dependent launch on sm_90+ (default
// on; a switch for tests and benchmarks).
inline bool& merge_pdl_enabled() {
  static bool enabled = true;
  return enabled;
}

// Whether the tensor-core decode kernel is launched as a programmatic dependent of the
// stream's previous kernel on sm_90+ (default on; JAX_FLASH_PAGED_PDL=0 turns it off, read
// once; a switch for tests and benchmarks).
inline bool& paged_attention_pdl_enabled() {
  static bool enabled = [] {
    const char* e = std::getenv("JAX_FLASH_PAGED_PDL");
    return !(e != nullptr && e[0] == '0' && e[1] == 0);
  }();
  return enabled;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch
// (cudaLaunchAttributeProgrammaticStreamSerialization) when `pdl` and the device is sm_90+:
// the kernel must then run griddepcontrol.wait before reading anything an earlier kernel of
// the stream may write.
template <typename... KArgs, typename... Args>
cudaError_t paged_launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, bool pdl, Args... args) {
  int dev = 0, major = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = (major >= 9 && pdl) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

// Whether launch_paged_merge launches the merge at all (default on; off only in the standalone
// tool, to time the attention grid alone: the output is then left unmerged).
inline bool& merge_enabled() {
  static bool enabled = true;
  return enabled;
}

// Query rows per CTA for a group of `rows` = G * Sq rows.
inline int paged_rows_per_cta(int64_t rows) { return rows <= 4 ? 4 : (rows <= 8 ? 8 : 16); }

template <typename TQ, int D>
cudaError_t launch_paged_merge(const PagedAttentionParams& p, cudaStream_t stream);

// ---- Tensor-core path (paged_attention_mma.cuh) ----
// Taken for float16 / bfloat16 q with a cache of q's dtype or an int8 / float8 e4m3 cache (any
// scale mode; D 64, 128, 256), whatever the group's query rows (it used to need 4). Measured on an H100 (bf16, D 128, page 16, GB/s of K+V,
// CUDA-core -> tensor-core kernel): B=64 ctx 8k G=4 Sq=1 2943 -> 2996, G=4 Sq=4 1179 -> 2980,
// G=8 Sq=1 2194 -> 2992, G=8 Sq=4 589 -> 2765; B=1 ctx 32k G=4 Sq=1 1951 -> 2308, G=8 Sq=4
// 551 -> 2035. With 1-2 rows (MHA, G = 2) it is ahead too, although 14-15 of its 16 rows are
// padding (tools/paged_mma_check --mha, us, CUDA-core -> tensor-core): bf16 32/32 D128 64 x 8k
// 2905 -> 2809, 1 x 32k 197 -> 187, 8 x 8k 371 -> 357; 32/16 256 x 1k 730 -> 709; D64 32/16
// 8 x 8k 114 -> 103; e4m3 per-token 32/32 64 x 8k 2160 -> 1717, 32/16 1 x 32k 98 -> 73.
// JAX_FLASH_PAGED_MMA overrides the choice: "0" never, "1" whenever supported; read once
// (paged_mma_mode() may be set by tests and benchmarks to compare both kernels in one process).
constexpr int kPagedMmaRows = 16;  // query rows per CTA of the tensor-core kernel

// -1: default, 1: whenever supported (the same since the kernel takes any row count), 0: never.
inline int& paged_mma_mode() {
  static int mode = [] {
    const char* e = std::getenv("JAX_FLASH_PAGED_MMA");
    if (e != nullptr && e[0] == '0' && e[1] == 0) return 0;
    if (e != nullptr && e[0] == '1' && e[1] == 0) return 1;
    return -1;
  }();
  return mode;
}

// Whether the tensor-core kernel takes a call, given that it supports its dtypes and head dim
// (mma_ok).
inline bool paged_use_mma(bool mma_ok) { return mma_ok && paged_mma_mode() != 0; }

// Whether the tensor-core kernel supports these parameters: q float16 or bfloat16 with a cache
// of q's dtype (no scales) or an int8 / float8 e4m3 cache (per-head or per-token scales),
// D == Dv in {64, 128, 256}, q 16-byte aligned (it is read in 16-byte vectors), a cache of at
// least one page (rows behind an invalid id read row 0: the output is NaN either way) and of
// fewer than 2^32 rows of Hkv heads (it indexes rows in 32 bits; 2^32 rows are over 256 GB).
inline bool paged_mma_supported(const PagedAttentionParams& p) {
  const bool f16 = p.dtype == DType::kFloat16 && p.cache_dtype == CacheDType::kFloat16;
  const bool bf16 = p.dtype == DType::kBFloat16 && p.cache_dtype == CacheDType::kBFloat16;
  const bool q16 = p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16;
  const bool c8 = p.cache_dtype == CacheDType::kInt8 || p.cache_dtype == CacheDType::kFloat8E4M3;
  const bool same = (f16 || bf16) && p.scale_mode == ScaleMode::kNone;
  const bool quant = q16 && c8 && p.scale_mode != ScaleMode::kNone;
  return (same || quant) && p.head_dim == p.head_dim_v &&
         (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) &&
         reinterpret_cast<uintptr_t>(p.q) % 16 == 0 &&
         p.num_pages > 0 &&
         static_cast<int64_t>(p.num_pages) * p.page_size * p.num_heads_k < (int64_t(1) << 32);
}

// CTAs of the tensor-core kernel per SM for a cache of elem_bytes per element (its shared memory
// is sized for this; checked by static_assert in paged_attention_mma.cuh): 16-bit caches 2, 2, 1
// for head dims 64, 128, 256; 8-bit caches 3, 2, 1.
constexpr int paged_mma_ctas_per_sm(int head_dim, int elem_bytes = 2) {
  return head_dim <= 64 ? (elem_bytes == 1 ? 3 : 2) : (head_dim <= 128 ? 2 : 1);
}

// Defined in paged_attention_mma.cuh, instantiated in cuda/src/paged_attention_mma_*.cu. T: q's
// type (__half, __nv_bfloat16); TC: the cache's (T, int8_t or __nv_fp8_e4m3).
template <typename T, int D, typename TC = T>
cudaError_t launch_paged_attention_mma(const PagedAttentionParams& p, cudaStream_t stream);

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

// The split-KV merge after an attention grid (nothing for num_splits <= 1).
template <typename TQ, int D>
cudaError_t launch_paged_merge(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_splits <= 1 || !merge_enabled()) return cudaSuccess;
  const int64_t out_rows = static_cast<int64_t>(p.batch) * p.seqlen_q * p.num_heads;
  if (out_rows > 0x7fffffff || p.num_splits > kMaxMergeSplits)
    return cudaErrorInvalidConfiguration;
  // On sm_90+ the merge is a programmatic dependent launch: its launch overlaps the attention
  // grid, and griddepcontrol.wait orders its reads after that grid's writes.
  return paged_launch_pdl(paged_merge_kernel<TQ, D>, dim3(static_cast<unsigned>(out_rows)),
                          dim3(128), static_cast<size_t>(p.num_splits) * sizeof(float), stream,
                          merge_pdl_enabled(), p);
}

// Paged decode attention for one (q dtype, cache element type, head dim); D == Dv. TC is
// float, __half, __nv_bfloat16 (equal to TQ), int8_t or __nv_fp8_e4m3. Asynchronous on
// `stream`; never synchronizes or allocates; returns the launch status.
template <typename TQ, typename TC, int D>
cudaError_t launch_paged_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_heads / p.num_heads_k) * p.seqlen_q;
  if constexpr (sizeof(TQ) == 2 && (std::is_same_v<TQ, TC> || sizeof(TC) == 1)) {
    if (paged_use_mma(paged_mma_supported(p)))
      return launch_paged_attention_mma<TQ, D, TC>(p, stream);
  }
  switch (paged_rows_per_cta(rows)) {
    case 4: return launch_paged_attention_mt<TQ, TC, D, 4>(p, stream);
    case 8: return launch_paged_attention_mt<TQ, TC, D, 8>(p, stream);
    default: return launch_paged_attention_mt<TQ, TC, D, 16>(p, stream);
  }
}

}  // namespace paged

// Explicit instantiations live in cuda/src/paged_attention_*.cu.
#define JAX_FLASH_PAGED_FOR_EACH_D(X, TQ, TC) X(TQ, TC, 64) X(TQ, TC, 128) X(TQ, TC, 256)
#define JAX_FLASH_PAGED_FOR_EACH(X)                      \
  JAX_FLASH_PAGED_FOR_EACH_D(X, float, float)            \
  JAX_FLASH_PAGED_FOR_EACH_D(X, float, int8_t)           \
  JAX_FLASH_PAGED_FOR_EACH_D(X, float, __nv_fp8_e4m3)    \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __half, __half)          \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __half, int8_t)          \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __half, __nv_fp8_e4m3)   \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __nv_bfloat16, __nv_bfloat16) \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __nv_bfloat16, int8_t)   \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __nv_bfloat16, __nv_fp8_e4m3)

#define JAX_FLASH_PAGED_DECLARE(TQ, TC, D)                                         \
  extern template cudaError_t paged::launch_paged_attention<TQ, TC, D>(            \
      const PagedAttentionParams&, cudaStream_t);
JAX_FLASH_PAGED_FOR_EACH(JAX_FLASH_PAGED_DECLARE)
#undef JAX_FLASH_PAGED_DECLARE

// The tensor-core launchers, in cuda/src/paged_attention_mma_{bf16,f16}.cu (16-bit caches) and
// cuda/src/paged_attention_mma_{bf16,f16}_q8.cu (int8 / e4m3 caches).
#define JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, T, TC) X(T, 64, TC) X(T, 128, TC) X(T, 256, TC)
#define JAX_FLASH_PAGED_MMA_FOR_EACH(X)                     \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __half, __half)         \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __half, int8_t)         \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __half, __nv_fp8_e4m3)  \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __nv_bfloat16, __nv_bfloat16) \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __nv_bfloat16, int8_t)  \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __nv_bfloat16, __nv_fp8_e4m3)
#define JAX_FLASH_PAGED_MMA_DECLARE(T, D, TC)                                  \
  extern template cudaError_t paged::launch_paged_attention_mma<T, D, TC>(     \
      const PagedAttentionParams&, cudaStream_t);
JAX_FLASH_PAGED_MMA_FOR_EACH(JAX_FLASH_PAGED_MMA_DECLARE)
#undef JAX_FLASH_PAGED_MMA_DECLARE

namespace paged {

template <typename TQ, typename TC>
cudaError_t dispatch_head_dim(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_paged_attention<TQ, TC, 64>(p, stream);
    case 128: return launch_paged_attention<TQ, TC, 128>(p, stream);
    case 256: return launch_paged_attention<TQ, TC, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename TQ>
cudaError_t dispatch_cache(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.cache_dtype) {
    case CacheDType::kInt8: return dispatch_head_dim<TQ, int8_t>(p, stream);
    case CacheDType::kFloat8E4M3: return dispatch_head_dim<TQ, __nv_fp8_e4m3>(p, stream);
    default:
      // An unquantized cache has q's dtype.
      if (cache_elem_bytes(p.cache_dtype) != static_cast<int32_t>(sizeof(TQ)) ||
          (sizeof(TQ) == 2 && (p.cache_dtype == CacheDType::kBFloat16) !=
                                  std::is_same_v<TQ, __nv_bfloat16>))
        return cudaErrorInvalidValue;
      return dispatch_head_dim<TQ, TQ>(p, stream);
  }
}

}  // namespace paged

// Split count for paged_attention_cuda: split only while the CTAs of one split
// (B * Hkv * chunks) fill less than 80% of one wave of `slots` CTAs (two per SM for up to 8
// query rows per KV head, one for more), then to the largest power of two that keeps within one
// wave and at least 128 keys per split. max_ctx is the longest context (max_pages * page_size).
// Measured on an H100 SXM (132 SMs; bf16 Hq=32 Hkv=8 D=128 page 16; effective K+V GB/s by
// num_splits, best in brackets; D2D copy 3014 GB/s read + write):
//   B=1   ctx 4k:   s16 858, [s32 915], s48 639, s64 728
//   B=1   ctx 32k:  s16 1924, s24 1944, [s32 2119], s48 1768, s64 1953
//   B=1   ctx 128k: s16 2299, s24 2424, [s32 2717], s48 2282
//   B=2   ctx 16k:  s8 1929, s12 1951, [s16 2102], s32 1964
//   B=4   ctx 16k:  s4 2166, s6 2294, [s8 2494], s12 2073, s16 2397
//   B=8   ctx 8k:   s2 2190, s3 2293, [s4 2410], s6 2076, s8 2390
//   B=16  ctx 4k:   s1 2278, [s2 2399], s3 2092, s4 2374
//   B=16  ctx 1k:   [s1 1764], s2 1690
//   B=32  ctx 4k:   [s1 2777], s2 2583;  B=64 ctx 8k: [s1 2936], s2 2839
// i.e. about one wave of 2 CTAs per SM (B * Hkv * s = 256 of 264 slots). The merge adds 2.6-3.3
// us at B = 1 (4.6-5% at 1 x 32k, 19% at 1 x 8k; tools/paged_mma_check --merge) and ~1% from
// B = 8. Split counts 8-128 around this choice (B = 1-2; 32/8, 28/4, 32/2, 32/1 heads; D 64,
// 128): it is the best or within ~6% of it.
// The tensor-core kernel (taken when paged::paged_use_mma(mma_ok); mma_ok: the call's
// dtypes and head_dim suit it, paged::paged_mma_supported) runs 16 query rows per CTA of 128
// threads, paged::paged_mma_ctas_per_sm(head_dim, cache_bytes) CTAs per SM (16-bit caches 2,
// 2, 1 for D 64, 128, 256; 8-bit caches 3, 2, 1).
// jax_flash/ops/paged_attention.py (default_num_splits) computes the same.
inline int paged_num_splits_heuristic(int64_t batch, int64_t num_heads_k, int64_t group,
                                      int64_t seqlen_q, int64_t max_ctx, int num_sms,
                                      int head_dim = 128, bool mma_ok = false,
                                      int cache_bytes = 2) {
  const int64_t rows = group * seqlen_q;
  const bool mma = paged::paged_use_mma(mma_ok);
  const int64_t mt = mma ? paged::kPagedMmaRows : paged::paged_rows_per_cta(rows);
  const int64_t ctas = batch * num_heads_k * ((rows + mt - 1) / mt);
  const int64_t per_sm =
      mma ? paged::paged_mma_ctas_per_sm(head_dim, cache_bytes) : (mt <= 8 ? 2 : 1);
  const int64_t slots = static_cast<int64_t>(num_sms) * per_sm;
  if (ctas <= 0 || ctas * 5 >= slots * 4) return 1;
  int64_t s = slots / ctas;
  const int64_t by_len = (max_ctx + 127) / 128;
  if (s > by_len) s = by_len;
  int64_t pow2 = 1;
  while (pow2 * 2 <= s) pow2 *= 2;
  return static_cast<int>(pow2);
}

// True when the CUDA kernel takes these parameters (head dims, D == Dv, a cache dtype that
// matches q or is int8 / e4m3 with a scale mode).
inline bool paged_attention_cuda_supported(const PagedAttentionParams& p) {
  const bool quant = p.cache_dtype == CacheDType::kInt8 || p.cache_dtype == CacheDType::kFloat8E4M3;
  return (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) &&
         p.head_dim_v == p.head_dim && p.num_heads_k > 0 && p.num_heads % p.num_heads_k == 0 &&
         p.page_size >= 1 && p.num_splits >= 1 && (quant == (p.scale_mode != ScaleMode::kNone));
}

// Paged decode attention (and the split-KV merge when p.num_splits > 1) on `stream`.
inline cudaError_t paged_attention_cuda(const PagedAttentionParams& p, cudaStream_t stream) {
  if (!paged_attention_cuda_supported(p)) return cudaErrorInvalidValue;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.num_heads <= 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return paged::dispatch_cache<float>(p, stream);
    case DType::kFloat16: return paged::dispatch_cache<__half>(p, stream);
    case DType::kBFloat16: return paged::dispatch_cache<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash
