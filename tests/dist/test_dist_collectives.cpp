// Collectives on real process groups: 2, 3 and 4 local ranks (and 2 ranks under mpirun), every
// collective's values in f32/bf16/f16 against a local recomputation of what every rank holds,
// async all-reduce, all-to-all, sub-groups, a 2x2 mesh, and the CommStats counts.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "shardit/dist/launcher.h"
#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace test_dist_collectives {
namespace {

using shardit::dist::DeviceMesh;
using shardit::dist::Group;
using shardit::dist::World;
using shardit::testing::error_of;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;

// What rank `r` holds: integers in [-8, 8] scaled by 1/4 are exact in bf16 and f16, and their sums
// over <= 4 ranks too, so the sums compare exactly whatever order the backend adds in. The random
// part (seeded per rank) checks non-trivial values with a tolerance.
at::Tensor rank_tensor(int r, at::IntArrayRef shape, at::ScalarType dtype, bool random) {
  if (random) {
    at::manual_seed(1000 + r);
    return at::randn(shape).to(dtype);
  }
  const int64_t numel = c10::multiply_integers(shape);
  at::Tensor base = at::arange(numel, at::kLong).reshape(shape);
  return ((base * (r + 3) + 5 * r) % 17 - 8).to(at::kFloat).div(4).to(dtype);
}

// Tolerances for the random values: the sum is taken in f32 and rounded once to the dtype, so at
// most one rounding of the dtype (bf16: 2^-8, f16: 2^-11 relative) separates any two orders.
double rtol_for(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return 1.0 / 128;
  if (dtype == at::kHalf) return 1.0 / 1024;
  return 1e-6;
}

void check_collectives(Group& group, at::ScalarType dtype, bool random) {
  const int n = group.size();
  const int me = group.rank();
  const auto& members = group.global_ranks();
  const std::string tag = std::string(c10::toString(dtype)) + (random ? " random" : " exact");
  const double rtol = random ? rtol_for(dtype) : 0.0;
  const double atol = random ? 1e-6 : 0.0;
  const std::vector<int64_t> shape = {2 * n, 3, n + 1};
  std::vector<at::Tensor> all;
  for (int j = 0; j < n; ++j) all.push_back(rank_tensor(members[j], shape, dtype, random));
  at::Tensor sum_f32 = at::zeros(shape, at::kFloat);
  for (const auto& t : all) sum_f32 += t.to(at::kFloat);
  const at::Tensor sum = sum_f32.to(dtype);

  // all_reduce, in place, on a contiguous and on a transposed (non-contiguous) tensor.
  at::Tensor x = all[me].clone();
  group.all_reduce(x);
  EXPECT_EQ(x.scalar_type(), dtype);
  EXPECT_TRUE(tensors_close("all_reduce " + tag, x, sum, atol, rtol));
  at::Tensor xt = all[me].clone().transpose(0, 2);
  group.all_reduce(xt);
  EXPECT_TRUE(tensors_close("all_reduce transposed " + tag, xt, sum.transpose(0, 2), atol, rtol));

  // all_reduce_async: two in flight at once.
  at::Tensor a = all[me].clone();
  at::Tensor b = all[me].clone() * 2;
  auto work_a = group.all_reduce_async(a);
  auto work_b = group.all_reduce_async(b);
  work_b.wait();
  work_a.wait();
  work_a.wait();  // a second wait is harmless
  EXPECT_TRUE(tensors_close("all_reduce_async " + tag, a, sum, atol, rtol));
  EXPECT_TRUE(tensors_close("all_reduce_async x2 " + tag, b, (sum_f32 * 2).to(dtype), atol, 2 * rtol));

  // all_gather along every dim (and a negative one): concatenation in group order (exact).
  for (int64_t dim : {0, 1, 2, -1}) {
    const at::Tensor gathered = group.all_gather(all[me], dim);
    EXPECT_TRUE(tensors_close("all_gather dim " + std::to_string(dim) + " " + tag, gathered,
                              at::cat(all, dim), 0, 0));
  }
  // A non-contiguous input.
  const at::Tensor gathered_t = group.all_gather(all[me].transpose(0, 1), 0);
  std::vector<at::Tensor> all_t;
  for (const auto& t : all) all_t.push_back(t.transpose(0, 1));
  EXPECT_TRUE(tensors_close("all_gather transposed " + tag, gathered_t, at::cat(all_t, 0), 0, 0));

  // reduce_scatter along dims 0 and 2: this member's chunk of the sum.
  for (int64_t dim : {0, 2}) {
    at::Tensor input = all[me];
    at::Tensor expected = sum;
    if (dim == 2) {  // make dim 2 (size n + 1) divisible by n
      input = at::cat({input, input}, 2).narrow(2, 0, n);
      at::Tensor s = at::zeros_like(input, at::kFloat);
      for (const auto& t : all) s += at::cat({t, t}, 2).narrow(2, 0, n).to(at::kFloat);
      expected = s.to(dtype);
    }
    const at::Tensor scattered = group.reduce_scatter(input, dim);
    EXPECT_TRUE(tensors_close("reduce_scatter dim " + std::to_string(dim) + " " + tag, scattered,
                              expected.chunk(n, dim)[me], atol, rtol));
  }

  // all_to_all: chunk j of member j's tensor along scatter_dim arrives at member j.
  for (auto [scatter_dim, gather_dim] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {0, 0}, {1, 0}}) {
    at::Tensor input = all[me];
    std::vector<at::Tensor> inputs = all;
    if (scatter_dim == 1) {  // dim 1 has size 3: widen it to 3n
      input = at::cat(std::vector<at::Tensor>(n, input), 1);
      for (auto& t : inputs) t = at::cat(std::vector<at::Tensor>(n, t), 1);
    }
    std::vector<at::Tensor> pieces;
    for (int j = 0; j < n; ++j) pieces.push_back(inputs[j].chunk(n, scatter_dim)[me]);
    const at::Tensor exchanged = group.all_to_all(input, scatter_dim, gather_dim);
    EXPECT_TRUE(tensors_close("all_to_all " + std::to_string(scatter_dim) + "->" +
                                  std::to_string(gather_dim) + " " + tag,
                              exchanged, at::cat(pieces, gather_dim), 0, 0));
  }

