// Parameters of one fused attention backward call, shared by the CPU and CUDA kernels.
//
// The forward call's packed form and masking rules (flash_params.h) hold unchanged: `fwd` is the
// forward call's parameters, with fwd.o and fwd.lse the forward results (inputs here). Given the
// cotangents dO of o and dLSE of lse, the kernels write
//
//     P     = exp(S - lse)                          (S the masked, scaled, soft-capped scores)
//     Delta = rowsum(dO * O) - dLSE                 ([Hq, Tq], float32)
//     dV_j  = sum_i P_ij dO_i
//     dS_ij = P_ij (dO_i . V_j - Delta_i)
//     dZ_ij = dS_ij * (1 - tanh^2(raw_ij / softcap))  with softcap > 0, else dS_ij
//             (raw = softmax_scale * q.k; the soft-capped score is softcap * tanh(raw / softcap))
//     dQ_i  = softmax_scale * sum_j dZ_ij K_j,   dK_j = softmax_scale * sum_i dZ_ij Q_i
//
// dK/dV of a key/value head sum over the Hq/Hkv query heads that read it (GQA), computed without
// repeating K/V. Rows of a query that see no key (lse = -inf) contribute nothing. Every row of
// dq that no sequence owns, and every row of dk/dv that no sequence owns, is written as zero: the
// results are fully defined for any starts/ends.
//
// No XLA headers here: the FFI handlers fill this struct, the kernels read it.
#pragma once

#include <cstdint>

#include "jax_flash/flash_params.h"

namespace jax_flash {

struct FlashBwdParams {
  FlashParams fwd;   // q, k, v, o (forward output), lse (forward lse), extents, masking
  const void* dout;  // [total_q, num_heads, head_dim_v] dtype: cotangent of o
  const float* dlse; // [num_heads, total_q] float32: cotangent of lse
  void* dq;          // [total_q, num_heads,   head_dim]   dtype
  void* dk;          // [total_k, num_heads_k, head_dim]   dtype
  void* dv;          // [total_k, num_heads_k, head_dim_v] dtype

  // Row strides (elements); the head stride is the head dim (contiguous), as in the forward.
  int64_t dout_row_stride, dq_row_stride, dk_row_stride, dv_row_stride;

  // No atomics in any accumulation: results bit-identical run to run (slower where the fast
  // path accumulates dQ with atomics).
  bool deterministic;

  // Device scratch of the CUDA launcher (from XLA's scratch allocator; null on the CPU).
  void* workspace;
  int64_t workspace_bytes;
};

}  // namespace jax_flash
