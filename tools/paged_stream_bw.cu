// Read bandwidth of the paged-cache access pattern alone (no attention math): each CTA streams
// the K and V rows of one sequence and one group of adjacent KV heads through a ring of shared
// memory with 16-byte cp.async, as the decode kernels do, and only sums one word per tile.
// It separates what the layout allows from what a kernel makes of it: rows of `row` bytes per
// CTA (the heads a CTA reads side by side: 128 = one e4m3 head of D=128, 256 = one bf16 head or
// two e4m3 heads), at a stride of Hkv * D * elem bytes per token, pages shuffled or in order;
// with 16-byte cp.async in rings of several shapes, with one bulk copy (TMA) per row, with CTAs
// that read several heads' rows side by side (whole pages, the context split to keep 512 CTAs),
// with the heads of a sequence in CTA clusters (optionally in lockstep), and with 16-byte loads
// straight into registers.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/sb tools/paged_stream_bw.cu
//   /tmp/sb [B ctx] [--main]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

constexpr int kThreads = 128;

__device__ __forceinline__ void cp16(uint32_t s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g));
}

// kTileBytes: K (or V) bytes of one tile (16 KB in the decode kernels), kStages: ring depth
// (kStages - 1 tiles in flight), kMinBlocks: CTAs per SM the registers must allow.
// grid: batch * groups; CTA (b, grp) reads bytes [grp * row, grp * row + row) of every token of
// sequence b (token t at page bt[b][t / ps], slot t % ps; token stride `stride` bytes).
// kLockstep: the CTAs of a cluster (launched by run_cluster: the heads of one sequence) wait for
// one another once per tile (cluster barrier, arrive after issuing a tile, wait before the next),
// so that they read each page's rows at about the same time.
template <int kTileBytes, int kStages, int kMinBlocks, bool kLockstep = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    stream(const char* k, const char* v, const int* bt, int max_pages, int ps, int ctx, int row,
           int stride, int groups, float* out, int splits) {
  extern __shared__ __align__(128) unsigned char sm[];
  const int split = blockIdx.x % splits, bg = blockIdx.x / splits;
  const int b = bg / groups, grp = bg % groups;
  const int rows_per_tile = kTileBytes / row;
  const int chunks = row / 16;
  const int ntiles = ctx / splits / rows_per_tile;
  const int t0 = split * (ctx / splits);
  const int* bts = bt + static_cast<int64_t>(b) * max_pages;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  auto issue = [&](int n) {
    const uint32_t st = base + (n % kStages) * 2 * kTileBytes;
    for (int i = threadIdx.x; i < rows_per_tile * chunks; i += kThreads) {
      const int r = i / chunks, c = i % chunks;
      const int t = t0 + n * rows_per_tile + r;
      const int64_t off = (static_cast<int64_t>(__ldg(bts + t / ps)) * ps + t % ps) * stride +
                          static_cast<int64_t>(grp) * row + 16 * c;
      cp16(st + 16 * i, k + off);
      cp16(st + kTileBytes + 16 * i, v + off);
    }
  };
  float acc = 0.f;
  for (int n = 0; n < kStages - 1 && n < ntiles; ++n) {
    issue(n);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int n = 0; n < ntiles; ++n) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();
    if constexpr (kLockstep) {
      if (n > 0) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    }
    if (n + kStages - 1 < ntiles) issue(n + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::);
    if constexpr (kLockstep) asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    acc += reinterpret_cast<const float*>(sm + (n % kStages) * 2 * kTileBytes)[threadIdx.x];
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if constexpr (kLockstep) {
    if (ntiles > 0) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  }
  if (acc == 12345.f) out[blockIdx.x] = acc;  // never: keeps the reads
}

