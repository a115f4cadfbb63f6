// CPU sampling kernels. See sampling.h and jax_flash/sampling_params.h.
//
// The masses, bounds and Gumbel scores must round exactly as on CUDA: no FMA contraction in this
// file (it only matters where the target has FMA instructions, e.g. -march=native or AArch64).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "sampling.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "dtype_io.h"
#include "thread_pool.h"

namespace jax_flash {
namespace {

namespace sp = sampling;

// Per-thread buffers, reused across the rows a thread handles.
struct Scratch {
  std::vector<uint64_t> key;  // [vocab] order keys
  std::vector<uint64_t> tmp;  // top-k selection
  std::vector<std::pair<uint64_t, uint64_t>> cand;  // top-p candidates: (key, mass)
};

struct RowCut {
  bool any;  // the row has a finite logit
  float x_max;
  float tau;
  sp::RowPlan plan;
  uint64_t top;  // order key of the first token
  uint64_t cut;  // kept: key >= cut (and, unless greedy, d >= plan.log_min_p)
};

float logit_of(uint64_t key) { return sp::key_value(static_cast<uint32_t>(key >> 32)); }

// The largest key K such that the candidates with key >= K weigh >= target (1 <= target <= their
// total weight; keys distinct, weights > 0): a quickselect on the keys that carries the weight
// of the part above the pivot. Reorders c.
uint64_t weighted_cut(std::vector<std::pair<uint64_t, uint64_t>>& c, uint64_t target) {
  auto lo = c.begin(), hi = c.end();
  for (;;) {
    const uint64_t a = lo->first, b = lo[(hi - lo) / 2].first, z = (hi - 1)->first;
    const uint64_t pivot = std::max(std::min(a, b), std::min(std::max(a, b), z));  // median
    const auto mid = std::partition(lo, hi, [&](const auto& e) { return e.first > pivot; });
    uint64_t above = 0;
    for (auto it = lo; it != mid; ++it) above += it->second;
    if (above >= target) {  // the cut lies above the pivot
      hi = mid;
      continue;
    }
    std::iter_swap(mid, std::find_if(mid, hi, [&](const auto& e) { return e.first == pivot; }));
    if (above + mid->second >= target) return pivot;
    target -= above + mid->second;
    lo = mid + 1;
  }
}

template <DType DT>
RowCut select_row(const SamplingParams& p, int64_t r, Scratch& s) {
  using E = cpu::Elem<DT>;
  const int32_t V = p.vocab;
  const typename E::T* src = static_cast<const typename E::T*>(p.logits) + r * V;
  s.key.resize(V);
  uint64_t top = 0;
  for (int32_t i = 0; i < V; ++i) {
    s.key[i] = sp::order_key(sp::normalize_logit(E::load(src[i])), static_cast<uint32_t>(i));
    top = std::max(top, s.key[i]);
  }
  RowCut c;
  c.top = top;
  c.x_max = logit_of(top);
  c.any = c.x_max > -INFINITY;
  c.tau = p.temperature[r];
  c.plan = sp::row_plan(c.tau, p.top_k[r], p.top_p[r], p.min_p[r], V);
  c.cut = top;
  if (!c.any || c.plan.greedy) return c;

  c.cut = 0;
  if (c.plan.top_k_on) {
    s.tmp.assign(s.key.begin(), s.key.end());
    const auto kth = s.tmp.begin() + (c.plan.top_k - 1);
    std::nth_element(s.tmp.begin(), kth, s.tmp.end(), std::greater<uint64_t>());
    c.cut = *kth;
  }
  if (c.plan.top_p_on) {
    uint64_t total = 0;
    for (int32_t i = 0; i < V; ++i)
      if (s.key[i] >= c.cut)
        total += sp::mass(sp::scaled_logit(logit_of(s.key[i]), c.x_max, c.tau));
    const uint64_t min_mass =
        std::max<uint64_t>(sp::top_p_mass_floor(c.plan.top_p, total, c.plan.top_k), 1);
    s.cand.clear();
    for (int32_t i = 0; i < V; ++i) {
      if (s.key[i] < c.cut) continue;
      const uint64_t m = sp::mass(sp::scaled_logit(logit_of(s.key[i]), c.x_max, c.tau));
      if (m >= min_mass) s.cand.emplace_back(s.key[i], m);
    }
    c.cut = weighted_cut(s.cand, sp::top_p_target(c.plan.top_p, total));
  }
  return c;
}

bool kept(const RowCut& c, uint64_t key, float d) {
  return c.any && key >= c.cut && (c.plan.greedy || d >= c.plan.log_min_p);
}

template <DType DT>
void sample_row(const SamplingParams& p, int64_t r, Scratch& s) {
  const RowCut c = select_row<DT>(p, r, s);
  if (!c.any || c.plan.greedy) {
    p.tokens[r] = c.any ? static_cast<int32_t>(sp::key_index(c.top)) : -1;
    return;
  }
  // Blocks of tokens: the scores of a block are one branch-free loop (vectorised), computed
  // only where the block keeps a token.
  constexpr int32_t kBlock = 64;  // a multiple of 4: Philox words come in groups of 4 tokens
  const uint32_t* seeds = p.seeds + 3 * r;
  uint64_t best = 0;
  for (int32_t base = 0; base < p.vocab; base += kBlock) {
    const int32_t n = std::min(kBlock, p.vocab - base);
    float d[kBlock] = {};
    bool keep[kBlock];
    bool any_kept = false;
    for (int32_t j = 0; j < n; ++j) {
      d[j] = sp::scaled_logit(logit_of(s.key[base + j]), c.x_max, c.tau);
      keep[j] = kept(c, s.key[base + j], d[j]);
      any_kept |= keep[j];
    }
    if (!any_kept) continue;
    uint32_t words[kBlock];
    for (int32_t g = 0; g < kBlock; g += 4) {
      const philox::Words w = sp::gumbel_words(seeds, static_cast<uint32_t>(base + g));
      for (int32_t j = 0; j < 4; ++j) words[g + j] = w.w[j];
    }
    float score[kBlock];
    for (int32_t j = 0; j < kBlock; ++j) score[j] = sp::gumbel_score(d[j], words[j]);
    for (int32_t j = 0; j < n; ++j)
      if (keep[j]) best = std::max(best, sp::order_key(score[j], static_cast<uint32_t>(base + j)));
  }
  p.tokens[r] = static_cast<int32_t>(sp::key_index(best));
}

template <DType DT>
void filter_row(const SamplingParams& p, int64_t r, Scratch& s) {
  using E = cpu::Elem<DT>;
  const RowCut c = select_row<DT>(p, r, s);
  const typename E::T* src = static_cast<const typename E::T*>(p.logits) + r * p.vocab;
  typename E::T* out = static_cast<typename E::T*>(p.masked) + r * p.vocab;
  for (int32_t i = 0; i < p.vocab; ++i) {
    const float x = E::load(src[i]);
    const float d = c.plan.greedy ? 0.0f : sp::scaled_logit(logit_of(s.key[i]), c.x_max, c.tau);
    const float y = c.plan.greedy ? x : sp::div(x, c.tau);
    out[i] = E::store(kept(c, s.key[i], d) ? y : -INFINITY);
  }
}

template <bool kFilter>
void run_rows(const SamplingParams& p) {
  if (p.batch <= 0 || p.vocab <= 0 || p.vocab > sp::kMaxVocab) return;
  auto row = [&](int64_t r) {
    thread_local Scratch s;
    switch (p.dtype) {
      case DType::kFloat32:
        kFilter ? filter_row<DType::kFloat32>(p, r, s) : sample_row<DType::kFloat32>(p, r, s);
        break;
      case DType::kFloat16:
        kFilter ? filter_row<DType::kFloat16>(p, r, s) : sample_row<DType::kFloat16>(p, r, s);
        break;
      case DType::kBFloat16:
        kFilter ? filter_row<DType::kBFloat16>(p, r, s) : sample_row<DType::kBFloat16>(p, r, s);
        break;
    }
  };
  cpu::parallel_for(p.batch, row);
}

}  // namespace

void sample_cpu(const SamplingParams& p) { run_rows<false>(p); }

void top_k_top_p_filter_cpu(const SamplingParams& p) { run_rows<true>(p); }

}  // namespace jax_flash
