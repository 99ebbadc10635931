#include "shardit/parallel/context_parallel.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <sstream>

#include "shardit/core/profile.h"
#include "shardit/dist/mesh.h"
#include "shardit/nn/attention/bf16_kernels.h"

namespace shardit::parallel {

namespace {

bool mesh_has(const dist::DeviceMesh& mesh, const std::string& dim) {
  const auto& dims = mesh.dims();
  return std::any_of(dims.begin(), dims.end(), [&](const auto& d) { return d.first == dim; });
}

std::shared_ptr<dist::Group> mesh_group_or_single(const dist::DeviceMesh& mesh, const std::string& dim) {
  return mesh_has(mesh, dim) ? mesh.group(dim) : dist::Group::single();
}

}  // namespace

ContextParallelConfig::ContextParallelConfig(const dist::DeviceMesh& mesh)
    : ulysses_group(mesh_group_or_single(mesh, "ulysses")),
      ring_group(mesh_group_or_single(mesh, "ring")),
      mesh(std::make_shared<const dist::DeviceMesh>(mesh)) {}

ContextParallelConfig::ContextParallelConfig(std::shared_ptr<dist::Group> ulysses, std::shared_ptr<dist::Group> ring)
    : ulysses_group(ulysses ? std::move(ulysses) : dist::Group::single()),
      ring_group(ring ? std::move(ring) : dist::Group::single()) {}

int ContextParallelConfig::mesh_tp_degree() const { return mesh && mesh_has(*mesh, "tp") ? mesh->size("tp") : 1; }

std::string ContextParallelConfig::to_string() const {
  return "ulysses=" + std::to_string(ulysses_degree()) + " x ring=" + std::to_string(ring_degree());
}

void check_context_parallel_heads(const std::string& model, const std::string& what, int64_t heads, int tp_degree,
                                  int ulysses_degree) {
  const int64_t product = int64_t{tp_degree} * ulysses_degree;
  if (heads % product == 0) return;
  std::ostringstream pairs;
  bool first = true;
  for (int64_t split = 1; split <= std::min<int64_t>(heads, 64); ++split) {
    if (heads % split != 0) continue;
    for (int64_t tp = 1; tp <= split; ++tp) {
      if (split % tp != 0) continue;
      pairs << (first ? "" : ", ") << "(" << tp << ", " << split / tp << ")";
      first = false;
    }
  }
  TORCH_CHECK(false, model, ": ", what, " = ", heads, " does not divide by tp x ulysses = ", tp_degree, " x ",
              ulysses_degree, " = ", product, " (each rank must hold whole heads); (tp, ulysses) pairs that work: ",
              pairs.str(), "; the ring degree is free");
}

at::Tensor ring_attention(dist::Group& group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& key_mask, double scale) {
  SHARDIT_PROFILE_SCOPE("ring_attention");
  const int n = group.size();
  const int64_t batch = k.size(0);
  const int64_t keys = k.size(2);
  // [B, S_kv] true = attend; every member sends one, so its shape is the same everywhere.
  const at::Tensor mask = key_mask.has_value() && key_mask->defined()
                              ? key_mask->to(k.device()).to(at::kBool).expand({batch, keys})
                              : at::ones({batch, keys}, k.options().dtype(at::kBool));
  // One flat buffer per block, [k | v | mask], so a step is one transfer.
  at::Tensor current = at::cat({k.contiguous().view({-1}), v.contiguous().view({-1}),
                                mask.to(k.scalar_type()).contiguous().view({-1})});
  const int64_t kv_numel = k.numel();
  at::Tensor output;  // fp32 [B, H, S_q, D]
  at::Tensor lse;     // fp32 [B, H, S_q]
  for (int step = 0; step < n; ++step) {
    at::Tensor next;
    dist::Work transfer;
    if (step + 1 < n) {
      next = at::empty_like(current);
      transfer = group.ring_shift_async(current, next);
    }
    // The block that started on member (rank - step) mod n.
    const at::Tensor block_k = current.slice(0, 0, kv_numel).view(k.sizes());
    const at::Tensor block_v = current.slice(0, kv_numel, 2 * kv_numel).view(k.sizes());
    // [B, S_kv] -> [B, 1, 1, S_kv]
    const at::Tensor block_mask = current.slice(0, 2 * kv_numel).view({batch, keys}).ne(0).unsqueeze(1).unsqueeze(1);
    const nn::AttentionWithLse part = nn::attention_with_lse(q, block_k, block_v, block_mask, scale);
    const at::Tensor part_output = part.output.to(at::kFloat);
    if (step == 0) {
      output = part_output;
      lse = part.lse;
    } else {
      // out = (e^(lse - m) out + e^(lse_i - m) out_i) / (e^(lse - m) + e^(lse_i - m)), m the larger
      // lse (0 where both are -inf: no key yet, the weights are then 0 and so is the output).
      at::Tensor top = at::maximum(lse, part.lse);
      top = top.masked_fill(top.isneginf(), 0.0);
      const at::Tensor weight = (lse - top).exp();
      const at::Tensor part_weight = (part.lse - top).exp();
      const at::Tensor total = weight + part_weight;
      output = (output * weight.unsqueeze(-1) + part_output * part_weight.unsqueeze(-1)) /
               total.clamp_min(std::numeric_limits<float>::min()).unsqueeze(-1);
      lse = top + total.log();
    }
    if (step + 1 < n) {
      transfer.wait();
      current = next;
    }
  }
  return output.to(q.scalar_type());
}

at::Tensor context_parallel_attention(const ContextParallelConfig& config, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const std::optional<at::Tensor>& key_mask, double scale) {
  SHARDIT_PROFILE_SCOPE("context_parallel_attention");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(3) == k.size(3),
              "context-parallel attention: q, k, v must be [B, S, H, D] with equal heads, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  dist::Group& ulysses = *config.ulysses_group;
  const int ulysses_degree = ulysses.size();
  const int64_t heads = q.size(2);
  std::optional<at::Tensor> mask;
  if (key_mask.has_value() && key_mask->defined()) {
    TORCH_CHECK(key_mask->dim() == 2 && key_mask->size(1) == k.size(1) &&
                    (key_mask->size(0) == 1 || key_mask->size(0) == k.size(0)),
                "context-parallel attention: key_mask must be [B or 1, ", k.size(1), "], got ", key_mask->sizes());
    // [B, S_local]
    mask = key_mask->to(k.device()).to(at::kBool).expand({k.size(0), k.size(1)}).contiguous();
  }
  at::Tensor query = q;
  at::Tensor key = k;
  at::Tensor value = v;
  if (ulysses_degree > 1) {
    TORCH_CHECK(heads % ulysses_degree == 0, "Ulysses attention on group '", ulysses.name(), "': ", heads,
                " local heads do not divide by the ulysses degree ", ulysses_degree,
                "; choose tp x ulysses dividing the model's head count");
    // [3, B, S_local, H, D] -> [3, B, ulysses * S_local, H / ulysses, D]: every rank's tokens, a
    // head slice; q, k and v in one exchange
    const std::vector<at::Tensor> exchanged = ulysses.all_to_all(at::stack({q, k, v}), 3, 2).unbind(0);
    query = exchanged[0];
    key = exchanged[1];
    value = exchanged[2];
    // [B, ulysses * S_local]: the mask travels with its keys, in the same rank order
    if (mask) mask = ulysses.all_gather(*mask, 1);
  }
  // [B, H', S', D]
  const at::Tensor q_heads = query.transpose(1, 2);
  const at::Tensor k_heads = key.transpose(1, 2);
  const at::Tensor v_heads = value.transpose(1, 2);
  at::Tensor attended;
  if (config.ring_degree() > 1) {
    attended = ring_attention(*config.ring_group, q_heads, k_heads, v_heads, mask, scale);
  } else {
    std::optional<at::Tensor> dense_mask;
    // [B, S'] -> [B, 1, 1, S']
    if (mask) dense_mask = mask->unsqueeze(1).unsqueeze(1);
    attended = nn::scaled_dot_product_attention(q_heads, k_heads, v_heads, dense_mask, scale);
  }
  // [B, S', H', D]
  at::Tensor out = attended.transpose(1, 2);
  // [B, ulysses * S_local, H / ulysses, D] -> [B, S_local, H, D]
  if (ulysses_degree > 1) out = ulysses.all_to_all(out.contiguous(), 1, 2);
  return out.to(q.scalar_type());
}

// ---------------------------------------------------------------------------------------------
// ContextParallelForward

ContextParallelForward::ContextParallelForward(const ContextParallelConfig& config, const CpPlan& plan,
                                               std::string model)
    : config_(config), plan_(plan), model_(std::move(model)) {
  scope_.emplace(this);
}

const CpPlanEntry& ContextParallelForward::entry(const std::string& name) const {
  for (const CpPlanEntry& e : plan_) {
    if (e.point == name) return e;
  }
  std::ostringstream known;
  for (size_t i = 0; i < plan_.size(); ++i) known << (i ? ", " : "") << plan_[i].point;
  TORCH_CHECK(false, model_, ": the forward marks a context-parallel point '", name,
              "' that its cp plan does not list (plan points: ", known.str(), ")");
}

ContextParallelForward::Stream& ContextParallelForward::stream(const CpPlanEntry& entry, int64_t full,
                                                               const at::Device& device) {
  const int degree = config_->cp_degree();
  auto found = streams_.find(entry.stream);
  if (found != streams_.end()) {
    TORCH_CHECK(found->second.full == full, model_, ": context-parallel point '", entry.point, "' has ", full, " ",
                sequence_stream_name(entry.stream), " tokens along dim ", entry.dim, " but the stream has ",
                found->second.full, " from an earlier point; tensors of one stream must have the same length");
    return found->second;
  }
  Stream s;
  s.full = full;
  s.chunk = (full + degree - 1) / degree;
  const int64_t start = s.chunk * config_->cp_rank();
  s.valid = at::arange(start, start + s.chunk, at::TensorOptions().dtype(at::kLong).device(device)).lt(full);
  return streams_.emplace(entry.stream, std::move(s)).first->second;
}

at::Tensor ContextParallelForward::point(const std::string& name, const at::Tensor& x) {
  if (!enabled()) return x;
  const CpPlanEntry& e = entry(name);
  TORCH_CHECK(x.defined() && e.dim >= -x.dim() && e.dim < x.dim(), model_, ": context-parallel point '", name,
              "' splits dim ", e.dim, " of a tensor of shape ", x.defined() ? x.sizes() : at::IntArrayRef{});
  const int64_t dim = e.dim < 0 ? e.dim + x.dim() : e.dim;
  const int degree = config_->cp_degree();
  if (e.action == CpAction::Split) {
    SHARDIT_PROFILE_SCOPE("cp_split");
    reached_.push_back(name);
    const Stream& s = stream(e, x.size(dim), x.device());
    at::Tensor padded = x;
    if (s.chunk * degree != s.full) {
      std::vector<int64_t> pad_shape = x.sizes().vec();
      pad_shape[dim] = s.chunk * degree - s.full;
      padded = at::cat({x, at::zeros(pad_shape, x.options())}, dim);
    }
    return padded.narrow(dim, s.chunk * config_->cp_rank(), s.chunk).contiguous();
  }
  SHARDIT_PROFILE_SCOPE("cp_gather");
  for (const CpPlanEntry& other : plan_) {
    TORCH_CHECK(other.action != CpAction::Split || other.optional ||
                    std::find(reached_.begin(), reached_.end(), other.point) != reached_.end(),
                model_, ": context-parallel point '", name, "' gathers, but the split point '", other.point,
                "' of the cp plan was never reached in this forward");
  }
  auto found = streams_.find(e.stream);
  TORCH_CHECK(found != streams_.end(), model_, ": context-parallel point '", name, "' gathers the ",
              sequence_stream_name(e.stream), " stream, which no point split");
  const Stream& s = found->second;
  TORCH_CHECK(x.size(dim) == s.chunk, model_, ": context-parallel point '", name, "' has ", x.size(dim),
              " tokens along dim ", dim, ", expected this rank's ", s.chunk, " ", sequence_stream_name(e.stream),
              " tokens");
  // ulysses index varies fastest in cp_rank: gather it first, then the ring.
  at::Tensor gathered = x.contiguous();
  if (config_->ulysses_degree() > 1) gathered = config_->ulysses_group->all_gather(gathered, dim);
  if (config_->ring_degree() > 1) gathered = config_->ring_group->all_gather(gathered, dim);
  return gathered.narrow(dim, 0, s.full);
}

at::Tensor ContextParallelForward::sum_over_sequence(const std::string& point, const at::Tensor& per_token) {
  if (!enabled()) return per_token.sum(-1);
  const CpPlanEntry& e = entry(point);
  auto found = streams_.find(e.stream);
  TORCH_CHECK(e.action == CpAction::Split && found != streams_.end(), model_, ": sum_over_sequence needs the split "
              "point of a stream that was split in this forward; '", point, "' is not one");
  const Stream& s = found->second;
  TORCH_CHECK(per_token.dim() >= 1 && per_token.size(-1) == s.chunk, model_, ": sum_over_sequence over '", point,
              "' takes [..., ", s.chunk, "] (this rank's tokens), got ", per_token.sizes());
  // Padding tokens (past the end of the sequence) count for nothing.
  at::Tensor sums = per_token.masked_fill(s.valid.logical_not(), 0).sum(-1).contiguous();
  if (config_->ulysses_degree() > 1) config_->ulysses_group->all_reduce(sums);
  if (config_->ring_degree() > 1) config_->ring_group->all_reduce(sums);
  return sums;
}

std::optional<at::Tensor> ContextParallelForward::padding_validity(int64_t length) const {
  bool padded = false;
  for (const auto& [kind, s] : streams_) padded = padded || s.chunk * config_->cp_degree() != s.full;
  if (!padded) return std::nullopt;
  std::vector<at::Tensor> candidates;
  const auto text = streams_.find(SequenceStream::Text);
  const auto image = streams_.find(SequenceStream::Image);
  // Joint sequences are [text; image] (nn::joint_attention, the single-stream blocks).
  if (text != streams_.end() && image != streams_.end() && text->second.chunk + image->second.chunk == length) {
    candidates.push_back(at::cat({text->second.valid, image->second.valid}));
  }
  for (const auto& [kind, s] : streams_) {
    if (s.chunk == length) candidates.push_back(s.valid);
  }
  std::ostringstream streams;
  for (const auto& [kind, s] : streams_) streams << " " << sequence_stream_name(kind) << " " << s.chunk;
  TORCH_CHECK(!candidates.empty(), model_, ": attention over ", length,
              " local tokens matches no split stream nor [text; image] (local lengths:", streams.str(), ")");
  for (const at::Tensor& c : candidates) {
    TORCH_CHECK(c.equal(candidates.front()), model_, ": attention over ", length,
                " local tokens is ambiguous between streams of that length with different padding (local lengths:",
                streams.str(), ")");
  }
  return candidates.front();
}

at::Tensor ContextParallelForward::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const std::optional<at::Tensor>& key_mask, double scale) {
  TORCH_INTERNAL_ASSERT(enabled(), "ContextParallelForward::attend without a config");
  // [S_local]: the same decision on every rank (padding depends only on the full lengths).
  const std::optional<at::Tensor> valid = padding_validity(k.size(1));
  std::optional<at::Tensor> mask;
  if (key_mask.has_value() && key_mask->defined()) mask = key_mask->to(at::kBool);
  if (valid) mask = mask ? mask->logical_and(valid->unsqueeze(0)) : valid->unsqueeze(0);
  return context_parallel_attention(*config_, q, k, v, mask, scale);
}

}  // namespace shardit::parallel
