# Finds every dependency once, checks that the distributed backends really work, and prints a
# capability summary. docs/building.md says which combinations have been compiled.

# An upstream LibTorch (the unzipped libtorch/ folder of a 2.x download) instead of the system's.
set(SHARDIT_LIBTORCH_DIR "" CACHE PATH "Upstream LibTorch folder to build against (default: the system LibTorch)")
if(SHARDIT_LIBTORCH_DIR)
  get_filename_component(SHARDIT_LIBTORCH_DIR "${SHARDIT_LIBTORCH_DIR}" ABSOLUTE)
  if(NOT EXISTS "${SHARDIT_LIBTORCH_DIR}/share/cmake/Torch/TorchConfig.cmake")
    message(FATAL_ERROR "SHARDIT_LIBTORCH_DIR=${SHARDIT_LIBTORCH_DIR} has no share/cmake/Torch/TorchConfig.cmake: "
                        "give the libtorch/ folder of an unzipped LibTorch download")
  endif()
  list(PREPEND CMAKE_PREFIX_PATH "${SHARDIT_LIBTORCH_DIR}")
  # A build folder configured before against another LibTorch keeps its package folders cached.
  set(Torch_DIR "${SHARDIT_LIBTORCH_DIR}/share/cmake/Torch" CACHE PATH "" FORCE)
  set(Caffe2_DIR "${SHARDIT_LIBTORCH_DIR}/share/cmake/Caffe2" CACHE PATH "" FORCE)
endif()

find_package(Torch REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)
# OpenMP: at::parallel_for is inlined from ATen's headers and runs its loop on LibTorch's OpenMP
# threads only where the including code is compiled with OpenMP; without it, it runs serially.
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(PNG REQUIRED)  # images written by `shardit generate` and read as inputs (libpng-dev)
find_package(JPEG REQUIRED)  # JPEG input images for editing (libjpeg62-turbo-dev)
# Tokenizers: SentencePiece (T5), PCRE2 (pre-tokenizer regexes), ICU (normalisation, case mapping).
find_package(PkgConfig REQUIRED)
pkg_check_modules(SentencePiece REQUIRED IMPORTED_TARGET sentencepiece)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
find_package(ICU REQUIRED COMPONENTS uc i18n)
# `shardit serve`: HTTP through Debian's cpp-httplib (a compiled library; its flags come from pkg-config).
pkg_check_modules(HTTPLIB IMPORTED_TARGET cpp-httplib>=0.11)
if(NOT HTTPLIB_FOUND)
  message(FATAL_ERROR "cpp-httplib (>= 0.11) was not found: `shardit serve` needs it; install the Debian package "
                      "libcpp-httplib-dev (scripts/setup.sh does)")
endif()

if(SHARDIT_LIBTORCH_DIR)
  get_filename_component(found_prefix "${TORCH_INSTALL_PREFIX}" REALPATH)
  get_filename_component(wanted_prefix "${SHARDIT_LIBTORCH_DIR}" REALPATH)
  if(NOT found_prefix STREQUAL wanted_prefix)
    message(FATAL_ERROR "SHARDIT_LIBTORCH_DIR=${SHARDIT_LIBTORCH_DIR}, but CMake found LibTorch in "
                        "${TORCH_INSTALL_PREFIX}; configure a fresh build folder")
  endif()
endif()

