#pragma once
// torch.nn.Embedding, parallel-aware like nn::Linear. weight [num_embeddings, embedding_dim].
//   VocabParallel (plan style Rowwise): rows of the table split by token id; rank r holds ids
//             [begin_r, end_r) (the last ranges may be shorter, so any degree works), looks up the
//             ids it holds, zeros the others, and the partial rows are all-reduced (Megatron's
//             VocabParallelEmbedding).
//   Colwise:  columns split; each rank returns its slice of every vector (output stays local).
//   ColwiseGather: colwise, then the output is all-gathered back to full width.
#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "shardit/dist/group.h"
#include "shardit/nn/module.h"

namespace shardit::nn {

enum class EmbeddingParallel { None, VocabParallel, Colwise, ColwiseGather };

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim);
  std::string type_name() const override { return "Embedding"; }

  /// ids (integer) [...] -> [..., embedding_dim] ([..., embedding_dim_local] when Colwise).
  at::Tensor forward(const at::Tensor& ids);

  /// Switches to a parallel mode after `weight` was replaced by this rank's shard. VocabParallel:
  /// the shard holds the ids [vocab_begin, vocab_begin + weight.size(0)).
  void set_parallel(EmbeddingParallel mode, std::shared_ptr<dist::Group> group, int64_t vocab_begin = 0);
  EmbeddingParallel parallel_mode() const { return mode_; }
  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t embedding_dim() const { return embedding_dim_; }

  at::Tensor weight;  ///< [num_embeddings, embedding_dim] (a shard of it once parallel)

 private:
  int64_t num_embeddings_;
  int64_t embedding_dim_;
  EmbeddingParallel mode_ = EmbeddingParallel::None;
  std::shared_ptr<dist::Group> group_;
  int64_t vocab_begin_ = 0;
};

}  // namespace shardit::nn
