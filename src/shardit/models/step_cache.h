#pragma once
// Step caching for the joint-stream transformers: skipping transformer work between denoising
// steps, with diffusers' rules (hooks/first_block_cache.py, hooks/taylorseer_cache.py) and their
// config names.
//
// First-Block Cache: every forward runs the stack's head block (transformer_blocks.0). Its
// image-stream residual r = output - input is compared with r_prev, the r of the context's last
// forward that ran the whole stack: ratio = mean|r - r_prev| / mean|r_prev|. The rest of the
// stack runs when there is no r_prev or ratio > threshold; it then keeps r as r_prev and the tail
// residual (the stack's last image output - the head's image output). Otherwise the rest is
// skipped and the image stream is the head's output + that tail residual.
//
// TaylorSeer, lite: a forward computes by its index s in the context (s < disable_cache_before_step,
// or (s - before - 1) mod cache_interval == 0, or s >= disable_cache_after_step). A computed
// forward's output F updates divided differences F0 = F, F(k+1) = (Fk - Fk_prev) / (steps since
// the last computed forward), up to max_order; any other forward returns sum_k Fk * off^k / k!
// (off = steps since the last computed forward) and runs no block.
//
// Each state belongs to a cache context (diffusers' transformer.cache_context): the pipelines
// run the conditional and unconditional CFG branches in the contexts "cond" and "uncond", which
// decide separately. The decisions never depend on how the ranks are laid out: the means are
// reduced over the whole sequence as float64 sums (StepCache::head_decides takes them already
// summed), and every rank of one forward takes the same decision (JointTransformer2DModel does the
// reductions).
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace shardit::models {

/// diffusers' FirstBlockCacheConfig.
struct FirstBlockCacheConfig {
  /// The rest of the stack runs when the head's residual changed by more than this (relative
  /// mean absolute difference); 0 never skips.
  double threshold = 0.05;
};

/// diffusers' TaylorSeerCacheConfig with use_lite_mode=True.
struct TaylorSeerCacheConfig {
  int64_t cache_interval = 5;             ///< a computed forward every this many
  int64_t disable_cache_before_step = 3;  ///< forwards 0 .. before-1 all compute
  std::optional<int64_t> disable_cache_after_step;  ///< forwards from this one on all compute
  int64_t max_order = 1;                  ///< highest divided difference kept (0: reuse the output)
  /// The factors' dtype. diffusers' default is bfloat16; float32 here, so that a prediction is
  /// not rounded to 8 bits of mantissa (the factors are [B, N, C] per context: small).
  at::ScalarType taylor_factors_dtype = at::kFloat;
};

/// What to cache: `--cache KIND:key=value,...` on the command line, {"kind": KIND, key: value, ...}
/// in a request. Kinds: first_block_cache (threshold), taylorseer_lite (cache_interval,
/// disable_cache_before_step, disable_cache_after_step, max_order, taylor_factors_dtype).
struct StepCacheConfig {
  std::variant<FirstBlockCacheConfig, TaylorSeerCacheConfig> method;

  /// "first_block_cache" or "taylorseer_lite".
  std::string kind() const;
  /// As parse() reads it, every key given: "first_block_cache:threshold=0.12".
  std::string to_string() const;
  nlohmann::json to_json() const;
  /// From "KIND" or "KIND:key=value,key=value" (diffusers' names; values are JSON numbers or
  /// names). Errors name the key and say what it takes.
  static StepCacheConfig parse(const std::string& spec);
  /// From {"kind": KIND, key: value, ...}. Every value is checked: unknown keys, wrong types,
  /// non-finite or out-of-range numbers, and a TaylorSeer schedule whose first forward would be
  /// predicted from nothing are refused.
  static StepCacheConfig from_json(const nlohmann::json& object);
};

/// What a step cache decided in one context, one entry per forward in order.
struct CacheContextRecord {
  std::string context;
  std::vector<bool> computed;  ///< whether the forward ran the whole stack
  /// First-Block Cache: the ratio compared (NaN where there was no r_prev); empty for TaylorSeer.
  std::vector<double> ratios;
};

/// The state of a step cache over one generation, per context. Used by JointTransformer2DModel's
/// forward; the pipeline selects the context and reads the record.
class StepCache {
 public:
  explicit StepCache(StepCacheConfig config) : config_(std::move(config)) {}

  const StepCacheConfig& config() const { return config_; }
  bool first_block() const { return std::holds_alternative<FirstBlockCacheConfig>(config_.method); }
  bool taylorseer() const { return std::holds_alternative<TaylorSeerCacheConfig>(config_.method); }

  /// Forgets every context's state and record: a new generation starts.
  void reset();
  /// The context the next forwards belong to (diffusers' cache_context); "cond" until set.
  void set_context(const std::string& name);
  const std::string& context() const { return context_; }

  /// At the start of a forward of `batch` x `tokens` image tokens. TaylorSeer: counts the forward
  /// and returns the predicted output when it does not compute (the caller runs nothing else).
  /// nullopt: the forward runs.
  std::optional<at::Tensor> begin_forward(int64_t batch, int64_t tokens);

  /// First-Block Cache, after the head block: `abs_sums` = {sum|r - r_prev|, sum|r_prev|} over the
  /// whole sequence and batch (float64 [2], the same on every rank of the forward; see
  /// head_residual_sums). Whether the rest of the stack runs. When it does, `residual` (this
  /// rank's r) and `head_output` are kept; when it does not, `hidden_states` (the head's image
  /// output) gets the tail residual added.
  bool head_decides(const at::Tensor& abs_sums, const at::Tensor& residual, at::Tensor& hidden_states);
  /// First-Block Cache: this rank's {|r - r_prev|, |r_prev|} summed per token over batch and
  /// channels (float64 [2, tokens]), for the caller to sum over the sequence; undefined when the
  /// context has no r_prev yet (the stack runs).
  at::Tensor head_residual_sums(const at::Tensor& residual) const;
  /// First-Block Cache, at the end of a stack that ran: keeps the tail residual (`hidden_states`,
  /// the last block's image output, minus the head's).
  void end_of_stack(const at::Tensor& hidden_states);
  /// TaylorSeer, after a computed forward: updates the factors from its output.
  void computed_output(const at::Tensor& output);

  /// Every context's decisions so far, in the order the contexts were first used.
  std::vector<CacheContextRecord> records() const;
  /// Bytes the cache holds now (residuals, factors), over all contexts.
  int64_t state_bytes() const;

 private:
  struct ContextState {
    CacheContextRecord record;
    // First-Block Cache
    at::Tensor head_residual;  ///< r of the last computed forward, this rank's tokens
    at::Tensor head_output;    ///< the head's image output in the forward now running the stack
    at::Tensor tail_residual;  ///< the last computed forward's stack output - head output
    // TaylorSeer
    int64_t step = -1;
    std::optional<int64_t> last_update_step;
    std::vector<at::Tensor> factors;
    at::ScalarType output_dtype = at::kFloat;
  };
  ContextState& state();
  const ContextState& state() const;
  bool taylor_computes(int64_t step) const;

  StepCacheConfig config_;
  std::string context_ = "cond";
  std::map<std::string, ContextState> states_;
  std::vector<std::string> order_;  ///< contexts in order of first use
};

}  // namespace shardit::models