# LibTorch's exported flags carry -D_GLIBCXX_USE_CXX11_ABI; keep them on every target. The other
# C++ libraries (GoogleTest, fmt) are Debian's, built with the C++11 ABI, so a pre-C++11-ABI
# LibTorch could not link with them.
separate_arguments(SHARDIT_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
if("-D_GLIBCXX_USE_CXX11_ABI=0" IN_LIST SHARDIT_TORCH_CXX_FLAGS)
  message(FATAL_ERROR "LibTorch in ${TORCH_INSTALL_PREFIX} uses the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0), "
                      "which cannot link with the system's GoogleTest and fmt: use the cxx11-abi build "
                      "(libtorch-cxx11-abi-shared-with-deps-*.zip)")
endif()

# Builds and links a small program against LibTorch with `definitions`; `result` is cached.
include(CheckCXXSourceCompiles)
function(shardit_check_torch_program result definitions libraries source)
  set(CMAKE_REQUIRED_DEFINITIONS ${definitions})
  set(CMAKE_REQUIRED_LIBRARIES torch ${libraries})
  set(CMAKE_REQUIRED_FLAGS "${TORCH_CXX_FLAGS}")
  set(CMAKE_REQUIRED_QUIET OFF)
  check_cxx_source_compiles("${source}" ${result})
endfunction()

# c10d's Gloo backend (with TCPStore) is part of libtorch_cpu when LibTorch was built with
# USE_DISTRIBUTED and Gloo. Its header is empty unless USE_C10D_GLOO is defined, so finding the
# header proves nothing: compile and link a program that makes a Gloo device and options.
shardit_check_torch_program(SHARDIT_C10D_GLOO_WORKS "-DUSE_C10D_GLOO" "" [=[
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
int main() {
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  c10d::TCPStoreOptions store;
  return static_cast<int>(options->devices.size() + store.port) - 1;
}
]=])
if(NOT SHARDIT_C10D_GLOO_WORKS)
  unset(SHARDIT_C10D_GLOO_WORKS CACHE)  # check again on the next configure
  message(FATAL_ERROR "shardit needs c10d's Gloo backend, and a program using ProcessGroupGloo (compiled with "
                      "USE_C10D_GLOO, linked with LibTorch in ${TORCH_INSTALL_PREFIX}) did not build: LibTorch "
                      "must be built with USE_DISTRIBUTED and Gloo, and Gloo's headers installed (Debian: "
                      "libgloo-dev). CMake's configure log has the compiler's output.")
endif()
# world.cpp includes the Gloo header: it needs USE_C10D_GLOO, which LibTorch's targets usually export.
get_target_property(torch_cpu_definitions torch_cpu INTERFACE_COMPILE_DEFINITIONS)
set(SHARDIT_DEFINE_C10D_GLOO OFF)
if(NOT "USE_C10D_GLOO" IN_LIST torch_cpu_definitions)
  set(SHARDIT_DEFINE_C10D_GLOO ON)
endif()

set(SHARDIT_WITH_CUDA OFF)
if(TARGET torch_cuda OR CUDA_FOUND)
  set(SHARDIT_WITH_CUDA ON)
endif()

# NCCL: AUTO uses it when LibTorch has CUDA and the check below passes; ON fails when it cannot.
set(SHARDIT_NCCL AUTO CACHE STRING "Use c10d's NCCL backend for CUDA tensors: AUTO, ON or OFF")
set_property(CACHE SHARDIT_NCCL PROPERTY STRINGS AUTO ON OFF)
set(SHARDIT_WITH_NCCL OFF)
set(nccl_problem "")
if(SHARDIT_NCCL STREQUAL "OFF")
  set(nccl_problem "SHARDIT_NCCL=OFF")
elseif(NOT SHARDIT_WITH_CUDA)
  set(nccl_problem "LibTorch in ${TORCH_INSTALL_PREFIX} has no CUDA")
else()
  find_path(SHARDIT_NCCL_INCLUDE_DIR nccl.h HINTS ENV NCCL_ROOT ENV NCCL_HOME PATH_SUFFIXES include)
  find_library(SHARDIT_NCCL_LIBRARY nccl HINTS ENV NCCL_ROOT ENV NCCL_HOME PATH_SUFFIXES lib lib64)
  if(NOT SHARDIT_NCCL_INCLUDE_DIR OR NOT SHARDIT_NCCL_LIBRARY)
    set(nccl_problem "nccl.h or libnccl not found (set NCCL_ROOT)")
  else()
    set(CMAKE_REQUIRED_INCLUDES "${SHARDIT_NCCL_INCLUDE_DIR}")
    # ProcessGroupNCCL.hpp is empty unless USE_C10D_NCCL is defined; the program uses both it and nccl.h.
    shardit_check_torch_program(SHARDIT_C10D_NCCL_WORKS "-DUSE_C10D_NCCL" "${SHARDIT_NCCL_LIBRARY}" [=[
#include <nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
int main() {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  int version = 0;
  ncclGetVersion(&version);
  return options ? 0 : version;
}
]=])
    unset(CMAKE_REQUIRED_INCLUDES)
    if(SHARDIT_C10D_NCCL_WORKS)
      set(SHARDIT_WITH_NCCL ON)
    else()
      unset(SHARDIT_C10D_NCCL_WORKS CACHE)  # check again on the next configure
      set(nccl_problem "a program using ProcessGroupNCCL with USE_C10D_NCCL and nccl.h did not build")
    endif()
  endif()
endif()
if(SHARDIT_NCCL STREQUAL "ON" AND NOT SHARDIT_WITH_NCCL)
  message(FATAL_ERROR "SHARDIT_NCCL=ON, but NCCL is not usable: ${nccl_problem}")
endif()
set(SHARDIT_WITH_SDPA OFF)
if(Torch_VERSION VERSION_GREATER_EQUAL 2.0)
  set(SHARDIT_WITH_SDPA ON)
endif()

message(STATUS "shardit capabilities:")
message(STATUS "  LibTorch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX})")
message(STATUS "  Gloo     ON (checked by compiling)")
message(STATUS "  CUDA     ${SHARDIT_WITH_CUDA}")
if(SHARDIT_WITH_NCCL)
  message(STATUS "  NCCL     ON")
else()
  message(STATUS "  NCCL     OFF (${nccl_problem})")
endif()
message(STATUS "  SDPA     ${SHARDIT_WITH_SDPA}")

# One function so every shardit target gets the same flags (needed to share the precompiled header).
function(shardit_target_defaults target)
  target_compile_options(${target} PRIVATE ${SHARDIT_TORCH_CXX_FLAGS} -Wall -Wextra -Wno-unused-parameter)
  target_compile_definitions(${target} PUBLIC
    SHARDIT_WITH_CUDA=$<BOOL:${SHARDIT_WITH_CUDA}>
    SHARDIT_WITH_NCCL=$<BOOL:${SHARDIT_WITH_NCCL}>
    $<$<BOOL:${SHARDIT_DEFINE_C10D_GLOO}>:USE_C10D_GLOO>
    $<$<BOOL:${SHARDIT_WITH_NCCL}>:USE_C10D_NCCL>)
  if(SHARDIT_WITH_NCCL)
    target_include_directories(${target} SYSTEM PUBLIC "${SHARDIT_NCCL_INCLUDE_DIR}")
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ${SHARDIT_UNITY_BUILD}
                        UNITY_BUILD_BATCH_SIZE ${SHARDIT_UNITY_BATCH_SIZE})
  if(SHARDIT_UNITY_BUILD)
    # In a batch a .cpp is no longer the main file, so GCC flags its classes that hold a type from
    # the file's anonymous namespace; in a file-by-file build it does not, and nothing is wrong.
    target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Wno-subobject-linkage>)
  endif()
endfunction()
