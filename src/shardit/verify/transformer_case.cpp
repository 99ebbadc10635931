#include "shardit/verify/transformer_case.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <utility>

#include "shardit/models/joint_transformer.h"

namespace shardit::verify {

namespace {

/// Whether a path segment is a module-list index ("0").
bool is_index(const std::string& segment) {
  return !segment.empty() && std::all_of(segment.begin(), segment.end(), [](char c) { return std::isdigit(c); });
}

/// True when the dotted path goes through a module-list entry ("transformer_blocks.0...").
bool inside_block(const std::string& path) {
  size_t begin = 0;
  while (begin < path.size()) {
    const size_t dot = path.find('.', begin);
    if (is_index(path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin))) return true;
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return false;
}

}  // namespace

at::Tensor forward_from_file(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs) {
  auto* transformer = dynamic_cast<models::JointTransformer2DModel*>(&model);
  TORCH_CHECK(transformer != nullptr, inputs.path(), ": no input reader for a ", model.type_name());
  return transformer->forward_from_file(inputs);
}

nn::ForwardObserver golden_observer(GoldenRecorder record) {
  return [record = std::move(record)](const std::string& path, const std::string& name, const at::Tensor& value) {
    record(inside_block(path) ? "debug." + path + "." + name : name, value);
  };
}

}  // namespace shardit::verify
