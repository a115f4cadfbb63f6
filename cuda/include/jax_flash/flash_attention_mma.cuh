// Tensor-core fused prefill attention for float16 / bfloat16 (FlashAttention-2 design).
//
// One CTA computes one BlockM x head_dim tile of O for one query head of one sequence. Its warps
// split the query rows (BlockM / warps rows each), so softmax row statistics stay inside a quad of
// lanes. Per key tile of BlockN rows:
//   S = Q K^T      mma.sync m16n8k16 (f32 accumulate), Q and K fed by ldmatrix.x4 from shared
//   online softmax exp2 with softmax_scale * log2(e) folded into one FFMA per score
//   O += P V       P converted in registers to the A operand, V fed by ldmatrix.x4.trans
// K and V stream through shared memory with 16-byte cp.async (rows past the sequence are
// zero-filled, never read), double-buffered where shared memory allows two CTAs per SM. Shared
// tiles are XOR-swizzled in 16-byte chunks (chunk ^ (row % 8)) so that ldmatrix, cp.async and the
// epilogue are free of bank conflicts. Key tiles are visited last to first, so only the first
// tiles (the diagonal / sequence end) need a mask; tiles that no query row of the CTA sees
// (causal, sliding window, sequence length) are never visited. The softmax rescales O lazily
// (only when a row max grows by more than 2^8 in weight).
//
// Head dims: the kernel is compiled for tile widths kHeadDim = 64, 128, 256. A call whose D and
// Dv (multiples of 16, policy::flash_mma_head_dims_supported) are not both the tile's width runs
// the padded variant (kPad) on the narrowest tile that holds them (policy::flash_mma_tile_dim):
// rows are copied at their own width (Q and K at D, V at Dv) with the tile's other 16-byte
// chunks zero-filled, Q K^T skips its k16 steps past D and P V its column pairs past Dv, and
// only Dv columns are stored. The exact variant (D == Dv == the tile) has none of these checks.
//
// Scheduling: grid.x enumerates the query tiles of all sequences in order (sequence b owns
// ceil(q_len_b / BlockM) consecutive tiles, heavy causal tiles first), grid.y/z the query heads.
// grid.x = ceil(total_q / BlockM) + batch bounds the tile count when sequences do not overlap;
// a CTA loops with stride gridDim.x, so overlapping (garbage) extents are still all computed.
//
// No XLA headers: the FFI layer fills FlashParams and calls run_flash_attention_mma.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/flash_params.h"
#include "jax_flash/launch.cuh"
#include "jax_flash/mma_sync.cuh"
#include "jax_flash/policy/flash.h"
#include "jax_flash/softmax.cuh"
#include "jax_flash/warp.cuh"

namespace jax_flash {

// The parameters this kernel computes exactly as the contract says
// (flash_tensor_core_call_supported); the dispatcher sends all others to the SIMT kernel.
inline bool flash_attention_mma_supported(const FlashParams& p) {
  return flash_tensor_core_call_supported(p);
}

namespace mma_detail {

// Tile shape of one kernel instance.
//   kBlockM query rows per CTA, split evenly over kWarps warps (a multiple of 16 rows each);
//   kBlockN key rows per iteration;
//   kStages 2: K and V each double-buffered (the load of tile n-1 overlaps all of tile n);
//           1: one K and one V buffer, FA2-style: V(n) loads under QK^T(n), K(n-1) under
//              softmax + PV(n). Used where two buffers would cost the second CTA per SM.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_>
struct MmaTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
  static constexpr int kMTiles = kWarpRows / 16;      // m16 tiles per warp
  static constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S per m16 tile
  static constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of O per m16 tile
  static constexpr int kChunks = kHeadDim / 8;        // 16-byte chunks per row
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kLoadRowsPerPass = kThreads / kChunks;
  static constexpr int kSmemQ = kBlockM * kRowBytes;   // sQ, reused for the O epilogue
  static constexpr int kSmemKV = kBlockN * kRowBytes;  // one K or one V buffer
  static constexpr int kSmemTiles = kSmemQ + 2 * kStages * kSmemKV;
  static constexpr int kSmemBytes = kSmemTiles + 64;  // + TileState
  static constexpr int kMinBlocksPerSm = 2;

