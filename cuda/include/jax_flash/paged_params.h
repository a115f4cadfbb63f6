// Parameters of the paged KV-cache operations, shared by the CPU and CUDA kernels:
// paged decode attention, the cache write (append_kv) and page copies (copy_pages).
//
// Cache layout ("NHD", as vLLM's flash layout and FlashInfer):
//   k_pages [num_pages, page_size, Hkv, D], v_pages [num_pages, page_size, Hkv, Dv]
// Token t of sequence b lives in page block_tables[b, t / page_size] at offset t % page_size.
// Slot s (append_kv) is page s / page_size, offset s % page_size.
//
// Quantized caches (int8 or float8 e4m3) store x / scale; the float32 scale is either one per KV
// head (k_scale [Hkv], given by the user, read by append and attention) or one per token and
// head (k_scale [num_pages, page_size, Hkv], written by append as amax / qmax, read by
// attention). qmax = 127 (int8), 448 (e4m3). Attention dequantises on the fly: x = q * scale.
// Quantisation, bit-exact across CPU, CUDA and the jnp reference: with x the input value in float32
// and scale the float32 scale, y = x / scale (IEEE division), clamped to [-qmax, qmax], then
// int8: round half to even; e4m3: round to nearest even. Per-token scale = amax / qmax (IEEE
// division) with amax = max |x| over the head's D (or Dv) values; amax == 0 gives scale 0 and
// stored zeros (no 0/0). A per-head scale of 0 likewise stores zeros.
//
// Attention semantics per sequence b, with q_len = Sq and k_len = kv_lens[b] (bottom-right
// aligned, as flash_params.h: query row i sits at position k_len - Sq + i):
//   row i sees key j iff (window_left < 0 || j >= i + k_len - Sq - window_left) &&
//                        (window_right < 0 || j <= i + k_len - Sq + window_right)
// causal = window_right 0. Scores s = softmax_scale * q.k, softcap as flash_params.h.
// Rows that see no key: o = 0, lse = -inf. kv_lens[b] == 0 gives zeros.
//
// Bad device data never leads to an out-of-bounds access. A sequence whose kv_lens[b] is < 0 or
// > max_pages * page_size, or whose first ceil(kv_lens[b] / page_size) block-table entries hold
// an id outside [0, num_pages), gets o = NaN and lse = NaN on every row and head (an error
// signal that cannot be mistaken for a result); no page is read through an invalid id.
// append_kv skips slots < 0 or >= num_pages * page_size; copy_pages skips pairs with an id
// out of range.
#pragma once

#include <cstdint>

#include "jax_flash/dtype.h"  // DType, JAX_FLASH_HD

namespace jax_flash {

// Element type of the cache pages.
enum class CacheDType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt8 = 3,
  kFloat8E4M3 = 4,
};

enum class ScaleMode : int32_t {
  kNone = 0,      // unquantized cache (float32/float16/bfloat16 pages, same dtype as q)
  kPerHead = 1,   // scale [Hkv]
  kPerToken = 2,  // scale [num_pages, page_size, Hkv]
};

// Which CUDA kernel runs a paged_attention call (the CPU kernel has one).
enum class PagedKernel : uint8_t {
  kAuto = 0,        // the tensor-core kernel where it supports the call, else the CUDA-core one
  kCudaCore = 1,    // the CUDA-core kernel
  kTensorCore = 2,  // the tensor-core kernel; a call it does not support is an error
};

// How the CUDA launchers run a call (no effect on the result, except `merge`): fields of the
// call, set from the FFI attributes (jax_flash/primitives/paged_attention.py), so that one
// process can run both kernels. The defaults are the library's choices. 4 bytes, which fit the
// tail padding of PagedAttentionParams: the kernels' parameter layout stays as it was.
struct PagedLaunch {
  PagedKernel kernel = PagedKernel::kAuto;
  bool pdl = true;        // the tensor-core kernel as a programmatic dependent launch (sm_90+)
  bool merge_pdl = true;  // the split-KV merge as a programmatic dependent launch (sm_90+)
  bool merge = true;      // launch the split-KV merge (off: the partials stay unmerged, o and
                          // lse unwritten; only to time the attention grid alone)
};

