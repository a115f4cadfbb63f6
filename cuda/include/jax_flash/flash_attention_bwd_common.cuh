// Pieces shared by the CUDA attention-backward kernels (tensor-core and SIMT): the layout of the
// launcher's workspace, the preprocessing step Delta = rowsum(dO * O) - dLSE, the float32 dQ
// accumulator's conversion, the steps around a tensor-core backward kernel, the mapping of a
// linear key-tile index onto (sequence, key block) for packed calls, a key tile's visits of
// query tiles, the mask band and the deterministic mode's turn wait. See flash_bwd_params.h for
// the contract. No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/flash_bwd_params.h"
#include "jax_flash/launch.cuh"
#include "jax_flash/softmax.cuh"  // kLog2e

namespace jax_flash {

// ---------------------------------------------------------------------------------------------
// Workspace (device scratch from the FFI handler, asked 16-byte aligned: the most XLA's FFI
// allocator accepts; its allocations are 256-byte aligned in practice),
// at offsets that are multiples of 256 bytes:
//   delta     [num_heads, row_stride]              float32   every path
//   lse_log2  [num_heads, row_stride]              float32   tensor-core path, right after delta
//             (no gap: a head's Delta and lse rows are one [2][num_heads][row_stride] tensor, of
//             which the Hopper kernel loads both rows of a visit by one TMA box): the forward's
//             lse in log2 units, +inf where it is -inf (such rows get weight exp2(-inf) = 0),
//             written with Delta
//   dq_accum  [total_q, num_heads, head_dim]       float32   tensor-core path (atomics target)
//   dq_turn   [num_heads, q_tile_slots]            int32     tensor-core deterministic path:
//             how many key blocks have added their dQ share to each (head, query tile)
// row_stride: total_q on the SIMT path, total_q rounded up to 4 on the tensor-core paths (every
// row then starts 16-byte aligned, as TMA's strides must be).
// ---------------------------------------------------------------------------------------------

struct FlashBwdWorkspace {
  float* delta;
  float* dq_accum;
  float* lse_log2;
  int32_t* dq_turn;
  int64_t q_tile_slots;  // entries of dq_turn per head
  int64_t row_stride;    // entries of delta and lse_log2 per head
};

inline int64_t flash_bwd_align256(int64_t n) { return (n + 255) / 256 * 256; }

// Entries per head of delta and lse_log2 for a path (q_block 0: the SIMT path).
inline int64_t flash_bwd_row_stride(const FlashParams& p, int32_t q_block) {
  return q_block > 0 ? (int64_t{p.total_q} + 3) / 4 * 4 : p.total_q;
}

// Bytes of delta (and lse_log2 after it, on a tensor-core path).
inline int64_t flash_bwd_rows_bytes(const FlashParams& p, int32_t q_block) {
  return int64_t{4} * (q_block > 0 ? 2 : 1) * p.num_heads * flash_bwd_row_stride(p, q_block);
}

// Bytes of workspace the launcher of one path needs (`q_block` is its query tile; 0 for a path
// without a dQ accumulator).
inline int64_t flash_bwd_workspace_bytes(const FlashParams& p, int32_t q_block,
                                         bool deterministic) {
  int64_t bytes = flash_bwd_align256(flash_bwd_rows_bytes(p, q_block));
  if (q_block > 0) {
    bytes += flash_bwd_align256(int64_t{4} * p.total_q * p.num_heads * p.head_dim);
    if (deterministic) bytes += flash_bwd_align256(int64_t{4} * p.num_heads *
                                                   flash_num_tile_slots(p, q_block));
  }
  return bytes;
}

inline FlashBwdWorkspace flash_bwd_workspace(const FlashBwdParams& p, int32_t q_block) {
  const FlashParams& f = p.fwd;
  char* base = static_cast<char*>(p.workspace);
  FlashBwdWorkspace w{};
  w.row_stride = flash_bwd_row_stride(f, q_block);
  w.delta = reinterpret_cast<float*>(base);
  base += flash_bwd_align256(flash_bwd_rows_bytes(f, q_block));
  if (q_block > 0) {
    w.lse_log2 = w.delta + int64_t{f.num_heads} * w.row_stride;
    w.dq_accum = reinterpret_cast<float*>(base);
    base += flash_bwd_align256(int64_t{4} * f.total_q * f.num_heads * f.head_dim);
    if (p.deterministic) {
      w.dq_turn = reinterpret_cast<int32_t*>(base);
      w.q_tile_slots = flash_num_tile_slots(f, q_block);
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------------
// Delta = rowsum(dO * O) - dLSE, for every row of q (owned or not: the kernels read it only for
// owned rows) and every head, and (lse_log2 not null) the lse in log2 units. One warp per (row,
// head).
// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(256) flash_bwd_delta_kernel(const __grid_constant__ FlashBwdParams p,
                                                              float* __restrict__ delta,
                                                              float* __restrict__ lse_log2,
                                                              int64_t row_stride) {
  const FlashParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(f.total_q) * f.num_heads;
  const T* o = static_cast<const T*>(f.o);
  const T* dout = static_cast<const T*>(p.dout);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t row = i / f.num_heads;
    const int head = static_cast<int>(i % f.num_heads);
    const T* orow = o + row * f.o_row_stride + static_cast<int64_t>(head) * f.head_dim_v;
    const T* drow = dout + row * p.dout_row_stride + static_cast<int64_t>(head) * f.head_dim_v;
    float acc = 0.f;
    for (int d = lane; d < f.head_dim_v; d += 32) acc += to_float(orow[d]) * to_float(drow[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
      const int64_t at = static_cast<int64_t>(head) * f.total_q + row;  // lse, dlse
      const int64_t out = static_cast<int64_t>(head) * row_stride + row;
      delta[out] = acc - p.dlse[at];
      if (lse_log2 != nullptr) {
        const float l = f.lse[at];
        lse_log2[out] = l == -INFINITY ? INFINITY : l * kLog2e;
      }
    }
  }
}

template <typename T>
cudaError_t flash_bwd_delta(const FlashBwdParams& p, const FlashBwdWorkspace& ws,
                            cudaStream_t stream) {
  const int64_t warps = static_cast<int64_t>(p.fwd.total_q) * p.fwd.num_heads;
  if (warps <= 0) return cudaSuccess;
  const int64_t blocks = (warps + 7) / 8 < 65536 ? (warps + 7) / 8 : 65536;
  flash_bwd_delta_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      p, ws.delta, ws.lse_log2, ws.row_stride);
  return cudaGetLastError();
}

// What both tensor-core backwards (mma.sync and Hopper) need of a call besides its head dims:
// dtype float16 or bfloat16, Hq a multiple of Hkv, every tensor 16-byte aligned with row
// strides a multiple of 8 elements (16-byte loads and TMA's 16-byte strides), finite scale and
// soft cap.
inline bool flash_bwd_tensor_core_layout_supported(const FlashBwdParams& p) {
  const FlashParams& f = p.fwd;
  if (f.dtype != DType::kFloat16 && f.dtype != DType::kBFloat16) return false;
  if (f.num_heads < 1 || f.num_heads_k < 1 || f.num_heads % f.num_heads_k != 0) return false;
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned16(f.q) || !aligned16(f.k) || !aligned16(f.v) || !aligned16(p.dout) ||
      !aligned16(p.dq) || !aligned16(p.dk) || !aligned16(p.dv))
    return false;
  if (f.q_row_stride % 8 != 0 || f.k_row_stride % 8 != 0 || f.v_row_stride % 8 != 0 ||
      p.dout_row_stride % 8 != 0 || p.dq_row_stride % 8 != 0 || p.dk_row_stride % 8 != 0 ||
      p.dv_row_stride % 8 != 0)
    return false;
  return std::isfinite(f.softmax_scale) && std::isfinite(f.softcap);
}

// ---------------------------------------------------------------------------------------------
// dq = softmax_scale * dq_accum over all rows (rows no sequence owns hold 0 in the accumulator).
// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(256) flash_bwd_dq_convert_kernel(const __grid_constant__ FlashBwdParams p,
                                                                   const float* __restrict__ acc) {
  const FlashParams& f = p.fwd;
  const int64_t row_elems = static_cast<int64_t>(f.num_heads) * f.head_dim;
  const int64_t n4 = static_cast<int64_t>(f.total_q) * row_elems / 4;  // head_dim % 4 == 0
  T* dq = static_cast<T*>(p.dq);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(acc)[i];
    const int64_t e = 4 * i;
    const int64_t row = e / row_elems;
    const float s = f.softmax_scale;
    store4_from_float<T>(dq + row * p.dq_row_stride + (e - row * row_elems), a.x * s, a.y * s,
                         a.z * s, a.w * s);
  }
}

