#pragma once
// Int8 compute (`--int8-compute`): a Linear with int8 weights multiplies int8 activation codes by
// its int8 weight codes in LibTorch's quantized engine (an int32 accumulator), instead of
// dequantizing its weight to the compute dtype for a dense product. On CPU only.
//
//   y[t, o] = acc[t, o] · w_scale[o] · x_scale[t] (+ b[o]),   acc[t, o] = Σ_i xq[t, i] · wq[o, i]
//
// - wq, w_scale: the Linear's int8 codes and per-output-row scales, unchanged (nn/quantized_weight.h).
// - xq, x_scale: each token (row of the input) quantized symmetrically with its own scale,
//   x_scale[t] = max_i |x[t, i]| / A, xq = round-half-even(x / x_scale) clamped to ±A. A = 127 where
//   the CPU has VNNI (exact int32 accumulation), 63 otherwise: without VNNI the int8 kernels add
//   pairs of u8·s8 products in int16, which 8-bit codes can saturate (LibTorch's reduce_range).
//
// LibTorch's dynamic quantized linear quantizes the whole input with one (asymmetric) scale. It
// is given the codes themselves, as fp32 integers, with two anchor rows that hold -(A+1) and A:
// the range it then picks is exactly [-(A+1), A] over 2A+2 steps, a scale of 1, so its own
// quantization reproduces the codes exactly and its fp32 result is the integer accumulator
// (exact below 2^24). The weight is packed with a scale of 1 and the scales are applied here, in
// fp32, in the order of the formula.
#include <ATen/ATen.h>

#include <memory>

#include "shardit/nn/quantized_weight.h"

namespace shardit::nn {

/// The largest activation code A (127 with VNNI, 63 without; see above).
int int8_activation_code_max();

/// The quantized engine int8 compute runs on: the first of ONEDNN, X86, FBGEMM that this LibTorch
/// has. QNNPACK (mobile kernels) is not used: on x86 it is slower than the fp32 product.
/// An error naming the engines LibTorch has when none of them is there.
at::QEngine int8_compute_engine();

/// Refuses int8 compute where it cannot run: `weights` other than Int8, a device other than the
/// CPU, or a LibTorch without a usable quantized engine (the messages name the flags).
void check_int8_compute(WeightsDtype weights, const at::Device& device);

/// An int8 weight packed for the engine (its own copy of the codes, in the engine's layout).
class Int8PackedWeight {
 public:
  /// `codes` [out, in] int8.
  explicit Int8PackedWeight(const at::Tensor& codes);
  /// The codes [out, in] as the engine keeps them beside its packed copy (the Linear holds this
  /// instead of a copy of its own).
  at::Tensor codes() const;
  /// acc[t, o] for each token t of `x2d` [rows, in] (any float dtype) quantized with `x_scale`
  /// [rows] (int8_activation_scales): [rows, out] fp32, neither scale applied.
  at::Tensor accumulate(const at::Tensor& x2d, const at::Tensor& x_scale) const;

 private:
  struct Packed;
  std::shared_ptr<const Packed> packed_;
};

/// acc[t, o] · w_scale[o] · x_scale[t] (+ bias[o] when defined) in `dtype`, in one pass: the
/// product from Int8PackedWeight::accumulate's result, written over it when `dtype` is fp32.
at::Tensor int8_rescale(const at::Tensor& accumulator, const at::Tensor& w_scale, const at::Tensor& x_scale,
                        const at::Tensor& bias, at::ScalarType dtype);

/// max_i |x2d[t, i]| of each row of `x2d` [rows, in], fp32 (exact).
at::Tensor int8_row_absmax(const at::Tensor& x2d);

/// x_scale of each token from its largest |x| `row_absmax` [rows] (over every rank's slice of
/// the row, under tensor parallelism): row_absmax / A, 1 for an all-zero row.
at::Tensor int8_activation_scales(const at::Tensor& row_absmax);

}  // namespace shardit::nn