// The same stream with bulk copies (TMA engine, sm_90): one cp.async.bulk per K or V row, each
// thread arriving on the stage's mbarrier with the bytes of its own copies. Whole contexts only
// (`splits` is always 1: the signature is stream's, for run()).
template <int kTileBytes, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    stream_bulk(const char* k, const char* v, const int* bt, int max_pages, int ps, int ctx,
                int row, int stride, int groups, float* out, int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t bar[kStages];
  const int b = blockIdx.x / groups, grp = blockIdx.x % groups;
  const int rows_per_tile = kTileBytes / row;
  const int ntiles = ctx / rows_per_tile;
  const int* bts = bt + static_cast<int64_t>(b) * max_pages;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  if (threadIdx.x < kStages) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[threadIdx.x]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(kThreads));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  auto issue = [&](int n) {
    const int st = n % kStages;
    const uint32_t mb = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[st]));
    const uint32_t dst = base + st * 2 * kTileBytes;
    int mine = 0;
    for (int r = threadIdx.x; r < rows_per_tile; r += kThreads) mine += 2 * row;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mb), "r"(mine)
                 : "memory");
    for (int r = threadIdx.x; r < rows_per_tile; r += kThreads) {
      const int t = n * rows_per_tile + r;
      const int64_t off = (static_cast<int64_t>(__ldg(bts + t / ps)) * ps + t % ps) * stride +
                          static_cast<int64_t>(grp) * row;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(dst + r * row), "l"(k + off), "r"(row), "r"(mb) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(dst + kTileBytes + r * row), "l"(v + off), "r"(row), "r"(mb) : "memory");
    }
  };
  float acc = 0.f;
  for (int n = 0; n < kStages - 1 && n < ntiles; ++n) issue(n);
  for (int n = 0; n < ntiles; ++n) {
    const uint32_t mb = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[n % kStages]));
    const uint32_t parity = (n / kStages) & 1;
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done) : "r"(mb), "r"(parity) : "memory");
    }
    __syncthreads();  // every thread is done with tile n - 1: its stage may be refilled
    if (n + kStages - 1 < ntiles) issue(n + kStages - 1);
    acc += reinterpret_cast<const float*>(sm + (n % kStages) * 2 * kTileBytes)[threadIdx.x];
  }
  if (acc == 12345.f) out[blockIdx.x] = acc;  // never: keeps the reads
#endif
}

