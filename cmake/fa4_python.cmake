# The fa4cpp Python package (pip install ., see pyproject.toml): libfa4.so is installed into the
# package directory, where fa4cpp/_library.py looks for it. scikit-build-core installs only the
# fa4cpp_python component, so the C/C++ install rules (static library, headers) stay out of the
# wheel; the install prefix is then the wheel's platlib root.
install(TARGETS fa4_shared
        LIBRARY DESTINATION fa4cpp COMPONENT fa4cpp_python EXCLUDE_FROM_ALL)
# What pip builds (pyproject.toml's build.targets): the library, and the native torch ops when
# this configuration builds them (cmake/fa4_torch_ops.cmake).
add_custom_target(fa4cpp_python)
add_dependencies(fa4cpp_python fa4_shared)
if(TARGET fa4_torch)
  add_dependencies(fa4cpp_python fa4_torch)
  install(TARGETS fa4_torch
          LIBRARY DESTINATION fa4cpp COMPONENT fa4cpp_python EXCLUDE_FROM_ALL)
  install(FILES "${CMAKE_CURRENT_BINARY_DIR}/libfa4_torch.torch_version"
          DESTINATION fa4cpp COMPONENT fa4cpp_python EXCLUDE_FROM_ALL)
endif()

if(FA4_WITH_CUDA)
  # The installed library keeps the toolkit's lib directory in its RUNPATH, so that libcudart is
  # found where the build found it even when the process has not loaded a libcudart of the same
  # major version already (torch's CUDA wheels load one when torch initialises CUDA).
  set_target_properties(fa4_shared PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
endif()
