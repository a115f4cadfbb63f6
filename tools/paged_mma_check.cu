// Standalone GPU check of the paged decode kernels (no XLA): the CUDA-core kernel
// (launch_paged_attention_mt) and the tensor-core kernel (launch_paged_attention_mma) against a
// float64 CPU reference on random 16-bit caches and int8 / float8 e4m3 caches with per-head or
// per-token scales (random page permutations, odd page sizes and lengths, GQA groups, Sq > 1
// causal, windows, softcap, splits, bad block-table data), then a timing of both kernels on
// large decode shapes (16-bit and 8-bit caches).
//
// Build and run from the repository root (the configure step writes the kernel instantiations):
//   cmake -S . -B build/cuda -G Ninja -DJAX_FLASH_CUDA=ON -DPython_EXECUTABLE=$(which python)
//   nvcc -I cuda/include -std=c++17 -O3 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//     -o /tmp/pm tools/paged_mma_check.cu build/cuda/instantiations/paged_attention_mma_*.cu && /tmp/pm
// Exit status 0 when every case passes. Flags: --no-timing (correctness only), --q8 (only the
// 8-bit cache cases and timing rows, with bf16 reference rows), --profile (one launch of the
// tensor-core kernel per row at 64 x 8k, for ncu), --bw (only the tensor-core kernel's time at
// the decode benchmark's main shapes), --d64 (the same for head dim 64, with 1-4 splits at
// 64 x 8k; with --profile: one launch each of bf16 and e4m3 D64 at 64 x 8k, for ncu), --merge
// (split-KV shapes with and without the merge: its cost), --mha (both kernels at 1-2 rows per
// kv head), --seq (timing rows with each
// sequence's pages in order instead of shuffled).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "jax_flash/paged_attention_mma.cuh"

using namespace jax_flash;

static PagedLaunch g_launch;  // launch options of every call (--merge changes the merge's)

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

template <typename T>
static float tf(T x);
template <>
float tf<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
float tf<__half>(__half x) { return __half2float(x); }
template <>
float tf<int8_t>(int8_t x) { return static_cast<float>(x); }
template <>
float tf<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
template <typename T>
__host__ __device__ T ft(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    // code of x in [-1.5, 1.5): spread over [-127, 127]
    const float y = rintf(x * 84.f);
    return static_cast<int8_t>(y > 127.f ? 127.f : (y < -127.f ? -127.f : y));
  } else {
    return __nv_fp8_e4m3(x * 64.f);  // e4m3 code (|x| < 7: no saturation, no NaN)
  }
}
template <typename TC>
constexpr bool is8() { return sizeof(TC) == 1; }
template <typename TC>
const char* cname() {
  if constexpr (std::is_same_v<TC, __half>) return "f16";
  else if constexpr (std::is_same_v<TC, __nv_bfloat16>) return "bf16";
  else if constexpr (std::is_same_v<TC, int8_t>) return "int8";
  else return "e4m3";
}

struct Case {
  int D, G, Hkv, Sq, ps, splits;
  std::vector<int> lens;
  float softcap = 0.f;
  int wl = -1, wr = 0;  // causal by default
  bool bad = false;     // corrupt some sequences
  bool f16 = false;
  ScaleMode scale = ScaleMode::kNone;  // 8-bit caches: per head or per token
};

enum Kernel { kSimt = 0, kMma = 1 };

template <typename T, typename TC = T>
static cudaError_t run_kernel(Kernel k, const PagedAttentionParams& p, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(p.num_heads / p.num_heads_k) * p.seqlen_q;
  const int mt = policy::paged_rows_per_cta(rows, static_cast<int>(sizeof(T)));
#define JF_SIMT(D)                                                                          \
  if (p.head_dim == D) {                                                                    \
    if (k == kMma) return paged::launch_paged_attention_mma<T, D, TC>(p, s);                \
    if (mt == 4) return paged::launch_paged_attention_mt<T, TC, D, 4>(p, s);                \
    if (mt == 8) return paged::launch_paged_attention_mt<T, TC, D, 8>(p, s);                \
    return paged::launch_paged_attention_mt<T, TC, D, 16>(p, s);                            \
  }
  JF_SIMT(64)
  JF_SIMT(128)
  JF_SIMT(256)
#undef JF_SIMT
  return cudaErrorInvalidValue;
}

// Device buffers of one problem.
struct Dev {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float *lse = nullptr, *op = nullptr, *lp = nullptr, *ks = nullptr, *vs = nullptr;
  int32_t *bt = nullptr, *kl = nullptr;
  void free_all() {
    for (void* x : {q, k, v, o, (void*)lse, (void*)op, (void*)lp, (void*)bt, (void*)kl,
                    (void*)ks, (void*)vs})
      if (x) cudaFree(x);
  }
};

