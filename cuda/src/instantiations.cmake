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

# Prefill, CUDA cores: every dtype; kMaxHeadDim bounds head_dim and head_dim_v.
foreach(tag f32 f16 bf16)
  foreach(d IN LISTS _jf_head_dims)
    jax_flash_instantiate(flash_attention_simt_${tag}_d${d}
      HEADER jax_flash/flash_attention_simt.cuh FUNCTION run_flash_attention_simt
      PARAMS FlashParams WHAT "${_jf_type_${tag}}, head dims <= ${d}"
      ARGS "${_jf_type_${tag}}, ${d}")
  endforeach()
endforeach()

# Prefill, tensor cores: 16-bit dtypes, head_dim == head_dim_v == d.
foreach(tag f16 bf16)
  foreach(d IN LISTS _jf_head_dims)
    jax_flash_instantiate(flash_attention_mma_${tag}_d${d}
      HEADER jax_flash/flash_attention_mma.cuh FUNCTION run_flash_attention_mma
      PARAMS FlashParams WHAT "${_jf_type_${tag}}, head dim ${d}"
      ARGS "${_jf_type_${tag}}, ${d}")
  endforeach()
endforeach()

# Paged decode, CUDA cores: q of each dtype with a cache of the same type (<tag>) or quantized
# (<tag>_q8); <TQ, TC, D>.
foreach(tag f32 f16 bf16)
  set(t ${_jf_type_${tag}})
  set(same "")
  set(quant "")
  foreach(d IN LISTS _jf_head_dims)
    list(APPEND same "${t}, ${t}, ${d}")
  endforeach()
  foreach(tc IN LISTS _jf_quant_cache_types)
    foreach(d IN LISTS _jf_head_dims)
      list(APPEND quant "${t}, ${tc}, ${d}")
    endforeach()
  endforeach()
  jax_flash_instantiate(paged_attention_${tag}
    HEADER jax_flash/paged_attention.cuh FUNCTION paged::launch_paged_attention
    PARAMS PagedAttentionParams WHAT "q and cache of type ${t}" ARGS ${same})
  jax_flash_instantiate(paged_attention_${tag}_q8
    HEADER jax_flash/paged_attention.cuh FUNCTION paged::launch_paged_attention
    PARAMS PagedAttentionParams WHAT "q of type ${t}, int8 and float8 e4m3 caches" ARGS ${quant})
endforeach()

# Paged decode, tensor cores: 16-bit q with a cache of its type (<T, D>) or quantized
# (<T, D, TC>).
foreach(tag f16 bf16)
  set(t ${_jf_type_${tag}})
  set(same "")
  set(quant "")
  foreach(d IN LISTS _jf_head_dims)
    list(APPEND same "${t}, ${d}")
  endforeach()
  foreach(tc IN LISTS _jf_quant_cache_types)
    foreach(d IN LISTS _jf_head_dims)
      list(APPEND quant "${t}, ${d}, ${tc}")
    endforeach()
  endforeach()
  jax_flash_instantiate(paged_attention_mma_${tag}
    HEADER jax_flash/paged_attention_mma.cuh FUNCTION paged::launch_paged_attention_mma
    PARAMS PagedAttentionParams WHAT "q and cache of type ${t}" ARGS ${same})
  jax_flash_instantiate(paged_attention_mma_${tag}_q8
    HEADER jax_flash/paged_attention_mma.cuh FUNCTION paged::launch_paged_attention_mma
    PARAMS PagedAttentionParams WHAT "q of type ${t}, int8 and float8 e4m3 caches" ARGS ${quant})
endforeach()
