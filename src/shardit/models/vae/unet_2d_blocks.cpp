#include "shardit/models/vae/unet_2d_blocks.h"

#include <c10/util/Exception.h>

#include "shardit/nn/attention.h"

namespace shardit::models {

Attention::Attention(int64_t channels, int64_t heads, int64_t norm_num_groups, double eps, double rescale_output_factor)
    : heads_(heads), rescale_output_factor_(rescale_output_factor) {
  TORCH_CHECK(heads > 0 && channels % heads == 0, "Attention: ", channels, " channels do not split into ", heads,
              " heads");
  group_norm = register_module("group_norm",
                               std::make_shared<nn::GroupNorm>(nn::GroupNormOptions(norm_num_groups, channels).with_eps(eps)));
  to_q = register_module("to_q", std::make_shared<nn::Linear>(nn::LinearOptions(channels, channels)));
  to_k = register_module("to_k", std::make_shared<nn::Linear>(nn::LinearOptions(channels, channels)));
  to_v = register_module("to_v", std::make_shared<nn::Linear>(nn::LinearOptions(channels, channels)));
  to_out = register_module("to_out", std::make_shared<nn::ModuleList<nn::Linear>>());
  to_out->push_back(std::make_shared<nn::Linear>(nn::LinearOptions(channels, channels)));
}

at::Tensor Attention::forward(const at::Tensor& hidden_states) {
  // [B, C, H, W]
  const int64_t batch = hidden_states.size(0);
  const int64_t channels = hidden_states.size(1);
  const int64_t height = hidden_states.size(2);
  const int64_t width = hidden_states.size(3);
  const int64_t head_dim = channels / heads_;
  // GroupNorm over [B, C, H*W] equals GroupNorm over [B, C, H, W].
  const at::Tensor normed = group_norm->forward(hidden_states).view({batch, channels, height * width}).transpose(1, 2);
  // [B, H*W, C] -> [B, heads, H*W, head_dim]
  const at::Tensor query = to_q->forward(normed).view({batch, -1, heads_, head_dim}).transpose(1, 2);
  const at::Tensor key = to_k->forward(normed).view({batch, -1, heads_, head_dim}).transpose(1, 2);
  const at::Tensor value = to_v->forward(normed).view({batch, -1, heads_, head_dim}).transpose(1, 2);
  at::Tensor attended = attend(query, key, value);
  // [B, H*W, C]
  attended = attended.transpose(1, 2).reshape({batch, -1, heads_ * head_dim});
  attended = (*to_out)[0].forward(attended);
  // [B, C, H, W]
  attended = attended.transpose(-1, -2).reshape({batch, channels, height, width});
  at::Tensor output = attended + hidden_states;
  if (rescale_output_factor_ != 1.0) output = output / rescale_output_factor_;
  return output;
}

UNetMidBlock2D::UNetMidBlock2D(const UNetMidBlock2DOptions& options) {
  TORCH_CHECK(options.attention_head_dim > 0 && options.in_channels % options.attention_head_dim == 0,
              "UNetMidBlock2D: ", options.in_channels, " channels do not split into heads of ", options.attention_head_dim);
  const auto resnet_options = ResnetBlock2DOptions(options.in_channels, options.in_channels)
                                  .with_groups(options.resnet_groups)
                                  .with_eps(options.resnet_eps);
  attentions = register_module("attentions", std::make_shared<nn::ModuleList<Attention>>());
  resnets = register_module("resnets", std::make_shared<nn::ModuleList<ResnetBlock2D>>());
  resnets->push_back(std::make_shared<ResnetBlock2D>(resnet_options));
  for (int64_t i = 0; i < options.num_layers; ++i) {
    if (options.add_attention) {
      attentions->push_back(std::make_shared<Attention>(options.in_channels,
                                                        options.in_channels / options.attention_head_dim,
                                                        options.resnet_groups, options.resnet_eps));
    }
    resnets->push_back(std::make_shared<ResnetBlock2D>(resnet_options));
  }
}

at::Tensor UNetMidBlock2D::forward(const at::Tensor& hidden_states) {
  // [B, C, H, W]
  at::Tensor x = (*resnets)[0].forward(hidden_states);
  for (size_t i = 1; i < resnets->size(); ++i) {
    if (attentions->size() > 0) x = (*attentions)[i - 1].forward(x);
    x = (*resnets)[i].forward(x);
  }
  return x;
}

namespace {

/// The resnets of an up or down block: `num_layers` blocks, the first one in -> out.
std::shared_ptr<nn::ModuleList<ResnetBlock2D>> block_resnets(int64_t in_channels, int64_t out_channels,
                                                             int64_t num_layers, int64_t groups, double eps) {
  auto resnets = std::make_shared<nn::ModuleList<ResnetBlock2D>>();
  for (int64_t i = 0; i < num_layers; ++i) {
    resnets->push_back(std::make_shared<ResnetBlock2D>(
        ResnetBlock2DOptions(i == 0 ? in_channels : out_channels, out_channels).with_groups(groups).with_eps(eps)));
  }
  return resnets;
}

}  // namespace

UpDecoderBlock2D::UpDecoderBlock2D(const UpDecoderBlock2DOptions& options) {
  resnets = register_module("resnets", block_resnets(options.in_channels, options.out_channels, options.num_layers,
                                                     options.resnet_groups, options.resnet_eps));
  if (options.add_upsample) {
    upsamplers = register_module("upsamplers", std::make_shared<nn::ModuleList<Upsample2D>>());
    upsamplers->push_back(std::make_shared<Upsample2D>(options.out_channels, options.out_channels));
  }
}

at::Tensor UpDecoderBlock2D::forward(const at::Tensor& hidden_states) {
  // [B, in, H, W]
  at::Tensor x = hidden_states;
  for (auto& resnet : *resnets) x = resnet->forward(x);
  if (upsamplers) x = (*upsamplers)[0].forward(x);
  return x;
}

DownEncoderBlock2D::DownEncoderBlock2D(const DownEncoderBlock2DOptions& options) {
  resnets = register_module("resnets", block_resnets(options.in_channels, options.out_channels, options.num_layers,
                                                     options.resnet_groups, options.resnet_eps));
  if (options.add_downsample) {
    downsamplers = register_module("downsamplers", std::make_shared<nn::ModuleList<Downsample2D>>());
    downsamplers->push_back(std::make_shared<Downsample2D>(options.out_channels, options.out_channels));
  }
}

at::Tensor DownEncoderBlock2D::forward(const at::Tensor& hidden_states) {
  // [B, in, H, W] -> [B, out, H / 2, W / 2]
  at::Tensor x = hidden_states;
  for (auto& resnet : *resnets) x = resnet->forward(x);
  return downsamplers ? (*downsamplers)[0].forward(x) : x;
}

}  // namespace shardit::models