  static_assert(kHeadDim % 64 == 0, "rows must span whole 128-byte swizzle atoms");
  static_assert(kWarpRows % 16 == 0 && kBlockM == kWarpRows * kWarps, "bad BlockM / warps");
  static_assert(kBlockN % 16 == 0, "BlockN must be a multiple of 16");
  static_assert(kThreads % kChunks == 0, "a pass of cp.async must cover whole rows");
  static_assert(kBlockM % kLoadRowsPerPass == 0 && kBlockN % kLoadRowsPerPass == 0,
                "tiles must be loaded in whole passes");
  static_assert(kStages == 1 || kStages == 2, "1 or 2 K/V stages");
};

// Default tiles per head dim, 4 warps each, two CTAs per SM (255 registers, no spills).
// Measured on an H100 SXM, bf16, B=4, S=4096, Hq=32, Hkv=8, TFLOP/s non-causal / causal:
//   d=64:  128x128 2 stages (80 KB)  331 / 291-300;  128x64 2 stages 290 / 266.
//   d=128: 128x64 2 stages (96 KB)   372 / 339-342;  128x64 1 stage 371 / 342; 64x64 2 stages
//          289 / 271 (FA2's causal choice on sm8x is not better here); 128x32 2 stages 340 / 309.
//   d=256: 64x64 1 stage (96 KB)     310 / 309;  64x64 2 stages (160 KB, one CTA per SM)
//          257 / 245;  64x32 2 stages (96 KB) 285 / 274. Double-buffering d=256 costs the second
//          CTA per SM or half the key tile, so it keeps FA2's single K and V buffer.
// (torch SDPA's FlashAttention-2 on the same card: d=128 357 / 316.)
template <int kHeadDim>
struct DefaultTraits;
template <>
struct DefaultTraits<64> {
  using type = MmaTraits<64, 128, 128, 4, 2>;
};
template <>
struct DefaultTraits<128> {
  using type = MmaTraits<128, 128, 64, 4, 2>;
};
template <>
struct DefaultTraits<256> {
  using type = MmaTraits<256, 64, 64, 4, 1>;
};

// Copies rows [row0, row0 + kRows) of a head's [rows, kHeadDim] slice g (row stride `stride`
// elements) into a swizzled shared tile. With kGuard, rows >= valid_rows are zero-filled and not
// read (their source address is row 0's; valid_rows > 0); without, all rows must be valid. With
// kPad, a row holds row_chunks 16-byte chunks (its head dim / 8) and the tile's others are
// zero-filled without reading. Thread tid copies chunk tid % kChunks of rows tid / kChunks +
// i * kLoadRowsPerPass.
template <class Tr, int kRows, bool kGuard, bool kPad, typename T>
__device__ __forceinline__ void load_tile(uint32_t s_tile, const T* g, int64_t stride, int row0,
                                          int valid_rows, int row_chunks, int tid) {
  const int c = tid % Tr::kChunks;
  const int r = tid / Tr::kChunks;
  const bool c_ok = !kPad || c < row_chunks;
  const T* row0_src = g + static_cast<uint32_t>(c * 8);  // unsigned: no sign-extension word
  const T* src = row0_src + static_cast<int64_t>(row0 + r) * stride;
  const int64_t step = stride * Tr::kLoadRowsPerPass;
  const int left = valid_rows - row0 - r;
#pragma unroll
  for (int i = 0; i < kRows / Tr::kLoadRowsPerPass; ++i) {
    const bool ok = (!kGuard || i * Tr::kLoadRowsPerPass < left) && c_ok;
    cp_async_16(s_tile + swizzle<Tr::kChunks>(r + i * Tr::kLoadRowsPerPass, c),
                ok ? src : row0_src, ok);
    src += step;
  }
}

// Per-tile scalars the main loop needs, kept in shared memory (written by thread 0 before the
// loop's first barrier) rather than in registers, which the accumulators fill.
struct TileState {
  int64_t k_off, v_off;  // element offsets of the sequence's first K / V row for this kv head
  int32_t n_first;       // first key tile visited (the loop runs n_last down to n_first)
  int32_t mask_below, mask_from;  // key tiles n < mask_below or n >= mask_from need a mask
  int32_t q_len, k_len, m0;
};

static_assert(sizeof(TileState) <= 64, "TileState must fit the 64 bytes reserved for it");

struct TileCoord {
  int32_t b;        // sequence
  int32_t m_block;  // query tile within the sequence
};

// Finds the tile-th query tile over all sequences (sequence b owns ceil(q_len_b / kBlockM)
// consecutive tiles). Each warp scans 32 sequences per step with shuffles, so the cost is
// batch / 32 steps whatever the lengths; all warps compute the same answer.
template <int kBlockM>
__device__ __forceinline__ bool find_tile(const FlashParams& p, int64_t tile, TileCoord* out) {
  const int lane = threadIdx.x & 31;
  int64_t before = 0;  // tiles of the sequences already scanned
  for (int base = 0; base < p.batch; base += 32) {
    const int b = base + lane;
    int n = 0;
    if (b < p.batch) {
      const SeqExtent e = seq_extent(p, p.q_starts[b], p.q_ends[b], 0, 0);
      n = e.q_len > 0 ? (e.q_len + kBlockM - 1) / kBlockM : 0;
    }
    const int incl = warp_inclusive_sum(n, lane);
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    if (tile < before + total) {
      const int64_t local = tile - before;  // < total, fits int32
      const unsigned hit = __ballot_sync(0xffffffffu, local < incl && local >= incl - n);
      const int leader = __ffs(hit) - 1;
      const int start = __shfl_sync(0xffffffffu, incl - n, leader);
      const int count = __shfl_sync(0xffffffffu, n, leader);
      out->b = base + leader;
      // Reverse order within a sequence: the last (heaviest under causal masking) tile first.
      out->m_block = count - 1 - (static_cast<int>(local) - start);
      return true;
    }
    before += total;
  }
  return false;
}

template <typename T, class Tr, bool kSoftcap, bool kPad>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocksPerSm)
    flash_fwd_mma_kernel(const __grid_constant__ FlashParams p) {
  constexpr int D = Tr::kHeadDim;  // the tile width
  // The call's head dims: the tile's with !kPad, else D >= head_dim, head_dim_v (multiples of 16).
  const int dk = kPad ? p.head_dim : D;
  const int dv = kPad ? p.head_dim_v : D;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int kMT = Tr::kMTiles;
  constexpr int kNT = Tr::kNTiles;
  constexpr int kDT = Tr::kDTiles;
  constexpr int kRowBytes = Tr::kRowBytes;

  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + Tr::kSmemQ;
  const uint32_t sV = sK + Tr::kStages * Tr::kSmemKV;
  TileState* st = reinterpret_cast<TileState*>(smem + Tr::kSmemTiles);

  const int head = blockIdx.z * gridDim.y + blockIdx.y;
  if (head >= p.num_heads) return;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // row of the mma C fragment (and +8)
  const int t = lane & 3;   // column pair of the mma C fragment
  const int warp_row0 = warp * Tr::kWarpRows;

  // ldmatrix lane addressing (lane l gives the row address of matrix l / 8, row l % 8):
  //   Q (A of S, x4 = rows 0-7/8-15 x k 0-7/8-15): row l % 16, chunk 2kk + l / 16
  //   K (B of S, x4 = n-tiles 2np/2np+1 x k halves): row (l / 16) * 8 + l % 8, chunk 2kk + l / 8 % 2
  //   V (B of PV, .trans, x4 = key halves x d-tiles 2dp/2dp+1): row (l / 8 % 2) * 8 + l % 8,
  //     chunk 2dp + l / 16
  // Every row address has row % 8 == l % 8, and the tiles are 128-byte aligned with rows of a
  // multiple of 128 bytes, so the swizzled address of chunk 2s + c is the lane's address of
  // chunk c (swizzled) XOR 16 * (2s % 8), plus 16 * (2s - 2s % 8): see chunk_pair.
  const uint32_t q_lane = sQ + (warp_row0 + (lane & 15)) * kRowBytes + (((lane >> 4) ^ (lane & 7)) << 4);
  const uint32_t k_lane = (((lane >> 4) & 1) * 8 + (lane & 7)) * kRowBytes +
                          ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
  const uint32_t v_lane = (((lane >> 3) & 1) * 8 + (lane & 7)) * kRowBytes +
                          ((((lane >> 4) & 1) ^ (lane & 7)) << 4);

  // Scores are kept in "raw" units x (q.k, or tanh(scale q.k / softcap) with softcap); the
  // softmax weight is exp2(x * scale_log2 - max * scale_log2).
  const ScoreScale score = score_scale<kSoftcap>(p);
  const float scale_log2 = score.scale_log2, softcap_in = score.softcap_in;


  for (int64_t tile = blockIdx.x;; tile += gridDim.x) {
    TileCoord tc;
    if (!find_tile<BM>(p, tile, &tc)) break;
    const int b = tc.b;
    SeqExtent e = seq_extent(p, p.q_starts[b], p.q_ends[b], p.k_starts[b], p.k_ends[b]);
    const int m0 = tc.m_block * BM;
    const FlashKeyTiles kt = flash_key_tiles<BM, BN>(p, e, m0);

    const T* q_ptr = static_cast<const T*>(p.q) +
                     static_cast<int64_t>(e.q_start) * p.q_row_stride +
                     static_cast<int64_t>(head) * dk;
    // GQA: query head h reads kv head h / (Hq / Hkv). Computed per tile through opaque():
    // hoisted out of the tile loop, it would be held (or spilled) across the main loop.
    const int kv_head = opaque(head) / (opaque(p.num_heads) / p.num_heads_k);
    const int64_t k_off = static_cast<int64_t>(e.k_start) * p.k_row_stride +
                          static_cast<int64_t>(kv_head) * dk;
    const int64_t v_off = static_cast<int64_t>(e.k_start) * p.v_row_stride +
                          static_cast<int64_t>(kv_head) * dv;
    if (tid == 0) {
      st->k_off = k_off;
      st->v_off = v_off;
      st->n_first = kt.n_first;
      st->mask_below = kt.mask_below;
      st->mask_from = kt.mask_from;
      st->q_len = e.q_len;
      st->k_len = e.k_len;
      st->m0 = m0;
    }
    const T* k_head = static_cast<const T*>(p.k);
    const T* v_head = static_cast<const T*>(p.v);

    float acc_o[kMT][kDT][4];
    float row_max[kMT][2];
    float row_sum[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
      }
      row_max[mt][0] = row_max[mt][1] = -INFINITY;
      row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    if (kt.n_last >= kt.n_first) {
      load_tile<Tr, BM, true, kPad>(sQ, q_ptr, p.q_row_stride, m0, e.q_len, dk / 8, tid);
      load_tile<Tr, BN, true, kPad>(sK, k_head + k_off, p.k_row_stride, kt.n_last * BN, e.k_len,
                                    dk / 8, tid);
      cp_async_commit();
      if constexpr (Tr::kStages == 2) {
        load_tile<Tr, BN, true, kPad>(sV, v_head + v_off, p.v_row_stride, kt.n_last * BN, e.k_len,
                                      dv / 8, tid);
        cp_async_commit();
      }

      // Only tile n_last can reach past k_len (key_end <= k_len), so the K/V loads of tiles
      // n - 1 < n_last issued inside the loop need no row guard.
      int stage = 0;
      for (int n = kt.n_last;; --n) {
        const int n0 = n * BN;
        const uint32_t sK_cur = sK + stage * Tr::kSmemKV;
        const uint32_t sV_cur = sV + stage * Tr::kSmemKV;

        // K(n) has landed; every warp is done with tile n+1 (its K and V buffers are free).
        if constexpr (Tr::kStages == 2) {
          cp_async_wait<1>();
          __syncthreads();
          if (n > st->n_first)
            load_tile<Tr, BN, false, kPad>(sK + (stage ^ 1) * Tr::kSmemKV, k_head + st->k_off,
                                           p.k_row_stride, n0 - BN, 0, dk / 8, tid);
          cp_async_commit();
        } else {
          cp_async_wait<0>();
          __syncthreads();
          load_tile<Tr, BN, true, kPad>(sV, v_head + st->v_off, p.v_row_stride, n0, st->k_len,
                                        dv / 8, tid);
          cp_async_commit();
        }

        // S = Q K^T
        float s[kMT][kNT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          if (kPad && kk * 16 >= dk) break;  // the tile's columns past D are zero
          uint32_t qa[kMT][4];
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
            ldmatrix_x4(qa[mt], chunk_pair(q_lane, kk) + mt * 16 * kRowBytes);
#pragma unroll
          for (int np = 0; np < kNT / 2; ++np) {
            uint32_t kb[4];
            ldmatrix_x4(kb, chunk_pair(sK_cur + k_lane, kk) + np * 16 * kRowBytes);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma_16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
              mma_16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
            }
          }
        }

        if constexpr (kSoftcap) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
              for (int i = 0; i < 4; ++i) s[mt][nt][i] = softcap_tanh(s[mt][nt][i] * softcap_in);
            }
          }
        }

        // Mask (after the softcap: tanh would turn -inf back into a finite score).
        if (n < st->mask_below || n >= st->mask_from) {
          const int q_len = st->q_len;
          const int k_len = st->k_len;
          const int row_base = st->m0 + warp_row0 + g;  // this thread's first row
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              int lo, hi;
              visible_keys(p, row_base + mt * 16 + hf * 8, q_len, k_len, &lo, &hi);
              // Key n0 + 2t + x for the compile-time column x = nt * 8 + c.
              lo -= n0 + 2 * t;
              hi -= n0 + 2 * t;
#pragma unroll
              for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  if (nt * 8 + c < lo || nt * 8 + c >= hi) s[mt][nt][2 * hf + c] = -INFINITY;
                }
              }
            }
          }
        }

        // V(n) has landed; every warp is done reading K(n).
        if constexpr (Tr::kStages == 2) {
          cp_async_wait<1>();
          __syncthreads();
          if (n > st->n_first)
            load_tile<Tr, BN, false, kPad>(sV + (stage ^ 1) * Tr::kSmemKV, v_head + st->v_off,
                                           p.v_row_stride, n0 - BN, 0, dv / 8, tid);
          cp_async_commit();
        } else {
          cp_async_wait<0>();
          __syncthreads();
          if (n > st->n_first)
            load_tile<Tr, BN, false, kPad>(sK, k_head + st->k_off, p.k_row_stride, n0 - BN, 0,
                                           dk / 8, tid);
          cp_async_commit();
        }

        // Online softmax with lazy rescaling (as FA4): a row keeps its reference max until the
        // new scores exceed it by more than 2^kRescaleLog2 in weight; until then the weights are
        // at most 2^kRescaleLog2 (fine in f16/bf16 and f32 sums) and O, l need no rescale, which
        // saves a multiply per accumulator on most tiles. Exact: O and l share the reference.
        // The decision is per warp (any row), so the branch is uniform. A row whose reference is
        // still -inf (nothing visible yet) subtracts 0: its weights are exp2(-inf) = 0, never NaN.
        {
          float mx[kMT][2];
          bool grow = false;
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              float m = -INFINITY;
#pragma unroll
              for (int nt = 0; nt < kNT; ++nt)
                m = fmaxf(m, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
              m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
              m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
              mx[mt][hf] = m;
              grow |= m * scale_log2 > row_max[mt][hf] * scale_log2 + kRescaleLog2;
            }
          }
          if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
              for (int hf = 0; hf < 2; ++hf) {
                const float m_new = fmaxf(row_max[mt][hf], mx[mt][hf]);
                const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
                const float corr = fast_exp2(row_max[mt][hf] * scale_log2 - m_scaled);
                row_max[mt][hf] = m_new;
                row_sum[mt][hf] *= corr;
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                  acc_o[mt][dt][2 * hf] *= corr;
                  acc_o[mt][dt][2 * hf + 1] *= corr;
                }
              }
            }
          }
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const float m_scaled =
                row_max[mt][hf] == -INFINITY ? 0.f : row_max[mt][hf] * scale_log2;
            float sum = row_sum[mt][hf];
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const float pv = fast_exp2(fmaf(s[mt][nt][2 * hf + c], scale_log2, -m_scaled));
                s[mt][nt][2 * hf + c] = pv;
                sum += pv;
              }
            }
            row_sum[mt][hf] = sum;
          }
        }

        // P as A fragments (two n8 tiles of the C fragment form one k16 tile).
        uint32_t pa[kMT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) {
            pa[mt][kk][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            pa[mt][kk][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            pa[mt][kk][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            pa[mt][kk][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
          }
        }
        // ptxas would sink the row-sum adds (and the packs) below the PV mma, keeping all fp32
        // weights alive across them, which spills. Make the V addresses depend on every sum and
        // packed weight through their sign bits (all zero: the weights are >= 0).
        uint32_t signs = 0;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          signs |= __float_as_uint(row_sum[mt][0]) | __float_as_uint(row_sum[mt][1]);
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk)
            signs |= pa[mt][kk][0] | pa[mt][kk][1] | pa[mt][kk][2] | pa[mt][kk][3];
        }
        const uint32_t sV_dep = sV_cur + v_lane + ((signs >> 31) & (signs >> 15) & 1u) * 16;

        // O += P V
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
          for (int dp = 0; dp < kDT / 2; ++dp) {
            if (kPad && dp * 16 >= dv) break;  // output columns past Dv are never stored
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, chunk_pair(sV_dep, dp) + kk * 16 * kRowBytes);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma_16816<T>(acc_o[mt][2 * dp], pa[mt][kk], vb[0], vb[1]);
              mma_16816<T>(acc_o[mt][2 * dp + 1], pa[mt][kk], vb[2], vb[3]);
            }
          }
        }
        if constexpr (Tr::kStages == 2) stage ^= 1;
        if (n == st->n_first) break;
      }
    }
    cp_async_wait<0>();
    e = seq_extent(p, p.q_starts[b], p.q_ends[b], 0, 0);

    // Epilogue: normalize, write lse, stage O (16-bit) in this warp's own rows of sQ (only this
    // warp ever read them), then store whole 16-byte chunks of the valid rows. (The staging
    // address goes through opaque() so that it is not hoisted out of the tile loop and held.)
    const uint32_t sO = static_cast<uint32_t>(opaque(static_cast<int>(sQ)));
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = row_sum[mt][hf];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const bool empty = !(sum > 0.f);
        const float inv = empty ? 0.f : 1.f / sum;
        const int r = warp_row0 + mt * 16 + g + hf * 8;
        if (t == 0 && p.lse != nullptr && m0 + r < e.q_len) {
          const float lse =
              empty ? -INFINITY : (row_max[mt][hf] * scale_log2 + log2f(sum)) * kLn2;
          p.lse[static_cast<int64_t>(head) * p.total_q + e.q_start + m0 + r] = lse;
        }
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const uint32_t v = pack2<T>(acc_o[mt][dt][2 * hf] * inv, acc_o[mt][dt][2 * hf + 1] * inv);
          st_shared_b32(sO + r * kRowBytes + ((dt ^ g) * 16) + t * 4, v);
        }
      }
    }
    __syncwarp();
    T* o_ptr = static_cast<T*>(p.o) +
               static_cast<int64_t>(e.q_start + m0 + warp_row0) * p.o_row_stride +
               static_cast<int64_t>(head) * dv;