template <typename T, typename TC = T>
static PagedAttentionParams make_params(const Dev& d, int B, int Sq, int Hq, int Hkv, int D,
                                        int num_pages, int ps, int max_pages, int splits,
                                        float softcap, int wl, int wr,
                                        ScaleMode sm = ScaleMode::kNone) {
  PagedAttentionParams p{};
  p.q = d.q;
  p.k_pages = d.k;
  p.v_pages = d.v;
  p.k_scale = d.ks;
  p.v_scale = d.vs;
  p.block_tables = d.bt;
  p.kv_lens = d.kl;
  p.o = d.o;
  p.lse = d.lse;
  p.o_partial = d.op;
  p.lse_partial = d.lp;
  p.batch = B;
  p.seqlen_q = Sq;
  p.num_heads = Hq;
  p.num_heads_k = Hkv;
  p.head_dim = D;
  p.head_dim_v = D;
  p.num_pages = num_pages;
  p.page_size = ps;
  p.max_pages = max_pages;
  p.num_splits = splits;
  p.launch = g_launch;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(D));
  p.softcap = softcap;
  p.window_left = wl;
  p.window_right = wr;
  const bool bf = std::is_same_v<T, __nv_bfloat16>;
  p.dtype = bf ? DType::kBFloat16 : DType::kFloat16;
  p.cache_dtype = bf ? CacheDType::kBFloat16 : CacheDType::kFloat16;
  if constexpr (std::is_same_v<TC, int8_t>) p.cache_dtype = CacheDType::kInt8;
  if constexpr (std::is_same_v<TC, __nv_fp8_e4m3>) p.cache_dtype = CacheDType::kFloat8E4M3;
  p.scale_mode = sm;
  return p;
}

static std::mt19937_64 rng(1234);

