// Real multi-process tensor parallelism on a toy FLUX-shaped transformer: joint attention over
// [txt; img], MLPs, a fused packed q|k|v, a packed rowwise proj_out over cat([attn, mlp]) and
// AdaLN modulations (ColwiseGather, one of them packed). A single-rank reference, then ranks at
// TP=2, 3, 4 through both load paths (load whole then shard in memory; shard while loading).
// And a rowwise Linear's bias at TP=2 and 3, where adding it before the all-reduce would show.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_tp_toy {
namespace {

using shardit::nn::Linear;
using shardit::nn::LinearOptions;
using shardit::nn::Module;
using shardit::nn::ModuleList;
using shardit::parallel::ParallelDims;
using shardit::parallel::LoadOptions;
using shardit::parallel::ShardStyle;
using shardit::parallel::TensorParallelConfig;
using shardit::parallel::TpDivisor;
using shardit::parallel::TpPlan;
using shardit::testing::env_or;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using ::testing::HasSubstr;

struct ToyConfig {
  int64_t heads;
  int64_t head_dim;
  int64_t dim() const { return heads * head_dim; }
  int64_t mlp() const { return 4 * dim(); }
};

ToyConfig config_from_env() {
  return {std::stoll(env_or("TP_TOY_HEADS", "0")), std::stoll(env_or("TP_TOY_HEAD_DIM", "0"))};
}

std::shared_ptr<Linear> linear(int64_t in, int64_t out) {
  return std::make_shared<Linear>(LinearOptions(in, out));
}

at::Tensor layer_norm(const at::Tensor& x) { return at::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6); }

// [B, S, D] modulated by shift/scale [B, D].
at::Tensor modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
  return layer_norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim) { register_parameter("weight", &weight, {dim}); }
  std::string type_name() const override { return "RMSNorm"; }
  at::Tensor forward(const at::Tensor& x) { return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * weight; }
  at::Tensor weight;
};

// AdaLN: a Linear over silu(temb) whose output indexes the full hidden dimension.
class AdaNorm : public Module {
 public:
  AdaNorm(int64_t dim, int64_t chunks) { linear = register_module("linear", test_tp_toy::linear(dim, chunks * dim)); }
  std::string type_name() const override { return "AdaNorm"; }
  std::vector<at::Tensor> forward(const at::Tensor& temb, int64_t chunks) {
    return linear->forward(at::silu(temb)).chunk(chunks, -1);  // chunks x [B, D]
  }
  std::shared_ptr<Linear> linear;
};

// q, k, v [B, S, D_local] -> [B, S, D_local]; the local head count comes from the tensor.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t head_dim,
                     RMSNorm& norm_q, RMSNorm& norm_k) {
  const int64_t batch = q.size(0), seq = q.size(1), heads = q.size(-1) / head_dim;
  auto split = [&](const at::Tensor& t) { return t.view({batch, seq, heads, head_dim}).transpose(1, 2); };
  const at::Tensor qh = norm_q.forward(split(q));  // [B, H_local, S, hd]
  const at::Tensor kh = norm_k.forward(split(k));  // [B, H_local, S, hd]
  const at::Tensor scores = at::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(static_cast<double>(head_dim));
  const at::Tensor out = at::matmul(at::softmax(scores, -1), split(v));  // [B, H_local, S, hd]
  return out.transpose(1, 2).reshape({batch, seq, heads * head_dim});    // [B, S, D_local]
}

