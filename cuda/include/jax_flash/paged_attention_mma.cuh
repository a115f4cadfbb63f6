// Paged decode attention on tensor cores (mma.sync m16n8k16, float32 accumulation) for float16 /
// bfloat16 q with a cache of q's dtype or an 8-bit cache (int8 / float8 e4m3, per-head or
// per-token scales), head dims D and Dv multiples of 16 up to 256 (D != Dv too). The contract is
// paged_params.h's; the dispatch in paged_attention.cuh sends every call it supports here
// (policy::paged_kernel_choice, unless the call asks for the CUDA-core kernel): faster than the
// CUDA-core kernel from one query row per kv head (MHA) on, as its float32 FMAs bound that
// kernel's speed.
//
// The kernel is compiled for tile widths D = 64, 128, 256 (the template's D) and runs a call on
// the narrowest tile that holds max(p.head_dim, p.head_dim_v) (policy::paged_mma_tile_dim): K
// rows are copied at their width p.head_dim, V rows at p.head_dim_v, q at p.head_dim; the
// tile's chunks past them are zeroed once in shared memory and never copied into, so Q K^T and
// P V over those columns add zeros, and only p.head_dim_v output columns are stored. The memory
// traffic is that of the call's own head dims.
//
// One CTA of 4 warps per (sequence, kv head, split, chunk of 16 query rows): the group's rows
// m = i * G + g (query position i, head g of the group), as in the CUDA-core kernel; rows past
// G * Sq are zero and never written. Every K/V row read from memory serves all 16 rows.
//
// Copy pipeline (shared with the CUDA-core kernel through paged/common.cuh):
// tiles of 64 or 128 keys (MmaCfg::kTK), K and V rows copied with 16-byte cp.async (L1 bypass)
// into a ring of 3-6 shared-memory stages (MmaCfg::kStages: 2-5 tiles in flight per CTA, 1-3
// CTAs per SM). Rows are placed through the page table one by one (any page size; tiles may
// straddle pages): thread r < kTK loads the page id of row r one tile ahead, checks it and
// writes the row's cache offset to a ring of offsets in shared memory. Rows past the key range
// or behind an invalid id are zero-filled and never read; an invalid id (or a scan of the whole
// block-table row in split 0, or a bad kv length) makes the sequence NaN.
//
// Compute: the warps split the KEYS of a tile, 16 each. Warp w computes
//   S_w = Q K_w^T   (16 x 16, ldmatrix.x4 of K from the swizzled tile; Q's A fragments are
//                    loaded once into registers for D <= 128, re-read from shared for D = 256),
//   scale, softcap, mask (kv length, causal / sliding window bottom-right aligned) in float32,
//   its own online softmax (exp2, log2 units; the reference max is raised only when a score
//   exceeds it by more than 2^8 in weight, so most tiles skip the rescale),
//   O_w += P_w V_w  (P rounded to the 16-bit type in registers as the A operand; V by
//                    ldmatrix.x4.trans),
// so the only barrier per tile is the ring's.
//
// 8-bit caches (TC = int8_t / __nv_fp8_e4m3): rows of D bytes are copied the same way (per-token
// scales travel with their tile, 4-byte cp.async, as in the CUDA-core kernel), into a ring of up
// to 6 stages. Both mma run in float16 whatever q's type: the warps read their 16-key slice
// straight from the 8-bit tile into mma B fragments (no ldmatrix) and convert the stored codes
// to float16, exactly and WITHOUT the scale (|int8| <= 128 and every e4m3 value are float16
// values; e4m3 converts in one instruction per pair); bfloat16 q is stored as float16 times a
// power of two chosen per CTA (exact for every q within 2^29 of the largest):
//   K (B of Q K^T, K[key][2 adjacent d]): lane (g, t) loads 16 bytes of key g's row at
//     d = 64 j + 16 t; byte pair {0,1} / {2,3} of word i is its b0 / b1 of k-step kk = 4 j + i.
//     This permutes the head dim inside each 64-wide block; Q's shared copy is stored permuted
//     the same way (q_perm_word), so its ldmatrix fragments match and Q K^T is unchanged.
//   V (B of P V, V[2 adjacent keys][d]): lane (g, t) loads the same D / 8 bytes of the 4 rows of
//     keys 2t, 2t+1, 2t+8, 2t+9 and pairs the keys with byte_perm. Output column n of n8-tile dt
//     is head-dim index vcol(n, dt) (a permutation), undone when O goes to shared memory at the
//     end.
// (int8 K goes into Q K^T biased by 1152, which each score sheds in float32 afterwards: cvt4_k.)
// These permutations and conversions live in paged/q8_fragments.cuh (namespace q8).
// Rows are XOR-swizzled in 16-byte chunks (q8_swz) so that these loads are free of bank
// conflicts (D = 64: 2-way on V). Scales in float32: a per-head K scale is folded into the score
// scale, a per-token K scale multiplies the score columns after the mma; a per-head V scale
// multiplies the final O; per-token V scales, divided by a per-warp reference (the largest seen,
// raised lazily, as the softmax max is), multiply P's columns (float32) before P is rounded to
// float16, and the reference multiplies the warp's O at the end.
//
// At the end the warps' (max, sum, O) states are merged through shared memory (overlaying the
// ring), normalised and stored; with split-KV (num_splits > 1) as the CUDA-core kernel's
// o_partial / lse_partial, merged by the same paged_merge_kernel.
//
// No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jax_flash/dtype.cuh"
#include "jax_flash/mma_sync.cuh"  // mma_detail: ldmatrix, mma_16816, pack2, swizzle
#include "jax_flash/paged/common.cuh"
#include "jax_flash/paged/launch.cuh"
#include "jax_flash/paged/merge.cuh"
#include "jax_flash/paged/ptx.cuh"
#include "jax_flash/paged/q8_fragments.cuh"  // q8::
#include "jax_flash/paged_attention.cuh"  // declarations of the launchers (extern templates)
#include "jax_flash/policy/paged.h"

