# The CPU backend's kernel libraries, from Debian's packages (scripts/install_deps.sh installs
# them; docs/developing.md says why these):
#   OpenBLAS, serial build (libopenblas-pthread-dev): the tile products (sgemm), linked statically
#     into libfa4 so that the library stays self-contained and no other OpenBLAS in the process
#     (numpy's, the system's threaded one) decides how its products thread;
#   Highway (libhwy-dev), headers only: the vectorised exponentials, conversions and row
#     operations, compiled for AVX-512, AVX2 and the baseline and chosen at run time.
# Elsewhere, point FA4_OPENBLAS_INCLUDE / FA4_OPENBLAS_STATIC at a threaded OpenBLAS's cblas.h and
# position-independent static library, and FA4_HWY_INCLUDE at Highway's headers.
set(_fa4_multiarch "${CMAKE_LIBRARY_ARCHITECTURE}")
find_path(FA4_OPENBLAS_INCLUDE cblas.h
          PATHS /usr/include/${_fa4_multiarch}/openblas-pthread NO_DEFAULT_PATH)
find_library(FA4_OPENBLAS_STATIC NAMES libopenblas.a
             PATHS /usr/lib/${_fa4_multiarch}/openblas-pthread NO_DEFAULT_PATH)
find_path(FA4_HWY_INCLUDE hwy/highway.h)
foreach(_fa4_dep FA4_OPENBLAS_INCLUDE FA4_OPENBLAS_STATIC FA4_HWY_INCLUDE)
  if(NOT ${_fa4_dep})
    message(FATAL_ERROR "${_fa4_dep} not found: run scripts/install_deps.sh (Debian: "
                        "libopenblas-pthread-dev, libhwy-dev), or set it")
  endif()
endforeach()

# What the library's objects compile against, and what a library linking them needs.
function(fa4_use_cpu_deps target)
  target_include_directories(${target} SYSTEM PRIVATE ${FA4_OPENBLAS_INCLUDE} ${FA4_HWY_INCLUDE})
endfunction()