class JointAttention : public Module {
 public:
  explicit JointAttention(const ToyConfig& config) : head_dim_(config.head_dim) {
    const int64_t d = config.dim();
    norm_q = register_module("norm_q", std::make_shared<RMSNorm>(config.head_dim));
    norm_k = register_module("norm_k", std::make_shared<RMSNorm>(config.head_dim));
    to_q = register_module("to_q", linear(d, d));
    to_k = register_module("to_k", linear(d, d));
    to_v = register_module("to_v", linear(d, d));
    add_q_proj = register_module("add_q_proj", linear(d, d));
    add_k_proj = register_module("add_k_proj", linear(d, d));
    add_v_proj = register_module("add_v_proj", linear(d, d));
    to_out = register_module("to_out", std::make_shared<ModuleList<Linear>>());
    to_out->push_back(linear(d, d));
    to_add_out = register_module("to_add_out", linear(d, d));
  }
  std::string type_name() const override { return "JointAttention"; }
  // img [B, S_img, D], txt [B, S_txt, D] -> (img, txt) [B, S, D]
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& img, const at::Tensor& txt) {
    const at::Tensor q =
        at::cat({add_q_proj->forward(txt), to_q->forward(img)}, 1);  // [B, S_txt + S_img, D_local]
    const at::Tensor k = at::cat({add_k_proj->forward(txt), to_k->forward(img)}, 1);
    const at::Tensor v = at::cat({add_v_proj->forward(txt), to_v->forward(img)}, 1);
    const at::Tensor out = attention(q, k, v, head_dim_, *norm_q, *norm_k);  // [B, S_txt + S_img, D_local]
    const int64_t s_txt = txt.size(1);
    return {(*to_out)[0].forward(out.narrow(1, s_txt, img.size(1))),
            to_add_out->forward(out.narrow(1, 0, s_txt))};
  }
  std::shared_ptr<RMSNorm> norm_q, norm_k;
  std::shared_ptr<Linear> to_q, to_k, to_v, add_q_proj, add_k_proj, add_v_proj, to_add_out;
  std::shared_ptr<ModuleList<Linear>> to_out;

 private:
  int64_t head_dim_;
};

class Mlp : public Module {
 public:
  explicit Mlp(const ToyConfig& config) {
    fc1 = register_module("fc1", linear(config.dim(), config.mlp()));
    fc2 = register_module("fc2", linear(config.mlp(), config.dim()));
  }
  std::string type_name() const override { return "Mlp"; }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(at::gelu(fc1->forward(x))); }
  std::shared_ptr<Linear> fc1, fc2;
};

class JointBlock : public Module {
 public:
  explicit JointBlock(const ToyConfig& config) {
    norm1 = register_module("norm1", std::make_shared<AdaNorm>(config.dim(), 6));
    norm1_context = register_module("norm1_context", std::make_shared<AdaNorm>(config.dim(), 6));
    attn = register_module("attn", std::make_shared<JointAttention>(config));
    ff = register_module("ff", std::make_shared<Mlp>(config));
    ff_context = register_module("ff_context", std::make_shared<Mlp>(config));
  }
  std::string type_name() const override { return "JointBlock"; }
  void forward(at::Tensor& img, at::Tensor& txt, const at::Tensor& temb) {
    const auto m = norm1->forward(temb, 6);
    const auto c = norm1_context->forward(temb, 6);
    auto [img_attn, txt_attn] = attn->forward(modulate(img, m[0], m[1]), modulate(txt, c[0], c[1]));
    img = img + m[2].unsqueeze(1) * img_attn;
    txt = txt + c[2].unsqueeze(1) * txt_attn;
    img = img + m[5].unsqueeze(1) * ff->forward(modulate(img, m[3], m[4]));
    txt = txt + c[5].unsqueeze(1) * ff_context->forward(modulate(txt, c[3], c[4]));
  }
  std::shared_ptr<AdaNorm> norm1, norm1_context;
  std::shared_ptr<JointAttention> attn;
  std::shared_ptr<Mlp> ff, ff_context;
};

