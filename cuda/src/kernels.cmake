# The CUDA kernels' target, jax_flash_kernels: a static archive of the kernel instantiations
# (instantiations.cmake; they include no Python or XLA header), which the _cuda module links.
#
# Development: JAX_FLASH_KERNELS_ARCHIVE names such an archive built earlier
# (<build-dir>/libjax_flash_kernels.a) to link instead of compiling the kernels, e.g. on a lent
# GPU machine whose Python differs from the machine that compiled them
# (tools/gpu/prebuilt_kernels.sh). Every archive built here gets a stamp beside it
# (libjax_flash_kernels.a.sources: a hash of the kernel sources and the architectures); a
# prebuilt one's stamp must equal this tree's, or the handlers compiled here and the kernels in
# the archive could disagree on a parameter struct.

set(JAX_FLASH_KERNELS_ARCHIVE "" CACHE FILEPATH
    "Development: a prebuilt libjax_flash_kernels.a to link instead of compiling the kernels")

# The CUDA compile settings of every target with CUDA sources (the kernels and the module's
# handlers): the Hopper kernels have code only in an sm_90a pass, and the dispatchers ask for it
# only when the build has one (JAX_FLASH_HAS_SM90A); a static CUDA runtime, so that the module
# imports on machines without libcudart (the driver is loaded at the first CUDA call).
function(jax_flash_cuda_settings target)
  target_include_directories(${target} PRIVATE "${PROJECT_SOURCE_DIR}/cuda/include")
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr -Xptxas=-warn-spills>)
  if(CMAKE_CUDA_ARCHITECTURES MATCHES "90a")
    target_compile_definitions(${target} PRIVATE JAX_FLASH_HAS_SM90A)
  endif()
  set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Static)
endfunction()

include(${CMAKE_CURRENT_LIST_DIR}/instantiations.cmake)

file(GLOB_RECURSE _jf_kernel_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/cuda/include/*")
list(APPEND _jf_kernel_sources "${CMAKE_CURRENT_LIST_DIR}/instantiations.cmake"
     "${CMAKE_CURRENT_LIST_DIR}/instantiation.cu.in" "${CMAKE_CURRENT_LIST_FILE}")
list(SORT _jf_kernel_sources)
set(_jf_sources_hash "${CMAKE_CUDA_ARCHITECTURES}")
foreach(f IN LISTS _jf_kernel_sources)
  file(SHA256 "${f}" h)
  file(RELATIVE_PATH rel "${PROJECT_SOURCE_DIR}" "${f}")
  string(APPEND _jf_sources_hash " ${rel} ${h}")
endforeach()
string(SHA256 _jf_sources_hash "${_jf_sources_hash}")

if(JAX_FLASH_KERNELS_ARCHIVE)
  if(NOT EXISTS "${JAX_FLASH_KERNELS_ARCHIVE}.sources")
    message(FATAL_ERROR "JAX_FLASH_KERNELS_ARCHIVE: no stamp ${JAX_FLASH_KERNELS_ARCHIVE}.sources")
  endif()
  file(READ "${JAX_FLASH_KERNELS_ARCHIVE}.sources" _jf_stamp)
  string(STRIP "${_jf_stamp}" _jf_stamp)
  if(NOT _jf_stamp STREQUAL _jf_sources_hash)
    message(FATAL_ERROR "JAX_FLASH_KERNELS_ARCHIVE: ${JAX_FLASH_KERNELS_ARCHIVE} was built from "
                        "other kernel sources or architectures than this tree's")
  endif()
  message(STATUS "jax_flash: linking the prebuilt CUDA kernels ${JAX_FLASH_KERNELS_ARCHIVE}")
  add_library(jax_flash_kernels STATIC IMPORTED)
  set_target_properties(jax_flash_kernels PROPERTIES
                        IMPORTED_LOCATION "${JAX_FLASH_KERNELS_ARCHIVE}")
else()
  list(LENGTH JAX_FLASH_INSTANTIATION_SOURCES _jf_num_kernels)
  message(STATUS "jax_flash: compiling the CUDA kernels (${_jf_num_kernels} files) for "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES}: several minutes (about 10 on 2 "
                 "cores); JAX_FLASH_CUDA=OFF builds the CPU kernels only, in under a minute")
  add_library(jax_flash_kernels STATIC ${JAX_FLASH_INSTANTIATION_SOURCES})
  jax_flash_cuda_settings(jax_flash_kernels)
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/libjax_flash_kernels.a.sources" "${_jf_sources_hash}\n")
endif()
