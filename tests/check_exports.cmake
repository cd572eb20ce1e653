# The shared library exports its API and nothing of its own beside it (include/fa4/export.h):
# every defined dynamic symbol in namespace fa4 is one of the C++ API's functions, every C symbol
# of ours is fa4_*, none is a CuTe / CUTLASS instantiation, and none of ours is a GNU unique symbol
# (an inline function's static, which the loader would share between two copies of the library).
#   cmake -DLIB=path/to/libfa4.so -DNM=nm -P tests/check_exports.cmake
execute_process(COMMAND ${NM} -D --defined-only -C ${LIB} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} failed on ${LIB}")
endif()
string(REPLACE "\n" ";" lines "${out}")
set(api "to_string|can_implement|workspace_size|forward|backward|resolve_backend|version")
set(bad "")
foreach(line ${lines})
  if(NOT line MATCHES "^[0-9a-f]+ (.) (.*)$")
    continue()
  endif()
  set(type "${CMAKE_MATCH_1}")
  set(name "${CMAKE_MATCH_2}")
  if(type STREQUAL "u" AND NOT name MATCHES "^std::")  # the standard library's are alike in every copy
    list(APPEND bad "unique: ${name}")
  elseif(name MATCHES "^fa4::" AND NOT name MATCHES "^fa4::(${api})\\(")
    list(APPEND bad "${name}")
  elseif(name MATCHES "^(cute|cutlass)::" OR name MATCHES "^fa4_" AND NOT name MATCHES "^fa4_[a-z0-9_]+$")
    list(APPEND bad "${name}")
  endif()
endforeach()
list(LENGTH bad n)
if(n GREATER 0)
  list(SUBLIST bad 0 20 shown)
  string(REPLACE ";" "\n  " shown "${shown}")
  message(FATAL_ERROR "${LIB} exports ${n} symbols beyond its API, e.g.\n  ${shown}")
endif()
message(STATUS "${LIB}: exports only the API")
