#include "shardit/nn/gguf_linear.h"

#include <c10/util/Exception.h>

#include <utility>

#include "shardit/nn/gguf_dequantize.h"

namespace shardit::nn {

namespace {

bool splits_rows(LinearParallel mode) { return mode == LinearParallel::Colwise || mode == LinearParallel::ColwiseGather; }

}  // namespace

at::Tensor read_gguf_linear_codes(const io::GgufFile& file, const std::string& name, LinearParallel mode,
                                  int64_t tp_degree, int64_t tp_rank) {
  const io::GgufTensorInfo& tensor = file.info(name);
  if (splits_rows(mode)) return file.read_rows(name, gguf_rank_rows(tensor, tp_degree, tp_rank));
  const io::Range rows{0, tensor.rows()};
  if (mode == LinearParallel::Rowwise) {
    return file.read_row_blocks(name, rows, gguf_rank_blocks(tensor, tp_degree, tp_rank));
  }
  return file.read_rows(name, rows);
}

int64_t gguf_linear_rank_bytes(const io::GgufTensorInfo& tensor, LinearParallel mode, int64_t tp_degree) {
  const int64_t row_bytes = static_cast<int64_t>(tensor.row_bytes());
  if (splits_rows(mode)) return gguf_rank_rows(tensor, tp_degree, 0).size() * row_bytes;
  if (mode == LinearParallel::Rowwise) {
    return tensor.rows() * gguf_rank_blocks(tensor, tp_degree, 0).size() * io::ggml_block(tensor.type).type_size;
  }
  return tensor.rows() * row_bytes;
}

void load_gguf_linear(Linear& linear, const io::GgufFile& file, const std::string& name, LinearParallel mode,
                      int64_t tp_degree, int64_t tp_rank, at::ScalarType dtype) {
  const io::GgufTensorInfo& tensor = file.info(name);
  const LinearOptions& options = linear.options();
  const std::vector<int64_t> expected{options.out_features, options.in_features};
  TORCH_CHECK(tensor.shape() == expected, file.path(), ": tensor '", name, "' (", io::ggml_type_name(tensor.type),
              ") has LibTorch shape ", c10::IntArrayRef(tensor.shape()), ", but Linear '", linear.path(),
              "' expects ", c10::IntArrayRef(expected));
  gguf_weight_format(tensor.type, file.path() + ": tensor '" + name + "'");  // refuses dense and unknown types first
  at::Tensor codes = read_gguf_linear_codes(file, name, mode, tp_degree, tp_rank);
  const int64_t first_row = splits_rows(mode) ? gguf_rank_rows(tensor, tp_degree, tp_rank).begin : 0;
  const int64_t first_block = mode == LinearParallel::Rowwise ? gguf_rank_blocks(tensor, tp_degree, tp_rank).begin : 0;
  set_gguf_linear_codes(linear, std::move(codes), tensor.type, file.path() + ": tensor '" + name + "'", first_row,
                        first_block, dtype);
}

void set_gguf_linear_codes(Linear& linear, at::Tensor codes, io::GgmlType type, const std::string& what,
                           int64_t first_row, int64_t first_block, at::ScalarType dtype) {
  check_gguf_scales(codes, type, what, first_row, first_block);
  linear.set_gguf_weight(std::move(codes), type, dtype);
}

}  // namespace shardit::nn
