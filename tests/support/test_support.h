#pragma once
// Helpers shared by the tests: golden-data paths, tensor comparison with a report, temp folders,
// running the CLI.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardit/nn/quantized_weight.h"
#include "shardit/parallel/plan.h"

namespace shardit::parallel {
class TensorParallelModule;
struct TensorParallelConfig;
}
namespace shardit::models {
class AutoencoderModel;
}

namespace shardit::testing {

/// The whole world as one tensor-parallel group (ParallelDims{1, 1, 1, 0}.build's "tp" dimension),
/// and on one rank a group of one: the TP tests run their load paths' sharding at every degree,
/// degree 1 included, where a pipeline on one rank loads its model whole.
parallel::TensorParallelConfig world_tensor_parallel();

/// Loads the transformer of `model_dir` through `path`: "whole", "shard-on-load" (TP over the
/// whole world, each rank reading its slices) or "enable-parallelism" (load whole, then shard).
/// `weights`, `quantize_kept`, `int8_compute`: parallel::LoadOptions::weights,
/// quantize_kept_layers and int8_compute.
std::shared_ptr<parallel::TensorParallelModule> load_transformer(
    const std::string& model_dir, const std::string& path = "whole",
    parallel::TpPlanKind kind = parallel::TpPlanKind::Full, nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint,
    bool quantize_kept = false, bool int8_compute = false);

/// The VAE of the golden folder `case_name` (its vae/), built from its config and loaded.
std::shared_ptr<models::AutoencoderModel> load_golden_vae(const std::string& case_name);

/// One forward of `model` on `<inputs_dir>/inputs.safetensors`; returns the sample.
at::Tensor run_case(parallel::TensorParallelModule& model, const std::string& inputs_dir);

/// Absolute path of a file or folder inside the golden data (tests/golden, or
/// $SHARDIT_GOLDEN_DIR). Throws, failing the test, when the data is missing, and when the test runs
/// under CTest without the label golden.
std::string golden_path(const std::string& relative);

/// The TP degrees from 1 to `limit` that divide `n`, as the plan resolver lists them: "1, 2, 4".
std::string divisors_of(int64_t n, int64_t limit = 64);

/// A fresh empty folder under the system temp dir, removed at process exit.
std::string make_temp_dir(const std::string& tag);

/// Checks |actual - expected| <= atol + rtol * |expected| elementwise; on failure the message
/// names `what`, the shapes, the max difference and the first bad index with both values.
::testing::AssertionResult tensors_close(const std::string& what, const at::Tensor& actual,
                                         const at::Tensor& expected, double atol, double rtol);

/// The message (without backtrace) of the c10::Error that `fn` throws; a test failure, and "",
/// when it throws none.
std::string error_of(const std::function<void()>& fn);

/// How long a test waits for an event (a line, a status, a process's exit) before it calls the case
/// hung: minutes, so that a slow machine never ends a wait, only a hang does.
inline constexpr std::chrono::minutes kHangDeadline{3};

/// Calls `ready` every `period` until it returns true (then true), or until `limit` has passed
/// (then false: the case hung). The period only paces the polling; `ready` decides.
bool poll_until(const std::function<bool()>& ready, std::chrono::milliseconds period = std::chrono::milliseconds(10),
                std::chrono::steady_clock::duration limit = kHangDeadline);

/// Runs a shell command line, returns its exit status and fills `output` with stdout+stderr.
int run_command(const std::string& command_line, std::string* output);

/// The built `shardit` CLI.
std::string cli_path();

}  // namespace shardit::testing
