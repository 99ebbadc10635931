#include "support/single_file_case.h"

#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include "shardit/models/registry.h"
#include "support/test_support.h"

namespace shardit::testing {

std::string single_file_path(const std::string& relative) {
  const char* dir = std::getenv("SHARDIT_SINGLE_FILE_DIR");
  const std::string path = std::string(dir ? dir : SHARDIT_SINGLE_FILE_DIR) + "/" + relative;
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error(path + " is missing: run `ctest -R 'make_single_file_cases|make_gguf_transformer_cases'` "
                             "first (tests/golden/tools/make_single_file_cases.py and "
                             "make_gguf_transformer_cases.py write it)");
  }
  return path;
}

std::shared_ptr<parallel::TensorParallelModule> load_transformer_file(const std::string& model_dir,
                                                                     const std::string& path, bool sharded,
                                                                     at::ScalarType dtype,
                                                                     std::optional<io::Checkpoint>* checkpoint) {
  const auto folder = io::open_component(model_dir, "transformer");
  auto model = models::create_transformer(folder);
  const io::Checkpoint weights = models::open_transformer_file(path, folder.class_name(), *model);
  parallel::LoadOptions options;
  options.dtype = dtype;
  if (sharded) options.tensor_parallel = world_tensor_parallel();
  model->load(weights, options);
  if (checkpoint != nullptr) *checkpoint = weights;
  return model;
}

}  // namespace shardit::testing