#pragma unroll
    for (int i = 0; i < Tr::kWarpRows * Tr::kChunks / 32; ++i) {
      const int idx = lane + 32 * i;
      const int r = idx / Tr::kChunks;
      const int c = idx % Tr::kChunks;
      if (m0 + warp_row0 + r < e.q_len && (!kPad || c < dv / 8)) {
        const uint4 v = ld_shared_v4(sO + swizzle<Tr::kChunks>(warp_row0 + r, c));
        st_global_v4(o_ptr + static_cast<int64_t>(r) * p.o_row_stride + c * 8, v);
      }
    }
    // The next tile's cp.async overwrites sQ / sK / sV.
    __syncthreads();
  }
}

// Launches one tile configuration. Returns cudaSuccess without a launch when there is nothing
// to compute (no sequence, no query row, no head).
template <typename T, class Tr, bool kSoftcap, bool kPad>
cudaError_t launch_flash_mma(const FlashParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.total_q <= 0 || p.num_heads <= 0) return cudaSuccess;
  // The kernel's tile loop strides over the slots past the grid.
  const int64_t tiles = flash_num_tile_slots(p, Tr::kBlockM);
  const int heads_y = p.num_heads < 65535 ? p.num_heads : 65535;
  const dim3 grid(static_cast<unsigned>(tiles), heads_y, (p.num_heads + heads_y - 1) / heads_y);
  return launch_with_smem<flash_fwd_mma_kernel<T, Tr, kSoftcap, kPad>>(grid, Tr::kThreads,
                                                                     Tr::kSmemBytes, stream, p);
}

}  // namespace mma_detail

