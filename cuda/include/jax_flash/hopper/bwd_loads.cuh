// The loads both Hopper attention backward kernels share (flash_bwd_kernel.cuh for the 64- and
// 128-wide tiles, flash_bwd_wide_kernel.cuh for the 256-wide one), over the part of their
// shared-memory layouts they have in common (Tr: HopperBwdTraits or HopperBwdWideTraits): K and
// V ([kBlockN][256 or 128 or 64], 64-column panels of 128-byte rows), a kStages ring of Q and dO
// tiles, a kStages ring of lse (log2 units) and Delta rows, and the mbarriers (kv_full, then
// q_full per stage).
//
// All loads are TMA loads issued by one thread: K / V once, and each visit's Q / dO tiles and
// lse / Delta rows kStages - 1 visits ahead, so that no thread waits for a global load in the
// visit loop. Rows past a length arrive as whatever TMA brings (another sequence's rows, or
// zeros past the tensors); zero_partial_kv / zero_partial_visit overwrite them.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "jax_flash/flash_attention_bwd_common.cuh"
#include "jax_flash/hopper/ptx.cuh"

namespace jax_flash::hopper {

// Zeroes rows [first_row, rows) of a tile of `panels` 64-column panels of `rows` 128-byte rows
// (panel stride `panel_bytes`), the CTA's 256 threads together (ctid 0..255).
__device__ __forceinline__ void zero_tile_rows(uint32_t tile, int panels, int panel_bytes,
                                               int rows, int first_row, int ctid) {
  for (int i = ctid; i < (rows - first_row) * panels * 8; i += 256) {
    const int r = first_row + i / (panels * 8);
    const int c = i % (panels * 8);
    const uint32_t addr = tile + (c / 8) * panel_bytes + r * 128 + (c % 8) * 16;
    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
  }
}

#if defined(JAX_FLASH_SM90A)  // the PTX wrappers it uses exist in the sm_90a pass only

template <class Tr>
struct BwdLoads {
  uint32_t sK, sV, sQ, sdO;  // shared-memory addresses of the regions
  float* s_rows;             // [kStages][kRowsStage]: per stage Delta, then lse (log2 units)
  uint32_t bars;
  const CUtensorMap *tm_q, *tm_k, *tm_v, *tm_do, *tm_rows;
  const FlashBwdVisits* v;
  int kv_head;

  __device__ __forceinline__ uint32_t kv_full() const { return bars; }
  __device__ __forceinline__ uint32_t q_full(int s) const { return bars + 8 + 8 * s; }

  // One thread, before a CTA barrier: every barrier expects one arrival (the issuing thread's,
  // with the stage's TMA bytes).
  __device__ __forceinline__ void init_barriers() const {
    mbar_init(kv_full(), 1);
    for (int s = 0; s < Tr::kStages; ++s) mbar_init(q_full(s), 1);
    mbar_fence_init();
  }

  // The loads of visit `it` into stage it % kStages: Q and dO tiles, and the visit's rows of lse
  // (log2 units, +inf where it is -inf: weights exp2(-inf) = 0; the workspace's lse_log2,
  // written with Delta) and Delta, in one box from the 16-byte aligned row at or before the
  // first (a box must start 16 bytes into a row).
  __device__ __forceinline__ void issue_visit(int it) const {
    const int st = it % Tr::kStages;
    int h, m;
    flash_bwd_visit(*v, kv_head, it, &h, &m);
    const int row = v->kt.ext.q_start + m * Tr::kBlockM;
    mbar_arrive_expect_tx(q_full(st), 2 * Tr::kSmemQ + 2 * Tr::kRowsBox * 4);
#pragma unroll
    for (int c = 0; c < Tr::kPanels; ++c) {
      tma_load_3d(sQ + st * Tr::kSmemQ + c * Tr::kPanelQ, tm_q, q_full(st), c * 64, h, row);
      tma_load_3d(sdO + st * Tr::kSmemQ + c * Tr::kPanelQ, tm_do, q_full(st), c * 64, h, row);
    }
    tma_load_3d(smem_u32(s_rows + st * Tr::kRowsStage), tm_rows, q_full(st), row & ~3, h, 0);
  }

  // One thread: the descriptors prefetched, K and V of the key block, and the first
  // kStages - 1 visits' loads.
  __device__ __forceinline__ void issue_first() const {
    tma_prefetch_desc(tm_q);
    tma_prefetch_desc(tm_k);
    tma_prefetch_desc(tm_v);
    tma_prefetch_desc(tm_do);
    tma_prefetch_desc(tm_rows);
    mbar_arrive_expect_tx(kv_full(), 2 * Tr::kSmemKV);
    const int key_row = v->kt.ext.k_start + v->n0;
#pragma unroll
    for (int c = 0; c < Tr::kPanels; ++c) {
      tma_load_3d(sK + c * Tr::kPanelKV, tm_k, kv_full(), c * 64, kv_head, key_row);
      tma_load_3d(sV + c * Tr::kPanelKV, tm_v, kv_full(), c * 64, kv_head, key_row);
    }
    for (int it = 0; it < Tr::kStages - 1 && it < v->items; ++it) issue_visit(it);
  }

  // The CTA's 256 threads, once K / V have landed: K and V rows past the key length zeroed (so
  // that no non-finite value there meets a zero weight), then a CTA barrier.
  __device__ __forceinline__ void zero_partial_kv(int ctid) const {
    if (v->n0 + Tr::kBlockN > v->k_len) {
      zero_tile_rows(sK, Tr::kPanels, Tr::kPanelKV, Tr::kBlockN, v->k_len - v->n0, ctid);
      zero_tile_rows(sV, Tr::kPanels, Tr::kPanelKV, Tr::kBlockN, v->k_len - v->n0, ctid);
      fence_proxy_async();
      named_sync(1, 256);
    }
  }

  // The CTA's 256 threads, once a visit's stage has landed: with rows < kBlockM (the sequence's
  // last, partial query block), its Q / dO rows past the sequence zeroed, their lse +inf (weight
  // 0) and Delta 0, whatever TMA brought, then a CTA barrier.
  __device__ __forceinline__ void zero_partial_visit(uint32_t q_st, uint32_t do_st, float* lse_st,
                                                     float* delta_st, int rows, int ctid) const {
    if (rows < Tr::kBlockM) {
      zero_tile_rows(q_st, Tr::kPanels, Tr::kPanelQ, Tr::kBlockM, rows, ctid);
      zero_tile_rows(do_st, Tr::kPanels, Tr::kPanelQ, Tr::kBlockM, rows, ctid);
      for (int r = rows + ctid; r < Tr::kBlockM; r += 256) {
        lse_st[r] = INFINITY;
        delta_st[r] = 0.f;
      }
      fence_proxy_async();
      named_sync(1, 256);
    }
  }
};

#endif  // JAX_FLASH_SM90A

}  // namespace jax_flash::hopper
