# The CUDA kernels' explicit instantiations: one generated .cu per (kernel, element types), each
# the set of head dims (and cache types) that the dispatch of its header selects at run time, so
# that every launcher is compiled once and the heavy kernels compile in parallel, one compile
# unit (and its memory) each. The files are written from instantiation.cu.in into the build tree;
# JAX_FLASH_INSTANTIATION_SOURCES lists them.

set(JAX_FLASH_INSTANTIATION_SOURCES "")

# Writes instantiations/<stem>.cu: `template cudaError_t <FUNCTION><args>(const <PARAMS>&,
# cudaStream_t);` for each element of ARGS (template arguments, e.g. "__half, 128"), with HEADER
# included. WHAT says in words what the file instantiates.
function(jax_flash_instantiate stem)
  cmake_parse_arguments(JF "" "HEADER;FUNCTION;PARAMS;WHAT" "ARGS" ${ARGN})
  set(JF_INSTANTIATIONS "")
  foreach(args IN LISTS JF_ARGS)
    string(APPEND JF_INSTANTIATIONS
           "template cudaError_t ${JF_FUNCTION}<${args}>(const ${JF_PARAMS}&, cudaStream_t);\n")
  endforeach()
  set(out "${CMAKE_CURRENT_BINARY_DIR}/instantiations/${stem}.cu")
  # Rewritten only when the text changes, so a re-configure does not recompile the kernels.
  configure_file("${CMAKE_CURRENT_FUNCTION_LIST_DIR}/instantiation.cu.in" "${out}" @ONLY)
  set(JAX_FLASH_INSTANTIATION_SOURCES ${JAX_FLASH_INSTANTIATION_SOURCES} "${out}" PARENT_SCOPE)
endfunction()

# Element types by file-name tag.
set(_jf_type_f32 float)
set(_jf_type_f16 __half)
set(_jf_type_bf16 __nv_bfloat16)
set(_jf_head_dims 64 128 256)
set(_jf_quant_cache_types int8_t __nv_fp8_e4m3)

# Prefill: one file per (dtype, head dim) of the CUDA-core kernel (every dtype; the head dim
# bounds head_dim and head_dim_v) and of the tensor-core kernel (16-bit dtypes; the tile width,
# policy::flash_mma_tile_dim: its exact variant for head_dim == head_dim_v == the width, its
# padded variant for the multiples of 16 below it).
foreach(kernel simt mma)
  set(tags f16 bf16)
  if(kernel STREQUAL "simt")
    set(tags f32 f16 bf16)
  endif()
  foreach(tag IN LISTS tags)
    foreach(d IN LISTS _jf_head_dims)
      jax_flash_instantiate(flash_attention_${kernel}_${tag}_d${d}
        HEADER jax_flash/flash_attention_${kernel}.cuh FUNCTION run_flash_attention_${kernel}
        PARAMS FlashParams WHAT "${_jf_type_${tag}}, head dim ${d}"
        ARGS "${_jf_type_${tag}}, ${d}")
    endforeach()
  endforeach()
endforeach()

# Prefill on Hopper (wgmma + TMA; code only in the sm_90a pass): one file per 16-bit dtype with
# every tile of policy::flash_hopper_tile_dim (the mma widths, 192, and the 128 tile computing
# 80, 96 or 112 columns), which compile in
# seconds.
set(_jf_hopper_tile_dims 64 80 96 112 128 192 256)
string(REPLACE ";" ", " _jf_hopper_tile_dims_text "${_jf_hopper_tile_dims}")
foreach(tag f16 bf16)
  set(_jf_hopper_args "")
  foreach(d IN LISTS _jf_hopper_tile_dims)
    list(APPEND _jf_hopper_args "${_jf_type_${tag}}, ${d}")
  endforeach()
  jax_flash_instantiate(flash_attention_hopper_${tag}
    HEADER jax_flash/hopper/flash_fwd_launch.cuh FUNCTION run_flash_attention_hopper
    PARAMS FlashParams WHAT "${_jf_type_${tag}}, tile widths ${_jf_hopper_tile_dims_text}"
    ARGS ${_jf_hopper_args})
endforeach()

# Paged multi-token queries on the Hopper prefill kernel (code only in the sm_90a pass): one file
# per 16-bit dtype with every tile width.
string(REPLACE ";" ", " _jf_head_dims_text "${_jf_head_dims}")
foreach(tag f16 bf16)
  set(_jf_hopper_args "")
  foreach(d IN LISTS _jf_head_dims)
    list(APPEND _jf_hopper_args "${_jf_type_${tag}}, ${d}")
  endforeach()
  jax_flash_instantiate(paged_attention_hopper_${tag}
    HEADER jax_flash/hopper/paged_prefill_launch.cuh FUNCTION run_paged_attention_hopper
    PARAMS PagedAttentionParams WHAT "${_jf_type_${tag}}, tile widths ${_jf_head_dims_text}"
    ARGS ${_jf_hopper_args})
