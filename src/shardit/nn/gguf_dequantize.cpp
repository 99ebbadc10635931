#include "shardit/nn/gguf_dequantize.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

namespace shardit::nn {

namespace {

using io::GgmlType;

// The fp16 at byte `at` of each block, as fp32 ([n, 1]; exact).
at::Tensor f16_at(const at::Tensor& blocks, int64_t at) {
  return blocks.narrow(1, at, 2).contiguous().view(at::kHalf).to(at::kFloat);
}

// Bytes [at, at + count) of each block ([n, count], uint8).
at::Tensor bytes_at(const at::Tensor& blocks, int64_t at, int64_t count) { return blocks.narrow(1, at, count); }

// [n, groups * width] bytes -> [n, groups * 2, width] nibbles: each group's low nibbles, then its high ones.
at::Tensor nibbles(const at::Tensor& packed, int64_t groups, int64_t width) {
  const at::Tensor q = packed.reshape({packed.size(0), groups, 1, width});
  return at::cat({at::bitwise_and(q, 0x0F), at::bitwise_right_shift(q, 4)}, 2).reshape({packed.size(0), groups * 2, width});
}

// [n, bytes] -> [n, bytes * 8 / bits, ...]: field k of width `bits` of every byte (k-th shift group first).
at::Tensor bit_fields(const at::Tensor& packed, int64_t bits) {
  const int64_t fields = 8 / bits;
  const at::Tensor shifts =
      at::arange(0, 8, bits, at::TensorOptions().dtype(at::kLong).device(packed.device())).to(at::kByte).view({1, fields, 1});
  return at::bitwise_and(at::bitwise_right_shift(packed.unsqueeze(1), shifts), (1 << bits) - 1);  // [n, fields, bytes]
}

// The 32 high bits of Q5_0/Q5_1 (a little-endian u32 at `at`): bit j of the u32 is element j's.
at::Tensor q5_high_bits(const at::Tensor& blocks, int64_t at) {
  const at::Tensor qh = bytes_at(blocks, at, 4);                                          // [n, 4]
  return bit_fields(qh, 1).transpose(1, 2).reshape({blocks.size(0), 32});                 // [n, 32]
}

at::Tensor as_float(const at::Tensor& codes) { return codes.to(at::kFloat); }

// Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes at byte 4 ([n, 8] each, uint8).
std::pair<at::Tensor, at::Tensor> k_scales_mins(const at::Tensor& blocks) {
  const at::Tensor packed = bytes_at(blocks, 4, 12).reshape({blocks.size(0), 3, 4});
  const at::Tensor d = packed.select(1, 0);
  const at::Tensor m = packed.select(1, 1);
  const at::Tensor md = packed.select(1, 2);
  const at::Tensor scales = at::cat(
      {at::bitwise_and(d, 0x3F), at::bitwise_or(at::bitwise_and(md, 0x0F), at::bitwise_and(at::bitwise_right_shift(d, 2), 0x30))},
      1);
  const at::Tensor mins = at::cat(
      {at::bitwise_and(m, 0x3F), at::bitwise_or(at::bitwise_right_shift(md, 4), at::bitwise_and(at::bitwise_right_shift(m, 2), 0x30))},
      1);
  return {scales, mins};
}

// Q4_K and Q5_K: (d * scale) * q - (dmin * min), each product rounded to fp32 as the reference does.
at::Tensor k_affine(const at::Tensor& blocks, const at::Tensor& q /*[n, 8, 32] uint8*/) {
  const auto [scales, mins] = k_scales_mins(blocks);
  const at::Tensor d = f16_at(blocks, 0).mul(as_float(scales)).unsqueeze(2);     // [n, 8, 1]
  const at::Tensor dmin = f16_at(blocks, 2).mul(as_float(mins)).unsqueeze(2);    // [n, 8, 1]
  return d.mul(as_float(q)).sub(dmin).reshape({blocks.size(0), 256});
}

// One row of blocks [n, type_size] -> [n, block_size] fp32.
at::Tensor dequantize_blocks(const at::Tensor& blocks, GgmlType type) {
  const int64_t n = blocks.size(0);
  switch (type) {
    case GgmlType::Q4_0: {
      const at::Tensor q = nibbles(bytes_at(blocks, 2, 16), 1, 16).reshape({n, 32});
      return f16_at(blocks, 0).mul(as_float(q).sub(8));
    }
    case GgmlType::Q4_1: {
      const at::Tensor q = nibbles(bytes_at(blocks, 4, 16), 1, 16).reshape({n, 32});
      return f16_at(blocks, 0).mul(as_float(q)).add(f16_at(blocks, 2));
    }
    case GgmlType::Q5_0: {
      const at::Tensor low = nibbles(bytes_at(blocks, 6, 16), 1, 16).reshape({n, 32});
      const at::Tensor q = at::bitwise_or(low, at::bitwise_left_shift(q5_high_bits(blocks, 2), 4));
      return f16_at(blocks, 0).mul(as_float(q).sub(16));
    }
    case GgmlType::Q5_1: {
      const at::Tensor low = nibbles(bytes_at(blocks, 8, 16), 1, 16).reshape({n, 32});
      const at::Tensor q = at::bitwise_or(low, at::bitwise_left_shift(q5_high_bits(blocks, 4), 4));
      return f16_at(blocks, 0).mul(as_float(q)).add(f16_at(blocks, 2));
    }
    case GgmlType::Q8_0:
      return as_float(bytes_at(blocks, 2, 32).contiguous().view(at::kChar)).mul(f16_at(blocks, 0));
    case GgmlType::Q4_K:
      return k_affine(blocks, nibbles(bytes_at(blocks, 16, 128), 4, 32));
    case GgmlType::Q5_K: {
      const at::Tensor low = nibbles(bytes_at(blocks, 48, 128), 4, 32);              // [n, 8, 32]
      const at::Tensor high = bit_fields(bytes_at(blocks, 16, 32), 1);               // [n, 8, 32]
      return k_affine(blocks, at::bitwise_or(low, at::bitwise_left_shift(high, 4)));
    }
    case GgmlType::Q6_K: {
      const at::Tensor low = nibbles(bytes_at(blocks, 0, 128), 2, 64).reshape({n, 8, 32});
      const at::Tensor high = bit_fields(bytes_at(blocks, 128, 64).reshape({n * 2, 32}), 2).reshape({n, 8, 32});
      const at::Tensor q = as_float(at::bitwise_or(low, at::bitwise_left_shift(high, 4))).sub(32).reshape({n, 16, 16});
      const at::Tensor scales = as_float(bytes_at(blocks, 192, 16).contiguous().view(at::kChar));   // [n, 16]
      const at::Tensor d = f16_at(blocks, 208).mul(scales).unsqueeze(2);                            // [n, 16, 1]
      return d.mul(q).reshape({n, 256});
    }
    case GgmlType::Q8_K: {
      const at::Tensor d = bytes_at(blocks, 0, 4).contiguous().view(at::kFloat);                    // [n, 1]
      return d.mul(as_float(bytes_at(blocks, 4, 256).contiguous().view(at::kChar)));
    }
    case GgmlType::F32: return blocks.contiguous().view(at::kFloat);
    case GgmlType::F16: return blocks.contiguous().view(at::kHalf).to(at::kFloat);
    case GgmlType::BF16: return blocks.contiguous().view(at::kBFloat16).to(at::kFloat);
    default: break;
  }
  TORCH_INTERNAL_ASSERT(false, "dequantize_blocks: unhandled ggml type ", io::ggml_type_name(type));
}

// The degrees from 1 to min(n, 64) that divide n: "1, 2, 4".
std::string gguf_degrees_dividing(int64_t n) {
  std::string out;
  for (int64_t d = 1; d <= std::min<int64_t>(n, 64); ++d) {
    if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
  }
  return out.empty() ? "none" : out;
}

io::Range gguf_rank_share(const io::GgufTensorInfo& tensor, int64_t count, const std::string& unit, int64_t tp_degree,
                          int64_t tp_rank) {
  TORCH_INTERNAL_ASSERT(tp_degree >= 1 && tp_rank >= 0 && tp_rank < tp_degree, "rank ", tp_rank, " of ", tp_degree);
  TORCH_CHECK(count % tp_degree == 0, "GGUF tensor '", tensor.name, "' (", io::ggml_type_name(tensor.type),
              ", LibTorch shape ", c10::IntArrayRef(tensor.shape()), ") has ", count, " ", unit,
              ", which tensor-parallel degree ", tp_degree, " does not split evenly; degrees that work: ",
              gguf_degrees_dividing(count));
  const int64_t share = count / tp_degree;
  return io::Range{tp_rank * share, (tp_rank + 1) * share};
}

}  // namespace

io::Range gguf_rank_rows(const io::GgufTensorInfo& tensor, int64_t tp_degree, int64_t tp_rank) {
  return gguf_rank_share(tensor, tensor.rows(), "rows (a colwise split keeps rows whole)", tp_degree, tp_rank);
}

io::Range gguf_rank_blocks(const io::GgufTensorInfo& tensor, int64_t tp_degree, int64_t tp_rank) {
  const std::string unit = c10::str("blocks of ", io::ggml_block(tensor.type).block_size,
                                    " elements in each row (a rowwise split cuts rows on block boundaries only)");
  return gguf_rank_share(tensor, tensor.blocks_per_row(), unit, tp_degree, tp_rank);
}

bool gguf_dequantize_supported(io::GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::Q8_K: return true;
    default: return false;
  }
}