template <typename T>
cudaError_t flash_bwd_dq_convert(const FlashBwdParams& p, const float* acc, cudaStream_t stream) {
  const int64_t n4 = static_cast<int64_t>(p.fwd.total_q) * p.fwd.num_heads * p.fwd.head_dim / 4;
  if (n4 <= 0) return cudaSuccess;
  const int64_t blocks = (n4 + 255) / 256 < 65536 ? (n4 + 255) / 256 : 65536;
  flash_bwd_dq_convert_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, acc);
  return cudaGetLastError();
}

// The steps of a tensor-core backward (mma.sync and Hopper kernels) around its kernel: zero dk,
// dv, the dQ accumulator and (deterministic mode) the turn counters, compute Delta, call
// launch(ws, softcap, deterministic) when some sequence has rows (the two flags as
// std::integral_constant: decltype(flag)::value picks the kernel variant), then convert dQ from
// the accumulator. The workspace holds query tiles of q_block rows (flash_bwd_workspace_bytes).
// Asynchronous on `stream`.
template <typename T, typename Launch>
cudaError_t run_flash_bwd_accumulated(const FlashBwdParams& p, int32_t q_block,
                                      cudaStream_t stream, Launch&& launch) {
  const FlashParams& f = p.fwd;
  const FlashBwdWorkspace ws = flash_bwd_workspace(p, q_block);
  const size_t dk_bytes = static_cast<size_t>(f.total_k) * p.dk_row_stride * sizeof(T);
  const size_t dv_bytes = static_cast<size_t>(f.total_k) * p.dv_row_stride * sizeof(T);
  cudaError_t err = cudaMemsetAsync(p.dk, 0, dk_bytes, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(p.dv, 0, dv_bytes, stream);
  if (err == cudaSuccess)
    err = cudaMemsetAsync(ws.dq_accum, 0,
                          sizeof(float) * static_cast<size_t>(f.total_q) * f.num_heads * f.head_dim,
                          stream);
  if (err == cudaSuccess && p.deterministic)
    err = cudaMemsetAsync(ws.dq_turn, 0,
                          sizeof(int32_t) * static_cast<size_t>(f.num_heads) * ws.q_tile_slots,
                          stream);
  if (err == cudaSuccess) err = flash_bwd_delta<T>(p, ws, stream);
  if (err == cudaSuccess && f.batch > 0 && f.total_q > 0 && f.total_k > 0) {
    err = dispatch_bool(f.softcap > 0.f, [&](auto softcap) {
      return dispatch_bool(p.deterministic,
                           [&](auto deterministic) { return launch(ws, softcap, deterministic); });
    });
  }
  if (err == cudaSuccess) err = flash_bwd_dq_convert<T>(p, ws.dq_accum, stream);
  return err;
}

// ---------------------------------------------------------------------------------------------
// Key-tile scheduling: sequence b owns ceil(k_len_b / block_n) consecutive tiles, numbered
// sequence by sequence. A whole warp finds tile `tile`'s sequence and key block, and the number
// of query tiles (of block_m rows) of the sequences before it (the deterministic path numbers
// its dQ turn counters by query tile). Returns false past the last tile.
// ---------------------------------------------------------------------------------------------

struct FlashKeyTile {
  int32_t b, n;          // sequence, key block within it
  int64_t q_tile_base;   // query tiles of sequences [0, b)
  SeqExtent ext;
};

__device__ __forceinline__ bool flash_find_key_tile(const FlashParams& p, int32_t block_n,
                                                    int32_t block_m, int64_t tile,
                                                    FlashKeyTile* out) {
  const int lane = threadIdx.x & 31;
  int64_t before = 0, q_before = 0;
  for (int base = 0; base < p.batch; base += 32) {
    const int b = base + lane;
    SeqExtent e{0, 0, 0, 0};
    int64_t n = 0, nq = 0;
    if (b < p.batch) {
      e = flash_seq_extent_at(p, b);
      n = e.k_len > 0 ? (e.k_len + block_n - 1) / block_n : 0;
      nq = flash_num_q_tiles(e, block_m);
    }
    int64_t incl = n, q_incl = nq;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t v = __shfl_up_sync(0xffffffffu, incl, off);
      const int64_t vq = __shfl_up_sync(0xffffffffu, q_incl, off);
      if (lane >= off) {
        incl += v;
        q_incl += vq;
      }
    }
    const int64_t total = __shfl_sync(0xffffffffu, incl, 31);
    if (tile < before + total) {
      const int64_t local = tile - before;
      const unsigned hit = __ballot_sync(0xffffffffu, local < incl && local >= incl - n);
      const int src = __ffs(static_cast<int>(hit)) - 1;
      out->b = base + src;
      out->n = static_cast<int32_t>(local - __shfl_sync(0xffffffffu, incl - n, src));
      out->q_tile_base = q_before + __shfl_sync(0xffffffffu, q_incl - nq, src);
      out->ext.q_start = __shfl_sync(0xffffffffu, e.q_start, src);
      out->ext.q_len = __shfl_sync(0xffffffffu, e.q_len, src);
      out->ext.k_start = __shfl_sync(0xffffffffu, e.k_start, src);
      out->ext.k_len = __shfl_sync(0xffffffffu, e.k_len, src);
      return true;
    }
    before += total;
    q_before += __shfl_sync(0xffffffffu, q_incl, 31);
  }
  return false;
}

