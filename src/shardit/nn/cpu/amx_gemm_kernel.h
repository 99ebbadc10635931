#pragma once
// The raw-pointer interface between nn/cpu/amx_gemm.cpp (tensors, checks, threads) and
// nn/cpu/amx_gemm_kernel.cpp (the tile loops, built with the AMX -m flags). Only <cstdint> here:
// the kernel's translation unit must not instantiate library templates.
#include <cstdint>

namespace shardit::nn::cpu {

/// One column block of x: `width` values (a multiple of 32) of each row, rows `stride` apart.
struct AmxInputPart {
  const uint16_t* x = nullptr;
  int64_t stride = 0;
  int64_t width = 0;
};

/// y[rows, out] = x[rows, in] w[out, in]^T (+ bias[out]), all bf16 as raw bits, rows `*_stride`
/// elements apart; x given as column blocks side by side (their widths sum to `in`). `in` and
/// `out` are multiples of 32, w_stride is even.
struct AmxLinearArgs {
  const AmxInputPart* parts = nullptr;
  int64_t part_count = 0;
  const uint16_t* w = nullptr;
  int64_t w_stride = 0;
  const uint16_t* bias = nullptr;  ///< nullptr: none
  bool gelu_tanh = false;          ///< y = gelu(x w^T + b, approximate="tanh"), on the fp32 sums
  uint16_t* y = nullptr;
  int64_t y_stride = 0;
  int64_t rows = 0, in = 0, out = 0;
};

// Cache blocking (fixed, so the order of every sum is too): a block of y of kAmxRowBlock x
// kAmxColumnBlock fp32 sums (512 KiB) stays in the core's L2 while the K loop runs over it in
// steps of kAmxDepthBlock, which keeps the 32 rows of x and the 32 columns of w of one tile block
// (32 KiB each) near L1. Measured on Sapphire Rapids-class cores (48 KiB L1, 2 MiB L2).
constexpr int64_t kAmxRowBlock = 512;
constexpr int64_t kAmxColumnBlock = 256;
constexpr int64_t kAmxDepthBlock = 512;

/// One thread's buffers, 64-byte aligned: packed_w (n_end - n_begin) * in / 2 words, sums
/// kAmxRowBlock * kAmxColumnBlock floats, tail_rows 32 * in values.
struct AmxScratch {
  uint32_t* packed_w = nullptr;
  float* sums = nullptr;
  uint16_t* tail_rows = nullptr;
};

/// False when the compiler could not build the kernel (then nothing else here may be called).
bool amx_gemm_kernel_built();

/// Columns [n_begin, n_end) of y (multiples of 32), every row; loads the tile configuration and
/// releases the tiles after. The sums of one output run over K in one fixed order whatever the
/// column range, so every split of the columns between threads gives the same bits.
void amx_bf16_linear_columns(const AmxLinearArgs& args, int64_t n_begin, int64_t n_end, const AmxScratch& scratch);

}  // namespace shardit::nn::cpu
