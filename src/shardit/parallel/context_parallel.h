#pragma once
// Context parallelism: each rank holds a share of the sequence (image and text tokens, with their
// rotary rows and mask entries) and attention exchanges keys and values between the shares, so
// activations per rank shrink with the degree. Two exchanges, composable with each other and with
// tensor parallelism on one mesh:
//   Ulysses  an all-to-all turns sequence shards into head shards before attention (every rank
//            then sees the whole sequence for H / (tp x ulysses) heads) and back after;
//   ring     key/value blocks travel around the ring while each rank attends its queries to the
//            block it holds; the partial results are merged with their log-sum-exp.
//
// The model side is data, as for tensor parallelism: a model lists its points in a CpPlan
// (parallel/plan.h) and marks them in its forward, never reading ranks:
//
//   at::Tensor MyModel::forward(const Inputs& inputs) {
//     ContextParallelForward cp = context_parallel_forward();  // identity without CP
//     at::Tensor x = cp.point("hidden_states", inputs.hidden_states);   // split: this rank's chunk
//     ...  nn::attention / nn::joint_attention exchange through cp while it lives ...
//     return cp.point("proj_out", out);                                // gather: the whole sequence
//   }
//
// Using it (every rank of the mesh, the same calls):
//
//   dist::DeviceMesh mesh(world, {{"ulysses", 2}, {"ring", 2}, {"tp", 2}});   // row-major, tp fastest
//   model->load(checkpoint, {dtype, device, TensorParallelConfig(mesh, "tp")});
//   model->enable_context_parallelism(ContextParallelConfig(mesh));
//   at::Tensor out = model->forward(inputs);   // full inputs in, full output out, on every rank
//
// Mesh convention: dims named "cfg", "ulysses", "ring", "tp" in that order (row-major, tp
// fastest); dims of size 1 may be omitted. Sequences that the CP degree does not divide are padded
// with zeros, the padding masked as keys and stripped at the gather.
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/nn/attention.h"
#include "shardit/parallel/plan.h"

namespace shardit::dist {
class DeviceMesh;
}

namespace shardit::parallel {

/// Which ranks share one sequence, and how: the "ulysses" and "ring" dimensions of a mesh.
struct ContextParallelConfig {
  /// The Ulysses all-to-all group (size 1 when the mesh has no "ulysses" dimension).
  std::shared_ptr<dist::Group> ulysses_group;
  /// The ring group (size 1 when the mesh has no "ring" dimension).
  std::shared_ptr<dist::Group> ring_group;
  /// The mesh the groups come from (null when built from bare groups).
  std::shared_ptr<const dist::DeviceMesh> mesh;

  /// The "ulysses" and "ring" dimensions of `mesh` (either may be absent: degree 1).
  explicit ContextParallelConfig(const dist::DeviceMesh& mesh);
  /// From bare groups (null: degree 1); the ulysses group must be the faster-varying one.
  ContextParallelConfig(std::shared_ptr<dist::Group> ulysses, std::shared_ptr<dist::Group> ring);

  int ulysses_degree() const { return ulysses_group->size(); }
  int ring_degree() const { return ring_group->size(); }
  /// ulysses x ring: the number of sequence shards.
  int cp_degree() const { return ulysses_degree() * ring_degree(); }
  /// This rank's shard: ring index x ulysses degree + ulysses index.
  int cp_rank() const { return ring_group->rank() * ulysses_degree() + ulysses_group->rank(); }
  /// The size of the mesh's "tp" dimension (1 without one or without a mesh).
  int mesh_tp_degree() const;
  /// "ulysses=2 x ring=1"
  std::string to_string() const;
};

/// Refuses a head count that tensor parallelism and Ulysses cannot split into whole heads:
/// `heads` must divide by tp x ulysses. The message names `model` and `what` and lists the
/// (tp, ulysses) pairs that would work.
void check_context_parallel_heads(const std::string& model, const std::string& what, int64_t heads, int tp_degree,
                                  int ulysses_degree);

/// Attention of this rank's queries over the keys of every CP rank: q, k, v [B, S_local, H, D]
/// (S_local equal on every rank), key_mask (optional) bool [B, S_local] (true = attend, travels
/// with its keys). Ulysses trades sequence for heads (H must divide by the ulysses degree), ring
/// rotates key/value blocks and merges by log-sum-exp. Returns [B, S_local, H, D] in q's dtype.
at::Tensor context_parallel_attention(const ContextParallelConfig& config, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const std::optional<at::Tensor>& key_mask, double scale);

/// Ring attention alone: q [B, H, S_q, D] against the key/value blocks k, v [B, H, S_kv, D] and
/// key_mask (optional) bool [B, S_kv] of every member of `group`, the next block's transfer
/// overlapping the current block's compute. Returns [B, H, S_q, D] in q's dtype.
at::Tensor ring_attention(dist::Group& group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& key_mask, double scale);

/// One forward under context parallelism (or, default-constructed, without: every point is the
/// identity). While it lives, nn::attention on this thread exchanges through it. Points split
/// and gather as the plan says; the padding of each stream is remembered so that attention masks
/// the padded keys and the gather strips them.
class ContextParallelForward : public nn::SequenceParallelAttention {
 public:
  ContextParallelForward() = default;
  /// `model` names the model in messages.
  ContextParallelForward(const ContextParallelConfig& config, const CpPlan& plan, std::string model);
  ContextParallelForward(const ContextParallelForward&) = delete;
  ContextParallelForward& operator=(const ContextParallelForward&) = delete;

  bool enabled() const { return config_.has_value(); }
  /// The tensor at the plan's point `name`: this rank's chunk (Split), the whole sequence
  /// (Gather), or `x` itself when context parallelism is off.
  at::Tensor point(const std::string& name, const at::Tensor& x);

  /// Sums `per_token` ([..., tokens], this rank's values per token of the stream split at the
  /// split point `point`) over the whole sequence: padding tokens left out, then summed over the
  /// ulysses and ring groups. [...] on every rank of the sequence split; without context
  /// parallelism, per_token.sum(-1).
  at::Tensor sum_over_sequence(const std::string& point, const at::Tensor& per_token);

  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& key_mask, double scale) override;

 private:
  struct Stream {
    int64_t full = 0;    ///< tokens before padding
    int64_t chunk = 0;   ///< tokens per rank after padding
    at::Tensor valid;    ///< bool [chunk]: this rank's tokens that are not padding
  };
  const CpPlanEntry& entry(const std::string& name) const;
  Stream& stream(const CpPlanEntry& entry, int64_t full, const at::Device& device);
  /// Validity of the keys of a local sequence of `length` tokens (one stream, or [text; image]);
  /// nullopt when no stream is padded.
  std::optional<at::Tensor> padding_validity(int64_t length) const;

  std::optional<ContextParallelConfig> config_;
  CpPlan plan_;
  std::string model_;
  std::map<SequenceStream, Stream> streams_;
  std::vector<std::string> reached_;
  std::optional<nn::SequenceParallelAttentionScope> scope_;
};

}  // namespace shardit::parallel