// The same rows loaded straight into registers (ld.global.nc, 16 bytes, no L1 allocation), no
// shared memory: each thread keeps kU K chunks and kU V chunks in flight per step, and the next
// step's loads are issued before the current step's words are consumed.
template <int kU, int kT, int kMinBlocks>
__global__ void __launch_bounds__(kT, kMinBlocks)
    stream_ldg(const char* k, const char* v, const int* bt, int max_pages, int ps, int ctx,
               int row, int stride, int groups, float* out, int splits) {
  const int split = blockIdx.x % splits, bg = blockIdx.x / splits;
  const int b = bg / groups, grp = bg % groups;
  const int chunks = row / 16;
  const int ntok = ctx / splits;
  const int t0 = split * ntok;
  const int total = ntok * chunks;  // 16-byte chunks of K (and of V) this CTA reads
  const int* bts = bt + static_cast<int64_t>(b) * max_pages;
  auto off = [&](int i) {
    const int r = i / chunks, c = i % chunks;
    const int t = t0 + r;
    return (static_cast<int64_t>(__ldg(bts + t / ps)) * ps + t % ps) * stride +
           static_cast<int64_t>(grp) * row + 16 * c;
  };
  auto ld = [](const char* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
  };
  uint4 ka[kU], va[kU];
  uint32_t acc = 0;
  const int step = kU * kT;
  int i0 = 0;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int i = i0 + u * kT + threadIdx.x;
    if (i < total) {
      const int64_t o = off(i);
      ka[u] = ld(k + o);
      va[u] = ld(v + o);
    }
  }
  for (; i0 < total; i0 += step) {
    uint4 kb[kU], vb[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + step + u * kT + threadIdx.x;
      if (i < total) {
        const int64_t o = off(i);
        kb[u] = ld(k + o);
        vb[u] = ld(v + o);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) acc ^= ka[u].x ^ ka[u].w ^ va[u].y ^ va[u].z;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      ka[u] = kb[u];
      va[u] = vb[u];
    }
  }
  if (acc == 12345u) out[blockIdx.x] = static_cast<float>(acc);  // never: keeps the reads
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  // [B ctx]: the batch and context (default 64 x 8192); --main: only the decode kernels' ring
  // and the whole-page rows, at that shape
  int B = 64, ctx = 8192;
  bool main_only = false;
  for (int i = 1, pos = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--main") {
      main_only = true;
    } else {
      (pos++ == 0 ? B : ctx) = std::atoi(argv[i]);
    }
  }
  const int ps = 16, Hkv = 8;
  std::printf("device: %s, B=%d ctx=%d Hkv=%d page %d\n", prop.name, B, ctx, Hkv, ps);
  const int max_pages = ctx / ps, num_pages = B * max_pages;
  std::mt19937 rng(1);
  std::vector<int> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::vector<int> shuffled = perm;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  int *bt_seq, *bt_rand;
  CK(cudaMalloc(&bt_seq, num_pages * 4));
  CK(cudaMalloc(&bt_rand, num_pages * 4));
  CK(cudaMemcpy(bt_seq, perm.data(), num_pages * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bt_rand, shuffled.data(), num_pages * 4, cudaMemcpyHostToDevice));
  const size_t max_bytes = static_cast<size_t>(num_pages) * ps * Hkv * 128 * 2;  // bf16 D=128
  char *k, *v;
  float* out;
  CK(cudaMalloc(&k, max_bytes));
  CK(cudaMalloc(&v, max_bytes));
  CK(cudaMalloc(&out, 4096 * 4));
  CK(cudaMemset(k, 0, max_bytes));
  CK(cudaMemset(v, 0, max_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // one row: the layout, rows per CTA, ring (tile bytes, stages, CTAs per SM), page order
  // median ms of 25 timed launches (after 5 warm-up ones)
  auto median_ms = [&](auto launch) {
    std::vector<float> ms;
    for (int it = 0; it < 30; ++it) {
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (it >= 5) ms.push_back(t);
    }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return static_cast<double>(ms[ms.size() / 2]);
  };
  auto run = [&](auto kernel, int tile, int stages, int per_sm, const char* name, int token_bytes,
                 int row, int order, int splits = 1, int threads = kThreads) {
    const int smem = stages * 2 * tile;
    if (smem) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int groups = token_bytes / row;
    const int* bt = order ? bt_seq : bt_rand;
    const double bytes = 2.0 * B * ctx * token_bytes;
    const double med = median_ms([&] {
      kernel<<<B * groups * splits, threads, smem>>>(k, v, bt, max_pages, ps, ctx, row,
                                                     token_bytes, groups, out, splits);
    });
    std::printf("%-40s %-8s %4d CTAs  tile %2d KB x %d stages, %d/SM  %8.1f us  %6.0f GB/s\n",
                name, order ? "in-order" : "shuffled", B * groups * splits, tile / 1024, stages,
                per_sm, 1e3 * med, bytes / med / 1e6);
  };
  // the per-head rows launched in clusters of `cl` CTAs (heads of one sequence side by side)
  auto run_cluster = [&](auto kernel, int cl, const char* name, int order) {
    const int tile = 16384, stages = 3, smem = stages * 2 * tile, row = 256, token_bytes = 2048;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int groups = token_bytes / row;
    const int* bt = order ? bt_seq : bt_rand;
    const double bytes = 2.0 * B * ctx * token_bytes;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(B * groups);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cl;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const double med = median_ms([&] {
      CK(cudaLaunchKernelEx(&cfg, kernel, (const char*)k, (const char*)v, bt, max_pages, ps, ctx,
                            row, token_bytes, groups, out, 1));
    });
    std::printf("%-40s %-8s %4d CTAs  clusters of %d             %8.1f us  %6.0f GB/s\n", name,
                order ? "in-order" : "shuffled", B * groups, cl, 1e3 * med, bytes / med / 1e6);
  };
  for (int order = 0; order < 2; ++order) {
    run_cluster(stream<16384, 3, 2, false>, 8, "bf16 D128 per head, cluster 8", order);
    run_cluster(stream<16384, 3, 2, true>, 8, "bf16 D128 per head, cluster 8 lockstep", order);
    run_cluster(stream<16384, 3, 2, true>, 4, "bf16 D128 per head, cluster 4 lockstep", order);
    run_cluster(stream<16384, 3, 2, true>, 2, "bf16 D128 per head, cluster 2 lockstep", order);
  }
  for (int order = 0; order < 2; ++order) {
    // the decode kernels' ring: 16 KB tiles, 3 stages, 2 CTAs per SM
    run(stream<16384, 3, 2>, 16384, 3, 2, "bf16 D128 (256 B rows, 2 KB stride)", 2048, 256, order);
    run(stream<16384, 3, 2>, 16384, 3, 2, "e4m3 D128 (128 B rows, 1 KB stride)", 1024, 128, order);
    run(stream<16384, 3, 2>, 16384, 3, 2, "e4m3 D128 x2 heads (256 B rows)", 1024, 256, order);
    run(stream<16384, 3, 2>, 16384, 3, 2, "bf16 D64 (128 B rows, 1 KB stride)", 1024, 128, order);
  }
  // CTAs that read several heads side by side (whole pages at 2048-byte rows), the context split
  // so that the CTA count stays 512
  for (int order = 0; order < 2; ++order) {
    run(stream<16384, 3, 2>, 16384, 3, 2, "bf16 D128 x2 heads (512 B rows), 2 splits", 2048, 512,
        order, 2);
    run(stream<16384, 3, 2>, 16384, 3, 2, "bf16 D128 x8 heads (whole pages), 8 splits", 2048,
        2048, order, 8);
    run(stream<32768, 3, 1>, 32768, 3, 1, "bf16 D128 x8 heads (whole pages), 8 splits", 2048,
        2048, order, 8);
  }
  if (main_only) return 0;
  // register-direct loads: kU chunks of K and of V per thread per step, double-buffered
  for (int order = 0; order < 2; ++order) {
    run(stream_ldg<4, 128, 4>, 0, 0, 4, "ldg U4 x128: bf16 D128 (256 B rows)", 2048, 256, order);
    run(stream_ldg<8, 128, 4>, 0, 0, 4, "ldg U8 x128: bf16 D128 (256 B rows)", 2048, 256, order);
    run(stream_ldg<4, 128, 8>, 0, 0, 8, "ldg U4 x128: bf16 D128 (256 B rows)", 2048, 256, order);
    run(stream_ldg<4, 256, 2>, 0, 0, 2, "ldg U4 x256: bf16 D128 (256 B rows)", 2048, 256, order,
        1, 256);
    run(stream_ldg<8, 256, 2>, 0, 0, 2, "ldg U8 x256: bf16 D128 (256 B rows)", 2048, 256, order,
        1, 256);
    run(stream_ldg<4, 256, 2>, 0, 0, 2, "ldg U4 x256: bf16 D128 x8 heads, 8 splits", 2048, 2048,
        order, 8, 256);
    run(stream_ldg<4, 128, 4>, 0, 0, 4, "ldg U4 x128: e4m3 D128 (128 B rows)", 1024, 128, order);
    run(stream_ldg<8, 128, 4>, 0, 0, 4, "ldg U8 x128: e4m3 D128 (128 B rows)", 1024, 128, order);
  }
  // other rings for the bf16 D128 layout, shuffled pages
  run(stream<8192, 6, 2>, 8192, 6, 2, "bf16 D128", 2048, 256, 0);
  run(stream<8192, 4, 3>, 8192, 4, 3, "bf16 D128", 2048, 256, 0);
  run(stream<16384, 6, 1>, 16384, 6, 1, "bf16 D128", 2048, 256, 0);
  run(stream<16384, 4, 1>, 16384, 4, 1, "bf16 D128", 2048, 256, 0);
  run(stream<8192, 3, 4>, 8192, 3, 4, "bf16 D128", 2048, 256, 0);
  run(stream<4096, 6, 4>, 4096, 6, 4, "bf16 D128", 2048, 256, 0);
  run(stream<16384, 3, 2>, 16384, 3, 2, "bf16 D128", 2048, 256, 0);
  // bulk copies (one per row)
  for (int order = 0; order < 2; ++order) {
    run(stream_bulk<16384, 3, 2>, 16384, 3, 2, "bulk: bf16 D128", 2048, 256, order);
    run(stream_bulk<16384, 3, 2>, 16384, 3, 2, "bulk: e4m3 D128", 1024, 128, order);
  }
  run(stream_bulk<16384, 6, 1>, 16384, 6, 1, "bulk: bf16 D128", 2048, 256, 0);
  run(stream_bulk<8192, 6, 2>, 8192, 6, 2, "bulk: bf16 D128", 2048, 256, 0);
  return 0;
}