const char* gguf_dequantize_supported_names() {
  return "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q8_K";
}

void check_gguf_scales(const at::Tensor& bytes, io::GgmlType type, const std::string& what, int64_t first_row,
                       int64_t first_block) {
  // Where each type's fp16 scales sit in its block (Q8_K's is an fp32 at byte 0).
  std::vector<int64_t> fp16_at;
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0: fp16_at = {0}; break;
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: fp16_at = {0, 2}; break;
    case GgmlType::Q6_K: fp16_at = {208}; break;
    case GgmlType::Q8_K: break;
    default: return;  // plain types: their values are the weights
  }
  const io::GgmlBlock block = io::ggml_block(type);
  if (bytes.numel() == 0) return;
  const at::Tensor blocks = bytes.contiguous().view({-1, block.type_size});
  std::vector<at::Tensor> scales;
  for (const int64_t at : fp16_at) scales.push_back(f16_at(blocks, at));
  if (type == GgmlType::Q8_K) scales.push_back(bytes_at(blocks, 0, 4).contiguous().view(at::kFloat));
  const at::Tensor all = at::cat(scales, 1).cpu();                              // [n, scales per block]
  const at::Tensor bad = all.isfinite().logical_not().any(1).nonzero();         // [k, 1]
  if (bad.numel() == 0) return;
  const int64_t index = bad[0][0].item<int64_t>();
  const int64_t per_row = bytes.size(1) / block.type_size;
  const at::Tensor values = all[index];
  const float value = values.isfinite().logical_not().nonzero().numel() > 0
                          ? values[values.isfinite().logical_not().nonzero()[0][0]].item<float>()
                          : 0.0f;
  TORCH_CHECK(false, what, " (", io::ggml_type_name(type), ") has a non-finite scale (", value, ") in block ",
              first_block + index % per_row, " of row ", first_row + index / per_row, " (blocks read with one: ", bad.size(0),
              "); the file is corrupt (download it again, or quantize it again)");
}

