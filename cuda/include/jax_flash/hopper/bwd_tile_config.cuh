// Tile shapes and shared-memory layout of the Hopper attention backward
// (flash_bwd_kernel.cuh).
//
// A CTA owns kBlockN = 128 keys of one kv head and has 2 warpgroups, each owning 64 of the keys
// (wgmma's M is 64 per warpgroup) and their dK/dV accumulators. A visit is one query block of
// kBlockM = 64 rows of one query head. No producer warpgroup: a first 384-thread layout spilled
// dK, dV, S^T and dP^T at head dim 128 (168 registers a thread), while 256 threads may use 255.
// (ptxas does allocate up to a setmaxnreg.inc count in code that only the raised warps run, as
// the forward kernel's consumers do, so the limit of that layout is 240 registers a consumer
// thread, where this kernel's D 128 code spills today: NOTES-hopper-bwd.md.)
// Thread 0 issues the loads instead, all by TMA: K/V (once), and the Q/dO tiles and lse/Delta
// rows kStages - 1 visits ahead.
//
// Shared memory (regions 1024-byte aligned, the 128-byte swizzle's period): K and V
// ([kBlockN][head_dim], head_dim / 64 column panels of 128-byte rows, TMA's SWIZZLE_128B), a
// kStages-deep ring of Q and dO tiles (same layout, kBlockM rows), two dS^T buffers
// ([kBlockN keys][kBlockM queries], one 128-byte-swizzled panel: the MN-major A operand of
// dQ = dS K), the float32 staging of dQ's TMA reduce-add (two 128-byte-swizzled boxes of 32
// columns per dQ warpgroup), a kStages ring of lse (log2 units) and Delta rows, then the
// mbarriers.
#pragma once

#include <cstdint>

namespace jax_flash::hopper {

template <int kHeadDim_>
struct HopperBwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;   // query rows per visit
  static constexpr int kBlockN = 128;  // keys per CTA, 64 per consumer warpgroup
  static constexpr int kStages = 3;  // loads run two visits ahead
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * kConsumers;
  // dQ = dS K (64 rows x head_dim) is split by 64-column panels over the consumer warpgroups:
  // both at head_dim 128, the first alone at 64.
  static constexpr int kDqWarpgroups = kHeadDim / 64;
  // Each warp adds its own 16 rows of the staged dQ panel (one lane issues two TMA reduce-adds
  // of 16 x 32 floats) after a warp barrier, instead of one thread per warpgroup adding the
  // whole 64-row panel after a 128-thread barrier. Measured on an H200 (bf16, B4 S4k, 32/8
  // heads, fwd+bwd TFLOP/s, one call): head dim 64 causal 315 -> 323 fast and 191 -> 239
  // deterministic (whose panel was added by atomics: the warpgroup barrier idled the other
  // warpgroup), head dim 128 363 -> 369 / 419 -> 426 deterministic (causal / not), but 441 ->
  // 432 / 505 -> 495 fast: per warp in deterministic mode and at head dim 64. Rows of the
  // reduce-add's box: kDqBoxRows.
  template <bool kDeterministic>
  static constexpr bool kDqReducePerWarp = kDeterministic || kHeadDim == 64;
  template <bool kDeterministic>
  static constexpr int kDqBoxRows = kDqReducePerWarp<kDeterministic> ? 16 : kBlockM;
  // A whole query block's dQ panel goes to the accumulator by TMA reduce-adds from shared
  // memory (else each thread adds its fragment with atomics). Measured on an H100 with one
  // reduce-add per warpgroup (bf16, 1 x 16k causal, 32/8 heads, backward alone): 426 against
  // 390 TFLOP/s at head_dim 128, but 290 against 305 at 64, where one warpgroup computes dQ and
  // the staging's barrier idles the other (per warp there is no such barrier).
  template <bool kDeterministic>
  static constexpr bool kDqReduceTma = kHeadDim >= 128 || kDqReducePerWarp<kDeterministic>;
  // The CTAs take every sequence's key block 0, then every block 1, ... (flash_bwd_cta_tile:
  // longest first under a causal mask) rather than sequence by sequence. Measured on an H200
  // (bf16, B4 S4k causal, 32/8 heads, fwd+bwd TFLOP/s, alternating with the plain order): fast
  // head dim 128 449 -> 458, 64 322 -> 350; deterministic 64 242 -> 266, but 128 372 -> 366
  // (and 433 -> 408 at B1 S16k, where it maps nothing: its scan's code costs that variant).
  template <bool kDeterministic>
  static constexpr bool kLongestFirst = !kDeterministic || kHeadDim == 64;
  // The dV GEMM issued before the dS stores and the dK GEMM after dQ's (fast mode: it runs
  // while dQ is staged for the reduce-add) or with dV (deterministic: both run while the CTA
  // waits for its dQ turn), rather than both after the dS stores. Measured on an H200 (bf16,
  // 32/8 heads, forward + backward, same process alternating with the build before): head dim
  // 128 fast +3.6-5% (B4 S4k causal 386 -> 405 TFLOP/s), deterministic +2.6-2.9%; head dim 64
  // (no staging to overlap) -2% in both modes.
  static constexpr bool kOverlapDkv = kHeadDim >= 128;

  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kPanelQ = kBlockM * 128;  // bytes of one 64-column panel of Q / dO
  static constexpr int kPanelKV = kBlockN * 128;
  static constexpr int kSmemQ = kPanels * kPanelQ;    // one Q or dO stage
  static constexpr int kSmemKV = kPanels * kPanelKV;  // K or V
  static constexpr int kSmemDs = kBlockN * kBlockM * 2;
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kSmemKV;
  static constexpr int kOffQ = kOffV + kSmemKV;
  static constexpr int kOffDo = kOffQ + kStages * kSmemQ;
  static constexpr int kOffDs = kOffDo + kStages * kSmemQ;
  // dQ staging for its TMA reduce-add: per dQ warpgroup a [kBlockM][64] float32 panel as two
  // 128-byte-swizzled boxes of 32 columns (kBlockM rows of 128 bytes each).
  static constexpr int kSmemDqPanel = kBlockM * 64 * 4;
  static constexpr int kOffDq = kOffDs + 2 * kSmemDs;
  // lse (log2 units) and Delta of a visit's rows: one TMA box [2][kRowsBox] from the workspace's
  // [2][heads][rows] tensor. A box's first column must sit 16 bytes into a row (TMA faults on
  // others: illegal instruction), so it starts at the visit's first row rounded down to 4 and
  // takes 4 columns more than kBlockM. Stages kRowsStage floats apart (128-byte aligned, as a
  // TMA destination must be).
  static constexpr int kRowsBox = kBlockM + 4;
  static constexpr int kRowsStage = (2 * kRowsBox * 4 + 127) / 128 * 128 / 4;
  static constexpr int kOffRows = kOffDq + kDqWarpgroups * kSmemDqPanel;
  static constexpr int kOffBars = kOffRows + kStages * kRowsStage * 4;
  // mbarriers (8 bytes each): kv_full, then q_full per stage (a stage is free again once both
  // warpgroups have passed the next visit's dS barrier).
  static constexpr int kNumBars = 1 + kStages;
  static constexpr int kSmemBytes = 1024 /* alignment slack */ + kOffBars + 8 * kNumBars;

  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64, 128");
  static_assert(kBlockM == 64, "a dS^T row is one 128-byte swizzle row (64 queries)");
  static_assert(kBlockN == 64 * kConsumers, "64 keys per consumer warpgroup");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

}  // namespace jax_flash::hopper