namespace jax_flash {
namespace paged {

// The kernel's configuration for tile width D and a cache of kElemBytes per element. The last
// three parameters request keys per tile, ring stages and CTAs per SM in place of the library's
// choices (0: the library's), so that tools/paged_decode_sweep.cu can time other configurations
// of the same kernel; the library compiles MmaCfg<D, kElemBytes> and, for head dims below the
// tile width, the ring of policy::paged_mma_padded_stages.
template <int D, int kElemBytes = 2, int kTKWant = 0, int kStagesWant = 0, int kCtasWant = 0>
struct MmaCfg {
  static_assert(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256");
  static_assert(kTKWant == 0 || kTKWant == 64 || kTKWant == 128, "64 or 128 keys per tile");
  static constexpr int kDim = D;
  static constexpr int kCacheBytes = kElemBytes;
  static_assert(kElemBytes == 1 || kElemBytes == 2, "16-bit or 8-bit cache");
  static constexpr bool kQ8 = kElemBytes == 1;
  static constexpr int kThreads = 128;
  static constexpr int kWarps = 4;
  static constexpr int kRows = policy::kPagedMmaRows;             // query rows per CTA (one m16 tile)
  // Keys per tile: 64 (16 per warp); 8-bit caches with D <= 128 and 16-bit caches with D = 64:
  // 128 (two 16-key slices per warp: two independent chains of mma (and code conversion) per
  // warp, half the barriers, 16 KB tiles: 16-bit D = 64 reads 7% faster at 64 x 8k than with
  // 64-key tiles in 4 stages at 3 CTAs per SM).
  static constexpr int kTK = kTKWant ? kTKWant : ((kQ8 && D <= 128) || D == 64 ? 128 : 64);
  static constexpr int kSlices = kTK / (kWarps * 16);     // 16-key slices per warp and tile
  static constexpr int kRowBytes = D * kElemBytes;        // one K or V row of the cache
  static constexpr int kChunks = kRowBytes / 16;          // 16-byte chunks per cache row
  static constexpr int kQRowBytes = D * 2;                // one query row (16-bit)
  static constexpr int kQChunks = D / 8;
  static constexpr int kTileBytes = kTK * kRowBytes;      // K (or V) of one tile
  static constexpr int kStageBytes = 2 * kTileBytes;      // K + V
  static constexpr int kScaleBytes = kQ8 ? 2 * kTK * 4 : 0;  // per-token K, V scales per stage
  static constexpr int kRowsPerPass = kThreads / kChunks;  // rows one pass of cp.async covers
  static constexpr int kPasses = kTK / kRowsPerPass;
  static constexpr int kQBytes = kRows * kQRowBytes;
  static constexpr int kQIt = kRows * kQChunks / kThreads;  // 16-byte q loads per thread
  static constexpr int kRedStride = D + 8;  // floats per row of the epilogue buffer (no conflicts)
  static constexpr int kRedBytes = kWarps * kRows * kRedStride * 4;
  static constexpr bool kQRegs = D <= 128;  // Q fragments held in registers
  static constexpr int kCtasPerSm =
      kCtasWant ? kCtasWant : policy::paged_mma_ctas_per_sm(D, kElemBytes);
  // 8-bit tiles are half the bytes; a requested ring may be as deep as shared memory allows
  static constexpr int kMaxStages = kQ8 || kStagesWant ? 6 : 4;

  static constexpr int ring_bytes(int stages) {
    return stages * kStageBytes > kRedBytes ? stages * kStageBytes : kRedBytes;
  }
  static constexpr int smem_bytes(int stages) {
    return ring_bytes(stages) + stages * kTK * 4 /*row indices*/ + stages * kScaleBytes +
           kQBytes + kWarps * kRows * 8 /*warp max, sum*/ + kRows * 8 /*final max, sum*/;
  }
  // An SM has 228 KB of shared memory, 1 KB of it reserved per CTA; at most 227 KB per CTA.
  static constexpr bool fits(int stages) {
    return stages <= kMaxStages && smem_bytes(stages) <= 227 * 1024 &&
           kCtasPerSm * (smem_bytes(stages) + 1024) <= 228 * 1024;
  }
  // The deepest ring (4 stages at most for 16-bit caches, 6 for 8-bit) that keeps kCtasPerSm
  // CTAs per SM (stage = K + V tiles): 16-bit D 64 and 128: 3 stages of 32 KB (2 CTAs per
  // SM), 256: 3 of 64 KB (1); 8-bit D 64: 4 of 16 KB (3), 128: 3 of 32 KB (2), 256: 6 of 32 KB
  // (1).
  static constexpr int kStages =
      kStagesWant ? kStagesWant
                  : (fits(6) ? 6 : (fits(5) ? 5 : (fits(4) ? 4 : (fits(3) ? 3 : 2))));
  static constexpr int kRingBytes = ring_bytes(kStages);
  static constexpr int kSmem = smem_bytes(kStages);

  static_assert(fits(kStages), "shared memory does not fit kCtasPerSm CTAs per SM");
  // the deepest ring keeps two tiles in flight; a requested ring of 2 (one tile copied while one
  // is computed) is correct too
  static_assert(kStages >= 3 || (kStagesWant == 2), "at least two tiles in flight");
  static_assert(kThreads % kChunks == 0 && kTK % kRowsPerPass == 0, "bad copy split");
  static_assert(kQIt * kThreads == kRows * kQChunks, "bad q split");
  static_assert(kStageBytes % 128 == 0 && (kStages * kTK * 4) % 128 == 0,
                "tiles must stay 128-byte aligned (swizzle)");
  static_assert(kTK % (kWarps * 16) == 0 && kTK <= kThreads, "16-key slices, a row per thread");

  // 8-bit tiles: physical 16-byte chunk of logical chunk c in tile row r is c ^ q8_swz(r). With
  // 8+ chunks per row, rows r and r ^ 1 differ in bit 2 (K loads: keys g, g + 1 read chunks
  // 4j..4j+3) and the even (odd) rows of an 8-row group in bits 1-2 (V loads: keys 0, 2, 4, 6
  // read chunk g of 2 lanes); D = 64 (4 chunks per row): the even rows take different chunks.
  static __device__ __forceinline__ int q8_swz(int r) {
    return kChunks >= 8 ? ((((r >> 1) & 3) << 1) ^ ((r & 1) << 2)) : ((r >> 1) & 3);
  }
};

// kHF: C-fragment row halves that hold query rows (rows g and g + 8 of lane (g, t)); 1 when a
// CTA has at most 8 rows (G * Sq <= 8: GQA decode), so rows 8-15 are padding and their softmax
// is skipped (their P is 0).
// Cfg: an MmaCfg of D and sizeof(TC).
template <typename T, typename TC, int D, int kHF, class Cfg = MmaCfg<D, sizeof(TC)>>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kCtasPerSm)
    paged_attention_mma_kernel(const PagedAttentionParams p, const int32_t num_chunks) {
  static_assert(kHF == 1 || kHF == 2, "one or two row halves");
  using C = Cfg;
  constexpr bool kQ8 = C::kQ8;
  constexpr int kS = C::kStages;
  constexpr int kTK = C::kTK;
  constexpr int kSl = C::kSlices;
  constexpr int kSN = 2 * kSl;  // n8 tiles of S per warp and tile
  constexpr int kRB = C::kRowBytes;
  constexpr int kNT = C::kThreads;
  constexpr int kCh = C::kChunks;
  constexpr int kQRB = C::kQRowBytes;
  constexpr int kQCh = C::kQChunks;
  constexpr int kRows = C::kRows;
  constexpr int kDT = D / 8;  // n8 tiles of O
  // The mma input type: q's, or float16 with an 8-bit cache (the codes convert to float16 in
  // one instruction per pair for e4m3, two for int8; bfloat16 q is stored as float16, scaled).
  using TM = std::conditional_t<kQ8, __half, T>;

  extern __shared__ __align__(1024) unsigned char mma_smem[];
  unsigned char* smem = mma_smem;
  unsigned char* ring = smem;                                               // [kS][K|V][kTK][kRB]
  uint32_t* rows_s = reinterpret_cast<uint32_t*>(smem + C::kRingBytes);    // [kS][kTK]
  float* scl_s = reinterpret_cast<float*>(rows_s + kS * kTK);  // 8-bit: [kS][K|V][kTK]
  unsigned char* q_s =
      reinterpret_cast<unsigned char*>(scl_s) + kS * C::kScaleBytes;        // [kRows][kQRB]
  float* wm_s = reinterpret_cast<float*>(q_s + C::kQBytes);                // [kWarps][kRows]
  float* wl_s = wm_s + C::kWarps * kRows;                                  // [kWarps][kRows]
  float* fm_s = wl_s + C::kWarps * kRows;                                  // [kRows]
  float* fl_s = fm_s + kRows;                                              // [kRows]
  float* red_s = reinterpret_cast<float*>(smem);  // epilogue overlay [kWarps][kRows][kRedStride]

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the stream's previous kernel (paged_launch_pdl):
  // this grid's launch overlaps that kernel's end, and nothing is read before that kernel has
  // completed and its writes are visible (a no-op for an ordinary launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // Lets the split-KV merge grid (a programmatic dependent) be scheduled early; it waits for
  // this grid's completion before reading anything. Without a merge, dependents start as this
  // grid ends (CTAs waiting early would take SM slots from this grid's later CTAs).
  if (p.num_splits > 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // C-fragment row (and g + 8)
  const int t = lane & 3;   // C-fragment column pair

  const PagedCta cta = paged_cta<kRows>(p, num_chunks);
  const int dk = p.head_dim, dv = p.head_dim_v;  // <= D (a padded tile when below)
  if (paged_reject_bad_klen<T, kNT>(p, dv, cta, tid)) return;
  // ---- key range of this CTA: the union of its rows' visible keys within the split ----
  const PagedKeyRange kr = paged_key_range<kTK>(p, cta);
  const int32_t kb = kr.kb, ke = kr.ke;
  const int ntiles = kr.ntiles;
  // Visible keys of this thread's two rows g and g + 8 (padding rows see none).
  int32_t lo_r[2], hi_r[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) paged_row_visible(p, cta, g + 8 * hf, &lo_r[hf], &hi_r[hf]);

  const bool per_token = kQ8 && p.scale_mode == ScaleMode::kPerToken;
  int bad = 0;
  // Page-table walk: thread tid < kTK places key kb + j * kTK + tid of tile j, as a block-table
  // index and an offset in the page advanced by kTK per tile (one division, at the start).
  const uint32_t ups = static_cast<uint32_t>(p.page_size);
  const uint32_t step_q = kTK / ups, step_r = kTK - step_q * ups;
  uint32_t wkey = static_cast<uint32_t>(kb) + tid;  // < 2^31 + kTK * (ntiles + kS + 1)
  uint32_t widx = wkey / ups, woff = wkey - widx * ups;
  auto walk = [&]() {  // the page of key wkey (a load of its id), then the next tile's key
    PagedRowRef r;
    r.valid = tid < kTK && static_cast<int64_t>(wkey) < ke;
    r.off = static_cast<int32_t>(woff);
    r.page = r.valid ? __ldg(cta.bt + widx) : 0;
    wkey += kTK;
    widx += step_q;
    woff += step_r;
    if (woff >= ups) {
      woff -= ups;
      ++widx;
    }
    return r;
  };
  // pf is always set (prologue) before store_row reads it; the front end cannot see that.
#pragma nv_diag_suppress 549
  PagedRowRef pf;  // page of this thread's row (tid < kTK) of the next tile to place
  // The ring of row indices holds 32-bit cache rows (paged_mma_supported: the cache has fewer
  // than 2^32 rows); a key past the range or behind an invalid id holds row 0, a valid address
  // whose data is never used: the copy zero-fills rows past the key range, and an invalid id
  // (paged_row_ok sets `bad`) makes the output NaN.
  auto store_row = [&](int slot) {
    rows_s[slot * kTK + tid] =
        paged_row_ok(pf, p, bad)
            ? (static_cast<uint32_t>(pf.page) * ups + static_cast<uint32_t>(pf.off)) *
                      static_cast<uint32_t>(p.num_heads_k) +
                  static_cast<uint32_t>(cta.kvh)
            : 0u;
  };
#pragma nv_diag_default 549
  // This thread's 16-byte chunk of a cache row: K at kbase + row * k_rb, V at vbase + row * v_rb
  // (the cache's row widths); a chunk past a row's width (a padded tile) is never copied.
  const int cp_c = tid % kCh;
  const int cp_r0 = tid / kCh;
  const uint32_t k_rb = static_cast<uint32_t>(dk) * sizeof(TC);
  const uint32_t v_rb = static_cast<uint32_t>(dv) * sizeof(TC);
  const bool k_on = static_cast<uint32_t>(cp_c << 4) < k_rb;
  const bool v_on = static_cast<uint32_t>(cp_c << 4) < v_rb;
  const uint64_t kbase = reinterpret_cast<uint64_t>(p.k_pages) + (cp_c << 4);
  const uint64_t vbase = reinterpret_cast<uint64_t>(p.v_pages) + (cp_c << 4);
  // Byte offset in a K (V) tile of this thread's chunk of tile row r.
  auto tile_off = [&](int r) -> uint32_t {
    if constexpr (kQ8) {
      return r * kRB + ((cp_c ^ C::q8_swz(r)) << 4);
    } else {
      return mma_detail::swizzle<kCh>(r, cp_c);
    }
  };
  // Copies K and V of tile n, whose row indices are in slot n % kS, into stage n % kS; rows
  // past the key range are zero-filled without reading.
  auto issue = [&](int n) {
    const int slot = n % kS;
    const uint32_t* rows = rows_s + slot * kTK;
    unsigned char* kdst = ring + slot * C::kStageBytes;
    unsigned char* vdst = kdst + C::kTileBytes;
    // rows of the tile in the key range (kb + n * kTK < ke: at least 1)
    const int nvalid = static_cast<int>(min(static_cast<int64_t>(ke) - kb - static_cast<int64_t>(n) * kTK,
                                            static_cast<int64_t>(kTK)));
#pragma unroll
    for (int i = 0; i < C::kPasses; ++i) {
      const int r = cp_r0 + i * C::kRowsPerPass;
      const uint32_t ri = rows[r];
      const uint32_t dst = tile_off(r);
      const bool zero = r >= nvalid;
      if (k_on) cp_async16_zfill(kdst + dst, mad_wide(ri, k_rb, kbase), zero);
      if (v_on) cp_async16_zfill(vdst + dst, mad_wide(ri, v_rb, vbase), zero);
    }
    if (per_token && tid < kTK) {
      const uint32_t ri = rows[tid];
      const bool zero = tid >= nvalid;
      float* sd = scl_s + slot * 2 * kTK;
      cp_async4_zfill(sd + tid, mad_wide(ri, 4, reinterpret_cast<uint64_t>(p.k_scale)), zero);
      cp_async4_zfill(sd + kTK + tid, mad_wide(ri, 4, reinterpret_cast<uint64_t>(p.v_scale)), zero);
    }
  };

  // ---- prologue: the page ids of the first kS + 1 tiles and the query rows are loaded
  // together (one memory round trip) ----
  PagedRowRef ref0[kS + 1];
#pragma unroll
  for (int j = 0; j <= kS; ++j) ref0[j] = walk();
  uint4 qv[C::kQIt];
#pragma unroll
  for (int k = 0; k < C::kQIt; ++k) {
    const int idx = tid + k * kNT;
    const int r = idx / kQCh;
    const int c = idx % kQCh;
    qv[k] = make_uint4(0u, 0u, 0u, 0u);  // padding rows, and columns past dk (a padded tile)
    if (r < cta.mvalid && 8 * c < dk)
      qv[k] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) +
                                                   paged_q_offset(p, dk, cta, cta.m0 + r, 8 * c)));
  }
  paged_place_first_rows<kS, kTK>(tid, ntiles, ref0, pf, store_row);
  // 8-bit caches with bfloat16 q: Q K^T runs in float16 on Q * 2^-q_sh, with 2^(q_sh + 15) the
  // power of two above the CTA's largest |q| (none overflows, and every q within 2^29 of the
  // largest is a normal float16: exact, as bfloat16 has 8 significant bits); 2^q_sh goes into
  // the score scale. Smaller q lose bits as float16 subnormals (an absolute error < 2^-40 of
  // the largest |q|: below float32 accumulation); q_sh >= -100 (a CTA whose |q| are all below
  // 2^-85 keeps fewer bits). Inf / NaN q pass through.
  int q_sh = 0;
  float q_scale = 1.f;
  if constexpr (kQ8 && std::is_same_v<T, __nv_bfloat16>) {
    float mx = 0.f;
#pragma unroll
    for (int k = 0; k < C::kQIt; ++k) {
      mx = fmaxf(mx, fmaxf(fmaxf(q8::bf16_absmax2(qv[k].x), q8::bf16_absmax2(qv[k].y)),
                           fmaxf(q8::bf16_absmax2(qv[k].z), q8::bf16_absmax2(qv[k].w))));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    if (lane == 0) fm_s[warp] = mx;  // fm_s is free until the epilogue
    __syncthreads();
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) mx = fmaxf(mx, fm_s[w]);
    if (mx > 0.f && mx <= 3.4e38f) {
      int ex;
      frexpf(mx, &ex);  // mx < 2^ex
      q_sh = min(max(ex - 15, -100), 113);  // 2^-113: bfloat16 max -> < 2^15
      q_scale = ldexpf(1.f, -q_sh);
    }
  }
#pragma unroll
  for (int k = 0; k < C::kQIt; ++k) {
    const int idx = tid + k * kNT;
    const int r = idx / kQCh;
    const int c = idx % kQCh;
    if constexpr (kQ8) {
      // head dim permuted as the 8-bit K fragments are (q8::q_perm_word)
      const uint32_t w[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int L = q8::q_perm_word(4 * c + e);
        *reinterpret_cast<uint32_t*>(q_s + mma_detail::swizzle<kQCh>(r, L >> 2) + 4 * (L & 3)) =
            q8::q_to_f16<T>(w[e], q_scale);
      }
    } else {
      *reinterpret_cast<uint4*>(q_s + mma_detail::swizzle<kQCh>(r, c)) = qv[k];
    }
  }
  if (!k_on || !v_on) {  // a padded tile: this thread's chunk past D (Dv) is zero in every stage
#pragma unroll
    for (int st = 0; st < kS; ++st) {
#pragma unroll
      for (int i = 0; i < C::kPasses; ++i) {
        unsigned char* kdst = ring + st * C::kStageBytes + tile_off(cp_r0 + i * C::kRowsPerPass);
        if (!k_on) *reinterpret_cast<uint4*>(kdst) = make_uint4(0u, 0u, 0u, 0u);
        if (!v_on) *reinterpret_cast<uint4*>(kdst + C::kTileBytes) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
  __syncthreads();
  paged_prime_pipeline<kS>(ntiles, issue);
  paged_scan_block_table<kNT>(p, cta, tid, bad);

  // ---- ldmatrix lane addresses (as the prefill kernel, flash_attention_mma.cuh):
  //   Q (A, x4 = rows 0-7 / 8-15 x k 0-7 / 8-15): row l % 16, chunk 2kk + l / 16
  //   K (B of S, x4 = keys 0-7 / 8-15 x k halves): row (l / 16) * 8 + l % 8, chunk 2kk + l / 8 % 2
  //   V (B of PV, .trans, x4 = key halves x d-tiles 2dp / 2dp + 1): row (l / 8 % 2) * 8 + l % 8,
  //     chunk 2dp + l / 16
  // K and V rows are offset by the warp's 16-key slice (which keeps row % 8). ----
  const uint32_t q_lane = mma_detail::smem_addr(q_s) + (lane & 15) * kQRB +
                          (((lane >> 4) ^ (lane & 7)) << 4);
  const uint32_t k_lane = (warp * 16 * kSl + ((lane >> 4) & 1) * 8 + (lane & 7)) * kRB +
                          ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
  const uint32_t v_lane = (warp * 16 * kSl + ((lane >> 3) & 1) * 8 + (lane & 7)) * kRB +
                          ((((lane >> 4) & 1) ^ (lane & 7)) << 4);
  const uint32_t ring_addr = mma_detail::smem_addr(ring);
  // 8-bit tiles: byte offsets in a stage's K tile of this lane's K row (keys g, 8 + g of the
  // warp's slice; both swizzled by q8_swz(g)) and of its V rows (keys 2t, 2t + 1, 2t + 8, 2t + 9)
  // at the lane's D / 8 columns vcol(g, 0...).
  const int k8_row = (warp * 16 * kSl + g) * kRB;
  const int k8_swz = C::q8_swz(g);
  const int v8_row = (warp * 16 * kSl + 2 * t) * kRB;
  const int v8_swz0 = C::q8_swz(2 * t), v8_swz1 = C::q8_swz(2 * t + 1);

  uint32_t qa[C::kQRegs ? D / 16 : 1][4];
  if constexpr (C::kQRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) mma_detail::ldmatrix_x4(qa[kk], mma_detail::chunk_pair(q_lane, kk));
  }

  // int8 caches: each raw score is Q K^T + 1152 * (the sum of its q row) (q8::cvt4_k: two
  // instructions fewer per 4 codes, ~4% of the tile loop's), the bias taken off in float32
  // before the scale: 1152 * the row sums of Q's float16 fragments (every warp holds all 16
  // rows). The accumulation's rounding then scales with the bias rather than the score: up to
  // ~2e-5 of a typical score's size (a float32 model of the 16-product sums, D 128, codes of
  // spread 40: the bias ~30x the score), against the codes' own rounding of 2^-8.
  constexpr bool kBiasK = std::is_same_v<TC, int8_t>;
  float k_bias[2] = {0.f, 0.f};  // rows g, g + 8
  if constexpr (kBiasK) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t f[4];
      if constexpr (C::kQRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) f[e] = qa[kk][e];
      } else {
        mma_detail::ldmatrix_x4(f, mma_detail::chunk_pair(q_lane, kk));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // A fragment: [0], [2] row g; [1], [3] row g + 8
        __half2 h;
        memcpy(&h, &f[e], 4);
        const float2 v = __half22float2(h);
        k_bias[e & 1] += v.x + v.y;
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      k_bias[hf] += __shfl_xor_sync(kFull, k_bias[hf], 1);
      k_bias[hf] += __shfl_xor_sync(kFull, k_bias[hf], 2);
      k_bias[hf] *= 1152.f;
    }
  }

