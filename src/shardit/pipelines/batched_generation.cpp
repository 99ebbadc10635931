// DiffusionPipeline::generate_batch: a server's batch of requests, those that can share one
// denoising loop run together, each image bit for bit the one generate() gives it alone.
#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "shardit/core/notes.h"
#include "shardit/nn/linear.h"
#include "shardit/pipelines/pipeline.h"

namespace shardit::pipelines {

namespace {

/// Thrown from a batch's progress callback to leave its denoising loop (caught by generate_batch).
struct BatchStopped {};

/// Whether two optional embeddings could be one batch: the same shapes, and Qwen-Image's mask
/// either absent or all ones on both (a full mask is dropped, a partial one is applied).
bool same_embeds_layout(const std::optional<PromptEmbeds>& a, const std::optional<PromptEmbeds>& b) {
  if (a.has_value() != b.has_value()) return false;
  if (!a) return true;
  const auto mask_kind = [](const PromptEmbeds& e) {
    if (!e.prompt_embeds_mask) return 0;
    return e.prompt_embeds_mask->ne(0).all().item<bool>() ? 1 : 2;
  };
  // [B, L, D]: the rows (prompts x images) may differ, the token count and width may not.
  return a->prompt_embeds.sizes().slice(1) == b->prompt_embeds.sizes().slice(1) &&
         a->pooled_prompt_embeds.has_value() == b->pooled_prompt_embeds.has_value() && mask_kind(*a) == mask_kind(*b);
}

/// Whether two prepared calls can share one denoising loop.
bool batchable(const PreparedRequest& a, const PreparedRequest& b) {
  return a.height == b.height && a.width == b.width && a.num_inference_steps == b.num_inference_steps &&
         a.guidance_scale == b.guidance_scale && a.true_cfg_scale == b.true_cfg_scale && a.do_cfg == b.do_cfg &&
         !a.references.defined() && !b.references.defined() && same_embeds_layout(a.cond, b.cond) &&
         same_embeds_layout(a.uncond, b.uncond);
}

/// The members' embeddings one after the other along the batch.
PromptEmbeds concat_prompt_embeds(const std::vector<const PromptEmbeds*>& parts) {
  const auto cat = [&](auto&& get) {
    std::vector<at::Tensor> tensors;
    for (const PromptEmbeds* part : parts) tensors.push_back(get(*part));
    return at::cat(tensors, 0);
  };
  PromptEmbeds out;
  out.prompt_embeds = cat([](const PromptEmbeds& e) { return e.prompt_embeds; });
  if (parts.front()->pooled_prompt_embeds) {
    out.pooled_prompt_embeds = cat([](const PromptEmbeds& e) { return *e.pooled_prompt_embeds; });
  }
  if (parts.front()->prompt_embeds_mask) {
    out.prompt_embeds_mask = cat([](const PromptEmbeds& e) { return *e.prompt_embeds_mask; });
  }
  return out;
}

}  // namespace

std::vector<std::optional<GenerateResult>> DiffusionPipeline::generate_batch(const std::vector<GenerateRequest>& requests,
                                                                             const BatchProgress& progress) {
  TORCH_CHECK(loaded_, class_name(), ": load() the weights before generate_batch()");
  TORCH_CHECK(joint_transformer().step_cache() == nullptr, class_name(),
              ": generate_batch() with a step cache enabled on the transformer: its decision to skip a step is "
              "taken for the whole batch, so a request would not get its own image; disable the cache or run "
              "the requests with generate()");
  nn::SamplewiseProducts samplewise;
  std::vector<PreparedRequest> calls;
  calls.reserve(requests.size());
  std::vector<std::vector<std::string>> request_notes;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& request = requests[i];
    TORCH_CHECK(!request.cache && request.image.empty() && !request.on_progress && !request.callback_on_step_end,
                class_name(), ": generate_batch() request ", i, " has a step cache, reference images or callbacks; "
                "run it with generate()");
    check(request);
    NoteCollector notes;
    calls.push_back(prepare(request));
    request_notes.push_back(notes.notes());
  }
  // Each request joins the first batch whose first member it can share a loop with.
  std::vector<std::vector<size_t>> batches;
  for (size_t i = 0; i < calls.size(); ++i) {
    auto batch = std::find_if(batches.begin(), batches.end(),
                              [&](const std::vector<size_t>& b) { return batchable(calls[b.front()], calls[i]); });
    if (batch == batches.end()) {
      batches.push_back({i});
    } else {
      batch->push_back(i);
    }
  }
  std::vector<std::optional<GenerateResult>> results(requests.size());
  for (const std::vector<size_t>& members : batches) {
    PreparedRequest call = std::move(calls[members.front()]);
    std::vector<const PromptEmbeds*> cond, uncond;
    std::vector<at::Tensor> latents;
    std::vector<int64_t> sizes;
    for (const size_t i : members) {
      const PreparedRequest& member = i == members.front() ? call : calls[i];
      cond.push_back(&member.cond);
      if (member.uncond) uncond.push_back(&*member.uncond);
      latents.push_back(member.latents);
      sizes.push_back(member.batch);
    }
    call.cond = concat_prompt_embeds(cond);
    if (call.do_cfg) call.uncond = concat_prompt_embeds(uncond);
    call.latents = at::cat(latents, 0);  // [sum B_i, N, C4]
    call.batch = call.latents.size(0);
    GenerateRequest shared = requests[members.front()];
    shared.on_progress = [&](int64_t done, int64_t total) {
      if (progress && progress(members, done, total)) throw BatchStopped{};
    };
    GenerateResult all;
    try {
      all = generate_prepared(call, shared);
    } catch (const BatchStopped&) {
      continue;
    }
    int64_t offset = 0;
    for (size_t k = 0; k < members.size(); ++k) {
      GenerateResult own = all;
      own.latents = all.latents.narrow(0, offset, sizes[k]);
      if (all.image.defined()) own.image = all.image.narrow(0, offset, sizes[k]);
      own.notes = request_notes[members[k]];
      results[members[k]] = std::move(own);
      offset += sizes[k];
    }
  }
  return results;
}

}  // namespace shardit::pipelines
