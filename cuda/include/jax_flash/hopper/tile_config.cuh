// Tile shapes and shared-memory layout of the Hopper prefill kernel (flash_fwd_kernel.cuh).
//
// A CTA has 1 + kConsumers warpgroups: warpgroup 0 is the producer (one thread issues every TMA
// load; the warpgroup gives its registers away with setmaxnreg), warpgroups 1.. are consumers,
// each computing 64 of the tile's kBlockM = 64 * kConsumers query rows (wgmma's M is 64 per
// warpgroup).
//
// Shared memory (all regions 1024-byte aligned, the 128-byte swizzle's period): every tile is
// stored as head_dim / 64 column panels of [rows][64] elements, 128 bytes a row, 128-byte
// swizzled (TMA's SWIZZLE_128B, the layout wgmma descriptors read). Q, kStages K tiles,
// kStages V tiles, the O staging buffer (kSeparateO; else O is staged in the Q buffer), then the
// mbarriers, then the work-item ring.
#pragma once

#include <cstdint>

namespace jax_flash::hopper {

template <int kHeadDim_, int kBlockN_, int kStages_, bool kOverlap_, bool kPingPong_ = true,
          int kComputeDim_ = kHeadDim_, int kConsumers_ = 2>
struct HopperTraits {
  static constexpr int kHeadDim = kHeadDim_;
  // The columns the tensor cores use: Q K^T runs kComputeDim / 16 k16 steps and O += P V is a
  // wgmma of N = kComputeDim, O's accumulators kComputeDim / 2 floats per thread. Below
  // kHeadDim (the shared-memory tile's width, whole 64-column panels that TMA fills, zeros past
  // the tensors' widths) it is a narrow variant of that tile: no tensor-core work on the last
  // panel's zero columns.
  static constexpr int kComputeDim = kComputeDim_;
  // Consumer warpgroups (64 query rows each): 2, or 3 (kBlockM = 192) so that two softmaxes run
  // while one warpgroup's GEMMs use the tensor cores (small head dims, few GEMMs per key).
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // Softmax of key tile n under the P V GEMM of tile n + 1 (S, P and O live together).
  static constexpr bool kOverlap = kOverlap_;
  // The consumer warpgroups take turns issuing their GEMMs (named barriers kPingPongBarrier + cw).
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // 128 * 40 + 256 * 232 and 128 * 24 + 384 * 160 registers: at most 64K
  static constexpr int kProducerRegs = kConsumers == 2 ? 40 : 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 232 : 160;
  // Named barriers: 1 all consumers, 2 + cw one consumer warpgroup, kPingPongBarrier + cw the
  // ping-pong turn of warpgroup cw.
  static constexpr int kPingPongBarrier = 2 + kConsumers;

  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kPanelQ = kBlockM * 128;  // bytes of one 64-column panel of Q
  static constexpr int kPanelKV = kBlockN * 128;
  static constexpr int kSmemQ = kPanels * kPanelQ;
  static constexpr int kSmemKV = kPanels * kPanelKV;  // one K or one V stage
  static constexpr int kOffK = kSmemQ;
  static constexpr int kOffV = kOffK + kStages * kSmemKV;
  static constexpr int kOffO = kOffV + kStages * kSmemKV;  // the O buffer (when kSeparateO)
  // mbarriers (8 bytes each): q_full, q_empty, then k_full, v_full, k_empty, v_empty per stage,
  // then item_full, item_empty per slot of the work-item ring.
  static constexpr int kItemSlots = 2;
  static constexpr int kNumBars = 2 + 4 * kStages + 2 * kItemSlots;
  // O is staged for its store in a buffer of its own where shared memory allows (tiles up to
  // 128 wide), so that Q goes back to the producer once the item's last Q K^T is done and the
  // next item's Q loads under this item's last P V and epilogue; else in the Q buffer.
  static constexpr bool kSeparateO =
      1024 + kOffO + kSmemQ + 8 * kNumBars + 8 * kItemSlots <= 227 * 1024;
  static constexpr int kOffBars = kOffO + (kSeparateO ? kSmemQ : 0);
  // The work-item ring: kItemSlots item numbers (int64) the producer hands the consumers.
  static constexpr int kOffItems = kOffBars + 8 * kNumBars;
  static constexpr int kSmemBytes = 1024 /* alignment slack */ + kOffItems + 8 * kItemSlots;

  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dims 64, 128, 192, 256");
  static_assert(kComputeDim % 16 == 0 && kComputeDim <= kHeadDim && kComputeDim > kHeadDim - 64,
                "compute width: a multiple of 16 in the tile's last panel");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N");
  static_assert(kConsumers == 2 || kConsumers == 3, "2 or 3 consumer warpgroups");
  static_assert(kPingPongBarrier + kConsumers <= 16, "named barriers");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

// Tiles per head dim (key tile kBlockN, K/V ring depth): the largest key tile whose
// accumulators fit 240 registers per consumer thread (S: kBlockN / 2, O: head_dim / 2 floats)
// with a 2-deep K/V ring in shared memory. d=256 keeps the softmax / P V overlap although its
// extra live registers (S beside P and O) spill 192 bytes: measured on an H100 (bf16, 2 x 4k
// causal, 32/8 heads) it runs at 605 TFLOP/s against 536 without the overlap.
//
// kConsumers: policy::flash_hopper_consumers (3 on the 64, 80 and 96 tiles); kCausal:
// policy::flash_hopper_causal_tile (the 64 tile's 3-consumer causal calls).
template <int kHeadDim, int kConsumers = 2, bool kCausal = false>
struct HopperDefaultTraits;
template <>
struct HopperDefaultTraits<64> {
  using type = HopperTraits<64, 128, 3, true>;
};
// 192 x 128 tiles: 88 bytes of spills (8 with 2 consumers), no wgmma serialization. Against
// 192 x 96 (faster on causal calls, below; within -3..+3% on full ones) and 192 x 64 with 4
// stages (slower everywhere) on an H100.
template <>
struct HopperDefaultTraits<64, 3> {
  using type = HopperTraits<64, 128, 3, true, true, 64, 3>;
};
// Causal: 192 x 96 tiles in a 4-deep ring (72 bytes of spills), 4-6% faster than 192 x 128 on
// causal calls of 1k-16k rows (policy::flash_hopper_causal_tile).
template <>
struct HopperDefaultTraits<64, 3, true> {
  using type = HopperTraits<64, 96, 4, true, true, 64, 3>;
};
template <>
struct HopperDefaultTraits<128> {
  using type = HopperTraits<128, 128, 2, true>;
};
// max(D, Dv) in (64, 112] (policy::flash_hopper_tile_dim: 80, 96, 112, e.g. Phi-2's 80, Phi-3's
// 96): the 128 tile computing only its first 80 / 96 / 112 columns. Zero-padded on the full 128
// tile they ran at D / 128 of its TFLOP/s (H100, bf16 4 x 4k 32/8, causal: D 80 338, 96 398, 112
// 448 against D 128's 516; benchmarks/results/headdims_*_20261127T1450.json); narrow, 398 / 440
// / 474 against 523 (headdims_prefill_*_20261127T1625.json).
template <>
struct HopperDefaultTraits<80> {
  using type = HopperTraits<128, 128, 2, true, true, 80>;
};
template <>
struct HopperDefaultTraits<96> {
  using type = HopperTraits<128, 128, 2, true, true, 96>;
};
// Long calls (policy::flash_hopper_consumers): 192 x 96 tiles, 2-deep ring (the 192 x 128 ones
// serialize their wgmma for want of registers; a 3-deep ring was slower). Spills: 176-204 bytes
// at 80 columns, 200-224 at 96.
template <>
struct HopperDefaultTraits<80, 3> {
  using type = HopperTraits<128, 96, 2, true, true, 80, 3>;
};
template <>
struct HopperDefaultTraits<96, 3> {
  using type = HopperTraits<128, 96, 2, true, true, 96, 3>;
};
template <>
struct HopperDefaultTraits<112> {
  using type = HopperTraits<128, 128, 2, true, true, 112>;
};
// d=192 (policy::flash_hopper_tile_dim: max(D, Dv) in (128, 192]): 96-key tiles, the largest
// that keeps the overlap within the registers (S 48 + O 96 floats; 88 bytes of spills). Measured
// on an H100 (bf16, 2 x 4k causal, 32/8 heads, D 192): 603 TFLOP/s; 192 x 80 with the overlap
// 584, 192 x 112 without it 538, and the same call zero-padded on the 256 tile (then without
// the overlap) 422.
template <>
struct HopperDefaultTraits<192> {
  using type = HopperTraits<192, 96, 2, true>;
};
template <>
struct HopperDefaultTraits<256> {
  using type = HopperTraits<256, 64, 2, true>;
};

}  // namespace jax_flash::hopper