class SingleBlock : public Module {
 public:
  explicit SingleBlock(const ToyConfig& config) : head_dim_(config.head_dim) {
    const int64_t d = config.dim();
    norm = register_module("norm", std::make_shared<AdaNorm>(d, 3));
    norm_q = register_module("norm_q", std::make_shared<RMSNorm>(config.head_dim));
    norm_k = register_module("norm_k", std::make_shared<RMSNorm>(config.head_dim));
    qkv = register_module("qkv", linear(d, 3 * d));
    proj_mlp = register_module("proj_mlp", linear(d, config.mlp()));
    proj_out = register_module(
        "proj_out",
        std::make_shared<Linear>(LinearOptions(d + config.mlp(), d).with_in_blocks({d, config.mlp()})));
  }
  std::string type_name() const override { return "SingleBlock"; }
  // x [B, S, D] -> [B, S, D]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& temb) {
    const auto m = norm->forward(temb, 3);
    const at::Tensor h = modulate(x, m[0], m[1]);
    const auto q_k_v = qkv->forward(h).chunk(3, -1);  // 3 x [B, S, D_local]
    const at::Tensor attn = attention(q_k_v[0], q_k_v[1], q_k_v[2], head_dim_, *norm_q, *norm_k);
    const at::Tensor mlp = at::gelu(proj_mlp->forward(h));                       // [B, S, 4D_local]
    return x + m[2].unsqueeze(1) * proj_out->forward(at::cat({attn, mlp}, -1));  // [B, S, D]
  }
  std::shared_ptr<AdaNorm> norm;
  std::shared_ptr<RMSNorm> norm_q, norm_k;
  std::shared_ptr<Linear> qkv, proj_mlp, proj_out;

 private:
  int64_t head_dim_;
};

class ToyTransformer : public shardit::parallel::TensorParallelModule {
 public:
  explicit ToyTransformer(const ToyConfig& config) : config_(config) {
    transformer_blocks = register_module("transformer_blocks", std::make_shared<ModuleList<JointBlock>>());
    single_transformer_blocks =
        register_module("single_transformer_blocks", std::make_shared<ModuleList<SingleBlock>>());
    for (int i = 0; i < 2; ++i) {
      transformer_blocks->push_back(std::make_shared<JointBlock>(config));
      single_transformer_blocks->push_back(std::make_shared<SingleBlock>(config));
    }
    norm_out = register_module("norm_out", std::make_shared<AdaNorm>(config.dim(), 2));
    proj_out = register_module("proj_out", linear(config.dim(), 5));
  }
  std::string type_name() const override { return "ToyTransformer"; }

  // Each colwise layer is closed by the rowwise layer that consumes its output.
  const TpPlan& tp_plan() const override {
    static const TpPlan plan = {
        {"transformer_blocks.*.norm1.linear", ShardStyle::ColwiseGather},
        {"transformer_blocks.*.norm1_context.linear", ShardStyle::ColwiseGather},
        {"transformer_blocks.*.attn.to_q", ShardStyle::Colwise},
        {"transformer_blocks.*.attn.to_k", ShardStyle::Colwise},
        {"transformer_blocks.*.attn.to_v", ShardStyle::Colwise},
        {"transformer_blocks.*.attn.add_q_proj", ShardStyle::Colwise},
        {"transformer_blocks.*.attn.add_k_proj", ShardStyle::Colwise},
        {"transformer_blocks.*.attn.add_v_proj", ShardStyle::Colwise},
        {"transformer_blocks.*.attn.to_out.0", ShardStyle::Rowwise},
        {"transformer_blocks.*.attn.to_add_out", ShardStyle::Rowwise},
        {"transformer_blocks.*.ff.fc1", ShardStyle::Colwise},
        {"transformer_blocks.*.ff.fc2", ShardStyle::Rowwise},
        {"transformer_blocks.*.ff_context.fc1", ShardStyle::Colwise},
        {"transformer_blocks.*.ff_context.fc2", ShardStyle::Rowwise},
        {"single_transformer_blocks.*.norm.linear", ShardStyle::ColwiseGather},
        {"single_transformer_blocks.*.qkv", ShardStyle::PackedColwise, {1, 1, 1}},
        {"single_transformer_blocks.*.proj_mlp", ShardStyle::Colwise},
        {"single_transformer_blocks.*.proj_out", ShardStyle::PackedRowwise},  // blocks declared by the layer
        // Packed gather: the output is (shift, scale), each split on its own, reordered after the gather.
        {"norm_out.linear", ShardStyle::ColwiseGather, {1, 1}},
    };
    return plan;
  }
  shardit::parallel::ModelTraits traits() const override {
    shardit::parallel::ModelTraits traits;
    traits.divisors = {{"num_attention_heads", config_.heads}};
    return traits;
  }

