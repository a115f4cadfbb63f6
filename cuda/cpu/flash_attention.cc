// CPU FlashAttention kernel. See flash_attention.h and jax_flash/flash_params.h.
//
// One work item is (sequence b, query head h, block of up to kBlockM query rows). For it we keep a
// float32 copy of the Q rows (transposed, pre-scaled), a running max m, a running sum l and a
// float32 accumulator [kBlockM, Dv]. Keys are visited in tiles of kBlockN over the union of the
// visible ranges of the block's rows only; each K and V tile is converted to float32 once into a
// per-thread scratch buffer and reused by every row of the block. Per tile:
//   S^T = K Q^T (register-blocked micro-kernel), softcap, mask,
//   online softmax update (rescale acc and l by exp(m_old - m_new)),
//   acc += P V (same micro-kernel).
// Nothing of size [Sq, Sk] is ever formed; extra memory is O(kBlockM * (D + Dv + kBlockN)) per
// thread. Blocks are kBlockM rows (fewer K/V passes) unless that leaves too few work items for
// the pool, in which case they are halved down to kMinBlockM.
// The inner loops are plain C++ (plus GCC/Clang generic vector types in the micro-kernel, no
// intrinsics) that the compiler vectorises for the baseline ISA; on x86-64 with GCC, copies
// compiled for AVX2+FMA and AVX-512F are selected at run time when the CPU has them.
// Work runs on the shared CPU thread pool (thread_pool.h).
#include "flash_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"  // cuda/cpu: exp_approx, round_up, JF_INLINE
#include "dtype_io.h"
#include "gemm.h"  // cuda/cpu: the float32 GEMM micro-kernel
#include "jax_flash/numeric.h"  // f2u
#include "thread_pool.h"  // cuda/cpu: the process-wide pool shared by the CPU kernels

#include "isa.h"  // cuda/cpu: JF_TARGET_*, detect_isa

