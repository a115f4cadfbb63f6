// The `policy` submodule of the `_cpu` module: the decisions and limits of
// jax_flash/policy/*.h for Python, which calls them instead of keeping copies
// (tests/test_policy.py pins that the ops use them).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "jax_flash/paged_params.h"
#include "jax_flash/policy/flash.h"
#include "jax_flash/policy/limits.h"
#include "jax_flash/policy/paged.h"

namespace jax_flash {

namespace policy_module {

namespace nb = nanobind;

inline DType q_dtype(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  throw nb::value_error(("q dtype must be float32, float16 or bfloat16, got " + name).c_str());
}

inline CacheDType cache_dtype(const std::string& name) {
  if (name == "float32") return CacheDType::kFloat32;
  if (name == "float16") return CacheDType::kFloat16;
  if (name == "bfloat16") return CacheDType::kBFloat16;
  if (name == "int8") return CacheDType::kInt8;
  if (name == "float8_e4m3fn") return CacheDType::kFloat8E4M3;
  throw nb::value_error(("cache dtype must be float32, float16, bfloat16, int8 or "
                         "float8_e4m3fn, got " + name).c_str());
}

inline PagedKernel paged_kernel(int kernel) {
  if (kernel < 0 || kernel > 2)
    throw nb::value_error(("kernel must be 0, 1 or 2, got " + std::to_string(kernel)).c_str());
  return static_cast<PagedKernel>(kernel);
}

}  // namespace policy_module

inline void def_policy_module(nanobind::module_& parent) {
  namespace nb = nanobind;
  using namespace nb::literals;
  namespace pm = policy_module;
  nb::module_ m = parent.def_submodule(
      "policy", "Decisions and limits of the CUDA kernels (jax_flash/policy/*.h), for Python.");
  m.attr("FLASH_MAX_HEAD_DIM") = policy::kFlashMaxHeadDim;
  nb::list dims;
  for (int d : policy::kPagedHeadDims) dims.append(d);
  m.attr("PAGED_HEAD_DIMS") = nb::tuple(dims);
  m.attr("PAGED_MAX_MERGE_SPLITS") = policy::kPagedMaxMergeSplits;
  m.attr("PAGED_MMA_ROWS") = policy::kPagedMmaRows;
  m.attr("ROPE_MAX_QUANT_ROW_BYTES") = policy::kRopeMaxQuantRowBytes;
  nb::dict kernels;
  kernels["auto"] = static_cast<int>(PagedKernel::kAuto);
  kernels["cuda_core"] = static_cast<int>(PagedKernel::kCudaCore);
  kernels["tensor_core"] = static_cast<int>(PagedKernel::kTensorCore);
  m.attr("PAGED_KERNELS") = kernels;

  m.def("paged_head_dim_supported", &policy::paged_head_dim_supported, "head_dim"_a,
        "head_dim_v"_a);
  nb::list tiles;
  for (int d : policy::kPagedMmaTileDims) tiles.append(d);
  m.attr("PAGED_MMA_TILE_DIMS") = nb::tuple(tiles);
  m.def("paged_mma_head_dims_supported",
        [](int64_t d, int64_t dv) { return policy::paged_mma_head_dims_supported(d, dv); },
        "head_dim"_a, "head_dim_v"_a);
  m.def("paged_mma_tile_dim",
        [](int64_t d, int64_t dv) { return policy::paged_mma_tile_dim(d, dv); }, "head_dim"_a,
        "head_dim_v"_a);
  nb::dict paged_choices;
  paged_choices["none"] = static_cast<int>(policy::PagedChoice::kNone);
  paged_choices["cuda_core"] = static_cast<int>(policy::PagedChoice::kCudaCore);
  paged_choices["tensor_core"] = static_cast<int>(policy::PagedChoice::kTensorCore);
  m.attr("PAGED_CHOICES") = paged_choices;
  m.def(
      "paged_kernel_choice",
      [](bool mma_ok, int64_t d, int64_t dv, int kernel) {
        return static_cast<int>(policy::paged_kernel_choice(mma_ok, d, dv, pm::paged_kernel(kernel)));
      },
      "mma_ok"_a, "head_dim"_a, "head_dim_v"_a, "kernel"_a);
  nb::dict flash_choices;
  flash_choices["none"] = static_cast<int>(policy::FlashChoice::kNone);
  flash_choices["simt"] = static_cast<int>(policy::FlashChoice::kSimt);
  flash_choices["tensor_core"] = static_cast<int>(policy::FlashChoice::kTensorCore);
  m.attr("FLASH_CHOICES") = flash_choices;
  m.def("flash_mma_head_dims_supported",
        [](int64_t d, int64_t dv) { return policy::flash_mma_head_dims_supported(d, dv); },
        "head_dim"_a, "head_dim_v"_a);
  m.def("flash_mma_tile_dim",
        [](int64_t d, int64_t dv) { return policy::flash_mma_tile_dim(d, dv); }, "head_dim"_a,
        "head_dim_v"_a);
  m.def("flash_hopper_tile_dim",
        [](int64_t d, int64_t dv) { return policy::flash_hopper_tile_dim(d, dv); }, "head_dim"_a,
        "head_dim_v"_a);
  m.def("flash_hopper_consumers",
        [](int tile_dim, bool softcap, int64_t window_left, int64_t window_right,
           int64_t max_seqlen_q) {
          return policy::flash_hopper_consumers(tile_dim, softcap, window_left, window_right,
                                                max_seqlen_q);
        },
        "tile_dim"_a, "softcap"_a, "window_left"_a, "window_right"_a, "max_seqlen_q"_a);
  m.def("flash_hopper_causal_tile",
        [](int tile_dim, int consumers, int64_t window_right) {
          return policy::flash_hopper_causal_tile(tile_dim, consumers, window_right);
        },
        "tile_dim"_a, "consumers"_a, "window_right"_a);
  m.def(
      "flash_kernel_choice",
      [](const std::string& dtype, int64_t d, int64_t dv, float softmax_scale, float softcap) {
        return static_cast<int>(
            policy::flash_kernel_choice(pm::q_dtype(dtype), d, dv, softmax_scale, softcap));
      },
      "dtype"_a, "head_dim"_a, "head_dim_v"_a, "softmax_scale"_a, "softcap"_a);
  m.def("paged_rows_per_cta",
        [](int64_t rows, int q_bytes) { return policy::paged_rows_per_cta(rows, q_bytes); },
        "rows"_a, "q_bytes"_a);
  m.def("paged_mma_ctas_per_sm",
        [](int head_dim, int elem_bytes) { return policy::paged_mma_ctas_per_sm(head_dim, elem_bytes); },
        "head_dim"_a, "elem_bytes"_a);
  m.def(
      "paged_mma_supported",
      [](const std::string& dtype, const std::string& cache_dtype, int scale_mode,
         int64_t head_dim, int64_t head_dim_v, int64_t num_pages, int64_t page_size,
         int64_t num_heads_k) {
        if (scale_mode < 0 || scale_mode > 2)
          throw nb::value_error(
              ("scale_mode must be 0, 1 or 2, got " + std::to_string(scale_mode)).c_str());
        return policy::paged_mma_supported(pm::q_dtype(dtype), pm::cache_dtype(cache_dtype),
                                           static_cast<ScaleMode>(scale_mode), head_dim,
                                           head_dim_v, num_pages, page_size, num_heads_k);
      },
      "dtype"_a, "cache_dtype"_a, "scale_mode"_a, "head_dim"_a, "head_dim_v"_a, "num_pages"_a,
      "page_size"_a, "num_heads_k"_a);
  m.def(
      "paged_use_mma",
      [](bool mma_ok, int kernel) { return policy::paged_use_mma(mma_ok, pm::paged_kernel(kernel)); },
      "mma_ok"_a, "kernel"_a);
  m.def("paged_num_splits", &policy::paged_num_splits, "batch"_a, "num_heads_k"_a, "group"_a,
        "seqlen_q"_a, "max_ctx"_a, "num_sms"_a, "head_dim"_a, "mma"_a, "cache_bytes"_a,
        "q_bytes"_a);
}

}  // namespace jax_flash