  // img [B, S_img, D], txt [B, S_txt, D], temb [B, D] -> [B, S_img, 5]
  at::Tensor forward(at::Tensor img, at::Tensor txt, const at::Tensor& temb) {
    for (auto& block : *transformer_blocks) block->forward(img, txt, temb);
    at::Tensor x = at::cat({txt, img}, 1);  // [B, S_txt + S_img, D]
    for (auto& block : *single_transformer_blocks) x = block->forward(x, temb);
    x = x.narrow(1, txt.size(1), img.size(1));  // [B, S_img, D]
    const auto m = norm_out->forward(temb, 2);
    return proj_out->forward(modulate(x, m[0], m[1]));
  }

  std::shared_ptr<ModuleList<JointBlock>> transformer_blocks;
  std::shared_ptr<ModuleList<SingleBlock>> single_transformer_blocks;
  std::shared_ptr<AdaNorm> norm_out;
  std::shared_ptr<Linear> proj_out;

 private:
  ToyConfig config_;
};

constexpr int kRowwiseLayers =
    2 * 4 + 2 * 1;  // per joint block: to_out.0, to_add_out, ff.fc2, ff_context.fc2
constexpr int kGatherLayers = 2 * 2 + 2 * 1 + 1;

// O(1) activations everywhere (weights ~ 1/sqrt(fan_in)), so a wrong shard shows clearly.
void init_weights(ToyTransformer& model, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& slot : model.named_parameters()) {
    const double std =
        slot.tensor->dim() == 2 ? 1.0 / std::sqrt(static_cast<double>(slot.tensor->size(1))) : 0.5;
    at::Tensor value =
        at::normal(0.0, std, slot.tensor->sizes(), generator, at::TensorOptions().dtype(at::kFloat));
    if (slot.name.find("norm_q") != std::string::npos || slot.name.find("norm_k") != std::string::npos)
      value += 1;
    *slot.tensor = value;
  }
}

std::vector<std::pair<std::string, at::Tensor>> make_inputs(const ToyConfig& config, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto randn = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat));
  };
  return {{"img", randn({2, 7, config.dim()})},
          {"txt", randn({2, 3, config.dim()})},
          {"temb", randn({2, config.dim()})}};
}

// Parent side: saves the weights, the inputs and the single-rank output into `dir`.
std::string prepare(const ToyConfig& config, uint64_t seed) {
  const std::string dir = shardit::testing::make_temp_dir("tp_toy");
  ToyTransformer model(config);
  init_weights(model, seed);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (auto& slot : model.named_parameters()) weights.emplace_back(slot.name, *slot.tensor);
  shardit::io::save_safetensors(dir + "/model.safetensors", weights);
  auto inputs = make_inputs(config, seed + 1);
  const at::Tensor output = model.forward(inputs[0].second, inputs[1].second, inputs[2].second);
  inputs.emplace_back("output", output);
  shardit::io::save_safetensors(dir + "/reference.safetensors", inputs);
  return dir;
}

std::map<std::string, std::string> toy_env(const ToyConfig& config, const std::string& dir) {
  return {{"TP_TOY_HEADS", std::to_string(config.heads)},
          {"TP_TOY_HEAD_DIM", std::to_string(config.head_dim)},
          {"TP_TOY_DIR", dir}};
}

