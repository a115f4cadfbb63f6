// Hopper (sm_90a) fused prefill attention for float16 / bfloat16: warp-specialised, TMA + wgmma.
//
// Persistent CTAs walk work items: CTA c takes item c first, then c + gridDim.x, c + 2 gridDim.x,
// ... or (kDynamicItems) the next item nobody has taken (gridDim.x + FlashParams::item_counter's
// atomic count), so that CTAs whose items were light take more (causal and packed calls). Item w
// is query head w % num_heads of query tile w / num_heads, query tiles numbered sequence by
// sequence (heaviest causal tile of a sequence first), so the heads sharing a K/V head run side by
// side and reuse it from L2. With kDynamicItems the producer picks each item and hands its number
// to the consumers through a ring of kItemSlots shared-memory slots (item_full / item_empty
// mbarriers); the number past the last item tells them to stop. Per item:
//   producer (warpgroup 0, one thread): TMA loads of the Q tile (once) and of the K and V tiles,
//     last key tile first, into a kStages-deep ring; each buffer has a "full" mbarrier (TMA
//     transaction bytes) and an "empty" one (one arrival per consumer warpgroup).
//   consumers (warpgroups 1 .. kConsumers; 64 query rows each): S = Q K^T with wgmma from
//     shared memory, soft cap, mask, online softmax in registers, P converted in registers to
//     wgmma's A fragment, O += P V with V read MN-major from shared memory. The softmax of key
//     tile n runs while the tensor cores compute P V of tile n + 1 (kOverlap), and the
//     warpgroups take turns issuing their GEMMs (kPingPong), so one's softmax hides under another's
//     GEMMs. The epilogue stages O in the warpgroup's rows of an O buffer (tiles up to 128
//     wide: Q is released after the item's last Q K^T, so the next item's Q loads under this
//     one's last P V and epilogue) or of the Q buffer, and stores whole 16-byte chunks of valid
//     rows.
// TMA reads whole tiles of the packed tensors, so a tile can cover rows of the next sequence:
// such q rows are computed but never stored, such keys are masked in S (as past-the-window keys
// are), and such V rows are zeroed in shared memory before P V (a masked key's weight is exactly
// 0, and 0 * inf would be NaN). Rows past the tensors arrive as zeros.
//
// Head dims below the tile width D (any D, Dv <= D that are multiples of 16): the TMA
// descriptors span the tensors' real widths, so Q / K columns past head_dim and V columns past
// head_dim_v arrive as zeros (they add nothing to S, and give O columns of zeros), and the
// epilogue stores only the head_dim_v columns of O. A narrow variant (Tr::kComputeDim < D)
// issues tensor-core work for its first kComputeDim columns only: Q K^T k16 steps and the N of
// P V's wgmma.
//
// Masking, softmax scaling and the lazy rescale follow the mma.sync kernel
// (flash_attention_mma.cuh): scores in raw units, exp2 with softmax_scale * log2(e) folded in,
// O and the row sum rescaled only when a row max grows by more than 2^8 in weight.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/flash_params.h"
#include "jax_flash/hopper/ptx.cuh"
#include "jax_flash/hopper/tile_config.cuh"
#include "jax_flash/hopper/wgmma.cuh"
#include "jax_flash/mma_sync.cuh"
#include "jax_flash/softmax.cuh"

