#pragma once
// shardit's bf16 matrix product on AMX tiles (Intel Sapphire Rapids and later), for the Linear
// layers' large products.
//
// Why our own: LibTorch 1.13 sends bf16 products to oneDNN 2.6, whose AMX kernels reach ~1.6-1.9
// TFLOP/s on two cores of the model's shapes, a quarter of what the tiles do (3.5 TFLOP/s a core,
// measured with products alone), and 80% of a bf16 FLUX step is those products. This kernel packs
// each thread's columns of the weight once per call into the tiles' pair layout, reads x in place,
// and keeps a 512 x 256 block of fp32 sums in L2 across the K loop: 1.1-1.25x oneDNN's rate on
// products of more than 512 rows (docs/benchmarks.md has the table).
//
// Numerics: each output is sum_k x[m][k] w[n][k] in fp32 on the tiles (products of bf16 pairs,
// denormals as zero, as oneDNN's AMX kernels), k in one fixed order, plus the bias, rounded once
// to bf16. Same inputs, same bits, whatever the thread count or load.
#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace shardit::nn::cpu {

/// Whether this process runs the kernel: built with it, the CPU has AMX-BF16 and AVX512-BF16 and
/// the OS grants the tile state (asked once).
bool amx_gemm_available();

/// Why not, for errors ("" when available).
std::string amx_gemm_unavailable_reason();

/// Whether the kernel computes a product of these widths: `in` and `out` multiples of 32.
bool amx_gemm_takes(int64_t in, int64_t out);

/// at::linear's result for bf16 x [rows, in] (last dimension contiguous), weight [out, in] (last
/// dimension contiguous), bias [out] or undefined -> [rows, out] bf16, contiguous. Needs
/// amx_gemm_available() and amx_gemm_takes(in, out); an error names what does not fit.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

/// The same for x given as column blocks side by side (each [..., in_i] with one leading shape,
/// widths multiples of 32 that sum to in): the product of their concatenation, without building
/// it, and the same bits as amx_linear of the concatenation.
at::Tensor amx_linear(const std::vector<at::Tensor>& x_parts, const at::Tensor& weight, const at::Tensor& bias);

/// gelu(amx_linear(x, weight, bias), approximate="tanh") with the GELU on each output's fp32 sum
/// before its one rounding to bf16 (where a separate pass would round twice and read and write
/// the output once more).
at::Tensor amx_linear_gelu_tanh(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace shardit::nn::cpu
