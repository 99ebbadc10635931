# Finds every dependency once and prints a capability summary.
find_package(Torch REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)
# Tokenizers: SentencePiece (T5), PCRE2 (pre-tokenizer regexes), ICU (normalisation, case mapping).
find_package(PkgConfig REQUIRED)
pkg_check_modules(SentencePiece REQUIRED IMPORTED_TARGET sentencepiece)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
find_package(ICU REQUIRED COMPONENTS uc i18n)

# LibTorch's exported flags carry -D_GLIBCXX_USE_CXX11_ABI; keep them on every target.
separate_arguments(SHARDIT_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")

# c10d (TCPStore, ProcessGroupGloo) is part of libtorch_cpu when LibTorch was built with USE_DISTRIBUTED.
include(CheckIncludeFileCXX)
set(CMAKE_REQUIRED_INCLUDES ${TORCH_INCLUDE_DIRS})
set(CMAKE_REQUIRED_FLAGS "-std=c++17")
check_include_file_cxx("torch/csrc/distributed/c10d/ProcessGroupGloo.hpp" SHARDIT_HAVE_GLOO_HEADERS)
unset(CMAKE_REQUIRED_INCLUDES)
unset(CMAKE_REQUIRED_FLAGS)
if(NOT SHARDIT_HAVE_GLOO_HEADERS)
  message(FATAL_ERROR "shardit needs c10d's ProcessGroupGloo headers (Debian: libgloo-dev; upstream LibTorch ships them).")
endif()

set(SHARDIT_WITH_CUDA OFF)
if(TARGET torch_cuda OR CUDA_FOUND)
  set(SHARDIT_WITH_CUDA ON)
endif()
set(SHARDIT_WITH_NCCL OFF)
if(SHARDIT_WITH_CUDA AND EXISTS "${TORCH_INSTALL_PREFIX}/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
  set(SHARDIT_WITH_NCCL ON)
endif()
set(SHARDIT_WITH_SDPA OFF)
if(Torch_VERSION VERSION_GREATER_EQUAL 2.0)
  set(SHARDIT_WITH_SDPA ON)
endif()

message(STATUS "shardit capabilities:")
message(STATUS "  LibTorch ${Torch_VERSION}")
message(STATUS "  CUDA     ${SHARDIT_WITH_CUDA}")
message(STATUS "  NCCL     ${SHARDIT_WITH_NCCL}")
message(STATUS "  SDPA     ${SHARDIT_WITH_SDPA}")

# One function so every shardit target gets the same flags (needed to share the precompiled header).
function(shardit_target_defaults target)
  target_compile_options(${target} PRIVATE ${SHARDIT_TORCH_CXX_FLAGS} -Wall -Wextra -Wno-unused-parameter)
  target_compile_definitions(${target} PUBLIC
    SHARDIT_WITH_CUDA=$<BOOL:${SHARDIT_WITH_CUDA}>
    SHARDIT_WITH_NCCL=$<BOOL:${SHARDIT_WITH_NCCL}>)
endfunction()