// Keys seen by any row of query tile [m0, m0 + rows): [lo, hi), empty when hi <= lo. The rows
// that see no key form a prefix of the sequence and see keys from 0 once they see any, so the
// union over the tile's rows is this one interval (see flash_params.h for the mask).
JAX_FLASH_HD void flash_tile_keys(const FlashParams& p, int32_t m0, int32_t rows, int32_t q_len,
                                  int32_t k_len, int32_t* lo, int32_t* hi) {
  int32_t lo_first, hi_first, lo_last, hi_last;
  visible_keys(p, m0, q_len, k_len, &lo_first, &hi_first);
  visible_keys(p, m0 + rows - 1, q_len, k_len, &lo_last, &hi_last);
  *lo = lo_first;
  *hi = hi_last;
}

// A load that later reads of this thread cannot pass (acquire, GPU scope): the dQ turn
// counters' reader.
__device__ __forceinline__ int ld_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Deterministic mode: the dQ turn counter of (query head h, query tile m of key tile kt's
// sequence), null past the workspace's slots. With `waiter` (one thread of the CTA), first
// spins until the key blocks before kt's (from lo / block_n, the first key block that visits
// the query tile) have added their dQ shares; then a CTA barrier orders the others' adds after
// that wait. The caller passes the turn on (flash_bwd_pass_dq_turn) once its shares are added.
__device__ __forceinline__ int32_t* flash_bwd_take_dq_turn(const FlashBwdWorkspace& ws,
                                                           const FlashKeyTile& kt, int h, int m,
                                                           int lo, int block_n, bool waiter) {
  const int64_t slot = kt.q_tile_base + m;
  if (slot >= ws.q_tile_slots) return nullptr;
  int32_t* turn = ws.dq_turn + static_cast<int64_t>(h) * ws.q_tile_slots + slot;
  if (waiter) {
    const int rank = kt.n - lo / block_n;
    while (ld_acquire(turn) < rank) {
    }
  }
  return turn;
}

// Deterministic mode: advances a turn taken with flash_bwd_take_dq_turn, by one thread, after a
// CTA barrier that every thread reached once its dQ adds were issued (bulk reduce-adds: waited
// for). One release by that thread publishes the whole CTA's adds (the barrier orders them
// before it, and a release is cumulative), as a split-K semaphore does: no thread needs a fence
// of its own. Two ways to release, each where it measured faster (H200, bf16, B4 S4k):
// - a sequentially consistent fence and an add (flash_bwd_pass_dq_turn): the 64 / 128 wide
//   Hopper kernel (bulk reduce-adds), where a release add cost 3-4% at D 128 (passed by the
//   thread that then waits; by another warpgroup, +0.2-0.9%, within the runs' spread), and the
//   mma.sync kernel (not measured with a release add);
// - a release add (flash_bwd_pass_dq_turn_release): the 256 wide Hopper kernel (per-thread
//   atomics), where the fence (MEMBAR.SC.GPU) holds the passing warp, and with it the CTA's next
//   visit, until the SM's outstanding atomics are visible: its deterministic mode ran 1.47x
//   faster with the release add (206 -> 302 TFLOP/s causal, 224 -> 331 non-causal).
__device__ __forceinline__ void flash_bwd_pass_dq_turn(int32_t* turn) {
  if (turn == nullptr) return;
  __threadfence();
  atomicAdd(turn, 1);
}
__device__ __forceinline__ void flash_bwd_pass_dq_turn_release(int32_t* turn) {
  if (turn == nullptr) return;
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(turn) : "memory");
}

