# The shared library exports its API and nothing of its own beside it (include/fa4/export.h): the
# C++ API's seven functions and the C ABI's fa4_* functions are there, and no other symbol names
# our namespace (in any position: template arguments, guard variables, typeinfo), CuTe or CUTLASS,
# and none of ours is a GNU unique symbol (an inline function's static, which the loader would
# share between two copies of the library). Mangled names, so that nothing hides in a demangled
# return type.
#   cmake -DLIB=path/to/libfa4.so -DNM=nm -P tests/check_exports.cmake
cmake_policy(SET CMP0057 NEW)
execute_process(COMMAND ${NM} -D --defined-only ${LIB} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} failed on ${LIB}")
endif()
string(REPLACE "\n" ";" lines "${out}")
# fa4::to_string, can_implement, workspace_size, resolve_backend, forward, version, backward,
# overrides_from_env.
set(api "_ZN3fa49to_string" "_ZN3fa413can_implement" "_ZN3fa414workspace_size"
        "_ZN3fa415resolve_backend" "_ZN3fa47forward" "_ZN3fa47version" "_ZN3fa48backward"
        "_ZN3fa418overrides_from_env")
set(c_abi fa4_abi_version fa4_version fa4_problem_init fa4_forward_tensors_init
          fa4_backward_tensors_init fa4_can_implement fa4_workspace_size fa4_forward fa4_backward
          fa4_last_error_message fa4_status_string fa4_overrides_init fa4_overrides_from_env
          fa4_workspace_size_with_overrides fa4_forward_with_overrides fa4_backward_with_overrides)
set(bad "")
set(found "")
foreach(line ${lines})
  if(NOT line MATCHES "^[0-9a-f]+ (.) ([^ ]+)$")
    continue()
  endif()
  set(type "${CMAKE_MATCH_1}")
  set(name "${CMAKE_MATCH_2}")
  set(is_api FALSE)
  foreach(prefix ${api})
    string(FIND "${name}" "${prefix}" at)
    if(at EQUAL 0)
      set(is_api TRUE)
      list(APPEND found "${prefix}")
    endif()
  endforeach()
  if(name MATCHES "^fa4_[a-z0-9_]+$")
    list(APPEND found "${name}")
  elseif(is_api)
  elseif(name MATCHES "3fa4|4cute|7cutlass")
    list(APPEND bad "${name}")
  elseif(type STREQUAL "u" AND NOT name MATCHES "^_ZZNSt|^_ZGVZNSt")  # std::'s: alike in every copy
    list(APPEND bad "unique: ${name}")
  endif()
endforeach()
foreach(want ${api} ${c_abi})
  if(NOT want IN_LIST found)
    list(APPEND bad "missing: ${want}")
  endif()
endforeach()
list(LENGTH bad n)
if(n GREATER 0)
  list(SUBLIST bad 0 20 shown)
  string(REPLACE ";" "\n  " shown "${shown}")
  message(FATAL_ERROR "${LIB}: ${n} symbols wrong, e.g.\n  ${shown}")
endif()
message(STATUS "${LIB}: exports the API and nothing else of ours")