struct PagedAttentionParams {
  const void* q;       // [B, Sq, Hq, D]        dtype (float32 | float16 | bfloat16)
  const void* k_pages; // [num_pages, page_size, Hkv, D]  cache_dtype
  const void* v_pages; // [num_pages, page_size, Hkv, Dv] cache_dtype
  const float* k_scale;  // null (kNone) | [Hkv] | [num_pages, page_size, Hkv]
  const float* v_scale;  // same shape as k_scale
  const int32_t* block_tables;  // [B, max_pages]
  const int32_t* kv_lens;       // [B]
  void* o;                      // [B, Sq, Hq, Dv] dtype
  float* lse;                   // [B, Hq, Sq] float32, natural log
  // Split-KV scratch, used when num_splits > 1 (XLA-allocated outputs, never cudaMalloc):
  float* o_partial;    // [num_splits, B, Sq, Hq, Dv] float32: each split's own softmax-normalised
                       // output over its keys (0 for an empty split)
  float* lse_partial;  // [num_splits, B, Hq, Sq] float32: each split's LSE (-inf when it sees no
                       // key, NaN for a sequence with bad data). Merge: lse = log sum_i
                       // exp(lse_i), o = sum_i exp(lse_i - lse) o_i; all -inf -> o = 0,
                       // lse = -inf; any NaN -> o = NaN, lse = NaN.

  int32_t batch;
  int32_t seqlen_q;     // Sq >= 1
  int32_t num_heads;    // Hq
  int32_t num_heads_k;  // Hkv, Hq % Hkv == 0; query head h reads kv head h / (Hq / Hkv)
  int32_t head_dim;     // D
  int32_t head_dim_v;   // Dv
  int32_t num_pages;
  int32_t page_size;    // any >= 1
  int32_t max_pages;    // columns of block_tables
  int32_t num_splits;   // >= 1: the KV range [0, k_len) of every sequence is cut into num_splits
                        // contiguous chunks of ceil(k_len / num_splits) keys (rounded up to
                        // whole pages); each chunk is attended separately and merged by LSE.
                        // The result is a deterministic function of the inputs and num_splits.

  float softmax_scale;
  float softcap;        // 0: off
  int32_t window_left;  // -1: unbounded
  int32_t window_right; // -1: unbounded; 0: causal
  DType dtype;          // of q and o
  CacheDType cache_dtype;
  ScaleMode scale_mode;
  PagedLaunch launch;   // last (in the tail padding); the kernels never read it
};

static_assert(sizeof(PagedLaunch) == 4, "PagedLaunch must fit the tail padding");

struct AppendKVParams {
  const void* k_new;           // [T, Hkv, D]  dtype
  const void* v_new;           // [T, Hkv, Dv] dtype
  const int32_t* slot_mapping; // [T]: page * page_size + offset; skipped when out of range
  void* k_pages;               // [num_pages, page_size, Hkv, D]  cache_dtype, written in place
  void* v_pages;               // [num_pages, page_size, Hkv, Dv] cache_dtype, written in place
  float* k_scale;  // kPerHead: [Hkv] read; kPerToken: [num_pages, page_size, Hkv] written
  float* v_scale;
  int32_t num_tokens;  // T
  int32_t num_heads_k;
  int32_t head_dim;
  int32_t head_dim_v;
  int32_t num_pages;
  int32_t page_size;
  DType dtype;  // of k_new / v_new
  CacheDType cache_dtype;
  ScaleMode scale_mode;
};

struct CopyPagesParams {
  void* k_pages;  // [num_pages, page_size, Hkv, D]  in place
  void* v_pages;  // [num_pages, page_size, Hkv, Dv] in place
  float* k_scale; // null, or per-token scales [num_pages, page_size, Hkv] copied along
  float* v_scale;
  const int32_t* src;  // [N] page ids
  const int32_t* dst;  // [N] page ids; pairs with an id outside [0, num_pages) are skipped.
                       // Destinations must be distinct and not also sources (else the result
                       // depends on the order of copies).
  int32_t num_copies;  // N
  int64_t page_bytes_k;  // bytes of one K page (page_size * Hkv * D * sizeof(cache elem))
  int64_t page_bytes_v;
  int32_t scale_per_page;  // floats of per-token scale per page (page_size * Hkv), 0 if none
  int32_t num_pages;
};

inline int32_t cache_elem_bytes(CacheDType t) {
  switch (t) {
    case CacheDType::kFloat32: return 4;
    case CacheDType::kFloat16:
    case CacheDType::kBFloat16: return 2;
    default: return 1;
  }
}

// Key range [begin, end) of split `split` for a sequence of k_len keys (whole pages per split).
JAX_FLASH_HD void split_range(int32_t k_len, int32_t page_size, int32_t num_splits, int32_t split,
                              int32_t* begin, int32_t* end) {
  const int32_t pages = (k_len + page_size - 1) / page_size;
  const int32_t pages_per_split = (pages + num_splits - 1) / num_splits;
  int64_t b = int64_t(split) * pages_per_split * page_size;
  int64_t e = b + int64_t(pages_per_split) * page_size;
  if (b > k_len) b = k_len;
  if (e > k_len) e = k_len;
  *begin = static_cast<int32_t>(b);
  *end = static_cast<int32_t>(e);
}

}  // namespace jax_flash
