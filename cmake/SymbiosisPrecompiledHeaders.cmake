# [Precompiled headers]: LibTorch's headers cost most of a translation unit's build (ATen/ATen.h
# alone parses in 18 s on the 2-core machine, torch/nn/module.h in 24 s). Every C++ target of the
# project compiles them once, in one of two precompiled headers: one for executables (-fPIE) and
# one for libraries (-fPIC), since GCC refuses a header precompiled with the other. A translation
# unit then builds in about two thirds of the time (docs/building.md has the figures).
#
# GCC uses a precompiled header only where every macro it depends on is defined as when it was made,
# so each consumer gets the host's definitions (torch's and spdlog's); GCC says when it refuses one
# (-Winvalid-pch) and compiles the headers as usual. A target built with OpenMP (_OPENMP changes
# what ATen's inline parallel_for compiles to: [OpenMP in our code] in client_runtime/) compiles its
# own. Off with -DSYMBIOSIS_PCH=OFF; only for GCC.
option(SYMBIOSIS_PCH "Compile LibTorch's headers once (precompiled headers, GCC)" ON)

set(SYMBIOSIS_PCH_HEADERS <ATen/ATen.h> <c10/util/Exception.h> <torch/nn/module.h>
    <torch/optim/adamw.h> <nlohmann/json.hpp> <spdlog/spdlog.h>)

# The macros the headers above depend on, as the imported targets define them.
function(_symbiosis_pch_definitions out)
  set(definitions)
  foreach(imported torch_cpu torch_cuda spdlog::spdlog fmt::fmt)
    if(TARGET ${imported})
      get_target_property(d ${imported} INTERFACE_COMPILE_DEFINITIONS)
      if(d)
        list(APPEND definitions ${d})
      endif()
    endif()
  endforeach()
  set(${out} ${definitions} PARENT_SCOPE)
endfunction()

function(_symbiosis_targets_below dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub ${subdirs})
    _symbiosis_targets_below(${sub} below)
    list(APPEND targets ${below})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

# Called once, after every target is defined.
function(symbiosis_precompiled_headers)
  if(NOT SYMBIOSIS_PCH OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    return()
  endif()
  _symbiosis_pch_definitions(definitions)
  set(host_source ${PROJECT_SOURCE_DIR}/cmake/precompiled_headers_host.cpp)
  add_library(symbiosis_pch_library OBJECT ${host_source})
  add_executable(symbiosis_pch_executable ${host_source})
  foreach(host symbiosis_pch_library symbiosis_pch_executable)
    target_link_libraries(${host} PRIVATE torch spdlog::spdlog nlohmann_json::nlohmann_json)
    symbiosis_real_includes(${host})
    target_precompile_headers(${host} PRIVATE ${SYMBIOSIS_PCH_HEADERS})
  endforeach()

  _symbiosis_targets_below(${PROJECT_SOURCE_DIR} targets)
  foreach(target ${targets})
    get_target_property(type ${target} TYPE)
    get_target_property(sources ${target} SOURCES)
    # Not the Python module (a MODULE, of its own visibility). A target's CUDA sources get no
    # precompiled header (CMake gives them none; nvcc takes none), its C++ sources do ([Torch-free
    # kernels] in kernels/launch.h).
    if(target MATCHES "^symbiosis_pch_" OR NOT sources
       OR NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY)$")
      continue()
    endif()
    target_compile_definitions(${target} PRIVATE ${definitions})
    symbiosis_real_includes(${target})
    get_target_property(links ${target} LINK_LIBRARIES)
    if(links MATCHES "OpenMP::")
      target_precompile_headers(${target} PRIVATE ${SYMBIOSIS_PCH_HEADERS})
    elseif(type STREQUAL "EXECUTABLE")
      target_precompile_headers(${target} REUSE_FROM symbiosis_pch_executable)
    else()
      target_precompile_headers(${target} REUSE_FROM symbiosis_pch_library)
    endif()
  endforeach()
endfunction()