// Fused attention on the tile width kHeadDim = policy::flash_mma_tile_dim(p.head_dim,
// p.head_dim_v) (the padded variant unless both equal it), T = __half or __nv_bfloat16, params
// accepted by flash_attention_mma_supported. Writes o and lse for every row that some
// sequence owns (rows past max_seqlen_q excepted); other rows are left to fill_uncovered.
// Asynchronous on `stream`; never synchronizes or allocates.
template <typename T, int kHeadDim>
cudaError_t run_flash_attention_mma(const FlashParams& p, cudaStream_t stream) {
  static_assert(kIsHalfOrBFloat16<T>, "float16 or bfloat16");
  using Tr = typename mma_detail::DefaultTraits<kHeadDim>::type;
  const bool pad = p.head_dim != kHeadDim || p.head_dim_v != kHeadDim;
  return dispatch_bool(pad, [&](auto pad_c) {
    return dispatch_bool(p.softcap > 0.f, [&](auto softcap_c) {
      return mma_detail::launch_flash_mma<T, Tr, decltype(softcap_c)::value,
                                          decltype(pad_c)::value>(p, stream);
    });
  });
}

// Instantiated once each in the files flash_attention_mma_{f16,bf16}_d{64,128,256}.cu that
// cuda/src/instantiations.cmake generates.
extern template cudaError_t run_flash_attention_mma<__half, 64>(const FlashParams&, cudaStream_t);
extern template cudaError_t run_flash_attention_mma<__half, 128>(const FlashParams&, cudaStream_t);
extern template cudaError_t run_flash_attention_mma<__half, 256>(const FlashParams&, cudaStream_t);
extern template cudaError_t run_flash_attention_mma<__nv_bfloat16, 64>(const FlashParams&,
                                                                      cudaStream_t);
extern template cudaError_t run_flash_attention_mma<__nv_bfloat16, 128>(const FlashParams&,
                                                                       cudaStream_t);
extern template cudaError_t run_flash_attention_mma<__nv_bfloat16, 256>(const FlashParams&,
                                                                       cudaStream_t);

}  // namespace jax_flash