  // broadcast from the last member, in place, also into a non-contiguous tensor.
  at::Tensor c = all[me].clone();
  group.broadcast(c, n - 1);
  EXPECT_TRUE(tensors_close("broadcast " + tag, c, all[n - 1], 0, 0));
  at::Tensor ct = all[me].clone().transpose(0, 1);
  group.broadcast(ct, 0);
  EXPECT_TRUE(tensors_close("broadcast transposed " + tag, ct, all[0].transpose(0, 1), 0, 0));
}

void check_stats(Group& group) {
  const uint64_t n = static_cast<uint64_t>(group.size());
  group.stats().reset();
  at::Tensor x = at::ones({10, 6}, at::kFloat);  // 240 bytes
  group.all_reduce(x);
  group.all_reduce_async(x).wait();
  const at::Tensor gathered = group.all_gather(at::ones({4, 2}, at::kBFloat16), 0);  // 16 bytes in
  const at::Tensor scattered = group.reduce_scatter(at::ones({static_cast<int64_t>(n) * 2, 5}, at::kFloat), 0);
  const at::Tensor exchanged = group.all_to_all(at::ones({static_cast<int64_t>(n) * 3}, at::kDouble), 0, 0);
  group.broadcast(x, 0);
  group.barrier();
  const auto& stats = group.stats();
  EXPECT_EQ(stats.collectives, 7u);
  EXPECT_EQ(stats.calls_by_op.at("all_reduce"), 2u);
  EXPECT_EQ(stats.calls_by_op.at("all_gather"), 1u);
  EXPECT_EQ(stats.calls_by_op.at("reduce_scatter"), 1u);
  EXPECT_EQ(stats.calls_by_op.at("all_to_all"), 1u);
  EXPECT_EQ(stats.calls_by_op.at("broadcast"), 1u);
  EXPECT_EQ(stats.calls_by_op.at("barrier"), 1u);
  // Ring counts (group.h): all-reduce 2(n-1)/n B, all-gather (n-1) B_in, reduce-scatter and
  // all-to-all (n-1)/n B_in, broadcast B on the root only.
  const uint64_t expected = 2 * (240 * 2 * (n - 1) / n) + 16 * (n - 1) +
                            (n * 2 * 5 * 4) * (n - 1) / n + (n * 3 * 8) * (n - 1) / n +
                            (group.rank() == 0 ? 240 : 0);
  EXPECT_EQ(stats.bytes_sent, expected);
}

