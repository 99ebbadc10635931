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
  # Upstream LibTorch (a download, PyPI's wheel) carries protobuf inside and names
  # protobuf::libprotobuf in its targets' link interface as an alias of a plain target it adds,
  # which the configure checks below (try_compile) cannot take: an empty imported target instead.
  if(NOT TARGET protobuf::libprotobuf)
    add_library(protobuf::libprotobuf INTERFACE IMPORTED)
  endif()
  # Its CUDA setup (Caffe2's cuda.cmake) reads TORCH_CUDA_ARCH_LIST and warns when CMake's own
  # CMAKE_CUDA_ARCHITECTURES is set, which enabling CUDA does under policy CMP0104's NEW
  # behaviour. shardit compiles no CUDA code of its own.
  cmake_policy(SET CMP0104 OLD)
endif()

find_package(Torch REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)
# OpenMP: at::parallel_for is inlined from ATen's headers and runs its loop on LibTorch's OpenMP
# threads only where the including code is compiled with OpenMP; without it, it runs serially.
# An upstream LibTorch (PyPI's wheel) brings its own libgomp.so.1, which its OpenMP code runs on: a
# process loads one libgomp.so.1, so shardit's OpenMP code links that one too.
if(SHARDIT_LIBTORCH_DIR AND EXISTS "${SHARDIT_LIBTORCH_DIR}/lib/libgomp.so.1")
  set(OpenMP_gomp_LIBRARY "${SHARDIT_LIBTORCH_DIR}/lib/libgomp.so.1" CACHE FILEPATH "libgomp" FORCE)
endif()
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

# LibTorch's CUDA library finds the CUDA libraries it was built with through its own RPATH (PyPI's
# wheel: the nvidia-* packages beside it, newer than a system CUDA toolkit's libraries of the same
# names). Those folders come first when linking (-rpath-link, for the libraries it needs) and in
# shardit's programs' RUNPATH, so that a CUDA toolkit's older copies are not taken instead.
set(SHARDIT_TORCH_LINK_OPTIONS "")
if(TARGET torch_cuda)
  find_library(SHARDIT_TORCH_CUDA_LIBRARY torch_cuda PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
  if(SHARDIT_TORCH_CUDA_LIBRARY)
    get_filename_component(origin "${SHARDIT_TORCH_CUDA_LIBRARY}" DIRECTORY)
    file(READ_ELF "${SHARDIT_TORCH_CUDA_LIBRARY}" RPATH torch_cuda_rpath RUNPATH torch_cuda_runpath)
    string(REPLACE ":" ";" torch_cuda_dirs "${torch_cuda_rpath}:${torch_cuda_runpath}")
    set(dirs "")
    foreach(dir IN LISTS torch_cuda_dirs)
      string(REPLACE "$ORIGIN" "${origin}" dir "${dir}")
      if(dir AND IS_DIRECTORY "${dir}")
        get_filename_component(dir "${dir}" ABSOLUTE)
        list(APPEND dirs "${dir}")
      endif()
    endforeach()
    list(REMOVE_DUPLICATES dirs)
    if(dirs)
      string(REPLACE ";" ":" dirs "${dirs}")
      set(SHARDIT_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${dirs}" "LINKER:-rpath,${dirs}")
    endif()
  endif()
endif()

# An upstream LibTorch carries the headers of the fmt it was built with (include/fmt, another major
# version than Debian's libfmt-dev, which shardit links), and its include folder comes before the
# system's. A folder holding only the linked fmt's headers goes first on every shardit target's
# include path, so that <fmt/...> is the fmt that is linked (and formats as in the Debian build).
set(SHARDIT_FMT_INCLUDE_DIR "")
if(SHARDIT_LIBTORCH_DIR AND EXISTS "${SHARDIT_LIBTORCH_DIR}/include/fmt")
  get_target_property(fmt_include_dirs fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
  find_path(SHARDIT_FMT_HEADERS fmt/format.h PATHS ${fmt_include_dirs} NO_DEFAULT_PATH)
  if(NOT SHARDIT_FMT_HEADERS)
    message(FATAL_ERROR "fmt's headers (fmt/format.h) were not found in ${fmt_include_dirs}: install libfmt-dev")
  endif()
  set(SHARDIT_FMT_INCLUDE_DIR "${CMAKE_BINARY_DIR}/linked-fmt-include")
  file(MAKE_DIRECTORY "${SHARDIT_FMT_INCLUDE_DIR}")
  file(CREATE_LINK "${SHARDIT_FMT_HEADERS}/fmt" "${SHARDIT_FMT_INCLUDE_DIR}/fmt" SYMBOLIC)
endif()

# Builds and links a small program against LibTorch with `definitions`; `result` is cached.
include(CheckCXXSourceCompiles)
function(shardit_check_torch_program result definitions libraries source)
  set(CMAKE_REQUIRED_DEFINITIONS ${definitions})
  set(CMAKE_REQUIRED_LIBRARIES torch ${libraries})
  set(CMAKE_REQUIRED_LINK_OPTIONS ${SHARDIT_TORCH_LINK_OPTIONS})
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

# LibTorch 2.x compiles what uses it as C++20 (its `torch` target asks for cxx_std_20).
# SHARDIT_TORCH_CXX_STANDARD is the standard LibTorch asks for, for what is compiled outside CMake's
# targets (the fuzzer, tests/fuzz).
set(SHARDIT_TORCH_CXX_STANDARD 17)
get_target_property(torch_compile_features torch INTERFACE_COMPILE_FEATURES)
if("cxx_std_20" IN_LIST torch_compile_features)
  set(SHARDIT_TORCH_CXX_STANDARD 20)
endif()

# One function so every shardit target gets the same flags (needed to share the precompiled header).
function(shardit_target_defaults target)
  target_compile_options(${target} PRIVATE ${SHARDIT_TORCH_CXX_FLAGS} -Wall -Wextra -Wno-unused-parameter)
  target_link_options(${target} PUBLIC ${SHARDIT_TORCH_LINK_OPTIONS})
  if(SHARDIT_FMT_INCLUDE_DIR)
    target_include_directories(${target} SYSTEM BEFORE PRIVATE "${SHARDIT_FMT_INCLUDE_DIR}")
  endif()
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
