#pragma once
// The attention backend registry behind nn::scaled_dot_product_attention (and so behind
// nn::attention and nn::joint_attention). Each backend registers with its constraints (devices,
// dtypes, masks, log-sum-exp output); a call goes to the backend selected by name, or with "auto"
// to the first backend of the device's preference list that accepts the call. A backend selected
// by name that cannot honour a call refuses it with a message instead of computing something else.
//
// Built in: "math" (the reference: scores materialised per head group, softmax in fp32),
// "memory_efficient" (key/value blocks streamed with an online softmax, memory linear in the
// sequence, any device), "amx" and "avx512_bf16" (bf16 in one kernel, its products on AMX tiles
// or on AVX512-BF16 pair dot products, CPUs with them; nn/attention/bf16_kernels.h) and "sdpa" (LibTorch's fused at::scaled_dot_product_attention, only where the linked
// LibTorch has it: 2.0 and later).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace shardit::nn {

/// The "math" backend's bound on the fp32 scores of one group of heads. Scores for every head at
/// once take B * H * S_q * S_kv floats: 2 GiB for FLUX.1 at 1024x1024 (24 heads, 4608 tokens),
/// 27 GiB at 2048x2048; the reference processes heads in groups whose scores stay under this
/// budget (at least one head), each group still one large batched matmul.
constexpr int64_t kMathScoresBudgetBytes = int64_t{256} << 20;

/// One attention call as a backend sees it: q [B, H, S_q, D], k and v [B, H, S_kv, D], mask
/// (optional) broadcastable to [B, H, S_q, S_kv] (bool, true = attend; or additive), softmax scale.
struct AttentionCall {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const std::optional<at::Tensor>& mask;
  double scale;
};

/// A registered backend and its constraints.
struct AttentionBackend {
  std::string name;
  std::string description;
  /// Devices it runs on (empty: every device).
  std::vector<c10::DeviceType> devices;
  /// Input dtypes it accepts (empty: every floating dtype).
  std::vector<at::ScalarType> dtypes;
  bool supports_mask = true;
  /// Whether it can also return the log-sum-exp of each query (what context parallelism merges).
  bool returns_lse = false;
  /// Further conditions: "" when it can run the call, otherwise the reason it cannot (optional).
  std::function<std::string(const AttentionCall&)> refuses;
  /// [B, H, S_q, D] in q's dtype.
  std::function<at::Tensor(const AttentionCall&)> run;
};

/// Adds (or replaces) a backend under its name.
void register_attention_backend(AttentionBackend backend);

/// The names of the registered backends, sorted.
std::vector<std::string> attention_backend_names();

/// The backend registered as `name`; an error listing the registered ones otherwise.
const AttentionBackend& attention_backend(const std::string& name);

/// "" when `backend` can run `call`, otherwise why not (device, dtype, mask or its own condition).
std::string attention_backend_refusal(const AttentionBackend& backend, const AttentionCall& call);

/// The preference list that "auto" walks on `device`: on CPU amx, avx512_bf16, memory_efficient,
/// then math; on accelerators sdpa (where built), memory_efficient, math. On CPU amx takes the bf16
/// calls where the CPU has AMX (1.9x memory_efficient's speed on FLUX's heads), avx512_bf16 where it
/// has AVX512-BF16 without AMX (AMD's Zen 4: see docs/benchmarks.md), and memory_efficient is faster
/// than math: it keeps one head's block of scores in cache, where math's batched scores go through
/// main memory (docs/benchmarks.md).
std::vector<std::string> default_attention_backends(c10::DeviceType device);

/// Selects the backend for every following call: "auto" or a registered name (checked here, so a
/// bad --attention-backend fails before any model is loaded). The start value is "auto", or
/// SHARDIT_ATTENTION_BACKEND from the environment.
void set_attention_backend(const std::string& name);
/// The current selection ("auto" or a name).
std::string attention_backend_selection();

/// Sets a selection for the lifetime of the guard and restores the previous one after.
class AttentionBackendGuard {
 public:
  explicit AttentionBackendGuard(const std::string& name);
  ~AttentionBackendGuard();
  AttentionBackendGuard(const AttentionBackendGuard&) = delete;
  AttentionBackendGuard& operator=(const AttentionBackendGuard&) = delete;

 private:
  std::string previous_;
};

/// The backend that runs `call` under the current selection: the selected one (an error naming
/// why when it cannot), or under "auto" the first of the device's preference list that accepts it
/// (an error with each one's reason when none does).
const AttentionBackend& attention_backend_for(const AttentionCall& call);

/// The backend that a plain call in `dtype` on the CPU (FLUX's head size 128, no mask) goes to under
/// the current selection: what start-up lines, `shardit version` and the bench report.
std::string cpu_attention_backend(at::ScalarType dtype);

/// Runs `call` on the selected backend and counts the dispatch.
at::Tensor dispatch_attention(const AttentionCall& call);

/// Calls that each backend ran since the last reset, by name.
std::map<std::string, int64_t> attention_dispatch_counts();
void reset_attention_dispatch_counts();

/// The reference path: softmax(q k^T * scale + mask) v with the scores materialised (in head
/// groups under a fixed budget) and the softmax in fp32.
at::Tensor math_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale);

}  // namespace shardit::nn