void check_world(int expected_size) {
  World& world = World::init();
  ASSERT_EQ(world.size(), expected_size);
  // Which launcher's variables this rank was started with (torchrun's from run_ranks).
  EXPECT_STREQ(shardit::dist::launch_source_name(world.env().source),
               shardit::testing::env_or("SHARDIT_TEST_EXPECT_SOURCE", "torchrun").c_str());
  EXPECT_EQ(world.device(), at::Device(at::kCPU));
  auto group = world.group();
  ASSERT_TRUE(group);
  EXPECT_EQ(group->size(), world.size());
  EXPECT_EQ(group->rank(), world.rank());
  std::vector<int> all(expected_size);
  for (int r = 0; r < expected_size; ++r) all[r] = r;
  EXPECT_EQ(group->global_ranks(), all);

  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    check_collectives(*group, dtype, /*random=*/false);
    check_collectives(*group, dtype, /*random=*/true);
  }
  // Integer and double all-reduce go through the backend natively.
  for (auto dtype : {at::kDouble, at::kInt, at::kLong}) {
    at::Tensor x = at::full({5}, world.rank() + 1, at::TensorOptions().dtype(dtype));
    group->all_reduce(x);
    EXPECT_EQ(x[4].item<double>(), expected_size * (expected_size + 1) / 2.0) << c10::toString(dtype);
  }
  check_stats(*group);

  // Errors are found before any communication, identically on every rank.
  const std::string n = std::to_string(expected_size);
  const std::string n1 = std::to_string(expected_size + 1);
  EXPECT_EQ(error_of([&] { group->reduce_scatter(at::ones({expected_size + 1}), 0); }),
            "reduce_scatter on group 'world': dim 0 of shape [" + n1 + "] has size " + n1 +
                ", which the group size " + n + " does not divide");
  EXPECT_EQ(error_of([&] { group->all_gather(at::ones({2}), 3); }),
            "all_gather on group 'world': dim 3 is out of range for a tensor of shape [2]");
  at::Tensor one = at::ones({1});
  EXPECT_EQ(error_of([&] { group->broadcast(one, expected_size); }),
            "broadcast on group 'world': root " + n + " is out of range for a group of size " + n);

  // A sub-group of the first and last rank; the others get nullptr.
  auto ends = world.new_group({0, expected_size - 1});
  const bool member = world.rank() == 0 || world.rank() == expected_size - 1;
  ASSERT_EQ(static_cast<bool>(ends), member);
  if (ends) {
    EXPECT_EQ(ends->size(), 2);
    EXPECT_EQ(ends->rank(), world.rank() == 0 ? 0 : 1);
    check_collectives(*ends, at::kBFloat16, /*random=*/true);
  }
  // A one-member group is the identity.
  auto alone = world.new_group({world.size() - 1});
  if (world.rank() == world.size() - 1) {
    ASSERT_TRUE(alone);
    EXPECT_EQ(alone->size(), 1);
    EXPECT_EQ(alone->global_ranks(), std::vector<int>{world.rank()});
    at::Tensor y = at::ones({3});
    alone->all_reduce(y);
    EXPECT_TRUE(tensors_close("single all_reduce", y, at::ones({3}), 0, 0));
  } else {
    EXPECT_FALSE(alone);
  }
  group->barrier();
}

TEST(DistCollectives, TwoRanks) {
  if (is_worker()) return check_world(2);
  EXPECT_EQ(run_ranks(2), 0);
}

TEST(DistCollectives, ThreeRanks) {
  if (is_worker()) return check_world(3);
  EXPECT_EQ(run_ranks(3), 0);
}

