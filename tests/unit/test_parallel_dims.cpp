// The cfg x ulysses x ring x tp mesh from the command-line degrees: tp filling the rest of the
// world, replicas when the product divides the world, and the errors (naming the flags, listing
// the meshes that fit) for degrees that cannot be laid out.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "shardit/parallel/parallel_dims.h"
#include "support/test_support.h"

namespace test_parallel_dims {
namespace {

using shardit::parallel::ParallelDims;
using shardit::testing::error_of;

TEST(ParallelDims, TpTakesTheRest) {
  EXPECT_EQ((ParallelDims{1, 1, 1, 0}.resolved(4)), (ParallelDims{1, 1, 1, 4}));
  EXPECT_EQ((ParallelDims{2, 1, 1, 0}.resolved(4)), (ParallelDims{2, 1, 1, 2}));
  EXPECT_EQ((ParallelDims{2, 1, 1, 0}.resolved(2)), (ParallelDims{2, 1, 1, 1}));
  EXPECT_EQ((ParallelDims{1, 2, 3, 0}.resolved(12)), (ParallelDims{1, 2, 3, 2}));
  EXPECT_EQ((ParallelDims{2, 1, 1, 0}.resolved(6)), (ParallelDims{2, 1, 1, 3}));
  EXPECT_EQ((ParallelDims{1, 1, 1, 0}.resolved(1)), (ParallelDims{1, 1, 1, 1}));
}

TEST(ParallelDims, MeshDimsRowMajorTpFastestReplicasFirst) {
  using Dims = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ((ParallelDims{2, 1, 1, 2}.mesh_dims(4)), (Dims{{"cfg", 2}, {"ulysses", 1}, {"ring", 1}, {"tp", 2}}));
  EXPECT_EQ((ParallelDims{1, 1, 1, 1}.mesh_dims(2)),
            (Dims{{"replica", 2}, {"cfg", 1}, {"ulysses", 1}, {"ring", 1}, {"tp", 1}}));
  EXPECT_EQ((ParallelDims{2, 1, 1, 1}.mesh_dims(6)),
            (Dims{{"replica", 3}, {"cfg", 2}, {"ulysses", 1}, {"ring", 1}, {"tp", 1}}));
  EXPECT_EQ((ParallelDims{1, 1, 1, 1}.replicas_in(3)), 3);
  EXPECT_EQ((ParallelDims{2, 2, 1, 0}.replicas_in(8)), 1);
}

TEST(ParallelDims, FittingListsEveryMeshOfTheWorld) {
  const auto fits = ParallelDims::fitting(4);
  ASSERT_EQ(fits.size(), 9u);  // cfg 1: 6 ordered (u, r, t) with product 4; cfg 2: 3 with product 2
  for (const auto& dims : fits) EXPECT_EQ(dims.product(), 4) << dims.to_string();
  EXPECT_EQ(fits.front(), (ParallelDims{1, 1, 1, 4}));
  EXPECT_EQ(fits.back(), (ParallelDims{2, 2, 1, 1}));
  EXPECT_EQ(ParallelDims::fitting(3).size(), 3u);  // tp 3, ring 3, ulysses 3; cfg 2 does not divide 3
  EXPECT_EQ((ParallelDims{2, 2, 1, 1}.to_flags()), "--cfg-parallel --ulysses 2 --tp 1");
  EXPECT_EQ((ParallelDims{2, 1, 1, 0}.to_string()), "cfg=2 x ulysses=1 x ring=1 x tp=auto");
}

TEST(ParallelDims, RefusesProductThatDoesNotDivideTheWorld) {
  EXPECT_EQ(error_of([] { ParallelDims{2, 1, 1, 3}.resolved(4); }),
            "the parallel mesh cfg 2 (--cfg-parallel) x ulysses 1 (--ulysses) x ring 1 (--ring) x tp 3 (--tp) = 6 "
            "does not divide the 4 ranks launched; choose degrees whose product is 4 (or divides it: each block of "
            "that many ranks then runs a replica): [--tp 4], [--ring 2 --tp 2], [--ring 4 --tp 1], "
            "[--ulysses 2 --tp 2], [--ulysses 2 --ring 2 --tp 1], [--ulysses 4 --tp 1], [--cfg-parallel --tp 2], "
            "[--cfg-parallel --ring 2 --tp 1], [--cfg-parallel --ulysses 2 --tp 1]");
  EXPECT_EQ(error_of([] { ParallelDims{1, 1, 1, 8}.resolved(4); })
                .find("the parallel mesh cfg 1 (--cfg-parallel) x ulysses 1 (--ulysses) x ring 1 (--ring) x tp 8 "
                      "(--tp) = 8 does not divide the 4 ranks launched"),
            0u);
}

TEST(ParallelDims, RefusesRestThatTpCannotTake) {
  EXPECT_EQ(error_of([] { ParallelDims{2, 1, 1, 0}.resolved(3); }),
            "the parallel mesh cfg 2 (--cfg-parallel) x ulysses 1 (--ulysses) x ring 1 (--ring) = 2 does not divide "
            "the 3 ranks launched, so --tp cannot take the rest; launch a multiple of 2 ranks, or choose degrees "
            "whose product is 3: [--tp 3], [--ring 3 --tp 1], [--ulysses 3 --tp 1]");
  EXPECT_EQ(error_of([] { ParallelDims{2, 1, 1, 0}.resolved(1); }),
            "the parallel mesh cfg 2 (--cfg-parallel) x ulysses 1 (--ulysses) x ring 1 (--ring) = 2 does not divide "
            "the 1 rank launched, so --tp cannot take the rest; launch a multiple of 2 ranks, or choose degrees "
            "whose product is 1: [--tp 1]");
}

TEST(ParallelDims, RefusesCfgDegreeOtherThanOneOrTwo) {
  EXPECT_EQ(error_of([] { ParallelDims{3, 1, 1, 0}.resolved(6); }),
            "--cfg-parallel degree 3: classifier-free guidance has two branches (conditional and unconditional), so "
            "the cfg degree is 1 or 2");
  EXPECT_EQ(error_of([] { ParallelDims{0, 1, 1, 0}.resolved(2); }),
            "--cfg-parallel degree 0: classifier-free guidance has two branches (conditional and unconditional), so "
            "the cfg degree is 1 or 2");
}

// serve's --replicas R: the world as R copies of the mesh; an unset tp takes what they leave.
TEST(ParallelDims, ReplicasLeaveTheRestToTp) {
  using Dims = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ((ParallelDims{1, 1, 1, 0, 2}.resolved(4)), (ParallelDims{1, 1, 1, 2, 2}));
  EXPECT_EQ((ParallelDims{2, 1, 1, 0, 2}.resolved(8)), (ParallelDims{2, 1, 1, 2, 2}));
  EXPECT_EQ((ParallelDims{1, 1, 1, 1, 4}.resolved(4)), (ParallelDims{1, 1, 1, 1, 4}));
  EXPECT_EQ((ParallelDims{1, 1, 1, 0, 2}.mesh_dims(4)),
            (Dims{{"replica", 2}, {"cfg", 1}, {"ulysses", 1}, {"ring", 1}, {"tp", 2}}));
  EXPECT_EQ((ParallelDims{1, 1, 1, 0, 2}.replicas_in(4)), 2);
}

TEST(ParallelDims, RefusesReplicasThatDoNotMakeTheWorld) {
  EXPECT_EQ(error_of([] { ParallelDims{1, 1, 1, 0, 3}.resolved(4); }),
            "serve: --replicas 3 of cfg=1 x ulysses=1 x ring=1 x tp=auto do not make the 4 ranks; choose --replicas "
            "and --tp (--cfg-parallel, --ulysses, --ring) so that replicas x cfg x ulysses x ring x tp = 4");
  EXPECT_EQ(error_of([] { ParallelDims{1, 1, 1, 1, 2}.resolved(4); }),
            "serve: --replicas 2 of cfg=1 x ulysses=1 x ring=1 x tp=1 do not make the 4 ranks; choose --replicas "
            "and --tp (--cfg-parallel, --ulysses, --ring) so that replicas x cfg x ulysses x ring x tp = 4");
}

TEST(ParallelDims, RefusesDegreesBelowOne) {
  EXPECT_EQ(error_of([] { ParallelDims{1, 0, 1, 0}.resolved(2); }), "--ulysses is 0; the Ulysses degree is at least 1");
  EXPECT_EQ(error_of([] { ParallelDims{1, 1, -2, 0}.resolved(2); }), "--ring is -2; the ring degree is at least 1");
  EXPECT_EQ(error_of([] { ParallelDims{1, 1, 1, -1}.resolved(2); }),
            "--tp is -1; the tensor-parallel degree is at least 1 (or unset: the rest of the world)");
}

}  // namespace
}  // namespace test_parallel_dims
