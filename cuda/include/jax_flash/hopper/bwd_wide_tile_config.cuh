// Tile shapes and shared-memory layout of the Hopper attention backward for head dims past 128
// (flash_bwd_wide_kernel.cuh; the 256-wide tile, columns past D and Dv zero).
//
// The 128-wide kernel's layout (a warpgroup owns 64 keys and their dK / dV over the whole head
// dim) would hold 2 x 128 accumulators a thread here. Instead a CTA owns kBlockN = 64 keys of one
// kv head, and its 2 warpgroups split the head dim: warpgroup w holds dK and dV of all 64 keys
// for columns 128 w .. 128 w + 127 (64 + 64 floats a thread). A visit is one query block of
// kBlockM = 64 rows of one query head:
//   S = Q K^T and dP = dO V^T, M = the 64 queries, N = this warpgroup's 32 of the keys (16 + 16
//     floats), so each row's lse / Delta is a thread's pair of values;
//   P and dS to shared memory as 16-bit [64 queries][64 keys] tiles, a 256-thread barrier;
//   dV += P^T dO, dK += dS^T Q (A MN-major from the tiles, M = the 64 keys; N = the warpgroup's
//     128 columns of dO / Q, MN-major);
//   dQ = dS K (A K-major, M = queries; N = the warpgroup's 128 columns, two 64-column GEMMs: 64
//     floats), added to the float32 accumulator by TMA reduce-adds, 2 KB a warp at a time (a
//     staging of all 64 KB does not fit beside the rest), staged in the P / dS tiles the visit
//     does not use; per-thread atomics for partial query blocks.
// Thread 0 issues the loads, all by TMA, as in the 128-wide kernel: K / V once, the Q / dO tiles
// and lse / Delta rows a visit ahead.
//
// Shared memory (regions 1024-byte aligned): K and V ([kBlockN][256], four 64-column panels of
// 128-byte rows, SWIZZLE_128B), a kStages ring of Q and dO tiles (same layout, kBlockM rows), two
// P and two dS tiles ([kBlockM][kBlockN] 16-bit: one 128-byte-swizzled panel), a kStages ring of
// lse (log2 units) and Delta rows, then the mbarriers: 226 KB.
#pragma once

#include <cstdint>

namespace jax_flash::hopper {

struct HopperBwdWideTraits {
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockM = 64;  // query rows per visit
  static constexpr int kBlockN = 64;  // keys per CTA, 32 per warpgroup in S / dP
  static constexpr int kStages = 2;   // loads run a visit ahead
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * kConsumers;
  static constexpr int kKeysPerWarpgroup = kBlockN / kConsumers;  // of S and dP
  static constexpr int kColsPerWarpgroup = kHeadDim / kConsumers;  // of dK, dV and dQ
  // dQ's reduce-adds: a warp's 16 rows x 32 columns a box.
  static constexpr int kDqBoxRows = 16;

  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kPanelQ = kBlockM * 128;  // bytes of one 64-column panel of Q / dO
  static constexpr int kPanelKV = kBlockN * 128;
  static constexpr int kSmemQ = kPanels * kPanelQ;    // one Q or dO stage
  static constexpr int kSmemKV = kPanels * kPanelKV;  // K or V
  static constexpr int kSmemPs = kBlockM * kBlockN * 2;  // one P or dS tile
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kSmemKV;
  static constexpr int kOffQ = kOffV + kSmemKV;
  static constexpr int kOffDo = kOffQ + kStages * kSmemQ;
  static constexpr int kOffP = kOffDo + kStages * kSmemQ;
  static constexpr int kOffDs = kOffP + 2 * kSmemPs;
  // lse (log2 units) and Delta of a visit's rows, as in HopperBwdTraits: one TMA box [2][kRowsBox]
  // from the 16-byte aligned row at or before the visit's first.
  static constexpr int kRowsBox = kBlockM + 4;
  static constexpr int kRowsStage = (2 * kRowsBox * 4 + 127) / 128 * 128 / 4;
  static constexpr int kOffRows = kOffDs + 2 * kSmemPs;
  static constexpr int kOffBars = kOffRows + kStages * kRowsStage * 4;
  // mbarriers (8 bytes each): kv_full, then q_full per stage.
  static constexpr int kNumBars = 1 + kStages;
  static constexpr int kSmemBytes = 1024 /* alignment slack */ + kOffBars + 8 * kNumBars;

  static_assert(kBlockM == 64 && kBlockN == 64, "a P / dS row is one 128-byte swizzle row");
  static_assert(kKeysPerWarpgroup == 32 && kColsPerWarpgroup == 128, "the GEMM shapes below");
  static_assert(kDqBoxRows * 4 == kBlockM, "a warp's rows of the block (the staging band)");
  static_assert(kOffRows % 1024 == 0, "1024-aligned regions");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

}  // namespace jax_flash::hopper
