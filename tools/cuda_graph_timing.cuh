// Shared by the standalone CUDA tools: the time of one call, as n back-to-back calls captured in
// one CUDA graph (no host launch cost between them, as in a model's step), best of 5 replays.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace tools {

inline void graph_check(cudaError_t e, int line) {
  if (e != cudaSuccess) {
    std::printf("CUDA %s (cuda_graph_timing.cuh line %d)\n", cudaGetErrorString(e), line);
    std::exit(2);
  }
}

// launch(stream, i) issues call i (i counts from 0; 3 warm-up calls first) and returns its
// launch status. Returns microseconds per call.
template <class F>
float graph_us(F launch, int n = 100) {
#define GT_CK(x) graph_check((x), __LINE__)
  cudaStream_t s;
  GT_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < 3; ++i) GT_CK(launch(s, i));
  GT_CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  GT_CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) GT_CK(launch(s, i));
  GT_CK(cudaStreamEndCapture(s, &g));
  GT_CK(cudaGraphInstantiate(&ge, g, 0));
  GT_CK(cudaGraphLaunch(ge, s));
  GT_CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  GT_CK(cudaEventCreate(&a));
  GT_CK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    GT_CK(cudaEventRecord(a, s));
    GT_CK(cudaGraphLaunch(ge, s));
    GT_CK(cudaEventRecord(b, s));
    GT_CK(cudaEventSynchronize(b));
    float ms;
    GT_CK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
#undef GT_CK
  return best * 1e3f / n;
}

}  // namespace tools
