# The native torch ops (python/csrc -> libfa4_torch.so): fa4cpp's torch.ops.fa4cpp.* registered
# from C++ against the torch of one Python interpreter, loaded by the fa4cpp package beside
# libfa4.so. The ops are tied to that torch's version: the build writes it next to the library
# (libfa4_torch.torch_version) and the package loads the ops only under the same version,
# running its Python implementation otherwise.
#
#   FA4_TORCH_OPS     AUTO (default): build them when FA4_TORCH_PYTHON imports torch; ON: require
#                     it; OFF: never
#   FA4_TORCH_PYTHON  the interpreter whose torch to build against (default: the Python that
#                     scikit-build-core runs, else python3 on the PATH)
set(FA4_TORCH_OPS "AUTO" CACHE STRING "Build the native torch ops: AUTO, ON or OFF")
set_property(CACHE FA4_TORCH_OPS PROPERTY STRINGS AUTO ON OFF)
set(FA4_TORCH_PYTHON "" CACHE FILEPATH "Python interpreter whose torch the native ops build against")

if(FA4_TORCH_OPS STREQUAL "OFF")
  return()
endif()

set(_fa4_torch_python "${FA4_TORCH_PYTHON}")
if(NOT _fa4_torch_python AND Python_EXECUTABLE)
  set(_fa4_torch_python "${Python_EXECUTABLE}")
endif()
if(NOT _fa4_torch_python)
  find_program(_fa4_torch_python NAMES python3 python)
endif()

# What the build needs from torch: its headers, its libraries' directory, its version and its
# C++ ABI flag. No CUDA headers: the op library reaches CUDA streams through c10's device API.
set(_fa4_torch_query [=[
import torch, torch.utils.cpp_extension as ext
print(torch.__version__)
print(",".join(ext.include_paths()))
print(ext.library_paths()[0])
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
]=])
set(_fa4_torch_found FALSE)
if(_fa4_torch_python)
  execute_process(COMMAND "${_fa4_torch_python}" -c "${_fa4_torch_query}"
                  RESULT_VARIABLE _fa4_torch_rc OUTPUT_VARIABLE _fa4_torch_out
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_fa4_torch_rc EQUAL 0)
    string(REPLACE "\n" ";" _fa4_torch_lines "${_fa4_torch_out}")
    list(GET _fa4_torch_lines 0 FA4_TORCH_VERSION)
    list(GET _fa4_torch_lines 1 _fa4_torch_includes)
    list(GET _fa4_torch_lines 2 _fa4_torch_libdir)
    list(GET _fa4_torch_lines 3 _fa4_torch_cxx11_abi)
    string(REPLACE "," ";" _fa4_torch_includes "${_fa4_torch_includes}")
    set(_fa4_torch_found TRUE)
  endif()
endif()

# The ops call the library's C++ API, whose Status holds a std::string: torch must use the
# library's (the default) C++11 string ABI, as every torch wheel since 2.7 does.
set(_fa4_torch_why "")
if(NOT _fa4_torch_found)
  set(_fa4_torch_why "'${_fa4_torch_python}' does not import torch")
elseif(NOT _fa4_torch_cxx11_abi EQUAL 1)
  set(_fa4_torch_why "torch ${FA4_TORCH_VERSION} uses the pre-C++11 string ABI")
endif()
if(_fa4_torch_why)
  if(FA4_TORCH_OPS STREQUAL "ON")
    message(FATAL_ERROR "FA4_TORCH_OPS=ON, but ${_fa4_torch_why} (FA4_TORCH_PYTHON names the "
                        "interpreter)")
  endif()
  message(STATUS "fa4cpp: native torch ops not built (${_fa4_torch_why}); the package runs its "
                 "Python implementation")
  return()
endif()
message(STATUS "fa4cpp: native torch ops against torch ${FA4_TORCH_VERSION} (${_fa4_torch_python})")

add_library(fa4_torch SHARED
  python/csrc/ops.cpp
  python/csrc/autograd.cpp
  python/csrc/run.cpp
  python/csrc/inputs.cpp
  python/csrc/delegate.cpp)
target_include_directories(fa4_torch SYSTEM PRIVATE ${_fa4_torch_includes})
target_compile_definitions(fa4_torch PRIVATE _GLIBCXX_USE_CXX11_ABI=${_fa4_torch_cxx11_abi})
target_compile_options(fa4_torch PRIVATE -Wall -Wextra -Wno-unused-parameter)
# torch's libraries are the ones the importing process has loaded already: linked by name, not
# located through a RUNPATH; libfa4.so is found beside this library.
target_link_libraries(fa4_torch PRIVATE fa4_shared
  "${_fa4_torch_libdir}/libc10.so" "${_fa4_torch_libdir}/libtorch_cpu.so"
  "${_fa4_torch_libdir}/libtorch.so")
set_target_properties(fa4_torch PROPERTIES
  CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
  BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN" BUILD_WITH_INSTALL_RPATH ON
  SKIP_BUILD_RPATH OFF)
set(_fa4_torch_version_file "${CMAKE_CURRENT_BINARY_DIR}/libfa4_torch.torch_version")
file(WRITE "${_fa4_torch_version_file}" "${FA4_TORCH_VERSION}\n")