  // Scores in log2 units: x = s * softmax_scale * log2(e), or with a softcap
  // x = tanh(s * softmax_scale / softcap) * softcap * log2(e).
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kRescale = 8.f;  // lazy rescale threshold (log2 units): weights <= 2^8
  const bool has_cap = p.softcap > 0.f;
  float cap_in = has_cap ? p.softmax_scale / p.softcap : 0.f;
  float x_scale = has_cap ? p.softcap * kLog2e : p.softmax_scale * kLog2e;
  float vscale_head = 1.f;
  if (kQ8 && p.scale_mode == ScaleMode::kPerHead) {
    const float ks = __ldg(p.k_scale + cta.kvh);
    if (has_cap) {
      cap_in *= ks;
    } else {
      x_scale *= ks;
    }
    vscale_head = __ldg(p.v_scale + cta.kvh);
  }
  if (has_cap) {
    cap_in = ldexpf(cap_in, q_sh);
  } else {
    x_scale = ldexpf(x_scale, q_sh);
  }

  float o[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  }
  float m_ref[2] = {neg_inf(), neg_inf()};  // per-warp reference max of rows g, g + 8
  float l_sum[2] = {0.f, 0.f};              // this thread's part of the rows' sums
  // Per-token V scales: P's columns times their key's V scale / v_ref go into the float16 P V,
  // v_ref a per-warp reference (the largest |scale| seen, raised lazily as the max is), so that
  // O = v_ref * (the accumulators) and every weight stays <= 2^8 * 2^7 (float16 holds 2^15).
  float v_ref = 0.f;
  float v_inv = 0.f;  // 1 / v_ref, set where v_ref is (0 while v_ref is: every scale so far 0)

