#include "shardit/nn/embedding.h"

#include <c10/util/Exception.h>

#include <utility>
#include <vector>

#include "shardit/core/profile.h"

namespace shardit::nn {

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim)
    : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {
  TORCH_CHECK(num_embeddings > 0 && embedding_dim > 0,
              "Embedding: num_embeddings and embedding_dim must be positive, got [", num_embeddings, ", ",
              embedding_dim, "]");
  register_parameter("weight", &weight, {num_embeddings, embedding_dim});
}

at::Tensor Embedding::forward(const at::Tensor& ids) {
  SHARDIT_PROFILE_SCOPE("Embedding");
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool, "Embedding '", path(),
              "': ids must be integers, got ", ids.scalar_type());
  const at::Tensor flat = ids.to(weight.device(), at::kLong);
  if (flat.numel() > 0) {
    const int64_t low = flat.min().item<int64_t>();
    const int64_t high = flat.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < num_embeddings_, "Embedding '", path(), "': token ids must be in [0, ",
                num_embeddings_, "), got ids from ", low, " to ", high);
  }
  switch (mode_) {
    case EmbeddingParallel::None:
    case EmbeddingParallel::Colwise:
      // [..., E] or [..., E_local]
      return at::embedding(weight, flat);
    case EmbeddingParallel::ColwiseGather: {
      const at::Tensor local = at::embedding(weight, flat);  // [..., E_local]
      return group_->all_gather(local, local.dim() - 1);     // [..., E]
    }
    case EmbeddingParallel::VocabParallel: {
      const int64_t rows = weight.size(0);
      const at::Tensor outside = (flat < vocab_begin_) | (flat >= vocab_begin_ + rows);
      // Ids this rank does not hold look up row 0 (any valid row) and are zeroed after.
      const at::Tensor local_ids = (flat - vocab_begin_).masked_fill(outside, 0);
      std::vector<int64_t> shape = flat.sizes().vec();
      shape.push_back(embedding_dim_);
      // [..., E], partial; a rank holding no rows (more ranks than ids) contributes zeros.
      at::Tensor out = rows > 0 ? at::embedding(weight, local_ids).masked_fill_(outside.unsqueeze(-1), 0)
                                : at::zeros(shape, weight.options());
      group_->all_reduce(out);  // [..., E], every row from the rank that holds it
      return out;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "Embedding: unknown parallel mode");
}

void Embedding::set_parallel(EmbeddingParallel mode, std::shared_ptr<dist::Group> group, int64_t vocab_begin) {
  TORCH_CHECK(mode == EmbeddingParallel::None || group != nullptr, "Embedding '", path(),
              "': a parallel mode needs a group");
  mode_ = mode;
  group_ = std::move(group);
  vocab_begin_ = vocab_begin;
}

}  // namespace shardit::nn