// What a tensor-core backward CTA does for key tile `tile` (of block_n keys): for every query
// head of its kv head's group (GQA), visit each query tile (of block_m rows) that sees one of
// its keys. Those query tiles are consecutive (a query tile's key interval moves right with the
// tile): per_head of them from m_first. Visit it (0 <= it < items) is query head
// kv_head * group + it / per_head, query tile m_first + it % per_head.
struct FlashBwdVisits {
  FlashKeyTile kt;
  int n0;  // first key of the tile within its sequence
  int q_len, k_len;
  int group;  // query heads per kv head
  int m_first, per_head, items;
};

// The key tile (flash_find_key_tile's numbering: sequence by sequence) that CTA `cta` of a
// kv head computes. When every sequence has the same number of key tiles (dense calls), the
// CTAs take every sequence's key block 0, then every sequence's key block 1, ...: under a
// causal mask block 0 is the longest (it sees every query tile), so the longest CTAs start in
// the first waves instead of the last group's in the last one (tools/bwd_schedule_sim.py). A
// key block's turn-order predecessor (block n - 1 of its sequence) still starts before it.
// Otherwise (varlen) the numbering itself. A whole warp.
__device__ __forceinline__ int64_t flash_bwd_cta_tile(const FlashParams& p, int32_t block_n,
                                                      int64_t cta) {
  const int lane = threadIdx.x & 31;
  uint32_t lo = 0xffffffffu, hi = 0;
  for (int base = 0; base < p.batch; base += 32) {
    if (base + lane < p.batch) {
      // flash_seq_extent_at's k_len, without its q loads.
      const int32_t ks = clamp_i32(__ldg(p.k_starts + base + lane), 0, p.total_k);
      const int32_t k_len = clamp_i32(__ldg(p.k_ends + base + lane), ks, p.total_k) - ks;
      const uint32_t n = (static_cast<uint32_t>(k_len) + block_n - 1) / block_n;
      lo = min(lo, n);
      hi = max(hi, n);
    }
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lo != hi || lo == 0 || cta >= static_cast<int64_t>(p.batch) * lo) return cta;
  // 32-bit division (cta < batch * lo < 2^31, a grid dimension): a 64-bit one is a call, and
  // the registers it clobbers spill in every kernel variant.
  const uint32_t c = static_cast<uint32_t>(cta), nb = static_cast<uint32_t>(p.batch);
  return static_cast<int64_t>(c % nb) * lo + c / nb;
}