  // ---- main loop ----
  for (int n = 0; n < ntiles; ++n) {
    cp_async_wait<kS - 2>();
    __syncthreads();  // tile n has landed; every warp is done with tile n - 1 (its stage is free)
    if (n + kS - 1 < ntiles) issue(n + kS - 1);
    cp_async_commit();
    if (tid < kTK && n + kS < ntiles) {
      store_row((n + kS) % kS);
      pf = walk();
    }

    // This warp's keys [kw, kw + 16 kSl) (slice sl: kw + 16 sl...); a warp whose keys are all
    // past the range (last tile) skips the tile (slices past it read zero-filled rows, masked).
    const int64_t kw64 = static_cast<int64_t>(kb) + static_cast<int64_t>(n) * kTK + warp * 16 * kSl;
    if (kw64 >= ke) continue;
    const int32_t kw = static_cast<int32_t>(kw64);
    const uint32_t sK = ring_addr + (n % kS) * C::kStageBytes;
    const uint32_t sV = sK + C::kTileBytes;
    // Per-token scales of the warp's keys. Read where they are used, their shared-memory
    // latency stalled the score scaling and the V-scale max (Nsight Compute, H200, int8 B64
    // ctx8k: 15% of the warp samples on short scoreboard against 11% with per-head scales), so
    // they are read before the tile's Q K^T where the registers allow (2 CTAs per SM or fewer:
    // 255 a thread; with 3, D 64's 8-bit variants, the 4 * kSN more would spill).
    constexpr bool kEarlyScales = C::kCtasPerSm <= 2;
    float2 ks[kSN], vs[kSN];
    auto read_scales = [&] {
      const float* scl = scl_s + (n % kS) * 2 * kTK + warp * 16 * kSl + 2 * t;
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) {
        ks[nt] = *reinterpret_cast<const float2*>(scl + nt * 8);
        vs[nt] = *reinterpret_cast<const float2*>(scl + kTK + nt * 8);
      }
    };
    if (kEarlyScales && per_token) read_scales();