namespace jax_flash::hopper {

using mma_detail::fast_exp2;
using mma_detail::ld_shared_v4;
using mma_detail::pack2;
using mma_detail::st_global_v4;
using mma_detail::st_shared_b32;

// Where the key / value rows come from.
// PackedKv: the packed k / v tensors of FlashParams (row k_start + j holds key j of a sequence).
struct PackedKv {
  static constexpr bool kPaged = false;
};
// PagedKv: paged_attention's page pools [num_pages * page_size, Hkv, D] and block tables (its
// multi-token queries: chunked prefill against the cache). FlashParams then describes q / o as
// batch sequences of max_seqlen_q = Sq rows each (q_starts... unused), k / v as the pools
// (total_k = num_pages * page_size), and lse as paged_params.h's [batch, Hq, Sq]. Key j of
// sequence b is pool row block_tables[b, j / page_size] * page_size + j % page_size; a tile of
// keys is loaded as kBlockN / box_rows TMA boxes (box_rows = min(page_size, kBlockN), a multiple
// of 16, dividing kBlockN or page_size). A sequence whose kv length is outside
// [0, max_pages * page_size], or whose first ceil(kv_len / page_size) ids are not all in
// [0, num_pages), is bad: its rows get o = NaN and lse = NaN and nothing of it is read (the
// paged contract). Ids past a sequence's length are never read either.
struct PagedKv {
  static constexpr bool kPaged = true;
  const int32_t* block_tables;  // [batch, max_pages]
  const int32_t* kv_lens;       // [batch]
  int32_t max_pages;
  int32_t page_size;
  int32_t num_pages;
  int32_t box_rows;
};

// Whether paged sequence b with kv length klen is bad (PagedKv). Whole warp.
__device__ __forceinline__ bool paged_sequence_bad(const PagedKv& kv, int b, int32_t klen) {
  if (klen < 0 || static_cast<int64_t>(klen) > static_cast<int64_t>(kv.max_pages) * kv.page_size)
    return true;
  const int pages = static_cast<int>((static_cast<int64_t>(klen) + kv.page_size - 1) / kv.page_size);
  const int32_t* bt = kv.block_tables + static_cast<int64_t>(b) * kv.max_pages;
  bool bad = false;
  for (int i = static_cast<int>(threadIdx.x & 31); i < pages; i += 32) {
    const int32_t id = __ldg(bt + i);
    bad |= id < 0 || id >= kv.num_pages;
  }
  return __any_sync(0xffffffffu, bad);
}

// Work item w: (sequence, query tile, head). False past the last item. Whole warp. `bad`: a
// paged sequence with bad data (PagedKv; its extent then has no keys).
template <int BM, class Kv>
__device__ __forceinline__ bool find_work(const FlashParams& p, const Kv& kv, int64_t w,
                                          FlashTileCursor& cur, FlashTile& ft, int& head,
                                          int& m0, bool& bad) {
  const int64_t tile = w / p.num_heads;
  head = static_cast<int>(w - tile * p.num_heads);
  bad = false;
  if constexpr (Kv::kPaged) {
    // Every sequence has Sq rows: ceil(Sq / BM) tiles each, no search.
    const int sq = p.max_seqlen_q;
    const int tiles = (sq + BM - 1) / BM;
    const int64_t b = tile / tiles;
    if (b >= p.batch) return false;
    ft.b = static_cast<int32_t>(b);
    ft.m = static_cast<int32_t>(tile - b * tiles);
    ft.num_m = tiles;
    const int32_t klen = __ldg(kv.kv_lens + b);
    bad = paged_sequence_bad(kv, ft.b, klen);
    ft.ext = SeqExtent{static_cast<int32_t>(b * sq), sq, 0, bad ? 0 : klen};
  } else {
    if (!flash_find_tile_warp(p, BM, tile, cur, ft)) return false;
  }
  m0 = (ft.num_m - 1 - ft.m) * BM;  // the heaviest causal tile of a sequence first
  return true;
}


template <typename T, class Tr, bool kSoftcap, class Kv = PackedKv, bool kDynamicItems = false>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_hopper_kernel(const __grid_constant__ FlashParams p,
                            const __grid_constant__ CUtensorMap tm_q,
                            const __grid_constant__ CUtensorMap tm_k,
                            const __grid_constant__ CUtensorMap tm_v, const Kv kv) {
#if defined(JAX_FLASH_SM90A)
  constexpr int D = Tr::kHeadDim;      // the shared-memory tile's width (64-column panels)
  constexpr int DC = Tr::kComputeDim;  // the columns the tensor cores use (O's accumulators)
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int S = Tr::kStages;
  // 16-byte chunks of an O row (Dv <= D, the tile width; the columns past it are never stored).
  const int dv_chunks = p.head_dim_v / 8;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = base;
  const uint32_t sK = base + Tr::kOffK;
  const uint32_t sV = base + Tr::kOffV;
  const uint32_t sO = Tr::kSeparateO ? base + Tr::kOffO : sQ;  // O's staging for its store
  const uint32_t bars = base + Tr::kOffBars;
  const uint32_t items = base + Tr::kOffItems;  // the work-item ring (int64 item numbers)
  const uint32_t q_full = bars;
  const uint32_t q_empty = bars + 8;
  auto k_full = [&](int s) { return bars + 16 + 8 * s; };
  auto v_full = [&](int s) { return bars + 16 + 8 * (S + s); };
  auto k_empty = [&](int s) { return bars + 16 + 8 * (2 * S + s); };
  auto v_empty = [&](int s) { return bars + 16 + 8 * (3 * S + s); };
  auto item_full = [&](int s) { return bars + 16 + 8 * (4 * S + s); };
  auto item_empty = [&](int s) { return bars + 16 + 8 * (4 * S + Tr::kItemSlots + s); };

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int wg = warp >> 2;

  if (tid == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, Tr::kConsumers);
    for (int s = 0; s < S; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), Tr::kConsumers);
      mbar_init(v_empty(s), Tr::kConsumers);
    }
    if constexpr (kDynamicItems) {
      for (int s = 0; s < Tr::kItemSlots; ++s) {
        mbar_init(item_full(s), 1);
        mbar_init(item_empty(s), 4 * Tr::kConsumers);  // each consumer warp reads the slot
      }
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (warp != 0) return;
    if (lane == 0) {
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
    }
    FlashTileCursor cur{0, 0};
    int stage = 0, phase = 0, q_phase = 0;
    // One K or V tile (key rows row .. row + BN - 1, every panel) into stage st of the ring at
    // `ring`, once both consumer warpgroups have released that buffer (phase ph); full / empty
    // map a stage to its mbarriers (k_full / k_empty or v_full / v_empty).
    auto load_kv = [&](const CUtensorMap* tm, uint32_t ring, auto full, auto empty, int st, int ph,
                       int kv_head, int row) {
      mbar_wait(empty(st), ph ^ 1);
      mbar_arrive_expect_tx(full(st), Tr::kSmemKV);
#pragma unroll
      for (int c = 0; c < Tr::kPanels; ++c)
        tma_load_3d(ring + st * Tr::kSmemKV + c * Tr::kPanelKV, tm, full(st), c * 64, kv_head, row);
    };
    // A paged K or V tile into stage st of the ring: box c (keys n * BN + c * box_rows ...) from
    // pool row `row` of lane c. The warp's lanes find the rows in parallel (one id each) and
    // issue their own box's loads, every panel, once lane 0 has seen the buffer released and
    // armed its mbarrier (a box that lands before the arming only drives the transaction count
    // below zero: the phase needs lane 0's arrival too).
    auto load_kv_paged = [&](const CUtensorMap* tm, uint32_t ring, auto full, auto empty, int st,
                             int ph, int kv_head, int row, int boxes) {
      if constexpr (Kv::kPaged) {
        if (lane == 0) {
          mbar_wait(empty(st), ph ^ 1);
          mbar_arrive_expect_tx(full(st), Tr::kSmemKV);
        }
        __syncwarp();
        if (lane < boxes) {
#pragma unroll
          for (int pc = 0; pc < Tr::kPanels; ++pc)
            tma_load_3d(ring + st * Tr::kSmemKV + pc * Tr::kPanelKV + lane * kv.box_rows * 128, tm,
                        full(st), pc * 64, kv_head, row);
        }
      }
    };
    // Q of work item (ft, head, m0), by one thread.
    auto load_q = [&](const FlashTile& ft, int head, int m0) {
      mbar_wait(q_empty, q_phase ^ 1);
      mbar_arrive_expect_tx(q_full, Tr::kSmemQ);
#pragma unroll
      for (int c = 0; c < Tr::kPanels; ++c)
        tma_load_3d(sQ + c * Tr::kPanelQ, &tm_q, q_full, c * 64, head, ft.ext.q_start + m0);
    };
    // kDynamicItems: the next item, held by lane 0. Its atomic is issued at the top of an item
    // and its value first needed at the top of the next one, under this item's loads.
    int64_t next = blockIdx.x;
    uint32_t handed = 0;
    for (int64_t w = blockIdx.x;; w += gridDim.x) {
      if constexpr (kDynamicItems) {
        w = __shfl_sync(0xffffffffu, next, 0);
        if (lane == 0) next = gridDim.x + static_cast<int64_t>(atomicAdd(p.item_counter, 1ull));
      }
      FlashTile ft;
      int head, m0;
      bool bad;
      const bool more = find_work<BM>(p, kv, w, cur, ft, head, m0, bad);
      if constexpr (kDynamicItems) {
        // Hand w to the consumers (past the last item: their signal to stop).
        const int slot = handed % Tr::kItemSlots;
        if (lane == 0) {
          mbar_wait(item_empty(slot), ((handed / Tr::kItemSlots) & 1) ^ 1);
          asm volatile("atom.shared.exch.b64 _, [%0], %1;\n" ::"r"(items + 8 * slot), "l"(w)
                       : "memory");
          mbar_arrive(item_full(slot));
        }
        ++handed;
      }
      if (!more) break;
      const FlashKeyTiles kt = flash_key_tiles<BM, BN>(p, ft.ext, m0);
      if (bad || kt.n_last < kt.n_first) continue;  // the consumers write NaN / zeros
      if constexpr (Kv::kPaged) {
        const int kv_head = head / (p.num_heads / p.num_heads_k);
        // The whole warp walks the key tiles. A box past the sequence's keys gets a row before
        // the pool's first: TMA fills it with zeros (those keys are masked), and no id past the
        // sequence's pages is read.
        const int boxes = BN / kv.box_rows;
        const int32_t* bt = kv.block_tables + static_cast<int64_t>(ft.b) * kv.max_pages;
        bool first = true;
        for (int n = kt.n_last; n >= kt.n_first; --n) {
          const int key = n * BN + lane * kv.box_rows;
          int row = -kv.box_rows;
          if (lane < boxes && key < ft.ext.k_len)
            row = __ldg(bt + key / kv.page_size) * kv.page_size + key % kv.page_size;
          load_kv_paged(&tm_k, sK, k_full, k_empty, stage, phase, kv_head, row, boxes);
          if (first && lane == 0) load_q(ft, head, m0);  // as below
          first = false;
          load_kv_paged(&tm_v, sV, v_full, v_empty, stage, phase, kv_head, row, boxes);
          if (++stage == S) {
            stage = 0;
            phase ^= 1;
          }
        }
      } else if (lane == 0) {
        const int kv_head = head / (p.num_heads / p.num_heads_k);
        bool first = true;
        for (int n = kt.n_last; n >= kt.n_first; --n) {
          const int row = ft.ext.k_start + n * BN;
          load_kv(&tm_k, sK, k_full, k_empty, stage, phase, kv_head, row);
          if (first) {
            // Q after the first K tile: the K load need not wait for the previous item to
            // release Q (after its last Q K^T; after its epilogue where O is staged in Q).
            load_q(ft, head, m0);
            first = false;
          }
          load_kv(&tm_v, sV, v_full, v_empty, stage, phase, kv_head, row);
          if (++stage == S) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      q_phase ^= 1;
      __syncwarp();
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Tr::kConsumerRegs>();
  const int cw = wg - 1;               // consumer warpgroup: query rows 64 cw .. 64 cw + 63
  const int ctid = tid - 128;          // 0 .. 128 * kConsumers - 1 over the consumers
  const int wtid = tid & 127;          // thread within the warpgroup
  const int g = lane >> 2;             // accumulator row (and +8) within the warp's 16
  const int t = lane & 3;              // accumulator column pair
  const int row_in_tile = 64 * cw + 16 * (warp & 3) + g;  // this thread's first row (second +8)

  const ScoreScale score = score_scale<kSoftcap>(p);
  const float scale_log2 = score.scale_log2, softcap_in = score.softcap_in;

  if constexpr (Tr::kPingPong) {
    // consumer warpgroup 0 takes the first turn (its predecessor hands it over)
    if (cw == Tr::kConsumers - 1) named_arrive(Tr::kPingPongBarrier, 256);
  }
  FlashTileCursor cur{0, 0};
  int stage = 0, phase = 0, q_phase = 0;
  uint32_t taken = 0;
  for (int64_t w = blockIdx.x;; w += gridDim.x) {
    if constexpr (kDynamicItems) {
      // The item the producer picked (each warp reads the slot, then releases its share of it).
      const int slot = taken % Tr::kItemSlots;
      mbar_wait(item_full(slot), (taken / Tr::kItemSlots) & 1);
      // Read by an atomic (the mbarriers order it; racecheck does not see them as barriers).
      if (lane == 0) {
        asm volatile("atom.shared.or.b64 %0, [%1], 0;\n" : "=l"(w) : "r"(items + 8 * slot) : "memory");
        mbar_arrive(item_empty(slot));
      }
      w = __shfl_sync(0xffffffffu, w, 0);
      ++taken;
    }
    FlashTile ft;
    int head, m0;
    bool bad;
    if (!find_work<BM>(p, kv, w, cur, ft, head, m0, bad)) break;
    const SeqExtent e = ft.ext;
    const FlashKeyTiles kt = flash_key_tiles<BM, BN>(p, e, m0);
    T* o_tile = static_cast<T*>(p.o) + static_cast<int64_t>(e.q_start + m0) * p.o_row_stride +
                static_cast<int64_t>(head) * p.head_dim_v;
    // lse: [Hq, total_q], or PagedKv's [batch, Hq, Sq].
    float* lse_tile = nullptr;
    if (p.lse != nullptr) {
      lse_tile = Kv::kPaged
                     ? p.lse + (static_cast<int64_t>(ft.b) * p.num_heads + head) * p.max_seqlen_q + m0
                     : p.lse + static_cast<int64_t>(head) * p.total_q + e.q_start + m0;
    }

    if (bad) {
      // A paged sequence with bad data: o = NaN, lse = NaN on its rows (paged_params.h).
      // 16-bit NaN pairs: 0x7e00 (fp16) / 0x7fc0 (bf16) in both halves.
      const uint32_t nan2 = std::is_same_v<T, __half> ? 0x7e007e00u : 0x7fc07fc0u;
      for (int i = wtid; i < 64 * (D / 8); i += 128) {
        const int r = 64 * cw + i / (D / 8);
        if (m0 + r < e.q_len && (i % (D / 8)) < dv_chunks) {
          *reinterpret_cast<uint4*>(o_tile + static_cast<int64_t>(r) * p.o_row_stride +
                                    (i % (D / 8)) * 8) = make_uint4(nan2, nan2, nan2, nan2);
          if (lse_tile != nullptr && i % (D / 8) == 0) lse_tile[r] = __int_as_float(0x7fc00000);
        }
      }
      continue;
    }

    if (kt.n_last < kt.n_first) {
      // No key visible to any row: o = 0, lse = -inf, written straight from registers.
      for (int i = wtid; i < 64 * (D / 8); i += 128) {
        const int r = 64 * cw + i / (D / 8);
        if (m0 + r < e.q_len && (i % (D / 8)) < dv_chunks) {
          *reinterpret_cast<uint4*>(o_tile + static_cast<int64_t>(r) * p.o_row_stride +
                                    (i % (D / 8)) * 8) = make_uint4(0u, 0u, 0u, 0u);
          if (lse_tile != nullptr && i % (D / 8) == 0) lse_tile[r] = -INFINITY;
        }
      }
      continue;
    }

    float o[DC / 2];
#pragma unroll
    for (int i = 0; i < DC / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};

    mbar_wait(q_full, q_phase);
    const uint32_t q_rows = sQ + 64 * cw * 128;

    // Per key tile n (last to first), software-pipelined so that the softmax of tile n runs
    // while the tensor cores compute O += P V of the previous tile:
    //   issue S = Q K(n)^T; issue O += P(n+1) V(n+1); wait for S; mask + softmax(n) into P;
    //   wait for P V; rescale O (only when a row max grew).
    float s[BN / 2];
    uint32_t pa[BN / 16][4];
    auto issue_s = [&](int st) {
      const uint32_t k_tile = sK + st * Tr::kSmemKV;
#pragma unroll
      for (int k = 0; k < DC / 16; ++k) {
        const uint32_t off = (k % 4) * 32;  // k16 step inside a 64-column panel
        const uint64_t da = smem_desc_sw128(q_rows + (k / 4) * Tr::kPanelQ + off, 16, 1024);
        const uint64_t db = smem_desc_sw128(k_tile + (k / 4) * Tr::kPanelKV + off, 16, 1024);
        Wgmma<T, BN>::ss(s, da, db, k > 0);
      }
      wgmma_commit();
    };
    auto issue_pv = [&](int st) {
      const uint32_t v_tile = sV + st * Tr::kSmemKV;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint64_t db = smem_desc_sw128(v_tile + kk * 16 * 128, Tr::kPanelKV, 1024);
        Wgmma<T, DC>::rs(o, pa[kk], db);
      }
      wgmma_commit();
    };
    // Waits for V(n) in stage st; the first (last in key order) tile can hold rows past the
    // sequence's keys (another sequence's, or zeros past the tensor): they must not reach O, so
    // the consumer warpgroups zero them, then meet.
    auto wait_v = [&](int st, int ph, int n) {
      mbar_wait(v_full(st), ph);
      const int n0 = n * BN;
      if (n == kt.n_last && n0 + BN > e.k_len) {
        const uint32_t v_tile = sV + st * Tr::kSmemKV;
        const int first_row = e.k_len - n0;
        for (int i = ctid; i < (BN - first_row) * Tr::kPanels * 8; i += 128 * Tr::kConsumers) {
          const int r = first_row + i / (Tr::kPanels * 8);
          const int c = i % (Tr::kPanels * 8);
          const uint32_t addr = v_tile + (c / 8) * Tr::kPanelKV + r * 128 + (c % 8) * 16;
          asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u)
                       : "memory");
        }
        fence_proxy_async();
        named_sync(1, 128 * Tr::kConsumers);
      }
    };
    // Soft cap, mask and online softmax of S (key tile n) into P (in s); returns the factor
    // O must be multiplied by per row (1 when no row max grew past the lazy threshold).
    auto softmax = [&](int n, float (&corr)[2]) -> bool {
      const int n0 = n * BN;
      if constexpr (kSoftcap) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] = softcap_tanh(s[i] * softcap_in);
      }
      // Mask (after the soft cap: tanh would turn -inf back into a finite score).
      if (n < kt.mask_below || n >= kt.mask_from) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          int lo, hi;
          visible_keys(p, m0 + row_in_tile + 8 * hf, e.q_len, e.k_len, &lo, &hi);
          lo -= n0 + 2 * t;
          hi -= n0 + 2 * t;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              if (j * 8 + c < lo || j * 8 + c >= hi) s[4 * j + 2 * hf + c] = -INFINITY;
            }
          }
        }
      }
      float mx[2];
      bool grow = false;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float m = -INFINITY;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          m = fmaxf(m, fmaxf(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        mx[hf] = m;
        grow |= m * scale_log2 > row_max[hf] * scale_log2 + kRescaleLog2;
      }
      // Lazy rescale (warp-uniform decision): a row keeps its reference max until a score
      // exceeds it by more than 2^kRescaleLog2 in weight. A row whose reference is still -inf
      // subtracts 0: its weights are exp2(-inf) = 0, never NaN.
      const bool rescale = __any_sync(0xffffffffu, grow);
      corr[0] = corr[1] = 1.f;
      if (rescale) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float m_new = fmaxf(row_max[hf], mx[hf]);
          const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
          corr[hf] = fast_exp2(row_max[hf] * scale_log2 - m_scaled);
          row_max[hf] = m_new;
          row_sum[hf] *= corr[hf];
        }
      }
      float m_scaled[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        m_scaled[hf] = row_max[hf] == -INFINITY ? 0.f : row_max[hf] * scale_log2;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const int hf = (i >> 1) & 1;
        s[i] = fast_exp2(fmaf(s[i], scale_log2, -m_scaled[hf]));
        row_sum[hf] += s[i];
      }
      return rescale;
    };
    auto pack_p = [&]() {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };
    // Ping-pong (round robin) of the consumer warpgroups: each issues its GEMMs only in its turn
    // and then hands the turn to the next, so that the others' softmax runs while one's GEMMs use
    // the tensor cores. (All issue the same number of GEMM groups, so the turns stay in step.)
    auto turn_begin = [&]() {
      if constexpr (Tr::kPingPong) named_sync(Tr::kPingPongBarrier + cw, 256);
    };
    auto turn_end = [&]() {
      if constexpr (Tr::kPingPong)
        named_arrive(Tr::kPingPongBarrier + (cw + 1) % Tr::kConsumers, 256);
    };
    // Register fences keep the compiler from moving accesses of wgmma operands across the
    // issue / wait (each only where that operand is live).
    auto fence_o = [&]() {
#pragma unroll
      for (int i = 0; i < DC / 2; ++i) reg_fence(o[i]);
    };
    auto fence_s = [&]() {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) reg_fence(s[i]);
    };
    auto fence_p = [&]() {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) reg_fence(pa[kk][i]);
    };
    // S = Q K(n)^T from stage st alone (no P V in flight): issue in this warpgroup's turn, wait,
    // and hand the K buffer back to the producer.
    auto gemm_s = [&](int st, int ph) {
      mbar_wait(k_full(st), ph);
      fence_s();
      turn_begin();
      wgmma_fence();
      issue_s(st);
      turn_end();
      wgmma_wait<0>();
      fence_s();
      if (wtid == 0) mbar_arrive(k_empty(st));
    };
    // O += P V(n) from stage st alone (no S in flight), then the V buffer goes back.
    auto gemm_pv = [&](int st, int ph, int n) {
      wait_v(st, ph, n);
      fence_o();
      fence_p();
      turn_begin();
      wgmma_fence();
      issue_pv(st);
      turn_end();
      wgmma_wait<0>();
      fence_o();
      if (wtid == 0) mbar_arrive(v_empty(st));
    };

    // The first key tile: S, softmax (O is still zero: no rescale).
    {
      float corr[2];
      gemm_s(stage, phase);
      softmax(kt.n_last, corr);
      pack_p();
    }
    int v_stage = stage, v_phase = phase, v_n = kt.n_last;
    if (++stage == S) {
      stage = 0;
      phase ^= 1;
    }
    for (int n = kt.n_last - 1; n >= kt.n_first; --n) {
      float corr[2];
      bool rescale;
      if constexpr (Tr::kOverlap) {
        mbar_wait(k_full(stage), phase);
        wait_v(v_stage, v_phase, v_n);
        fence_o();
        fence_p();
        fence_s();
        turn_begin();
        wgmma_fence();
        issue_s(stage);
        issue_pv(v_stage);
        turn_end();
        wgmma_wait<1>();  // S done, P V in flight
        fence_s();
        if (wtid == 0) mbar_arrive(k_empty(stage));
        rescale = softmax(n, corr);
        wgmma_wait<0>();
        fence_o();
        fence_p();
        if (wtid == 0) mbar_arrive(v_empty(v_stage));
      } else {
        // Without the overlap P and S are never live together (fewer registers).
        gemm_pv(v_stage, v_phase, v_n);
        gemm_s(stage, phase);
        rescale = softmax(n, corr);
      }
      if (rescale) {
#pragma unroll
        for (int j = 0; j < DC / 8; ++j) {
          o[4 * j] *= corr[0];
          o[4 * j + 1] *= corr[0];
          o[4 * j + 2] *= corr[1];
          o[4 * j + 3] *= corr[1];
        }
      }
      pack_p();
      v_stage = stage;
      v_phase = phase;
      v_n = n;
      if (++stage == S) {
        stage = 0;
        phase ^= 1;
      }
    }
    // Every Q K^T of the item is done: with O staged elsewhere, Q goes back to the producer now,
    // so that the next item's Q loads under the last P V and the epilogue.
    if constexpr (Tr::kSeparateO) {
      if (wtid == 0) mbar_arrive(q_empty);
    }
    // The last P V.
    gemm_pv(v_stage, v_phase, v_n);

    // Epilogue: normalize, lse, stage O in this warpgroup's rows of the O buffer (or of the Q
    // buffer: its own Q rows, which only it read), then store whole 16-byte chunks of the valid
    // rows.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = row_sum[hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool empty = !(sum > 0.f);
      const float inv = empty ? 0.f : 1.f / sum;
      const int r = row_in_tile + 8 * hf;
      if (t == 0 && lse_tile != nullptr && m0 + r < e.q_len)
        lse_tile[r] = empty ? -INFINITY : (row_max[hf] * scale_log2 + log2f(sum)) * kLn2;
