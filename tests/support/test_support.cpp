#include "support/test_support.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <sstream>
#include <thread>
#include <sys/wait.h>
#include <unistd.h>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/vae.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/verify/transformer_case.h"

namespace shardit::testing {

std::shared_ptr<models::AutoencoderModel> load_golden_vae(const std::string& case_name) {
  const io::ComponentFolder folder = io::open_component(golden_path(case_name), "vae");
  auto vae = models::create_vae(folder);
  vae->load(folder.weights(), {});
  return vae;
}

parallel::TensorParallelConfig world_tensor_parallel() {
  dist::World& world = dist::World::get();
  if (world.size() == 1) return parallel::TensorParallelConfig(dist::DeviceMesh(world, {{"tp", 1}}), "tp");
  return parallel::ParallelDims{1, 1, 1, 0}.build(world).tensor_parallel().value();
}

std::shared_ptr<parallel::TensorParallelModule> load_transformer(const std::string& model_dir,
                                                                 const std::string& path, parallel::TpPlanKind kind,
                                                                 nn::WeightsDtype weights, bool quantize_kept,
                                                                 bool int8_compute) {
  const auto folder = io::open_component(model_dir, "transformer");
  auto model = models::create_transformer(folder);
  parallel::LoadOptions options;
  options.plan = kind;
  options.weights = weights;
  options.quantize_kept_layers = quantize_kept;
  options.int8_compute = int8_compute;
  if (path == "shard-on-load") {
    options.tensor_parallel = world_tensor_parallel();
  } else if (path != "whole" && path != "enable-parallelism") {
    throw std::invalid_argument("load_transformer: unknown load path '" + path + "'");
  }
  model->load(folder.weights(), options);
  if (path == "enable-parallelism") {
    model->enable_parallelism(world_tensor_parallel(), kind);
  }
  return model;
}

at::Tensor run_case(parallel::TensorParallelModule& model, const std::string& inputs_dir) {
  return verify::forward_from_file(model, *io::SafetensorsFile::open(inputs_dir + "/inputs.safetensors"));
}

std::string golden_path(const std::string& relative) {
  // Under CTest every case knows its labels (tests/CMakeLists.txt): one that reads the golden data
  // must carry `golden`, so that `ctest -LE golden` leaves out every case that needs it.
  if (const char* labels = std::getenv("SHARDIT_TEST_LABELS")) {
    if (("," + std::string(labels) + ",").find(",golden,") == std::string::npos) {
      const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
      throw std::logic_error(std::string(info ? info->name() : "this test") +
                             " reads the golden data but its CTest entry is not labelled golden (labels: " +
                             labels + "); put \"Golden\" in the test's name");
    }
  }
  const char* override_dir = std::getenv("SHARDIT_GOLDEN_DIR");
  const std::string root = override_dir ? override_dir : SHARDIT_GOLDEN_DIR;
  if (!std::filesystem::is_directory(root)) {
    throw std::runtime_error("golden data not found: '" + root +
                             "' is not a folder; set SHARDIT_GOLDEN_DIR (or configure with "
                             "-DSHARDIT_GOLDEN_DIR=...), or leave these tests out with `ctest -LE golden`");
  }
  const std::string path = relative.empty() ? root : root + "/" + relative;
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error("golden data '" + relative + "' not found in '" + root + "'");
  }
  return path;
}

std::string divisors_of(int64_t n, int64_t limit) {
  std::string list;
  for (int64_t d = 1; d <= std::min(n, limit); ++d) {
    if (n % d == 0) list += (list.empty() ? "" : ", ") + std::to_string(d);
  }
  return list;
}

namespace {
std::vector<std::string>& temp_dirs() {
  static std::vector<std::string> dirs;
  return dirs;
}
void remove_temp_dirs() {
  for (const auto& dir : temp_dirs()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
}
}  // namespace

std::string make_temp_dir(const std::string& tag) {
  static std::once_flag registered;
  // Build the list before registering the handler, so it outlives the handler.
  std::call_once(registered, [] {
    temp_dirs();
    std::atexit(remove_temp_dirs);
  });
  std::string pattern = (std::filesystem::temp_directory_path() / ("shardit-" + tag + "-XXXXXX")).string();
  char* made = mkdtemp(pattern.data());
  if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
  // Only the process that made it removes it (worker ranks run as separate processes).
  temp_dirs().push_back(made);
  return made;
}

::testing::AssertionResult tensors_close(const std::string& what, const at::Tensor& actual,
                                         const at::Tensor& expected, double atol, double rtol) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << what << ": undefined tensor";
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << what << ": shape " << actual.sizes() << ", expected "
                                         << expected.sizes();
  }
  // Compared on the CPU: either side may have been computed on another device.
  const at::Tensor a = actual.to(at::kCPU, at::kDouble).contiguous();
  const at::Tensor b = expected.to(at::kCPU, at::kDouble).contiguous();
  const at::Tensor diff = (a - b).abs();
  const at::Tensor limit = atol + rtol * b.abs();
  const at::Tensor bad = (diff > limit) | (a.isnan() != b.isnan());
  const double max_diff = diff.numel() ? diff.max().item<double>() : 0.0;
  if (!bad.any().item<bool>()) {
    return ::testing::AssertionSuccess() << what << ": max abs diff " << max_diff;
  }
  const int64_t first = bad.flatten().nonzero().select(1, 0)[0].item<int64_t>();
  std::ostringstream index;
  int64_t rest = first;
  std::vector<int64_t> coords(b.dim());
  for (int64_t d = b.dim() - 1; d >= 0; --d) {
    coords[d] = rest % b.size(d);
    rest /= b.size(d);
  }
  index << "[";
  for (size_t i = 0; i < coords.size(); ++i) index << (i ? ", " : "") << coords[i];
  index << "]";
  return ::testing::AssertionFailure()
         << what << ": max abs diff " << max_diff << " exceeds " << atol << " + " << rtol
         << "*|expected|; " << bad.sum().item<int64_t>() << " of " << b.numel()
         << " elements bad, first at " << index.str() << ": got " << a.flatten()[first].item<double>()
         << ", expected " << b.flatten()[first].item<double>();
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error, none was thrown";
  return "";
}

bool poll_until(const std::function<bool()>& ready, std::chrono::milliseconds period,
                std::chrono::steady_clock::duration limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(period);
  }
  return true;
}

int run_command(const std::string& command_line, std::string* output) {
  std::string full = command_line + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::array<char, 4096> buffer{};
  std::string collected;
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) collected.append(buffer.data(), n);
  const int status = pclose(pipe);
  if (output) *output = collected;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string cli_path() { return SHARDIT_CLI_PATH; }

}  // namespace shardit::testing