    // S = Q K^T: s[nt] holds keys kw + nt * 8 + 2t + {0, 1} of rows g ([0], [1]) and g + 8.
    float s[kSN][4];
#pragma unroll
    for (int nt = 0; nt < kSN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
    }
    // One k16 step of slice sl: s[2 sl..2 sl + 1] += Q[:, 16kk:16kk+16] K^T with the K
    // fragment kf (Q from registers, or re-read from shared memory where it does not fit them).
    auto qk_step = [&](int sl, int kk, const uint32_t (&kf)[4]) {
      if constexpr (C::kQRegs) {
        mma_detail::mma_16816<TM>(s[2 * sl], qa[kk], kf[0], kf[1]);
        mma_detail::mma_16816<TM>(s[2 * sl + 1], qa[kk], kf[2], kf[3]);
      } else {
        uint32_t qf[4];
        mma_detail::ldmatrix_x4(qf, mma_detail::chunk_pair(q_lane, kk));
        mma_detail::mma_16816<TM>(s[2 * sl], qf, kf[0], kf[1]);
        mma_detail::mma_16816<TM>(s[2 * sl + 1], qf, kf[2], kf[3]);
      }
    };
    if constexpr (kQ8) {
      const unsigned char* k8 = ring + (n % kS) * C::kStageBytes + k8_row;
#pragma unroll
      for (int j = 0; j < D / 64; ++j) {
        const int off = ((4 * j + t) ^ k8_swz) << 4;
        uint32_t w[kSl][2][4];  // slice, key g / g + 8, word
#pragma unroll
        for (int sl = 0; sl < kSl; ++sl) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 r = *reinterpret_cast<const uint4*>(k8 + (16 * sl + 8 * h) * kRB + off);
            w[sl][h][0] = r.x;
            w[sl][h][1] = r.y;
            w[sl][h][2] = r.z;
            w[sl][h][3] = r.w;
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int kk = 4 * j + i;
#pragma unroll
          for (int sl = 0; sl < kSl; ++sl) {
            uint32_t kf[4];
            q8::cvt4_k<TC>(w[sl][0][i], kf[0], kf[1]);
            q8::cvt4_k<TC>(w[sl][1][i], kf[2], kf[3]);
            qk_step(sl, kk, kf);
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int sl = 0; sl < kSl; ++sl) {
          uint32_t kf[4];
          mma_detail::ldmatrix_x4(kf, mma_detail::chunk_pair(sK + k_lane + sl * 16 * kRB, kk));
          qk_step(sl, kk, kf);
        }
      }
    }
    if (!kEarlyScales && per_token) read_scales();
    // scale (times the key's K scale, per-token scales), softcap, mask (after the softcap: tanh
    // would turn -inf into a finite score)
    const float s_in = has_cap ? cap_in : x_scale;
#pragma unroll
    for (int nt = 0; nt < kSN; ++nt) {
      float2 f = make_float2(s_in, s_in);
      if (per_token) {
        f.x *= ks[nt].x;
        f.y *= ks[nt].y;
      }
#pragma unroll
      for (int e = 0; e < 2 * kHF; ++e) {
        const float raw = kBiasK ? s[nt][e] - k_bias[e >> 1] : s[nt][e];
        const float x = raw * ((e & 1) ? f.y : f.x);
        s[nt][e] = has_cap ? tanhf(x) * x_scale : x;
      }
    }
    const bool full = kw >= kr.lo_last && kw64 + 16 * kSl <= kr.hi_first && kw64 + 16 * kSl <= ke;
    if (!full) {
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) {
#pragma unroll
        for (int e = 0; e < 2 * kHF; ++e) {
          const int hf = e >> 1;
          const int64_t j = kw64 + nt * 8 + 2 * t + (e & 1);
          if (!(j < ke && j >= lo_r[hf] && j < hi_r[hf])) s[nt][e] = neg_inf();
        }
      }
    }

    // Online softmax, per warp, with lazy rescaling: a row keeps its reference max until a
    // score exceeds it by more than kRescale; O and the sum share the reference, so the result
    // is exact. The decision is warp-uniform. A row whose reference is still -inf subtracts 0.
    {
      float mx[2];
      bool grow = false;
#pragma unroll
      for (int hf = 0; hf < kHF; ++hf) {
        float m = fmaxf(s[0][2 * hf], s[0][2 * hf + 1]);
#pragma unroll
        for (int nt = 1; nt < kSN; ++nt) m = fmaxf(m, fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]));
        m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));
        m = fmaxf(m, __shfl_xor_sync(kFull, m, 2));
        mx[hf] = m;
        grow |= m > m_ref[hf] + kRescale;
      }
      if (__any_sync(kFull, grow)) {
#pragma unroll
        for (int hf = 0; hf < kHF; ++hf) {
          const float m_new = fmaxf(m_ref[hf], mx[hf]);
          const float corr = fast_exp2(m_ref[hf] - (m_new == neg_inf() ? 0.f : m_new));
          m_ref[hf] = m_new;
          l_sum[hf] *= corr;
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            o[dt][2 * hf] *= corr;
            o[dt][2 * hf + 1] *= corr;
          }
        }
      }
    }
