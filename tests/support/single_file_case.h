// What the single-file and GGUF transformer tests share: the golden transformers written as the
// files users have (tests/golden/tools/make_single_file_cases.py, make_gguf_transformer_cases.py,
// into the build folder by their CTest setup entries), and a transformer loaded from such a file.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::testing {

/// A golden transformer as a single file (`file`: its name without the extension) and the golden
/// case whose folder and inputs it comes from.
struct SingleFileCase {
  const char* file;
  const char* golden_case;
};
/// FLUX.1 and FLUX.2 in Black Forest Labs' keys, Qwen-Image in ComfyUI's layout.
inline constexpr SingleFileCase kSingleFileCases[] = {{"flux1_bfl", "flux_b1_square"},
                                                      {"flux2_bfl", "flux2_b1_square"},
                                                      {"qwenimage_comfyui", "qwenimage_b1_square"}};

/// `relative` under the folder the setup entries write (the build folder's, or
/// $SHARDIT_SINGLE_FILE_DIR); an error naming the entries to run when it is missing.
std::string single_file_path(const std::string& relative);

/// The transformer of `model_dir` (its config.json) with its weights from the file `path`, loaded
/// whole or sharded over the world in `dtype`; `checkpoint` receives the mapped file.
std::shared_ptr<parallel::TensorParallelModule> load_transformer_file(const std::string& model_dir,
                                                                     const std::string& path, bool sharded,
                                                                     at::ScalarType dtype = at::kFloat,
                                                                     std::optional<io::Checkpoint>* checkpoint = nullptr);

}  // namespace shardit::testing
