#include "shardit/models/step_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "shardit/core/dtype.h"
#include "shardit/io/json.h"

namespace shardit::models {

namespace {

constexpr const char* kFirstBlockCache = "first_block_cache";
constexpr const char* kTaylorSeerLite = "taylorseer_lite";
/// Bounds on the schedule's numbers: far above any real schedule (a generation has at most
/// pipelines::kMaxInferenceSteps steps), low enough that no step arithmetic overflows.
constexpr int64_t kMaxCacheStep = 1'000'000;
/// first_block_cache's largest threshold: far above any use (a relative change of 1 already skips
/// every step after the first).
constexpr double kMaxThreshold = 1e6;
/// Divided differences beyond this order only amplify noise (diffusers' examples use 1 or 2).
constexpr int64_t kMaxTaylorOrder = 8;

std::string key_list(const std::string& kind) {
  return kind == kFirstBlockCache
             ? "threshold"
             : "cache_interval, disable_cache_before_step, disable_cache_after_step, max_order, taylor_factors_dtype";
}

/// A whole number in [low, high] (0 <= low <= high), as JSON stores it (signed or unsigned).
int64_t integer_value(const std::string& kind, const std::string& key, const nlohmann::json& value, int64_t low,
                      int64_t high) {
  const bool in_range =
      value.is_number_unsigned()
          ? value.get<uint64_t>() >= static_cast<uint64_t>(low) && value.get<uint64_t>() <= static_cast<uint64_t>(high)
          : value.is_number_integer() && value.get<int64_t>() >= low && value.get<int64_t>() <= high;
  TORCH_CHECK(in_range, "step cache ", kind, ": ", key, " is ", io::brief(value),
              ", but it takes a whole number from ", low, " to ", high);
  return value.get<int64_t>();
}

const char* factors_dtype_name(at::ScalarType dtype) { return dtype == at::kFloat ? "float32" : "bfloat16"; }

/// A value of "KIND:key=value": a JSON number, or a bare name ("float32", "none") as a string.
nlohmann::json spec_value(const std::string& text) {
  const nlohmann::json number = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (number.is_number()) return number;
  return text;
}

}  // namespace

std::string StepCacheConfig::kind() const {
  return std::holds_alternative<FirstBlockCacheConfig>(method) ? kFirstBlockCache : kTaylorSeerLite;
}

nlohmann::json StepCacheConfig::to_json() const {
  nlohmann::json object = {{"kind", kind()}};
  if (const auto* fbc = std::get_if<FirstBlockCacheConfig>(&method)) {
    object["threshold"] = fbc->threshold;
    return object;
  }
  const auto& ts = std::get<TaylorSeerCacheConfig>(method);
  object["cache_interval"] = ts.cache_interval;
  object["disable_cache_before_step"] = ts.disable_cache_before_step;
  if (ts.disable_cache_after_step) object["disable_cache_after_step"] = *ts.disable_cache_after_step;
  object["max_order"] = ts.max_order;
  object["taylor_factors_dtype"] = factors_dtype_name(ts.taylor_factors_dtype);
  return object;
}

std::string StepCacheConfig::to_string() const {
  std::string text = kind();
  char separator = ':';
  const nlohmann::json object = to_json();  // named: the loop's range must not outlive a temporary
  for (const auto& [key, value] : object.items()) {
    if (key == "kind") continue;
    text += separator + key + "=" + (value.is_string() ? value.get<std::string>() : value.dump());
    separator = ',';
  }
  return text;
}

StepCacheConfig StepCacheConfig::parse(const std::string& spec) {
  const size_t colon = spec.find(':');
  nlohmann::json object = {{"kind", spec.substr(0, colon)}};
  if (colon != std::string::npos) {
    const std::string rest = spec.substr(colon + 1);
    size_t start = 0;
    while (start <= rest.size()) {
      const size_t comma = std::min(rest.find(',', start), rest.size());
      const std::string item = rest.substr(start, comma - start);
      const size_t equals = item.find('=');
      TORCH_CHECK(equals != std::string::npos && equals > 0, "--cache ", io::brief(spec), ": ", io::brief(item),
                  " is not key=value; write KIND:key=value,key=value (e.g. first_block_cache:threshold=0.12)");
      const std::string key = item.substr(0, equals);
      TORCH_CHECK(!object.contains(key), "--cache ", io::brief(spec), ": ", io::brief(key), " is given twice");
      object[key] = spec_value(item.substr(equals + 1));
      start = comma + 1;
    }
  }
  return from_json(object);
}

StepCacheConfig StepCacheConfig::from_json(const nlohmann::json& object) {
  TORCH_CHECK(object.is_object() && object.contains("kind") && object.at("kind").is_string(),
              "a step cache config is an object with \"kind\" (", kFirstBlockCache, " or ", kTaylorSeerLite,
              ") and its keys; got ", io::brief(object));
  const std::string kind = object.at("kind").get<std::string>();
  TORCH_CHECK(kind == kFirstBlockCache || kind == kTaylorSeerLite, "step cache kind ", io::brief(kind),
              " is unknown; the kinds are ", kFirstBlockCache, " (threshold) and ", kTaylorSeerLite,
              " (cache_interval, disable_cache_before_step, ...)");
  StepCacheConfig config;
  if (kind == kFirstBlockCache) {
    FirstBlockCacheConfig fbc;
    for (const auto& [key, value] : object.items()) {
      if (key == "kind") continue;
      TORCH_CHECK(key == "threshold", "step cache ", kind, ": unknown key ", io::brief(key), "; it takes ",
                  key_list(kind));
      TORCH_CHECK(value.is_number() && std::isfinite(value.get<double>()) && value.get<double>() >= 0 &&
                      value.get<double>() <= kMaxThreshold,
                  "step cache ", kind, ": threshold is ", io::brief(value), ", but it takes a number from 0 (never "
                  "skip) to ", static_cast<int64_t>(kMaxThreshold), " (0.05 to 0.2 are usual)");
      fbc.threshold = value.get<double>();
    }
    config.method = fbc;
    return config;
  }
  TaylorSeerCacheConfig ts;
  for (const auto& [key, value] : object.items()) {
    if (key == "kind") continue;
    if (key == "cache_interval") {
      ts.cache_interval = integer_value(kind, key, value, 1, kMaxCacheStep);
    } else if (key == "disable_cache_before_step") {
      ts.disable_cache_before_step = integer_value(kind, key, value, 0, kMaxCacheStep);
    } else if (key == "disable_cache_after_step") {
      if (value.is_null() || value == "none" || value == "None") continue;
      ts.disable_cache_after_step = integer_value(kind, key, value, 0, kMaxCacheStep);
    } else if (key == "max_order") {
      ts.max_order = integer_value(kind, key, value, 0, kMaxTaylorOrder);
    } else if (key == "taylor_factors_dtype") {
      const std::string name = value.is_string() ? value.get<std::string>() : value.dump();
      const std::string bare = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
      TORCH_CHECK(bare == "float32" || bare == "bfloat16", "step cache ", kind, ": taylor_factors_dtype is ",
                  io::brief(name), ", but it takes float32 or bfloat16");
      ts.taylor_factors_dtype = parse_compute_dtype(bare);
    } else {
      TORCH_CHECK(false, "step cache ", kind, ": unknown key ", io::brief(key), "; it takes ", key_list(kind));
    }
  }
  // diffusers computes forward s when (s - before - 1) mod interval == 0 (Python's modulo): with
  // before = 0 the first forward would be predicted from nothing unless every forward computes.
  TORCH_CHECK(ts.disable_cache_before_step > 0 || ts.cache_interval == 1, "step cache ", kind,
              ": disable_cache_before_step 0 with cache_interval ", ts.cache_interval,
              " would predict the first step before any was computed; give disable_cache_before_step >= 1");
  config.method = ts;
  return config;
}

void StepCache::reset() {
  states_.clear();
  order_.clear();
  context_ = "cond";
}

void StepCache::set_context(const std::string& name) {
  TORCH_CHECK(!name.empty(), "a step cache context needs a name");
  context_ = name;
}

StepCache::ContextState& StepCache::state() {
  auto found = states_.find(context_);
  if (found != states_.end()) return found->second;
  order_.push_back(context_);
  ContextState& created = states_[context_];
  created.record.context = context_;
  return created;
}

const StepCache::ContextState& StepCache::state() const {
  auto found = states_.find(context_);
  TORCH_INTERNAL_ASSERT(found != states_.end(), "step cache context ", context_, " used before begin_forward");
  return found->second;
}

bool StepCache::taylor_computes(int64_t step) const {
  const auto& ts = std::get<TaylorSeerCacheConfig>(config_.method);
  if (step < ts.disable_cache_before_step) return true;
  if (ts.disable_cache_after_step && step >= *ts.disable_cache_after_step) return true;
  // (step - before - 1) mod interval == 0, with step >= before here: the left side is >= -1, and
  // -1 mod interval is interval - 1 (Python's modulo), 0 only for an interval of 1.
  const int64_t offset = step - ts.disable_cache_before_step - 1;
  return offset < 0 ? ts.cache_interval == 1 : offset % ts.cache_interval == 0;
}

std::optional<at::Tensor> StepCache::begin_forward(int64_t batch, int64_t tokens) {
  ContextState& s = state();
  if (!taylorseer()) return std::nullopt;
  ++s.step;
  const bool computes = taylor_computes(s.step);
  s.record.computed.push_back(computes);
  if (computes) return std::nullopt;
  TORCH_INTERNAL_ASSERT(s.last_update_step.has_value() && !s.factors.empty(),
                        "TaylorSeer predicts before any computed step (from_json refuses such schedules)");
  const at::Tensor& f0 = s.factors.front();
  TORCH_CHECK(f0.size(0) == batch && f0.size(1) == tokens, "step cache ", config_.to_string(), ", context ",
              context_, ": this forward has ", batch, " x ", tokens,
              " image tokens, but the cached output is for ", f0.size(0), " x ", f0.size(1),
              "; a step cache serves one generation: reset it between generations of other sizes");
  const int64_t offset = s.step - *s.last_update_step;
  // sum_k Fk * offset^k / k!, in the output's dtype, as diffusers sums it (from zero, in order).
  at::Tensor output = at::zeros_like(f0, f0.options().dtype(s.output_dtype));
  double factorial = 1;
  for (size_t order = 0; order < s.factors.size(); ++order) {
    if (order > 0) factorial *= static_cast<double>(order);
    const double coefficient = std::pow(static_cast<double>(offset), static_cast<double>(order)) / factorial;
    output = output + s.factors[order].to(s.output_dtype) * coefficient;
  }
  return output;
}

at::Tensor StepCache::head_residual_sums(const at::Tensor& residual) const {
  const ContextState& s = state();
  if (!s.head_residual.defined()) return {};
  TORCH_CHECK(s.head_residual.sizes() == residual.sizes(), "step cache ", config_.to_string(), ", context ", context_,
              ": the head block's residual has shape ", residual.sizes(), " but the cached one ",
              s.head_residual.sizes(), "; a step cache serves one generation: reset it between generations of "
              "other sizes");
  // [B, N, D] -> [N] each, summed in float64 so that the sum over the sequence does not depend on
  // how the tokens are split over ranks beyond float64 rounding.
  const at::Tensor change = (residual - s.head_residual).abs().to(at::kDouble).sum(std::vector<int64_t>{0, 2});
  const at::Tensor previous = s.head_residual.abs().to(at::kDouble).sum(std::vector<int64_t>{0, 2});
  return at::stack({change, previous});  // [2, N]
}

bool StepCache::head_decides(const at::Tensor& abs_sums, const at::Tensor& residual, at::Tensor& hidden_states) {
  ContextState& s = state();
  const double threshold = std::get<FirstBlockCacheConfig>(config_.method).threshold;
  double ratio = std::numeric_limits<double>::quiet_NaN();
  bool computes = true;
  if (abs_sums.defined()) {
    // Both means are over the same number of values: their ratio is the ratio of the sums.
    const at::Tensor sums = abs_sums.to(at::kCPU);
    ratio = sums[0].item<double>() / sums[1].item<double>();
    computes = !(ratio <= threshold);  // NaN (a zero r_prev) computes
  }
  s.record.computed.push_back(computes);
  s.record.ratios.push_back(ratio);
  if (computes) {
    s.head_residual = residual;
    s.head_output = hidden_states;
    return true;
  }
  TORCH_INTERNAL_ASSERT(s.tail_residual.defined(), "First-Block Cache skipped before any full stack ran");
  hidden_states = hidden_states + s.tail_residual;
  return false;
}

void StepCache::end_of_stack(const at::Tensor& hidden_states) {
  ContextState& s = state();
  TORCH_INTERNAL_ASSERT(s.head_output.defined(), "end_of_stack without a head block that ran");
  s.tail_residual = hidden_states - s.head_output;
  s.head_output = at::Tensor();
}

void StepCache::computed_output(const at::Tensor& output) {
  ContextState& s = state();
  const auto& ts = std::get<TaylorSeerCacheConfig>(config_.method);
  // diffusers' TaylorSeerState.update: differences in the output's dtype, stored in the factors'.
  std::vector<at::Tensor> factors = {output};
  if (s.last_update_step) {
    const int64_t delta = s.step - *s.last_update_step;
    TORCH_INTERNAL_ASSERT(delta > 0, "TaylorSeer update without a step in between");
    for (int64_t j = 0; j < ts.max_order && static_cast<size_t>(j) < s.factors.size(); ++j) {
      factors.push_back((factors[static_cast<size_t>(j)] - s.factors[static_cast<size_t>(j)].to(output.scalar_type())) /
                        delta);
    }
  }
  for (at::Tensor& factor : factors) {
    // A copy even where the dtype is the same: the output goes on to the caller, who may change it.
    factor = factor.to(ts.taylor_factors_dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  s.factors = std::move(factors);
  s.output_dtype = output.scalar_type();
  s.last_update_step = s.step;
}

std::vector<CacheContextRecord> StepCache::records() const {
  std::vector<CacheContextRecord> records;
  for (const std::string& name : order_) records.push_back(states_.at(name).record);
  return records;
}

int64_t StepCache::state_bytes() const {
  int64_t bytes = 0;
  const auto add = [&bytes](const at::Tensor& t) {
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& [name, s] : states_) {
    add(s.head_residual);
    add(s.head_output);
    add(s.tail_residual);
    for (const at::Tensor& factor : s.factors) add(factor);
  }
  return bytes;
}

}  // namespace shardit::models