#pragma unroll
    for (int hf = 0; hf < kHF; ++hf) {
      const float mref = m_ref[hf] == neg_inf() ? 0.f : m_ref[hf];
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float pv = fast_exp2(s[nt][2 * hf + c] - mref);
          s[nt][2 * hf + c] = pv;
          l_sum[hf] += pv;
        }
      }
    }

    if (per_token) {  // after the sums: P's columns times the V scale of their key / v_ref
      float vmax = 0.f;
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) vmax = fmaxf(vmax, fmaxf(fabsf(vs[nt].x), fabsf(vs[nt].y)));
      // the warp's keys: lanes of one t share them, so the max over t is warp-uniform
      vmax = fmaxf(vmax, __shfl_xor_sync(kFull, vmax, 1));
      vmax = fmaxf(vmax, __shfl_xor_sync(kFull, vmax, 2));
      if (vmax > v_ref * 128.f) {
        const float corr = v_ref / vmax;  // 0 while nothing was accumulated
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
          for (int e = 0; e < 2 * kHF; ++e) o[dt][e] *= corr;
        }
        v_ref = vmax;  // > 0 here
        v_inv = 1.f / vmax;  // a division only where the reference moves, not every tile
      }
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) {
        const float ax = vs[nt].x * v_inv, ay = vs[nt].y * v_inv;
        s[nt][0] *= ax;
        s[nt][1] *= ay;
        if (kHF > 1) {
          s[nt][2] *= ax;
          s[nt][3] *= ay;
        }
      }
    }

    // O += P V: P (16 rows x the warp's 16 keys) is one k16 A tile, of type TM (float16 with an
    // 8-bit cache: P <= 2^8 keeps 3 more mantissa bits than in bfloat16, and a weight below
    // 2^-24 of the row's largest flushes to 0).
    auto pv = [&](int sl) {
      uint32_t pa[4];
      pa[0] = mma_detail::pack2<TM>(s[2 * sl][0], s[2 * sl][1]);
      pa[1] = kHF > 1 ? mma_detail::pack2<TM>(s[2 * sl][2], s[2 * sl][3]) : 0u;  // rows g + 8
      pa[2] = mma_detail::pack2<TM>(s[2 * sl + 1][0], s[2 * sl + 1][1]);
      pa[3] = kHF > 1 ? mma_detail::pack2<TM>(s[2 * sl + 1][2], s[2 * sl + 1][3]) : 0u;
      if constexpr (kQ8) {
        // Lane (g, t): words of keys 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1) at columns vcol(g, dt);
        // byte_perm pairs the two keys of each column: word w of a load feeds tiles 4w..4w+3.
        const unsigned char* v8 =
            ring + (n % kS) * C::kStageBytes + C::kTileBytes + v8_row + sl * 16 * kRB;
        // word w of each load (keys 2t, 2t+1 in wa, wb; 2t+8, 2t+9 in wc, wd) -> O tiles dt0..dt0+3
        auto pv_word = [&](uint32_t wa, uint32_t wb, uint32_t wc, uint32_t wd, int dt0) {
          uint32_t f0[4], f1[4];
          q8::cvt4_v<TC>(wa, wb, f0);
          q8::cvt4_v<TC>(wc, wd, f1);
#pragma unroll
          for (int e = 0; e < 4; ++e) mma_detail::mma_16816<TM>(o[dt0 + e], pa, f0[e], f1[e]);
        };
        if constexpr (D == 64) {
          const int c0 = g >> 1;
          const int o0 = ((c0 ^ v8_swz0) << 4) + ((g & 1) << 3);
          const int o1 = ((c0 ^ v8_swz1) << 4) + ((g & 1) << 3);
          const uint2 a = *reinterpret_cast<const uint2*>(v8 + o0);
          const uint2 b = *reinterpret_cast<const uint2*>(v8 + kRB + o1);
          const uint2 c2 = *reinterpret_cast<const uint2*>(v8 + 8 * kRB + o0);
          const uint2 d2 = *reinterpret_cast<const uint2*>(v8 + 9 * kRB + o1);
          const uint32_t wa[2] = {a.x, a.y}, wb[2] = {b.x, b.y};
          const uint32_t wc[2] = {c2.x, c2.y}, wd[2] = {d2.x, d2.y};
#pragma unroll
          for (int w = 0; w < 2; ++w) pv_word(wa[w], wb[w], wc[w], wd[w], 4 * w);
        } else {
#pragma unroll
          for (int h = 0; h < D / 128; ++h) {
            const int o0 = (8 * h + (g ^ v8_swz0)) << 4;
            const int o1 = (8 * h + (g ^ v8_swz1)) << 4;
            const uint4 a = *reinterpret_cast<const uint4*>(v8 + o0);
            const uint4 b = *reinterpret_cast<const uint4*>(v8 + kRB + o1);
            const uint4 c2 = *reinterpret_cast<const uint4*>(v8 + 8 * kRB + o0);
            const uint4 d2 = *reinterpret_cast<const uint4*>(v8 + 9 * kRB + o1);
            const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
            const uint32_t wc[4] = {c2.x, c2.y, c2.z, c2.w}, wd[4] = {d2.x, d2.y, d2.z, d2.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) pv_word(wa[w], wb[w], wc[w], wd[w], 16 * h + 4 * w);
          }
        }
      } else {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t vf[4];
          mma_detail::ldmatrix_x4_trans(vf, mma_detail::chunk_pair(sV + v_lane + sl * 16 * kRB, dp));
          mma_detail::mma_16816<TM>(o[2 * dp], pa, vf[0], vf[1]);
          mma_detail::mma_16816<TM>(o[2 * dp + 1], pa, vf[2], vf[3]);
        }
      }
    };