// Rank side: both load paths at the world's degree must reproduce the single-rank output.
void run_worker() {
  auto& world = shardit::dist::World::init();
  const ToyConfig config = config_from_env();
  const std::string dir = env_or("TP_TOY_DIR");
  // The three ways to name the TP group: the world's, the "tp" dimension of the layout
  // ParallelDims::build makes, and a mesh's (both meshes make their own, new groups).
  const TensorParallelConfig tp(world.group());
  const TensorParallelConfig tp_of_world = ParallelDims{1, 1, 1, 0}.build(world).tensor_parallel().value();
  const shardit::dist::DeviceMesh mesh = shardit::dist::DeviceMesh::one_d(world, "tp");
  const TensorParallelConfig tp_from_mesh(mesh, "tp");
  const int degree = tp.tp_degree();
  const int rank = tp.tp_rank();
  ASSERT_EQ(degree, world.size());
  EXPECT_EQ(tp_of_world.tp_degree(), degree);
  EXPECT_EQ(tp_from_mesh.tp_degree(), degree);
  EXPECT_EQ(tp_from_mesh.tp_rank(), rank);
  try {
    ParallelDims{1, 1, 1, degree + 1}.build(world);
    ADD_FAILURE() << "a tp degree that does not divide the world size should fail";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.msg(), HasSubstr("tp " + std::to_string(degree + 1) + " (--tp) = " + std::to_string(degree + 1) +
                                   " does not divide the " + std::to_string(degree) + " ranks launched"));
  }

  const auto reference = shardit::io::Checkpoint::open(dir + "/reference.safetensors");
  const at::Tensor img = reference.read("img"), txt = reference.read("txt"), temb = reference.read("temb");
  const at::Tensor expected = reference.read("output");
  // fp32: TP only changes the order of summation (partial sums over in-feature shards, then the
  // all-reduce), so differences are rounding-level: a few ulp of the accumulated values (about
  // 1e-6 here), well below 1e-5 of the output scale. A wrong shard, head split or block order
  // gives O(1) errors.
  const double atol = 1e-5 * std::max(1.0, expected.abs().max().item<double>());

  // Path 1: load whole, then shard in memory.
  ToyTransformer in_memory(config);
  const auto checkpoint1 = shardit::io::Checkpoint::open(dir + "/model.safetensors");
  in_memory.load(checkpoint1, LoadOptions{});
  in_memory.enable_parallelism(tp_from_mesh);
  EXPECT_EQ(in_memory.tp_degree(), degree);

  // Path 2: each rank reads only its slices.
  ToyTransformer sharded(config);
  const auto checkpoint2 = shardit::io::Checkpoint::open(dir + "/model.safetensors");
  LoadOptions options;
  options.tensor_parallel = tp_of_world;
  sharded.load(checkpoint2, options);
  EXPECT_EQ(sharded.tp_degree(), degree);

  // The plan the model was loaded with; sharding in memory gives the same one.
  ASSERT_NE(sharded.resolved_plan(), nullptr);
  const auto& plan = *sharded.resolved_plan();
  ASSERT_NE(in_memory.resolved_plan(), nullptr);
  EXPECT_EQ(in_memory.resolved_plan()->bytes_on_rank(rank), plan.bytes_on_rank(rank));
  EXPECT_EQ(checkpoint2.stats().bytes_read.load(),
            static_cast<uint64_t>(plan.replicated_bytes() + plan.sharded_bytes() / degree));
  EXPECT_EQ(sharded.parameter_bytes(), plan.bytes_on_rank(rank));
  EXPECT_EQ(in_memory.parameter_bytes(), plan.bytes_on_rank(rank));

  auto slots1 = in_memory.named_parameters();
  auto slots2 = sharded.named_parameters();
  ASSERT_EQ(slots1.size(), slots2.size());
  for (size_t i = 0; i < slots1.size(); ++i) {
    EXPECT_EQ(slots1[i].name, slots2[i].name);
    EXPECT_TRUE(at::equal(*slots1[i].tensor, *slots2[i].tensor)) << "rank " << rank << ": " << slots1[i].name;
    EXPECT_EQ(slots1[i].tensor->sizes().vec(), plan.spec(slots1[i].name).local_shape(rank)) << slots1[i].name;
  }

  const std::pair<ToyTransformer*, const TensorParallelConfig*> runs[] = {{&in_memory, &tp_from_mesh},
                                                                          {&sharded, &tp_of_world}};
  for (const auto& [model, model_tp] : runs) {
    auto& stats = model_tp->group->stats();
    stats.reset();
    const at::Tensor output = model->forward(img, txt, temb);
    std::cout << "rank " << rank << " of " << degree << ": max abs diff to the single-rank output "
              << (output - expected).abs().max().item<double>() << " (tolerance " << atol << ")\n";
    EXPECT_TRUE(shardit::testing::tensors_close("rank " + std::to_string(rank) + " output", output, expected,
                                                atol, 0));
    EXPECT_EQ(stats.calls_by_op["all_reduce"], static_cast<uint64_t>(kRowwiseLayers));
    EXPECT_EQ(stats.calls_by_op["all_gather"], static_cast<uint64_t>(kGatherLayers));
  }
}