namespace jax_flash {
namespace {

#ifndef JAX_FLASH_CPU_BLOCK_M
#define JAX_FLASH_CPU_BLOCK_M 128
#endif
#ifndef JAX_FLASH_CPU_BLOCK_N
#define JAX_FLASH_CPU_BLOCK_N 64
#endif
constexpr int kBlockM = JAX_FLASH_CPU_BLOCK_M;  // max query rows per work item
constexpr int kMinBlockM = 32;
constexpr int kBlockN = JAX_FLASH_CPU_BLOCK_N;  // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using cpu::Elem;  // element loads and stores by DType (dtype_io.h)
using cpu::gemm;
using cpu::thread_scratch;
using cpu::exp_approx;
using cpu::round_up;

// The micro-kernel shapes (gemm.h), each with the tile extents padded for it.
using Tiles = cpu::PaddedTiles<kBlockM, kBlockN>;

// Floats of per-thread scratch that one work item needs.
template <class Cfg>
int64_t scratch_floats(const FlashParams& p) {
  constexpr int rc = Cfg::RC, kr = Cfg::KR, nr = Cfg::NR;
  const int64_t D = p.head_dim, Dvp = round_up(p.head_dim_v, nr);
  return D * rc           // Q^T, scaled [D, rc]
         + kr * D         // K tile [kr, D]
         + kBlockN * Dvp  // V tile [kBlockN, Dvp]
         + kr * rc        // S^T / P^T tile [kr, rc]
         + rc * Dvp       // accumulator [rc, Dvp]
         + 6 * rc;        // per-row m, l, tile max, tile sum, m used, alpha
}

// One work item: rows [i0, i0 + m) of sequence extent e (m <= kBlockM), query head h.
//
// Scores are computed transposed, S^T = K Q^T ([keys, rows]), so that the K tile needs no
// transpose and the softmax bookkeeping is elementwise over rows (vectorises without
// reassociating reductions). P^T then feeds acc += P V as a strided A operand.
template <DType DT, class C>
JF_INLINE void block_impl(const FlashParams& p, const SeqExtent& e, int h, int i0, int m,
                          float* JF_RESTRICT scratch) {
  using T = typename Elem<DT>::T;
  constexpr int NR = C::NR, RC = C::RC, KR = C::KR;
  const int D = p.head_dim, Dv = p.head_dim_v;
  const int Dvp = static_cast<int>(round_up(Dv, NR));
  const int m_s = static_cast<int>(round_up(m, NR));    // columns of S^T computed
  const int m_o = static_cast<int>(round_up(m, C::MR)); // rows of acc computed
  const int hk = h / (p.num_heads / p.num_heads_k);

  float* JF_RESTRICT Qt = scratch;
  float* JF_RESTRICT Kf = Qt + static_cast<int64_t>(D) * RC;
  float* JF_RESTRICT Vf = Kf + static_cast<int64_t>(KR) * D;
  float* JF_RESTRICT Pt = Vf + static_cast<int64_t>(kBlockN) * Dvp;
  float* JF_RESTRICT Acc = Pt + KR * RC;
  float* JF_RESTRICT mrow = Acc + static_cast<int64_t>(RC) * Dvp;
  float* JF_RESTRICT lrow = mrow + RC;
  float* JF_RESTRICT tmax = lrow + RC;
  float* JF_RESTRICT tsum = tmax + RC;
  float* JF_RESTRICT muse = tsum + RC;
  float* JF_RESTRICT alpha = muse + RC;

  // Visible key ranges (clamped to [0, k_len]); both ends are non-decreasing in the row.
  int32_t lo[RC], hi[RC];
  int klo = e.k_len, khi = 0;
  for (int i = 0; i < m; ++i) {
    int32_t l, u;
    visible_keys(p, i0 + i, e.q_len, e.k_len, &l, &u);
    l = std::max(l, 0);
    u = std::min(u, e.k_len);
    if (l >= u) l = u = 0;
    lo[i] = l;
    hi[i] = u;
    if (l < u) {
      klo = std::min(klo, static_cast<int>(l));
      khi = std::max(khi, static_cast<int>(u));
    }
  }
  for (int i = 0; i < m; ++i) {
    mrow[i] = kNegInf;
    lrow[i] = 0.0f;
  }

  if (klo < khi) {
    std::fill(Acc, Acc + static_cast<int64_t>(m_o) * Dvp, 0.0f);
    // Q^T, pre-multiplied by the softmax scale; padding columns are zero.
    const T* q = static_cast<const T*>(p.q);
    const float scale = p.softmax_scale;
    for (int i = 0; i < m; ++i) {
      const T* src = q + static_cast<int64_t>(e.q_start + i0 + i) * p.q_row_stride +
                     static_cast<int64_t>(h) * D;
      for (int d = 0; d < D; ++d) Qt[static_cast<int64_t>(d) * RC + i] = Elem<DT>::load(src[d]) * scale;
    }
    for (int d = 0; d < D; ++d)
      for (int i = m; i < m_s; ++i) Qt[static_cast<int64_t>(d) * RC + i] = 0.0f;
    // P^T columns m_s..m_o are read by the P V product (for padding rows only): keep finite.
    for (int j = 0; j < KR; ++j)
      for (int i = m_s; i < m_o; ++i) Pt[j * RC + i] = 0.0f;

    const T* kp = static_cast<const T*>(p.k);
    const T* vp = static_cast<const T*>(p.v);
    const bool use_cap = p.softcap > 0.0f;
    const float cap = p.softcap, inv_cap = use_cap ? 1.0f / p.softcap : 0.0f;

    for (int kb = klo; kb < khi; kb += kBlockN) {
      const int nk = std::min(kBlockN, khi - kb);
      const int nk_r = static_cast<int>(round_up(nk, C::MR));
      // K tile [nk_r, D] (padding rows zero) and V tile [nk, Dvp] (padding columns zero).
      for (int j = 0; j < nk; ++j) {
        const T* src = kp + static_cast<int64_t>(e.k_start + kb + j) * p.k_row_stride +
                       static_cast<int64_t>(hk) * D;
        float* dst = Kf + static_cast<int64_t>(j) * D;
        for (int d = 0; d < D; ++d) dst[d] = Elem<DT>::load(src[d]);
      }
      std::fill(Kf + static_cast<int64_t>(nk) * D, Kf + static_cast<int64_t>(nk_r) * D, 0.0f);
      // Every row sees every key of the tile, or some rows have masked keys here (their P is 0).
      bool full = true;
      for (int i = 0; i < m; ++i) full = full && lo[i] <= kb && hi[i] >= kb + nk;
      // Non-finite values in V (only looked for where keys are masked): 0 * inf / nan is nan, so
      // P V then has to skip the masked keys instead of multiplying them by 0.
      uint32_t v_nonfinite = 0;
      for (int j = 0; j < nk; ++j) {
        const T* src = vp + static_cast<int64_t>(e.k_start + kb + j) * p.v_row_stride +
                       static_cast<int64_t>(hk) * Dv;
        float* dst = Vf + static_cast<int64_t>(j) * Dvp;
        for (int d = 0; d < Dv; ++d) dst[d] = Elem<DT>::load(src[d]);
        for (int d = Dv; d < Dvp; ++d) dst[d] = 0.0f;
        if (!full)
          for (int d = 0; d < Dv; ++d)
            v_nonfinite |=
                static_cast<uint32_t>((numeric::f2u(dst[d]) & 0x7f800000u) == 0x7f800000u);
      }

      // S^T[j, i] = scale * k_j . q_i
      gemm<C::W, C::MR, C::NV, false>(nk_r, m_s, D, Kf, D, 1, Qt, RC, Pt, RC);

      // Softcap, mask, tile max.
      for (int i = 0; i < m; ++i) tmax[i] = kNegInf;
      for (int j = 0; j < nk; ++j) {
        float* JF_RESTRICT s = Pt + j * RC;
        if (use_cap)
          for (int i = 0; i < m; ++i) s[i] = cap * std::tanh(s[i] * inv_cap);
        if (!full) {
          const int32_t key = kb + j;
          for (int i = 0; i < m; ++i) s[i] = (key >= lo[i] && key < hi[i]) ? s[i] : kNegInf;
        }
        for (int i = 0; i < m; ++i) tmax[i] = s[i] > tmax[i] ? s[i] : tmax[i];
      }
      // Online softmax update. A row with no visible key so far keeps m = -inf; it uses 0 as
      // its reference so that exp(-inf - 0) = 0 instead of nan.
      for (int i = 0; i < m; ++i) {
        const float m_new = tmax[i] > mrow[i] ? tmax[i] : mrow[i];
        const float mu = m_new == kNegInf ? 0.0f : m_new;
        muse[i] = mu;
        alpha[i] = exp_approx(mrow[i] - mu);
        mrow[i] = m_new;
        tsum[i] = 0.0f;
      }
      for (int j = 0; j < nk; ++j) {
        float* JF_RESTRICT s = Pt + j * RC;
        for (int i = 0; i < m; ++i) {
          const float pj = exp_approx(s[i] - muse[i]);
          s[i] = pj;
          tsum[i] += pj;
        }
      }
      for (int i = 0; i < m; ++i) {
        lrow[i] = lrow[i] * alpha[i] + tsum[i];
        if (alpha[i] != 1.0f) {
          float* JF_RESTRICT acc = Acc + static_cast<int64_t>(i) * Dvp;
          const float a = alpha[i];
          for (int d = 0; d < Dvp; ++d) acc[d] *= a;
        }
      }

      // acc[i, :] += sum_j P[i, j] V[j, :], with P[i, j] = Pt[j * RC + i]; over each row's
      // visible keys only when a masked key holds inf / nan (rare: no register blocking).
      if (v_nonfinite == 0) {
        gemm<C::W, C::MR, C::NV, true>(m_o, Dvp, nk, Pt, 1, RC, Vf, Dvp, Acc, Dvp);
      } else {
        for (int i = 0; i < m; ++i) {
          float* JF_RESTRICT acc = Acc + static_cast<int64_t>(i) * Dvp;
          const int j1 = std::min(hi[i] - kb, nk);
          for (int j = std::max(lo[i] - kb, 0); j < j1; ++j) {
            const float pj = Pt[j * RC + i];
            const float* JF_RESTRICT v = Vf + static_cast<int64_t>(j) * Dvp;
            for (int d = 0; d < Dvp; ++d) acc[d] += pj * v[d];
          }
        }
      }
    }
  }

  // Write o and lse.
  T* o = static_cast<T*>(p.o);
  for (int i = 0; i < m; ++i) {
    const int64_t r = static_cast<int64_t>(e.q_start) + i0 + i;
    T* dst = o + r * p.o_row_stride + static_cast<int64_t>(h) * Dv;
    float* lse = p.lse + static_cast<int64_t>(h) * p.total_q + r;
    if (mrow[i] == kNegInf) {
      for (int d = 0; d < Dv; ++d) dst[d] = Elem<DT>::store(0.0f);
      *lse = kNegInf;
    } else {
      const float inv_l = 1.0f / lrow[i];
      const float* acc = Acc + static_cast<int64_t>(i) * Dvp;
      for (int d = 0; d < Dv; ++d) dst[d] = Elem<DT>::store(acc[d] * inv_l);
      *lse = mrow[i] + std::log(lrow[i]);
    }
  }
}

// Fills the rows of a failed work item with nan so that a failure is never silently plausible.
template <DType DT>
void block_fail(const FlashParams& p, const SeqExtent& e, int h, int i0, int m) {
  using T = typename Elem<DT>::T;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  T* o = static_cast<T*>(p.o);
  for (int i = 0; i < m; ++i) {
    const int64_t r = static_cast<int64_t>(e.q_start) + i0 + i;
    T* dst = o + r * p.o_row_stride + static_cast<int64_t>(h) * p.head_dim_v;
    for (int d = 0; d < p.head_dim_v; ++d) dst[d] = Elem<DT>::store(nan);
    p.lse[static_cast<int64_t>(h) * p.total_q + r] = nan;
  }
}

using BlockFn = void (*)(const FlashParams&, const SeqExtent&, int, int, int, float*);

template <DType DT>
void block_generic(const FlashParams& p, const SeqExtent& e, int h, int i0, int m,
                   float* scratch) {
  block_impl<DT, Tiles::Generic>(p, e, h, i0, m, scratch);
}

#if JF_X86_DISPATCH
template <DType DT>
JF_TARGET_AVX2 void block_avx2(const FlashParams& p, const SeqExtent& e, int h, int i0, int m,
                               float* scratch) {
  block_impl<DT, Tiles::Avx2>(p, e, h, i0, m, scratch);
}
template <DType DT>
JF_TARGET_AVX512 void block_avx512(const FlashParams& p, const SeqExtent& e, int h, int i0,
                                   int m, float* scratch) {
  block_impl<DT, Tiles::Avx512>(p, e, h, i0, m, scratch);
}
#endif

using cpu::Isa;
using cpu::detect_isa;

using cpu::parallel_for;
using cpu::ThreadPool;

// ---------------------------------------------------------------------------------------------

struct WorkItem {
  int32_t b, i0, rows;
  int64_t cost;
};

template <DType DT>
void fill_uncovered_rows(const FlashParams& p) {
  using T = typename Elem<DT>::T;
  constexpr int64_t kRows = 256;
  const int64_t chunks = (static_cast<int64_t>(p.total_q) + kRows - 1) / kRows;
  auto body = [&](int64_t c) {
    const int64_t r0 = c * kRows, r1 = std::min<int64_t>(r0 + kRows, p.total_q);
    T* o = static_cast<T*>(p.o);
    const T zero = Elem<DT>::store(0.0f);
    const int64_t width = static_cast<int64_t>(p.num_heads) * p.head_dim_v;
    for (int64_t r = r0; r < r1; ++r) {
      T* dst = o + r * p.o_row_stride;
      for (int64_t x = 0; x < width; ++x) dst[x] = zero;
    }
    for (int64_t h = 0; h < p.num_heads; ++h) {
      float* lse = p.lse + h * p.total_q;
      for (int64_t r = r0; r < r1; ++r) lse[r] = kNegInf;
    }
  };
  parallel_for(chunks, body);
}

template <DType DT>
void run(const FlashParams& p_in) {
  // Windows wider than any sequence are equivalent to unbounded ones; clamping them keeps the
  // int32 arithmetic of visible_keys() from overflowing for huge values.
  FlashParams p = p_in;
  const int32_t wl_max = std::max(p.total_k, 0);
  const int64_t wr_max = std::min<int64_t>(static_cast<int64_t>(std::max(p.total_q, 0)) +
                                               std::max(p.total_k, 0),
                                           std::numeric_limits<int32_t>::max() / 2);
  if (p.window_left > wl_max) p.window_left = wl_max;
  if (p.window_right > wr_max) p.window_right = static_cast<int32_t>(wr_max);

  if (p.fill_uncovered) fill_uncovered_rows<DT>(p);

  // Work items: (sequence, block of query rows) x heads, most expensive first.
  std::vector<SeqExtent> ext;
  std::vector<WorkItem> items;
  const int32_t batch = std::max(p.batch, 0);
  ext.resize(batch);
  for (int32_t b = 0; b < batch; ++b) {
    const SeqExtent e = seq_extent(p, p.q_starts[b], p.q_ends[b], p.k_starts[b], p.k_ends[b]);
    ext[b] = e;
  }
  // Rows per work item: kBlockM, halved while that gives fewer than ~4 items per thread.
  const int64_t heads = p.num_heads;
  const int64_t min_items = 4 * static_cast<int64_t>(ThreadPool::get().num_threads());
  int bm = kBlockM;
  for (; bm > kMinBlockM; bm /= 2) {
    int64_t n = 0;
    for (const SeqExtent& e : ext)
      if (e.q_len > 0) n += (e.q_len + bm - 1) / bm;
    if (n * heads >= min_items) break;
  }
  for (int32_t b = 0; b < batch; ++b) {
    const SeqExtent& e = ext[b];
    if (e.q_len <= 0) continue;
    for (int64_t r0 = 0; r0 < e.q_len; r0 += bm) {
      const int32_t i0 = static_cast<int32_t>(r0);
      const int32_t rows = static_cast<int32_t>(std::min<int64_t>(bm, e.q_len - r0));
      int32_t lo0, hi0, lo1, hi1;
      visible_keys(p, i0, e.q_len, e.k_len, &lo0, &hi0);
      visible_keys(p, i0 + rows - 1, e.q_len, e.k_len, &lo1, &hi1);
      const int64_t keys = std::max<int64_t>(0, static_cast<int64_t>(hi1) - std::max(lo0, 0));
      items.push_back({b, i0, rows, keys * rows + 1});
    }
  }
  std::sort(items.begin(), items.end(),
            [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });

  BlockFn fn = &block_generic<DT>;
  int64_t scratch_size = scratch_floats<Tiles::Generic>(p);
#if JF_X86_DISPATCH
  switch (detect_isa()) {
    case Isa::kAvx512:
      fn = &block_avx512<DT>;
      scratch_size = scratch_floats<Tiles::Avx512>(p);
      break;
    case Isa::kAvx2:
      fn = &block_avx2<DT>;
      scratch_size = scratch_floats<Tiles::Avx2>(p);
      break;
    case Isa::kGeneric:
      break;
  }
#endif
  auto body = [&](int64_t idx) {
    const WorkItem& it = items[idx / heads];
    const int h = static_cast<int>(idx % heads);
    const SeqExtent& e = ext[it.b];
    if (float* scratch = thread_scratch(scratch_size))
      fn(p, e, h, it.i0, it.rows, scratch);
    else
      block_fail<DT>(p, e, h, it.i0, it.rows);
  };
  parallel_for(static_cast<int64_t>(items.size()) * heads, body);
}

}  // namespace

void flash_attention_cpu(const FlashParams& p) {
  // head_dim_v 0 is a valid call: o is empty but lse is still computed.
  if (p.num_heads <= 0 || p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0 ||
      p.head_dim <= 0 || p.head_dim_v < 0 || p.total_q < 0 || p.total_k < 0)
    return;
  try {
    switch (p.dtype) {
      case DType::kFloat32: run<DType::kFloat32>(p); break;
      case DType::kFloat16: run<DType::kFloat16>(p); break;
      case DType::kBFloat16: run<DType::kBFloat16>(p); break;
    }
  } catch (...) {
    // Only allocation of the work list can throw; nothing sensible is left to do.
  }
}

}  // namespace jax_flash