#pragma unroll
    for (int sl = 0; sl < kSl; ++sl) pv(sl);
  }

  // ---- epilogue: merge the warps' states ----
  cp_async_wait<0>();
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    l_sum[hf] += __shfl_xor_sync(kFull, l_sum[hf], 1);
    l_sum[hf] += __shfl_xor_sync(kFull, l_sum[hf], 2);
    if (t == 0) {
      wm_s[warp * kRows + g + 8 * hf] = m_ref[hf];
      wl_s[warp * kRows + g + 8 * hf] = l_sum[hf];
    }
  }
  // also: every warp is done with the ring (red_s overlays it) and every copy has landed
  if (__syncthreads_or(bad)) {
    paged_store_nan<T, kNT>(p, dv, cta, tid);
    return;
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = g + 8 * hf;
    const float mref = paged_final_max<C::kWarps, kRows>(wm_s, r);
    const float f = fast_exp2(m_ref[hf] - mref) * (per_token ? v_ref : 1.f);
    // padding rows (r >= cta.mvalid: 12 of the 16 in GQA-4 decode) are never read
    if (r < cta.mvalid) {
      if constexpr (kQ8) {  // undo the column permutation of the 8-bit V path
        float* dst = red_s + (warp * kRows + r) * C::kRedStride;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          dst[q8::vcol<D>(2 * t, dt)] = o[dt][2 * hf] * f;
          dst[q8::vcol<D>(2 * t + 1, dt)] = o[dt][2 * hf + 1] * f;
        }
      } else {
        float* dst = red_s + (warp * kRows + r) * C::kRedStride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          *reinterpret_cast<float2*>(dst + dt * 8) =
              make_float2(o[dt][2 * hf] * f, o[dt][2 * hf + 1] * f);
      }
    }
    if (warp == 0 && t == 0) {
      fm_s[r] = mref;
      fl_s[r] = paged_final_sum<C::kWarps, kRows>(wm_s, wl_s, r, mref);
    }
  }
  __syncthreads();
  paged_store_rows<T, C::kWarps, kRows, C::kRedStride, kNT>(p, dv, cta, tid, red_s, fm_s, fl_s,
                                                            vscale_head);
}

