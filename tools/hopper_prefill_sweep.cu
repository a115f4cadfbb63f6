// A sweep of the Hopper prefill kernel's tiles (hopper::HopperTraits: key tile, ring stages,
// consumer warpgroups, compute width) without JAX, against the library's own choice for the same
// call, on one dense shape: bf16, 32 query / 8 kv heads, B x S, causal or not, head dim D in
// {64, 80, 96, 112, 128}.
//
// The library's choice is the call through run_flash_attention_hopper (the policy picks the
// tile: policy::flash_hopper_tile_dim, flash_hopper_consumers, flash_hopper_causal_tile, and the
// work-item counter where flash_hopper_dynamic_items says so); each variant is a direct
// launch_flash_hopper with its traits (the counter too, where the policy gives it to that tile).
// Times are per call, 20 back-to-back calls in one CUDA graph, best of 5 replays
// (cuda_graph_timing.cuh). Each variant's output is compared with the library's (max |diff|;
// bf16 rounding of a different summation order is up to ~0.008 here, a wrong tile is far off)
// and checked for non-finite values.
//
// Build from the repository root (sm_90a; the Hopper kernel has no code for other targets):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -DJAX_FLASH_SM90A \
//     --expt-relaxed-constexpr -Icuda/include -o /tmp/prefill_sweep tools/hopper_prefill_sweep.cu
// Arguments: B S causal(0/1) D, e.g. `/tmp/prefill_sweep 4 4096 1 96`.
// Output: one line per variant: TFLOP/s (causal counts half), ms per call, max |diff|.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_graph_timing.cuh"
#include "jax_flash/hopper/flash_fwd_launch.cuh"

using namespace jax_flash;
using hopper::HopperTraits;
using T = __nv_bfloat16;

// The library's entry is declared `extern template` by its header (the package compiles it in
// its own files); this tool instantiates the tiles it calls.
template cudaError_t jax_flash::run_flash_attention_hopper<T, 64>(const FlashParams&, cudaStream_t);
template cudaError_t jax_flash::run_flash_attention_hopper<T, 80>(const FlashParams&, cudaStream_t);
template cudaError_t jax_flash::run_flash_attention_hopper<T, 96>(const FlashParams&, cudaStream_t);
template cudaError_t jax_flash::run_flash_attention_hopper<T, 112>(const FlashParams&,
                                                                   cudaStream_t);
template cudaError_t jax_flash::run_flash_attention_hopper<T, 128>(const FlashParams&,
                                                                   cudaStream_t);

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA %s line %d\n", cudaGetErrorString(e_), __LINE__);            \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace {

constexpr int kHq = 32, kHkv = 8;

// Deterministic uniform(-2, 2) values from the element index and a seed.
__global__ void fill_uniform(T* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    x[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 4.f);
  }
}

struct Call {
  int batch, seqlen, head_dim;
  bool causal;
  FlashParams p;
  T* o;
  std::vector<float> library_out;  // the library's output, the reference of the variants
};

std::vector<float> read_out(const Call& c) {
  const size_t n = static_cast<size_t>(c.batch) * c.seqlen * kHq * c.head_dim;
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), c.o, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(h[i]);
  return out;
}

// Runs launch(stream) once (checked against the library's output), then times it.
template <class F>
void report(Call& c, const char* name, F launch) {
  CK(cudaMemset(c.o, 0, static_cast<size_t>(c.batch) * c.seqlen * kHq * c.head_dim * 2));
  CK(launch(cudaStream_t{0}));
  CK(cudaDeviceSynchronize());
  const std::vector<float> out = read_out(c);
  double max_diff = 0.0;
  bool finite = true;
  if (c.library_out.empty()) c.library_out = out;
  for (size_t i = 0; i < out.size(); ++i) {
    finite = finite && std::isfinite(out[i]);
    max_diff = std::fmax(max_diff, std::fabs(out[i] - c.library_out[i]));
  }
  const float us = tools::graph_us([&](cudaStream_t s, int) { return launch(s); }, 20);
  const double flops = 4.0 * c.batch * kHq * double(c.seqlen) * c.seqlen * c.head_dim *
                       (c.causal ? 0.5 : 1.0);
  std::printf("D%-3d B%-3d S%-6d %-6s %-28s %7.1f TFLOP/s %8.3f ms  max|diff| %.4g%s\n",
              c.head_dim, c.batch, c.seqlen, c.causal ? "causal" : "full", name,
              flops / (us * 1e-6) / 1e12, us * 1e-3, max_diff, finite ? "" : "  NON-FINITE");
}

