// Qwen-Image specifics beyond the generic golden parity: the text mask hides padded tokens (their
// values cannot reach the image), img_shapes is taken from inputs.json or from the caller and is
// validated, and the RoPE positions (centred image grid, text after it) hold for grids the golden
// cases do not cover.
#include <gtest/gtest.h>
#include <gmock/gmock.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/models/registry.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace shardit {
namespace {

using ::testing::HasSubstr;
using testing::golden_path;
using testing::tensors_close;

constexpr double kTol = 1e-4;

std::shared_ptr<models::QwenImageTransformer2DModel> load_model(const std::string& dir) {
  const io::ComponentFolder folder = io::open_component(dir, "transformer");
  auto model = std::dynamic_pointer_cast<models::QwenImageTransformer2DModel>(models::create_transformer(folder));
  EXPECT_TRUE(model != nullptr);
  model->load(folder.weights(), {});
  return model;
}

models::QwenImageTransformer2DModelInputs read_inputs(const std::string& dir) {
  return verify::read_qwenimage_inputs(*io::SafetensorsFile::open(dir + "/inputs.safetensors"));
}

at::Tensor golden_sample(const std::string& dir) {
  return io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
}

TEST(QwenImage, ReadsImgShapesFromInputsJson) {
  const auto inputs = read_inputs(golden_path("qwenimage_b2_nonsquare"));
  ASSERT_EQ(inputs.img_shapes.size(), 2u);
  for (const auto& sample : inputs.img_shapes) {
    ASSERT_EQ(sample.size(), 1u);
    EXPECT_EQ(sample[0], (models::QwenImageShape{1, 3, 5}));
  }
  ASSERT_TRUE(inputs.encoder_hidden_states_mask.has_value());
  EXPECT_EQ(inputs.encoder_hidden_states_mask->sizes(), (std::vector<int64_t>{2, 7}));
}

TEST(QwenImage, PaddedTextTokensDoNotReachTheImage) {
  const std::string dir = golden_path("qwenimage_b2_nonsquare");
  auto model = load_model(dir);
  auto inputs = read_inputs(dir);
  const at::Tensor valid = inputs.encoder_hidden_states_mask->to(at::kBool);
  ASSERT_GT((~valid).sum().item<int64_t>(), 0) << "the case must have padded text tokens";

  // Other values (large ones) in every padded row: the sample must not move.
  const at::Tensor noise = at::randn(inputs.encoder_hidden_states.sizes(), at::TensorOptions().dtype(at::kFloat)) * 10;
  auto changed = inputs;
  changed.encoder_hidden_states = at::where(valid.unsqueeze(-1), inputs.encoder_hidden_states, noise);
  ASSERT_FALSE(at::equal(changed.encoder_hidden_states, inputs.encoder_hidden_states));
  const at::Tensor golden = golden_sample(dir);
  EXPECT_TRUE(tensors_close("sample with other padded rows", model->forward(changed), golden, kTol, kTol));
  EXPECT_TRUE(at::allclose(model->forward(changed), model->forward(inputs), 0, 1e-6));

  // Without the mask the padded rows are attended to: the sample of the padded sample moves.
  auto unmasked = inputs;
  unmasked.encoder_hidden_states_mask.reset();
  const at::Tensor moved = model->forward(unmasked);
  EXPECT_GT((moved[1] - golden[1]).abs().max().item<double>(), 1e-3);
  // Sample 0 has no padding: the mask changes nothing there.
  EXPECT_TRUE(tensors_close("unpadded sample without mask", moved[0], golden[0], kTol, kTol));
}

TEST(QwenImage, ExplicitImgShapesMatchTheFileAndAreChecked) {
  const std::string dir = golden_path("qwenimage_b2_nonsquare");
  auto model = load_model(dir);
  auto inputs = read_inputs(dir);
  inputs.img_shapes = {{{1, 3, 5}}, {{1, 3, 5}}};
  EXPECT_TRUE(tensors_close("explicit img_shapes", model->forward(inputs), golden_sample(dir), kTol, kTol));

  // The transposed grid has the same token count but other positions.
  inputs.img_shapes = {{{1, 5, 3}}, {{1, 5, 3}}};
  EXPECT_GT((model->forward(inputs) - golden_sample(dir)).abs().max().item<double>(), 1e-3);

  inputs.img_shapes = {{{1, 4, 5}}, {{1, 4, 5}}};
  try {
    model->forward(inputs);
    ADD_FAILURE() << "a grid of 20 tokens for 15 image tokens must be rejected";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("hold 20 tokens but hidden_states has 15"));
  }
  inputs.img_shapes = {{{1, 3, 5}}, {{1, 5, 3}}};
  try {
    model->forward(inputs);
    ADD_FAILURE() << "different grids within a batch must be rejected";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("img_shapes differ within the batch"));
  }
  inputs.img_shapes.clear();
  EXPECT_THROW(model->forward(inputs), c10::Error);
}

TEST(QwenImage, RopePositionsOfAnotherGrid) {
  // A 6 x 2 grid and 3 text tokens: height positions -3..2, width -1..0, text from max(3, 1) = 3.
  const std::string dir = golden_path("qwenimage_b1_square");
  auto model = load_model(dir);
  const auto& cfg = model->config;
  models::QwenImageTransformer2DModelInputs inputs;
  inputs.hidden_states = at::randn({1, 12, cfg.in_channels});
  inputs.encoder_hidden_states = at::randn({1, 3, cfg.joint_attention_dim});
  inputs.timestep = at::full({1}, 0.5);
  inputs.img_shapes = {{{1, 6, 2}}};
  std::map<std::string, at::Tensor> recorded;
  at::Tensor sample;
  {
    const nn::ObserveForward observe(
        verify::golden_observer([&](const std::string& name, const at::Tensor& value) { recorded[name] = value.clone(); }));
    sample = model->forward(inputs);
  }
  EXPECT_EQ(sample.sizes(), (std::vector<int64_t>{1, 12, cfg.patch_size * cfg.patch_size * cfg.resolved_out_channels()}));
  // Channel pair 0 of each axis section has frequency 1, so its angle is the position itself.
  const int64_t frame0 = 0;
  const int64_t height0 = cfg.axes_dims_rope[0] / 2;
  const int64_t width0 = height0 + cfg.axes_dims_rope[1] / 2;
  const at::Tensor img_sin = recorded.at("rope.img.imag");
  const at::Tensor txt_sin = recorded.at("rope.txt.imag");
  ASSERT_EQ(img_sin.sizes(), (std::vector<int64_t>{12, cfg.attention_head_dim / 2}));
  ASSERT_EQ(txt_sin.sizes(), (std::vector<int64_t>{3, cfg.attention_head_dim / 2}));
  for (int64_t token = 0; token < 12; ++token) {
    const double row = static_cast<double>(token / 2 - 3);
    const double col = static_cast<double>(token % 2 - 1);
    EXPECT_NEAR(img_sin[token][frame0].item<double>(), 0.0, 1e-7) << token;
    EXPECT_NEAR(img_sin[token][height0].item<double>(), std::sin(row), 1e-6) << token;
    EXPECT_NEAR(img_sin[token][width0].item<double>(), std::sin(col), 1e-6) << token;
  }
  for (int64_t token = 0; token < 3; ++token) {
    for (int64_t section : {frame0, height0, width0}) {
      EXPECT_NEAR(txt_sin[token][section].item<double>(), std::sin(3.0 + token), 1e-6) << token;
    }
  }
}

}  // namespace
}  // namespace shardit
