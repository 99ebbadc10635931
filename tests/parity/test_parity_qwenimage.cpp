// Qwen-Image specifics beyond the generic golden parity: the text mask hides padded tokens (their
// values cannot reach the image), img_shapes is taken from inputs.json or from the caller and is
// validated, and the RoPE positions (centred image grid, text after it) hold for grids the golden
// cases do not cover.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/models/registry.h"
#include "shardit/verify/transformer_case.h"
#include "support/test_support.h"

namespace shardit {
namespace test_parity_qwenimage {
namespace {

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
  return models::QwenImageTransformer2DModelInputs::from_file(*io::SafetensorsFile::open(dir + "/inputs.safetensors"));
}

at::Tensor golden_sample(const std::string& dir) {
  return io::SafetensorsFile::open(dir + "/outputs.safetensors")->read("sample");
}

/// The case's img_shapes as inputs.json states them (the reference's call arguments).
std::vector<std::vector<models::QwenImageShape>> img_shapes_of(const std::string& dir) {
  const nlohmann::json spec = io::read_json_file(dir + "/inputs.json");
  std::vector<std::vector<models::QwenImageShape>> shapes;
  for (const auto& sample : spec.at("non_tensor_kwargs").at("img_shapes")) {
    shapes.emplace_back();
    for (const auto& grid : sample) shapes.back().push_back(grid.get<models::QwenImageShape>());
  }
  return shapes;
}

TEST(QwenImage, ReadsImgShapesFromInputsJson) {
  const std::string dir = golden_path("qwenimage_b2_nonsquare");
  const auto inputs = read_inputs(dir);
  EXPECT_EQ(inputs.img_shapes, img_shapes_of(dir));
  const nlohmann::json spec = io::read_json_file(dir + "/inputs.json");
  ASSERT_TRUE(inputs.encoder_hidden_states_mask.has_value());
  EXPECT_EQ(inputs.encoder_hidden_states_mask->sizes().vec(),
            spec.at("tensors").at("encoder_hidden_states_mask").at("shape").get<std::vector<int64_t>>());
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
  const std::vector<std::vector<models::QwenImageShape>> shapes = img_shapes_of(dir);
  ASSERT_EQ(shapes.size(), 2u);
  ASSERT_EQ(shapes[0].size(), 1u);
  const auto [frames, height, width] = shapes[0][0];
  ASSERT_NE(height, width) << "the case's grid must not be square";
  const int64_t tokens = inputs.hidden_states.size(1);
  inputs.img_shapes = shapes;
  EXPECT_TRUE(tensors_close("explicit img_shapes", model->forward(inputs), golden_sample(dir), kTol, kTol));

  // The transposed grid has the same token count but other positions.
  const models::QwenImageShape transposed{frames, width, height};
  inputs.img_shapes = {{transposed}, {transposed}};
  EXPECT_GT((model->forward(inputs) - golden_sample(dir)).abs().max().item<double>(), 1e-3);

  auto grids = [](const models::QwenImageShape& shape) {
    return "[(" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " + std::to_string(shape[2]) + ")]";
  };
  const models::QwenImageShape taller{frames, height + 1, width};
  inputs.img_shapes = {{taller}, {taller}};
  EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }),
            "QwenImageTransformer2DModel: img_shapes " + grids(taller) + " hold " +
                std::to_string(frames * (height + 1) * width) + " tokens but hidden_states has " +
                std::to_string(tokens) + " (N = sum of frame * height * width)");
  inputs.img_shapes = {{shapes[0][0]}, {transposed}};
  EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }),
            "QwenImageTransformer2DModel: img_shapes differ within the batch (" + grids(shapes[0][0]) + " vs " +
                grids(transposed) + " for sample 1); all samples must share one token grid");
  inputs.img_shapes.clear();
  EXPECT_EQ(testing::error_of([&] { model->forward(inputs); }),
            "QwenImageTransformer2DModel: img_shapes is empty; pass the (frame, height, width) token grid(s) of "
            "each sample, e.g. [[(1, h, w)]] * B");
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
}  // namespace test_parity_qwenimage
}  // namespace shardit