template <int kTile>
void library(Call& c) {
  report(c, "library's choice", [&](cudaStream_t s) {
    return run_flash_attention_hopper<T, kTile>(c.p, s);
  });
}

template <class Tr>
void variant(Call& c, const char* name) {
  report(c, name, [&](cudaStream_t s) {
    return hopper::launch_flash_hopper<T, Tr, false, hopper::PackedKv>(c.p, s);
  });
}

}  // namespace

// The 128 tile computing D = 80 / 96 columns: 2 consumers on 128 x 128 tiles, 3 on 192 x 96.
template <int D>
void narrow_variants(Call& c) {
  library<D>(c);
  variant<HopperTraits<128, 128, 2, true, true, D>>(c, "2c 128x128 st2");
  variant<HopperTraits<128, 96, 2, true, true, D, 3>>(c, "3c 192x96 st2");
  variant<HopperTraits<128, 96, 3, true, true, D, 3>>(c, "3c 192x96 st3");
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::printf("usage: %s B S causal(0/1) D(64/80/96/112/128)\n", argv[0]);
    return 2;
  }
  Call c;
  c.batch = std::atoi(argv[1]);
  c.seqlen = std::atoi(argv[2]);
  c.causal = std::atoi(argv[3]) != 0;
  c.head_dim = std::atoi(argv[4]);
  const int B = c.batch, S = c.seqlen, D = c.head_dim;
  const size_t nq = static_cast<size_t>(B) * S * kHq * D;
  const size_t nk = static_cast<size_t>(B) * S * kHkv * D;
  T *q, *k, *v;
  float* lse;
  int32_t* starts;
  int32_t* ends;
  unsigned long long* counter;
  CK(cudaMalloc(&q, nq * 2));
  CK(cudaMalloc(&k, nk * 2));
  CK(cudaMalloc(&v, nk * 2));
  CK(cudaMalloc(&c.o, nq * 2));
  CK(cudaMalloc(&lse, static_cast<size_t>(B) * S * kHq * 4));
  CK(cudaMalloc(&counter, sizeof(*counter)));
  fill_uniform<<<1024, 256>>>(q, nq, 1);
  fill_uniform<<<1024, 256>>>(k, nk, 2);
  fill_uniform<<<1024, 256>>>(v, nk, 3);
  std::vector<int32_t> hs(B), he(B);
  for (int b = 0; b < B; ++b) hs[b] = b * S, he[b] = (b + 1) * S;
  CK(cudaMalloc(&starts, 4 * B));
  CK(cudaMalloc(&ends, 4 * B));
  CK(cudaMemcpy(starts, hs.data(), 4 * B, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ends, he.data(), 4 * B, cudaMemcpyHostToDevice));

  FlashParams& p = c.p;
  p = FlashParams{};
  p.q = q, p.k = k, p.v = v, p.o = c.o, p.lse = lse;
  p.q_starts = starts, p.q_ends = ends, p.k_starts = starts, p.k_ends = ends;
  p.q_row_stride = p.o_row_stride = kHq * D;
  p.k_row_stride = p.v_row_stride = kHkv * D;
  p.batch = B, p.total_q = p.total_k = B * S, p.max_seqlen_q = S;
  p.num_heads = kHq, p.num_heads_k = kHkv, p.head_dim = p.head_dim_v = D;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(D));
  p.window_left = -1, p.window_right = c.causal ? 0 : -1;
  p.dtype = DType::kBFloat16;
  p.item_counter = counter;

  // Variants: <tile width, key tile, stages, overlap, ping-pong, compute width, consumers>.
  switch (D) {
    case 64:
      library<64>(c);
      variant<HopperTraits<64, 128, 3, true>>(c, "2c 128x128 st3");
      variant<HopperTraits<64, 128, 3, true, true, 64, 3>>(c, "3c 192x128 st3");
      variant<HopperTraits<64, 96, 3, true, true, 64, 3>>(c, "3c 192x96 st3");
      variant<HopperTraits<64, 96, 4, true, true, 64, 3>>(c, "3c 192x96 st4");
      break;
    case 80:
      narrow_variants<80>(c);
      break;
    case 96:
      narrow_variants<96>(c);
      break;
    case 112:
      library<112>(c);
      variant<HopperTraits<128, 128, 2, true, true, 112>>(c, "2c 128x128 st2");
      variant<HopperTraits<128, 64, 2, true, true, 112, 3>>(c, "3c 192x64 st2");
      break;
    case 128:
      library<128>(c);
      variant<HopperTraits<128, 128, 2, true>>(c, "2c 128x128 st2");
      break;
    default:
      std::printf("D must be 64, 80, 96, 112 or 128\n");
      return 2;
  }
  return 0;
}
