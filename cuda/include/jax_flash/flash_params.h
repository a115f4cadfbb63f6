// Parameters of one fused prefill-attention call, shared by the CPU and CUDA kernels.
//
// Every call is expressed in the packed ("varlen") form: q, k, v, o hold rows of many sequences
// one after another; sequence b owns q rows [q_starts[b], q_ends[b]) and k/v rows
// [k_starts[b], k_ends[b]). The dense padded API ([B, S, H, D]) is the special case
// q_starts[b] = b*Sq, q_ends[b] = b*Sq + q_len[b]; vmap folds more sequences into the same arrays
// by offsetting the starts. Starts and ends are device data: kernels clamp them into
// [0, total_q] / [0, total_k] so that no value makes them read or write out of bounds.
//
// Masking, for a sequence with sq query rows and sk key rows (bottom-right aligned, as
// FlashAttention >= 2.1): query row i sees key j iff
//     (window_left  < 0 || j >= i + sk - sq - window_left) &&
//     (window_right < 0 || j <= i + sk - sq + window_right).
// Causal attention is window_right = 0. Scores are s = softmax_scale * q.k, then
// s = softcap * tanh(s / softcap) when softcap > 0. A row that sees no key gets o = 0 and
// lse = -inf. Rows of q that belong to no sequence get o = 0 and lse = -inf when
// fill_uncovered is set (the launcher clears them first).
//
// No XLA headers here: the FFI handlers fill this struct, the kernels read it.
#pragma once

#include <cstdint>

#include "jax_flash/dtype.h"

namespace jax_flash {

struct FlashParams {
  const void* q;  // [total_q, num_heads,   head_dim]   dtype
  const void* k;  // [total_k, num_heads_k, head_dim]   dtype
  const void* v;  // [total_k, num_heads_k, head_dim_v] dtype
  void* o;        // [total_q, num_heads,   head_dim_v] dtype
  float* lse;     // [num_heads, total_q] float32, natural log of the softmax denominator

  const int32_t* q_starts;  // [batch] first q row of each sequence
  const int32_t* q_ends;    // [batch] one past its last q row
  const int32_t* k_starts;  // [batch] first k/v row of each sequence
  const int32_t* k_ends;    // [batch] one past its last k/v row

  // Row strides (elements) of the packed tensors; the head stride is head_dim (contiguous).
  int64_t q_row_stride, k_row_stride, v_row_stride, o_row_stride;

  int32_t batch;        // number of sequences
  int32_t total_q;      // rows of q and o
  int32_t total_k;      // rows of k and v
  int32_t max_seqlen_q; // upper bound of any q_ends[b]-q_starts[b] (tiles q; longer rows are
                        // truncated to it and left to fill_uncovered)
  int32_t num_heads;    // query heads Hq
  int32_t num_heads_k;  // key/value heads Hkv, Hq % Hkv == 0; query head h reads kv head
                        // h / (Hq / Hkv)
  int32_t head_dim;     // D of q and k
  int32_t head_dim_v;   // Dv of v and o

  float softmax_scale;
  float softcap;         // 0: off
  int32_t window_left;   // -1: unbounded
  int32_t window_right;  // -1: unbounded; 0 for causal
  bool fill_uncovered;   // set o = 0, lse = -inf on rows no sequence owns
  DType dtype;
  // Hopper prefill only: a counter in device memory, zero at launch, from which the persistent
  // CTAs take their work items after the first (in item order, whichever CTA is free first);
  // nullptr: CTA c takes items c, c + grid, c + 2 grid, ... (policy::flash_hopper_dynamic_items).
  unsigned long long* item_counter = nullptr;
};

// Clamped extent of sequence b. Shared by both kernels so that they agree on what garbage
// starts/ends mean.
struct SeqExtent {
  int32_t q_start, q_len, k_start, k_len;
};

JAX_FLASH_HD int32_t clamp_i32(int32_t x, int32_t lo, int32_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

JAX_FLASH_HD SeqExtent seq_extent(const FlashParams& p, int32_t qs, int32_t qe, int32_t ks,
                                  int32_t ke) {
  SeqExtent e;
  e.q_start = clamp_i32(qs, 0, p.total_q);
  int32_t q_end = clamp_i32(qe, e.q_start, p.total_q);
  e.q_len = q_end - e.q_start;
  if (e.q_len > p.max_seqlen_q) e.q_len = p.max_seqlen_q;
  e.k_start = clamp_i32(ks, 0, p.total_k);
  int32_t k_end = clamp_i32(ke, e.k_start, p.total_k);
  e.k_len = k_end - e.k_start;
  return e;
}

// Visible key range [lo, hi) of query row i (0-based within its sequence). Empty when lo >= hi.
JAX_FLASH_HD void visible_keys(const FlashParams& p, int32_t i, int32_t q_len, int32_t k_len,
                               int32_t* lo, int32_t* hi) {
  // int64: windows up to INT32_MAX must not overflow.
  const int64_t diag = int64_t(i) + k_len - q_len;  // key aligned with row i (bottom-right)
  int64_t l = 0, h = k_len;
  if (p.window_left >= 0 && diag - p.window_left > l) l = diag - p.window_left;
  if (p.window_right >= 0 && diag + p.window_right + 1 < h) h = diag + p.window_right + 1;
  *lo = static_cast<int32_t>(l);
  *hi = static_cast<int32_t>(h < l ? l : h);
}

}  // namespace jax_flash