TEST(TpToy, CountsMatchThePlan) {
  if (is_worker()) return;
  ToyTransformer model({6, 8});
  const auto plan = model.resolve(2);
  int rowwise = 0, gather = 0;
  for (const auto& spec : plan.parameters) {
    if (spec.parameter.size() < 7 || spec.parameter.compare(spec.parameter.size() - 7, 7, ".weight") != 0)
      continue;
    if (spec.style == ShardStyle::Rowwise || spec.style == ShardStyle::PackedRowwise) ++rowwise;
    if (spec.style == ShardStyle::ColwiseGather) ++gather;
  }
  EXPECT_EQ(rowwise, kRowwiseLayers);
  EXPECT_EQ(gather, kGatherLayers);
}

// 6 heads: TP=2 and 3 work.
TEST(TpToy, SixHeadsTp2) {
  if (is_worker()) return run_worker();
  const ToyConfig config{6, 8};
  EXPECT_EQ(run_ranks(2, toy_env(config, prepare(config, 101))), 0);
}

TEST(TpToy, SixHeadsTp3) {
  if (is_worker()) return run_worker();
  const ToyConfig config{6, 8};
  EXPECT_EQ(run_ranks(3, toy_env(config, prepare(config, 202))), 0);
}

// 12 heads: TP=2, 3 and 4 all work.
TEST(TpToy, TwelveHeadsTp2) {
  if (is_worker()) return run_worker();
  const ToyConfig config{12, 4};
  EXPECT_EQ(run_ranks(2, toy_env(config, prepare(config, 303))), 0);
}

TEST(TpToy, TwelveHeadsTp3) {
  if (is_worker()) return run_worker();
  const ToyConfig config{12, 4};
  EXPECT_EQ(run_ranks(3, toy_env(config, prepare(config, 404))), 0);
}

TEST(TpToy, TwelveHeadsTp4) {
  if (is_worker()) return run_worker();
  const ToyConfig config{12, 4};
  EXPECT_EQ(run_ranks(4, toy_env(config, prepare(config, 505))), 0);
}