// Paged decode attention on tensor cores (and the split-KV merge when num_splits > 1) on the
// configuration C (an MmaCfg of the tile width and the cache's element size).
template <typename T, typename TC, class C>
cudaError_t launch_paged_attention_mma_config(const PagedAttentionParams& p,
                                              cudaStream_t stream) {
  constexpr int D = C::kDim;
  const int64_t rows = static_cast<int64_t>(p.num_heads / p.num_heads_k) * p.seqlen_q;
  const int64_t chunks = (rows + C::kRows - 1) / C::kRows;
  const int64_t blocks = static_cast<int64_t>(p.batch) * p.num_heads_k * p.num_splits * chunks;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  // at most 8 query rows per CTA (GQA decode): row halves 8-15 are padding
  const bool half = rows <= 8;
  auto kernel = half ? paged_attention_mma_kernel<T, TC, D, 1, C>
                     : paged_attention_mma_kernel<T, TC, D, 2, C>;
  cudaError_t err = half ? ensure_smem_attrs<paged_attention_mma_kernel<T, TC, D, 1, C>>(C::kSmem)
                         : ensure_smem_attrs<paged_attention_mma_kernel<T, TC, D, 2, C>>(C::kSmem);
  if (err != cudaSuccess) return err;
  err = paged_launch_pdl(kernel, dim3(static_cast<unsigned>(blocks)), dim3(C::kThreads), C::kSmem,
                         stream, p.launch.pdl, p, static_cast<int32_t>(chunks));
  if (err != cudaSuccess) return err;
  return launch_paged_merge<T, D>(p, stream);
}

// Paged decode attention on tensor cores (and the split-KV merge when num_splits > 1) for q of
// type T (__half or __nv_bfloat16) and a cache of type TC (T, int8_t or __nv_fp8_e4m3) on the
// tile width D = policy::paged_mma_tile_dim(head_dim, head_dim_v); parameters accepted by
// paged_mma_supported. Asynchronous on `stream`; never synchronizes or allocates. Cfg: void
// (the library's configurations: MmaCfg<D, sizeof(TC)>, with policy::paged_mma_padded_stages
// ring stages when max(D, Dv) is below the tile width) or another MmaCfg of D and sizeof(TC)
// (the sweep tool).
template <typename T, int D, typename TC, class Cfg>
cudaError_t launch_paged_attention_mma(const PagedAttentionParams& p, cudaStream_t stream) {
  static_assert(kIsHalfOrBFloat16<T>, "float16 or bfloat16");
  static_assert(std::is_same_v<TC, T> || std::is_same_v<TC, int8_t> ||
                    std::is_same_v<TC, __nv_fp8_e4m3>,
                "cache of q's type, int8 or float8 e4m3");
  if constexpr (!std::is_void_v<Cfg>) {
    static_assert(Cfg::kDim == D && Cfg::kCacheBytes == sizeof(TC),
                  "an MmaCfg of D and the cache");
    return launch_paged_attention_mma_config<T, TC, Cfg>(p, stream);
  } else {
    constexpr int kPaddedStages = policy::paged_mma_padded_stages(D, sizeof(TC));
    if constexpr (kPaddedStages > 0) {
      if (p.head_dim < D && p.head_dim_v < D)
        return launch_paged_attention_mma_config<T, TC, MmaCfg<D, sizeof(TC), 0, kPaddedStages>>(
            p, stream);
    }
    return launch_paged_attention_mma_config<T, TC, MmaCfg<D, sizeof(TC)>>(p, stream);
  }
}

}  // namespace paged
}  // namespace jax_flash
