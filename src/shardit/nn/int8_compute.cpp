#include "shardit/nn/int8_compute.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "shardit/core/cpu_features.h"

namespace shardit::nn {

namespace {

/// Makes `engine` LibTorch's quantized engine for the guard's lifetime (prepacking reads it).
class QEngineGuard {
 public:
  explicit QEngineGuard(at::QEngine engine) : previous_(at::globalContext().qEngine()) {
    at::globalContext().setQEngine(engine);
  }
  ~QEngineGuard() { at::globalContext().setQEngine(previous_); }
  QEngineGuard(const QEngineGuard&) = delete;
  QEngineGuard& operator=(const QEngineGuard&) = delete;

 private:
  at::QEngine previous_;
};

std::string supported_engine_names() {
  std::ostringstream names;
  for (const at::QEngine engine : at::globalContext().supportedQEngines()) {
    if (engine == at::QEngine::NoQEngine) continue;
    names << (names.tellp() > 0 ? ", " : "") << c10::toString(engine);
  }
  return names.tellp() > 0 ? names.str() : "none";
}

bool has_engine(at::QEngine engine) {
  const auto& engines = at::globalContext().supportedQEngines();
  return std::find(engines.begin(), engines.end(), engine) != engines.end();
}

constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23

/// fn(r) for every row r of a [rows, cols] tensor, over the threads in blocks of about 64K elements.
template <class Fn>
void for_each_row(int64_t rows, int64_t cols, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) fn(r);
                   });
}

/// rows [0, rows): round-half-even(x / x_scale) clamped to ±code_max; rows `rows` and `rows + 1`:
/// the anchors -(code_max + 1) and code_max in column 0, zeros elsewhere.
template <class T>
void write_codes(const at::Tensor& x2d, const float* x_scale, float code_max, at::Tensor& out) {
  const int64_t rows = x2d.size(0);
  const int64_t cols = x2d.size(1);
  const T* src = x2d.data_ptr<T>();
  float* dst = out.data_ptr<float>();
  for_each_row(rows, cols, [&](int64_t r) {
    for (int64_t c = 0; c < cols; ++c) {
      // Divided, as quantize_rows does, and clamped, then rounded half to even by adding and
      // subtracting 1.5 * 2^23 (exact below 2^22; unlike nearbyint, the compiler vectorizes it).
      const float value = std::min(std::max(static_cast<float>(src[r * cols + c]) / x_scale[r], -code_max), code_max);
      dst[r * cols + c] = (value + kRoundingShift) - kRoundingShift;
    }
  });
  float* anchors = dst + rows * cols;
  std::fill(anchors, anchors + 2 * cols, 0.0f);
  anchors[0] = -(code_max + 1);
  anchors[cols] = code_max;
}

}  // namespace

int int8_activation_code_max() { return cpu_features().avx512_vnni ? 127 : 63; }

at::QEngine int8_compute_engine() {
  for (const at::QEngine engine : {at::QEngine::ONEDNN, at::QEngine::X86, at::QEngine::FBGEMM}) {
    if (has_engine(engine)) return engine;
  }
  TORCH_CHECK(false, "--int8-compute: this LibTorch has no x86 quantized engine (ONEDNN, X86 or FBGEMM; it has ",
              supported_engine_names(), "); run without --int8-compute (int8 weights are then dequantized for a "
              "dense product)");
}

void check_int8_compute(WeightsDtype weights, const at::Device& device) {
  TORCH_CHECK(weights == WeightsDtype::Int8, "--int8-compute multiplies int8 weights: add --weights-dtype int8 (got "
              "--weights-dtype ", weights_dtype_name(weights), ")");
  TORCH_CHECK(device.is_cpu(), "--int8-compute runs on the CPU only (LibTorch's quantized engines), not on ", device,
              "; drop it (int8 weights are then dequantized for a dense product)");
  int8_compute_engine();
}

at::Tensor int8_row_absmax(const at::Tensor& x2d) {
  TORCH_INTERNAL_ASSERT(x2d.dim() == 2);
  // The infinity norm: one vectorized pass, no |x| tensor; a maximum is exact.
  return at::linalg_vector_norm(x2d, std::numeric_limits<double>::infinity(), {1}, false, at::kFloat);
}