#pragma unroll
      for (int j = 0; j < DC / 8; ++j) {
        const uint32_t v = pack2<T>(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
        const uint32_t addr = sO + (j / 8) * Tr::kPanelQ + r * 128 + (((j % 8) ^ (r % 8)) << 4) + t * 4;
        st_shared_b32(addr, v);
      }
    }
    named_sync(2 + cw, 128);
#pragma unroll
    for (int i = 0; i < 64 * (DC / 8) / 128; ++i) {
      const int idx = wtid + 128 * i;
      const int r = 64 * cw + idx / (DC / 8);
      const int c = idx % (DC / 8);
      if (m0 + r < e.q_len && c < dv_chunks) {
        const uint4 v = ld_shared_v4(sO + (c / 8) * Tr::kPanelQ + r * 128 + (((c % 8) ^ (r % 8)) << 4));
        st_global_v4(o_tile + static_cast<int64_t>(r) * p.o_row_stride + c * 8, v);
      }
    }
    if constexpr (Tr::kSeparateO) {
      named_sync(2 + cw, 128);  // every thread's reads of the O rows before the next item's writes
    } else {
      // The next item's Q arrives by TMA (async proxy) over these rows.
      fence_proxy_async();
      named_sync(2 + cw, 128);
      if (wtid == 0) mbar_arrive(q_empty);
    }
    q_phase ^= 1;
  }
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::hopper