at::Tensor gguf_dequantize(const at::Tensor& bytes, io::GgmlType type, at::ScalarType dtype, const std::string& what) {
  TORCH_CHECK(gguf_dequantize_supported(type), what, " is stored as ggml type ", io::ggml_type_name(type),
              ", which shardit does not dequantize (supported: ", gguf_dequantize_supported_names(),
              "); re-quantize the checkpoint to one of those");
  TORCH_INTERNAL_ASSERT(bytes.scalar_type() == at::kByte && bytes.dim() == 2, "gguf_dequantize: ", what,
                        " bytes must be uint8 [rows, row_bytes], got ", bytes.scalar_type(), " ", bytes.sizes());
  const io::GgmlBlock block = io::ggml_block(type);
  const int64_t rows = bytes.size(0);
  TORCH_CHECK(bytes.size(1) % block.type_size == 0, what, ": rows of ", bytes.size(1), " bytes are not whole ",
              io::ggml_type_name(type), " blocks of ", block.type_size, " bytes");
  const int64_t row_length = bytes.size(1) / block.type_size * block.block_size;
  if (rows == 0 || row_length == 0) return at::empty({rows, row_length}, bytes.options().dtype(dtype));
  const at::Tensor blocks = bytes.contiguous().view({-1, block.type_size});  // [rows * blocks_per_row, type_size]
  at::Tensor values = dequantize_blocks(blocks, type).reshape({rows, row_length});
  if (type == GgmlType::F32) values = values.clone();  // never an alias of the input's bytes
  return values.to(dtype);
}

}  // namespace shardit::nn
