// CPU apply_rope. See rope.h and jax_flash/rope_params.h.
#include "rope.h"

#include <cmath>
#include <cstdint>

#include "dtype_io.h"
#include "thread_pool.h"

namespace jax_flash {
namespace {

// Tokens per task of the thread pool: enough elements to amortise the dispatch.
int64_t tokens_per_task(const RopeParams& p) {
  const int64_t per_token = static_cast<int64_t>(p.heads) * p.head_dim;
  const int64_t n = (1 << 15) / (per_token > 0 ? per_token : 1);
  return n > 0 ? n : 1;
}

bool valid(const RopeParams& p) {
  return p.heads >= 0 && p.head_dim > 0 && p.rotary_dim >= 2 && p.rotary_dim % 2 == 0 &&
         p.rotary_dim <= p.head_dim && p.rotary_dim <= kMaxRotaryDim;
}

template <DType DT, RopeStyle kStyle>
void rope_tokens(const RopeParams& p, int64_t t0, int64_t t1) {
  using E = cpu::Elem<DT>;
  const int32_t half = p.rotary_dim / 2, D = p.head_dim;
  float cosv[kMaxRotaryDim / 2], sinv[kMaxRotaryDim / 2];  // per pair
  for (int64_t t = t0; t < t1; ++t) {
    for (int32_t i = 0; i < half; ++i) {
      const float a = rope::angle(p.positions[t], p.inv_freq[i]);
      cosv[i] = std::cos(a);
      sinv[i] = std::sin(a);
    }
    for (int32_t h = 0; h < p.heads; ++h) {
      const int64_t o = (t * p.heads + h) * static_cast<int64_t>(D);
      const typename E::T* x = static_cast<const typename E::T*>(p.x) + o;
      typename E::T* out = static_cast<typename E::T*>(p.out) + o;
      for (int32_t i = 0; i < half; ++i) {
        const int32_t ia = rope::first_of_pair(kStyle, i);
        const int32_t ib = rope::second_of_pair(kStyle, i, p.rotary_dim);
        float a, b;
        rope::rotate(E::load(x[ia]), E::load(x[ib]), cosv[i], sinv[i], &a, &b);
        out[ia] = E::store(a);
        out[ib] = E::store(b);
      }
      for (int32_t d = p.rotary_dim; d < D; ++d) out[d] = x[d];
    }
  }
}

template <DType DT>
void range(const RopeParams& p, int64_t t0, int64_t t1) {
  if (p.style == RopeStyle::kNeox)
    rope_tokens<DT, RopeStyle::kNeox>(p, t0, t1);
  else
    rope_tokens<DT, RopeStyle::kGptj>(p, t0, t1);
}

}  // namespace

void apply_rope_cpu_range(const RopeParams& p, int64_t t0, int64_t t1) {
  if (!valid(p) || t0 < 0 || t1 > p.tokens || t0 >= t1) return;
  switch (p.dtype) {
    case DType::kFloat32: range<DType::kFloat32>(p, t0, t1); break;
    case DType::kFloat16: range<DType::kFloat16>(p, t0, t1); break;
    case DType::kBFloat16: range<DType::kBFloat16>(p, t0, t1); break;
  }
}

void apply_rope_cpu(const RopeParams& p) {
  if (p.tokens <= 0 || p.heads <= 0 || !valid(p)) return;
  const int64_t chunk = tokens_per_task(p);
  const int64_t tasks = (p.tokens + chunk - 1) / chunk;
  auto task = [&](int64_t k) {
    const int64_t t0 = k * chunk, t1 = t0 + chunk < p.tokens ? t0 + chunk : p.tokens;
    apply_rope_cpu_range(p, t0, t1);
  };
  cpu::parallel_for(tasks, task);
}

}  // namespace jax_flash
