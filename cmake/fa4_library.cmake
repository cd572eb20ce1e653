# The library: one set of objects, linked as a static and a shared library (the C ABI is in both).
set(FA4_SOURCES
  src/api/attention.cpp
  src/api/validate.cpp
  src/common/status.cpp
  src/api/c_api.cpp
  src/api/overrides.cpp
  src/dispatch/dispatch.cpp
  src/dispatch/pointer_memory.cpp
  src/cpu/cpu_backend.cpp
  src/cpu/forward.cpp
  src/cpu/backward.cpp
  src/cpu/parallel.cpp
  src/cpu/blas.cpp
  src/cpu/vec.cpp
  src/sm90/host/backend.cpp
  src/sm90/host/fwd_plan.cpp
  src/sm90/host/bwd_plan.cpp
)

include(cmake/fa4_cpu_deps.cmake)
add_library(fa4_objects OBJECT ${FA4_SOURCES})
fa4_use_cpu_deps(fa4_objects)
target_include_directories(fa4_objects
  PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
  PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
target_compile_options(fa4_objects PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
target_compile_definitions(fa4_objects PRIVATE FA4_VERSION_STRING="${PROJECT_VERSION}")
# Only the API is exported (include/fa4/export.h): kernels, CUTLASS / CuTe instantiations and the
# internal statics stay private to the library.
set_target_properties(fa4_objects PROPERTIES CXX_VISIBILITY_PRESET hidden
                      CUDA_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
target_link_libraries(fa4_objects PUBLIC Threads::Threads ${CMAKE_DL_LIBS})

if(FA4_WITH_CUDA)
  target_compile_definitions(fa4_objects PUBLIC FA4_WITH_CUDA=1)
  target_link_libraries(fa4_objects PUBLIC CUDA::cudart)
  include(cmake/fa4_sm90.cmake)
endif()

add_library(fa4 STATIC $<TARGET_OBJECTS:fa4_objects>)
add_library(fa4_shared SHARED $<TARGET_OBJECTS:fa4_objects>)
set_target_properties(fa4_shared PROPERTIES OUTPUT_NAME fa4)
# OpenBLAS goes into the shared library with its symbols hidden (only the API is exported); the
# static library's users link it after libfa4.a.
target_link_libraries(fa4_shared PRIVATE "${FA4_OPENBLAS_STATIC}")
target_link_options(fa4_shared PRIVATE "LINKER:--exclude-libs,libopenblas.a")
target_link_libraries(fa4 INTERFACE "${FA4_OPENBLAS_STATIC}")
foreach(lib fa4 fa4_shared)
  target_include_directories(${lib} PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>)
  target_link_libraries(${lib} PUBLIC Threads::Threads ${CMAKE_DL_LIBS})
  if(FA4_WITH_CUDA)
    target_compile_definitions(${lib} PUBLIC FA4_WITH_CUDA=1)
    target_link_libraries(${lib} PUBLIC CUDA::cudart)
  endif()
endforeach()

include(GNUInstallDirs)
install(TARGETS fa4 fa4_shared ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY include/fa4 DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