// 6 heads at TP=4: every width (48, 144, 192) divides by 4, only the head count does not. Every
// rank must refuse on both paths, before reading any weight.
TEST(TpToy, SixHeadsTp4IsRefused) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    const TensorParallelConfig tp(world.group());
    const ToyConfig config = config_from_env();
    const std::string dir = env_or("TP_TOY_DIR");
    const std::string expected =
        "num_attention_heads = 6, which does not divide by tp_degree 4; degrees that "
        "would work (up to 64): 1, 2, 3, 6";
    ToyTransformer sharded(config);
    const auto checkpoint = shardit::io::Checkpoint::open(dir + "/model.safetensors");
    LoadOptions options;
    options.tensor_parallel = tp;
    EXPECT_EQ(shardit::testing::error_of([&] { sharded.load(checkpoint, options); }), expected);
    EXPECT_EQ(checkpoint.stats().bytes_read.load(), 0u);
    EXPECT_FALSE(sharded.is_materialized());

    ToyTransformer in_memory(config);
    in_memory.load(checkpoint, LoadOptions{});
    const at::Tensor q_before = in_memory.transformer_blocks->operator[](0).attn->to_q->weight.clone();
    EXPECT_EQ(shardit::testing::error_of([&] { in_memory.enable_parallelism(tp); }), expected);
    // Nothing moved.
    EXPECT_TRUE(at::equal(in_memory.transformer_blocks->operator[](0).attn->to_q->weight, q_before));
    return;
  }
  const ToyConfig config{6, 8};
  EXPECT_EQ(run_ranks(4, toy_env(config, prepare(config, 606))), 0);
}

// A rowwise Linear on real ranks: each rank holds the input columns [r*w, (r+1)*w) of the weight
// and of x, and the full bias. The output must be X A^T + b on every rank. Adding the bias before
// the all-reduce would give X A^T + degree * b, so at degree 2 and 3 it moves the output by at
// least min|b| (0.5 here, far above the tolerance); at degree 1 the two are the same.
void rowwise_bias_worker() {
  auto& world = shardit::dist::World::init();
  const int degree = world.size();
  const int rank = world.rank();
  constexpr int64_t kIn = 12, kOut = 5;  // 12 splits at degree 2 and 3
  auto generator = at::make_generator<at::CPUGeneratorImpl>(2024);  // the same on every rank
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kIn));
  const at::Tensor weight = at::normal(0.0, scale, {kOut, kIn}, generator, f32);
  const at::Tensor sign = at::randint(0, 2, {kOut}, generator, f32) * 2 - 1;
  const at::Tensor bias = sign * (0.5 + at::rand({kOut}, generator, f32));  // 0.5 <= |b| < 1.5
  const at::Tensor x = at::normal(0.0, 1.0, {3, 4, kIn}, generator, f32);
  const at::Tensor expected = at::linear(x, weight, bias);                  // [3, 4, kOut]
  const at::Tensor bias_before_reduce = at::linear(x, weight) + degree * bias;

  const int64_t width = kIn / degree;
  Linear layer(LinearOptions(kIn, kOut));
  layer.weight = weight.narrow(1, rank * width, width).contiguous();  // [kOut, kIn / degree]
  layer.bias = bias;
  auto group = world.group();
  layer.set_parallel(shardit::nn::LinearParallel::Rowwise, group);
  group->stats().reset();
  const at::Tensor output = layer.forward(x.narrow(-1, rank * width, width));  // [3, 4, kOut]
  EXPECT_EQ(group->stats().calls_by_op["all_reduce"], 1u);
  // fp32 partial sums of 12 O(1) products in another order: ~1e-6.
  const std::string what = "rank " + std::to_string(rank) + " of " + std::to_string(degree) + " rowwise output";
  EXPECT_TRUE(shardit::testing::tensors_close(what, output, expected, 1e-5, 1e-5));
  EXPECT_FALSE(shardit::testing::tensors_close("bias added before the reduce", bias_before_reduce, expected,
                                               1e-5, 1e-5));
}

TEST(TpRowwise, BiasIsAddedOnceAfterTheReduceTp2) {
  if (is_worker()) return rowwise_bias_worker();
  EXPECT_EQ(run_ranks(2), 0);
}

TEST(TpRowwise, BiasIsAddedOnceAfterTheReduceTp3) {
  if (is_worker()) return rowwise_bias_worker();
  EXPECT_EQ(run_ranks(3), 0);
}

}  // namespace
}  // namespace test_tp_toy
