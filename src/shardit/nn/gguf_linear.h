#pragma once
// A Linear's weight from a GGUF file, kept as GGUF blocks on each rank: what a loader calls for
// each Linear weight of a GGUF checkpoint (its key already mapped to the model's name). Each rank
// reads only its share of the blocks, with the tensor-parallel rule of a block format:
//   Colwise (and ColwiseGather): whole rows of A [out, in], an equal share each;
//   Rowwise: every row, cut on block boundaries only (a block's scales cover all its elements), an
//            equal share of each row's blocks; a degree that does not divide them is refused,
//            listing the degrees that work.
// The layer then dequantizes its blocks at each forward (Linear::set_gguf_weight). Fused (packed)
// layers, whose column blocks are sharded apart, are not handled here.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "shardit/io/gguf.h"
#include "shardit/nn/linear.h"

namespace shardit::nn {

/// This rank's codes of the GGUF weight `name` (uint8 [out_local, row_bytes_local]) for a layer
/// in `mode` at `tp_degree`: its rows (Colwise, ColwiseGather), its blocks of every row (Rowwise)
/// or the whole tensor (None). Only those bytes are read from the file.
at::Tensor read_gguf_linear_codes(const io::GgufFile& file, const std::string& name, LinearParallel mode,
                                  int64_t tp_degree, int64_t tp_rank);

/// The bytes one rank holds of that weight, as stored (what a memory plan counts for it).
int64_t gguf_linear_rank_bytes(const io::GgufTensorInfo& tensor, LinearParallel mode, int64_t tp_degree);

/// Holds `codes` (a rank's blocks of a GGUF weight, uint8 [out_local, row_bytes_local], read by the
/// caller, e.g. through a mapped io::Checkpoint) in `linear`, after checking that every block scale
/// is finite (check_gguf_scales, naming `what` and the share's first row and block in the whole
/// tensor). `dtype`: the dtype the weight would have dense.
void set_gguf_linear_codes(Linear& linear, at::Tensor codes, io::GgmlType type, const std::string& what,
                           int64_t first_row, int64_t first_block, at::ScalarType dtype);

/// Reads this rank's codes of `name` into `linear` (Linear::set_gguf_weight), after checking that
/// the tensor is 2-D with the layer's full shape [out_features, in_features] (LibTorch order), and
/// that every scale of the rank's blocks is finite (check_gguf_scales).
/// `dtype`: the dtype the weight would have dense.
void load_gguf_linear(Linear& linear, const io::GgufFile& file, const std::string& name, LinearParallel mode,
                      int64_t tp_degree, int64_t tp_rank, at::ScalarType dtype);

}  // namespace shardit::nn