endforeach()

# Paged decode: q of each dtype (tag) with a cache of its own type (file <kernel>_<tag>) and with
# the quantized caches (<kernel>_<tag>_q8). The template arguments follow `same` / `quant`, in
# which @T@, @TC@ and @D@ stand for the q type, the cache type and the head dim.
function(jax_flash_instantiate_paged kernel function tags same quant)
  foreach(tag IN LISTS tags)
    set(T ${_jf_type_${tag}})
    set(same_args "")
    set(quant_args "")
    foreach(D IN LISTS _jf_head_dims)
      string(CONFIGURE "${same}" a @ONLY)
      list(APPEND same_args "${a}")
    endforeach()
    foreach(TC IN LISTS _jf_quant_cache_types)
      foreach(D IN LISTS _jf_head_dims)
        string(CONFIGURE "${quant}" a @ONLY)
        list(APPEND quant_args "${a}")
      endforeach()
    endforeach()
    jax_flash_instantiate(${kernel}_${tag}
      HEADER jax_flash/${kernel}.cuh FUNCTION ${function} PARAMS PagedAttentionParams
      WHAT "q and cache of type ${T}" ARGS ${same_args})
    jax_flash_instantiate(${kernel}_${tag}_q8
      HEADER jax_flash/${kernel}.cuh FUNCTION ${function} PARAMS PagedAttentionParams
      WHAT "q of type ${T}, int8 and float8 e4m3 caches" ARGS ${quant_args})
  endforeach()
  set(JAX_FLASH_INSTANTIATION_SOURCES ${JAX_FLASH_INSTANTIATION_SOURCES} PARENT_SCOPE)
endfunction()

# CUDA cores: every q dtype, <TQ, TC, D>.
jax_flash_instantiate_paged(paged_attention paged::launch_paged_attention "f32;f16;bf16"
                            "@T@, @T@, @D@" "@T@, @TC@, @D@")
# Tensor cores: 16-bit q, <T, D> (the cache type defaults to T) and <T, D, TC>; D is the tile
# width (policy::paged_mma_tile_dim), which takes the head dims up to it.
jax_flash_instantiate_paged(paged_attention_mma paged::launch_paged_attention_mma "f16;bf16"
                            "@T@, @D@" "@T@, @D@, @TC@")

# Backward: the CUDA-core kernels (every dtype; one file per dtype holds the three head-dim
# bounds, the kernels being small) and the tensor-core kernel (16-bit dtypes, tile widths 64, 128
# and 256, policy::flash_bwd_mma_tile_dim: the 256-wide tile takes D in (128, 256]).
foreach(tag f32 f16 bf16)
  jax_flash_instantiate(flash_attention_bwd_simt_${tag}
    HEADER jax_flash/flash_attention_bwd_simt.cuh FUNCTION run_flash_attention_bwd_simt
    PARAMS FlashBwdParams WHAT "${_jf_type_${tag}}, head dims up to 64, 128, 256"
    ARGS "${_jf_type_${tag}}, 64" "${_jf_type_${tag}}, 128" "${_jf_type_${tag}}, 256")
endforeach()
foreach(tag f16 bf16)
  foreach(d 64 128 256)
    jax_flash_instantiate(flash_attention_bwd_mma_${tag}_d${d}
      HEADER jax_flash/flash_attention_bwd_mma.cuh FUNCTION run_flash_attention_bwd_mma
      PARAMS FlashBwdParams WHAT "${_jf_type_${tag}}, head dim ${d}"
      ARGS "${_jf_type_${tag}}, ${d}")
  endforeach()
endforeach()

# Backward on Hopper (wgmma + TMA; code only in the sm_90a pass): one file per 16-bit dtype with
# head dims 64 and 128.
foreach(tag f16 bf16)
  jax_flash_instantiate(flash_attention_bwd_hopper_${tag}
    HEADER jax_flash/hopper/flash_bwd_launch.cuh FUNCTION run_flash_attention_bwd_hopper
    PARAMS FlashBwdParams WHAT "${_jf_type_${tag}}, head dims 64, 128"
    ARGS "${_jf_type_${tag}}, 64" "${_jf_type_${tag}}, 128")
  # The 256-wide tile (head dims past 128): a file of its own, so that the compile spreads.
  jax_flash_instantiate(flash_attention_bwd_hopper_wide_${tag}
    HEADER jax_flash/hopper/flash_bwd_launch.cuh FUNCTION run_flash_attention_bwd_hopper
    PARAMS FlashBwdParams WHAT "${_jf_type_${tag}}, head dim 256"
    ARGS "${_jf_type_${tag}}, 256")
endforeach()