at::Tensor int8_activation_scales(const at::Tensor& row_absmax) {
  return symmetric_row_scales(row_absmax, static_cast<float>(int8_activation_code_max()));
}

struct Int8PackedWeight::Packed {
  c10::intrusive_ptr<LinearPackedParamsBase> params;
};

Int8PackedWeight::Int8PackedWeight(const at::Tensor& codes) {
  TORCH_INTERNAL_ASSERT(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.device().is_cpu(),
                        "Int8PackedWeight: expected [out, in] int8 codes on the CPU, got ", codes.sizes(), " ",
                        codes.scalar_type());
  static auto prepack = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("quantized::linear_prepack", "")
                            .typed<c10::intrusive_ptr<LinearPackedParamsBase>(at::Tensor, c10::optional<at::Tensor>)>();
  // A scale of 1: the product is the integer accumulator, and the weight's own scales are applied
  // after it.
  const at::Tensor quantized = at::_make_per_tensor_quantized_tensor(codes.contiguous(), 1.0, 0);
  QEngineGuard engine(int8_compute_engine());
  packed_ = std::make_shared<const Packed>(Packed{prepack.call(quantized, c10::nullopt)});
}

at::Tensor Int8PackedWeight::codes() const {
  const at::Tensor quantized = std::get<0>(packed_->params->unpack());  // qint8, scale 1
  return at::from_blob(
      quantized.data_ptr(), quantized.sizes(), quantized.strides(), [quantized](void*) {},
      at::TensorOptions().dtype(at::kChar));
}

at::Tensor Int8PackedWeight::accumulate(const at::Tensor& x2d, const at::Tensor& x_scale) const {
  TORCH_INTERNAL_ASSERT(x2d.dim() == 2 && x_scale.dim() == 1 && x_scale.size(0) == x2d.size(0));
  const int64_t rows = x2d.size(0);
  const int code_max = int8_activation_code_max();
  const at::Tensor source = x2d.contiguous();
  const at::Tensor scales = x_scale.to(at::kFloat).contiguous();
  // [rows + 2, in]: the codes, then the two anchor rows.
  at::Tensor codes = at::empty({rows + 2, x2d.size(1)}, x2d.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, source.scalar_type(), "int8 compute codes", [&] {
    write_codes<scalar_t>(source, scales.data_ptr<float>(), static_cast<float>(code_max), codes);
  });
  // reduce_range: the engine's range is then 0..127 (7-bit activations), which the anchors of
  // code_max 63 fill exactly.
  const at::Tensor accumulator = packed_->params->apply_dynamic(codes, /*reduce_range=*/code_max < 127);
  return accumulator.narrow(0, 0, rows);  // [rows, out]
}

at::Tensor int8_rescale(const at::Tensor& accumulator, const at::Tensor& w_scale, const at::Tensor& x_scale,
                        const at::Tensor& bias, at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(accumulator.dim() == 2 && accumulator.is_contiguous() && accumulator.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(w_scale.numel() == accumulator.size(1) && x_scale.numel() == accumulator.size(0));
  const int64_t cols = accumulator.size(1);
  const at::Tensor w = w_scale.to(at::kFloat).contiguous();
  const at::Tensor x = x_scale.to(at::kFloat).contiguous();
  const at::Tensor b = bias.defined() ? bias.to(dtype).contiguous() : at::Tensor();
  // In place for fp32: a fresh output of a large product costs its page faults again every call.
  at::Tensor out = dtype == at::kFloat ? accumulator : at::empty(accumulator.sizes(), accumulator.options().dtype(dtype));
  const float* acc = accumulator.data_ptr<float>();
  const float* w_data = w.data_ptr<float>();
  const float* x_data = x.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_rescale", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    const scalar_t* b_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    for_each_row(accumulator.size(0), cols, [&](int64_t r) {
      for (int64_t c = 0; c < cols; ++c) {
        // Rounded to the output dtype before the bias, as a dense product in that dtype adds it.
        scalar_t y = static_cast<scalar_t>(acc[r * cols + c] * w_data[c] * x_data[r]);
        if (b_data != nullptr) y = static_cast<scalar_t>(static_cast<float>(y) + static_cast<float>(b_data[c]));
        dst[r * cols + c] = y;
      }
    });
  });
  return out;
}

}  // namespace shardit::nn