// Fills *out for CTA `cta`'s key tile (a whole warp, as flash_find_key_tile): with
// kLongestFirst flash_bwd_cta_tile's order, else the numbering itself. False past the last key
// tile, or when no query tile sees its keys.
template <bool kLongestFirst = false>
__device__ __forceinline__ bool flash_bwd_find_visits(const FlashParams& p, int32_t block_n,
                                                      int32_t block_m, int64_t cta,
                                                      FlashBwdVisits* out) {
  FlashKeyTile kt;
  const int64_t tile = kLongestFirst ? flash_bwd_cta_tile(p, block_n, cta) : cta;
  if (!flash_find_key_tile(p, block_n, block_m, tile, &kt)) return false;
  const int q_len = kt.ext.q_len, k_len = kt.ext.k_len;
  const int num_m = flash_num_q_tiles(kt.ext, block_m);
  auto visits = [&](int m) {
    int lo, hi;
    flash_tile_keys(p, m * block_m, min(block_m, q_len - m * block_m), q_len, k_len, &lo, &hi);
    return hi > lo && lo / block_n <= kt.n && kt.n <= (hi - 1) / block_n;
  };
  int m_first = 0;
  while (m_first < num_m && !visits(m_first)) ++m_first;
  int m_last = m_first;
  while (m_last + 1 < num_m && visits(m_last + 1)) ++m_last;
  if (m_first >= num_m) return false;
  out->kt = kt;
  out->n0 = kt.n * block_n;
  out->q_len = q_len;
  out->k_len = k_len;
  out->group = p.num_heads / p.num_heads_k;
  out->m_first = m_first;
  out->per_head = m_last - m_first + 1;
  out->items = out->group * out->per_head;
  return true;
}