TEST(DistCollectives, FourRanksAndMesh) {
  if (is_worker()) {
    check_world(4);
    World& world = World::get();
    DeviceMesh mesh(world, {{"cp", 2}, {"tp", 2}});
    EXPECT_EQ(mesh.to_string(), "cp=2 x tp=2");
    EXPECT_EQ(mesh.ndim(), 2);
    EXPECT_EQ(mesh.size("cp"), 2);
    EXPECT_EQ(mesh.size("tp"), 2);
    const int cp = world.rank() / 2;
    const int tp = world.rank() % 2;
    EXPECT_EQ(mesh.coordinate("cp"), cp);
    EXPECT_EQ(mesh.coordinate("tp"), tp);
    EXPECT_EQ(mesh.group("tp")->global_ranks(), (std::vector<int>{cp * 2, cp * 2 + 1}));
    EXPECT_EQ(mesh.group("cp")->global_ranks(), (std::vector<int>{tp, tp + 2}));
    EXPECT_EQ(mesh.group("tp")->rank(), tp);
    EXPECT_EQ(mesh.group("cp")->rank(), cp);
    at::Tensor x = at::full({2}, static_cast<float>(world.rank()));
    mesh.group("tp")->all_reduce(x);
    EXPECT_EQ(x[0].item<float>(), static_cast<float>(cp * 2 + cp * 2 + 1));
    at::Tensor y = at::full({2}, static_cast<float>(world.rank()));
    mesh.group("cp")->all_reduce(y);
    EXPECT_EQ(y[1].item<float>(), static_cast<float>(tp + tp + 2));
    EXPECT_EQ(error_of([&] { mesh.size("dp"); }), "DeviceMesh cp=2 x tp=2 has no dimension 'dp'");
    EXPECT_EQ(error_of([&] { DeviceMesh(world, {{"cp", 3}, {"tp", 2}}); }),
              "DeviceMesh cp=3 x tp=2 holds 6 ranks but the world has 4; choose sizes whose product is 4");

    // A mesh with a size-1 dimension, and a 1-D mesh.
    DeviceMesh flat(world, {{"cp", 1}, {"tp", 4}});
    EXPECT_EQ(flat.group("cp")->size(), 1);
    EXPECT_EQ(flat.group("tp")->size(), 4);
    EXPECT_EQ(flat.coordinate("tp"), world.rank());
    DeviceMesh line = DeviceMesh::one_d(world);
    EXPECT_EQ(line.to_string(), "tp=4");
    EXPECT_EQ(line.group("tp")->global_ranks(), (std::vector<int>{0, 1, 2, 3}));
    world.group()->barrier();
    return;
  }
  EXPECT_EQ(run_ranks(4), 0);
}

TEST(DistCollectives, SingleProcessWorldIsTheIdentity) {
  if (is_worker()) GTEST_SKIP() << "runs in the parent process only";
  // No launcher variables in this process: rank 0 of 1, no store.
  World& world = World::init();
  ASSERT_EQ(world.size(), 1);
  auto group = world.group();
  at::Tensor x = at::arange(6.0).reshape({2, 3});
  const at::Tensor original = x.clone();
  group->all_reduce(x);
  group->all_reduce_async(x).wait();
  group->broadcast(x, 0);
  group->barrier();
  EXPECT_TRUE(tensors_close("identity", x, original, 0, 0));
  EXPECT_TRUE(tensors_close("all_gather", group->all_gather(x, 1), original, 0, 0));
  EXPECT_TRUE(tensors_close("reduce_scatter", group->reduce_scatter(x, 0), original, 0, 0));
  EXPECT_TRUE(tensors_close("all_to_all", group->all_to_all(x, 0, 1), original, 0, 0));
  EXPECT_EQ(group->stats().calls_by_op.at("all_reduce"), 2u);
  EXPECT_EQ(group->stats().bytes_sent, 0u);
  DeviceMesh mesh = DeviceMesh::one_d(world);
  EXPECT_EQ(mesh.group("tp")->size(), 1);
  EXPECT_EQ(mesh.coordinate("tp"), 0);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The same two-rank checks under OpenMPI's launcher (OMPI_COMM_WORLD_* variables).
TEST(DistCollectives, TwoRanksUnderMpirun) {
  if (is_worker()) return check_world(2);
  std::string mpirun_path;
  if (shardit::testing::run_command("command -v mpirun", &mpirun_path) != 0) {
    GTEST_SKIP() << "mpirun is not installed (OpenMPI's launcher), so the mpirun convention "
                    "cannot be exercised here";
  }
  const shardit::testing::WorkerRecord record;
  std::string command = "mpirun -np 2 --oversubscribe --allow-run-as-root";
  auto env = record.env();
  env["SHARDIT_TEST_EXPECT_SOURCE"] = "openmpi";
  env["MASTER_ADDR"] = "127.0.0.1";
  env["MASTER_PORT"] = std::to_string(free_port());
  for (const auto& [name, value] : env) command += " -x " + name + "=" + value;
  command += " " + shardit::dist::current_executable() +
             " --gtest_color=no --gtest_filter=" + shardit::testing::current_test_name() + " 2>&1";
  std::string output;
  const int code = shardit::testing::run_command(command, &output);
  EXPECT_EQ(code, 0) << command << "\n" << output;
  record.expect_ran(2);
}

}  // namespace
}  // namespace test_dist_collectives