template <typename T, typename TC = T>
static bool run_case(const Case& c) {
  const int B = static_cast<int>(c.lens.size());
  const int D = c.D, G = c.G, Hkv = c.Hkv, Hq = G * Hkv, Sq = c.Sq, ps = c.ps;
  std::vector<int> lens = c.lens;
  int max_pages = 1, need = 0;
  std::vector<int> npg(B);
  for (int b = 0; b < B; ++b) {
    npg[b] = std::max(1, (lens[b] + ps - 1) / ps);
    need += npg[b];
    max_pages = std::max(max_pages, npg[b] + 1);
  }
  const int num_pages = need + 3;
  std::vector<int> perm(num_pages);
  for (int i = 0; i < num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt(static_cast<size_t>(B) * max_pages, -1);  // unused entries: garbage
  for (int b = 0, at = 0; b < B; ++b)
    for (int j = 0; j < npg[b]; ++j) bt[static_cast<size_t>(b) * max_pages + j] = perm[at++];
  std::vector<bool> bad_seq(B, false);
  if (c.bad && B >= 5) {
    bt[1 * max_pages + std::min(1, npg[1] - 1)] = num_pages + 1000;  // invalid id in use
    bad_seq[1] = lens[1] > 0;
    bt[2 * max_pages + 0] = -5;
    bad_seq[2] = lens[2] > 0;
    lens[3] = max_pages * ps + 1;  // beyond capacity
    bad_seq[3] = true;
    lens[4] = -1;
    bad_seq[4] = true;
    bt[0 * max_pages + max_pages - 1] = 1 << 30;  // past the used pages: never read
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t nq = static_cast<size_t>(B) * Sq * Hq * D;
  const size_t nkv = static_cast<size_t>(num_pages) * ps * Hkv * D;
  std::vector<T> hq(nq);
  std::vector<TC> hk(nkv), hv(nkv);
  for (auto& x : hq) x = ft<T>(nd(rng));
  for (auto& x : hk) x = ft<TC>(nd(rng));
  for (auto& x : hv) x = ft<TC>(nd(rng));
  // Scales (8-bit caches): x = code * scale (paged_params.h); per head [Hkv] or per token
  // [num_pages, page_size, Hkv], random in [0.5, 1.5] / (code range) so that x ~ N(0, 1).
  const ScaleMode sm = is8<TC>() ? c.scale : ScaleMode::kNone;
  const size_t nsc = sm == ScaleMode::kPerHead ? Hkv : (sm == ScaleMode::kPerToken ? nkv / D : 0);
  std::vector<float> hks(nsc), hvs(nsc);
  {
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    const float unit = std::is_same_v<TC, int8_t> ? 1.f / 84.f : 1.f / 64.f;
    for (auto& x : hks) x = ud(rng) * unit;
    for (auto& x : hvs) x = ud(rng) * unit;
  }
  // dequantised cache element e of cache row `row` ((page * ps + off) * Hkv + kvh)
  auto deq = [&](const std::vector<TC>& cache, const std::vector<float>& sc, size_t row, int e) {
    double x = tf(cache[row * D + e]);
    if (sm == ScaleMode::kPerHead) x *= double(sc[row % Hkv]);
    if (sm == ScaleMode::kPerToken) x *= double(sc[row]);
    return x;
  };

  Dev d;
  CK(cudaMalloc(&d.q, nq * sizeof(T)));
  CK(cudaMalloc(&d.k, nkv * sizeof(TC)));
  CK(cudaMalloc(&d.v, nkv * sizeof(TC)));
  CK(cudaMalloc(&d.o, nq * sizeof(T)));
  CK(cudaMalloc(&d.lse, static_cast<size_t>(B) * Hq * Sq * 4));
  CK(cudaMalloc(&d.op, nq * c.splits * 4));
  if (nsc > 0) {
    CK(cudaMalloc(&d.ks, nsc * 4));
    CK(cudaMalloc(&d.vs, nsc * 4));
    CK(cudaMemcpy(d.ks, hks.data(), nsc * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.vs, hvs.data(), nsc * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&d.lp, static_cast<size_t>(B) * Hq * Sq * c.splits * 4));
  CK(cudaMalloc(&d.bt, bt.size() * 4));
  CK(cudaMalloc(&d.kl, B * 4));
  CK(cudaMemcpy(d.q, hq.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.k, hk.data(), nkv * sizeof(TC), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.v, hv.data(), nkv * sizeof(TC), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.bt, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.kl, lens.data(), B * 4, cudaMemcpyHostToDevice));
  const PagedAttentionParams p = make_params<T, TC>(d, B, Sq, Hq, Hkv, D, num_pages, ps,
                                                    max_pages, c.splits, c.softcap, c.wl, c.wr, sm);

  // float64 reference
  std::vector<double> ro(nq, 0.0), rl(static_cast<size_t>(B) * Hq * Sq, -INFINITY);
  for (int b = 0; b < B; ++b) {
    if (bad_seq[b]) continue;
    const int kl = lens[b];
    for (int i = 0; i < Sq; ++i) {
      const long diag = static_cast<long>(i) + kl - Sq;
      long lo = 0, hi = kl;
      if (c.wl >= 0) lo = std::max(lo, diag - c.wl);
      if (c.wr >= 0) hi = std::min(hi, diag + c.wr + 1);
      for (int h = 0; h < Hq; ++h) {
        const int kvh = h / G;
        const T* qr = &hq[((static_cast<size_t>(b) * Sq + i) * Hq + h) * D];
        std::vector<double> sc;
        double mx = -INFINITY;
        for (long j = lo; j < hi; ++j) {
          const int page = bt[static_cast<size_t>(b) * max_pages + j / ps];
          const size_t row = (static_cast<size_t>(page) * ps + j % ps) * Hkv + kvh;
          double s = 0;
          for (int e = 0; e < D; ++e) s += double(tf(qr[e])) * deq(hk, hks, row, e);
          s *= p.softmax_scale;
          if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
          sc.push_back(s);
          mx = std::max(mx, s);
        }
        if (sc.empty()) continue;
        double sum = 0;
        for (double& s : sc) sum += (s = std::exp(s - mx));
        double* out = &ro[((static_cast<size_t>(b) * Sq + i) * Hq + h) * D];
        for (long j = lo; j < hi; ++j) {
          const int page = bt[static_cast<size_t>(b) * max_pages + j / ps];
          const size_t row = (static_cast<size_t>(page) * ps + j % ps) * Hkv + kvh;
          const double w = sc[j - lo] / sum;
          for (int e = 0; e < D; ++e) out[e] += w * deq(hv, hvs, row, e);
        }
        rl[(static_cast<size_t>(b) * Hq + h) * Sq + i] = mx + std::log(sum);
      }
    }
  }

  const double tol = std::is_same_v<T, __half> ? 2e-3 : 1.2e-2;
  bool all_ok = true;
  std::string desc = std::string(std::is_same_v<T, __half> ? "f16 " : "bf16") +
                     (is8<TC>() ? std::string("/") + cname<TC>() +
                                      (sm == ScaleMode::kPerHead ? "/head" : "/token")
                                : std::string()) +
                     " D" +
                     std::to_string(D) + " G" + std::to_string(G) + " Hkv" + std::to_string(Hkv) +
                     " Sq" + std::to_string(Sq) + " page" + std::to_string(ps) + " splits" +
                     std::to_string(c.splits) + (c.softcap > 0 ? " softcap" : "") +
                     (c.wl >= 0 ? " wl" + std::to_string(c.wl) : "") +
                     (c.wr < 0 ? " noncausal" : "") + (c.bad ? " bad-data" : "");
  for (Kernel k : {kSimt, kMma}) {
    CK(cudaMemset(d.o, 0x7f, nq * sizeof(T)));  // garbage: every row must be written
    CK((run_kernel<T, TC>(k, p, 0)));
    CK(cudaDeviceSynchronize());
    std::vector<T> ho(nq);
    std::vector<float> hl(rl.size());
    CK(cudaMemcpy(ho.data(), d.o, nq * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl.data(), d.lse, hl.size() * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0, lse_err = 0;
    bool ok = true;
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < Sq; ++i)
        for (int h = 0; h < Hq; ++h) {
          const size_t ob = ((static_cast<size_t>(b) * Sq + i) * Hq + h) * D;
          const size_t lb = (static_cast<size_t>(b) * Hq + h) * Sq + i;
          if (bad_seq[b]) {
            ok &= std::isnan(hl[lb]);
            for (int e = 0; e < D; ++e) ok &= std::isnan(tf(ho[ob + e]));
            continue;
          }
          for (int e = 0; e < D; ++e) {
            const double x = tf(ho[ob + e]);
            ok &= std::isfinite(x);
            num += (x - ro[ob + e]) * (x - ro[ob + e]);
            den += ro[ob + e] * ro[ob + e];
          }
          if (std::isinf(rl[lb])) {
            ok &= std::isinf(hl[lb]) && hl[lb] < 0;
            for (int e = 0; e < D; ++e) ok &= tf(ho[ob + e]) == 0.f;
          } else {
            lse_err = std::max(lse_err, std::fabs(hl[lb] - rl[lb]) / std::max(1.0, std::fabs(rl[lb])));
          }
        }
    const double rel = std::sqrt(num / (den > 0 ? den : 1.0));
    ok &= rel <= tol && lse_err <= tol;
    all_ok &= ok;
    std::printf("%-4s %-68s rel err %.3e  lse err %.3e  %s\n", k == kSimt ? "simt" : "mma",
                desc.c_str(), rel, lse_err, ok ? "PASS" : "FAIL");
  }
  d.free_all();
  return all_ok;
}

// ---- the in-register code conversions (q8::cvt4, q8::cvt4_v), every code at every byte ----

template <typename TC>
__global__ void cvt_kernel(uint32_t* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // 256 codes x 4 byte positions
  if (i >= 1024) return;
  const uint32_t c = i & 255, j = i >> 8;
  // the other bytes hold other codes
  uint32_t w = 0;
  for (uint32_t k = 0; k < 4; ++k) w |= (k == j ? c : (c * 37u + 11u * k + 5u) & 0xffu) << (8 * k);
  uint32_t* o = out + 7 * i;  // w, cvt4's lo and hi, cvt4_v's f[4] (second key: ~w ^ 0x5a...)
  o[0] = w;
  paged::q8::cvt4<TC>(w, o[1], o[2]);
  uint32_t f[4];
  paged::q8::cvt4_v<TC>(w, ~w ^ 0x5a5a5a5au, f);
  for (int e = 0; e < 4; ++e) o[3 + e] = f[e];
}

template <typename TC>
static float code_value(uint32_t code) {
  TC x;
  const uint8_t b = static_cast<uint8_t>(code);
  std::memcpy(&x, &b, 1);
  return tf(x);
}

template <typename T>
static uint16_t bits16(float x) {
  const T y = ft<T>(x);
  uint16_t b;
  std::memcpy(&b, &y, 2);
  return b;
}

// Every code at every byte position through cvt4 and cvt4_v, compared bit for bit with the
// reference conversion (code -> float -> float16, exact). The e4m3 NaN codes are skipped (NaN
// bit patterns need not match).
template <typename TC>
static bool check_cvt() {
  using T = __half;
  uint32_t* d;
  CK(cudaMalloc(&d, 1024 * 7 * 4));
  std::vector<uint32_t> a(1024 * 7);
  cvt_kernel<TC><<<4, 256>>>(d);
  CK(cudaMemcpy(a.data(), d, a.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  int bad = 0, checked = 0;
  auto expect = [&](uint32_t code, uint16_t got, const char* what, uint32_t w) {
    if (!std::is_same_v<TC, int8_t> && (code & 0x7f) == 0x7f) return;  // NaN code
    ++checked;
    const uint16_t want = bits16<T>(code_value<TC>(code));
    if (got != want && bad++ < 5)
      std::printf("  %s word %08x code %02x: got %04x want %04x\n", what, w, code, got, want);
  };
  for (int i = 0; i < 1024; ++i) {
    const uint32_t* o = a.data() + 7 * i;
    const uint32_t w = o[0], lo = o[1], hi = o[2];
    const uint32_t c[4] = {w & 255, (w >> 8) & 255, (w >> 16) & 255, w >> 24};
    expect(c[0], lo & 0xffff, "cvt4", w);
    expect(c[1], lo >> 16, "cvt4", w);
    expect(c[2], hi & 0xffff, "cvt4", w);
    expect(c[3], hi >> 16, "cvt4", w);
    const uint32_t wb = ~w ^ 0x5a5a5a5au;
    for (int e = 0; e < 4; ++e) {
      expect(c[e], o[3 + e] & 0xffff, "cvt4_v", w);
      expect((wb >> (8 * e)) & 255, o[3 + e] >> 16, "cvt4_v", w);
    }
  }
  std::printf("%-4s -> f16 code conversion (cvt4, cvt4_v): %d values  %s\n", cname<TC>(),
              checked, bad ? "FAIL" : "PASS");
  return bad == 0;
}

// ---- timing ----

template <typename T>
__global__ void fill_random(T* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = ft<T>((static_cast<float>(h & 0xffff) / 65536.f - 0.5f) * 3.f);
  }
}

static double g_ref_mma_ms = 0;  // last 16-bit row's tensor-core time (tokens/s ratio)
static int g_warm = 5, g_iters = 50;  // --profile: 1 and 1, tensor-core kernel only
static bool g_mma_only = false;
static int g_splits = 0;  // > 0: the tensor-core kernel's split count in timing rows (else the heuristic's)
static bool g_seq_pages = false;  // --seq: each sequence's pages in order (default: shuffled)

template <typename T, typename TC = T>
static void time_case(int B, int ctx, int Hq, int Hkv, int Sq, int D, int ps, int num_sms,
                      ScaleMode sm = ScaleMode::kNone) {
  if (!is8<TC>()) sm = ScaleMode::kNone;
  const int max_pages = (ctx + ps - 1) / ps;
  const int num_pages = B * max_pages;
  std::vector<int32_t> bt(static_cast<size_t>(B) * max_pages);
  std::vector<int> perm(num_pages);
  for (int i = 0; i < num_pages; ++i) perm[i] = i;
  if (!g_seq_pages) std::shuffle(perm.begin(), perm.end(), rng);
  for (size_t i = 0; i < bt.size(); ++i) bt[i] = perm[i];
  std::vector<int> lens(B, ctx);
  const size_t nq = static_cast<size_t>(B) * Sq * Hq * D;
  const size_t nkv = static_cast<size_t>(num_pages) * ps * Hkv * D;
  const int G = Hq / Hkv;
  int splits[2];
  for (int k = 0; k < 2; ++k)  // 0: the CUDA-core kernel's split count, 1: the tensor-core one's
    splits[k] = policy::paged_num_splits(B, Hkv, G, Sq, int64_t(max_pages) * ps, num_sms, D,
                                         k == 1, static_cast<int>(sizeof(TC)),
                                         static_cast<int>(sizeof(T)));
  if (g_splits > 0) splits[1] = g_splits;
  const int max_s = std::max(splits[0], splits[1]);
  Dev d;
  CK(cudaMalloc(&d.q, nq * sizeof(T)));
  CK(cudaMalloc(&d.k, nkv * sizeof(TC)));
  CK(cudaMalloc(&d.v, nkv * sizeof(TC)));
  CK(cudaMalloc(&d.o, nq * sizeof(T)));
  CK(cudaMalloc(&d.lse, static_cast<size_t>(B) * Hq * Sq * 4));
  CK(cudaMalloc(&d.op, nq * max_s * 4));
  const size_t nsc = sm == ScaleMode::kPerHead ? Hkv : (sm == ScaleMode::kPerToken ? nkv / D : 0);
  if (nsc > 0) {
    std::vector<float> hs(nsc);
    for (size_t i = 0; i < nsc; ++i) hs[i] = (1.f + 0.25f * static_cast<float>(i % 7)) / 84.f;
    CK(cudaMalloc(&d.ks, nsc * 4));
    CK(cudaMalloc(&d.vs, nsc * 4));
    CK(cudaMemcpy(d.ks, hs.data(), nsc * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.vs, hs.data(), nsc * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&d.lp, static_cast<size_t>(B) * Hq * Sq * max_s * 4));
  CK(cudaMalloc(&d.bt, bt.size() * 4));
  CK(cudaMalloc(&d.kl, B * 4));
  fill_random<T><<<1024, 256>>>(static_cast<T*>(d.q), nq, 1);
  fill_random<TC><<<4096, 256>>>(static_cast<TC*>(d.k), nkv, 2);
  fill_random<TC><<<4096, 256>>>(static_cast<TC*>(d.v), nkv, 3);
  CK(cudaMemcpy(d.bt, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.kl, lens.data(), B * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  // bytes read: K and V (and their per-token scales)
  const double bytes = 2.0 * B * double(ctx) * Hkv * (D * sizeof(TC) +
                                                      (sm == ScaleMode::kPerToken ? 4 : 0));
  double med[2];
  std::vector<T> out[2];
  for (int k = g_mma_only ? 1 : 0; k < 2; ++k) {
    const PagedAttentionParams p = make_params<T, TC>(d, B, Sq, Hq, Hkv, D, num_pages, ps,
                                                      max_pages, splits[k], 0.f, -1, 0, sm);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int w = 0; w < g_warm; ++w) CK((run_kernel<T, TC>(static_cast<Kernel>(k), p, 0)));
    std::vector<float> ms;
    for (int it = 0; it < g_iters; ++it) {
      CK(cudaEventRecord(e0));
      CK((run_kernel<T, TC>(static_cast<Kernel>(k), p, 0)));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t = 0;
      CK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    med[k] = ms[ms.size() / 2];
    out[k].resize(nq);
    CK(cudaMemcpy(out[k].data(), d.o, nq * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  if (g_mma_only) {
    med[0] = med[1];
    out[0] = out[1];
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < nq; ++i) {
    const double a = tf(out[0][i]), b = tf(out[1][i]);
    num += (a - b) * (a - b);
    den += a * a;
  }
  // 8-bit rows: tokens/s relative to the preceding 16-bit row's tensor-core kernel
  char extra[64] = "";
  if (!is8<TC>()) {
    g_ref_mma_ms = med[1];
  } else if (g_ref_mma_ms > 0) {
    std::snprintf(extra, sizeof(extra), "  mma tokens/s %.2fx 16-bit", g_ref_mma_ms / med[1]);
  }
  std::printf(
      "%-4s%-6s B=%-3d ctx=%-6d Hq/Hkv=%d/%d Sq=%d D=%d page=%d: simt %8.1f us (s%-2d %6.0f GB/s)  "
      "mma %8.1f us (s%-2d %6.0f GB/s)  speedup %.2fx  simt-vs-mma rel diff %.1e%s\n",
      cname<TC>(), sm == ScaleMode::kPerHead ? "/head" : (sm == ScaleMode::kPerToken ? "/token" : ""),
      B, ctx, Hq, Hkv, Sq, D, ps, med[0] * 1e3, splits[0], bytes / (med[0] * 1e6), med[1] * 1e3,
      splits[1], bytes / (med[1] * 1e6), med[0] / med[1], std::sqrt(num / (den > 0 ? den : 1)),
      extra);
  d.free_all();
}

int main(int argc, char** argv) {
  int dev = 0, num_sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs\n", prop.name, num_sms);
  bool ok = true;
  bool no_timing = false, q8_only = false;  // --no-timing; --q8: only the 8-bit cases and rows
  bool profile = false;  // --profile: one launch of the tensor-core kernel per timing row
  bool bw = false;       // --bw: the tensor-core kernel's time at the benchmark's main shapes
  bool d64 = false;      // --d64: the same for head dim 64, with 1-4 splits at 64 x 8k
  bool merge = false;    // --merge: split-KV shapes with and without the merge
  bool mha = false;      // --mha: both kernels at 1 and 2 query rows per kv head (G * Sq < 4)
  for (int i = 1; i < argc; ++i) {
    no_timing |= std::string(argv[i]) == "--no-timing";
    q8_only |= std::string(argv[i]) == "--q8";
    profile |= std::string(argv[i]) == "--profile";
    bw |= std::string(argv[i]) == "--bw";
    g_seq_pages |= std::string(argv[i]) == "--seq";
    d64 |= std::string(argv[i]) == "--d64";
    merge |= std::string(argv[i]) == "--merge";
    mha |= std::string(argv[i]) == "--mha";
  }
  if (mha) {  // the CUDA-core kernel (4-row CTAs) against the tensor-core one (16-row CTAs)
    g_iters = 100;
    for (int Hkv : {32, 16}) {
      for (int D : {128, 64}) {
        time_case<__nv_bfloat16>(64, 8192, 32, Hkv, 1, D, 16, num_sms);
        time_case<__nv_bfloat16>(256, 1024, 32, Hkv, 1, D, 16, num_sms);
        time_case<__nv_bfloat16>(8, 8192, 32, Hkv, 1, D, 16, num_sms);
        time_case<__nv_bfloat16>(1, 32768, 32, Hkv, 1, D, 16, num_sms);
      }
      time_case<__nv_bfloat16, __nv_fp8_e4m3>(64, 8192, 32, Hkv, 1, 128, 16, num_sms,
                                              ScaleMode::kPerToken);
      time_case<__nv_bfloat16, __nv_fp8_e4m3>(1, 32768, 32, Hkv, 1, 128, 16, num_sms,
                                              ScaleMode::kPerToken);
    }
    time_case<__nv_bfloat16>(64, 8192, 32, 32, 2, 128, 16, num_sms);  // Sq 2: 2 rows
    return 0;
  }
  if (merge) {  // split-KV shapes (the heuristic's splits), bf16 32/8 D128 page 16
    // each shape three times: merged (programmatic dependent launch), merged by an ordinary
    // launch, the attention grid alone (merge skipped: the cost of the merge is the difference)
    g_mma_only = true;
    g_iters = 100;
    auto rows = [&]() {
      time_case<__nv_bfloat16>(1, 8192, 32, 8, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 32, 8, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 131072, 32, 8, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(8, 8192, 32, 8, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 28, 4, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 32, 8, 1, 64, 16, num_sms);
    };
    std::printf("-- merged (programmatic dependent launch)\n");
    rows();
    std::printf("-- merged (ordinary launch)\n");
    g_launch.merge_pdl = false;
    rows();
    std::printf("-- attention grid alone (no merge)\n");
    g_launch.merge_pdl = true;
    g_launch.merge = false;
    rows();
    g_launch.merge = true;
    std::printf("-- split counts around the heuristic's (merged)\n");
    for (int sp : {8, 16, 32, 64, 128}) {
      g_splits = sp;
      time_case<__nv_bfloat16>(1, 8192, 32, 8, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 32, 8, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 28, 4, 1, 128, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 32, 8, 1, 64, 16, num_sms);
      time_case<__nv_bfloat16>(1, 32768, 32, 2, 1, 128, 16, num_sms);  // the heuristic: 128
      time_case<__nv_bfloat16>(1, 32768, 32, 1, 1, 128, 16, num_sms);  // 2 chunks; 128
      time_case<__nv_bfloat16>(2, 32768, 28, 4, 1, 128, 16, num_sms);  // 32
    }
    g_splits = 0;
    return 0;
  }
  if (d64 && !profile) {  // bf16 32/8 D64 page 16: the heuristic's splits, then 1-4 splits at 64 x 8k
    g_mma_only = true;
    g_iters = 100;
    for (int s : {0, 1, 2, 3, 4}) {
      g_splits = s;
      time_case<__nv_bfloat16>(64, 8192, 32, 8, 1, 64, 16, num_sms);
    }
    g_splits = 0;
    time_case<__nv_bfloat16>(128, 2048, 32, 8, 1, 64, 16, num_sms);
    time_case<__nv_bfloat16>(256, 1024, 32, 8, 1, 64, 16, num_sms);
    time_case<__nv_bfloat16>(8, 8192, 32, 8, 1, 64, 16, num_sms);
    time_case<__nv_bfloat16>(1, 32768, 32, 8, 1, 64, 16, num_sms);
    time_case<__nv_bfloat16>(64, 8192, 32, 8, 1, 128, 16, num_sms);
    for (int s : {1, 2, 3, 4}) {  // 8-bit D64 at 64 x 8k: 512 CTAs make 1.29 waves at 3 per SM
      g_splits = s;
      time_case<__nv_bfloat16, __nv_fp8_e4m3>(64, 8192, 32, 8, 1, 64, 16, num_sms,
                                              ScaleMode::kPerHead);
    }
    g_splits = 0;
    for (int B : {64, 256}) {
      const int ctx = B == 64 ? 8192 : 1024;
      time_case<__nv_bfloat16>(B, ctx, 32, 8, 1, 64, 16, num_sms);
      time_case<__nv_bfloat16, __nv_fp8_e4m3>(B, ctx, 32, 8, 1, 64, 16, num_sms,
                                              ScaleMode::kPerHead);
      time_case<__nv_bfloat16, int8_t>(B, ctx, 32, 8, 1, 64, 16, num_sms, ScaleMode::kPerToken);
    }
    return 0;
  }
  if (bw) {  // bf16 32/8 D128 page 16 at 64 x 8k, 128 x 2k, 256 x 1k; e4m3 at 64 x 8k
    g_mma_only = true;
    g_iters = 100;
    time_case<__nv_bfloat16>(64, 8192, 32, 8, 1, 128, 16, num_sms);
    time_case<__nv_bfloat16>(128, 2048, 32, 8, 1, 128, 16, num_sms);
    time_case<__nv_bfloat16>(256, 1024, 32, 8, 1, 128, 16, num_sms);
    // 64 x 8k again: the drift between rows, and the 16-bit reference of the 8-bit rows below
    time_case<__nv_bfloat16>(64, 8192, 32, 8, 1, 128, 16, num_sms);
    time_case<__nv_bfloat16, __nv_fp8_e4m3>(64, 8192, 32, 8, 1, 128, 16, num_sms,
                                            ScaleMode::kPerHead);
    time_case<__nv_bfloat16, __nv_fp8_e4m3>(64, 8192, 32, 8, 1, 128, 16, num_sms,
                                            ScaleMode::kPerToken);
    return 0;
  }
  if (profile) {  // for ncu: B=64 ctx=8k, bf16 / e4m3 per head (D128, or D64 with --d64), and
                  // at D128 e4m3 per token with bf16 and f16 q
    g_warm = 1;
    g_iters = 1;
    g_mma_only = true;
    const int D = d64 ? 64 : 128;
    time_case<__nv_bfloat16>(64, 8192, 32, 8, 1, D, 16, num_sms);
    time_case<__nv_bfloat16, __nv_fp8_e4m3>(64, 8192, 32, 8, 1, D, 16, num_sms,
                                            ScaleMode::kPerHead);
    if (!d64) {
      time_case<__nv_bfloat16, __nv_fp8_e4m3>(64, 8192, 32, 8, 1, 128, 16, num_sms,
                                              ScaleMode::kPerToken);
      time_case<__half, __nv_fp8_e4m3>(64, 8192, 32, 8, 1, 128, 16, num_sms,
                                       ScaleMode::kPerToken);
    }
    return 0;
  }
  ok &= check_cvt<int8_t>();
  ok &= check_cvt<__nv_fp8_e4m3>();
  const std::vector<int> lens = {0, 5, 97, 333, 1001};
  for (int D : {64, 128, 256})
    for (int G : {4, 8})
      for (int Sq : {1, 4})
        for (int ps : {7, 16})
          for (int splits : {1, 3}) {
            if (q8_only) continue;
            Case c{D, G, 2, Sq, ps, splits, lens};
            ok &= run_case<__nv_bfloat16>(c);
          }
  // odd groups (padding rows, several 16-row chunks), options, float16, bad data
  for (int D : {64, 128, 256}) {
    if (q8_only) break;
    Case c{D, 3, 2, 2, 16, 2, lens};  // 6 rows
    ok &= run_case<__nv_bfloat16>(c);
    Case c2{D, 7, 2, 4, 7, 3, lens};  // 28 rows: two chunks
    ok &= run_case<__nv_bfloat16>(c2);
    Case c3{D, 8, 2, 4, 16, 1, lens};
    c3.softcap = 4.f;
    ok &= run_case<__half>(c3);
    Case c4{D, 4, 2, 4, 16, 2, lens};
    c4.wl = 40;  // sliding window, causal
    ok &= run_case<__nv_bfloat16>(c4);
    Case c5{D, 4, 2, 4, 5, 3, lens};
    c5.wl = 3;
    c5.wr = 0;
    ok &= run_case<__half>(c5);
    Case c6{D, 8, 2, 4, 16, 2, lens};
    c6.wr = -1;  // non-causal
    ok &= run_case<__nv_bfloat16>(c6);
    Case c7{D, 8, 2, 1, 16, 2, {40, 40, 40, 40, 40}};
    c7.bad = true;
    ok &= run_case<__nv_bfloat16>(c7);
    Case c8{D, 8, 2, 1, 16, 1, {40, 40, 40, 40, 40}};
    c8.bad = true;
    ok &= run_case<__half>(c8);
    Case c9{D, 16, 1, 1, 1, 4, {1, 2, 3, 50, 129}};  // page size 1
    ok &= run_case<__nv_bfloat16>(c9);
  }
  // 8-bit caches (int8, e4m3) with per-head and per-token scales, both q dtypes
  for (int D : {64, 128, 256}) {
    for (ScaleMode sm : {ScaleMode::kPerHead, ScaleMode::kPerToken}) {
      Case a{D, 4, 2, 1, 16, 1, lens};
      a.scale = sm;
      ok &= run_case<__nv_bfloat16, int8_t>(a);
      ok &= run_case<__half, __nv_fp8_e4m3>(a);
      Case b2{D, 8, 2, 4, 7, 3, lens};
      b2.scale = sm;
      ok &= run_case<__half, int8_t>(b2);
      ok &= run_case<__nv_bfloat16, __nv_fp8_e4m3>(b2);
      Case c3{D, 7, 2, 4, 5, 2, lens};  // 28 rows: two chunks
      c3.scale = sm;
      c3.softcap = 4.f;
      ok &= run_case<__nv_bfloat16, int8_t>(c3);
      ok &= run_case<__half, __nv_fp8_e4m3>(c3);
      Case c4{D, 4, 2, 4, 16, 2, lens};
      c4.scale = sm;
      c4.wl = 40;
      ok &= run_case<__half, int8_t>(c4);
      ok &= run_case<__nv_bfloat16, __nv_fp8_e4m3>(c4);
      Case c5{D, 8, 2, 1, 16, 2, {40, 40, 40, 40, 40}};
      c5.scale = sm;
      c5.bad = true;
      ok &= run_case<__nv_bfloat16, int8_t>(c5);
      ok &= run_case<__half, __nv_fp8_e4m3>(c5);
      Case c6{D, 16, 1, 1, 1, 4, {1, 2, 3, 50, 129}};  // page size 1
      c6.scale = sm;
      c6.wr = -1;
      ok &= run_case<__half, int8_t>(c6);
      ok &= run_case<__nv_bfloat16, __nv_fp8_e4m3>(c6);
    }
  }
  std::printf("correctness: %s\n", ok ? "ALL PASS" : "SOME FAILED");
  std::printf("default dispatch of supported calls: %s\n",
              policy::paged_use_mma(true, PagedKernel::kAuto) ? "mma" : "simt");
  if (no_timing) return ok ? 0 : 1;
  if (!q8_only) {
    std::printf("timing (bf16, median of 50, K+V bytes / time; each kernel with its own split "
                "heuristic):\n");
    for (int Hq : {32, 64})
      for (int Sq : {1, 4}) time_case<__nv_bfloat16>(64, 8192, Hq, 8, Sq, 128, 16, num_sms);
    for (int Hq : {32, 64})
      for (int Sq : {1, 4}) time_case<__nv_bfloat16>(1, 32768, Hq, 8, Sq, 128, 16, num_sms);
  }
  std::printf("timing, 8-bit caches (bf16 q; GB/s of the 8-bit K+V bytes and per-token scales; "
              "bf16 rows for reference):\n");
  for (int B : {64, 1}) {
    const int ctx = B == 64 ? 8192 : 32768;
    time_case<__nv_bfloat16>(B, ctx, 32, 8, 1, 128, 16, num_sms);
    for (ScaleMode sm : {ScaleMode::kPerHead, ScaleMode::kPerToken}) {
      time_case<__nv_bfloat16, int8_t>(B, ctx, 32, 8, 1, 128, 16, num_sms, sm);
      time_case<__nv_bfloat16, __nv_fp8_e4m3>(B, ctx, 32, 8, 1, 128, 16, num_sms, sm);
    }
    time_case<__half, int8_t>(B, ctx, 32, 8, 1, 128, 16, num_sms, ScaleMode::kPerToken);
    time_case<__half, __nv_fp8_e4m3>(B, ctx, 32, 8, 1, 128, 16, num_sms, ScaleMode::kPerToken);
  }
  return ok ? 0 : 1;
}
