// Where a small-batch paged decode call spends its time, without JAX: the tensor-core kernel at
// B = 1, 32/8 heads, bf16, page 16, by split count, with the split-KV merge (programmatic
// dependent launch or not) and without it, timed as 100 back-to-back calls captured in one CUDA
// graph (no host launch cost, as in a model's step), beside an empty kernel and plain reads of
// 4-64 MB. The cache is zeros (timing only; tools/paged_mma_check.cu checks the results).
//
// Build and run from the repository root:
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -Icuda/include \
//     -o /tmp/pgt tools/paged_graph_time.cu && /tmp/pgt
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>
#include "jax_flash/paged_attention_mma.cuh"
#include "cuda_graph_timing.cuh"
using namespace jax_flash;
typedef __nv_bfloat16 bf;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e_), __LINE__); exit(2); } } while (0)

__global__ void empty_kernel(int) {}
__global__ void read_kernel(const uint4* x, size_t n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint4 v = __ldcs(x + i); acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if (acc.x == 0x12345678) sink[0] = acc;
}

using tools::graph_us;  // n calls in one CUDA graph, us per call (cuda_graph_timing.cuh)

template <int D>
void run(int ctx, int num_sms) {
  const int B = 1, Hq = 32, Hkv = 8, ps = 16;
  const int max_pages = (ctx + ps - 1) / ps, num_pages = B * max_pages;
  std::vector<int> bt(num_pages); std::iota(bt.begin(), bt.end(), 0);
  std::shuffle(bt.begin(), bt.end(), std::mt19937(1));
  int kl = ctx;
  void *q, *k, *v, *o, *op; float *lse, *lp; int32_t *dbt, *dkl;
  const size_t nkv = size_t(num_pages) * ps * Hkv * D;
  CK(cudaMalloc(&q, Hq * D * 2)); CK(cudaMalloc(&k, nkv * 2)); CK(cudaMalloc(&v, nkv * 2));
  CK(cudaMalloc(&o, Hq * D * 2)); CK(cudaMalloc(&lse, Hq * 4));
  CK(cudaMalloc(&op, 256 * Hq * D * 4)); CK(cudaMalloc(&lp, 256 * Hq * 4));
  CK(cudaMemset(q, 0, Hq * D * 2)); CK(cudaMemset(k, 0, nkv * 2)); CK(cudaMemset(v, 0, nkv * 2));
  CK(cudaMalloc(&dbt, num_pages * 4)); CK(cudaMalloc(&dkl, 4));
  CK(cudaMemcpy(dbt, bt.data(), num_pages * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dkl, &kl, 4, cudaMemcpyHostToDevice));
  PagedAttentionParams p{};
  p.q = q; p.k_pages = k; p.v_pages = v; p.block_tables = dbt; p.kv_lens = dkl; p.o = o; p.lse = lse;
  p.o_partial = (float*)op; p.lse_partial = lp; p.batch = B; p.seqlen_q = 1; p.num_heads = Hq;
  p.num_heads_k = Hkv; p.head_dim = D; p.head_dim_v = D; p.num_pages = num_pages; p.page_size = ps;
  p.max_pages = max_pages; p.softmax_scale = 0.1f; p.window_left = -1; p.window_right = -1;
  p.dtype = DType::kBFloat16; p.cache_dtype = CacheDType::kBFloat16; p.scale_mode = ScaleMode::kNone;
  const int pol = policy::paged_num_splits(B, Hkv, Hq / Hkv, 1, int64_t(max_pages) * ps, num_sms, D, true, 2, 2);
  const double bytes = 2.0 * ctx * Hkv * D * 2;
  printf("D %d ctx %d (%.1f MB, policy splits %d)\n", D, ctx, bytes / 1e6, pol);
  for (int s : {1, 4, 8, 16, 32, 64}) {
    if (s > 128 || (s > 1 && ctx / s < 16)) continue;
    p.num_splits = s;
    float t[4];
    for (int var = 0; var < 4; ++var) {
      p.launch = PagedLaunch{};
      if (var == 1) p.launch.merge = false;                       // attention grid alone
      if (var == 2) { p.launch.pdl = false; p.launch.merge_pdl = false; }  // ordinary launches
      if (var == 3) p.launch.merge_pdl = false;
      t[var] = graph_us([&](cudaStream_t st, int) { return paged::launch_paged_attention_mma<bf, D, bf>(p, st); });
    }
    printf("  s%-3d %s call %6.2f us (%5.0f GB/s)  attention alone %6.2f  no pdl %6.2f  merge not pdl %6.2f\n",
           s, s == pol ? "*" : " ", t[0], bytes / t[0] / 1e3, t[1], t[2], t[3]);
  }
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse); cudaFree(op); cudaFree(lp);
  cudaFree(dbt); cudaFree(dkl);
}

int main() {
  int dev = 0, sms = 0; cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceProp pr; cudaGetDeviceProperties(&pr, dev); printf("%s, %d SMs\n", pr.name, sms);
  printf("empty kernel in a graph: %.2f us\n", graph_us([](cudaStream_t s, int) { empty_kernel<<<1, 32, 0, s>>>(0); return cudaGetLastError(); }));
  for (size_t mb : {4, 16, 32, 64}) {
    uint4 *x, *sink; size_t n = mb * 1000000 / 16;
    CK(cudaMalloc(&x, n * 16)); CK(cudaMalloc(&sink, 16)); CK(cudaMemset(x, 1, n * 16));
    for (int grid : {132, 264, 528, 1056}) {
      float t = graph_us([&](cudaStream_t s, int) { read_kernel<<<grid, 512, 0, s>>>(x, n, sink); return cudaGetLastError(); });
      printf("read %zu MB grid %d: %.2f us (%.0f GB/s)\n", mb, grid, t, mb * 1e6 / t / 1e3);
    }
    cudaFree(x); cudaFree(sink);
  }
  for (int ctx : {16, 256, 2048, 8192, 32768}) run<64>(ctx, sms);
  for (int ctx : {16, 2048, 8192, 32768}) run<128>(ctx, sms);
  return 0;
}
template cudaError_t jax_flash::paged::launch_paged_attention_mma<bf, 64, bf>(const PagedAttentionParams&, cudaStream_t);
template cudaError_t jax_flash::paged::launch_paged_attention_mma<bf, 128, bf>(const PagedAttentionParams&, cudaStream_t);
