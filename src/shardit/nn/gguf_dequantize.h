#pragma once
// GGUF (ggml) blocks to weights. The bytes of a tensor, whole blocks per row as io::GgufFile reads
// them, become fp32 values with the same bits as the reference dequantizer of the pinned gguf-py
// release (gguf.quants.dequantize, which computes in NumPy float32 with float16 scales): every
// product and sum below is one fp32 operation in the reference's order, with no fused
// multiply-add, so each element is rounded exactly where the reference rounds it. The ops are
// LibTorch tensor ops over all blocks at once, so the same code runs on the CPU and on a GPU and
// gives the same bits on both. See docs/quantization.md (GGUF).
#include <ATen/ATen.h>

#include <string>

#include "shardit/io/gguf.h"

namespace shardit::nn {

/// True for the ggml types gguf_dequantize handles: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
/// Q4_K, Q5_K, Q6_K, Q8_K.
bool gguf_dequantize_supported(io::GgmlType type);
/// The supported types' names, comma-separated (for messages).
const char* gguf_dequantize_supported_names();

/// `bytes` (uint8 [rows, row_bytes], each row whole blocks of `type`; any device) dequantized to
/// [rows, row_bytes / type_size * block_size]: fp32 values bit-equal to gguf-py's, then rounded
/// once to `dtype`. `what` names the tensor in errors.
at::Tensor gguf_dequantize(const at::Tensor& bytes, io::GgmlType type, at::ScalarType dtype = at::kFloat,
                           const std::string& what = "GGUF tensor");

/// Refuses `bytes` (as for gguf_dequantize) when a block's scale (d, dmin) is NaN or infinite,
/// naming `what`, the row and the block of the whole tensor (a rank's share starts at row
/// `first_row` and, in each row, at block `first_block`) and the value: a corrupt file, caught
/// before any compute.
void check_gguf_scales(const at::Tensor& bytes, io::GgmlType type, const std::string& what, int64_t first_row = 0,
                       int64_t first_block = 0);

/// The rows (the outer dimension, LibTorch's dim 0) that rank `tp_rank` of `tp_degree` holds when
/// the tensor is split colwise: whole rows, an equal share each. Refuses, naming the tensor and
/// listing the degrees that work, when `tp_degree` does not divide the rows.
io::Range gguf_rank_rows(const io::GgufTensorInfo& tensor, int64_t tp_degree, int64_t tp_rank);
/// The blocks of every row that rank `tp_rank` of `tp_degree` holds when the tensor is split
/// rowwise: rows are cut on block boundaries only (a block's scale covers all its elements), an
/// equal share each. Refuses, naming the tensor and listing the degrees that work, when
/// `tp_degree` does not divide the blocks of a row.
io::Range gguf_rank_blocks(const io::GgufTensorInfo& tensor, int64_t tp_degree, int64_t tp_rank);

}  // namespace shardit::nn
