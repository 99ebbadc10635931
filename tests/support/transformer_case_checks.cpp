#include "support/transformer_case_checks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/nn/gemm.h"
#include "shardit/nn/module.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace shardit::testing {

namespace {

constexpr double kFp32Tol = 1e-4;
constexpr double kBf16MaxRelToPeak = 5e-2;
constexpr double kBf16RmsRel = 4e-2;

std::shared_ptr<parallel::TensorParallelModule> load_case_transformer(const std::string& dir,
                                                                     const parallel::LoadOptions& options) {
  const io::ComponentFolder folder = io::open_component(dir, "transformer");
  auto model = models::create_transformer(folder);
  model->load(folder.weights(), options);
  return model;
}

}  // namespace

const std::vector<std::string>& golden_transformer_cases() {
  static const std::vector<std::string> cases = {
      "flux_b1_square",  "flux_b2_nonsquare",  "flux_schnell_b2_nonsquare", "flux2_b1_square",
      "flux2_b2_nonsquare", "flux2_klein_b2_nonsquare", "qwenimage_b1_square", "qwenimage_b2_nonsquare",
      "qwenimage_edit_zero_cond_t_b2"};
  return cases;
}

void expect_sample_and_intermediates_match(const std::string& case_name, const parallel::LoadOptions& options) {
  ASSERT_EQ(options.dtype, at::kFloat) << "the intermediates are compared at fp32 tolerances";
  const std::string dir = golden_path(case_name);
  auto model = load_case_transformer(dir, options);

  std::map<std::string, at::Tensor> recorded;
  const auto inputs = io::SafetensorsFile::open(dir + "/inputs.safetensors");
  // Recorded tensors may be reused in place by the model afterwards: keep copies.
  at::Tensor sample;
  {
    const nn::ObserveForward observe(verify::golden_observer([&](const std::string& name, const at::Tensor& value) {
      EXPECT_EQ(recorded.count(name), 0u) << "intermediate '" << name << "' recorded twice";
      recorded[name] = value.clone();
    }));
    sample = verify::forward_from_file(*model, *inputs);
  }
  EXPECT_EQ(sample.device(), options.device) << "the sample is computed where the model was loaded";
  recorded["sample"] = sample;

  const auto outputs = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  std::vector<std::string> compared;
  for (const std::string& name : outputs->names()) {
    auto it = recorded.find(name);
    if (it == recorded.end()) {
      ADD_FAILURE() << case_name << ": expected intermediate '" << name << "' was not produced";
      continue;
    }
    const auto result = tensors_close(case_name + " " + name, it->second, outputs->read(name), kFp32Tol, kFp32Tol);
    EXPECT_TRUE(result);
    std::cout << "  compared " << result.message() << "\n";
    compared.push_back(name);
  }
  std::cout << case_name << " on " << options.device << ": compared " << compared.size() << " of "
            << outputs->names().size() << " golden tensors\n";
  // The golden cases hold the sample plus the documented intermediates: a silent drop to only a
  // few comparisons would hide regressions.
  EXPECT_GE(compared.size(), 20u);
  EXPECT_TRUE(std::find(compared.begin(), compared.end(), "sample") != compared.end());
}

at::Tensor expect_bf16_sample_close_to_golden(const std::string& case_name, const parallel::LoadOptions& options) {
  EXPECT_EQ(options.dtype, at::kBFloat16);
  const std::string dir = golden_path(case_name);
  auto model = load_case_transformer(dir, options);
  for (const auto& parameter : model->named_parameters()) {
    EXPECT_EQ(parameter.tensor->scalar_type(), at::kBFloat16) << parameter.name;
  }

  const at::Tensor sample =
      verify::forward_from_file(*model, *io::SafetensorsFile::open(dir + "/inputs.safetensors"));
  EXPECT_EQ(sample.scalar_type(), at::kBFloat16);
  EXPECT_EQ(sample.device(), options.device) << "the sample is computed where the model was loaded";

  const at::Tensor expected = io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample").to(at::kDouble);
  EXPECT_EQ(sample.sizes(), expected.sizes());
  if (sample.sizes() != expected.sizes()) return sample;
  const at::Tensor diff = sample.to(at::kCPU, at::kDouble) - expected;
  const double peak = expected.abs().max().item<double>();
  const double max_rel = diff.abs().max().item<double>() / peak;
  const double rms_rel = std::sqrt(diff.pow(2).mean().item<double>() / expected.pow(2).mean().item<double>());
  std::cout << case_name << " on " << options.device << " (gemm " << nn::gemm_backend_name(nn::gemm_backend_selection())
            << "): bf16 vs fp32 golden: max |diff| / max |ref| = " << max_rel << ", relative rms = " << rms_rel << "\n";
  EXPECT_LE(max_rel, kBf16MaxRelToPeak);
  EXPECT_LE(rms_rel, kBf16RmsRel);
  // And clearly not identical to fp32: the test would otherwise not be exercising bf16.
  EXPECT_GT(rms_rel, 1e-5);
  return sample;
}

}  // namespace shardit::testing