// Visit `it` (0 <= it < v.items) of key tile v of kv head kv_head: its query head *h and query
// tile *m. Both modes walk the query tiles in descending order, every head of the group at each
// tile, so that the deterministic mode's dK/dV (summed in registers in visit order) are
// bit-identical to the fast mode's. The order is the deterministic mode's: key block n then adds
// to (h, m) as the same visit index as block n - 1 (both start at the sequence's last visited
// tile, and a query tile's key interval moves right with the tile), so each block trails its
// turn-order predecessor by one visit. In ascending order block n's first tile (2n under a causal
// mask with 128 keys per block and 64 rows per tile) is block n - 1's third visit, so block n
// would wait for most of the chain before it to get going and hold its SM idle meanwhile.
__device__ __forceinline__ void flash_bwd_visit(const FlashBwdVisits& v, int kv_head, int it,
                                                int* h, int* m) {
  *h = kv_head * v.group + it % v.group;
  *m = v.m_first + v.per_head - 1 - it / v.group;
}

// Key j of a sequence of q_len queries and k_len keys is visible from query row i iff
// j < k_len and *d_min <= j - i <= *d_max (flash_params.h's mask with diag = i + k_len - q_len).
JAX_FLASH_HD void flash_diag_band(const FlashParams& p, int q_len, int k_len, int* d_min,
                                  int* d_max) {
  const int64_t diag_off = static_cast<int64_t>(k_len) - q_len;
  auto clamp_int = [](int64_t x) {
    return static_cast<int>(x < INT_MIN ? INT_MIN : (x > INT_MAX ? INT_MAX : x));
  };
  *d_min = p.window_left < 0 ? INT_MIN : clamp_int(diag_off - p.window_left);
  *d_max = p.window_right < 0 ? INT_MAX : clamp_int(diag_off + p.window_right);
}

}  // namespace jax_flash
