# [libstdc++ first] libtorch.so exports its own copy of std::filesystem, and some of those
# functions crash when called from outside it (std::filesystem::remove_all jumps to address 0).
# Our programs must bind std::filesystem to libstdc++'s, so libstdc++ must come before libtorch in
# their dynamic dependencies. "-lstdc++" at the head of the link line did that with Debian's
# toolchain but not with Ubuntu 24.04's (the GPU machine's: symbiosis-bench-roundtrip died at its
# first remove_all); naming the library by its full path does it with both.
# Sets SYMBIOSIS_LIBSTDCXX_FIRST to the link flags that do it.
execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
  OUTPUT_VARIABLE _symbiosis_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT IS_ABSOLUTE "${_symbiosis_libstdcxx}" OR NOT EXISTS "${_symbiosis_libstdcxx}")
  set(_symbiosis_libstdcxx "-lstdc++")  # the compiler does not say: the library by name
endif()
set(SYMBIOSIS_LIBSTDCXX_FIRST "-Wl,--push-state,--no-as-needed ${_symbiosis_libstdcxx} -Wl,--pop-state")
